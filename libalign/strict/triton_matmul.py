"""The K-ordered fp32 product of :mod:`libalign.strict.ops` as one Triton kernel on a GPU.

:func:`libalign.strict.ops.matmul_f32` defines strict products: every output element is
``((a0 w0 + a1 w1) + a2 w2) + ...`` in fp32, each product and each sum rounded on its own, so
the value of a row never depends on the other rows of the call. Written with torch it is a loop
of K rank-1 updates, two kernel launches per k over the whole ``[M, N]`` accumulator: correct
on any device, but on a GPU a 2048-wide linear costs 2 x 2048 launches and rereads the
accumulator each time.

This kernel computes the same sequence of roundings in registers: a program owns a
``BLOCK_M x BLOCK_N`` tile of the output, walks k from 0 to K - 1 and adds ``a[:, k] w[:, k]``
to its tile. Nothing is split over K, tiles never share a sum, and the compiler is told not to
contract ``acc + a * w`` into a fused multiply-add (``enable_fp_fusion=False``), so each product
is rounded to fp32 before its addition, as the torch loop does. The bits are therefore those
of :func:`~libalign.strict.ops.matmul_f32` on the CPU, whatever the tile sizes or M.

Two starts are offered, because two callers need them: ``zero_init=False`` starts the
accumulator with the first product (``matmul_f32``), ``zero_init=True`` adds the first
product to +0 (a slot-ordered sum such as attention's, where ``0 + (-0) = +0`` matters to the
sign of an all-zero result).
"""

from __future__ import annotations

import contextlib

import torch

from libalign.kernels.grid import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["kordered_matmul", "kordered_matmul_available"]


def kordered_matmul_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel serves ``x``'s device (a CUDA tensor with Triton present)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _kordered_kernel(a_ptr, w_ptr, c_ptr, M, N, K,
                         s_ab, s_am, s_ak, s_wb, s_wn, s_wk, s_cb, s_cm, s_cn,
                         ZERO_INIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        a_row = a_ptr + b * s_ab + rm.to(tl.int64) * s_am
        w_row = w_ptr + b * s_wb + rn.to(tl.int64) * s_wn
        a0 = tl.load(a_row, mask=m_ok, other=0.0).to(tl.float32)
        w0 = tl.load(w_row, mask=n_ok, other=0.0).to(tl.float32)
        acc = a0[:, None] * w0[None, :]
        if ZERO_INIT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + acc
        for k in range(1, K):
            a = tl.load(a_row + k * s_ak, mask=m_ok, other=0.0).to(tl.float32)
            w = tl.load(w_row + k * s_wk, mask=n_ok, other=0.0).to(tl.float32)
            acc = acc + a[:, None] * w[None, :]
        c = c_ptr + b * s_cb + rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
        tl.store(c, acc, mask=m_ok[:, None] & n_ok[None, :])


def _blocks(m: int, n: int) -> tuple[int, int]:
    """Tile sizes by shape: only speed depends on them, never the bits."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64 if n >= 64 else 32


def kordered_matmul(a: torch.Tensor, w: torch.Tensor, *, zero_init: bool = False) -> torch.Tensor:
    """fp32 ``a @ w^T`` accumulated in K order: ``a`` ``[M, K]`` or ``[B, M, K]``, ``w``
    ``[N, K]`` or ``[B, N, K]`` (any strides, any float dtype: products are taken in fp32),
    on a CUDA device; the bits of :func:`libalign.strict.ops.matmul_f32`."""
    if triton is None:
        raise RuntimeError("kordered_matmul needs Triton")
    batched = a.ndim == 3
    a3 = a if batched else a.unsqueeze(0)
    w3 = w if w.ndim == 3 else w.unsqueeze(0).expand(a3.shape[0], -1, -1)
    bsz, m, k = a3.shape
    n = w3.shape[1]
    out = torch.empty((bsz, m, n), dtype=torch.float32, device=a.device)
    if out.numel() and k:
        bm, bn = _blocks(m, n)
        grid = (cdiv(m, bm), cdiv(n, bn), bsz)
        on = torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext()
        with on:
            _kordered_kernel[grid](a3, w3, out, m, n, k, *a3.stride(), *w3.stride(), *out.stride(),
                                   ZERO_INIT=zero_init, BLOCK_M=bm, BLOCK_N=bn,
                                   enable_fp_fusion=False)
    elif out.numel():
        out.zero_()
    return out if batched else out[0]
