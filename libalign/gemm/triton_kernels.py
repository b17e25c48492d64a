"""Triton kernels of the emulated W4A4 expert GEMM on GPUs without FP4 tensor cores (Hopper).

Reached only through :mod:`libalign.gemm.triton_grouped`. Two phases implement
:mod:`libalign.gemm`'s three steps:

``act_codes`` (phase 1)
    One pass over the activations ``[M, K]``: the row maximum (or a given tensor maximum),
    the outer scales, the E4M3 block scales and the E2M1 codes, all in the ``te`` fp32
    operation order of :mod:`libalign.spec.scale_math` (true IEEE divisions through ``div_rn``,
    the E4M3 cast by the hardware converter, ties-to-even E2M1 by midpoint counting), then
    writes the packed codes (uint8 ``[M, K/2]``, the even element in the low nibble), the
    E4M3 block-scale bytes (uint8 ``[M, K/16]``) and the fp32 row decode scales. A zero
    magnitude is code 0x0 whatever its sign (positive zeros), so a code decodes to exactly
    the inner value ``code * block_scale`` the GEMM multiplies. A row holding NaN/Inf gets a
    NaN decode scale, which the caller checks. ``guided_act_qdq`` is the same pass with the
    rows that have a sampler's record rounded by it (TRACE). The rounding has one home:
    ``_rne_blocks`` (round to nearest) and ``_guided_levels`` (TRACE) give E2M1 magnitudes,
    signs and block scales, written as values (``_signed_values``) or as codes
    (``_store_codes``).
``grouped_gemm_codes`` (phase 2)
    A bf16 tensor-core GEMM over the padded expert layout: each ``BM``-row tile belongs to
    one expert (``tile_expert``), its weights are that expert's exact inner values; each
    activation tile is loaded as codes and scale bytes and decoded in registers to the same
    exact bf16 inner values; fp32 accumulation; the epilogue
    ``bf16(acc * (a_dec[m] * w_dec[n]))``.

The one-phase form writes the inner values as a bf16 tensor instead (``act_qdq``) and the
GEMM reads them as they are (``grouped_gemm``): four times the bytes between the two kernels,
the same dot operands and so the same output bits. ``act_qdq`` with ``dequantize`` writes the
values read back, ``fl(inner * dec)`` in the input's dtype: a fake-quantized tensor (the
learner's FP4 K/V, :func:`libalign.gemm.triton_grouped.triton_qdq_rows`) in one pass.

Weights are quantized once per version (``libalign.gemm.prepare_weights``), so the per-call
cost over a bf16 grouped GEMM is the activation pass, the tile decode and the epilogue's two
scale loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _block_scales(x, enc):
    """E4M3 block scales of fp32 blocks ``x`` [R, B, 16] under row encode scales ``enc`` [R]
    (te order): ``e4m3(min(fl(vmax * fl(enc * fl(1/6))), 448))``, as float8 [R, B]."""
    vmax = tl.max(tl.abs(x), axis=2)
    sixth = tl.math.div_rn(tl.full(enc.shape, 1.0, tl.float32), tl.full(enc.shape, 6.0, tl.float32))
    pre = tl.minimum(vmax * (enc * sixth)[:, None], _FLT_MAX)
    return tl.minimum(pre, 448.0).to(tl.float8e4nv)


@triton.jit
def _normalized(x, s, dec):
    """``x`` [R, B, 16] times ``fl(1 / fl(s * dec))`` (0 where the block scale ``s`` is 0):
    the values E2M1 rounds, before any clamp."""
    sd = s * dec[:, None]
    mult = tl.minimum(tl.math.div_rn(tl.full(sd.shape, 1.0, tl.float32), sd), _FLT_MAX)
    mult = tl.where(s == 0.0, 0.0, mult)
    return x * mult[:, :, None]


@triton.jit
def _rne_magnitude(a):
    """The E2M1 magnitude nearest to ``a`` (0 <= a <= 6), ties to the even level: midpoint
    counting. The one home of round-to-nearest; codes come from it by :func:`_magnitude_index`."""
    mag = tl.where(a > 0.25, 0.5, 0.0)
    mag = tl.where(a >= 0.75, 1.0, mag)
    mag = tl.where(a > 1.25, 1.5, mag)
    mag = tl.where(a >= 1.75, 2.0, mag)
    mag = tl.where(a > 2.5, 3.0, mag)
    mag = tl.where(a >= 3.5, 4.0, mag)
    return tl.where(a > 5.0, 6.0, mag)


@triton.jit
def _magnitude_index(mag):
    """The level index (0..7, the code's low 3 bits) of an E2M1 magnitude, from its fp32 bits:
    from 1.0 up the exponent and the one mantissa bit, ``(bits >> 22) - 252``; 1 for 0.5."""
    bits = mag.to(tl.int32, bitcast=True)
    return tl.where(mag >= 1.0, (bits >> 22) - 252, tl.where(mag > 0.0, 1, 0))


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
def _rne_blocks(x, enc, dec):
    """fp32 blocks ``x`` [R, B, 16] rounded to nearest (te order): the normalized values ``z``,
    the E2M1 magnitudes of ``|z|`` and the float8 block scales [R, B]."""
    s8 = _block_scales(x, enc)
    z = _normalized(x, s8.to(tl.float32), dec)
    return z, _rne_magnitude(tl.minimum(tl.abs(z), 6.0)), s8


@triton.jit
def _store_codes(codes_ptr, scales_ptr, rows, b, mag, neg, sbyte, mask, stride_c, stride_s):
    """Store E2M1 magnitudes [R, B, 16] with signs ``neg`` as packed codes (two a byte, the even
    element in the low nibble: :func:`libalign.spec.packing.pack_nibbles`) at ``codes_ptr``
    [M, K/2], a zero magnitude as 0x0 whatever its sign (positive zeros), and the E4M3
    block-scale bytes ``sbyte`` [R, B] at ``scales_ptr`` [M, K/16]; ``mask`` [R, B]."""
    idx = _magnitude_index(mag)
    code = tl.where(neg & (idx > 0), idx | 8, idx)
    lo, hi = tl.split(tl.reshape(code, [code.shape[0], code.shape[1], 8, 2]))
    r64 = rows.to(tl.int64)
    jj = tl.arange(0, 8)
    tl.store(codes_ptr + r64[:, None, None] * stride_c + b[None, :, None] * 8 + jj[None, None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=mask[:, :, None])
    tl.store(scales_ptr + r64[:, None] * stride_s + b[None, :], sbyte, mask=mask)


@triton.jit
def _signed_values(mag, neg, s):
    """Inner values ``code * block scale`` of E2M1 magnitudes [R, B, 16] with signs ``neg``
    under fp32 block scales ``s`` [R, B]: exact, a zero +0.0 (Triton's unary minus is
    ``0 - x``)."""
    return tl.where(neg, -mag, mag) * s[:, :, None]


@triton.jit
def _store_values(out_ptr, rows, cols, mask, val, dec, stride_o, OUT: tl.constexpr):
    """Store inner values [R, B, 16] (``OUT`` 0, bf16 exact) or the values read back
    ``fl(inner * dec)`` (``OUT`` 1, one rounding to ``out_ptr``'s dtype); ``mask`` [R, B]."""
    if OUT == 1:
        val = val * dec[:, None, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None, None] * stride_o + cols,
             val.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])


