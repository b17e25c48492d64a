"""Profiling probe for the CUDA converter kernel (run under ncu; not a benchmark table).

``ncu --clock-control none -k regex:quantize_rows --launch-skip 2 -c 2 --section
SpeedOfLight ... python -m tests.bench.profile_convert`` quantizes one Qwen3-30B-A3B layer's
gate/up and down stacks once each after a warm-up call on each shape, so the profiler sees
exactly one steady-state launch of each.
"""

from __future__ import annotations

import sys

import torch

from libalign import ops
from libalign.spec import PRESETS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preset = argv[0] if argv else "minite"
    stacks = [torch.randn((128, m, k), device="cuda", dtype=torch.bfloat16)
              for m, k in ((1536, 2048), (2048, 768))]
    for x in stacks:  # build, load, warm up (smaller launches of the same kernels)
        ops.quantize(x[:2], PRESETS[preset])
    torch.cuda.synchronize()
    for x in stacks:
        ops.quantize(x, PRESETS[preset])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
