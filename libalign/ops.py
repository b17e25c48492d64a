"""The only door to the compiled quantize kernels; everything else calls these functions.

Each function here has a reference in :mod:`libalign.spec`, and the kernels in ``csrc/``
reproduce that reference bit for bit (codes, block-scale bytes, outer-scale bits). The
grouped GEMM backends are not here: they live with :mod:`libalign.gemm`
(:mod:`libalign.gemm_triton`, :mod:`libalign.gemm_cutlass`).

How a call is served
    CUDA tensors go to the CUDA kernel, CPU tensors to the C++ kernel, both built on first
    use (:mod:`libalign._native`). The C++ kernel runs the best instruction-set path the
    CPU has, AVX-512, AVX2 or scalar (:func:`cpu_kernel_path`; ``ALIGN_CPU_KERNEL`` or
    :func:`set_cpu_kernel_path` force one), all three bit-identical. The kernels cover the
    ``te``, ``torchao`` and ``modelopt`` operation orders, every outer domain, bf16 /
    fp16 / fp32 input, 2-D matrices and 3-D expert stacks, a given outer maximum (shared
    gate/up scales), and linear or 128x4-swizzled block scales. Anything else — the
    compressed-tensors order (its scale math runs in bf16), a Hadamard rotation,
    stochastic rounding, K not a multiple of 16, a given per-row maximum — is served by
    the spec itself: slower, the same bits. :func:`backend_for` says which one a call gets.

Where a kernel cannot be built
    No compiler, a failed build, or ``ALIGN_KERNELS=spec``: the spec serves every call on
    that device (one warning). :func:`backends` says, per device, which implementation
    serves and why (the build error), for ``alignd selfcheck`` and the ``/metrics`` page.

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
import functools
from dataclasses import dataclass

import torch

from . import _native, scale_math
from . import spec as _spec
from .constants import BLOCK_SIZE
from .errors import ConfigError, SpecError
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


@dataclass(frozen=True)
class DeviceBackend:
    """Which implementation serves :func:`quantize` on one device type, and why.

    ``backend`` is ``'cpu'`` or ``'cuda'`` (the compiled kernel of that device) or ``'spec'``
    (the reference: the same bits, about 20x slower). ``reason`` says what serves (e.g.
    ``"compiled C++ kernel (avx2 path; this CPU runs avx2, scalar)"``) or, for ``'spec'``,
    why no kernel does: the build or load error, or ``ALIGN_KERNELS=spec``.
    """

    device: str
    backend: str
    reason: str

    @property
    def fallback(self) -> bool:
        """True when the reference spec stands in for a missing kernel."""
        return self.backend == "spec"


def backends() -> dict[str, DeviceBackend]:
    """The backend serving each device type here: ``'cpu'``, and ``'cuda'`` when CUDA is
    available. The first call builds (or finds in the cache) the kernels, as the first
    :func:`quantize` on that device would; later calls answer from memory. Calls the
    kernels cannot take whatever the device (see :func:`kernel_gap`) use the spec anyway.
    """
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {}
    for kind in kinds:
        lib = _native.load(kind)
        if lib is None:
            out[kind] = DeviceBackend(kind, "spec", _native.unavailable_reason(kind) or
                                      f"the {kind} kernel is unavailable")
        elif kind == "cpu":
            out[kind] = DeviceBackend(kind, kind, f"compiled C++ kernel ({_native.cpu_path(lib)}"
                                      f" path; this CPU runs {', '.join(_native.cpu_paths(lib))})")
        else:
            major, minor = torch.cuda.get_device_capability()
            out[kind] = DeviceBackend(kind, kind, f"compiled CUDA kernel on "
                                      f"{torch.cuda.get_device_name()} (sm_{major}{minor})")
    return out


def cpu_kernel_path() -> str | None:
    """The instruction-set path of the C++ kernel serving CPU calls: ``'avx512'``,
    ``'avx2'`` or ``'scalar'``; None when no CPU kernel is available (the spec serves)."""
    lib = _native.load("cpu")
    return None if lib is None else _native.cpu_path(lib)


def cpu_kernel_paths() -> tuple[str, ...]:
    """The C++ kernel's paths this CPU can run, best first; empty without a CPU kernel."""
    lib = _native.load("cpu")
    return () if lib is None else _native.cpu_paths(lib)


def set_cpu_kernel_path(name: str | None) -> str:
    """Force the C++ kernel's path for this process (tests, benchmarks); None or ``'auto'``
    restores the best one. Returns the path now serving. ConfigError for a path this CPU
    lacks or an unknown name, or when no CPU kernel could be built."""
    lib = _native.load("cpu")
    if lib is None:
        raise ConfigError(f"no CPU kernel to set a path on: {_native.unavailable_reason('cpu')}")
    return _native.set_cpu_path(lib, name)


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
    _spec.check_input(x, spec)
    if out is not None:
        _check_out(out, x, spec, scale_layout)
    gap = kernel_gap(x, spec, outer_amax)
    lib = None if gap is not None or backend == "spec" else _native.load(x.device.type)
    if lib is None:
        if backend == "kernel":
            why = gap or (f"kernel unavailable: {_native.unavailable_reason(x.device.type)}"
                          if _native.unavailable_reason(x.device.type) else "kernel unavailable")
            raise SpecError(f"no compiled kernel serves this call: {why}")
        q = _spec.quantize(x, spec, outer_amax=outer_amax)
        q = q if scale_layout == "linear" else as_gemm_operand(q)
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