@triton.jit
def _emit(out_ptr, scales_ptr, rows, b, cols, mask, mag, neg, s, sbyte, dec, stride_o, stride_s,
          OUT: tl.constexpr):
    """Write blocks [R, B, 16] of E2M1 magnitudes ``mag`` with signs ``neg`` under block scales
    ``s`` [R, B] (fp32; their E4M3 bytes ``sbyte``) as the pass's ``OUT`` says: 0 the inner
    values, 1 the values read back (:func:`_store_values`), 2 packed codes and scale bytes
    (:func:`_store_codes`). ``mask`` [R, B] marks the blocks that exist."""
    if OUT == 2:
        _store_codes(out_ptr, scales_ptr, rows, b, mag, neg, sbyte, mask, stride_o, stride_s)
    else:
        _store_values(out_ptr, rows, cols, mask, _signed_values(mag, neg, s), dec, stride_o, OUT)


@triton.jit
def _act_qdq_kernel(x_ptr, out_ptr, scales_ptr, dec_ptr, amax_ptr, M, KB, stride_x, stride_o,
                    stride_s, AMAX_FLOOR: tl.constexpr, HAS_FLOOR: tl.constexpr,
                    TENSOR_AMAX: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
                    OUT: tl.constexpr):
    # a [ROWS, NB, 16] tile holds whole rows: one row per ROWS index, one 16-element block
    # per NB index, so block and row maxima are plain reductions (no reshapes)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, NB)
    j = tl.arange(0, 16)
    cols = blk[None, :, None] * 16 + j[None, None, :]
    rmask = rows < M
    bmask = rmask[:, None] & (blk < KB)[None, :]  # whole blocks: K % 16 == 0
    r64 = rows[:, None, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=bmask[:, :, None], other=0.0).to(tl.float32)
    poison = tl.sum(tl.sum(x * 0.0, axis=2), axis=1)  # NaN iff the row holds NaN or Inf
    if TENSOR_AMAX:
        amax = tl.load(amax_ptr) + tl.zeros([ROWS], dtype=tl.float32)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    z, mag, s8 = _rne_blocks(x, enc, dec)
    _emit(out_ptr, scales_ptr, rows, blk, cols, bmask, mag, z < 0.0, s8.to(tl.float32),
          s8.to(tl.uint8, bitcast=True), dec, stride_o, stride_s, OUT)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, dec, float("nan")), mask=rmask)


