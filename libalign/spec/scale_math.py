"""The floating-point operation orders that turn maxima into scales, one per peer.

Every NVFP4 producer computes the same three quantities, but in a different fp32 order,
and a different order flips bits at exact ties (common for bf16 data):

* the outer scales from the outer maximum ``A``: an encode scale ``enc ~ 2688 / A`` and
  a decode scale ``dec ~ A / 2688`` (``fl(1 / fl(2688 / A))`` differs from ``fl(A / 2688)``
  for 29 % of bf16 amax values, so which one is computed matters);
* the block scale before its E4M3 cast, from the block maximum ``v``;
* the element encoding: ``x`` times a multiplier, or ``x`` divided by a divisor.

Each order below is written in exactly the operations, dtypes and association of the
library it is named after (``fl`` is one IEEE fp32 rounding). The spec combines one of
them with its policies (floors, zero handling, signed zero) in :mod:`libalign.spec`.

``te`` (TransformerEngine's reference and kernels; also miniTE; with 4-over-6 the 2688 is
``6 * e4m3_max``, 1536 under the bound 256)::

    enc = fl(2688 / A), min FLT_MAX, 0 -> 1     dec = fl(1 / enc)
    pre = min(fl(v * fl(enc * fl(1/6))), FLT_MAX)
    x_scaled = fl(x * min(fl(1 / fl(s * dec)), FLT_MAX))

``torchao`` (``nvfp4_quantize`` with a per-tensor scale)::

    dec = fl(A / 2688)                           enc = fl(1 / dec)
    pre = fl(fl(v / 6) / dec)
    x_scaled = fl(x * fl(enc / s))

``modelopt`` (``NVFP4QTensor.quantize``)::

    dec = fl(A / 2688)                           enc = fl(1 / dec)
    pre = fl(v / fl(6 * dec))
    x_scaled = fl(x / fl(s * dec))

``compressed_tensors`` (``generate_gparam`` / ``calculate_qparams`` / ``quantize``): the
global scale and ``v / 6`` are computed in the *model dtype* ``t`` (bf16 for a bf16
checkpoint; ``t(.)`` is one rounding to it), and ``2688.0 / tensor`` is PyTorch's
reflected division, a reciprocal followed by a multiply::

    enc = fp32( t(t(1 / t(max(A, tiny_t))) * 2688) ), NaN/Inf -> 1
    pre = fl(enc * t(v / 6))
    x_scaled = fl(x / fl(s / enc))

``flashinfer`` (FlashInfer's exact-math FP4 quantizer, ``cvt_warp_fp16_to_fp4`` with
``DISABLE_FP4_QUANT_FAST_MATH``, fed the way SGLang's NVFP4 KV cache feeds it: the global
scale ``g`` is a *decode* scale, one per layer for K and one for V, and the kernel receives
``S = fl(1 / g)``). The kernel's encode step inverts ``S`` again, and ``fl(1 / fl(1 / g))`` is
not always ``g``; reads multiply by ``g`` itself (FlashInfer ``fb28d7242b35``,
``csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh``; SGLang 0.5.23,
``srt/layers/quantization/kvfp4_tensor.py`` ``NVFP4KVQuantizeUtil``)::

    enc = fl(1 / dec)                            dec = g (given; from A: fl(A / 2688))
    pre = min(fl(v * fl(enc * fl(1/6))), FLT_MAX)
    x_scaled = fl(x * min(fl(1 / fl(s * fl(1 / enc))), FLT_MAX))

MXFP4 orders (E8M0 block scales, no outer scale; ``b`` is the scale byte, the scale is
``2^(b-127)``, ``e(a)`` the biased exponent field of fp32 ``a`` and ``m(a)`` its mantissa
field). The three torchao modes take the exponent of the block maximum ``v`` and subtract
2 (= floor(log2 6)), clamped to bytes [0, 255]; ``mx_floor`` is OCP's rule and torchao's
default, ``mx_ceil`` adds one when ``m(v) > 0``, ``mx_even`` first rounds ``v`` to one
mantissa bit (``bits + 2^21``, mantissa cleared)::

    b = clamp(e(v) - 2 [+ ceil/even adjustment], 0, 255)
    x_scaled = fl(x / max(2^(b-127), 2^-126))      # torchao divides byte 0 by 2^-126

``mx_te`` is TransformerEngine's ``float_to_e8m0`` (round the fp32 descale up to a power
of two, what ``cvt.rp.satfinite.ue8m0x2.f32`` does) with FP4's ``max_norm_rcp``::

    d = fl(v * fl(1/6));  b = e(d) + (m(d) > 0), except: d == 0 -> 0, a subnormal d with
    m(d) <= 2^22 stays 0, e(d) == 254 never rounds up
    x_scaled = fl(x * (b == 0 ? 1 : 2^(127-b)))

``mx_sglang`` is SGLang's ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` (an exponent-only
byte per *16* values, ``--kv-cache-dtype fp4_mx_block16``), as ``torch.compile`` runs it:
the input upcast to fp32 and every step in fp32. ``log2r`` is the fp32 logarithm rounded to
nearest (for a block maximum that came from bf16 or fp16 the rounding never matters: the
quotient is a power of two exactly or more than 2^-12 away from one)::

    q = max(fl(v / 6), fl(1e-10));  b = ceil(log2r(q)) + 127      (b in [94, 253])
    x_scaled = fl(x / 2^(b-127))                                   # exact

Dequantization orders: ``te`` and ``flashinfer`` multiply ``fl(fl(q * s) * dec)`` (``q * s`` is exact, so a
single rounding); ``torchao`` and ``modelopt`` ``fl(q * fl(dec * s))``, where ModelOpt's
value table decodes the negative-zero code 0x8 as +0.0; ``compressed_tensors``
``fl(q * fl(s / enc))``; the MX orders ``fl(q * s)`` (exact but for underflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libalign.errors import SpecError
from libalign.spec.choices import OpOrder
from libalign.spec.constants import (
    E2M1_MAX,
    E2M1_MAX_POW2,
    E4M3_MAX,
    E8M0_EXPONENT_BIAS,
    FLT_MAX,
    FP8_TIMES_FP4_MAX,
)

#: NVFP4 orders (E4M3 block scales, an outer scale).
NV_ORDERS = tuple(o.value for o in OpOrder if not o.is_mx)
#: Exponent-only orders (E8M0 block scales, no outer scale).
MX_ORDERS = tuple(o.value for o in OpOrder if o.is_mx)
OP_ORDERS = OpOrder.values()

_F32 = torch.float32


@dataclass(frozen=True)
class OuterScales:
    """Outer scales in both conventions, fp32, broadcastable against block tensors.

    ``enc`` multiplies to encode (about 2688 / amax); ``dec`` multiplies to decode
    (about amax / 2688). Under a given order each is a fixed function of the other.
    """

    enc: torch.Tensor
    dec: torch.Tensor


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=_F32, device=like.device)


def outer_from_amax(amax: torch.Tensor, order: str, math_dtype: torch.dtype,
                    e4m3_max: float = E4M3_MAX) -> OuterScales:
    """Outer scales from the (already floored) fp32 outer maximum under ``order``; ``e4m3_max``
    (``te`` only: 448, or 256 for 4-over-6) is the bound the maximum's block scale maps to."""
    a = amax.to(_F32)
    if order == "te":
        enc = torch.div(_f32(e4m3_max * E2M1_MAX, a), a)
        enc = torch.minimum(enc, _f32(FLT_MAX, a))
        enc = torch.where(enc == 0, _f32(1.0, a), enc)
        return OuterScales(enc=enc, dec=torch.div(_f32(1.0, a), enc))
    if order in ("torchao", "modelopt", "flashinfer"):
        dec = torch.div(a, _f32(FP8_TIMES_FP4_MAX, a))
        return OuterScales(enc=torch.div(_f32(1.0, a), dec), dec=dec)
    if order == "compressed_tensors":
        t = a.to(math_dtype)
        t = torch.clamp(t, min=torch.finfo(math_dtype).tiny)
        enc = torch.reciprocal(t) * FP8_TIMES_FP4_MAX  # what `2688.0 / t` executes
        enc = torch.nan_to_num(enc, nan=1.0, posinf=1.0, neginf=1.0).to(_F32)
        return OuterScales(enc=enc, dec=ct_dec_from_enc(enc))
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")


