"""Triton kernels of the emulated W4A4 expert GEMM on GPUs without FP4 tensor cores (Hopper).

Reached only through :mod:`libalign.gemm.triton_grouped`. Two kernels implement :mod:`libalign.gemm`'s three
steps:

``act_qdq``
    One pass over the activations ``[M, K]``: the row maximum (or a given tensor maximum),
    the outer scales, the E4M3 block scales and the E2M1 codes, all in the ``te`` fp32
    operation order of :mod:`libalign.spec.scale_math` (true IEEE divisions through ``div_rn``,
    the E4M3 cast by the hardware converter, ties-to-even E2M1 by midpoint counting), then
    writes the exact inner values ``code * block_scale`` as bf16 and the row decode scales.
    A row holding NaN/Inf gets a NaN decode scale, which the caller checks. With
    ``dequantize`` it writes the values read back instead, ``fl(inner * dec)`` in the input's
    dtype: a fake-quantized tensor (the learner's FP4 K/V,
    :func:`libalign.gemm.triton_grouped.triton_qdq_rows`) in one pass. ``guided_act_qdq`` is the same
    pass with the rows that have a sampler's record rounded by it (TRACE).
``grouped_gemm``
    A bf16 tensor-core GEMM over the padded expert layout: each ``BM``-row tile belongs to
    one expert (``tile_expert``), its weights are that expert's exact inner values; fp32
    accumulation; the epilogue ``bf16(acc * (a_dec[m] * w_dec[n]))``.

Weights are quantized once per version (``libalign.gemm.prepare_weights``), so the per-call
cost over a bf16 grouped GEMM is the activation pass and the epilogue's two scale loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libalign.kernels.grid import cdiv, next_power_of_2

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _outer(amax, AMAX_FLOOR: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """te order: enc = fl(2688 / A) (capped, 0 -> 1), dec = fl(1 / enc)."""
    if HAS_FLOOR:
        amax = tl.maximum(amax, AMAX_FLOOR)
    enc = tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax)
    enc = tl.minimum(enc, _FLT_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), enc)
    return enc, dec


@triton.jit
def _block_multiplier(s, dec):
    """The multiplier that normalizes a block under E4M3 block scale ``s`` [R, B] and row
    decode scale ``dec`` [R] (te order): ``min(fl(1 / fl(s * dec)), FLT_MAX)``, 0 where
    ``s`` is 0."""
    sd = s * dec[:, None]
    mult = tl.minimum(tl.math.div_rn(tl.full(sd.shape, 1.0, tl.float32), sd), _FLT_MAX)
    return tl.where(s == 0.0, 0.0, mult)


@triton.jit
def _rne_ladder(a, l0, l1, l2, l3, l4, l5, l6, l7):
    """The E2M1 level nearest a normalized magnitude ``a`` (at most 6; ties to the even
    level, by midpoint comparisons), given as ``l0`` .. ``l7``: the levels' magnitudes or
    their indices."""
    out = tl.where(a > 0.25, l1, l0)
    out = tl.where(a >= 0.75, l2, out)
    out = tl.where(a > 1.25, l3, out)
    out = tl.where(a >= 1.75, l4, out)
    out = tl.where(a > 2.5, l5, out)
    out = tl.where(a >= 3.5, l6, out)
    return tl.where(a > 5.0, l7, out)


@triton.jit
def _inner_values(x, enc, dec):
    """Exact code * block-scale values of fp32 blocks ``x`` [R, B, 16] (te order, RNE)."""
    vmax = tl.max(tl.abs(x), axis=2)
    sixth = tl.math.div_rn(tl.full(enc.shape, 1.0, tl.float32), tl.full(enc.shape, 6.0, tl.float32))
    pre = tl.minimum(vmax * (enc * sixth)[:, None], _FLT_MAX)
    s = tl.minimum(pre, 448.0).to(tl.float8e4nv).to(tl.float32)
    z = x * _block_multiplier(s, dec)[:, :, None]
    a = tl.minimum(tl.abs(z), 6.0)
    mag = _rne_ladder(a, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    return tl.where(z < 0.0, -mag, mag) * s[:, :, None]


@triton.jit
def _source_rows(src_ptr, rows, rmask, GATHER: tl.constexpr):
    """Input row of each output row and whether it is read: itself, or with ``GATHER`` the
    int32 ``src_ptr[row]`` (-1: a row of zeros, never read)."""
    if GATHER:
        src = tl.load(src_ptr + rows, mask=rmask, other=-1)
        return tl.where(src >= 0, src, 0).to(tl.int64), rmask & (src >= 0)
    return rows.to(tl.int64), rmask


@triton.jit
def _act_qdq_kernel(x_ptr, inner_ptr, dec_ptr, amax_ptr, src_ptr, M, KB, stride_x, stride_i,
                    AMAX_FLOOR: tl.constexpr, HAS_FLOOR: tl.constexpr, TENSOR_AMAX: tl.constexpr,
                    ROWS: tl.constexpr, NB: tl.constexpr, DEQUANT: tl.constexpr,
                    GATHER: tl.constexpr):
    # a [ROWS, NB, 16] tile holds whole rows: one row per ROWS index, one 16-element block
    # per NB index, so block and row maxima are plain reductions (no reshapes)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, NB)
    j = tl.arange(0, 16)
    cols = blk[None, :, None] * 16 + j[None, None, :]
    rmask = rows < M
    src, read = _source_rows(src_ptr, rows, rmask, GATHER)
    mask = rmask[:, None, None] & (blk < KB)[None, :, None]  # whole blocks: K % 16 == 0
    r64 = rows[:, None, None].to(tl.int64)
    x = tl.load(x_ptr + src[:, None, None] * stride_x + cols,
                mask=mask & read[:, None, None], other=0.0).to(tl.float32)
    poison = tl.sum(tl.sum(x * 0.0, axis=2), axis=1)  # NaN iff the row holds NaN or Inf
    if TENSOR_AMAX:
        amax = tl.load(amax_ptr) + tl.zeros([ROWS], dtype=tl.float32)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    val = _inner_values(x, enc, dec)
    if DEQUANT:  # the value read back: fl(inner * dec), one rounding to the output dtype
        val = val * dec[:, None, None]
    tl.store(inner_ptr + r64 * stride_i + cols, val.to(inner_ptr.dtype.element_ty), mask=mask)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, dec, float("nan")), mask=rmask)


@triton.jit
def _act_qdq_chunked_kernel(x_ptr, inner_ptr, dec_ptr, amax_ptr, src_ptr, M, KB, stride_x,
                            stride_i, AMAX_FLOOR: tl.constexpr, HAS_FLOOR: tl.constexpr,
                            TENSOR_AMAX: tl.constexpr, ROWS: tl.constexpr, CB: tl.constexpr,
                            DEQUANT: tl.constexpr, GATHER: tl.constexpr):
    # rows whose block count is not a power of two: walk them in chunks of CB blocks, once
    # for the row maxima and once to encode (the second read mostly hits L2), so no lane
    # idles on padding
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, CB)
    j = tl.arange(0, 16)
    rmask = rows < M
    src, read = _source_rows(src_ptr, rows, rmask, GATHER)
    s64 = src[:, None, None]
    r64 = rows[:, None, None].to(tl.int64)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    poison = tl.zeros([ROWS], dtype=tl.float32)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + s64 * stride_x + cols, mask=mask & read[:, None, None],
                    other=0.0).to(tl.float32)
        poison += tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
    if TENSOR_AMAX:
        amax = tl.load(amax_ptr) + tl.zeros([ROWS], dtype=tl.float32)
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + s64 * stride_x + cols, mask=mask & read[:, None, None],
                    other=0.0).to(tl.float32)
        val = _inner_values(x, enc, dec)
        if DEQUANT:
            val = val * dec[:, None, None]
        tl.store(inner_ptr + r64 * stride_i + cols, val.to(inner_ptr.dtype.element_ty), mask=mask)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, dec, float("nan")), mask=rmask)


def _pass_shape(x: torch.Tensor, src_rows: torch.Tensor | None, what: str) -> tuple[int, int]:
    """``(rows, K)`` an activation pass writes: ``x``'s own, or one row per ``src_rows``
    entry (which must be int32 on ``x``'s device)."""
    if src_rows is None:
        return tuple(x.shape)
    if src_rows.dtype != torch.int32 or src_rows.device != x.device:
        raise ValueError(f"{what}'s src_rows must be int32 on the activations' device")
    return src_rows.shape[0], x.shape[1]


def act_qdq(x: torch.Tensor, *, amax_floor: float | None, tensor_amax: torch.Tensor | None,
            out: torch.Tensor | None = None, dec_out: torch.Tensor | None = None,
            elems: int = 4096, num_warps: int = 4, chunk: int | None = None,
            dequantize: bool = False, src_rows: torch.Tensor | None = None):
    """Inner values (bf16 ``[M, K]``) and fp32 row decode scales ``[M]`` of activations.

    Rows of a power-of-two block count are read once as whole-row tiles; others in chunks of
    ``chunk`` blocks (default 16; 0 forces whole-row tiles padded to a power of two).
    ``dequantize`` writes the values read back instead, ``fl(inner * dec)`` rounded once to
    ``x``'s dtype (what ``(inner.float() * dec[:, None]).to(x.dtype)`` gives).
    ``src_rows`` (int32 ``[M]``, on ``x``'s device) gathers: output row ``r`` quantizes
    ``x[src_rows[r]]``, or a row of zeros where it is -1, so rows sorted by expert reach a
    padded layout in the same pass (:meth:`~libalign.gemm.row_groups.GroupLayout.source_rows`).
    """
    m, k = _pass_shape(x, src_rows, "act_qdq")
    if k % 16 or x.stride(1) != 1:
        raise ValueError("act_qdq needs contiguous rows whose length is a multiple of 16")
    inner = out if out is not None else torch.empty(
        (m, k), dtype=x.dtype if dequantize else torch.bfloat16, device=x.device)
    dec = torch.empty((m,), dtype=torch.float32, device=x.device) if dec_out is None else dec_out
    if m == 0:
        return inner, dec
    kb = k // 16
    nb = next_power_of_2(kb)
    amax = tensor_amax if tensor_amax is not None else dec  # unused pointer when per row
    common = dict(AMAX_FLOOR=float(amax_floor or 0.0), HAS_FLOOR=amax_floor is not None,
                  TENSOR_AMAX=tensor_amax is not None, DEQUANT=dequantize,
                  GATHER=src_rows is not None, num_warps=num_warps)
    src = src_rows if src_rows is not None else dec  # unused pointer without a gather
    if nb == kb or chunk == 0 or (chunk is None and nb <= 8):  # whole rows in one tile
        rows = max(1, min(64, elems // (16 * nb)))
        _act_qdq_kernel[(cdiv(m, rows),)](
            x, inner, dec, amax, src, m, kb, x.stride(0), inner.stride(0), ROWS=rows, NB=nb,
            **common)
    else:
        cb = chunk or 16
        rows = max(1, min(64, elems // (16 * cb)))
        _act_qdq_chunked_kernel[(cdiv(m, rows),)](
            x, inner, dec, amax, src, m, kb, x.stride(0), inner.stride(0), ROWS=rows, CB=cb,
            **common)
    return inner, dec


@triton.jit
def _e2m1_magnitude(i):
    """The E2M1 magnitude of level index ``i`` (0..7)."""
    v = tl.where(i >= 1, 0.5, 0.0)
    v = tl.where(i >= 2, 1.0, v)
    v = tl.where(i >= 3, 1.5, v)
    v = tl.where(i >= 4, 2.0, v)
    v = tl.where(i >= 5, 3.0, v)
    v = tl.where(i >= 6, 4.0, v)
    return tl.where(i >= 7, 6.0, v)


@triton.jit
def _level_bits(level, BITS: tl.constexpr):
    """The low bits a code at signed ``level`` carries (level 0 carries 0)."""
    if BITS == 4:  # noqa: SIM108 - a constexpr branch, resolved when Triton compiles
        out = tl.where(level < 0, (-level) | 8, level)
    else:
        out = tl.abs(level) & ((1 << BITS) - 1)
    return out


@triton.jit
def _guided_values(x, s, dec, g, up_ptr, down_ptr, BITS: tl.constexpr):
    """Inner values of fp32 blocks ``x`` [R, B, 16] rounded by the sampler's low bits ``g``
    under its E4M3 block scales ``s`` [R, B] and row decode scales ``dec`` [R] (te order):
    :func:`libalign.spec.normalized_with_scales`, then
    :func:`libalign.spec.rounding.round_e2m1_guided` with positive zeros."""
    z = tl.minimum(tl.maximum(x * _block_multiplier(s, dec)[:, :, None], -6.0), 6.0)
    a = tl.abs(z)
    rne = _rne_ladder(a, 0, 1, 2, 3, 4, 5, 6, 7)  # the RNE level, as _inner_values rounds
    lo = tl.where(a >= 0.5, 1, 0)  # the largest level whose magnitude is <= a
    lo = tl.where(a >= 1.0, 2, lo)
    lo = tl.where(a >= 1.5, 3, lo)
    lo = tl.where(a >= 2.0, 4, lo)
    lo = tl.where(a >= 3.0, 5, lo)
    lo = tl.where(a >= 4.0, 6, lo)
    lo = tl.where(a >= 6.0, 7, lo)
    hi = tl.where(_e2m1_magnitude(lo) == a, lo, tl.minimum(lo + 1, 7))
    neg = z < 0.0
    lower = tl.where(neg, -hi, lo)
    upper = tl.where(neg, -lo, hi)
    rne_level = tl.where(neg, -rne, rne)
    if BITS == 4:  # the sampler's negative zero is level 0
        g = tl.where(g == 8, 0, g)
    lower_hit = _level_bits(lower, BITS) == g
    upper_hit = _level_bits(upper, BITS) == g
    nc = 1 << BITS
    ends = tl.load(up_ptr + (upper + 7) * nc + g) + tl.load(down_ptr + (lower + 7) * nc + g)
    two_z = 2.0 * z
    outside = tl.where(ends < two_z, upper, tl.where(two_z < ends, lower, rne_level))
    level = tl.where(lower_hit, lower, tl.where(upper_hit, upper, outside))
    mag = _e2m1_magnitude(tl.abs(level))
    return tl.where(level < 0, -mag, mag) * s[:, :, None]


@triton.jit
def _guided_qdq_kernel(x_ptr, inner_ptr, dec_ptr, src_ptr, arow_ptr, low_ptr, bs_ptr, rs_ptr,
                       e4m3_ptr, up_ptr, down_ptr, M, stride_x, stride_i, stride_low, stride_bs,
                       KB: tl.constexpr, AMAX_FLOOR: tl.constexpr, HAS_FLOOR: tl.constexpr,
                       BITS: tl.constexpr, ROWS: tl.constexpr, CB: tl.constexpr,
                       DEQUANT: tl.constexpr, GATHER: tl.constexpr):
    # rows with a record (src >= 0) take its block and row scales and its low code bits;
    # the others round to nearest under their own scales, as _act_qdq_chunked_kernel does
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, CB)
    j = tl.arange(0, 16)
    rmask = rows < M
    r64 = rows[:, None, None].to(tl.int64)
    arow, read = _source_rows(arow_ptr, rows, rmask, GATHER)
    a64 = arow[:, None, None]
    src = tl.load(src_ptr + rows, mask=rmask, other=-1)
    guided = src >= 0
    s64 = tl.where(guided, src, 0).to(tl.int64)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    poison = tl.zeros([ROWS], dtype=tl.float32)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + a64 * stride_x + cols, mask=mask & read[:, None, None],
                    other=0.0).to(tl.float32)
        poison += tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    rs = tl.load(rs_ptr + s64, mask=rmask & guided, other=1.0)
    read_dec = tl.where(guided, rs, dec)  # the row's decode scale: the record's or its own
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + a64 * stride_x + cols, mask=mask & read[:, None, None],
                    other=0.0).to(tl.float32)
        own = _inner_values(x, enc, dec)
        gmask = (rmask & guided)[:, None] & (b < KB)[None, :]
        sb = tl.load(bs_ptr + s64[:, None] * stride_bs + b[None, :], mask=gmask, other=0)
        s = tl.load(e4m3_ptr + sb.to(tl.int32))
        g = tl.load(low_ptr + s64[:, None, None] * stride_low + cols,
                    mask=gmask[:, :, None], other=0).to(tl.int32)
        val = tl.where(guided[:, None, None], _guided_values(x, s, rs, g, up_ptr, down_ptr, BITS),
                       own)
        if DEQUANT:
            val = val * read_dec[:, None, None]
        tl.store(inner_ptr + r64 * stride_i + cols, val.to(inner_ptr.dtype.element_ty), mask=mask)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, read_dec, float("nan")), mask=rmask)


