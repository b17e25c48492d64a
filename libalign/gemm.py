"""The W4A4 expert GEMM: what a block-scaled NVFP4 matrix product computes, and in which order.

A W4A4 product multiplies two NVFP4 operands, the activations ``A`` ``[M, K]`` and an expert's
weights ``W`` ``[N, K]`` (both quantized along K, the contraction dimension). Each element is
``q * s * d``: an E2M1 value ``q``, the E4M3 scale ``s`` of its 16-element block, and the fp32
outer decode scale ``d`` of its row (or of the whole tensor or expert). The product is
defined here in three steps, and every backend follows them:

1. **Inner dequantization.** ``a_in = q_a * s_a`` and ``w_in = q_w * s_w``. An E2M1 value has
   at most 2 significant bits and an E4M3 value 4, so ``q * s`` has at most 6 and is exact in
   bf16 (8 bits) as in fp32. The outer scales stay out of the inner loop, which is what lets a
   tensor core (or, on Blackwell, the FP4 tensor core with its block-scale hardware) consume
   the operands.
2. **Accumulation in fp32.** ``acc[m, n] = sum_k a_in[m, k] * w_in[n, k]``. Each product is
   exact in fp32 (at most 12 significant bits), so the only rounding is in the additions, and
   their order is the backend's: the reference sums in float64 and rounds once to fp32 (the
   ideal fp32 accumulator, independent of order); a tensor core sums in its own tree.
3. **Epilogue, in fp32, then one rounding.** ``out[m, n] = bf16(fl(acc[m, n] * fl(d_a[m] *
   d_w[n])))``: the two outer decode scales are multiplied first (a per-tensor or per-expert
   scale broadcasts), the accumulator is scaled once, and the result is rounded once to bf16.

Backends therefore agree exactly up to step 2's addition order: the fused GPU path (Triton
on Hopper: bf16 tensor cores fed with the exact inner values) and the CPU path (fp32 matmul)
differ from the float64 reference by a few fp32 ulps in ``acc``, which flips the final bf16
rounding of a small fraction of outputs by one bf16 ulp (the tests pin that bound).

**Grouped over experts.** A mixture-of-experts layer multiplies each expert's rows of a
token-permuted activation matrix by that expert's weights. Rows arrive sorted by expert with
``counts[e]`` rows for expert ``e`` (zero allowed). :class:`GroupLayout`
(:mod:`libalign.gemm_layout`) pads each expert's rows to a multiple of 64 or 128 so that a
GEMM tile never straddles two experts; padding rows are zero, which changes no outer maximum
(a zero row quantizes to zero codes), so padding is invisible in the result.

**Backends.** This module defines the product, runs the reference and CPU backends, and
chooses one (:func:`grouped_linear`); the GPU backends live beside it:
:mod:`libalign.gemm_triton` (Hopper, Triton kernels on bf16 tensor cores) and
:mod:`libalign.gemm_cutlass` (Blackwell FP4 tensor cores through CUTLASS). Operands are
quantized through the kernel door, :mod:`libalign.ops`.

**Execution paths.** :data:`PATHS` names what a learner or a sampler can run: ``bf16`` (no
quantization), ``nvfp4_naive`` (per-tensor activation scale, per-expert weight scale: the
common recipe), ``nvfp4_minite`` (row-scaled activations and weights, the miniTE spec). A
path fixes one :class:`~libalign.spec.NumericsSpec` for each operand.

**Backward.** The straight-through estimator: gradients are those of the bf16 product of the
*unquantized* operands saved by the forward (``grad_a = grad_out @ W``, ``grad_W = grad_out^T
@ a`` per expert), as if quantization were the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import ops
from .errors import DTypeError, ShapeError, SpecError
from .gemm_cutlass import grouped_activation_scales, native_grouped_gemm, native_grouped_gemm_gap
from .gemm_layout import PAD_CHOICES, GroupLayout, group_layout
from .gemm_triton import (
    fused_guidance_enabled,
    triton_act_gap,
    triton_gemm_available,
    triton_guided_gap,
    triton_inner_values,
    triton_k_gap,
    w4a4_grouped_triton,
    w4a4_grouped_triton_guided,
    w4a4_grouped_triton_quantized,
)
from .packing import unpack_nibbles
from .rounding import e2m1_code_values, e4m3_bits_to_float
from .spec import PRESETS, NumericsSpec, NVFP4Tensor, check_finite

BACKENDS = ("auto", "reference", "torch", "triton", "native")
__all__ = [  # GroupLayout, group_layout and PAD_CHOICES are gemm_layout's, re-exported
    "BACKENDS", "PAD_CHOICES", "PATHS", "ActivationHook", "ExecutionPath", "ExpertWeights",
    "GroupLayout", "Observer", "epilogue", "fuses_guidance", "get_path", "group_layout",
    "grouped_linear",
    "inner_table", "inner_values", "moe_experts_forward", "prepare_weights", "quantize_activations",
    "register_path", "row_decode_scales", "take_rows", "w4a4_reference", "weights_from_quantized",
]


# --- execution paths --------------------------------------------------------------------------

@dataclass(frozen=True)
class ExecutionPath:
    """How one side multiplies by its experts: one numerics spec per operand, or none (bf16).

    ``act_spec.outer_domain`` is ``row`` (one scale per token row) or ``tensor`` (one scale
    over all rows of the grouped call); ``weight_spec.outer_domain`` is ``row`` (per output
    row of each expert), ``expert``, ``tensor`` or ``none``.
    """

    name: str
    weight_spec: NumericsSpec | None = None
    act_spec: NumericsSpec | None = None
    description: str = ""
    kv_spec: NumericsSpec | None = None
    """The KV cache's format (``kv_nvfp4``, ``kv_mxfp4``), None: K and V stay in the model's
    dtype; :mod:`libalign.models.kv_cache` quantizes them on write."""

    def __post_init__(self) -> None:
        if (self.weight_spec is None) != (self.act_spec is None):
            raise SpecError(f"path {self.name!r}: quantize both operands or neither")
        for what, spec in (("weight", self.weight_spec), ("activation", self.act_spec)):
            if spec is not None and spec.hadamard:
                raise SpecError(f"path {self.name!r}: the W4A4 GEMM takes {what} specs "
                                "without the Hadamard rotation")
            if spec is not None and spec.stochastic_rounding:
                raise SpecError(f"path {self.name!r}: stochastic rounding is not a GEMM path")
        if self.act_spec is not None and self.act_spec.outer_domain not in ("row", "tensor", "none"):
            raise SpecError(f"path {self.name!r}: activation outer domain must be row, tensor "
                            f"or none, got {self.act_spec.outer_domain!r}")

    @property
    def quantized(self) -> bool:
        """True when the path multiplies NVFP4 operands."""
        return self.weight_spec is not None


_TE_EXPERT = PRESETS["te"].replace(name="te_expert", outer_domain="expert")

PATHS: dict[str, ExecutionPath] = {
    "bf16": ExecutionPath("bf16", description="bf16 operands, fp32 accumulation"),
    "nvfp4_naive": ExecutionPath(
        "nvfp4_naive", _TE_EXPERT, PRESETS["te"],
        "NVFP4, one outer scale per activation tensor and per expert weight (common recipe)"),
    "nvfp4_minite": ExecutionPath(
        "nvfp4_minite", PRESETS["minite"], PRESETS["minite"],
        "NVFP4, row-scaled activations and weights (the miniTE spec)"),
    "nvfp4_trace": ExecutionPath(
        "nvfp4_trace", PRESETS["minite"], PRESETS["minite"],
        "NVFP4 as nvfp4_minite, activations rounded as the sampler's guidance records say "
        "(TRACE; round-to-nearest where no record is attached)"),
}
for _kv in ("kv_nvfp4", "kv_mxfp4"):  # FP4 KV cache: the path's name says its KV format
    PATHS[f"nvfp4_minite_{_kv}"] = ExecutionPath(
        f"nvfp4_minite_{_kv}", PRESETS["minite"], PRESETS["minite"],
        f"nvfp4_minite with K and V stored as {_kv} (quantized on write)", PRESETS[_kv])
    PATHS[f"nvfp4_trace_{_kv}"] = ExecutionPath(
        f"nvfp4_trace_{_kv}", PRESETS["minite"], PRESETS["minite"],
        f"nvfp4_trace with K and V quantized as {_kv}, rounded as the sampler's KV guidance "
        "records say", PRESETS[_kv])


def register_path(path: ExecutionPath) -> None:
    """Add a named path (e.g. a guided-rounding path) that :func:`get_path` will find."""
    PATHS[path.name] = path


def get_path(path: str | ExecutionPath) -> ExecutionPath:
    """The path of that name; :class:`~libalign.errors.SpecError` names the known ones."""
    if isinstance(path, ExecutionPath):
        return path
    try:
        return PATHS[path]
    except KeyError:
        raise SpecError(f"unknown execution path {path!r}; known: {sorted(PATHS)}") from None


# --- inner and outer parts of an NVFP4 operand ------------------------------------------------

_INNER_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def inner_table(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The inner values of every (E4M3 scale byte, code byte) pair: ``[65536, 2]`` of ``dtype``.

    Row ``(s << 8) | b`` holds ``fl32(code * scale)`` of byte ``b``'s two E2M1 codes (low
    nibble first) under scale byte ``s``, cast to ``dtype`` (exact: at most 6 significant
    bits between 2^-10 and 2688). Built once per device and dtype (256 KiB in bf16)."""
    key = (str(device), dtype)
    table = _INNER_TABLES.get(key)
    if table is None:
        vals = e2m1_code_values(unpack_nibbles(torch.arange(256, dtype=torch.uint8).reshape(256, 1)))
        scales = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
        table = (vals[None] * scales[:, None, None]).reshape(65536, 2).to(dtype).to(device)
        _INNER_TABLES[key] = table
    return table


