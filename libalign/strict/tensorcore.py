"""Batch-invariant tensor-core kernels: strict execution at the price of a deterministic engine.

A row comes out of a GPU kernel with different bits in a batch of 8 and a batch of 512 for
one reason only: the kernel chose another *schedule* for the bigger call (a split over K
whose partial sums are added at the end, a reduction spread over more threads, an instruction
that adds the products in another order). The arithmetic of one tile is fixed by the hardware
and the compiler: a tensor-core ``mma`` adds its products into the accumulator the same way
whichever row or column of the tile an input sits in. So a kernel whose reduction order never
depends on the number of rows is batch-invariant while running at tensor-core speed. Every kernel here follows
that rule (as Thinking Machines' and SGLang's batch-invariant operations do):

* :func:`matmul` and :func:`grouped_matmul`: a program owns an output tile and walks all of K,
  in steps of 64 (256 for few rows: the instruction still adds 16 products of K at a time, in
  K order), into one fp32 accumulator; nothing is split over K; bias, then the optional
  NVFP4 epilogue ``acc * (a_dec[m] * w_dec[n])``, then one rounding to the output dtype. The
  tile's shape is chosen per call for speed (:func:`tile_config`): the tensor-core
  instruction adds each output element's products in an order that does not depend on the
  tile's other rows or columns, so every shape gives a row the same bits. The grouped form runs
  the rows of many experts in one launch (a tile never straddles two experts; each program
  finds its tile from the experts' row counts on the device), each tile computed exactly as
  the plain form computes it.
* :func:`mean_last` (the mean of RMSNorm) and :func:`log_softmax`: a row read in chunks of 1024
  in order, each chunk reduced by the same in-register tree, the chunk results added left to
  right (a small batch spreads a row's chunks over programs and adds their results in the
  same order).
* :func:`rms_norm`: the squares, the mean above, then scale and weight in one pass
  (element-wise steps, PyTorch's bits); with this module's own mean, one launch a call whose
  squares are summed in the same order.
* :func:`combine_rows` (a MoE layer's output): each token's expert rows weighted and added
  in slot order in one pass, element-wise operations whose bits are the portable form's.
* attention lives in :mod:`libalign.strict.attention`, on the same rule.

The K steps, the chunk widths and the reduction shapes are those of SGLang's
``batch_invariant_ops`` (its Triton persistent matmul, ``log_softmax`` and ``mean_dim``), so a
sampler running SGLang's deterministic inference on the Triton matmul computes the same bits
as these kernels (checked on a GPU against SGLang's own functions). They are not the bits of
the portable element-wise ops (:mod:`libalign.strict.ops`): tensor cores add in their own
order, and ``exp``/``log`` are the GPU's. What they share with those is the guarantee: row ``i``
gives the same bits alone, in a batch of 512, in a prefill or in a decode step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from libalign.errors import ConfigError, DTypeError, ShapeError
from libalign.kernels.grid import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = [
    "CONFIGS",
    "available",
    "combine_rows",
    "grouped_matmul",
    "log_softmax",
    "matmul",
    "mean_last",
    "require",
    "rms_norm",
    "sequential_sum",
    "tile_config",
]

#: The tile configuration per operand dtype: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
#: fp32 operands multiply in IEEE fp32 (no TF32).
CONFIGS = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 256, 64, 8, 3),
    torch.float32: (128, 128, 32, 8, 3),
}
#: Narrower configurations, for products whose :data:`CONFIGS` grid would leave the GPU
#: short of programs (few rows, few output columns, or many small experts). Only the
#: output tile's shape, the warps and the pipeline depth differ; K is walked in the same
#: steps by the same tensor-core instruction, which adds each output element's products in
#: an order that does not depend on the tile's other rows or columns, so a row gets the bits
#: :data:`CONFIGS` gives it (checked on a GPU for every dtype and these shapes).
#: ``SMALL_CONFIGS``: 64-row tiles; ``WIDE_CONFIGS``: 64 rows and 256 columns, for up to
#: :data:`SMALL_M` rows against a very wide weight (an LM head).
SMALL_CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4, 4),
    torch.float16: (64, 128, 64, 4, 4),
    torch.float32: (64, 128, 32, 4, 3),
}
WIDE_CONFIGS = {
    torch.bfloat16: (64, 256, 64, 8, 3),
    torch.float16: (64, 256, 64, 8, 3),
    torch.float32: (64, 128, 32, 4, 3),
}
#: For at most :data:`SMALL_M` rows against an ordinary weight: 64-column tiles (twice the
#: programs of :data:`SMALL_CONFIGS`) that step K by 256, so each program walks a quarter of
#: the steps. The tensor-core instruction adds 16 products of K at a time into the
#: accumulator, in K order, whatever the step's width: a K step that is a multiple of
#: :data:`CONFIGS`'s gives every element the same additions in the same order (checked on a
#: GPU, K steps of 64, 128 and 256). fp32 operands keep their step.
FEW_ROWS_CONFIGS = {
    torch.bfloat16: (64, 64, 256, 4, 3),
    torch.float16: (64, 64, 256, 4, 3),
    torch.float32: (64, 128, 32, 4, 3),
}
#: For at most :data:`SKINNY_M` rows, whatever the weight's width: tiles of 16 rows. A tile
#: of fewer than 64 rows runs the transposed product (the weight tile times the rows' tile,
#: transposed back), so the rows are the instruction's narrow side and no load is spent on
#: padding rows; each element still adds its products 16 at a time in K order. fp32
#: operands keep their tiles.
SKINNY_CONFIGS = {
    torch.bfloat16: (16, 64, 256, 4, 3),
    torch.float16: (16, 64, 256, 4, 3),
    torch.float32: (64, 128, 32, 4, 3),
}
SKINNY_M = 16
SMALL_M = 64
_WIDE_N = 16384
_CHUNK = 1024          # row chunk of the row reductions
_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    """The multiprocessor count of CUDA ``device``, looked up once."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def available(x: torch.Tensor) -> bool:
    """Whether these kernels serve ``x``: a CUDA tensor with Triton present."""
    return triton is not None and x.is_cuda