def guided_act_qdq(x: torch.Tensor, *, src: torch.Tensor, low: torch.Tensor,
                   block_scales: torch.Tensor, row_scales: torch.Tensor, bits: int,
                   amax_floor: float | None, e4m3: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, rows: int = 16, chunk: int = 16, num_warps: int = 4,
                   dequantize: bool = False, src_rows: torch.Tensor | None = None):
    """Inner values (bf16 ``[M, K]``) and fp32 row decode scales ``[M]`` of guided activations.

    Row ``r`` with ``src[r] >= 0`` (int32) is rounded by record ``src[r]``: its low code bits
    ``low`` ``[n, K]`` (uint8), E4M3 block-scale bytes ``block_scales`` ``[n, K/16]`` and row
    decode scale ``row_scales`` ``[n]`` (fp32); the other rows round to nearest under their
    own scales. ``e4m3`` is the fp32 value of each E4M3 byte, ``up``/``down`` the
    nearest-matching-level tables of ``bits`` (:func:`libalign.spec.rounding.guide_tables`).
    A row holding NaN/Inf gets a NaN decode scale. ``dequantize`` and ``src_rows`` (the
    input row of each output row, -1 for zeros; ``src`` is then over the output rows): as
    :func:`act_qdq`'s.
    """
    m, k = _pass_shape(x, src_rows, "guided_act_qdq")
    if k % 16 or x.stride(1) != 1 or low.stride(-1) != 1 or block_scales.stride(-1) != 1:
        raise ValueError("guided_act_qdq needs contiguous rows whose length is a multiple of 16")
    inner = torch.empty((m, k), dtype=x.dtype if dequantize else torch.bfloat16, device=x.device)
    dec = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return inner, dec
    _guided_qdq_kernel[(cdiv(m, rows),)](
        x, inner, dec, src, src if src_rows is None else src_rows, low, block_scales, row_scales,
        e4m3, up, down, m,
        x.stride(0), inner.stride(0), low.stride(0), block_scales.stride(0), KB=k // 16,
        AMAX_FLOOR=float(amax_floor or 0.0), HAS_FLOOR=amax_floor is not None, BITS=bits,
        ROWS=rows, CB=chunk, DEQUANT=dequantize, GATHER=src_rows is not None,
        num_warps=num_warps)
    return inner, dec