def ct_dec_from_enc(enc: torch.Tensor) -> torch.Tensor:
    """compressed-tensors never forms a decode scale; this is ``1 / enc`` for reporting."""
    return torch.div(_f32(1.0, enc), enc)


def outer_from_stored(stored: torch.Tensor, convention: str, order: str,
                      math_dtype: torch.dtype = _F32, e4m3_max: float = E4M3_MAX) -> OuterScales:
    """The one place that converts a stored outer scale into both conventions.

    ``amax`` reruns the order's formulas; ``enc`` and ``dec`` take the other one as the
    order derives it (``1 / x`` for every order here).
    """
    s = stored.to(_F32)
    if convention == "amax":
        return outer_from_amax(s, order, math_dtype, e4m3_max)
    if convention == "enc":
        return OuterScales(enc=s, dec=torch.div(_f32(1.0, s), s))
    if convention == "dec":
        return OuterScales(enc=torch.div(_f32(1.0, s), s), dec=s)
    raise SpecError(f"outer convention must be 'amax', 'enc' or 'dec', got {convention!r}")


def stored_from_outer(outer: OuterScales, amax: torch.Tensor, convention: str) -> torch.Tensor:
    """Pick the tensor to store for ``convention`` from the computed scales."""
    return {"amax": amax.to(_F32), "enc": outer.enc, "dec": outer.dec}[convention]


