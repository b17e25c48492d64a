"""MXFP4 quantize throughput: the compiled kernels behind ``libalign.kernels`` against the spec
and torchao's ``to_mx``, all measured in this run on the same inputs.

Workloads (BF16, seeded standard-normal data): one Qwen3-30B-A3B MoE layer's expert
matrices, ``--experts`` experts of 1536x2048 (gate/up) and of 2048x768 (down), under
``mxfp4`` (torchao's FLOOR rule) and ``mxfp4_te`` (TE's rule; torchao's RCEIL); and the
KV-cache write of ``--tokens`` tokens of 4 KV heads of 128 (K and V rows) under
``kv_mxfp4``. Rows:

* ``spec``: :func:`libalign.spec.quantize`, the baseline of ``vs spec``;
* ``kernel <path>``: :func:`libalign.kernels.quantize` (``backend='kernel'``) on each CPU
  instruction-set path this CPU has (forced as ``ALIGN_CPU_KERNEL`` does), or ``kernel
  cuda`` on a GPU;
* ``torchao to_mx``: ``torchao.prototype.mx_formats.mx_tensor.to_mx`` in the matching
  scale mode, when torchao imports, the baseline of ``vs torchao``.

Each figure is the best of ``--repeats`` wall times, round-robin over the rows after one
untimed warm-up call each. GB/s = (BF16 bytes in + codes + scale bytes out) / seconds;
``vs spec`` / ``vs torchao`` are the baseline's seconds over the row's (above 1 = faster).
``bits`` says whether the row's codes and scale bytes equal the spec's on the timed input
(torchao's RCEIL equals ``mxfp4_te`` on BF16 input; see tests/libalign/test_mxfp4.py).
``torch.set_num_threads`` is ``--threads`` (default 1, steadier on a shared host; the CPU
kernel splits rows over that many threads too).

Run: ``python -m tests.bench mxfp4 [-- --quick --device cuda --out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from libalign.kernels import ops
from libalign.spec import PRESETS, quantize

from .measure import Col, sync
from .measure import print_table as measure_table

SCALE_MODES = {"mxfp4": "FLOOR", "kv_mxfp4": "FLOOR", "mxfp4_te": "RCEIL"}
KV_HEADS, HEAD_DIM = 4, 128


@dataclass
class Row:
    """One timed quantizer on one workload."""

    workload: str
    preset: str
    name: str
    seconds: float
    gbps: float
    bits: str
    vs_spec: float | None = None
    vs_torchao: float | None = None


def workloads(experts: int, tokens: int, device: str) -> list[tuple[str, str, list[torch.Tensor]]]:
    """(name, preset, tensors) of the timed calls."""
    g = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)

    gate_up, down = make(experts, 1536, 2048), make(experts, 2048, 768)
    kv = [make(tokens * KV_HEADS, HEAD_DIM), make(tokens * KV_HEADS, HEAD_DIM)]
    layer = f"{experts}x(1536x2048 + 2048x768)"
    return [(layer, "mxfp4", [gate_up, down]), (layer, "mxfp4_te", [gate_up, down]),
            (f"KV write {tokens} tok x {KV_HEADS}x{HEAD_DIM} K+V", "kv_mxfp4", kv)]


def _torchao_to_mx(preset: str) -> Callable | None:
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # torchao missing or without mx_formats: no torchao row
        return None
    mode = getattr(ScaleCalculationMode, SCALE_MODES[preset])

    def run(x: torch.Tensor):
        scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode)
        return data.view(torch.uint8), scale.view(torch.uint8)

    return run


def quantizers(preset: str, device: str) -> dict[str, Callable[[torch.Tensor], tuple]]:
    """name -> fn(x) returning (codes, scale bytes); the CPU kernel rows force their path."""
    spec = PRESETS[preset]

    def spec_run(x):
        q = quantize(x, spec)
        return q.codes, q.block_scales.view(torch.uint8)

    def kernel_run(path):
        def run(x):
            if path is not None:
                ops.set_cpu_kernel_path(path)
            q = ops.quantize(x, spec, backend="kernel")
            return q.codes, q.block_scales.view(torch.uint8)
        return run

    rows: dict[str, Callable] = {"spec": spec_run}
    if device == "cpu":
        for path in ops.cpu_kernel_paths():
            rows[f"kernel {path}"] = kernel_run(path)
    else:
        rows["kernel cuda"] = kernel_run(None)
    to_mx = _torchao_to_mx(preset)
    if to_mx is not None:
        rows["torchao to_mx"] = to_mx
    return rows


def measure(workload: str, preset: str, xs: list[torch.Tensor], device: str,
            repeats: int) -> list[Row]:
    """Best-of-``repeats`` seconds of each quantizer over the tensors ``xs``."""
    runs = quantizers(preset, device)
    ref = [quantize(x, PRESETS[preset]) for x in xs]
    same, best, out_bytes = {}, {}, {}
    try:
        for name, fn in runs.items():  # warm-up (and the kernel build), bit check
            got = [fn(x) for x in xs]
            same[name] = all(torch.equal(c.cpu(), r.codes.cpu()) and
                             torch.equal(s.cpu(), r.block_scales.view(torch.uint8).cpu())
                             for (c, s), r in zip(got, ref, strict=True))
            out_bytes[name] = sum(c.numel() + s.numel() for c, s in got)
            best[name] = float("inf")
        for _ in range(repeats):
            for name, fn in runs.items():
                sync(device)
                t0 = time.perf_counter()
                for x in xs:
                    fn(x)
                sync(device)
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        if device == "cpu":
            ops.set_cpu_kernel_path(None)
    in_bytes = sum(x.numel() * x.element_size() for x in xs)
    rows = []
    for name, sec in best.items():
        rows.append(Row(workload, preset, name, sec, (in_bytes + out_bytes[name]) / sec / 1e9,
                        "equal" if same[name] else "differ",
                        best["spec"] / sec,
                        best["torchao to_mx"] / sec if "torchao to_mx" in best else None))
    return rows


def _times(key: str) -> Callable[[dict], str]:
    return lambda row: "-" if row[key] is None else f"{row[key]:.2f}x"


def print_table(rows: list[Row], device: str, threads: int) -> None:
    print(f"MXFP4 quantize on {device} (torch threads {threads}; best of repeats, seconds "
          f"for the whole workload)")
    measure_table([Col("workload", "<36", "workload"), Col("preset", "<9", "preset"),
                   Col("quantizer", "<15", "name"), Col("ms", ">9.2f", lambda r: r["seconds"] * 1e3),
                   Col("GB/s", ">7.2f", "gbps"), Col("vs spec", ">8", _times("vs_spec")),
                   Col("vs torchao", ">10", _times("vs_torchao")), Col("bits", ">6", "bits")],
                  [asdict(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.bench mxfp4``; non-zero when a kernel's bits differ."""
    ap = argparse.ArgumentParser(prog="bench_mxfp4", description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads, used by the spec, torchao and the CPU kernel alike "
                    "(1: steadier on a shared host)")
    ap.add_argument("--quick", action="store_true", help="1 expert, 256 tokens, 2 repeats")
    ap.add_argument("--out", type=Path, default=None, help="write bench_mxfp4.json here")
    args = ap.parse_args(argv)
    if args.quick:
        args.experts, args.tokens, args.repeats = 1, 256, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [r for name, preset, xs in workloads(args.experts, args.tokens, args.device)
            for r in measure(name, preset, xs, args.device, args.repeats)]
    print_table(rows, args.device, torch.get_num_threads())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_mxfp4.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return int(any(r.bits != "equal" for r in rows if r.name.startswith("kernel")))