@triton.jit
def _inner_from_codes_kernel(codes_ptr, scales_ptr, e4m3_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # one packed byte (two codes, low nibble first) per lane; 8 bytes share a block scale
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    byte = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(e4m3_ptr + tl.load(scales_ptr + offs // 8, mask=mask, other=0).to(tl.int32))
    lo = _e2m1_magnitude(byte & 7)
    hi = _e2m1_magnitude((byte >> 4) & 7)
    # signs by multiplication: Triton's unary minus is 0 - x, which loses the sign of -0
    lo = lo * tl.where((byte & 8) != 0, -1.0, 1.0) * s
    hi = hi * tl.where((byte & 128) != 0, -1.0, 1.0) * s
    pair = tl.reshape(tl.join(lo, hi), [2 * BLOCK])
    outs = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + outs, pair.to(out_ptr.dtype.element_ty), mask=outs < 2 * N)


def inner_from_codes(codes: torch.Tensor, scales: torch.Tensor, e4m3: torch.Tensor,
                     block: int = 1024) -> torch.Tensor:
    """bf16 inner values ``[..., 2 * K/2]`` of packed codes ``[..., K/2]`` and E4M3 scale bytes
    ``[..., K/16]`` (``e4m3``: the fp32 value of each byte): one read of the bits, one write."""
    if codes.shape[-1] % 8 or scales.shape[-1] * 8 != codes.shape[-1]:
        raise ValueError("inner_from_codes needs whole 16-value blocks")
    codes, scales = codes.contiguous(), scales.view(torch.uint8).contiguous()
    out = torch.empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=torch.bfloat16,
                      device=codes.device)
    n = codes.numel()
    if n:
        _inner_from_codes_kernel[(cdiv(n, block),)](codes, scales, e4m3, out, n, BLOCK=block)
    return out


def _set_blocks(nargs):
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["o_desc"].block_shape = [bm, bn]


def _configs():
    out = []
    for bm, bn, bk, st, wp in ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 128, 3, 8),
                               (64, 256, 64, 4, 4), (128, 256, 64, 4, 8), (64, 128, 64, 4, 4)):
        for flat in (False, True):
            out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "FLATTEN": flat},
                                     num_stages=st, num_warps=wp, pre_hook=_set_blocks))
    return out


