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
(:mod:`libalign.gemm.row_groups`) pads each expert's rows to a multiple of 64 or 128 so that a
GEMM tile never straddles two experts; padding rows are zero, which changes no outer maximum
(a zero row quantizes to zero codes), so padding is invisible in the result.

**Backends.** This module defines the product, runs the reference and CPU backends, and
chooses one (:func:`grouped_linear`); the GPU backends live beside it:
:mod:`libalign.gemm.triton_grouped` (Hopper, Triton kernels on bf16 tensor cores) and
:mod:`libalign.gemm.cutlass_grouped` (Blackwell FP4 tensor cores through CUTLASS). Operands are
quantized through the kernel door, :mod:`libalign.kernels`.

**Execution paths.** :data:`PATHS` names what a learner or a sampler can run: ``bf16`` (no
quantization), ``nvfp4_naive`` (per-tensor activation scale, per-expert weight scale: the
common recipe), ``nvfp4_minite`` (row-scaled activations and weights, the miniTE spec). A
path fixes one :class:`~libalign.spec.NumericsSpec` for each operand.

**Backward.** The straight-through estimator: gradients are those of the bf16 product of the
*unquantized* operands saved by the forward (``grad_a = grad_out @ W``, ``grad_W = grad_out^T
@ a`` per expert), as if quantization were the identity.

The package, one concept a module: :mod:`~libalign.gemm.paths` (execution paths),
:mod:`~libalign.gemm.inner` (inner values, epilogue, the reference),
:mod:`~libalign.gemm.weights` (prepared weights, quantized activations),
:mod:`~libalign.gemm.backends` (which backend serves a call), :mod:`~libalign.gemm.grouped`
(the grouped product and its straight-through autograd), :mod:`~libalign.gemm.moe` (a whole
MoE expert block), :mod:`~libalign.gemm.row_groups` (rows grouped by expert), the GPU backends
(:mod:`~libalign.gemm.triton_grouped`, :mod:`~libalign.gemm.cutlass_grouped`) and
:mod:`~libalign.gemm.finite_checks` (NaN/Inf checks of GPU activations).
"""

from libalign.gemm.backends import BACKENDS
from libalign.gemm.grouped import fuses_guidance, grouped_linear
from libalign.gemm.inner import (
    epilogue,
    inner_table,
    inner_values,
    row_decode_scales,
    w4a4_reference,
)
from libalign.gemm.moe import ActivationHook, Observer, moe_experts_forward, take_rows
from libalign.gemm.paths import (
    GUIDED,
    PATHS,
    Backend,
    ExecutionPath,
    get_path,
    guided_paths,
    register_path,
)
from libalign.gemm.row_groups import PAD_CHOICES, GroupLayout, group_layout
from libalign.gemm.weights import (
    ExpertWeights,
    prepare_weights,
    quantize_activations,
    weights_from_quantized,
)

__all__ = [
    "BACKENDS", "GUIDED", "PAD_CHOICES", "PATHS", "ActivationHook", "Backend", "ExecutionPath",
    "ExpertWeights", "GroupLayout", "Observer", "epilogue", "fuses_guidance", "get_path",
    "group_layout", "grouped_linear", "guided_paths", "inner_table", "inner_values",
    "moe_experts_forward", "prepare_weights", "quantize_activations", "register_path",
    "row_decode_scales", "take_rows", "w4a4_reference", "weights_from_quantized",
]
