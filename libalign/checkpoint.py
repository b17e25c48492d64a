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

One documented extension exists for row-scaled weights (the ``minite`` preset), asked for
with ``row_scaled_ok=True`` and only in the ModelOpt layout: ``weight_scale_2`` becomes
an fp32 column ``[N, 1]`` holding each output row's decode scale. ModelOpt's own
dequantization (``weight_scale * weight_scale_2``, broadcast per block) reads it
correctly; stock serving loaders (SGLang ``modelopt_fp4``, vLLM) expect a scalar per
weight and do not. compressed-tensors' ``tensor_group`` dequantization cannot broadcast
a per-row global scale against its ``[N, K/16, 1]`` group scales, so that format stays
tensor-scaled only.

MXFP4 (an ``mxfp4*`` preset) goes to compressed-tensors' ``mxfp4-pack-quantized`` layout,
what vLLM's and SGLang's ``CompressedTensorsW4A16Mxfp4`` schemes load: ``weight_packed``
(uint8 ``[N, K/2]``, the same nibbles) and ``weight_scale`` (uint8 ``[N, K/32]``, the E8M0
bytes ``127 + log2(scale)``), no global scale. ModelOpt's layout has E4M3 scales and an
outer scale, so an MXFP4 tensor is refused there.

Readers check dtypes, shapes and finiteness and name what is wrong.
"""

from __future__ import annotations

import torch

from libalign.errors import DTypeError, LayoutError, ShapeError
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor, check_finite

FORMATS = ("modelopt", "compressed-tensors")


def _tensor_scaled_2d(q: NVFP4Tensor, fmt: str, row_scaled_ok: bool = False) -> None:
    if len(q.shape) != 2:
        raise ShapeError(f"{fmt} stores 2-D weights; take q.expert(e) of shape {q.shape} first")
    if q.spec.is_mx:
        raise LayoutError(f"{fmt}'s NVFP4 layout has E4M3 block scales; MXFP4 (preset "
                          f"{q.spec.name!r}) is stored in compressed-tensors' mxfp4-pack-quantized")
    allowed = ("tensor", "expert", "row") if row_scaled_ok else ("tensor", "expert")
    if q.spec.outer_domain not in allowed:
        raise LayoutError(
            f"{fmt} has one outer scale per weight; a {q.spec.outer_domain!r}-scaled tensor "
            f"cannot be stored without re-quantizing"
        )


def to_modelopt(q: NVFP4Tensor, *, row_scaled_ok: bool = False) -> dict[str, torch.Tensor]:
    """``weight`` / ``weight_scale`` / ``weight_scale_2`` of a 2-D weight (rows: ``[N, 1]``)."""
    _tensor_scaled_2d(q, "ModelOpt", row_scaled_ok)
    dec = q.outer_dec.to(torch.float32)
    return {
        "weight": q.codes.contiguous(),
        "weight_scale": q.block_scales.contiguous(),
        "weight_scale_2": (dec.reshape(-1, 1) if q.spec.outer_domain == "row"
                           else dec.reshape(())).clone(),
    }


def to_compressed_tensors(q: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` of a 2-D weight; for
    MXFP4 ``weight_packed`` / ``weight_scale`` (uint8 E8M0 bytes), no global scale."""
    if q.spec.is_mx:
        if len(q.shape) != 2:
            raise ShapeError(f"compressed-tensors stores 2-D weights, got shape {q.shape}")
        return {"weight_packed": q.codes.contiguous(),
                "weight_scale": q.block_scales.view(torch.uint8).contiguous()}
    _tensor_scaled_2d(q, "compressed-tensors")
    return {
        "weight_packed": q.codes.contiguous(),
        "weight_scale": q.block_scales.contiguous(),
        "weight_global_scale": q.outer_enc.reshape(1).to(torch.float32).clone(),
    }