def _prune(configs, named_args, **kwargs):
    n, pad = named_args["N"], named_args["PAD"]
    keep = [c for c in configs if pad % c.kwargs["BM"] == 0 and n % c.kwargs["BN"] == 0]
    return keep or [c for c in configs if pad % c.kwargs["BM"] == 0][:2]


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each column of weights in L2."""
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "PAD"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_gemm_kernel(a_desc, w_desc, o_desc, a_dec_ptr, w_dec_ptr, tile_expert_ptr,
                         M, N, K, M_BUCKET, PAD, NUM_SMS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    # persistent: NUM_SMS programs walk the output tiles; with FLATTEN the compiler
    # pipelines the next tile's loads under this tile's epilogue
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        e = tl.load(tile_expert_ptr + (pid_m * BM) // PAD)
        row_w = e * N + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            w = w_desc.load([row_w, ki * BK])
            acc = tl.dot(a, w.T, acc)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        a_dec = tl.load(a_dec_ptr + offs_m)
        w_dec = tl.load(w_dec_ptr + e * N + offs_n, mask=offs_n < N, other=0.0)
        out = acc * (a_dec[:, None] * w_dec[None, :])
        o_desc.store([pid_m * BM, pid_n * BN], out.to(o_desc.dtype))


_SMS: dict[int, int] = {}
_TUNED: dict[tuple, triton.Config] = {}
"""The autotuner's choice per (M bucket, N, K, padding, dtypes, device): its own key."""


