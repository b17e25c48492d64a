"""Host-time probe for the eager W4A4 call (not a benchmark table; needs CUDA and Triton).

At 256 rows per expert a W4A4 call is host-bound: the device finishes before the host has
queued the next call. This probe says where the host time goes, for the FC1 and FC2 cells
of ``bench gemm`` at ``--rows`` rows per expert:

* host µs per call of a loop of back-to-back calls (the enqueue rate, device left to run)
  for the layers of the call: ``torch._grouped_mm`` (the bf16 baseline), the two Triton
  kernels alone on preallocated buffers, :func:`libalign.gemm.triton_grouped.w4a4_grouped_triton`,
  and :func:`libalign.gemm.grouped_linear` without and with the (deferred) NaN/Inf check;
* a ``cProfile`` table of the ``grouped_linear`` loop (top functions by own time).

Run: ``python -m tests.bench.profile_gemm [--rows 256] [--calls 300]``.
"""

from __future__ import annotations

import argparse

import torch

from libalign import gemm
from libalign.gemm.finite_checks import deferred_finite_checks
from libalign.gemm.triton_grouped import triton_gemm_available, w4a4_grouped_triton

from .measure import host_us, profiled


def _cell(name: str, k: int, n: int, args, tk) -> None:
    """Print one GEMM shape's host µs per call and its cProfile table."""
    w = (torch.randn(args.experts, n, k, device="cuda") * 0.02).to(torch.bfloat16)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    counts = [args.rows] * args.experts
    a = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16)
    lay = gemm.group_layout(counts, 128)
    offs = torch.tensor(lay.offsets(padded=False)[1:], dtype=torch.int32, device="cuda")
    spec = ew.path.act_spec
    inner, dec = tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=None)
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
    tiles = lay.tile_expert(128, "cuda")
    wt = w.transpose(1, 2)
    runs = {
        "torch._grouped_mm (bf16)": lambda: torch._grouped_mm(a, wt, offs=offs),
        "act_qdq kernel alone": lambda: tk.act_qdq(a, amax_floor=spec.amax_floor,
                                                   tensor_amax=None, out=inner, dec_out=dec),
        "grouped_gemm kernel alone": lambda: tk.grouped_gemm(inner, dec, ew.inner, ew.dec,
                                                             tiles, 128, out=out),
        "w4a4_grouped_triton, no check": lambda: w4a4_grouped_triton(
            a, spec, ew.inner, ew.dec, lay, check_finite=False),
        "grouped_linear, no check": lambda: gemm.grouped_linear(a, ew, lay, backend="triton",
                                                                check_finite=False),
        "grouped_linear, deferred check": lambda: gemm.grouped_linear(a, ew, lay,
                                                                      backend="triton"),
    }
    print(f"== {name} {args.rows} rows/expert: host µs per call ({args.calls} calls)")
    with torch.no_grad(), deferred_finite_checks():
        for label, fn in runs.items():
            print(f"  {label:<34}{host_us(fn, args.calls):>9.1f}", flush=True)
        stats = profiled(runs["grouped_linear, deferred check"], args.calls)
    stats.sort_stats("tottime").print_stats(22)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="profile_gemm")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not triton_gemm_available("cuda"):
        print("profile_gemm needs a CUDA device with Triton; skipped")
        return 0
    from libalign.gemm import triton_kernels as tk

    torch.manual_seed(0)
    for name, k, n in (("FC1", 2048, 1536), ("FC2", 768, 2048)):
        _cell(name, k, n, args, tk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