def block_prescale(vmax: torch.Tensor, outer: OuterScales, order: str,
                   math_dtype: torch.dtype = _F32) -> torch.Tensor:
    """fp32 block scale before clamping and the E4M3 cast, from fp32 block maxima."""
    if order in ("te", "flashinfer"):
        mult = outer.enc * torch.reciprocal(_f32(E2M1_MAX, vmax))
        return torch.minimum(vmax * mult, _f32(FLT_MAX, vmax))
    if order == "torchao":
        # a tensor divisor keeps this a true division on every device: PyTorch on CUDA
        # turns `tensor / python_float` into a multiply by the rounded reciprocal
        return torch.div(vmax, _f32(E2M1_MAX, vmax)) / outer.dec
    if order == "modelopt":
        return vmax / (E2M1_MAX * outer.dec)
    if order == "compressed_tensors":
        six = torch.tensor(E2M1_MAX, dtype=math_dtype, device=vmax.device)
        # the fp32 product CT forms with its 1-element global scale (never a bf16 product)
        return outer.enc * (vmax.to(math_dtype) / six).to(_F32)
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")


def encode_blocks(x: torch.Tensor, s: torch.Tensor, outer: OuterScales, order: str) -> torch.Tensor:
    """Scaled fp32 elements (before clamping to +-6) for blocks with non-zero scale.

    ``x`` is ``[..., nb, 16]`` fp32, ``s`` the decoded fp32 block scales ``[..., nb, 1]``.
    Blocks whose scale is zero get their multiplier from the spec's policy instead. The MX
    orders ignore ``outer`` (MXFP4 has no outer scale); ``s`` is the decoded E8M0 scale.
    """
    if order in MX_ORDERS:
        return _mx_encode(x, s, order)
    if order == "te":
        mult = torch.minimum(torch.reciprocal(s * outer.dec), _f32(FLT_MAX, x))
        return x * mult
    if order == "flashinfer":
        dec = torch.div(_f32(1.0, x), outer.enc)  # the kernel's 1 / S, not the given g
        return x * torch.minimum(torch.reciprocal(s * dec), _f32(FLT_MAX, x))
    if order == "torchao":
        return x * (outer.enc / s)
    if order == "modelopt":
        return x / (s * outer.dec)
    if order == "compressed_tensors":
        return x / (s / outer.enc)
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")


def e8m0_block_scales(vmax: torch.Tensor, order: str) -> torch.Tensor:
    """E8M0 scale bytes (uint8) from finite, non-negative fp32 block maxima under an MX order."""
    a = vmax.to(_F32).contiguous()
    if order == "mx_sglang":
        return _sglang_block16_bytes(a)
    if order == "mx_te":
        d = (a * _f32(1.0 / E2M1_MAX, a)).view(torch.int32)
        exp, man = d >> 23, d & 0x7FFFFF
        up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
        return (exp + up.to(torch.int32)).to(torch.uint8)  # d == 0 gives exp 0, man 0: 0x00
    bits = a.view(torch.int32)
    if order == "mx_even":
        bits = (bits + (1 << 21)) & 0x7F800000
    elif order not in ("mx_floor", "mx_ceil"):
        raise SpecError(f"unknown MX op_order {order!r}; expected one of {MX_ORDERS}")
    unbiased = ((bits >> 23) & 0xFF) - E8M0_EXPONENT_BIAS
    if order == "mx_ceil":
        unbiased = unbiased + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    scale = torch.clamp(unbiased - E2M1_MAX_POW2, -E8M0_EXPONENT_BIAS, E8M0_EXPONENT_BIAS + 1)
    return (scale + E8M0_EXPONENT_BIAS).to(torch.uint8)


#: SGLang's lower clamp of ``v / 6`` before the logarithm (``torch.clamp(..., min=1e-10)``), in fp32.
SGLANG_BLOCK16_FLOOR = float(torch.tensor(1e-10, dtype=_F32))


def _sglang_block16_bytes(a: torch.Tensor) -> torch.Tensor:
    """``ceil(log2r(max(fl(a / 6), 1e-10))) + 127`` for fp32 block maxima ``a`` (uint8)."""
    q = torch.clamp(torch.div(a, _f32(E2M1_MAX, a)), min=SGLANG_BLOCK16_FLOOR)
    # the fp32 logarithm rounded to nearest: float64's log2 is within 2^-52 of the true value,
    # far below half an fp32 ulp, so one rounding of it is the nearest fp32
    e = torch.ceil(torch.log2(q.to(torch.float64)).to(_F32))
    return (e + E8M0_EXPONENT_BIAS).to(torch.uint8)


def _mx_encode(x: torch.Tensor, s: torch.Tensor, order: str) -> torch.Tensor:
    if order == "mx_te":
        rcp = torch.where(s == 2.0 ** -E8M0_EXPONENT_BIAS, _f32(1.0, s), torch.div(_f32(1.0, s), s))
        return x * rcp
    return x / torch.clamp(s, min=_f32(2.0 ** (1 - E8M0_EXPONENT_BIAS), s))


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, outer: OuterScales, order: str) -> torch.Tensor:
    """fp32 values from E2M1 values ``q`` ``[..., nb, B]`` and block scales ``[..., nb, 1]``."""
    if order in MX_ORDERS:
        return q * s
    if order in ("te", "flashinfer"):
        return (q * s) * outer.dec
    if order == "torchao":
        return q * (outer.dec * s)
    if order == "modelopt":
        return (q + 0.0) * (outer.dec * s)  # ModelOpt's value table maps 0x8 to +0.0
    if order == "compressed_tensors":
        return q * (s / outer.enc)
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")
