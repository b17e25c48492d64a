"""Probe: the refit producer's host time per quantized weight, stacked runs against one launch
per weight, same run.

:func:`alignd.sync.fill.filled_buckets` under ``minite`` over a trainer's per-expert 2-D
weights (``--layers`` layers of 128 experts x gate/up/down, each ``--rows`` x ``--cols``, small
by default so the quantize kernels' own time is negligible and what is left is host work),
once with runs of same-shape weights quantized as one stack (the default) and once with every
weight quantized on its own (``RUN_BYTES = 0``), alternating, median of ``--repeats``. Both
produce the same bits (checked). ``--views``: the experts are views of one stacked tensor per
projection (the stack is viewed, not copied).

Run: ``python -m tests.bench.probe_fill_host [--device cuda] [--rows 64 --cols 64]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from alignd.sync import fill


def _named(layers: int, rows: int, cols: int, views: bool, device: str):
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in range(layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stack = torch.randn(128, rows, cols, generator=g).to(device, torch.bfloat16)
            for e in range(128):
                x = stack[e] if views else stack[e].clone()
                out.append((f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", x))
    return out


def _run(named, device: str) -> tuple[float, dict]:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    got = {}
    for bucket, _ in fill.filled_buckets(named, "minite", bucket_bytes=512 << 20):
        got.update(bucket.tensors())
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--views", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="then print a cProfile of one stacked run (where its host time goes) "
                        "and the device's kernel time in it")
    args = p.parse_args(argv)
    named = _named(args.layers, args.rows, args.cols, args.views, args.device)
    stacked_limit = fill.RUN_BYTES
    times: dict[str, list[float]] = {"stacked": [], "one launch a weight": []}
    bits = {}
    for i in range(args.repeats + 1):
        for mode, limit in (("stacked", stacked_limit), ("one launch a weight", 0)):
            fill.RUN_BYTES = limit
            try:
                dt, got = _run(named, args.device)
            finally:
                fill.RUN_BYTES = stacked_limit
            if i:
                times[mode].append(dt)
            bits[mode] = got
    same = bits["stacked"].keys() == bits["one launch a weight"].keys() and all(
        torch.equal(bits["stacked"][k].view(torch.uint8), bits["one launch a weight"][k]
                    .view(torch.uint8)) for k in bits["stacked"])
    n = len(named)
    base = statistics.median(times["one launch a weight"])
    print(f"filled_buckets on {args.device}: {n} weights of {args.rows}x{args.cols} "
          f"({'views of one stack' if args.views else 'separate tensors'}), median of "
          f"{args.repeats}; baseline: one launch a weight, this run")
    print(f"{'producer':22} {'ms':>8} {'us/weight':>10} {'vs baseline':>12}")
    for mode, ts in times.items():
        m = statistics.median(ts)
        print(f"{mode:22} {m * 1e3:8.1f} {m / n * 1e6:10.1f} {m / base:12.3f}")
    print(f"same bits: {same}")
    if args.profile and args.device == "cuda":
        _profile(named)


def _profile(named) -> None:
    """One stacked run: its cProfile (host time by function) and the profiler's kernel table."""
    from .measure import profiled

    profiled(lambda: _run(named, "cuda"), 1).sort_stats("tottime").print_stats(22)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(named, "cuda")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
