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

``te`` (TransformerEngine's reference and kernels; also miniTE)::

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

Dequantization orders: ``te`` multiplies ``fl(fl(q * s) * dec)`` (``q * s`` is exact, so a
single rounding); ``torchao`` and ``modelopt`` ``fl(q * fl(dec * s))``, where ModelOpt's
value table decodes the negative-zero code 0x8 as +0.0; ``compressed_tensors``
``fl(q * fl(s / enc))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import E2M1_MAX, FLT_MAX, FP8_TIMES_FP4_MAX
from .errors import SpecError

OP_ORDERS = ("te", "torchao", "modelopt", "compressed_tensors")

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


def outer_from_amax(amax: torch.Tensor, order: str, math_dtype: torch.dtype) -> OuterScales:
    """Outer scales from the (already floored) fp32 outer maximum under ``order``."""
    a = amax.to(_F32)
    if order == "te":
        enc = torch.div(_f32(FP8_TIMES_FP4_MAX, a), a)
        enc = torch.minimum(enc, _f32(FLT_MAX, a))
        enc = torch.where(enc == 0, _f32(1.0, a), enc)
        return OuterScales(enc=enc, dec=torch.div(_f32(1.0, a), enc))
    if order in ("torchao", "modelopt"):
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
                      math_dtype: torch.dtype = _F32) -> OuterScales:
    """The one place that converts a stored outer scale into both conventions.

    ``amax`` reruns the order's formulas; ``enc`` and ``dec`` take the other one as the
    order derives it (``1 / x`` for every order here).
    """
    s = stored.to(_F32)
    if convention == "amax":
        return outer_from_amax(s, order, math_dtype)
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
    if order == "te":
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
    Blocks whose scale is zero get their multiplier from the spec's policy instead.
    """
    if order == "te":
        mult = torch.minimum(torch.reciprocal(s * outer.dec), _f32(FLT_MAX, x))
        return x * mult
    if order == "torchao":
        return x * (outer.enc / s)
    if order == "modelopt":
        return x / (s * outer.dec)
    if order == "compressed_tensors":
        return x / (s / outer.enc)
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, outer: OuterScales, order: str) -> torch.Tensor:
    """fp32 values from E2M1 values ``q`` ``[..., nb, 16]`` and block scales ``[..., nb, 1]``."""
    if order == "te":
        return (q * s) * outer.dec
    if order == "torchao":
        return q * (outer.dec * s)
    if order == "modelopt":
        return (q + 0.0) * (outer.dec * s)  # ModelOpt's value table maps 0x8 to +0.0
    if order == "compressed_tensors":
        return q * (s / outer.enc)
    raise SpecError(f"unknown op_order {order!r}; expected one of {OP_ORDERS}")
