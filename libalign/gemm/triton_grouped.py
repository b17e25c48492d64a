"""The grouped W4A4 GEMM on Hopper-class GPUs: Triton kernels fed with exact inner values.

Hopper (sm_90) has no FP4 tensor cores, but it multiplies bf16 on tensor cores with fp32
accumulation, and the inner value ``code * block_scale`` of an NVFP4 element has at most
6 significant bits, so it is exact in bf16. This backend therefore runs
:mod:`libalign.gemm`'s three steps as two Triton kernels (:mod:`libalign.gemm.triton_kernels`):

1. one pass over the activations quantizes each row in the ``te`` fp32 operation order
   (bit for bit the spec's codes and scales) and writes the bf16 inner values and fp32 row
   decode scales;
2. a bf16 tensor-core GEMM over the expert-padded layout (:mod:`libalign.gemm.row_groups`),
   weights given as their exact inner values, with the epilogue
   ``bf16(acc * (a_dec[m] * w_dec[n]))``.

Only the fp32 addition order differs from the float64 reference, within one bf16 ulp.
What the activation pass implements is narrower than the spec: :func:`triton_act_gap` says
why a spec cannot be served, and :func:`libalign.gemm.grouped_linear` then uses another
backend. Triton is an optional dependency, imported on first use.
"""

from __future__ import annotations

import warnings

import torch

from libalign.errors import SpecError
from libalign.gemm.finite_checks import check_rows
from libalign.gemm.row_groups import GroupLayout, group_layout
from libalign.kernels import config
from libalign.spec import INPUT_DTYPES, NumericsSpec
from libalign.spec.rounding import e4m3_table, guide_tables

_triton_module = None
_capability: dict[str, tuple[int, int]] = {}


def _kernels():
    """The Triton kernels, imported on first use; None where Triton or CUDA is missing."""
    global _triton_module
    if _triton_module is None:
        try:
            from libalign.gemm import triton_kernels
            _triton_module = triton_kernels
        except Exception:  # no triton, or a triton that cannot load
            _triton_module = False
    return _triton_module or None


def triton_gemm_available(device: torch.device | str) -> bool:
    """Whether the fused Triton W4A4 GEMM can run on ``device`` (CUDA, sm_90+, Triton)."""
    dev = torch.device(device)
    if dev.type != "cuda" or config.current().kernels == "spec":
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


def _unpad_rows(lay: GroupLayout):
    """Map row decode scales over ``lay``'s padded rows to the caller's rows."""
    return lambda dec: lay.unpad(dec.reshape(-1, 1)).reshape(-1)


def w4a4_grouped_triton(a: torch.Tensor, spec: NumericsSpec, w_inner: torch.Tensor,
                        w_dec: torch.Tensor, layout: GroupLayout,
                        out_dtype: torch.dtype = torch.bfloat16, *,
                        check_finite: bool = True, chunks: int | None = None) -> torch.Tensor:
    """The fused W4A4 grouped GEMM on a CUDA device.

    ``a`` ``[rows, K]`` sorted by expert as ``layout`` says; ``w_inner`` the bf16 inner values
    ``[E, N, K]`` and ``w_dec`` ``[E, N]`` of :func:`libalign.gemm.prepare_weights`. Rows are
    padded to 128 per expert when the layout is not already padded to 64 or 128.
    ``check_finite`` raises :class:`~libalign.errors.NonFiniteError` for activations holding
    NaN/Inf: at once (one synchronisation), or when the enclosing
    :func:`libalign.gemm.finite_checks.deferred_finite_checks` block ends. ``chunks`` row ranges
    overlap the activation pass of one with the GEMM of the previous (default
    ``$ALIGN_GEMM_CHUNKS`` or 1); the bits are the same for any value.
    """
    tk = _kernels_for(a, a.shape[-1])
    gap = triton_act_gap(spec)
    if gap is not None:
        raise SpecError(f"the Triton W4A4 GEMM cannot serve {gap}")
    lay = _tiled(layout)
    a = a.contiguous()
    # rows reach the padded layout inside the activation pass: no padded copy of ``a``
    src_rows = lay.source_rows(a.device) if lay.padded_total != lay.total else None
    amax = None
    if spec.outer_domain == "tensor":
        # one read pass (no |a| temporary); NaN propagates and is caught by the row check
        amax = (torch.linalg.vector_norm(a, float("inf")).float().reshape(1) if a.numel()
                else a.new_zeros(1, dtype=torch.float32))
    tiles = lay.tile_expert(lay.pad_to, a.device)
    if chunks is None:
        chunks = config.current().gemm_chunks
    out, dec = tk.pipelined(a, amax_floor=spec.amax_floor, tensor_amax=amax, w_inner=w_inner,
                            w_dec=w_dec, tile_expert=tiles, pad=lay.pad_to, out_dtype=out_dtype,
                            chunks=chunks, src_rows=src_rows)
    if check_finite:  # after the GEMM is queued, so the device never idles while the host looks
        check_rows(dec, a, "activations", _unpad_rows(lay))
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