def require(op: str, x: torch.Tensor) -> None:
    """:class:`~libalign.errors.ConfigError` naming ``op`` unless the kernels serve ``x``."""
    if not x.is_cuda:
        raise ConfigError(f"strict {op}: the tensor-core kernels run on CUDA tensors, got "
                          f"{x.device.type}")
    if triton is None:
        raise ConfigError(f"strict {op}: the batch-invariant kernels need Triton, which this torch "
                          "build lacks; strict device mode has no non-invariant fallback")


if triton is not None:

    @triton.jit
    def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, adec_ptr, wdec_ptr, counts_ptr, E,
                       M, N, K, s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn, s_de,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUPED: tl.constexpr, E_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SCALED: tl.constexpr, IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if GROUPED:
            # row tile pid_m of rows sorted by expert, from the experts' row counts alone (no
            # table, no read to the host): expert e's tiles follow the tiles of the experts
            # before it, and a tile never holds two experts' rows. Tiles past the last real
            # one hold no rows (start = end = M), as does anything past M.
            ex = tl.arange(0, E_P2)
            n = tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32)
            tiles = (n + BLOCK_M - 1) // BLOCK_M
            before = tl.cumsum(tiles, 0) <= pid_m  # experts whose tiles all precede this one
            e = tl.sum(before.to(tl.int32), 0)
            rows_before = tl.sum(tl.where(before, n, 0), 0)
            tiles_before = tl.sum(tl.where(before, tiles, 0), 0)
            n_e = tl.sum(tl.where(ex == e, n, 0), 0)
            real = e < E
            start_m = tl.minimum(tl.where(real, rows_before + (pid_m - tiles_before) * BLOCK_M,
                                          M), M)
            end_m = tl.minimum(tl.where(real, rows_before + n_e, M), M)
            e = tl.where(real, e, 0).to(tl.int64)
        else:
            e = 0
            start_m = pid_m * BLOCK_M
            end_m = M
        offs_am = start_m + tl.arange(0, BLOCK_M)
        offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows and columns past the end read row / column 0 (their results are never stored)
        offs_am = tl.where(offs_am < end_m, offs_am, 0).to(tl.int64)
        offs_bn = tl.where(offs_bn < N, offs_bn, 0).to(tl.int64)
        offs_kk = tl.arange(0, BLOCK_K)
        b_base = b_ptr + e * s_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # a grouped launch has a program for every tile the rows could need; those past the
        # last real tile hold no rows and skip the loop (they store nothing)
        if BLOCK_M < 64:  # few rows: the weight's columns are the instruction's wide side
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(tl.where(start_m < end_m, tl.cdiv(K, BLOCK_K), 0)):
            offs_k = ki * BLOCK_K + offs_kk
            a = tl.load(a_ptr + offs_am[:, None] * s_am + offs_k[None, :] * s_ak,
                        mask=offs_kk[None, :] < K - ki * BLOCK_K, other=0.0)
            b = tl.load(b_base + offs_k[:, None] * s_bk + offs_bn[None, :] * s_bn,
                        mask=offs_kk[:, None] < K - ki * BLOCK_K, other=0.0)
            if BLOCK_M < 64:  # the transposed product: w-tile [N, K] times a-tile^T [K, M]
                acc_t = tl.dot(tl.trans(b), tl.trans(a), acc_t)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if BLOCK_M < 64:
            acc = tl.trans(acc_t)
        offs_cm = start_m + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_cm < end_m
        n_ok = offs_cn < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_cn, mask=n_ok, other=0.0).to(tl.float32)
        if SCALED:
            ad = tl.load(adec_ptr + offs_cm, mask=m_ok, other=0.0)
            wd = tl.load(wdec_ptr + e * s_de + offs_cn, mask=n_ok, other=0.0)
            acc = acc * (ad[:, None] * wd[None, :])
        c = c_ptr + offs_cm.to(tl.int64)[:, None] * s_cm + offs_cn.to(tl.int64)[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _combine_rows_kernel(y_ptr, slot_ptr, w_ptr, out_ptr, H, s_y, s_o, K: tl.constexpr,
                             BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(slot_ptr + tok * K + j).to(tl.int64)
            wv = tl.load(w_ptr + tok * K + j).to(y_ptr.dtype.element_ty).to(tl.float32)
            v = tl.load(y_ptr + row * s_y + offs, mask=ok, other=0.0).to(tl.float32)
            # the product rounded to y's dtype, then added in fp32: the round trip keeps the
            # multiply and the add two operations (never one FMA)
            acc = acc + (v * wv).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + tok * s_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, v * v, mask=offs < n)

    @triton.jit
    def _rms_scale_kernel(x_ptr, var_ptr, w_ptr, out_ptr, N, s_x, s_o, eps,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        r = tl.math.rsqrt(tl.load(var_ptr + row) + eps)
        xv = tl.load(x_ptr + row * s_x + offs, mask=ok, other=0.0).to(tl.float32)
        y = (xv * r).to(x_ptr.dtype.element_ty).to(tl.float32)
        wv = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, (wv * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, s_x, s_o, eps, BLOCK: tl.constexpr):
        # rms_norm in one program a row, with the bits of its three launches (_square_kernel,
        # _mean_kernel, _rms_scale_kernel). A row sum's order is set by how the loaded chunk
        # lies in the threads: Triton gives every load and store of a kernel the widest
        # vector any of them allows, and _mean_kernel's fp32 loads hold 4 values a thread. So
        # every access here is declared at most 4 contiguous: the squares then lie as
        # _mean_kernel's loads do and are summed by the same tree. Launched without FMA
        # contraction, so each square is one fp32 rounding, as _square_kernel stores it.
        row = tl.program_id(0).to(tl.int64)
        acc = 0.0
        for start in range(0, N, BLOCK):
            offs = tl.max_contiguous(start + tl.arange(0, BLOCK), 4)
            v = tl.load(x_ptr + row * s_x + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc += tl.sum(v * v)
        r = tl.math.rsqrt(acc / N + eps)
        for start in range(0, N, BLOCK):
            offs = tl.max_contiguous(start + tl.arange(0, BLOCK), 4)
            ok = offs < N
            xv = tl.load(x_ptr + row * s_x + offs, mask=ok, other=0.0).to(tl.float32)
            y = (xv * r).to(x_ptr.dtype.element_ty).to(tl.float32)
            wv = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * s_o + offs, (wv * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _sequential_sum_kernel(x_ptr, out_ptr, R, K, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < R
        acc = tl.zeros([BLOCK], dtype=tl.float32).to(x_ptr.dtype.element_ty)
        for j in range(K):
            v = tl.load(x_ptr + rows * K + j, mask=ok, other=0.0)
            acc = (acc.to(tl.float32) + v.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(out_ptr + rows, acc, mask=ok)

    @triton.jit
    def _mean_kernel(x_ptr, out_ptr, s_xm, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = 0.0
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            vals = tl.load(x_ptr + row * s_xm + offs, mask=offs < N, other=0.0)
            acc += tl.sum(vals)
        tl.store(out_ptr + row, acc / N)

    @triton.jit
    def _log_softmax_kernel(x_ptr, out_ptr, s_xm: tl.constexpr, s_om: tl.constexpr,
                            N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * s_xm
        o_row = out_ptr + row * s_om
        offs0 = tl.arange(0, BLOCK)
        top = tl.max(tl.load(x_row + offs0, mask=offs0 < N, other=-float("inf")))
        for start in range(BLOCK, N, BLOCK):
            offs = start + offs0
            vals = tl.load(x_row + offs, mask=offs < N, other=-float("inf"))
            top = tl.max(tl.maximum(vals, top))
        total = tl.sum(tl.zeros([1], dtype=top.dtype))
        for start in range(0, N, BLOCK):
            offs = start + offs0
            ok = offs < N
            vals = tl.load(x_row + offs, mask=ok, other=0.0)
            total += tl.sum(tl.where(ok, tl.exp(vals - top), 0.0))
        lse = tl.log(total)
        for start in range(0, N, BLOCK):
            offs = start + offs0
            ok = offs < N
            vals = tl.load(x_row + offs, mask=ok)
            tl.store(o_row + offs, vals - top - lse, mask=ok)

    @triton.jit
    def _chunk_max_kernel(x_ptr, part_ptr, s_xm: tl.constexpr, N: tl.constexpr,
                          NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the maximum of chunk c (max is exact, so any split gives the
        # row maximum the one-program kernel finds)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        vals = tl.load(x_ptr + row * s_xm + offs, mask=offs < N, other=-float("inf"))
        tl.store(part_ptr + row * NCHUNK + c, tl.max(vals))

    @triton.jit
    def _row_top(part_ptr, row, NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr):
        """The row maximum from its chunk maxima (exact)."""
        j = tl.arange(0, NCHUNK_P2)
        return tl.max(tl.load(part_ptr + row * NCHUNK + j, mask=j < NCHUNK, other=-float("inf")))

    @triton.jit
    def _chunk_sum_kernel(x_ptr, part_ptr, sum_ptr, s_xm: tl.constexpr, N: tl.constexpr,
                          NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the row maximum from the chunk maxima, then chunk c's sum of
        # exp(x - max), reduced exactly as the one-program kernel reduces that chunk
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        top = _row_top(part_ptr, row, NCHUNK, NCHUNK_P2)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        vals = tl.load(x_ptr + row * s_xm + offs, mask=ok, other=0.0)
        tl.store(sum_ptr + row * NCHUNK + c, tl.sum(tl.where(ok, tl.exp(vals - top), 0.0)))

    @triton.jit
    def _chunk_out_kernel(x_ptr, out_ptr, part_ptr, sum_ptr, s_xm: tl.constexpr,
                          s_om: tl.constexpr, N: tl.constexpr, NCHUNK: tl.constexpr,
                          NCHUNK_P2: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the chunk sums added left to right from 0 (the one-program
        # kernel's running total), the log, then chunk c's outputs
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        top = _row_top(part_ptr, row, NCHUNK, NCHUNK_P2)
        total = tl.sum(tl.zeros([1], dtype=top.dtype))
        for i in range(NCHUNK):
            total += tl.load(sum_ptr + row * NCHUNK + i)
        lse = tl.log(total)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        vals = tl.load(x_ptr + row * s_xm + offs, mask=ok)
        tl.store(out_ptr + row * s_om + offs, vals - top - lse, mask=ok)

def tile_config(dtype: torch.dtype, rows: int, op: str = "matmul", *, n: int = 0,
                row_tiles: int | None = None, sms: int = 0) -> tuple[int, ...]:
    """The tile configuration of a product of ``rows`` rows (the rows of one expert, for a
    grouped call) and ``n`` output columns, by speed alone (every configuration gives a row
    the same bits): :data:`SKINNY_CONFIGS` for at most :data:`SKINNY_M` rows (whatever the
    weight's width), :data:`WIDE_CONFIGS` for other calls of at most :data:`SMALL_M` rows
    against a very wide weight, :data:`FEW_ROWS_CONFIGS` for the rest of those,
    :data:`SMALL_CONFIGS` for calls whose :data:`CONFIGS` grid (``row_tiles`` 128-row tiles,
    default ``rows / 128``, times the column tiles) has fewer than two programs per
    multiprocessor (``sms``), else :data:`CONFIGS`."""
    if dtype not in CONFIGS:
        raise DTypeError(f"strict {op}: the tensor-core kernels take bf16, fp16 or fp32 operands, "
                         f"got {dtype}")
    if rows <= SKINNY_M:
        return SKINNY_CONFIGS[dtype]
    if rows <= SMALL_M:
        return (WIDE_CONFIGS if n >= _WIDE_N else FEW_ROWS_CONFIGS)[dtype]
    tiles = (row_tiles if row_tiles is not None else -(-rows // 128)) * -(-n // 128)
    return SMALL_CONFIGS[dtype] if tiles < 2 * sms else CONFIGS[dtype]


def _launch_matmul(a, w, out, *, bias=None, a_dec=None, w_dec=None, counts=None,
                   config=None) -> None:
    """One launch of :func:`_matmul_kernel`; with ``counts`` (the experts' row counts on the
    device) a grouped launch, whose programs find their row tiles from the counts."""
    bm, bn, bk, warps, stages = config or tile_config(
        a.dtype, a.shape[0], n=out.shape[1], sms=_sms(a.device))
    grouped = counts is not None
    m, k = a.shape
    n = out.shape[1]
    if w.ndim == 3:
        s_be, s_bn, s_bk = w.stride()
    else:  # one expert: the strides of w.unsqueeze(0), without making the view
        s_bn, s_bk = w.stride()
        s_be = w.shape[0] * s_bn
    dummy = out
    experts = counts.shape[0] if grouped else 0
    # grouped: a program for every row tile the counts could need (each expert with rows
    # may end in a partial tile, and at most M experts have rows); those with no rows exit
    n_mtiles = cdiv(m, bm) + min(experts, m) if grouped else cdiv(m, bm)
    if n_mtiles == 0 or n == 0:
        return
    wdec = w_dec if w_dec is not None else dummy
    with torch.cuda.device(a.device):
        _matmul_kernel[(n_mtiles, cdiv(n, bn))](
            a, w, out, bias if bias is not None else dummy,
            a_dec if a_dec is not None else dummy, wdec, counts if grouped else dummy, experts,
            m, n, k, *a.stride(), s_be, s_bk, s_bn, *out.stride(),
            wdec.stride(0) if w_dec is not None and wdec.ndim == 2 else 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUPED=grouped,
            E_P2=max(16, next_power_of_2(experts)), HAS_BIAS=bias is not None,
            SCALED=a_dec is not None, IEEE=a.dtype == torch.float32,
            num_warps=warps, num_stages=stages)


def _check_operands(op: str, a: torch.Tensor, w: torch.Tensor, w_rank: int) -> None:
    require(op, a)
    if a.ndim != 2 or w.ndim != w_rank or a.shape[1] != w.shape[-1]:
        want = "[N, K]" if w_rank == 2 else "[E, N, K]"
        raise ShapeError(f"strict {op} needs a [M, K] and w {want}, got {tuple(a.shape)} and "
                         f"{tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise DTypeError(f"strict {op}: a is {a.dtype}, w is {w.dtype}; the tile products need one "
                         "operand dtype")
    if a.device != w.device:
        raise ShapeError(f"strict {op}: a on {a.device}, w on {w.device}")


def matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``a @ w.T (+ bias)``: ``a`` ``[M, K]``, ``w`` ``[N, K]`` (any strides), fp32 accumulation,
    one rounding to ``out_dtype`` (default ``a``'s); row ``i`` the same bits for every ``M``.
    ``config`` overrides :func:`tile_config` (a probe comparing tile shapes)."""
    _check_operands("matmul", a, w, 2)
    if config is not None:
        tile_config(a.dtype, 0)  # a dtype no tile serves is refused by name
        step = CONFIGS[a.dtype][2]
        if config[2] % step or (a.dtype == torch.float32 and config[2] != step):
            raise ShapeError(f"strict matmul: tile config {config} steps K by {config[2]}; the "
                             f"kernels' step is {step}"
                             + ("" if a.dtype == torch.float32 else " (or a multiple of it)"))
    out = torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype or a.dtype, device=a.device)
    if a.shape[1] == 0:
        out.zero_()
        if bias is not None:
            out += bias.float().to(out.dtype)
        return out
    _launch_matmul(a, w, out, bias=bias, config=config)
    return out


@functools.lru_cache(maxsize=8)
def _device_counts(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Counts given as a list, on ``device`` (kept, read-only: a MoE layer's FC1 and FC2, and a
    CUDA graph's capture after its warm-up calls, copy nothing)."""
    return torch.tensor(counts, dtype=torch.int32).to(device)


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor, *,
                   out_dtype: torch.dtype, a_dec: torch.Tensor | None = None,
                   w_dec: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``a`` ``[M, K]`` sorted by expert (``counts[e]`` rows of expert ``e``) times their
    expert's ``w[e]`` ``[N, K]`` (``w`` ``[E, N, K]``), in one launch; each row's bits those of
    :func:`matmul` of that row alone. With ``a_dec`` ``[M]`` and ``w_dec`` ``[E, N]`` (fp32) the
    NVFP4 epilogue ``acc * (a_dec[m] * w_dec[e, n])`` runs before the rounding.

    ``counts`` a list, or an integer tensor on ``a``'s device (what a router's ``bincount``
    gives): then nothing is read back to the host (the call can be captured in a CUDA graph),
    and the counts are trusted to add to ``M`` (rows past ``M`` are never touched; rows the
    counts miss are left unwritten)."""
    _check_operands("grouped_matmul", a, w, 3)
    if isinstance(counts, torch.Tensor):
        if counts.ndim != 1 or counts.device != a.device or counts.dtype.is_floating_point \
                or counts.dtype == torch.bool or counts.shape[0] > w.shape[0]:
            raise ShapeError(f"strict grouped_matmul: counts {tuple(counts.shape)} "
                             f"{counts.dtype} on {counts.device} (integer [E <= {w.shape[0]}] on "
                             f"{a.device})")
    elif sum(counts) != a.shape[0] or len(counts) > w.shape[0]:
        raise ShapeError(f"strict grouped_matmul: counts add to {sum(counts)} over {len(counts)} "
                         f"experts, a has {a.shape[0]} rows, w {w.shape[0]} experts")
    else:
        counts = _device_counts(tuple(counts), a.device)
    if (a_dec is None) != (w_dec is None):
        raise ShapeError("strict grouped_matmul: a_dec and w_dec come together")
    m = a.shape[0]
    out = torch.empty((m, w.shape[1]), dtype=out_dtype, device=a.device)
    if a.shape[1] == 0:
        return out.zero_()
    if a_dec is not None:
        a_dec = a_dec.float().contiguous()
        w_dec = w_dec.float().reshape(w.shape[0], w.shape[1]).contiguous()
    # the rows per expert pick the configuration (every one gives the same bits), estimated
    # as if the router spread the rows evenly (the counts stay on the device): a few rows'
    # tiles at SMALL_M rows an expert or fewer (a decode step), 64-row tiles up to 256 (a
    # prefill spread over many experts: less of each tile is padding), else tile_config's
    experts = max(1, min(counts.shape[0], m))
    per_expert = -(-m // experts)
    if per_expert <= 4 * SMALL_M:
        cfg = tile_config(a.dtype, per_expert, "grouped_matmul", n=w.shape[1])
        if per_expert > SMALL_M:
            cfg = SMALL_CONFIGS[a.dtype]
    else:
        cfg = tile_config(a.dtype, per_expert, "grouped_matmul", n=w.shape[1],
                          row_tiles=-(-m // 128) + experts, sms=_sms(a.device))
    _launch_matmul(a, w, out, a_dec=a_dec, w_dec=w_dec, config=cfg, counts=counts)
    return out


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """The fp32 mean over the last dimension, keepdim: chunks of 1024 reduced in order."""
    require("mean", x)
    if x.dtype != torch.float32:
        raise DTypeError(f"strict mean takes fp32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        with torch.cuda.device(x.device):
            _mean_kernel[(x2.shape[0],)](x2, out, x2.stride(0), x2.shape[1], BLOCK=_CHUNK)
    return out.reshape(*x.shape[:-1], 1)


def sequential_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over ``dim`` left to right from 0 (``((0 + x0) + x1) + ...``), each addition
    rounded to ``x``'s dtype, in one launch: the bits of
    :func:`libalign.strict.ops.sequential_sum`."""
    require("sequential_sum", x)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(f"strict sequential_sum takes a float dtype, got {x.dtype}")
    moved = x.movedim(dim, -1)
    if moved.shape[-1] == 0 or moved.numel() == 0:
        return x.new_zeros(moved.shape[:-1])
    rows = moved.reshape(-1, moved.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        _sequential_sum_kernel[(cdiv(rows.shape[0], 256),)](rows, out, rows.shape[0],
                                                             rows.shape[1], BLOCK=256)
    return out.reshape(moved.shape[:-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Qwen3's RMSNorm ``weight * (xf * rsqrt(mean(xf * xf) + eps)).to(x.dtype)`` (``xf`` = ``x``
    in fp32) in three launches: the squares, ``mean`` (default :func:`mean_last`; a kernel set
    brings its own), then the scaling and the weight in one pass. The bits of those steps as
    PyTorch's element-wise ops compute them: each product one fp32 rounding, the GPU's
    ``rsqrt``, the rounding to ``x``'s dtype before the weight. ``eps`` must be positive.

    With :func:`mean_last` as the mean, rows whose width is a multiple of 16 starting on a
    16-byte boundary take one launch instead (:func:`_rms_norm_kernel`), with the same bits."""
    require("rms_norm", x)
    if not eps > 0:
        raise ShapeError(f"strict rms_norm: eps {eps} (the fused form takes a positive eps)")
    n = x.shape[-1]
    if weight.shape != (n,) or weight.device != x.device:
        raise ShapeError(f"strict rms_norm: weight {tuple(weight.shape)} on {weight.device} for "
                         f"rows of {n} on {x.device}")
    x2 = x.reshape(-1, n)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    if not x2.numel():
        return out.reshape(x.shape)
    if (mean is None or mean is mean_last) and n % 16 == 0 and x2.data_ptr() % 16 == 0:
        with torch.cuda.device(x.device):
            _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, n, x2.stride(0),
                                             out.stride(0), float(eps), BLOCK=_CHUNK,
                                             enable_fp_fusion=False)
        return out.reshape(x.shape)
    squares = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    block = min(1024, max(16, next_power_of_2(n)))
    with torch.cuda.device(x.device):
        _square_kernel[(cdiv(x2.numel(), 1024),)](x2, squares, x2.numel(), BLOCK=1024)
        var = (mean or mean_last)(squares).reshape(-1)
        _rms_scale_kernel[(x2.shape[0], cdiv(n, block))](
            x2, var.contiguous(), weight.contiguous(), out, n, x2.stride(0), out.stride(0),
            float(eps), BLOCK=block)
    return out.reshape(x.shape)


def combine_rows(y: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Each token's ``k`` expert rows weighted and added in its top-k order, in one launch:
    ``out[t] = sum_j fp32(y[slot_of[t * k + j]] * w[t, j])`` (``y`` ``[T * k, H]`` bf16 or
    fp16, the expert outputs sorted by expert; ``slot_of`` ``[T * k]`` the sorted row of each
    (token, slot); ``weights`` ``[T, k]``), each product rounded to ``y``'s dtype with the
    weight rounded to it first, the sum in fp32 from 0 left to right, one rounding to
    ``out_dtype``: the bits of :func:`libalign.strict.ops.combine_experts`."""
    require("combine", y)
    if y.dtype not in (torch.bfloat16, torch.float16):
        raise DTypeError(f"strict combine takes bf16 or fp16 expert rows, got {y.dtype}")
    t, k = weights.shape
    if y.ndim != 2 or y.shape[0] != t * k or slot_of.shape != (t * k,) \
            or slot_of.device != y.device or weights.device != y.device:
        raise ShapeError(f"strict combine: rows {tuple(y.shape)}, slots {tuple(slot_of.shape)}, "
                         f"weights {tuple(weights.shape)} (rows [T * k, H], slots [T * k], "
                         "weights [T, k] on one device)")
    h = y.shape[1]
    out = torch.empty((t, h), dtype=out_dtype, device=y.device)
    if not out.numel() or k == 0:  # no slots: every token's sum is 0
        return out.zero_()
    yc = y if y.stride(-1) == 1 else y.contiguous()
    block = min(1024, max(16, next_power_of_2(h)))
    with torch.cuda.device(y.device):
        _combine_rows_kernel[(t, cdiv(h, block))](
            yc, slot_of.contiguous(), weights.contiguous(), out, h, yc.stride(0), out.stride(0),
            K=k, BLOCK=block, num_warps=4)
    return out


#: Up to this many rows, :func:`log_softmax` spreads each row over one program per chunk.
SPLIT_ROWS = 64


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dimension: ``x - max - log(sum(exp(x - max)))``, the sum
    over chunks of 1024 in order (the GPU's ``exp`` and ``log``).

    A batch of more than :data:`SPLIT_ROWS` rows runs one program per row, walking its chunks
    three times (maximum, sum, output). A smaller batch would leave most of the GPU idle that
    way, so it runs the same arithmetic over one program per (row, chunk) in three launches:
    chunk maxima; each chunk's ``sum(exp(x - max))``, reduced as the one-program kernel reduces
    it; then the chunk sums added left to right from 0, the log and the outputs. Both give a
    row the same bits (the maximum is exact whatever the split; every rounded step is the
    same operation on the same values in the same order), so rows stay batch-invariant."""
    require("log_softmax", x)
    xf = x.float().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(xf)
    rows, n = xf.shape
    if not xf.numel():
        return out.reshape(x.shape)
    with torch.cuda.device(x.device):
        if rows > SPLIT_ROWS:
            _log_softmax_kernel[(rows,)](xf, out, xf.stride(0), out.stride(0), n, BLOCK=_CHUNK)
        else:
            nchunk = cdiv(n, _CHUNK)
            top = torch.empty((rows, nchunk), dtype=torch.float32, device=x.device)
            sums = torch.empty_like(top)
            grid = (rows, nchunk)
            p2 = next_power_of_2(nchunk)
            _chunk_max_kernel[grid](xf, top, xf.stride(0), n, NCHUNK=nchunk, BLOCK=_CHUNK)
            _chunk_sum_kernel[grid](xf, top, sums, xf.stride(0), n, NCHUNK=nchunk,
                                    NCHUNK_P2=p2, BLOCK=_CHUNK)
            _chunk_out_kernel[grid](xf, out, top, sums, xf.stride(0), out.stride(0), n,
                                    NCHUNK=nchunk, NCHUNK_P2=p2, BLOCK=_CHUNK)
    return out.reshape(x.shape)