def as_gemm_operand(q: NVFP4Tensor) -> GemmOperand:
    """The same bits as ``q`` with block scales in the 128x4 layout (one swizzle pass).

    What :func:`quantize` with ``scale_layout="swizzled"`` returns directly; use this for
    bits quantized earlier (stored weights) that a block-scaled GEMM is about to read.
    """
    return GemmOperand(q.codes, q.swizzled_block_scales(), q.outer_scale, q.outer_amax,
                       q.spec, q.shape)


def _params(x3: torch.Tensor, spec: NumericsSpec, swizzled: bool) -> _native.NvParams:
    """The kernels' parameter block for this call (shared: the kernels only read it)."""
    return _params_for(tuple(x3.shape), x3.dtype, spec, swizzled)


@functools.lru_cache(maxsize=256)
def _params_for(shape: tuple[int, int, int], dtype: torch.dtype, spec: NumericsSpec,
                swizzled: bool) -> _native.NvParams:
    e, m, k = shape
    p = _native.NvParams()
    p.experts, p.rows, p.k = e, m, k
    p.in_dtype = _DTYPES[dtype]
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
    p.in_max = torch.finfo(dtype).max
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
        amax = _spec.checked_outer_amax(outer_amax, want.to(dev))
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


def _launch(lib, x, spec, outer_amax, swizzled, out=None, flags=None, stream=None) -> _Pending:
    """Allocate outputs and launch the kernel(s); CUDA work stays asynchronous.

    ``stream``: the raw CUDA stream to launch on (default: the device's current stream).
    """
    is_3d = x.ndim == 3
    x3 = (x if is_3d else x.unsqueeze(0)).contiguous()
    e, m, k = x3.shape
    nb = k // BLOCK_SIZE
    dev = x3.device
    p = _params(x3, spec, swizzled)
    cuda = dev.type == "cuda"
    if cuda and flags is None:
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
    if cuda and stream is None:
        stream = torch.cuda.current_stream(dev).cuda_stream
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
        q = as_gemm_operand(q) if t.swizzled else q
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
    flags, streams = {}, {}
    for i, x in enumerate(tensors):
        _spec.check_input(x, spec)
        lib = None if kernel_gap(x, spec, None) else _native.load(x.device.type)
        if lib is None:
            q = _spec.quantize(x, spec)
            results[i] = q if scale_layout == "linear" else as_gemm_operand(q)
            continue
        slot = stream = None
        if x.device.type == "cuda":
            buf = flags.get(x.device)
            if buf is None:
                buf = flags[x.device] = torch.zeros(len(tensors), dtype=torch.int32, device=x.device)
                streams[x.device] = torch.cuda.current_stream(x.device).cuda_stream
            slot, stream = buf[i:i + 1], streams[x.device]
        t = _launch(lib, x, spec, None, scale_layout == "swizzled", flags=slot, stream=stream)
        launched.append((i, t))
        if isinstance(t.flags, torch.Tensor):  # assemble the result while the device works
            results[i] = _finish(t, 0)
    host_flags = {dev: buf.tolist() for dev, buf in flags.items()}  # one sync per device
    for i, t in launched:
        bad = host_flags[t.x.device][i] if isinstance(t.flags, torch.Tensor) else t.flags
        if bad or results[i] is None:
            results[i] = _finish(t, bad)
    return results


def _raise_like_spec(x, spec, outer_amax):
    _spec.quantize(x, spec, outer_amax=outer_amax)  # raises the typed error with positions
    raise RuntimeError("an NVFP4 kernel flagged its input but the spec accepted it; "
                       "please report this as a kernel bug")


#: Quantize kernels of the CUDA library: ``auto`` picks per shape (the register-resident
#: kernel where a row fits its lanes' registers, the shared-memory one otherwise).
CUDA_KERNEL_VARIANTS = {"auto": 0, "staged": 1, "registers": 2}


@contextlib.contextmanager
def cuda_kernel_variant(name: str):
    """Serve CUDA quantize calls with one kernel variant inside the block (tests, benchmarks).

    The choice is process-wide, so use it where nothing else quantizes concurrently.
    Without a CUDA library (no device, no build) the block runs unchanged.
    """
    if name not in CUDA_KERNEL_VARIANTS:
        raise SpecError(f"unknown CUDA kernel variant {name!r}; "
                        f"choose from {sorted(CUDA_KERNEL_VARIANTS)}")
    lib = _native.load("cuda") if torch.cuda.is_available() else None
    if lib is None:
        yield
        return
    lib.nvfp4_cuda_set_variant(CUDA_KERNEL_VARIANTS[name])
    try:
        yield
    finally:
        lib.nvfp4_cuda_set_variant(0)