def grouped_gemm(a_inner: torch.Tensor, a_dec: torch.Tensor, w_inner: torch.Tensor,
                 w_dec: torch.Tensor, tile_expert: torch.Tensor, pad: int,
                 out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[Mp, N]`` of the padded layout; ``tile_expert`` holds one expert per ``pad`` rows."""
    mp, k = a_inner.shape
    e, n, _ = w_inner.shape
    if not (w_inner.is_contiguous() and w_dec.is_contiguous() and w_dec.dtype == torch.float32):
        raise ValueError("grouped_gemm needs contiguous bf16 weights and fp32 [E, N] decode scales")
    if out is None:
        out = torch.empty((mp, n), dtype=out_dtype, device=a_inner.device)
    if mp == 0:
        return out
    dev = a_inner.device.index if a_inner.device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(dev)
    if sms is None:
        sms = _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    w2 = w_inner.reshape(e * n, k)
    m_bucket = next_power_of_2(mp)
    key = (m_bucket, n, k, pad, a_inner.dtype, w_inner.dtype, out.dtype, dev)
    cfg = _TUNED.get(key)
    if cfg is None:  # first call of this shape: the autotuner picks, we remember its pick
        dummy = [16, 16]
        a_desc = TensorDescriptor.from_tensor(a_inner, dummy)
        w_desc = TensorDescriptor.from_tensor(w2, dummy)
        o_desc = TensorDescriptor.from_tensor(out, dummy)

        def grid(meta):
            return (min(sms, cdiv(mp, meta["BM"]) * cdiv(n, meta["BN"])),)

        _grouped_gemm_kernel[grid](a_desc, w_desc, o_desc, a_dec, w_dec.reshape(-1), tile_expert,
                                   mp, n, k, m_bucket, pad, NUM_SMS=sms)
        _TUNED[key] = _grouped_gemm_kernel.best_config
        return out
    # later calls launch the chosen config directly: the same kernel and bits, without the
    # autotuner's per-call key building and pre-hook (host time is what a small call costs)
    bm, bn, bk = cfg.kwargs["BM"], cfg.kwargs["BN"], cfg.kwargs["BK"]
    grid = (min(sms, cdiv(mp, bm) * cdiv(n, bn)),)
    _grouped_gemm_kernel.fn[grid](
        TensorDescriptor.from_tensor(a_inner, [bm, bk]), TensorDescriptor.from_tensor(w2, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), a_dec, w_dec.reshape(-1), tile_expert,
        mp, n, k, m_bucket, pad, NUM_SMS=sms, **cfg.all_kwargs())
    return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def pipelined(a: torch.Tensor, *, amax_floor: float | None, tensor_amax: torch.Tensor | None,
              w_inner: torch.Tensor, w_dec: torch.Tensor, tile_expert: torch.Tensor, pad: int,
              out_dtype: torch.dtype = torch.bfloat16, chunks: int = 1,
              src_rows: torch.Tensor | None = None):
    """Activation pass and GEMM over ``chunks`` row ranges, the pass of range i+1 on a side
    stream while the GEMM of range i runs (a memory-bound pass under a compute-bound GEMM).
    ``src_rows`` gathers ``a``'s rows into the padded layout in the pass (:func:`act_qdq`).

    Returns ``(out, dec)``; the bits do not depend on ``chunks`` (rows are independent).
    """
    m, k = _pass_shape(a, src_rows, "pipelined")
    n = w_inner.shape[1]
    inner = torch.empty((m, k), dtype=torch.bfloat16, device=a.device)
    dec = torch.empty((m,), dtype=torch.float32, device=a.device)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    step = -(-m // max(1, chunks) // pad) * pad if m else pad
    bounds = [(lo, min(m, lo + step)) for lo in range(0, m, step)]
    if len(bounds) <= 1:
        act_qdq(a, amax_floor=amax_floor, tensor_amax=tensor_amax, out=inner, dec_out=dec,
                src_rows=src_rows)
        grouped_gemm(inner, dec, w_inner, w_dec, tile_expert, pad, out_dtype, out=out)
        return out, dec
    main = torch.cuda.current_stream(a.device)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(dev)
    if side is None:
        side = _SIDE[dev] = torch.cuda.Stream(device=a.device)
    side.wait_stream(main)  # the activations (and the buffers) are ready on the main stream
    ready = []
    with torch.cuda.stream(side):
        for lo, hi in bounds:
            act_qdq(a if src_rows is not None else a[lo:hi], amax_floor=amax_floor,
                    tensor_amax=tensor_amax, out=inner[lo:hi], dec_out=dec[lo:hi],
                    src_rows=src_rows[lo:hi] if src_rows is not None else None)
            ev = torch.cuda.Event()
            ev.record(side)
            ready.append(ev)
    for (lo, hi), ev in zip(bounds, ready, strict=True):
        main.wait_event(ev)
        grouped_gemm(inner[lo:hi], dec[lo:hi], w_inner, w_dec, tile_expert[lo // pad:], pad,
                     out_dtype, out=out[lo:hi])
    return out, dec