def inner_values(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * s`` per element (step 1): exact in fp32 and bf16; logical shape, K unpadded.

    The bits of the field-by-field decode (:func:`~libalign.rounding.e2m1_code_values` times
    :func:`~libalign.rounding.e4m3_bits_to_float`) from one gather per code byte in
    :func:`inner_table` (index ``scale byte << 8 | code byte``, each byte's two values one
    word), or in bf16 on a Triton GPU one Triton pass (reads the bits once, writes bf16)."""
    scales = q.block_scales
    if scales.dtype == torch.float8_e8m0fnu or q.codes.shape[-1] * 2 != scales.shape[-1] * 16:
        raise DTypeError(f"inner_values decodes NVFP4 (E4M3 scales per 16 values); spec "
                         f"{q.spec.name!r} has {scales.dtype} scales per {q.spec.block_size}")
    fast = triton_inner_values(q.codes, scales) if dtype == torch.bfloat16 and q.codes.is_cuda \
        and _device_kernels(q.codes.device)[1] else None
    if fast is not None:
        return fast[..., : q.k]
    lead = q.codes.shape[:-1]
    nb = scales.shape[-1]
    shifted = scales.view(torch.uint8).to(torch.int32).unsqueeze(-1) << 8
    idx = torch.add(q.codes.reshape(*lead, nb, 8), shifted).reshape(-1)
    table = inner_table(q.codes.device, dtype)
    word = {2: torch.int32, 4: torch.int64}.get(table.element_size())
    if word is not None:  # each byte's pair as one word: a plain 1-D gather
        out = table.view(word).reshape(-1).index_select(0, idx).view(dtype)
    else:
        out = table.index_select(0, idx)
    return out.reshape(*lead, nb * 16)[..., : q.k]


def row_decode_scales(q: NVFP4Tensor) -> torch.Tensor:
    """The fp32 outer decode scale of every row of ``q``, shape ``q.shape[:-1]``."""
    rows = q.shape[:-1]
    dec = q.outer_dec
    dom = q.spec.outer_domain
    if q.outer_scale is None or dom == "tensor":
        return dec.reshape(()).expand(rows).contiguous()
    if dom == "expert":
        return dec.reshape(-1, *([1] * (len(rows) - 1))).expand(rows).contiguous()
    return dec.reshape(rows)


def epilogue(acc: torch.Tensor, a_dec: torch.Tensor, w_dec: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Step 3: ``dtype(fl(acc * fl(a_dec[m] * w_dec[n])))`` for an fp32 ``acc`` ``[M, N]``."""
    alpha = a_dec.float().reshape(-1, 1) * w_dec.float().reshape(1, -1)
    return (acc * alpha).to(dtype)


def w4a4_reference(a: NVFP4Tensor, w: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16):
    """The defining product of two 2-D NVFP4 operands ``[M, K]`` and ``[N, K]``.

    Accumulates the exact products in float64 and rounds the sum once to fp32, so the result
    does not depend on an addition order (for the ranges NVFP4 operands span, float64 holds
    the sums exactly or within one float64 ulp, far below the fp32 rounding that follows).
    """
    if len(a.shape) != 2 or len(w.shape) != 2 or a.k != w.k:
        raise ShapeError(f"w4a4_reference needs [M, K] x [N, K], got {a.shape} and {w.shape}")
    acc = (inner_values(a, torch.float64) @ inner_values(w, torch.float64).T).float()
    return epilogue(acc, row_decode_scales(a), row_decode_scales(w), dtype)


# --- prepared weights -------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """An expert stack ``[E, N, K]`` made ready for one path.

    ``weight`` is the unquantized stack (the bf16 path's operand and the STE backward's);
    for a quantized path ``q`` holds its NVFP4 bits, ``inner`` the exact inner values (bf16 on
    a GPU, fp32 on the CPU) and ``dec`` the fp32 outer decode scale of every output row
    ``[E, N]``; on a device with the native Blackwell GEMM, ``operand`` holds the same bits
    with 128x4-swizzled scales. Weights change only when a new version arrives, so a caller
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


def _inner_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
    native = w.is_cuda and _device_kernels(w.device)[0]
    return ExpertWeights(p, weight, q, inner_values(q, _inner_dtype(w.device)), row_decode_scales(q),
                         ops.as_gemm_operand(q) if native else None)


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
    native = q.codes.is_cuda and _device_kernels(dev)[0]
    return ExpertWeights(p, weight, q, inner_values(q, _inner_dtype(dev)), row_decode_scales(q),
                         ops.as_gemm_operand(q) if native else None)


# --- activations ------------------------------------------------------------------------------

def quantize_activations(a: torch.Tensor, spec: NumericsSpec):
    """Quantize activations ``[M, K]``: returns ``(q, inner, dec)`` with ``dec`` ``[M]``.

    A ``tensor``-domain spec takes one maximum over all ``M`` rows of the grouped call.
    """
    q = ops.quantize(a.detach(), spec)
    return q, inner_values(q, _inner_dtype(a.device)), row_decode_scales(q)


# --- the grouped product ----------------------------------------------------------------------

def _check_grouped(a: torch.Tensor, w: ExpertWeights, layout: GroupLayout) -> None:
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


def _resolve_backend(backend: str, device: torch.device, path: ExecutionPath, k: int) -> str:
    if backend not in BACKENDS:
        raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        if not triton_gemm_available(device):
            raise SpecError(f"the triton W4A4 backend needs a CUDA device with Triton, got {device}")
        gap = triton_act_gap(path.act_spec) if path.quantized else "the bf16 path"
        gap = gap or triton_k_gap(k)
        if gap is not None:
            raise SpecError(f"the triton W4A4 backend cannot serve path {path.name!r}: {gap}")
    if backend == "native":
        gap = native_grouped_gemm_gap(device) if path.quantized else "the bf16 path"
        if gap is not None:
            raise SpecError(f"the native Blackwell W4A4 backend cannot serve this call: {gap}")
    if backend != "auto":
        return backend
    if not path.quantized or device.type != "cuda":
        return "torch"
    native, triton = _device_kernels(device)
    if native:
        return "native"
    if triton and triton_k_gap(k) is None and triton_act_gap(path.act_spec) is None:
        return "triton"
    return "torch"

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_DEVICE_KERNELS: dict[str, tuple[bool, bool]] = {}


def _device_kernels(device: torch.device) -> tuple[bool, bool]:
    """(native Blackwell GEMM, Triton GEMM) availability per device, asked once per process."""
    key = str(device)
    if key not in _DEVICE_KERNELS:
        _DEVICE_KERNELS[key] = (native_grouped_gemm_gap(device) is None,
                                triton_gemm_available(device))
    return _DEVICE_KERNELS[key]


def _per_expert(layout: GroupLayout, fn: Callable[[int, slice], torch.Tensor],
                out: torch.Tensor) -> torch.Tensor:
    offs = layout.offsets(padded=False)
    for e in range(layout.experts):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = fn(e, slice(lo, hi))
    return out


def _bf16_grouped(a: torch.Tensor, w: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    if a.is_cuda and _GROUPED_MM is not None and a.dtype == torch.bfloat16 and a.shape[0]:
        offs = torch.tensor(layout.offsets(padded=False)[1:], dtype=torch.int32, device=a.device)
        return _GROUPED_MM(a, w.transpose(1, 2), offs=offs)
    wd = w.to(a.dtype)
    return _per_expert(layout, lambda e, s: a[s] @ wd[e].T, a.new_empty((a.shape[0], w.shape[1])))


def _quantized_grouped(a: torch.Tensor, w: ExpertWeights, layout: GroupLayout,
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
    if backend == "native":  # Blackwell FP4 tensor cores (compiled for sm_100a, never run here)
        if w.operand is None:
            raise SpecError("these weights were not prepared on a device with the native GEMM")
        qa = act_q if act_q is not None else ops.quantize(a.detach(), spec)
        offs = layout.offsets(padded=False)
        return native_grouped_gemm(qa.codes, grouped_activation_scales(qa.block_scales, offs),
                                       row_decode_scales(qa), offs, w.operand.codes,
                                       w.operand.block_scales, w.dec)
    if act_q is not None:
        a_in, a_dec = inner_values(act_q, _inner_dtype(a.device)), row_decode_scales(act_q)
    else:
        _, a_in, a_dec = quantize_activations(a, spec)
    out = a.new_empty((a.shape[0], w.shape[1]), dtype=out_dtype)
    if backend == "reference":
        w_in64 = inner_values(w.q, torch.float64)
        a_in64 = a_in.double()

        def one(e, s):
            acc = (a_in64[s] @ w_in64[e].T).float()
            return epilogue(acc, a_dec[s], w.dec[e], out_dtype)
    else:
        def one(e, s):
            acc = a_in[s].float() @ w.inner[e].float().T
            return epilogue(acc, a_dec[s], w.dec[e], out_dtype)
    return _per_expert(layout, one, out)


class _GroupedSTE(torch.autograd.Function):
    """Forward through the chosen path; backward as the bf16 product of saved operands."""

    @staticmethod
    def forward(ctx, a, weight, w, layout, backend, act_q, checked, guide):
        ctx.save_for_backward(a, weight)
        ctx.layout = layout
        if w.path.quantized:
            return _quantized_grouped(a, w, layout, backend, act_q, checked, guide)
        return _bf16_grouped(a, weight, layout)

    @staticmethod
    def backward(ctx, grad):
        a, weight = ctx.saved_tensors
        layout = ctx.layout
        grad = grad.to(a.dtype)
        wd = weight.to(a.dtype)
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = _per_expert(layout, lambda e, s: grad[s] @ wd[e], torch.zeros_like(a))
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
    CUTLASS; compiled, not yet run on hardware), ``auto`` (native on Blackwell, else triton
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
    or queued inside :func:`libalign.finite_checks.deferred_finite_checks`): a NaN/Inf row
    then comes out NaN instead of raising :class:`~libalign.errors.NonFiniteError`. The
    other backends raise either way.
    """
    layout = counts if isinstance(counts, GroupLayout) else group_layout(counts)
    _check_grouped(a, weights, layout)
    if act_q is not None and (not weights.path.quantized or act_q.shape != tuple(a.shape)):
        raise ShapeError(f"act_q of shape {act_q.shape} for activations {tuple(a.shape)} on path "
                         f"{weights.path.name!r}: needs a quantized path and the same shape")
    be = _resolve_backend(backend, a.device, weights.path, a.shape[-1])
    if act_guide is not None and (act_q is not None or not fuses_guidance(a, weights, act_guide, be)):
        raise SpecError("act_guide needs the fused Triton pass (fuses_guidance) and no act_q")
    return _GroupedSTE.apply(a, weights.weight, weights, layout, be, act_q, check_finite, act_guide)


def fuses_guidance(a: torch.Tensor, weights: ExpertWeights, guide, backend: str = "auto") -> bool:
    """Whether :func:`grouped_linear` rounds ``a`` by ``guide`` inside the Triton activation
    pass: a quantized path on the Triton backend, fused guidance on
    (:func:`~libalign.gemm_triton.fused_guidance`), a spec and records the pass implements."""
    spec = weights.path.act_spec
    return spec is not None and fused_guidance_enabled() and triton_guided_gap(
        spec, guide, a.shape[-1]) is None and _resolve_backend(
        backend, a.device, weights.path, a.shape[-1]) == "triton"


# --- a whole MoE expert block -----------------------------------------------------------------

Observer = Callable[[str, torch.Tensor], None]
# hook(site, activations, spec, token_of, expert_of) -> their NVFP4 quantization
ActivationHook = Callable[[str, torch.Tensor, NumericsSpec, torch.Tensor, torch.Tensor | None],
                          NVFP4Tensor]


def take_rows(q: NVFP4Tensor, idx: torch.Tensor) -> NVFP4Tensor:
    """Rows ``idx`` of a 2-D NVFP4 tensor (row outer scales follow their rows)."""
    outer = q.outer_scale
    if outer is not None and q.spec.outer_domain == "row":
        outer = outer[idx]
    return NVFP4Tensor(q.codes[idx], q.block_scales[idx], outer, q.spec, (int(idx.numel()), q.k))


def moe_experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up: ExpertWeights, down: ExpertWeights, *, backend: str = "auto",
                        act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        observer: Observer | None = None,
                        act_hook: ActivationHook | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer (Qwen3-MoE layout) through prepared weights.

    ``hidden`` ``[T, H]``; ``top_k_index``/``top_k_weights`` ``[T, k]``; ``gate_up`` holds
    ``[E, 2I, H]`` (gate rows first, then up), ``down`` ``[E, H, I]``. Tokens are permuted
    so that rows are sorted by expert (stable, so ties keep token order), FC1 runs grouped,
    ``act_fn(gate) * up`` (SiLU by default) forms FC2's input, FC2 runs grouped, and each
    row is weighted by its router weight and summed back into its token.

    ``observer(name, tensor)``, when given, sees ``routing`` (``top_k_index``), ``fc1_in``,
    ``fc1_out``, ``fc2_in`` and ``fc2_out`` in the permuted (expert-sorted) row order, and
    ``order`` (the permutation) — what per-layer diagnosis compares between paths.

    ``act_hook``, on a quantized path, quantizes the activations instead of the path: it is
    called as ``hook("fc1", hidden, spec, token_of, None)`` once per token (``token_of`` is
    ``arange(T)``; row scales make a token's bits the same for each of its experts, so the
    rows are then gathered into expert order) and as ``hook("fc2", act, spec, token_of,
    expert_of)`` on the expert-sorted FC2 inputs. Guidance capture and guided rounding use it.
    """
    if hidden.ndim != 2:
        raise ShapeError(f"hidden states must be [tokens, hidden], got {tuple(hidden.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden.shape[0]:
        raise ShapeError(f"routing shapes {tuple(top_k_index.shape)} / {tuple(top_k_weights.shape)}"
                         f" do not match {hidden.shape[0]} tokens")
    e = gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=e)[:e]
    layout = group_layout(counts.cpu())
    x = hidden[token_of]
    hook = act_hook if gate_up.path.quantized and down.path.quantized else None
    q1 = q2 = None
    if hook is not None:
        tokens = torch.arange(hidden.shape[0], device=hidden.device)
        q1 = take_rows(hook("fc1", hidden, gate_up.path.act_spec, tokens, None), token_of)
    h = grouped_linear(x, gate_up, layout, backend=backend, act_q=q1)
    gate, up = h.chunk(2, dim=-1)
    act = (act_fn or torch.nn.functional.silu)(gate) * up
    if hook is not None:
        q2 = hook("fc2", act, down.path.act_spec, token_of, flat[order])
    y = grouped_linear(act, down, layout, backend=backend, act_q=q2)
    if observer is not None:
        observer("routing", top_k_index)
        observer("order", order)
        observer("fc1_in", x)
        observer("fc1_out", h)
        observer("fc2_in", act)
        observer("fc2_out", y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token_of, y.to(hidden.dtype))
