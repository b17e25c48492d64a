"""Expert weights made ready for a path once per version, and activations quantized per call.

Weights change only when a new version arrives, so :func:`prepare_weights` quantizes an expert
stack once (its NVFP4 bits, exact inner values and row decode scales, and on Blackwell the
swizzled operand) and every call reuses them; :func:`weights_from_quantized` builds the same
from stored bits without quantizing again. :func:`quantize_activations` is the per-call side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libalign.errors import DTypeError, ShapeError, SpecError
from libalign.gemm.backends import device_kernels
from libalign.gemm.inner import inner_dtype, inner_values, row_decode_scales, row_epilogue_scales
from libalign.gemm.paths import ExecutionPath, get_path
from libalign.kernels import ops
from libalign.spec import NumericsSpec, NVFP4Tensor


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """An expert stack ``[E, N, K]`` made ready for one path.

    ``weight`` is the unquantized stack (the bf16 path's operand and the STE backward's);
    for a quantized path ``q`` holds its NVFP4 bits, ``inner`` the exact inner values (bf16 on
    a GPU, fp32 on the CPU) and ``dec`` what the path's epilogue reads of every output row
    ``[E, N]`` (the fp32 outer decode scale; TE's stored maximum for TE's epilogues); on a
    device with the native Blackwell GEMM, ``operand`` holds the same bits with
    128x4-swizzled scales. Weights change only when a new version arrives, so a caller
    keeps one of these per version and pays the quantization once.
    """

    path: ExecutionPath
    weight: torch.Tensor
    q: NVFP4Tensor | None = None
    inner: torch.Tensor | None = None
    dec: torch.Tensor | None = None
    operand: ops.GemmOperand | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``."""
        e, n, k = self.weight.shape
        return e, n, k


def prepare_weights(weight: torch.Tensor, path: str | ExecutionPath, *,
                    outer_amax: torch.Tensor | None = None) -> ExpertWeights:
    """Quantize an expert stack ``[E, N, K]`` for ``path`` (once per weight version).

    ``outer_amax`` shares outer maxima (e.g. :func:`~libalign.spec.shared_outer_amax` for a
    fused gate/up stack). NaN/Inf weights raise :class:`~libalign.errors.NonFiniteError`.
    """
    p = get_path(path)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 3:
        raise ShapeError(f"expert weights must be a 3-D [E, N, K] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not weight.is_floating_point():
        raise DTypeError(f"expert weights must be floating point, got {weight.dtype}")
    if not p.quantized:
        return ExpertWeights(p, weight)
    w = weight.detach()
    q = ops.quantize(w, p.weight_spec, outer_amax=outer_amax)
    native = w.is_cuda and device_kernels(w.device)[0]
    return ExpertWeights(p, weight, q, inner_values(q, inner_dtype(w.device)),
                         row_epilogue_scales(q, p), ops.as_gemm_operand(q) if native else None)


def weights_from_quantized(q: NVFP4Tensor, path: str | ExecutionPath,
                           weight: torch.Tensor | None = None) -> ExpertWeights:
    """:class:`ExpertWeights` from stored bits (a converted version), without re-quantizing.

    ``q`` must carry exactly the path's weight spec (else :class:`SpecError`: a sampler must
    not multiply bits made for another recipe); ``weight`` is the unquantized stack for the
    straight-through backward, by default the dequantized bits.
    """
    p = get_path(path)
    if not p.quantized:
        raise SpecError(f"path {p.name!r} multiplies bf16 weights; it takes no NVFP4 bits")
    if q.spec.to_dict() != p.weight_spec.to_dict():
        raise SpecError(f"stored weights carry spec {q.spec.name!r}, path {p.name!r} needs "
                        f"{p.weight_spec.name!r}")
    if len(q.shape) != 3:
        raise ShapeError(f"expert weights must be a 3-D [E, N, K] stack, got shape {q.shape}")
    dev = q.codes.device
    if weight is None:
        weight = q.dequantize(torch.float32).to(torch.bfloat16)
    native = q.codes.is_cuda and device_kernels(dev)[0]
    return ExpertWeights(p, weight, q, inner_values(q, inner_dtype(dev)), row_epilogue_scales(q, p),
                         ops.as_gemm_operand(q) if native else None)


# --- activations ------------------------------------------------------------------------------

def quantize_activations(a: torch.Tensor, spec: NumericsSpec):
    """Quantize activations ``[M, K]``: returns ``(q, inner, dec)`` with ``dec`` ``[M]``.

    A ``tensor``-domain spec takes one maximum over all ``M`` rows of the grouped call.
    """
    q = ops.quantize(a.detach(), spec)
    return q, inner_values(q, inner_dtype(a.device)), row_decode_scales(q)
