"""Probe of the CUDA converter kernels: each variant, each stack, kernel-only and end to end.

Not a table of the product (``python -m tests.bench convert`` is): a development probe
that, on one Qwen3-30B-A3B layer's two BF16 expert stacks, checks every CUDA quantize
kernel variant bit for bit against the spec, then prints per stack and variant the
kernel-only time (sum of the kernels' device durations, torch.profiler), the end-to-end
time a caller of ``quantize_many`` pays (CUDA events around the call, and wall clock),
and the device-to-device copy of the same bytes, in effective GB/s (read + write).

``--roofline`` adds, per stack, what this traffic can reach on the device without the
converter's arithmetic: Triton kernels that read the stack once and write nothing but a
value a row (``read``), and that read it and write the converter's output bytes (a byte a
pair of values and a byte a block of 16, from the values' top bits: ``twin``), each over a
few tile settings, the best kept, and PyTorch's row maximum of the same bytes (a read by a
tuned library kernel). All as device time against the copy's (CUDA graph replays), the
converter's kernels beside them. A twin well above the kernels says their code leaves
bandwidth unused; a twin near them says the traffic itself is the limit.
Run: ``python -m tests.bench.probe_convert_cuda [preset] [--roofline]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libalign.kernels import ops
from libalign.spec import PRESETS, quantize
from tests.bench.measure import graph_ms

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

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


if triton is not None:

    @triton.jit
    def _read_rows(x_ptr, out_ptr, n_rows, K: tl.constexpr, C: tl.constexpr,
                   ROWS: tl.constexpr):
        # every byte of ROWS rows read once, in K / C column pieces; one int32 a row written
        # (the rows' bitwise OR)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = r < n_rows
        base = x_ptr + r.to(tl.int64)[:, None] * K + tl.arange(0, C)[None, :]
        acc = tl.zeros((ROWS,), dtype=tl.int32)
        for c in tl.static_range(K // C):
            x = tl.load(base + c * C, mask=ok[:, None], other=0)
            acc |= tl.reduce_or(x.to(tl.int32) & 0xFFFF, 1)
        tl.store(out_ptr + r, acc, mask=ok)

    @triton.jit
    def _twin_rows(x_ptr, codes_ptr, scales_ptr, n_rows, K: tl.constexpr, C: tl.constexpr,
                   ROWS: tl.constexpr):
        # the converter's traffic: ROWS rows of K 16-bit values read once, in K / C column
        # pieces; K / 2 bytes a row (a byte a pair of values, from their top bits) and K / 16
        # bytes a row (a byte a block of 16, its largest magnitude's top byte) written
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = r < n_rows
        r64 = r.to(tl.int64)
        for c in tl.static_range(K // C):
            x = tl.load(x_ptr + r64[:, None] * K + c * C + tl.arange(0, C)[None, :],
                        mask=ok[:, None], other=0).to(tl.int32) & 0xFFFF
            lo, hi = tl.split(tl.reshape(x, (ROWS, C // 2, 2)))
            codes = ((lo >> 12) | ((hi >> 12) << 4)).to(tl.uint8)
            tl.store(codes_ptr + r64[:, None] * (K // 2) + c * (C // 2)
                     + tl.arange(0, C // 2)[None, :], codes, mask=ok[:, None])
            top = tl.max(tl.reshape(x & 0x7FFF, (ROWS, C // 16, 16)), 2)
            tl.store(scales_ptr + r64[:, None] * (K // 16) + c * (C // 16)
                     + tl.arange(0, C // 16)[None, :], (top >> 7).to(tl.uint8),
                     mask=ok[:, None])


#: (rows a program, warps) the roofline kernels try
ROOFLINE_TILES = ((4, 4), (8, 4), (8, 8), (16, 8))


def roofline(x: torch.Tensor) -> None:
    """Print the best read-only and twin bandwidth over :data:`ROOFLINE_TILES` for ``x``, as
    device time (CUDA graph replays, no host launch work) against the copy timed the same
    way, beside the converter's kernels (``quantize_many``, minite; their device time by the
    profiler: the call reads its error flags back, so it is not captured in a graph)."""
    k = x.shape[-1]
    rows = x.numel() // k
    flat = x.view(torch.int16).reshape(rows, k)
    acc = torch.empty(rows, dtype=torch.int32, device=x.device)
    codes = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((rows, k // 16), dtype=torch.uint8, device=x.device)
    bytes_in = x.numel() * x.element_size()
    piece = min(1024, k & -k)  # the largest power of two dividing K, at most 1024
    dst = torch.empty_like(x)
    copy_ms = graph_ms(lambda: dst.copy_(x), 20)
    copy_gbps = 2 * bytes_in / copy_ms / 1e6
    print(f"{f'K={k} copy (device time)':34} {'':>10} {'':>7} {copy_ms:10.3f} {copy_gbps:7.0f}")
    outs = ops.quantize_many([x], PRESETS["minite"])
    conv_ms = kernel_ms(lambda: ops.quantize_many([x], PRESETS["minite"]), 10)
    moved = bytes_in + out_bytes(outs[0])
    print(f"{f'K={k} converter (device time)':34} {'':>10} {'':>7} {conv_ms:10.3f} "
          f"{moved / conv_ms / 1e6:7.0f} {'':>8} {moved / conv_ms / 1e6 / copy_gbps:8.2f}")
    torch_ms = graph_ms(lambda: torch.amax(flat, 1), 20)
    print(f"{f'K={k} read (torch.amax)':34} {'':>10} {'':>7} {torch_ms:10.3f} "
          f"{bytes_in / torch_ms / 1e6:7.0f} {'':>8} {bytes_in / torch_ms / 1e6 / copy_gbps:8.2f}")
    for label, moved, kern, args in (
            ("read", bytes_in + 4 * rows, _read_rows, (acc,)),
            ("twin", bytes_in + codes.numel() + scales.numel(), _twin_rows, (codes, scales))):
        best = None
        for per, warps in ROOFLINE_TILES:
            def run(per=per, warps=warps, kern=kern, args=args):
                kern[(triton.cdiv(rows, per),)](flat, *args, rows, K=k, C=piece, ROWS=per,
                                                num_warps=warps)
            run()
            ms = graph_ms(run, 20)
            if best is None or ms < best[0]:
                best = (ms, per, warps)
        ms, per, warps = best
        print(f"{f'K={k} {label} ({per} rows, {warps} warps)':34} {'':>10} {'':>7} {ms:10.3f} "
              f"{moved / ms / 1e6:7.0f} {'':>8} {moved / ms / 1e6 / copy_gbps:8.2f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with_roofline = "--roofline" in argv
    argv = [a for a in argv if a != "--roofline"]
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
        if with_roofline and triton is not None and len(xs) == 1:
            roofline(xs[0])
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