_DECODE_FAILED: list[str] = []


def triton_decode(on: bool = True):
    """Decode bf16 inner values with the Triton pass (or not) inside the block: on by default
    (``ALIGN_TRITON_DECODE=0``, :attr:`~libalign.kernels.config.KernelConfig.triton_decode`);
    off, the table gather serves, with the same bits."""
    return config.scoped(triton_decode=bool(on))


def triton_inner_values(codes: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor | None:
    """bf16 inner values (code times E4M3 block scale) of packed codes ``[..., Kp/2]`` on a
    CUDA device, K padded to 16: :func:`libalign.gemm.inner_values`'s bits in one pass.

    None when the pass is off (:func:`triton_decode`) or this Triton cannot build it (one
    warning; the caller's table gather then serves, with the same bits), as a failed kernel
    build leaves the spec serving.
    """
    if _DECODE_FAILED or not config.current().triton_decode:
        return None
    try:
        return _kernels_for(codes, 16).inner_from_codes(codes, block_scales,
                                                        e4m3_table(codes.device))
    except Exception as e:  # a compile failure of this Triton version
        _DECODE_FAILED.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"the Triton inner-value pass failed ({_DECODE_FAILED[0][:200]}); "
                      "the table gather decodes instead", RuntimeWarning, stacklevel=2)
        return None


# --- guided rounding fused into the activation pass (TRACE) ----------------------------------

def fused_guidance_enabled() -> bool:
    """Whether guided activations go through the fused Triton pass: on by default;
    ``ALIGN_FUSED_GUIDANCE=0`` or :func:`fused_guidance` turns it off."""
    return config.current().fused_guidance


def fused_guidance(on: bool = True):
    """Route guided activations through the fused pass (or not) inside the block."""
    return config.scoped(fused_guidance=bool(on))


def triton_guided_gap(spec: NumericsSpec, guide, k: int) -> str | None:
    """Why the fused pass cannot round these activations by ``guide`` (a
    :class:`~libalign.guidance.RowGuide`), or None when it can."""
    gap = triton_act_gap(spec) or triton_k_gap(k)
    if gap is not None:
        return gap
    if spec.outer_domain != "row" or spec.outer_convention != "dec":
        return "guided rows need row scales stored as decode scales"
    if spec.signed_zero != "positive" or spec.zero_scale_encode != "zero":
        return "signed zeros or a saturating zero scale"
    if guide.bits not in (1, 2, 3, 4) or guide.low.dtype != torch.uint8 or \
            guide.low.shape[-1] != k or guide.block_scales.shape[-1] * 16 != k:
        return "records of another width"
    return None


def _record_rows(guide) -> torch.Tensor:
    """int32 record index of each row of ``guide`` (a RowGuide), -1 where it has none."""
    return torch.where(guide.present, guide.index, -1).to(torch.int32)


def _guided_pass(tk, x: torch.Tensor, src: torch.Tensor, guide, spec: NumericsSpec, **kw):
    """The guided activation pass over rows ``x`` (``src``: each row's record, -1 none) with
    ``guide``'s records, low bits and level tables: ``(values, row decode scales)``."""
    up, down = guide_tables(guide.bits, x.device)
    return tk.guided_act_qdq(
        x, src=src, low=guide.low.contiguous(),
        block_scales=guide.block_scales.view(torch.uint8).contiguous(),
        row_scales=guide.row_scales.to(torch.float32).contiguous(), bits=guide.bits,
        amax_floor=spec.amax_floor, e4m3=e4m3_table(x.device), up=up, down=down, **kw)


def w4a4_grouped_triton_guided(a: torch.Tensor, spec: NumericsSpec, guide, w_inner: torch.Tensor,
                               w_dec: torch.Tensor, layout: GroupLayout,
                               out_dtype: torch.dtype = torch.bfloat16, *,
                               check_finite: bool = True) -> torch.Tensor:
    """:func:`w4a4_grouped_triton` with the activations rounded by a sampler's records.

    ``guide`` (a :class:`~libalign.guidance.RowGuide` for the rows of ``a``): rows it marks
    present take their record's scales and low code bits
    (:func:`libalign.guidance.guided_quantize`'s bits), the others round to nearest; one
    pass writes the inner values, as the unguided pass does.
    """
    tk = _kernels_for(a, a.shape[-1])
    gap = triton_guided_gap(spec, guide, a.shape[-1])
    if gap is not None:
        raise SpecError(f"the fused guided pass cannot serve {gap}")
    lay = _tiled(layout)
    src = _record_rows(guide)
    rows = None
    if lay.padded_total != lay.total:  # the pass reads each row into its padded place
        src = (lay.pad((src + 1).reshape(-1, 1)) - 1).reshape(-1).contiguous()  # padding: none
        rows = lay.source_rows(a.device)
    inner, dec = _guided_pass(tk, a.contiguous(), src, guide, spec, src_rows=rows)
    out = tk.grouped_gemm(inner, dec, w_inner, w_dec, lay.tile_expert(lay.pad_to, a.device),
                          lay.pad_to, out_dtype)
    if check_finite:
        check_rows(dec, a, "activations", _unpad_rows(lay))
    return lay.unpad(out)


