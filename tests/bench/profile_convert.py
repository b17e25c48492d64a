"""Profiling probe for the CUDA converter kernel (run under ncu; not a benchmark table).

``ncu --clock-control none -k regex:quantize_rows -c 1 --section SpeedOfLight ...
python -m tests.bench.profile_convert`` quantizes one Qwen3-30B-A3B gate/up stack once
after a warm-up call, so the profiler sees exactly one steady-state launch.
"""

from __future__ import annotations

import sys

import torch

from libalign import ops
from libalign.spec import PRESETS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preset = argv[0] if argv else "minite"
    x = torch.randn((128, 1536, 2048), device="cuda", dtype=torch.bfloat16)
    ops.quantize(x[:2], PRESETS[preset])  # build, load, warm up (a different launch shape)
    torch.cuda.synchronize()
    ops.quantize(x, PRESETS[preset])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