@triton.jit
def _act_qdq_chunked_kernel(x_ptr, out_ptr, scales_ptr, dec_ptr, amax_ptr, M, KB, stride_x,
                            stride_o, stride_s, AMAX_FLOOR: tl.constexpr,
                            HAS_FLOOR: tl.constexpr, TENSOR_AMAX: tl.constexpr,
                            ROWS: tl.constexpr, CB: tl.constexpr, OUT: tl.constexpr):
    # rows whose block count is not a power of two: walk them in chunks of CB blocks, once
    # for the row maxima and once to encode (the second read mostly hits L2), so no lane
    # idles on padding
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, CB)
    j = tl.arange(0, 16)
    rmask = rows < M
    r64 = rows[:, None, None].to(tl.int64)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    poison = tl.zeros([ROWS], dtype=tl.float32)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        poison += tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
    if TENSOR_AMAX:
        amax = tl.load(amax_ptr) + tl.zeros([ROWS], dtype=tl.float32)
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        bmask = rmask[:, None] & (b < KB)[None, :]
        x = tl.load(x_ptr + r64 * stride_x + cols, mask=bmask[:, :, None], other=0.0).to(tl.float32)
        z, mag, s8 = _rne_blocks(x, enc, dec)
        _emit(out_ptr, scales_ptr, rows, b, cols, bmask, mag, z < 0.0, s8.to(tl.float32),
              s8.to(tl.uint8, bitcast=True), dec, stride_o, stride_s, OUT)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, dec, float("nan")), mask=rmask)


_VALUES, _READ_BACK, _CODES = 0, 1, 2
"""What an activation pass writes (its ``OUT``): inner values, values read back, codes."""


