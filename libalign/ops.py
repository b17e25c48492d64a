"""The only door to compiled kernels; everything else calls these functions.

Each function here has a reference in :mod:`libalign.spec`, and the kernels in ``csrc/``
reproduce that reference bit for bit (codes, block-scale bytes, outer-scale bits).

How a call is served
    CUDA tensors go to the CUDA kernel, CPU tensors to the C++ kernel (AVX-512 where the
    CPU has it), both built on first use (:mod:`libalign._native`). The kernels cover the
    ``te``, ``torchao`` and ``modelopt`` operation orders, every outer domain, bf16 /
    fp16 / fp32 input, 2-D matrices and 3-D expert stacks, a given outer maximum (shared
    gate/up scales), and linear or 128x4-swizzled block scales. Anything else — the
    compressed-tensors order (its scale math runs in bf16), a Hadamard rotation,
    stochastic rounding, K not a multiple of 16, a given per-row maximum — is served by
    the spec itself: slower, the same bits. :func:`backend_for` says which one a call gets.

Errors
    The kernels flag NaN/Inf input and undefined scales (a preset dividing 0 by 0) rather
    than describe them; on a flag the call re-runs the spec, which raises the typed error
    with positions, so every path raises exactly what the spec raises.

Row domain, one pass
    In the row domain (the ``minite`` default) a row's maximum, outer scale, block scales
    and codes come from one read of the row. The tensor and expert domains need the
    maximum before any scale, so they read the input twice: a max pass, then the encode.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from . import _native, scale_math
from . import spec as _spec
from .constants import BLOCK_SIZE
from .errors import SpecError
from .packing import swizzled_size, unswizzle_scales
from .spec import PRESETS, NumericsSpec, NVFP4Tensor

_ORDERS = {"te": 0, "torchao": 1, "modelopt": 2}
_SIGNED_ZERO = {"positive": 0, "sign_of_input": 1, "sign_of_nonzero": 2}
_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_CONVENTIONS = {"amax": 0, "enc": 1, "dec": 2}
_FLAG_NONFINITE, _FLAG_UNDEFINED, _FLAG_USE_SPEC = 1, 2, 4
SCALE_LAYOUTS = ("linear", "swizzled")
BACKENDS = ("auto", "kernel", "spec")


@dataclass(frozen=True, eq=False)
class GemmOperand:
    """A quantized weight laid out for block-scaled GEMMs: scales in the 128x4 layout.

    ``block_scales`` is the flat swizzled buffer (each expert padded to 128 rows and a
    multiple of 4 scale columns, padding bytes zero); the other fields are as in
    :class:`~libalign.spec.NVFP4Tensor`.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    outer_scale: torch.Tensor | None
    outer_amax: torch.Tensor | None
    spec: NumericsSpec
    shape: tuple[int, ...]

    def linear(self) -> NVFP4Tensor:
        """The same bits with linear block scales."""
        nb = -(-self.shape[-1] // BLOCK_SIZE)
        lin = unswizzle_scales(self.block_scales, (*self.shape[:-1], nb))
        return NVFP4Tensor(self.codes, lin, self.outer_scale, self.spec, self.shape,
                           self.outer_amax)


def kernel_gap(x: torch.Tensor, spec: NumericsSpec, outer_amax: torch.Tensor | None) -> str | None:
    """Why the compiled kernels cannot serve this call, or None when they can."""
    if spec.op_order not in _ORDERS:
        return f"op_order {spec.op_order!r} (its scale math is not fp32)"
    if spec.scale_math_dtype != "float32" or spec.zero_scale_to is not None:
        return "scale math in the input dtype / zero-scale substitution"
    if spec.hadamard:
        return "Hadamard rotation"
    if spec.stochastic_rounding:
        return "stochastic rounding"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    if x.shape[-1] % BLOCK_SIZE:
        return f"K={x.shape[-1]} is not a multiple of {BLOCK_SIZE}"
    if x.device.type not in ("cpu", "cuda"):
        return f"device {x.device.type}"
    if outer_amax is not None and spec.outer_domain == "row":
        return "a given per-row maximum"
    return None


def backend_for(x: torch.Tensor, spec: NumericsSpec | None = None,
                outer_amax: torch.Tensor | None = None) -> str:
    """``'cuda'``, ``'cpu'`` or ``'spec'``: which implementation :func:`quantize` would use."""
    spec = PRESETS["minite"] if spec is None else spec
    if kernel_gap(x, spec, outer_amax) is not None:
        return "spec"
    kind = x.device.type
    return kind if _native.load(kind) is not None else "spec"


def quantize(
    x: torch.Tensor,
    spec: NumericsSpec | None = None,
    *,
    outer_amax: torch.Tensor | None = None,
    scale_layout: str = "linear",
    backend: str = "auto",
    out: NVFP4Tensor | GemmOperand | None = None,
) -> NVFP4Tensor | GemmOperand:
    """Quantize like :func:`libalign.spec.quantize`, on the fastest backend available.

    ``scale_layout='swizzled'`` returns a :class:`GemmOperand` whose block scales are
    already in the 128x4 layout (written in place by the kernel, no extra pass).
    ``backend`` is ``auto`` (kernel when possible), ``kernel`` (raise
    :class:`~libalign.errors.SpecError` if no kernel can serve the call) or ``spec``.
    ``out`` is an earlier result of the same shape, spec, layout and device whose buffers
    are overwritten (a converter that quantizes the same shapes every step skips the
    allocation and the page faults of fresh output memory).
    """
    spec = PRESETS["minite"] if spec is None else spec
    if scale_layout not in SCALE_LAYOUTS:
        raise SpecError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if backend not in BACKENDS:
        raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _spec._check_input(x, spec)
    if out is not None:
        _check_out(out, x, spec, scale_layout)
    gap = kernel_gap(x, spec, outer_amax)
    lib = None if gap is not None or backend == "spec" else _native.load(x.device.type)
    if lib is None:
        if backend == "kernel":
            raise SpecError(f"no compiled kernel serves this call: {gap or 'kernel unavailable'}")
        q = _spec.quantize(x, spec, outer_amax=outer_amax)
        q = q if scale_layout == "linear" else _as_gemm_operand(q)
        return q if out is None else _copy_into(q, out)
    return _quantize_kernel(lib, x, spec, outer_amax, scale_layout == "swizzled", out)


def _check_out(out, x, spec, layout) -> None:
    """Refuse an ``out`` that does not have this call's shape, spec, layout and device."""
    want = GemmOperand if layout == "swizzled" else NVFP4Tensor
    if not isinstance(out, want):
        raise SpecError(f"out must be a {want.__name__} for scale_layout={layout!r}")
    if out.shape != tuple(x.shape) or out.spec != spec or out.codes.device != x.device:
        raise SpecError(f"out has shape {out.shape}, spec {out.spec.name!r} on "
                        f"{out.codes.device}; this call needs {tuple(x.shape)}, "
                        f"{spec.name!r} on {x.device}")
    for t in (out.codes, out.block_scales, out.outer_scale, out.outer_amax):
        if t is not None and not t.is_contiguous():
            raise SpecError("out's buffers must be contiguous")


def _copy_into(q, out):
    """Copy a result's bits into ``out``'s buffers and return a result viewing them."""
    out.codes.copy_(q.codes)
    out.block_scales.view(torch.uint8).copy_(q.block_scales.view(torch.uint8))
    for mine, theirs in ((out.outer_scale, q.outer_scale), (out.outer_amax, q.outer_amax)):
        if mine is not None and theirs is not None:
            mine.copy_(theirs)
    return type(out)(**{**q.__dict__, "codes": out.codes, "block_scales": out.block_scales,
                        "outer_scale": out.outer_scale if q.outer_scale is not None else None,
                        "outer_amax": out.outer_amax if q.outer_amax is not None else None})


def _as_gemm_operand(q: NVFP4Tensor) -> GemmOperand:
    return GemmOperand(q.codes, q.swizzled_block_scales(), q.outer_scale, q.outer_amax,
                       q.spec, q.shape)


def _params(x3: torch.Tensor, spec: NumericsSpec, swizzled: bool) -> _native.NvParams:
    e, m, k = x3.shape
    p = _native.NvParams()
    p.experts, p.rows, p.k = e, m, k
    p.in_dtype = _DTYPES[x3.dtype]
    p.op_order = _ORDERS[spec.op_order]
    p.outer_mode = 1 if spec.outer_domain == "row" else 0
    p.outer_stride = 1 if spec.outer_domain == "expert" else 0
    p.store_conv = _CONVENTIONS[spec.outer_convention]
    p.has_amax_floor = int(spec.amax_floor is not None)
    p.amax_floor = spec.amax_floor or 0.0
    p.block_scale_floor = spec.block_scale_floor or 0.0
    p.has_zero_prescale = int(spec.zero_prescale_to is not None)
    p.zero_prescale_to = spec.zero_prescale_to or 0.0
    p.zero_saturate = int(spec.zero_scale_encode == "saturate")
    p.signed_zero = _SIGNED_ZERO[spec.signed_zero]
    p.nonfinite_saturate = int(spec.nonfinite == "saturate")
    p.in_max = torch.finfo(x3.dtype).max
    p.swizzled = int(swizzled)
    return p


def _outer_given(lib, x3, is_3d, spec, p, outer_amax, flags, stream, nthreads):
    """Outer scales of the tensor/expert/none domains: amax pass + the spec's formulas.

    Returns ``(enc, dec, stored, amax)``, or None when the amax pass met NaN/Inf.
    """
    dev = x3.device
    if spec.outer_domain == "none":
        one = torch.ones(1, dtype=torch.float32, device=dev)
        return one, one, None, None
    per_expert_domain = spec.outer_domain == "expert" and is_3d
    if outer_amax is None:
        per_expert = torch.zeros(x3.shape[0], dtype=torch.float32, device=dev)
        if dev.type == "cpu":
            code = lib.nvfp4_amax_cpu(x3.data_ptr(), per_expert.data_ptr(), p, nthreads)
            _check_launch(code, "amax")
            if code > 0:
                return None
        else:  # NaN/Inf rows are flagged again by the encode kernel: flags are read once
            code = lib.nvfp4_amax_cuda(x3.data_ptr(), per_expert.data_ptr(), p,
                                       flags.data_ptr(), stream)
            _check_launch(code, "amax")
            if code:
                raise RuntimeError(f"CUDA error {code} in the NVFP4 amax kernel")
        if per_expert_domain:
            amax = per_expert
        else:
            amax = per_expert.amax() if per_expert.numel() else per_expert.new_zeros(())
    else:
        want = torch.empty(x3.shape[0] if per_expert_domain else ())
        amax = _spec._checked_outer_amax(outer_amax, want.to(dev))
    if spec.amax_floor is not None:
        amax = torch.clamp(amax, min=amax.new_tensor(spec.amax_floor))
    outer = scale_math.outer_from_amax(amax, spec.op_order, torch.float32)
    stored = scale_math.stored_from_outer(outer, amax, spec.outer_convention)
    return outer.enc.reshape(-1).contiguous(), outer.dec.reshape(-1).contiguous(), stored, amax


def _check_launch(code: int, what: str) -> None:
    if code < 0:
        raise SpecError(f"the {what} kernel refused its parameters (code {code})")


@dataclass
class _Pending:
    """A launched kernel call whose flags are not read yet (see :func:`quantize_many`)."""

    x: torch.Tensor
    spec: NumericsSpec
    outer_amax: torch.Tensor | None
    swizzled: bool
    out: NVFP4Tensor | GemmOperand | None
    codes: torch.Tensor
    scales: torch.Tensor
    amax_out: torch.Tensor
    stored_out: torch.Tensor
    stored: torch.Tensor | None
    amax: torch.Tensor | None
    flags: torch.Tensor | int  # a device int (CUDA, read later) or the CPU kernel's result


def _launch(lib, x, spec, outer_amax, swizzled, out=None, flags=None) -> _Pending:
    """Allocate outputs and launch the kernel(s); CUDA work stays asynchronous."""
    is_3d = x.ndim == 3
    x3 = (x if is_3d else x.unsqueeze(0)).contiguous()
    e, m, k = x3.shape
    nb = k // BLOCK_SIZE
    dev = x3.device
    p = _params(x3, spec, swizzled)
    cuda = dev.type == "cuda"
    if cuda and flags is None:
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream if cuda else None
    nthreads = torch.get_num_threads()

    row = spec.outer_domain == "row"
    if out is None:
        codes = torch.empty((e, m, k // 2), dtype=torch.uint8, device=dev)
        if swizzled:  # padding bytes must be zero; without padding every byte is written
            alloc = torch.empty if m % 128 == 0 and nb % 4 == 0 else torch.zeros
            scales = alloc(e * swizzled_size(m, nb), dtype=torch.uint8, device=dev)
        else:
            scales = torch.empty((e, m, nb), dtype=torch.uint8, device=dev)
        amax_out = torch.empty(e * m if row else 0, dtype=torch.float32, device=dev)
        stored_out = torch.empty_like(amax_out)
    else:  # the kernel never writes swizzle padding, so out's zero padding stays zero
        codes = out.codes.view(e, m, k // 2)
        scales = out.block_scales.view(torch.uint8)
        scales = scales.view(-1) if swizzled else scales.view(e, m, nb)
        empty = torch.empty(0, dtype=torch.float32, device=dev)
        amax_out = out.outer_amax.view(-1) if row else empty
        stored_out = out.outer_scale.view(-1) if row else empty
    stored = amax = None
    pending = _Pending(x, spec, outer_amax, swizzled, out, codes, scales, amax_out, stored_out,
                       None, None, 0)
    same = not cuda or dev.index is None or dev.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(dev):
        if row:
            enc = dec = amax_out  # unused in ROW mode
        else:
            given = _outer_given(lib, x3, is_3d, spec, p, outer_amax, flags, stream, nthreads)
            if given is None:  # the CPU amax pass met NaN/Inf
                pending.flags = _FLAG_NONFINITE
                return pending
            enc, dec, stored, amax = given
        if cuda:
            code = lib.nvfp4_quantize_cuda(x3.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                           amax_out.data_ptr(), stored_out.data_ptr(),
                                           enc.data_ptr(), dec.data_ptr(), p, flags.data_ptr(),
                                           stream)
            _check_launch(code, "quantize")
            if code:
                raise RuntimeError(f"CUDA error {code} in the NVFP4 quantize kernel")
            pending.flags = flags
        else:
            bad = lib.nvfp4_quantize_cpu(x3.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                         amax_out.data_ptr(), stored_out.data_ptr(),
                                         enc.data_ptr(), dec.data_ptr(), p, nthreads)
            _check_launch(bad, "quantize")
            pending.flags = bad
    pending.stored, pending.amax = stored, amax
    return pending


def _finish(t: _Pending, bad: int):
    """The result of a launched call, given its flags (the spec raises or answers on a flag)."""
    x, spec, out = t.x, t.spec, t.out
    if bad == _FLAG_USE_SPEC:  # a corner the fast path does not reproduce: the spec's bits
        q = _spec.quantize(x, spec, outer_amax=t.outer_amax)
        q = _as_gemm_operand(q) if t.swizzled else q
        return q if out is None else _copy_into(q, out)
    if bad:
        return _raise_like_spec(x, spec, t.outer_amax)
    shape = tuple(x.shape)
    lead, k = shape[:-1], shape[-1]
    codes = t.codes.reshape(*lead, k // 2)
    stored, amax = t.stored, t.amax
    if spec.outer_domain == "row":
        stored, amax = t.stored_out.reshape(lead), t.amax_out.reshape(lead)
    elif out is not None and stored is not None:
        out.outer_scale.copy_(stored)
        out.outer_amax.copy_(amax)
        stored, amax = out.outer_scale, out.outer_amax
    if t.swizzled:
        return GemmOperand(codes, t.scales.view(torch.float8_e4m3fn), stored, amax, spec, shape)
    return NVFP4Tensor(codes=codes,
                       block_scales=t.scales.reshape(*lead, k // BLOCK_SIZE).view(torch.float8_e4m3fn),
                       outer_scale=stored, spec=spec, shape=shape, outer_amax=amax)


def _quantize_kernel(lib, x, spec, outer_amax, swizzled, out=None):
    t = _launch(lib, x, spec, outer_amax, swizzled, out)
    return _finish(t, int(t.flags.item()) if isinstance(t.flags, torch.Tensor) else t.flags)


def quantize_many(
    tensors: list[torch.Tensor],
    spec: NumericsSpec | None = None,
    *,
    scale_layout: str = "linear",
) -> list[NVFP4Tensor | GemmOperand]:
    """:func:`quantize` of several tensors with one device synchronisation for all.

    Each call's error flags are read after every kernel has been launched, so a GPU runs
    the tensors back to back (a converter quantizing a layer, a sync quantizing a model).
    Errors are the same as :func:`quantize` raises, for the first failing tensor.
    """
    spec = PRESETS["minite"] if spec is None else spec
    if scale_layout not in SCALE_LAYOUTS:
        raise SpecError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    results: list = [None] * len(tensors)
    launched: list[tuple[int, _Pending]] = []
    flags = {}
    for i, x in enumerate(tensors):
        _spec._check_input(x, spec)
        lib = None if kernel_gap(x, spec, None) else _native.load(x.device.type)
        if lib is None:
            q = _spec.quantize(x, spec)
            results[i] = q if scale_layout == "linear" else _as_gemm_operand(q)
            continue
        slot = None
        if x.device.type == "cuda":
            buf = flags.get(x.device)
            if buf is None:
                buf = flags[x.device] = torch.zeros(len(tensors), dtype=torch.int32, device=x.device)
            slot = buf[i:i + 1]
        launched.append((i, _launch(lib, x, spec, None, scale_layout == "swizzled", flags=slot)))
    host_flags = {dev: buf.tolist() for dev, buf in flags.items()}  # one sync per device
    for i, t in launched:
        bad = host_flags[t.x.device][i] if isinstance(t.flags, torch.Tensor) else t.flags
        results[i] = _finish(t, bad)
    return results


# --- the emulated W4A4 grouped GEMM (Triton, CUDA) -------------------------------------------

_triton_module = None


def _triton():
    """The Triton kernels, imported on first use; None where Triton or CUDA is missing."""
    global _triton_module
    if _triton_module is None:
        try:
            from . import _triton_w4a4
            _triton_module = _triton_w4a4
        except Exception:  # no triton, or a triton that cannot load
            _triton_module = False
    return _triton_module or None


_capability: dict[str, tuple[int, int]] = {}


def triton_gemm_available(device: torch.device | str) -> bool:
    """Whether the fused Triton W4A4 GEMM can run on ``device`` (CUDA, sm_90+, Triton)."""
    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get("ALIGN_KERNELS", "") == "spec":
        return False
    key = str(dev)
    if key not in _capability:
        _capability[key] = torch.cuda.get_device_capability(dev)
    return _capability[key][0] >= 9 and _triton() is not None


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


def _triton_k_gap(k: int) -> str | None:
    return None if k % 16 == 0 else f"K={k} is not a multiple of 16"


def w4a4_grouped_triton(a: torch.Tensor, spec: NumericsSpec, w_inner: torch.Tensor,
                        w_dec: torch.Tensor, layout, out_dtype: torch.dtype = torch.bfloat16, *,
                        check_finite: bool = True, chunks: int | None = None) -> torch.Tensor:
    """The fused W4A4 grouped GEMM on a CUDA device (see :mod:`libalign._triton_w4a4`).

    ``a`` ``[rows, K]`` sorted by expert as ``layout`` (a :class:`libalign.gemm.GroupLayout`)
    says; ``w_inner`` the bf16 inner values ``[E, N, K]`` and ``w_dec`` ``[E, N]`` of
    :func:`libalign.gemm.prepare_weights`. Rows are padded to 128 per expert when the layout
    is not already padded to 64 or 128. ``check_finite`` synchronises once to raise
    :class:`~libalign.errors.NonFiniteError` for activations holding NaN/Inf. ``chunks`` row
    ranges overlap the activation pass of one with the GEMM of the previous (default
    ``$ALIGN_GEMM_CHUNKS`` or 1); the bits are the same for any value.
    """
    from .gemm import group_layout

    tk = _triton()
    if tk is None or a.device.type != "cuda":
        raise SpecError("the Triton W4A4 GEMM needs a CUDA device with Triton installed")
    gap = triton_act_gap(spec) or _triton_k_gap(a.shape[-1])
    if gap is not None:
        raise SpecError(f"the Triton W4A4 GEMM cannot serve {gap}")
    lay = layout if layout.pad_to in (64, 128) else group_layout(layout.counts, 128)
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
        _spec.check_finite(a, "activations")  # raises with counts and positions
    return lay.unpad(out)


def w4a4_grouped_triton_quantized(a_inner: torch.Tensor, a_dec: torch.Tensor,
                                  w_inner: torch.Tensor, w_dec: torch.Tensor, layout,
                                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The Triton grouped GEMM on activations quantized elsewhere (guided rounding).

    ``a_inner`` ``[rows, K]`` bf16 inner values (code times block scale) and ``a_dec``
    ``[rows]`` fp32 row decode scales, rows sorted by expert as ``layout`` says.
    """
    from .gemm import group_layout

    tk = _triton()
    if tk is None or a_inner.device.type != "cuda":
        raise SpecError("the Triton W4A4 GEMM needs a CUDA device with Triton installed")
    gap = _triton_k_gap(a_inner.shape[-1])
    if gap is not None:
        raise SpecError(f"the Triton W4A4 GEMM cannot serve {gap}")
    lay = layout if layout.pad_to in (64, 128) else group_layout(layout.counts, 128)
    ap = lay.pad(a_inner.to(torch.bfloat16).contiguous())
    dp = lay.pad(a_dec.float().reshape(-1, 1)).reshape(-1).contiguous()
    tiles = lay.tile_expert(lay.pad_to, a_inner.device)
    out = tk.grouped_gemm(ap, dp, w_inner, w_dec, tiles, lay.pad_to, out_dtype)
    return lay.unpad(out)


def _raise_like_spec(x, spec, outer_amax):
    _spec.quantize(x, spec, outer_amax=outer_amax)  # raises the typed error with positions
    raise RuntimeError("an NVFP4 kernel flagged its input but the spec accepted it; "
                       "please report this as a kernel bug")


# --- native Blackwell grouped NVFP4 GEMM (CUTLASS, sm_100a) -----------------------------------
#
# csrc/gemm_nvfp4_sm100.cu (ABI: csrc/gemm_abi.h). The FP4 tensor core multiplies the E2M1
# codes with their E4M3 block scales and accumulates in fp32; the epilogue computes
# out = bf16(acc * (a_dec[row] * w_dec[col])) in fp32, libalign.gemm's step 3 in its order.
# Built for sm_100a only (compute capability 10.0). Compiled in the tests, never run here:
# no Blackwell device has been available to this project.

_GEMM_SM100 = "gemm_sm100"
_GEMM_STATUS_ARCH, _GEMM_STATUS_SHAPE, _GEMM_STATUS_CAN_IMPLEMENT = 1, 2, 3
_WDEC_SCALAR, _WDEC_PER_EXPERT, _WDEC_PER_ROW = 0, 1, 2


def native_grouped_gemm_gap(device: torch.device | str | None = None) -> str | None:
    """Why the native Blackwell grouped GEMM cannot run on ``device``, or None when it can.

    Cheap checks come first (device type, compute capability), so a CPU or a Hopper machine
    never builds the library; on a 10.x device the first call builds it (about a minute).
    """
    dev = torch.device("cuda" if device is None else device)
    if os.environ.get("ALIGN_KERNELS", "").lower() == "spec":
        return "compiled kernels are disabled (ALIGN_KERNELS=spec)"
    if dev.type != "cuda":
        return f"device {dev} is not a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 10:
        return f"compute capability {major}.{minor} (the kernel needs Blackwell, 10.x)"
    try:
        lib = _native.load_or_raise(_GEMM_SM100)
    except _native.KernelBuildError as exc:
        return f"the sm_100a GEMM library is unavailable: {exc}"
    with torch.cuda.device(dev):
        if not lib.nvfp4_gemm_sm100_available():
            return f"the library holds no kernel for compute capability {major}.{minor} (sm_100a only)"
    return None


def native_grouped_gemm_available(device: torch.device | str | None = None) -> bool:
    """True when :func:`native_grouped_gemm` can run on ``device`` (a CC 10.x CUDA device)."""
    return native_grouped_gemm_gap(device) is None


def grouped_activation_scales(block_scales: torch.Tensor, row_offsets) -> torch.Tensor:
    """Linear activation scales ``[M_total, K/16]`` -> the grouped layout the GEMM reads.

    Each expert's rows ``row_offsets[e]:row_offsets[e+1]`` are swizzled on their own (padded
    to 128 rows and a multiple of 4 columns, padding zero) and the experts' buffers follow
    each other; an expert without rows takes no bytes.
    """
    from .errors import ShapeError
    from .packing import swizzle_scales

    if block_scales.ndim != 2:
        raise ShapeError(f"block_scales must be [M_total, K/16], got {tuple(block_scales.shape)}")
    offsets = _host_offsets(row_offsets, block_scales.shape[0])
    parts = [swizzle_scales(block_scales[offsets[e]:offsets[e + 1]])
             for e in range(len(offsets) - 1)]
    return torch.cat(parts) if parts else block_scales.new_zeros(0).reshape(-1)


def _host_offsets(row_offsets, total: int) -> list[int]:
    """``row_offsets`` as a checked host list: 0, non-decreasing, ending at ``total``."""
    from itertools import pairwise

    from .errors import ShapeError

    offs = [int(v) for v in (row_offsets.tolist() if isinstance(row_offsets, torch.Tensor)
                             else row_offsets)]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != total:
        raise ShapeError(f"row_offsets must run from 0 to {total} over E+1 >= 2 entries, got "
                         f"{offs[:4]}{' ...' if len(offs) > 4 else ''} (length {len(offs)})")
    if any(b < a for a, b in pairwise(offs)):
        raise ShapeError("row_offsets must be non-decreasing")
    return offs


def native_grouped_gemm(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_dec: torch.Tensor,
    row_offsets,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_dec: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = bf16(acc[r] * (a_dec[r] * w_dec[e]))`` for the rows ``r`` of each expert ``e``.

    The W4A4 grouped GEMM on Blackwell's FP4 tensor cores (CUTLASS, sm_100a):
    ``acc[r, n] = sum_k a[r, k] * w[e, n, k]`` over NVFP4 operands, then the fp32 epilogue.

    - ``a_codes`` uint8 ``[M_total, K/2]``: activation rows sorted by expert.
    - ``a_scales`` flat E4M3 (or uint8) block scales in the grouped swizzled layout of
      :func:`grouped_activation_scales`.
    - ``a_dec`` fp32 decode scales, ``[M_total]`` (per row) or one value.
    - ``row_offsets`` ``E + 1`` row offsets (0, non-decreasing, ``M_total``): a sequence or
      a CPU tensor (checked, copied to the device), or a CUDA int32 tensor (used as it is,
      with no synchronisation; then ``a_scales`` must hold the worst case,
      ``(M_total + 127 * E)`` padded rows).
    - ``w_codes`` uint8 ``[E, N, K/2]``, ``w_scales`` flat ``E`` swizzled ``[N, K/16]``
      matrices (a 3-D :class:`GemmOperand`'s ``block_scales``).
    - ``w_dec`` fp32 ``[E, N]`` (per output row of each expert), ``[E]`` or one value.

    K must be a multiple of 32 and N of 8. Returns (or fills) bf16 ``[M_total, N]``.
    Raises :class:`~libalign.errors.ShapeError` / ``DTypeError`` for operands that do not
    fit, and :class:`~libalign.errors.SpecError` where no native kernel can run (not a
    CC 10.x CUDA device, no CUTLASS headers or nvcc; the message says which).
    """
    import ctypes
    from itertools import pairwise

    from .errors import DTypeError, ShapeError
    from .packing import swizzled_size

    u8 = (torch.uint8, torch.float8_e4m3fn)
    for name, t, ndim in (("a_codes", a_codes, 2), ("w_codes", w_codes, 3)):
        if t.dtype != torch.uint8:
            raise DTypeError(f"{name} must be uint8 packed E2M1 codes, got {t.dtype}")
        if t.ndim != ndim:
            raise ShapeError(f"{name} must have {ndim} dimensions, got {tuple(t.shape)}")
    for name, t in (("a_scales", a_scales), ("w_scales", w_scales)):
        if t.dtype not in u8:
            raise DTypeError(f"{name} must be float8_e4m3fn or uint8, got {t.dtype}")
    for name, t in (("a_dec", a_dec), ("w_dec", w_dec)):
        if t.dtype != torch.float32:
            raise DTypeError(f"{name} must be float32 decode scales, got {t.dtype}")
    m, k = a_codes.shape[0], a_codes.shape[1] * 2
    e, n = w_codes.shape[0], w_codes.shape[1]
    if w_codes.shape[2] * 2 != k:
        raise ShapeError(f"activations have K={k}, weights K={w_codes.shape[2] * 2}")
    if e < 1 or k % 32 or n % 8 or k == 0 or n == 0:
        raise ShapeError(f"the native GEMM needs E >= 1, K a multiple of 32 and N of 8; got "
                         f"E={e}, N={n}, K={k}")
    if max(m, n, k) >= 2**31:
        raise ShapeError(f"M={m}, N={n}, K={k}: each must stay below 2**31")
    if a_dec.numel() == 1:
        a_per_row = 0
    elif a_dec.numel() == m and a_dec.ndim in (1, 2) and a_dec.shape[0] == m:
        a_per_row = 1
    else:
        raise ShapeError(f"a_dec must be [M_total]={m} or one value, got {tuple(a_dec.shape)}")
    if tuple(w_dec.shape) == (e, n):
        w_mode = _WDEC_PER_ROW
    elif w_dec.numel() == 1:
        w_mode = _WDEC_SCALAR
    elif tuple(w_dec.shape) == (e,):
        w_mode = _WDEC_PER_EXPERT
    else:
        raise ShapeError(f"w_dec must be [E, N]=({e}, {n}), [E] or one value, "
                         f"got {tuple(w_dec.shape)}")
    cols = -(-(k // BLOCK_SIZE) // 4) * 4
    if w_scales.numel() < e * swizzled_size(n, k // BLOCK_SIZE):
        raise ShapeError(f"w_scales has {w_scales.numel()} bytes, {e} swizzled [{n}, "
                         f"{k // BLOCK_SIZE}] matrices need {e * swizzled_size(n, k // BLOCK_SIZE)}")
    on_device = isinstance(row_offsets, torch.Tensor) and row_offsets.device.type == "cuda"
    offs: list[int] = []
    if on_device:
        if row_offsets.dtype != torch.int32 or tuple(row_offsets.shape) != (e + 1,):
            raise ShapeError(f"CUDA row_offsets must be int32 [E+1]=[{e + 1}], got "
                             f"{row_offsets.dtype} {tuple(row_offsets.shape)}")
        need_rows = m + 127 * e
    else:
        offs = _host_offsets(row_offsets, m)
        if len(offs) != e + 1:
            raise ShapeError(f"row_offsets has {len(offs)} entries, the weights have E={e}")
        need_rows = sum(-(-(b - a) // 128) * 128 for a, b in pairwise(offs))
    if a_scales.numel() < need_rows * cols:
        raise ShapeError(f"a_scales has {a_scales.numel()} bytes, the grouped layout needs "
                         f"{need_rows * cols}")
    dev = a_codes.device
    others = (a_scales, a_dec, w_codes, w_scales, w_dec) + ((row_offsets,) if on_device else ())
    if any(t.device != dev for t in others):
        raise ShapeError("all operands must be on one device")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n)
                            or out.device != dev or not out.is_contiguous()):
        raise ShapeError(f"out must be a contiguous bf16 [{m}, {n}] tensor on {dev}")

    gap = native_grouped_gemm_gap(dev)
    if gap is not None:
        raise SpecError(f"no native grouped GEMM serves this call: {gap}")
    lib = _native.load_or_raise(_GEMM_SM100)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    if m == 0:
        return out
    offsets = row_offsets if on_device else torch.tensor(offs, dtype=torch.int32).to(dev)
    keep = [t.contiguous() for t in (a_codes, a_scales, a_dec, w_codes, w_scales, w_dec)]
    args = _native.GemmSm100Args(experts=e, n=n, k=k, a_dec_per_row=a_per_row,
                                 w_dec_mode=w_mode, reserved=0)
    args.row_offsets = offsets.data_ptr()
    args.a_codes, args.a_scales, args.a_dec = (t.data_ptr() for t in keep[:3])
    args.w_codes, args.w_scales, args.w_dec = (t.data_ptr() for t in keep[3:])
    args.out = out.data_ptr()
    with torch.cuda.device(dev):
        size = ctypes.c_size_t(0)
        status = lib.nvfp4_gemm_sm100_workspace_size(ctypes.byref(args), ctypes.byref(size))
        workspace = torch.empty(size.value, dtype=torch.uint8, device=dev) if status == 0 else None
        if status == 0:  # the caching allocator reuses it only in this stream's order
            stream = torch.cuda.current_stream(dev).cuda_stream
            status = lib.nvfp4_grouped_gemm_sm100(ctypes.byref(args), workspace.data_ptr(),
                                                  size.value, stream)
    if status:
        text = lib.nvfp4_gemm_sm100_status_string(status).decode()
        if status in (_GEMM_STATUS_SHAPE, _GEMM_STATUS_CAN_IMPLEMENT):
            raise ShapeError(f"the native grouped GEMM refused its operands: {text}")
        if status == _GEMM_STATUS_ARCH:
            raise SpecError(f"no native grouped GEMM serves this call: {text}")
        raise RuntimeError(f"the native grouped GEMM failed (status {status}): {text}")
    return out
