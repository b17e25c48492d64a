"""Probe of the CUDA converter kernels: each variant, each stack, kernel-only and end to end.

Not a table of the product (``python -m tests.bench convert`` is): a development probe
that, on one Qwen3-30B-A3B layer's two BF16 expert stacks, checks every CUDA quantize
kernel variant bit for bit against the spec, then prints per stack and variant the
kernel-only time (sum of the kernels' device durations, torch.profiler), the end-to-end
time a caller of ``quantize_many`` pays (CUDA events around the call, and wall clock),
and the device-to-device copy of the same bytes, in effective GB/s (read + write).
Run: ``python -m tests.bench.probe_convert_cuda [preset]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libalign.kernels import ops
from libalign.spec import PRESETS, quantize

SHAPES = ((1536, 2048), (2048, 768))


def out_bytes(q) -> int:
    n = q.codes.numel() + q.block_scales.numel()
    return n + (4 * q.outer_scale.numel() if q.outer_scale is not None else 0)


def bits_equal(q, ref) -> bool:
    same = torch.equal(q.codes, ref.codes) and torch.equal(
        q.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8))
    if ref.outer_scale is not None:
        same = same and torch.equal(q.outer_scale.view(torch.int32), ref.outer_scale.view(torch.int32))
    return same


def event_ms(fn, reps: int) -> tuple[float, float]:
    """Median CUDA-event ms and median wall ms of fn() (each call synchronised at the end)."""
    ev, wall = [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        e.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        ev.append(s.elapsed_time(e))
    return statistics.median(ev), statistics.median(wall)


def kernel_ms(fn, reps: int) -> float:
    """Device time of the kernels fn() launches, per call (profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if "quantize_rows" in e.key
                or "amax_rows" in e.key)
    return total / reps / 1e3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preset = argv[0] if argv else "minite"
    spec = PRESETS[preset]
    gen = torch.Generator(device="cuda").manual_seed(0)
    stacks = [torch.randn((128, m, k), generator=gen, device="cuda").to(torch.bfloat16)
              for m, k in SHAPES]
    refs = [quantize(x, spec) for x in stacks]
    print(f"{'case':34} {'kernel ms':>10} {'GB/s':>7} {'e2e ev ms':>10} {'GB/s':>7} "
          f"{'wall ms':>8} {'vs copy':>8} bits")
    cases = [(f"K={x.shape[-1]}", [i]) for i, x in enumerate(stacks)] + [("layer (both)", [0, 1])]
    for label, idx in cases:
        xs = [stacks[i] for i in idx]
        bytes_in = sum(x.numel() * x.element_size() for x in xs)
        dst = [torch.empty_like(x) for x in xs]

        def copy(xs=xs, dst=dst):
            for d, x in zip(dst, xs, strict=True):
                d.copy_(x)

        copy()
        cms, _ = event_ms(copy, 20)
        copy_gbps = 2 * bytes_in / cms / 1e6
        print(f"{label + ' copy':34} {'':>10} {'':>7} {cms:10.3f} {copy_gbps:7.0f}")
        for variant in ("staged", "registers", "auto"):
            with ops.cuda_kernel_variant(variant):
                def run(xs=xs):
                    return ops.quantize_many(xs, spec)
                qs = run()
                torch.cuda.synchronize()
                ok = all(bits_equal(q, refs[i]) for q, i in zip(qs, idx, strict=True))
                moved = bytes_in + sum(out_bytes(q) for q in qs)
                kms = kernel_ms(run, 10)
                ems, wms = event_ms(run, 20)
            print(f"{label + ' ' + variant:34} {kms:10.3f} {moved / kms / 1e6:7.0f} {ems:10.3f} "
                  f"{moved / ems / 1e6:7.0f} {wms:8.3f} {moved / ems / 1e6 / copy_gbps:8.2f} {ok}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