def _act_pass(x, out, scales, dec, *, amax_floor, tensor_amax, elems, num_warps, chunk, mode):
    """Launch the whole-row or the chunked activation kernel over rows ``x`` [M, K]."""
    m, k = x.shape
    if m == 0:
        return
    kb = k // 16
    nb = triton.next_power_of_2(kb)
    amax = tensor_amax if tensor_amax is not None else dec  # unused pointer when per row
    common = dict(AMAX_FLOOR=float(amax_floor or 0.0), HAS_FLOOR=amax_floor is not None,
                  TENSOR_AMAX=tensor_amax is not None, OUT=mode, num_warps=num_warps)
    args = (x, out, scales, dec, amax, m, kb, x.stride(0), out.stride(0), scales.stride(0))
    if nb == kb or chunk == 0 or (chunk is None and nb <= 8):  # whole rows in one tile
        rows = max(1, min(64, elems // (16 * nb)))
        _act_qdq_kernel[(triton.cdiv(m, rows),)](*args, ROWS=rows, NB=nb, **common)
    else:
        cb = chunk or 16
        rows = max(1, min(64, elems // (16 * cb)))
        _act_qdq_chunked_kernel[(triton.cdiv(m, rows),)](*args, ROWS=rows, CB=cb, **common)


def _rows_ok(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % 16 or x.stride(-1) != 1:
        raise ValueError(f"{what} needs contiguous rows whose length is a multiple of 16")


def act_qdq(x: torch.Tensor, *, amax_floor: float | None, tensor_amax: torch.Tensor | None,
            out: torch.Tensor | None = None, dec_out: torch.Tensor | None = None,
            elems: int = 4096, num_warps: int = 4, chunk: int | None = None,
            dequantize: bool = False):
    """Inner values (bf16 ``[M, K]``) and fp32 row decode scales ``[M]`` of activations.

    Rows of a power-of-two block count are read once as whole-row tiles; others in chunks of
    ``chunk`` blocks (default 16; 0 forces whole-row tiles padded to a power of two).
    ``dequantize`` writes the values read back instead, ``fl(inner * dec)`` rounded once to
    ``x``'s dtype (what ``(inner.float() * dec[:, None]).to(x.dtype)`` gives).
    """
    _rows_ok(x, "act_qdq")
    m, k = x.shape
    inner = out if out is not None else torch.empty(
        (m, k), dtype=x.dtype if dequantize else torch.bfloat16, device=x.device)
    dec = torch.empty((m,), dtype=torch.float32, device=x.device) if dec_out is None else dec_out
    _act_pass(x, inner, dec, dec, amax_floor=amax_floor, tensor_amax=tensor_amax, elems=elems,
              num_warps=num_warps, chunk=chunk, mode=_READ_BACK if dequantize else _VALUES)
    return inner, dec


def code_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty packed-code ``[m, K/2]`` and scale-byte ``[m, K/16]`` uint8 buffers; the codes'
    rows start 16 bytes apart (the stride a TMA descriptor needs), whatever K is."""
    kc = k // 2
    codes = torch.empty((m, kc), dtype=torch.uint8, device=device) if kc % 16 == 0 else \
        torch.empty((m, -(-kc // 16) * 16), dtype=torch.uint8, device=device)[:, :kc]
    return codes, torch.empty((m, k // 16), dtype=torch.uint8, device=device)


def act_codes(x: torch.Tensor, *, amax_floor: float | None, tensor_amax: torch.Tensor | None,
              codes_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None,
              dec_out: torch.Tensor | None = None, elems: int = 4096, num_warps: int = 4,
              chunk: int | None = None):
    """Packed E2M1 codes (uint8 ``[M, K/2]``, the even element in the low nibble), E4M3 block
    scale bytes (uint8 ``[M, K/16]``) and fp32 row decode scales ``[M]`` of activations.

    :func:`act_qdq`'s pass with the same codes and scales, written as bits instead of values
    (a fourth of the bytes): a zero magnitude is code 0x0 (positive zeros), so decoding them,
    ``code * block scale``, gives :func:`act_qdq`'s inner values bit for bit. A row holding
    NaN/Inf gets a NaN decode scale. ``chunk``, ``elems``, ``num_warps``: as :func:`act_qdq`'s.
    """
    _rows_ok(x, "act_codes")
    m, k = x.shape
    codes, scales = (codes_out, scales_out) if codes_out is not None else \
        code_buffers(m, k, x.device)
    dec = torch.empty((m,), dtype=torch.float32, device=x.device) if dec_out is None else dec_out
    _act_pass(x, codes, scales, dec, amax_floor=amax_floor, tensor_amax=tensor_amax, elems=elems,
              num_warps=num_warps, chunk=chunk, mode=_CODES)
    return codes, scales, dec


@triton.jit
def _guided_levels(x, s, dec, g, up_ptr, down_ptr, BITS: tl.constexpr):
    """Signed levels (int32 -7..7, positive zeros) of fp32 blocks ``x`` [R, B, 16] rounded by
    the sampler's low bits ``g`` under its E4M3 block scales ``s`` [R, B] (fp32) and row decode
    scales ``dec`` [R] (te order): :func:`libalign.spec.normalized_with_scales`, then
    :func:`libalign.spec.rounding.round_e2m1_guided` with positive zeros."""
    z = tl.minimum(tl.maximum(_normalized(x, s, dec), -6.0), 6.0)
    a = tl.abs(z)
    rne = _magnitude_index(_rne_magnitude(a))  # the RNE level, as _rne_blocks rounds
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
    return tl.where(lower_hit, lower, tl.where(upper_hit, upper, outside))


@triton.jit
def _guided_qdq_kernel(x_ptr, out_ptr, scales_ptr, dec_ptr, src_ptr, low_ptr, bs_ptr, rs_ptr,
                       e4m3_ptr, up_ptr, down_ptr, M, stride_x, stride_o, stride_s, stride_low,
                       stride_bs, KB: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                       HAS_FLOOR: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                       CB: tl.constexpr, OUT: tl.constexpr):
    # rows with a record (src >= 0) take its block and row scales and its low code bits;
    # the others round to nearest under their own scales, as _act_qdq_chunked_kernel does
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, CB)
    j = tl.arange(0, 16)
    rmask = rows < M
    r64 = rows[:, None, None].to(tl.int64)
    src = tl.load(src_ptr + rows, mask=rmask, other=-1)
    guided = src >= 0
    s64 = tl.where(guided, src, 0).to(tl.int64)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    poison = tl.zeros([ROWS], dtype=tl.float32)
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        mask = rmask[:, None, None] & (b < KB)[None, :, None]
        x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        poison += tl.sum(tl.sum(x * 0.0, axis=2), axis=1)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
    enc, dec = _outer(amax, AMAX_FLOOR, HAS_FLOOR)
    rs = tl.load(rs_ptr + s64, mask=rmask & guided, other=1.0)
    read_dec = tl.where(guided, rs, dec)  # the row's decode scale: the record's or its own
    for c in range(0, KB, CB):
        b = c + blk
        cols = b[None, :, None] * 16 + j[None, None, :]
        bmask = rmask[:, None] & (b < KB)[None, :]
        x = tl.load(x_ptr + r64 * stride_x + cols, mask=bmask[:, :, None], other=0.0).to(tl.float32)
        z, mag, s8 = _rne_blocks(x, enc, dec)
        own = _signed_values(mag, z < 0.0, s8.to(tl.float32))  # (unused when writing codes)
        gmask = (rmask & guided)[:, None] & (b < KB)[None, :]
        sb = tl.load(bs_ptr + s64[:, None] * stride_bs + b[None, :], mask=gmask, other=0)
        s = tl.load(e4m3_ptr + sb.to(tl.int32))
        g = tl.load(low_ptr + s64[:, None, None] * stride_low + cols,
                    mask=gmask[:, :, None], other=0).to(tl.int32)
        level = _guided_levels(x, s, rs, g, up_ptr, down_ptr, BITS)
        sel = guided[:, None, None]
        gmag = _e2m1_magnitude(tl.abs(level))
        if OUT == 2:  # the record's scale bytes; levels as signed magnitudes
            _store_codes(out_ptr, scales_ptr, rows, b, tl.where(sel, gmag, mag),
                         tl.where(sel, level < 0, z < 0.0),
                         tl.where(guided[:, None], sb, s8.to(tl.uint8, bitcast=True)), bmask,
                         stride_o, stride_s)
        else:  # own values formed before the record's loads: fewer registers live across them
            val = tl.where(sel, _signed_values(gmag, level < 0, s), own)
            _store_values(out_ptr, rows, cols, bmask, val, read_dec, stride_o, OUT)
    tl.store(dec_ptr + rows, tl.where(poison == 0.0, read_dec, float("nan")), mask=rmask)


def guided_act_qdq(x: torch.Tensor, *, src: torch.Tensor, low: torch.Tensor,
                   block_scales: torch.Tensor, row_scales: torch.Tensor, bits: int,
                   amax_floor: float | None, e4m3: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, rows: int = 16, chunk: int = 16, num_warps: int = 4,
                   dequantize: bool = False, codes: bool = False):
    """Inner values (bf16 ``[M, K]``) and fp32 row decode scales ``[M]`` of guided activations.

    Row ``r`` with ``src[r] >= 0`` (int32) is rounded by record ``src[r]``: its low code bits
    ``low`` ``[n, K]`` (uint8), E4M3 block-scale bytes ``block_scales`` ``[n, K/16]`` and row
    decode scale ``row_scales`` ``[n]`` (fp32); the other rows round to nearest under their
    own scales. ``e4m3`` is the fp32 value of each E4M3 byte, ``up``/``down`` the
    nearest-matching-level tables of ``bits`` (:func:`libalign.spec.rounding.guide_tables`).
    A row holding NaN/Inf gets a NaN decode scale. ``dequantize``: as :func:`act_qdq`'s;
    ``codes``: ``(codes, scale bytes, dec)`` as :func:`act_codes` gives them (a guided row's
    scale bytes are its record's).
    """
    m, k = x.shape
    _rows_ok(x, "guided_act_qdq")
    if low.stride(-1) != 1 or block_scales.stride(-1) != 1:
        raise ValueError("guided_act_qdq needs records with contiguous rows")
    dec = torch.empty((m,), dtype=torch.float32, device=x.device)
    if codes:
        out, scales = code_buffers(m, k, x.device)
    else:
        out = torch.empty((m, k), dtype=x.dtype if dequantize else torch.bfloat16, device=x.device)
        scales = dec  # unused
    if m:
        _guided_qdq_kernel[(triton.cdiv(m, rows),)](
            x, out, scales, dec, src, low, block_scales, row_scales, e4m3, up, down, m,
            x.stride(0), out.stride(0), scales.stride(0), low.stride(0), block_scales.stride(0),
            KB=k // 16, AMAX_FLOOR=float(amax_floor or 0.0), HAS_FLOOR=amax_floor is not None,
            BITS=bits, ROWS=rows, CB=chunk,
            OUT=_CODES if codes else _READ_BACK if dequantize else _VALUES, num_warps=num_warps)
    return (out, scales, dec) if codes else (out, dec)


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
        _inner_from_codes_kernel[(triton.cdiv(n, block),)](codes, scales, e4m3, out, n, BLOCK=block)
    return out


def _set_blocks(nargs):
    """The autotuner's pre-hook: each descriptor's block shape for the config being tried."""
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    if "c_desc" in nargs:  # packed codes: two a byte
        nargs["c_desc"].block_shape = [bm, bk // 2]
    else:
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


CONFIGS = _configs()
"""The tile configurations both GEMM kernels are tuned over (and tests may name one of)."""


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


@triton.jit
def _store_tile(o_desc, acc, a_dec_ptr, w_dec_ptr, e, pid_m, pid_n, N, BM: tl.constexpr,
                BN: tl.constexpr):
    """The epilogue: ``out = fl(acc * fl(a_dec[m] * w_dec[n]))`` in the output's dtype."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    a_dec = tl.load(a_dec_ptr + offs_m)
    w_dec = tl.load(w_dec_ptr + e * N + offs_n, mask=offs_n < N, other=0.0)
    out = acc * (a_dec[:, None] * w_dec[None, :])
    o_desc.store([pid_m * BM, pid_n * BN], out.to(o_desc.dtype))


@triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K", "PAD"],
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
        _store_tile(o_desc, acc, a_dec_ptr, w_dec_ptr, e, pid_m, pid_n, N, BM, BN)


@triton.jit
def _code_values(c, s):
    """fp32 ``code * block scale`` of the E2M1 codes in the low 4 bits of ``c`` (int32), ``s``
    the block scales times 2^14. The code's bits placed in an fp16, ``(c & 7) << 9`` and the
    sign bit at 15, are its value times 2^-14: E2M1's two exponent bits and one mantissa bit
    land in fp16's (its subnormal 0.5 in fp16's subnormals, which no hardware flushes). The
    product is exact (at most 6 significant bits), so these are the inner values' bits."""
    h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * s


@triton.jit
def _decoded_tile(c_desc, sb, row0, ki, BM: tl.constexpr, BK: tl.constexpr):
    """The inner values [BM, BK] (fp32) of k-step ``ki``: packed codes [BM, BK/2] by TMA and
    their E4M3 scale bytes ``sb`` [BM, BK/16], decoded in registers; the nibbles interleave
    back (low first), so the elements are in the unpacked order."""
    c = c_desc.load([row0, ki * (BK // 2)]).to(tl.int32)
    s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    s2 = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BK // 16, 8]), [BM, BK // 2])
    return tl.reshape(tl.join(_code_values(c, s2), _code_values(c >> 4, s2)), [BM, BK])


@triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K", "PAD"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_gemm_codes_kernel(c_desc, w_desc, o_desc, a_dec_ptr, w_dec_ptr, tile_expert_ptr,
                               M, N, K, M_BUCKET, PAD, s_ptr, stride_s, NUM_SMS: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    # _grouped_gemm_kernel with the activations read as packed codes and scale bytes and
    # decoded on load: the same tile walk, BK steps, dot operands and epilogue, so the same
    # output bits
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        e = tl.load(tile_expert_ptr + (pid_m * BM) // PAD)
        row_w = e * N + pid_n * BN
        s_rows = s_ptr + (pid_m * BM + tl.arange(0, BM)).to(tl.int64)[:, None] * stride_s
        kb = tl.arange(0, BK // 16)
        sb = tl.load(s_rows + kb[None, :], mask=(kb < K // 16)[None, :], other=0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            # the next step's scale bytes load under this step's decode and dot (a plain load,
            # too narrow for TMA, that the pipeliner leaves synchronous)
            kb_next = (ki + 1) * (BK // 16) + tl.arange(0, BK // 16)
            sb_next = tl.load(s_rows + kb_next[None, :], mask=(kb_next < K // 16)[None, :],
                              other=0)
            a = _decoded_tile(c_desc, sb, pid_m * BM, ki, BM, BK)
            w = w_desc.load([row_w, ki * BK])
            acc = tl.dot(a.to(w.dtype), w.T, acc)
            sb = sb_next
        _store_tile(o_desc, acc, a_dec_ptr, w_dec_ptr, e, pid_m, pid_n, N, BM, BN)


_SMS: dict[int, int] = {}
_TUNED: dict[tuple, triton.Config] = {}
"""The autotuner's choice per (kernel, M bucket, N, K, padding, dtypes, device): its own key."""


def _sm_count(device: torch.device) -> int:
    dev = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(dev)
    if sms is None:
        sms = _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return sms


def _launch(kernel, descs, ptrs, extra=(), *, mp: int, n: int, k: int, pad: int,
            dtypes: tuple, device: torch.device, sms: int | None,
            config: triton.Config | None) -> None:
    """Launch a grouped GEMM kernel: ``descs(BM, BN, BK)`` its descriptors, ``ptrs`` the decode
    scales and tile experts, ``extra`` what follows the shape arguments.

    The first call of a shape lets the autotuner pick and remembers its pick in
    :data:`_TUNED`; later calls launch that config directly: the same kernel and bits, without
    the autotuner's per-call key building and pre-hook (host time is what a small call costs).
    ``config`` (and ``sms``, the persistent grid's size) fix the choice instead (tests).
    """
    sms = sms or _sm_count(device)
    m_bucket = triton.next_power_of_2(mp)
    key = (kernel.fn.__name__, m_bucket, n, k, pad, *dtypes, device.index)
    cfg = config or _TUNED.get(key)
    if cfg is None:
        def grid(meta):
            return (min(sms, triton.cdiv(mp, meta["BM"]) * triton.cdiv(n, meta["BN"])),)

        # the descriptors' block shapes are the pre-hook's to set, per config tried
        kernel[grid](*descs(16, 16, 32), *ptrs, mp, n, k, m_bucket, pad, *extra, NUM_SMS=sms)
        _TUNED[key] = kernel.best_config
        return
    bm, bn, bk = cfg.kwargs["BM"], cfg.kwargs["BN"], cfg.kwargs["BK"]
    grid = (min(sms, triton.cdiv(mp, bm) * triton.cdiv(n, bn)),)
    kernel.fn[grid](*descs(bm, bn, bk), *ptrs, mp, n, k, m_bucket, pad, *extra, NUM_SMS=sms,
                    **cfg.all_kwargs())


def _weights(w_inner: torch.Tensor, w_dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights as ``[E*N, K]`` rows and their decode scales as ``[E*N]``."""
    if not (w_inner.is_contiguous() and w_dec.is_contiguous() and w_dec.dtype == torch.float32):
        raise ValueError("grouped_gemm needs contiguous bf16 weights and fp32 [E, N] decode scales")
    e, n, k = w_inner.shape
    return w_inner.reshape(e * n, k), w_dec.reshape(-1)


def grouped_gemm(a_inner: torch.Tensor, a_dec: torch.Tensor, w_inner: torch.Tensor,
                 w_dec: torch.Tensor, tile_expert: torch.Tensor, pad: int,
                 out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None, *,
                 config: triton.Config | None = None, sms: int | None = None) -> torch.Tensor:
    """``out[Mp, N]`` of the padded layout; ``tile_expert`` holds one expert per ``pad`` rows.

    ``config`` (one of :data:`CONFIGS`) and ``sms`` (the grid's size) replace the autotuner's
    choice and the device's SM count (tests; the interpreter has neither)."""
    mp, k = a_inner.shape
    n = w_inner.shape[1]
    w2, wd = _weights(w_inner, w_dec)
    if out is None:
        out = torch.empty((mp, n), dtype=out_dtype, device=a_inner.device)
    if mp:
        _launch(_grouped_gemm_kernel, lambda bm, bn, bk: (
            TensorDescriptor.from_tensor(a_inner, [bm, bk]), TensorDescriptor.from_tensor(w2, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn])), (a_dec, wd, tile_expert), mp=mp, n=n, k=k,
            pad=pad, dtypes=(a_inner.dtype, w_inner.dtype, out.dtype), device=a_inner.device,
            sms=sms, config=config)
    return out


def grouped_gemm_codes(a_codes: torch.Tensor, a_scales: torch.Tensor, a_dec: torch.Tensor,
                       w_inner: torch.Tensor, w_dec: torch.Tensor, tile_expert: torch.Tensor,
                       pad: int, out_dtype: torch.dtype = torch.bfloat16,
                       out: torch.Tensor | None = None, *, config: triton.Config | None = None,
                       sms: int | None = None) -> torch.Tensor:
    """:func:`grouped_gemm` on activations given as packed codes ``[Mp, K/2]`` (rows 16-byte
    aligned: :func:`code_buffers`) and E4M3 scale bytes ``[Mp, K/16]`` (uint8), decoded to the
    weights' dtype inside the GEMM's loads: the same products, sums and bits, without an
    inner-value tensor."""
    mp, kc = a_codes.shape
    k, n = 2 * kc, w_inner.shape[1]
    if a_codes.dtype != torch.uint8 or a_scales.shape != (mp, k // 16) or a_scales.stride(1) != 1:
        raise ValueError("grouped_gemm_codes needs uint8 codes [Mp, K/2] and scale bytes [Mp, K/16]")
    w2, wd = _weights(w_inner, w_dec)
    if out is None:
        out = torch.empty((mp, n), dtype=out_dtype, device=a_codes.device)
    if mp:
        scales = a_scales.view(torch.uint8)
        _launch(_grouped_gemm_codes_kernel, lambda bm, bn, bk: (
            TensorDescriptor.from_tensor(a_codes, [bm, bk // 2]),
            TensorDescriptor.from_tensor(w2, [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn])),
            (a_dec, wd, tile_expert), (scales, scales.stride(0)), mp=mp, n=n, k=k, pad=pad,
            dtypes=(torch.uint8, w_inner.dtype, out.dtype), device=a_codes.device, sms=sms,
            config=config)
    return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def _overlapped(m: int, pad: int, chunks: int, device: torch.device, act, gemm) -> None:
    """``act(lo, hi)`` then ``gemm(lo, hi)`` over ``chunks`` row ranges (multiples of ``pad``),
    the pass of range i+1 on a side stream while the GEMM of range i runs."""
    step = -(-m // max(1, chunks) // pad) * pad if m else pad
    bounds = [(lo, min(m, lo + step)) for lo in range(0, m, step)]
    if len(bounds) <= 1:
        act(0, m)
        gemm(0, m)
        return
    main = torch.cuda.current_stream(device)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(dev)
    if side is None:
        side = _SIDE[dev] = torch.cuda.Stream(device=device)
    side.wait_stream(main)  # the activations (and the buffers) are ready on the main stream
    ready = []
    with torch.cuda.stream(side):
        for lo, hi in bounds:
            act(lo, hi)
            ev = torch.cuda.Event()
            ev.record(side)
            ready.append(ev)
    for (lo, hi), ev in zip(bounds, ready, strict=True):
        main.wait_event(ev)
        gemm(lo, hi)


def pipelined(a: torch.Tensor, *, amax_floor: float | None, tensor_amax: torch.Tensor | None,
              w_inner: torch.Tensor, w_dec: torch.Tensor, tile_expert: torch.Tensor, pad: int,
              out_dtype: torch.dtype = torch.bfloat16, chunks: int = 1, codes: bool = True):
    """Activation pass and GEMM over ``chunks`` row ranges, the pass of range i+1 on a side
    stream while the GEMM of range i runs (a memory-bound pass under a compute-bound GEMM).

    ``codes`` (two-phase): the pass writes packed codes and scale bytes
    (:func:`act_codes`), which :func:`grouped_gemm_codes` decodes in its loads; else the pass
    writes bf16 inner values (:func:`act_qdq`) for :func:`grouped_gemm`. Returns
    ``(out, dec)``; the bits depend neither on ``chunks`` (rows are independent) nor on
    ``codes`` (the same values reach the same dot products).
    """
    m, k = a.shape
    n = w_inner.shape[1]
    dec = torch.empty((m,), dtype=torch.float32, device=a.device)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if codes:
        c, s = code_buffers(m, k, a.device)

        def act(lo, hi):
            act_codes(a[lo:hi], amax_floor=amax_floor, tensor_amax=tensor_amax,
                      codes_out=c[lo:hi], scales_out=s[lo:hi], dec_out=dec[lo:hi])

        def gemm(lo, hi):
            grouped_gemm_codes(c[lo:hi], s[lo:hi], dec[lo:hi], w_inner, w_dec,
                               tile_expert[lo // pad:], pad, out_dtype, out=out[lo:hi])
    else:
        inner = torch.empty((m, k), dtype=torch.bfloat16, device=a.device)

        def act(lo, hi):
            act_qdq(a[lo:hi], amax_floor=amax_floor, tensor_amax=tensor_amax, out=inner[lo:hi],
                    dec_out=dec[lo:hi])

        def gemm(lo, hi):
            grouped_gemm(inner[lo:hi], dec[lo:hi], w_inner, w_dec, tile_expert[lo // pad:], pad,
                         out_dtype, out=out[lo:hi])
    _overlapped(m, pad, chunks, a.device, act, gemm)
    return out, dec
