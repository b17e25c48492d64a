"""Probe: what quantizing the activations inside the W4A4 GEMM's A-tile load costs on Hopper.

Not a table of the product (``python -m tests.bench gemm`` is): a development probe that
answers one question before the grouped path is rebuilt around it. The emulated W4A4 GEMM
today is two kernels, the activation pass (``triton_kernels.act_qdq``: bf16 inner values and
row decode scales written out) and a bf16 tensor-core GEMM reading them. Fused, the GEMM
would load the raw bf16 activations, form each tile's inner values in registers
(``triton_kernels._inner_values``: block maxima, E4M3 scales, E2M1 rounding, in the ``te``
order) from row decode scales a read-only maximum pass gave, and feed them to the same
``tl.dot``.

For one dense product per shape (one expert's weights, ``M`` rows), each at a few tile
settings, it prints as device time (CUDA graph replays) against cuBLAS bf16:

- ``plain``: the GEMM on precomputed inner values (the GEMM half of today's path);
- ``two-step``: the activation pass, then ``plain`` (today's path);
- ``fused``: a row-maximum pass (``torch.linalg.vector_norm``, inf) then the GEMM quantizing
  in its load;

and whether ``fused`` gives ``two-step``'s bits (same tiles, same accumulation order).
Run: ``python -m tests.bench.probe_w4a4_fused``.
"""

from __future__ import annotations

import sys

import torch

from libalign.kernels.grid import cdiv
from tests.bench.measure import graph_ms

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from libalign.gemm import triton_kernels as tk
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

#: (M, K, N): FC1 (gate/up) and FC2 (down) of a Qwen3-30B-A3B expert, a few row counts
SHAPES = ((2048, 2048, 1536), (8192, 2048, 1536), (2048, 768, 2048), (8192, 768, 2048))
#: (BM, BN, BK, stages, warps)
TILES = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4), (64, 256, 64, 4, 4))


if triton is not None:

    @triton.jit
    def _plain_kernel(a_desc, w_desc, o_desc, a_dec_ptr, w_dec_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = tk._tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN),
                                         GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([pid_m * BM, ki * BK])
            w = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, w.T, acc)
        a_dec = tl.load(a_dec_ptr + pid_m * BM + tl.arange(0, BM))
        w_dec = tl.load(w_dec_ptr + pid_n * BN + tl.arange(0, BN))
        o_desc.store([pid_m * BM, pid_n * BN],
                     (acc * (a_dec[:, None] * w_dec[None, :])).to(o_desc.dtype))

    @triton.jit
    def _fused_kernel(x_desc, w_desc, o_desc, amax_ptr, w_dec_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = tk._tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN),
                                         GROUP_M)
        amax = tl.load(amax_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.float32)
        enc, dec = tk._outer(amax, 0.0, False)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            x = x_desc.load([pid_m * BM, ki * BK]).to(tl.float32)
            inner = tk._inner_values(tl.reshape(x, (BM, BK // 16, 16)), enc, dec)
            a = tl.reshape(inner, (BM, BK)).to(tl.bfloat16)
            w = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, w.T, acc)
        w_dec = tl.load(w_dec_ptr + pid_n * BN + tl.arange(0, BN))
        o_desc.store([pid_m * BM, pid_n * BN],
                     (acc * (dec[:, None] * w_dec[None, :])).to(o_desc.dtype))


def run_tile(t: dict, tile: tuple, cublas: float) -> None:
    """Time one tile setting's plain, two-step and fused calls on the tensors ``t``."""
    bm, bn, bk, stages, warps = tile
    x, inner, a_dec, amax, w_inner, w_dec = (t[k] for k in ("x", "inner", "a_dec", "amax",
                                                             "w_inner", "w_dec"))
    (m, k), n = x.shape, w_inner.shape[0]
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    kw = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_stages=stages, num_warps=warps)
    a_d = TensorDescriptor.from_tensor(inner, [bm, bk])
    x_d = TensorDescriptor.from_tensor(x, [bm, bk])
    w_d = TensorDescriptor.from_tensor(w_inner, [bn, bk])
    o_d = TensorDescriptor.from_tensor(t["out"], [bm, bn])
    r_d = TensorDescriptor.from_tensor(t["ref"], [bm, bn])

    def plain():
        _plain_kernel[grid](a_d, w_d, r_d, a_dec, w_dec, m, n, k, **kw)

    def two_step():
        tk.act_qdq(x, amax_floor=None, tensor_amax=None, out=inner, dec_out=a_dec)
        plain()

    def fused():
        torch.linalg.vector_norm(x, float("inf"), dim=1, out=amax)
        _fused_kernel[grid](x_d, w_d, o_d, amax, w_dec, m, n, k, **kw)

    name = f"{bm}x{bn}x{bk} s{stages} w{warps}"
    try:
        two_step()
        fused()
        torch.cuda.synchronize()
    except Exception as exc:  # a setting that does not compile or fit: say so, go on
        print(f"  {name}: failed ({type(exc).__name__}: {exc})"[:300])
        return
    same = torch.equal(t["out"].view(torch.int16), t["ref"].view(torch.int16))
    t_plain, t_two, t_fused = (graph_ms(f, 20) for f in (plain, two_step, fused))
    print(f"  {name}: plain {t_plain / cublas:.2f}x  two-step {t_two / cublas:.2f}x  "
          f"fused {t_fused / cublas:.2f}x  fused == two-step: {same}")


def run_shape(m: int, k: int, n: int) -> None:
    """Print the passes and every tile setting of one (M, K, N) product."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((m, k), generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn((n, k), generator=gen, device="cuda").to(torch.bfloat16)
    # weights: exact inner values and decode scales, from the same activation pass
    w_inner, w_dec = tk.act_qdq(w, amax_floor=None, tensor_amax=None)
    inner, a_dec = tk.act_qdq(x, amax_floor=None, tensor_amax=None)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    t = dict(x=x, inner=inner, a_dec=a_dec, w_inner=w_inner, w_dec=w_dec, out=out,
             ref=torch.empty_like(out), amax=torch.empty((m,), dtype=torch.bfloat16, device="cuda"))
    cublas = graph_ms(lambda: torch.matmul(x, w.T), 20)
    act = graph_ms(lambda: tk.act_qdq(x, amax_floor=None, tensor_amax=None, out=inner,
                                      dec_out=a_dec), 20)
    rmax = graph_ms(lambda: torch.linalg.vector_norm(x, float("inf"), dim=1, out=t["amax"]), 20)
    print(f"M={m} K={k} N={n}: cuBLAS bf16 {cublas:.4f} ms; activation pass {act / cublas:.2f}x;"
          f" row-maximum pass {rmax / cublas:.2f}x")
    for tile in TILES:
        bm, bn, bk = tile[:3]
        if not (m % bm or n % bn or k % bk):
            run_tile(t, tile, cublas)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if triton is None or not torch.cuda.is_available():
        print("needs Triton and a CUDA device")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    for shape in SHAPES:
        run_shape(*shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
