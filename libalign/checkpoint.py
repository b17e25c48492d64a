"""NVFP4 tensors to and from the tensor dicts of public checkpoint formats.

ModelOpt (``hf_quant_config.json`` with ``quant_algo: NVFP4``) stores per linear layer
``weight`` (uint8 packed ``[N, K/2]``), ``weight_scale`` (float8_e4m3fn ``[N, K/16]``)
and ``weight_scale_2`` (fp32 scalar, decode convention ``amax / 2688``).

compressed-tensors (``nvfp4-pack-quantized``) stores ``weight_packed`` (uint8
``[N, K/2]``), ``weight_scale`` (float8_e4m3fn ``[N, K/16]``) and
``weight_global_scale`` (fp32 ``[1]``, encode convention ``2688 / amax``).

Both formats hold one outer scale per 2-D weight, so only tensor-scaled 2-D tensors
convert (take ``q.expert(e)`` of a stack first). A row-scaled tensor has no faithful
representation in either format and is refused rather than silently re-scaled.
Readers check dtypes, shapes and finiteness and name what is wrong.
"""

from __future__ import annotations

import torch

from .errors import DTypeError, LayoutError, ShapeError
from .spec import PRESETS, NumericsSpec, NVFP4Tensor, check_finite


def _tensor_scaled_2d(q: NVFP4Tensor, fmt: str) -> None:
    if len(q.shape) != 2:
        raise ShapeError(f"{fmt} stores 2-D weights; take q.expert(e) of shape {q.shape} first")
    if q.spec.outer_domain not in ("tensor", "expert"):
        raise LayoutError(
            f"{fmt} has one outer scale per weight; a {q.spec.outer_domain!r}-scaled tensor "
            f"cannot be stored without re-quantizing"
        )


def to_modelopt(q: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """``weight`` / ``weight_scale`` / ``weight_scale_2`` of a tensor-scaled 2-D weight."""
    _tensor_scaled_2d(q, "ModelOpt")
    return {
        "weight": q.codes.contiguous(),
        "weight_scale": q.block_scales.contiguous(),
        "weight_scale_2": q.outer_dec.reshape(()).to(torch.float32).clone(),
    }


def to_compressed_tensors(q: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` of a 2-D weight."""
    _tensor_scaled_2d(q, "compressed-tensors")
    return {
        "weight_packed": q.codes.contiguous(),
        "weight_scale": q.block_scales.contiguous(),
        "weight_global_scale": q.outer_enc.reshape(1).to(torch.float32).clone(),
    }


def _read(d: dict, packed_key: str, outer_key: str, fmt: str):
    missing = [k for k in (packed_key, "weight_scale", outer_key) if k not in d]
    if missing:
        raise LayoutError(f"{fmt} dict lacks {missing}; it has {sorted(d)}")
    packed, scales, outer = d[packed_key], d["weight_scale"], d[outer_key]
    if packed.dtype != torch.uint8:
        raise DTypeError(f"{fmt} {packed_key!r} must be uint8, got {packed.dtype}")
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    if scales.dtype != torch.float8_e4m3fn:
        raise DTypeError(f"{fmt} 'weight_scale' must be float8_e4m3fn, got {scales.dtype}")
    if outer.dtype != torch.float32:
        raise DTypeError(f"{fmt} {outer_key!r} must be float32, got {outer.dtype}")
    if packed.ndim != 2 or scales.ndim != 2:
        raise ShapeError(f"{fmt} weights are 2-D, got {tuple(packed.shape)} / {tuple(scales.shape)}")
    n, half_k = packed.shape
    if tuple(scales.shape) != (n, -(-half_k * 2 // 16)):
        raise ShapeError(
            f"{fmt} 'weight_scale' shape {tuple(scales.shape)} does not match "
            f"{packed_key!r} {tuple(packed.shape)} (expected {(n, -(-half_k * 2 // 16))})"
        )
    if outer.numel() != 1:
        raise ShapeError(f"{fmt} {outer_key!r} must hold one value, got shape {tuple(outer.shape)}")
    check_finite(outer, outer_key)
    if float(outer.reshape(())) <= 0:
        raise LayoutError(f"{fmt} {outer_key!r} must be positive, got {float(outer.reshape(()))}")
    if bool(scales.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any()):
        raise LayoutError(f"{fmt} 'weight_scale' holds NaN bytes (0x7F/0xFF)")
    return packed, scales, outer.reshape(()), (n, half_k * 2)


def from_modelopt(d: dict[str, torch.Tensor], spec: NumericsSpec | None = None) -> NVFP4Tensor:
    """Read a ModelOpt NVFP4 weight dict (decode convention outer scale)."""
    spec = PRESETS["modelopt"] if spec is None else spec
    packed, scales, outer, shape = _read(d, "weight", "weight_scale_2", "ModelOpt")
    spec = spec.replace(outer_domain="tensor", outer_convention="dec")
    return NVFP4Tensor(packed, scales, outer.clone(), spec, shape)


def from_compressed_tensors(
    d: dict[str, torch.Tensor], spec: NumericsSpec | None = None
) -> NVFP4Tensor:
    """Read a compressed-tensors NVFP4 weight dict (encode convention global scale)."""
    spec = PRESETS["compressed_tensors"] if spec is None else spec
    packed, scales, outer, shape = _read(d, "weight_packed", "weight_global_scale",
                                         "compressed-tensors")
    spec = spec.replace(outer_domain="tensor", outer_convention="enc")
    return NVFP4Tensor(packed, scales, outer.clone(), spec, shape)
