"""The grouped product over experts, differentiable: the call every MoE layer makes.

:func:`grouped_linear` multiplies each expert's rows (sorted by expert, a
:class:`~libalign.gemm.row_groups.GroupLayout`) by that expert's prepared weights through the
backend :mod:`libalign.gemm.backends` chooses. Its autograd function (:class:`GroupedSTE`) is
the straight-through estimator: the backward is the bf16 product of the *unquantized* operands
the forward saved, as if quantization were the identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from libalign.errors import DTypeError, ShapeError, SpecError
from libalign.gemm.backends import resolve_backend
from libalign.gemm.cutlass_grouped import grouped_activation_scales, native_grouped_gemm
from libalign.gemm.inner import (
    epilogue,
    inner_dtype,
    inner_values,
    row_decode_scales,
    row_epilogue_scales,
)
from libalign.gemm.row_groups import GroupLayout, group_layout
from libalign.gemm.triton_grouped import (
    fused_guidance_enabled,
    triton_guided_gap,
    w4a4_grouped_triton,
    w4a4_grouped_triton_guided,
    w4a4_grouped_triton_quantized,
)
from libalign.gemm.weights import ExpertWeights, quantize_activations
from libalign.kernels import ops
from libalign.spec import NVFP4Tensor, check_finite

#: torch's grouped matrix product (public name where torch has it).
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def check_grouped(a: torch.Tensor, w: ExpertWeights, layout: GroupLayout) -> None:
    e, _, k = w.shape
    if a.ndim != 2:
        raise ShapeError(f"activations must be 2-D [rows, K], got shape {tuple(a.shape)}")
    if a.shape[1] != k:
        raise ShapeError(f"activations have K={a.shape[1]}, expert weights K={k}")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"activations must be bf16, fp16 or fp32, got {a.dtype}")
    if layout.experts != e:
        raise ShapeError(f"counts name {layout.experts} experts, the weights hold {e}")
    if a.shape[0] != layout.total:
        raise ShapeError(f"counts sum to {layout.total} rows, activations have {a.shape[0]}")
    if a.device != w.weight.device:
        raise ShapeError(f"activations on {a.device}, weights on {w.weight.device}")


def per_expert(layout: GroupLayout, fn: Callable[[int, slice], torch.Tensor],
                out: torch.Tensor) -> torch.Tensor:
    offs = layout.offsets(padded=False)
    for e in range(layout.experts):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = fn(e, slice(lo, hi))
    return out


def bf16_grouped(a: torch.Tensor, w: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    if a.is_cuda and GROUPED_MM is not None and a.dtype == torch.bfloat16 and a.shape[0]:
        offs = torch.tensor(layout.offsets(padded=False)[1:], dtype=torch.int32, device=a.device)
        return GROUPED_MM(a, w.transpose(1, 2), offs=offs)
    wd = w.to(a.dtype)
    return per_expert(layout, lambda e, s: a[s] @ wd[e].T, a.new_empty((a.shape[0], w.shape[1])))


def quantized_grouped(a: torch.Tensor, w: ExpertWeights, layout: GroupLayout,
                       backend: str, act_q: NVFP4Tensor | None = None,
                       checked: bool = True, guide=None) -> torch.Tensor:
    spec = w.path.act_spec
    out_dtype = a.dtype if a.dtype != torch.float32 else torch.bfloat16
    if guide is not None:  # guided rounding fused into the Triton activation pass
        return w4a4_grouped_triton_guided(a, spec, guide, w.inner, w.dec, layout, out_dtype,
                                          check_finite=checked)
    if backend == "triton":
        if act_q is not None:
            return w4a4_grouped_triton_quantized(
                inner_values(act_q, torch.bfloat16), row_decode_scales(act_q), w.inner, w.dec,
                layout, out_dtype)
        return w4a4_grouped_triton(a, spec, w.inner, w.dec, layout, out_dtype, check_finite=checked)
    if act_q is None:
        check_finite(a, "activations")
    if backend == "native":  # Blackwell FP4 tensor cores (sm_100a)
        if w.operand is None:
            raise SpecError("these weights were not prepared on a device with the native GEMM")
        qa = act_q if act_q is not None else ops.quantize(a.detach(), spec)
        offs = layout.offsets(padded=False)
        return native_grouped_gemm(qa.codes, grouped_activation_scales(qa.block_scales, offs),
                                       row_decode_scales(qa), offs, w.operand.codes,
                                       w.operand.block_scales, w.dec)
    if act_q is not None:
        a_in, a_dec = inner_values(act_q, inner_dtype(a.device)), row_epilogue_scales(act_q, w.path)
    else:
        qa, a_in, _ = quantize_activations(a, spec)
        a_dec = row_epilogue_scales(qa, w.path)
    out = a.new_empty((a.shape[0], w.shape[1]), dtype=out_dtype)
    if backend == "reference":
        w_in64 = inner_values(w.q, torch.float64)
        a_in64 = a_in.double()

        def one(e, s):
            acc = (a_in64[s] @ w_in64[e].T).float()
            return epilogue(acc, a_dec[s], w.dec[e], out_dtype, w.path)
    else:
        def one(e, s):
            acc = a_in[s].float() @ w.inner[e].float().T
            return epilogue(acc, a_dec[s], w.dec[e], out_dtype, w.path)
    return per_expert(layout, one, out)


class GroupedSTE(torch.autograd.Function):
    """Forward through the chosen path; backward as the bf16 product of saved operands."""

    @staticmethod
    def forward(ctx, a, weight, w, layout, backend, act_q, checked, guide):
        ctx.save_for_backward(a, weight)
        ctx.layout = layout
        if w.path.quantized:
            return quantized_grouped(a, w, layout, backend, act_q, checked, guide)
        return bf16_grouped(a, weight, layout)

    @staticmethod
    def backward(ctx, grad):
        a, weight = ctx.saved_tensors
        layout = ctx.layout
        grad = grad.to(a.dtype)
        wd = weight.to(a.dtype)
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = per_expert(layout, lambda e, s: grad[s] @ wd[e], torch.zeros_like(a))
        if ctx.needs_input_grad[1]:
            offs = layout.offsets(padded=False)
            grad_w = torch.zeros_like(weight)
            for e in range(layout.experts):
                lo, hi = offs[e], offs[e + 1]
                if hi > lo:
                    grad_w[e] = (grad[lo:hi].T @ a[lo:hi]).to(weight.dtype)
        return grad_a, grad_w, None, None, None, None, None, None


def grouped_linear(a: torch.Tensor, weights: ExpertWeights,
                   counts: torch.Tensor | list[int] | GroupLayout, *,
                   backend: str = "auto", act_q: NVFP4Tensor | None = None,
                   check_finite: bool = True, act_guide=None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ W[e]^T`` through ``weights.path``, rows sorted by expert.

    ``a`` is ``[rows, K]``; ``counts`` gives each expert's rows (or a :class:`GroupLayout`).
    Backends: ``reference`` (float64 accumulation), ``torch`` (fp32 matmul of exact inner
    values), ``triton`` (fused Hopper kernel), ``native`` (Blackwell FP4 tensor cores through
    CUTLASS), ``auto`` (native on Blackwell, else triton
    on a CUDA device that has it, else torch).
    Differentiable in ``a`` and ``weights.weight`` with the straight-through estimator.

    ``act_q``, when given, is the activations' quantization to multiply instead of the
    path's own (guided rounding): an NVFP4 ``[rows, K]`` of ``a`` in the same row order;
    ``a`` itself is then only saved for the backward pass. ``act_guide`` (a
    :class:`~libalign.guidance.RowGuide`: a sampler's records for the rows of ``a``) rounds
    the activations as :func:`~libalign.guidance.guided_quantize` does, inside the Triton
    activation pass; only where :func:`fuses_guidance` says so (else quantize them with
    ``guided_quantize`` and pass ``act_q``).

    ``check_finite=False`` drops the Triton backend's NaN/Inf check (one device sync per call,
    or queued inside :func:`libalign.gemm.finite_checks.deferred_finite_checks`): a NaN/Inf row
    then comes out NaN instead of raising :class:`~libalign.errors.NonFiniteError`. The
    other backends raise either way.
    """
    layout = counts if isinstance(counts, GroupLayout) else group_layout(counts)
    check_grouped(a, weights, layout)
    if act_q is not None and (not weights.path.quantized or act_q.shape != tuple(a.shape)):
        raise ShapeError(f"act_q of shape {act_q.shape} for activations {tuple(a.shape)} on path "
                         f"{weights.path.name!r}: needs a quantized path and the same shape")
    be = resolve_backend(backend, a.device, weights.path, a.shape[-1])
    if act_guide is not None and (act_q is not None or not fuses_guidance(a, weights, act_guide, be)):
        raise SpecError("act_guide needs the fused Triton pass (fuses_guidance) and no act_q")
    return GroupedSTE.apply(a, weights.weight, weights, layout, be, act_q, check_finite, act_guide)


def fuses_guidance(a: torch.Tensor, weights: ExpertWeights, guide, backend: str = "auto") -> bool:
    """Whether :func:`grouped_linear` rounds ``a`` by ``guide`` inside the Triton activation
    pass: a quantized path on the Triton backend, fused guidance on
    (:func:`~libalign.gemm.triton_grouped.fused_guidance`), a spec and records the pass implements."""
    spec = weights.path.act_spec
    return spec is not None and fused_guidance_enabled() and triton_guided_gap(
        spec, guide, a.shape[-1]) is None and resolve_backend(
        backend, a.device, weights.path, a.shape[-1]) == "triton"