def to_format(q: NVFP4Tensor, fmt: str, *, row_scaled_ok: bool = False) -> dict[str, torch.Tensor]:
    """The tensor dict of ``q`` in checkpoint format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "modelopt":
        return to_modelopt(q, row_scaled_ok=row_scaled_ok)
    if fmt == "compressed-tensors":
        return to_compressed_tensors(q)
    raise LayoutError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")


def stored_layout(fmt: str, shape: tuple[int, ...], row_scaled: bool = False, *,
                  mx: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key, shape and dtype of every tensor :func:`to_format` stores for a ``[N, K]`` weight.

    K must be a multiple of 16 (MXFP4, ``mx``: 32): the formats store unpadded widths
    ``K / 2`` and ``K / 16`` (``K / 32``).
    """
    if len(shape) != 2:
        raise ShapeError(f"checkpoint weights are 2-D, got shape {tuple(shape)}")
    n, k = shape
    if mx:
        if fmt != "compressed-tensors":
            raise LayoutError(f"MXFP4 is stored in compressed-tensors' mxfp4-pack-quantized "
                              f"layout, not {fmt!r}")
        if k % 32:
            raise ShapeError(f"K={k} is not a multiple of 32; {fmt} stores unpadded MXFP4 weights")
        return {"weight_packed": ((n, k // 2), torch.uint8),
                "weight_scale": ((n, k // 32), torch.uint8)}
    if k % 16:
        raise ShapeError(f"K={k} is not a multiple of 16; {fmt} stores unpadded NVFP4 weights")
    if fmt == "modelopt":
        outer = ((n, 1) if row_scaled else ())
        return {"weight": ((n, k // 2), torch.uint8),
                "weight_scale": ((n, k // 16), torch.float8_e4m3fn),
                "weight_scale_2": (outer, torch.float32)}
    if fmt == "compressed-tensors":
        if row_scaled:
            raise LayoutError("compressed-tensors has one global scale per weight; "
                              "a row-scaled weight cannot be stored in it")
        return {"weight_packed": ((n, k // 2), torch.uint8),
                "weight_scale": ((n, k // 16), torch.float8_e4m3fn),
                "weight_global_scale": ((1,), torch.float32)}
    raise LayoutError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")


def _read(d: dict, packed_key: str, outer_key: str, fmt: str, row_scaled_ok: bool = False):
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
    rows = row_scaled_ok and tuple(outer.shape) == (n, 1) and n != 1
    if outer.numel() != 1 and not rows:
        want = "one value" + (f" or one per row, shape {(n, 1)}" if row_scaled_ok else "")
        raise ShapeError(f"{fmt} {outer_key!r} must hold {want}, got shape {tuple(outer.shape)}")
    check_finite(outer, outer_key)
    if bool((outer <= 0).any()):
        raise LayoutError(f"{fmt} {outer_key!r} must be positive, got minimum {float(outer.min())}")
    if bool(scales.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any()):
        raise LayoutError(f"{fmt} 'weight_scale' holds NaN bytes (0x7F/0xFF)")
    return packed, scales, outer.reshape(-1) if rows else outer.reshape(()), (n, half_k * 2)


def from_modelopt(d: dict[str, torch.Tensor], spec: NumericsSpec | None = None, *,
                  row_scaled_ok: bool = False) -> NVFP4Tensor:
    """Read a ModelOpt NVFP4 weight dict (decode convention; ``[N, 1]`` rows if allowed)."""
    spec = PRESETS["modelopt"] if spec is None else spec
    packed, scales, outer, shape = _read(d, "weight", "weight_scale_2", "ModelOpt", row_scaled_ok)
    domain = "row" if outer.ndim else "tensor"
    spec = spec.replace(outer_domain=domain, outer_convention="dec")
    return NVFP4Tensor(packed, scales, outer.clone(), spec, shape)


def _read_mxfp4(d: dict[str, torch.Tensor], spec: NumericsSpec) -> NVFP4Tensor:
    missing = [k for k in ("weight_packed", "weight_scale") if k not in d]
    if missing:
        raise LayoutError(f"compressed-tensors MXFP4 dict lacks {missing}; it has {sorted(d)}")
    packed, scales = d["weight_packed"], d["weight_scale"]
    if packed.dtype != torch.uint8 or scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise DTypeError(f"MXFP4 'weight_packed' must be uint8 and 'weight_scale' uint8 E8M0, "
                         f"got {packed.dtype} / {scales.dtype}")
    if packed.ndim != 2 or scales.ndim != 2 or (packed.shape[1] * 2) % 32 \
            or tuple(scales.shape) != (packed.shape[0], packed.shape[1] * 2 // 32):
        raise ShapeError(f"MXFP4 'weight_scale' {tuple(scales.shape)} does not fit "
                         f"'weight_packed' {tuple(packed.shape)} (one scale per 32 values)")
    if bool((scales.view(torch.uint8) == 0xFF).any()):
        raise LayoutError("MXFP4 'weight_scale' holds the E8M0 NaN byte 0xFF")
    return NVFP4Tensor(packed, scales.view(torch.float8_e8m0fnu).clone(), None, spec,
                       (packed.shape[0], packed.shape[1] * 2))


def from_compressed_tensors(
    d: dict[str, torch.Tensor], spec: NumericsSpec | None = None
) -> NVFP4Tensor:
    """Read a compressed-tensors NVFP4 weight dict (encode convention global scale), or an
    ``mxfp4-pack-quantized`` one when ``spec`` is an MXFP4 spec."""
    spec = PRESETS["compressed_tensors"] if spec is None else spec
    if spec.is_mx:
        return _read_mxfp4(d, spec)
    packed, scales, outer, shape = _read(d, "weight_packed", "weight_global_scale",
                                         "compressed-tensors")
    spec = spec.replace(outer_domain="tensor", outer_convention="enc")
    return NVFP4Tensor(packed, scales, outer.clone(), spec, shape)
