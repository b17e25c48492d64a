"""The grouped W4A4 GEMM on Hopper-class GPUs: Triton kernels fed with exact inner values.

Hopper (sm_90) has no FP4 tensor cores, but it multiplies bf16 on tensor cores with fp32
accumulation, and the inner value ``code * block_scale`` of an NVFP4 element has at most
6 significant bits, so it is exact in bf16. This backend therefore runs
:mod:`libalign.gemm`'s three steps as two Triton kernels (:mod:`libalign._triton_w4a4`):

1. one pass over the activations quantizes each row in the ``te`` fp32 operation order
   (bit for bit the spec's codes and scales) and writes the bf16 inner values and fp32 row
   decode scales;
2. a bf16 tensor-core GEMM over the expert-padded layout (:mod:`libalign.gemm_layout`),
   weights given as their exact inner values, with the epilogue
   ``bf16(acc * (a_dec[m] * w_dec[n]))``.

Only the fp32 addition order differs from the float64 reference, within one bf16 ulp.
What the activation pass implements is narrower than the spec: :func:`triton_act_gap` says
why a spec cannot be served, and :func:`libalign.gemm.grouped_linear` then uses another
backend. Triton is an optional dependency, imported on first use.
"""

from __future__ import annotations

import os

import torch

from .errors import SpecError
from .gemm_layout import GroupLayout, group_layout
from .spec import NumericsSpec
from .spec import check_finite as raise_if_nonfinite

_triton_module = None
_capability: dict[str, tuple[int, int]] = {}


def _kernels():
    """The Triton kernels, imported on first use; None where Triton or CUDA is missing."""
    global _triton_module
    if _triton_module is None:
        try:
            from . import _triton_w4a4
            _triton_module = _triton_w4a4
        except Exception:  # no triton, or a triton that cannot load
            _triton_module = False
    return _triton_module or None


def triton_gemm_available(device: torch.device | str) -> bool:
    """Whether the fused Triton W4A4 GEMM can run on ``device`` (CUDA, sm_90+, Triton)."""
    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get("ALIGN_KERNELS", "") == "spec":
        return False
    key = str(dev)
    if key not in _capability:
        _capability[key] = torch.cuda.get_device_capability(dev)
    return _capability[key][0] >= 9 and _kernels() is not None


def triton_act_gap(spec: NumericsSpec) -> str | None:
    """Why the Triton activation pass cannot quantize under ``spec``, or None when it can."""
    if spec.op_order != "te":
        return f"op_order {spec.op_order!r} (the Triton pass implements 'te')"
    if spec.outer_domain not in ("row", "tensor"):
        return f"activation outer domain {spec.outer_domain!r}"
    if spec.block_scale_floor is not None or spec.zero_prescale_to is not None:
        return "a block-scale floor or zero-prescale substitute"
    if spec.nonfinite != "raise" or spec.scale_math_dtype != "float32":
        return "non-finite saturation or non-fp32 scale math"
    if spec.hadamard or spec.stochastic_rounding:
        return "a Hadamard rotation or stochastic rounding"
    return None


def triton_k_gap(k: int) -> str | None:
    """Why the Triton GEMM cannot contract over ``k`` elements, or None when it can."""
    return None if k % 16 == 0 else f"K={k} is not a multiple of 16"


def _kernels_for(x: torch.Tensor, k: int):
    tk = _kernels()
    if tk is None or x.device.type != "cuda":
        raise SpecError("the Triton W4A4 GEMM needs a CUDA device with Triton installed")
    gap = triton_k_gap(k)
    if gap is not None:
        raise SpecError(f"the Triton W4A4 GEMM cannot serve {gap}")
    return tk


def _tiled(layout: GroupLayout) -> GroupLayout:
    """``layout`` itself when its padding is a Triton tile (64 or 128 rows), else padded to 128."""
    return layout if layout.pad_to in (64, 128) else group_layout(layout.counts, 128)


def w4a4_grouped_triton(a: torch.Tensor, spec: NumericsSpec, w_inner: torch.Tensor,
                        w_dec: torch.Tensor, layout: GroupLayout,
                        out_dtype: torch.dtype = torch.bfloat16, *,
                        check_finite: bool = True, chunks: int | None = None) -> torch.Tensor:
    """The fused W4A4 grouped GEMM on a CUDA device.

    ``a`` ``[rows, K]`` sorted by expert as ``layout`` says; ``w_inner`` the bf16 inner values
    ``[E, N, K]`` and ``w_dec`` ``[E, N]`` of :func:`libalign.gemm.prepare_weights`. Rows are
    padded to 128 per expert when the layout is not already padded to 64 or 128.
    ``check_finite`` synchronises once to raise :class:`~libalign.errors.NonFiniteError`
    for activations holding NaN/Inf. ``chunks`` row ranges overlap the activation pass of one
    with the GEMM of the previous (default ``$ALIGN_GEMM_CHUNKS`` or 1); the bits are the same
    for any value.
    """
    tk = _kernels_for(a, a.shape[-1])
    gap = triton_act_gap(spec)
    if gap is not None:
        raise SpecError(f"the Triton W4A4 GEMM cannot serve {gap}")
    lay = _tiled(layout)
    ap = lay.pad(a.contiguous())
    amax = None
    if spec.outer_domain == "tensor":
        # one read pass (no |a| temporary); NaN propagates and is caught by the row check
        amax = (torch.linalg.vector_norm(a, float("inf")).float().reshape(1) if a.numel()
                else a.new_zeros(1, dtype=torch.float32))
    tiles = lay.tile_expert(lay.pad_to, a.device)
    if chunks is None:  # the overlap is written and bit-tested but not yet timed on a GPU
        chunks = int(os.environ.get("ALIGN_GEMM_CHUNKS", "1"))
    out, dec = tk.pipelined(ap, amax_floor=spec.amax_floor, tensor_amax=amax, w_inner=w_inner,
                            w_dec=w_dec, tile_expert=tiles, pad=lay.pad_to, out_dtype=out_dtype,
                            chunks=chunks)
    # checked after the GEMM is queued, so the device never idles while the host looks
    if check_finite and not bool(torch.isfinite(dec).all()):
        raise_if_nonfinite(a, "activations")  # raises with counts and positions
    return lay.unpad(out)


def w4a4_grouped_triton_quantized(a_inner: torch.Tensor, a_dec: torch.Tensor,
                                  w_inner: torch.Tensor, w_dec: torch.Tensor, layout: GroupLayout,
                                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The Triton grouped GEMM on activations quantized elsewhere (guided rounding).

    ``a_inner`` ``[rows, K]`` bf16 inner values (code times block scale) and ``a_dec``
    ``[rows]`` fp32 row decode scales, rows sorted by expert as ``layout`` says.
    """
    tk = _kernels_for(a_inner, a_inner.shape[-1])
    lay = _tiled(layout)
    ap = lay.pad(a_inner.to(torch.bfloat16).contiguous())
    dp = lay.pad(a_dec.float().reshape(-1, 1)).reshape(-1).contiguous()
    tiles = lay.tile_expert(lay.pad_to, a_inner.device)
    out = tk.grouped_gemm(ap, dp, w_inner, w_dec, tiles, lay.pad_to, out_dtype)
    return lay.unpad(out)