# --- FP4 rows read back in one pass (the learner's K/V) ---------------------------------------



def fused_kv(on: bool = True):
    """Read FP4 K/V back through :func:`triton_qdq_rows` (or not) inside the block (on by
    default, ``ALIGN_FUSED_KV=0`` turns it off). Off, the unfused path serves with the same
    bits (what the benchmark's ``_torchkv`` rows time)."""
    return config.scoped(fused_kv=bool(on))


def triton_qdq_gap(spec: NumericsSpec, guide, x: torch.Tensor) -> str | None:
    """Why :func:`triton_qdq_rows` cannot give ``x``'s rows as their FP4 bits read back, bit
    for bit, or None when it can (``guide``: a :class:`~libalign.guidance.RowGuide` or None).

    Beyond what the activation pass implements (:func:`triton_act_gap`, and with a guide
    :func:`triton_guided_gap`, which also asks for :func:`fused_guidance`), a value read back
    shows what a GEMM never sees: the sign of a zero (the pass writes +0.0, so the spec must
    code every zero magnitude 0x0 and give a zero-scale block zero codes) and one decode scale
    per row (outer domain ``row``). The spec's amax floor is passed to the pass, its
    ``nonfinite='raise'`` checked on the row decode scales it writes.
    """
    if not config.current().fused_kv:
        return "the fused read-back is off (fused_kv / ALIGN_FUSED_KV=0)"
    if not triton_gemm_available(x.device):
        return f"device {x.device} (the pass needs CUDA sm_90+ with Triton)"
    if x.ndim != 2 or x.dtype not in INPUT_DTYPES:
        return f"a {x.ndim}-D {x.dtype} input (rows [n, K] of float32, bfloat16 or float16)"
    gap = triton_act_gap(spec) or triton_k_gap(x.shape[-1])
    if gap is None and spec.outer_domain != "row":
        gap = f"outer domain {spec.outer_domain!r} (reads need one decode scale a row)"
    if gap is None and (spec.signed_zero != "positive" or spec.zero_scale_encode != "zero"):
        gap = "signed zeros or a saturating zero scale (the pass reads zeros back as +0.0)"
    if gap is None and guide is not None:
        if not fused_guidance_enabled():
            return "fused guidance is off (fused_guidance / ALIGN_FUSED_GUIDANCE=0)"
        if tuple(guide.present.shape) != (x.shape[0],):
            return "guidance for another number of rows"
        gap = triton_guided_gap(spec, guide, x.shape[-1])
    return gap


def triton_qdq_rows(x: torch.Tensor, spec: NumericsSpec, guide=None) -> torch.Tensor:
    """``x`` ``[n, K]`` quantized row by row under ``spec`` and read back, in ``x``'s dtype.

    What an FP4 KV cache holds and attention reads: each row's NVFP4 codes (rounded to nearest
    under its own scales, or, for a row ``guide`` marks present, under its record's scales
    towards its record's low bits: :func:`libalign.guidance.guided_quantize`'s codes), then
    ``(inner.float() * dec[:, None]).to(x.dtype)`` with ``inner = code * block scale`` exact
    and ``dec`` the row decode scale: :func:`libalign.models.kv_cache.dequantize_kv`'s bits.
    The unfused path runs about a dozen kernels (a guided one also synchronises on
    ``nonzero``); this is one Triton pass (:func:`libalign.gemm.triton_kernels.act_qdq` or its guided
    twin with ``dequantize``), reading ``x`` and writing the values once, no codes kept.

    A NaN/Inf in ``x`` raises :class:`~libalign.errors.NonFiniteError` naming the input
    positions, as :func:`libalign.kernels.quantize` does (now, or when an enclosing
    :func:`libalign.gemm.finite_checks.deferred_finite_checks` block ends). SpecError where
    :func:`triton_qdq_gap` names a gap.
    """
    gap = triton_qdq_gap(spec, guide, x)
    if gap is not None:
        raise SpecError(f"the fused FP4 read-back pass cannot serve {gap}")
    tk = _kernels_for(x, x.shape[-1])
    xc = x.contiguous()
    if guide is None:
        out, dec = tk.act_qdq(xc, amax_floor=spec.amax_floor, tensor_amax=None, dequantize=True)
    else:
        kb = x.shape[-1] // 16
        out, dec = _guided_pass(tk, xc, _record_rows(guide), guide, spec,
                                chunk=min(16, 1 << (kb - 1).bit_length()), dequantize=True)
    check_rows(dec, x, "input")
    return out
