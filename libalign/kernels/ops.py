"""The only door to the compiled quantize kernels; everything else calls these functions.

Each function here has a reference in :mod:`libalign.spec`, and the kernels in ``csrc/``
reproduce that reference bit for bit (codes, block-scale bytes, outer-scale bits). The
grouped GEMM backends are not here: they live with :mod:`libalign.gemm`
(:mod:`libalign.gemm.triton_grouped`, :mod:`libalign.gemm.cutlass_grouped`).

How a call is served
    CUDA tensors go to the CUDA kernel, CPU tensors to the C++ kernel, both built on first
    use (:mod:`libalign.kernels.native`). The C++ kernel runs the best instruction-set path the
    CPU has, AVX-512, AVX2 or scalar (:func:`cpu_kernel_path`; ``ALIGN_CPU_KERNEL`` or
    :func:`set_cpu_kernel_path` force one), all three bit-identical. The kernels cover the
    ``te``, ``torchao`` and ``modelopt`` operation orders, every outer domain, bf16 /
    fp16 / fp32 input, 2-D matrices and 3-D expert stacks, a given outer maximum (shared
    gate/up scales), and linear or 128x4-swizzled block scales; and MXFP4 (the four E8M0
    rules of the ``mxfp4*`` and ``kv_mxfp4`` presets, one byte per 32 values, no outer
    scale) on the same load and encode steps. The kernels also serve the production
    recipes: ``flashinfer_pertoken`` (TE's order, row domain, the input's sign in a zero
    code) and 4-over-6 block scaling with the E4M3 bound 256 or 448 (``te_4over6``,
    ``te_4over6_448``, ``te_row_4over6``, ``flashinfer_pertoken_4over6``, MAE or MSE): each
    block is encoded with its maximum mapped to 6 and to 4 and keeps the candidate with the
    smaller error, summed in TE's or FlashInfer's order (the scalar steps of
    ``csrc/nvfp4_math.h`` on the scalar path and the GPU, the same steps lane by lane on
    AVX2 and AVX-512; the error sums stay in the spec's element order). Anything
    else — the compressed-tensors order (its scale math runs in bf16), a Hadamard rotation,
    stochastic rounding, K not a multiple of the block (16, MXFP4 32; the presets refuse it
    with the spec's ShapeError), a given per-row maximum, SGLang's KV formats (FlashInfer's
    order with a given per-layer scale, the block-16 exponent rule with ties away from
    zero) — is served by the spec itself: slower, the same bits. :func:`backend_for` says
    which one a call gets.

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
from dataclasses import dataclass

import torch

from libalign import spec as _spec
from libalign.errors import ConfigError, SpecError
from libalign.kernels import calls, native
from libalign.kernels.calls import GemmOperand, as_gemm_operand
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor

__all__ = ["BACKENDS", "CUDA_KERNEL_VARIANTS", "SCALE_LAYOUTS", "DeviceBackend", "GemmOperand",
           "as_gemm_operand", "backend_for", "backends", "cpu_kernel_path", "cpu_kernel_paths",
           "cuda_kernel_variant", "kernel_gap", "quantize", "quantize_many",
           "set_cpu_kernel_path"]

SCALE_LAYOUTS = ("linear", "swizzled")
BACKENDS = ("auto", "kernel", "spec")


def kernel_gap(x: torch.Tensor, spec: NumericsSpec, outer_amax: torch.Tensor | None) -> str | None:
    """Why the compiled kernels cannot serve this call, or None when they can."""
    if spec.op_order not in calls.ORDERS:
        return f"op_order {spec.op_order!r} (no compiled kernel has its scale math)"
    if spec.e2m1_ties != "even" or spec.outer_source != "data":
        return "E2M1 ties away from zero / a given outer scale"
    if spec.scale_math_dtype != "float32" or spec.zero_scale_to is not None:
        return "scale math in the input dtype / zero-scale substitution"
    if spec.hadamard:
        return "Hadamard rotation"
    if spec.stochastic_rounding:
        return "stochastic rounding"
    if x.dtype not in calls.DTYPES:
        return f"dtype {x.dtype}"
    if x.shape[-1] % spec.block_size:
        return f"K={x.shape[-1]} is not a multiple of {spec.block_size}"
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
    return kind if native.load(kind) is not None else "spec"


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
        lib = native.load(kind)
        if lib is None:
            out[kind] = DeviceBackend(kind, "spec", native.unavailable_reason(kind) or
                                      f"the {kind} kernel is unavailable")
        elif kind == "cpu":
            out[kind] = DeviceBackend(kind, kind, f"compiled C++ kernel ({native.cpu_path(lib)}"
                                      f" path; this CPU runs {', '.join(native.cpu_paths(lib))})")
        else:
            major, minor = torch.cuda.get_device_capability()
            out[kind] = DeviceBackend(kind, kind, f"compiled CUDA kernel on "
                                      f"{torch.cuda.get_device_name()} (sm_{major}{minor})")
    return out


def cpu_kernel_path() -> str | None:
    """The instruction-set path of the C++ kernel serving CPU calls: ``'avx512'``,
    ``'avx2'`` or ``'scalar'``; None when no CPU kernel is available (the spec serves)."""
    lib = native.load("cpu")
    return None if lib is None else native.cpu_path(lib)


def cpu_kernel_paths() -> tuple[str, ...]:
    """The C++ kernel's paths this CPU can run, best first; empty without a CPU kernel."""
    lib = native.load("cpu")
    return () if lib is None else native.cpu_paths(lib)


def set_cpu_kernel_path(name: str | None) -> str:
    """Force the C++ kernel's path for this process (tests, benchmarks); None or ``'auto'``
    restores the best one. Returns the path now serving. ConfigError for a path this CPU
    lacks or an unknown name, or when no CPU kernel could be built."""
    lib = native.load("cpu")
    if lib is None:
        raise ConfigError(f"no CPU kernel to set a path on: {native.unavailable_reason('cpu')}")
    return native.set_cpu_path(lib, name)


def quantize(
    x: torch.Tensor,
    spec: NumericsSpec | None = None,
    *,
    outer_amax: torch.Tensor | None = None,
    outer_scale: torch.Tensor | None = None,
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
    allocation and the page faults of fresh output memory). ``outer_scale`` is the given outer
    scale of a spec whose ``outer_source`` is ``given`` (:func:`libalign.spec.quantize`).
    """
    spec = PRESETS["minite"] if spec is None else spec
    if scale_layout not in SCALE_LAYOUTS:
        raise SpecError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if backend not in BACKENDS:
        raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _spec.check_input(x, spec)
    if out is not None:
        calls.check_out(out, x, spec, scale_layout)
    gap = kernel_gap(x, spec, outer_amax) or (None if outer_scale is None else "a given outer scale")
    lib = None if gap is not None or backend == "spec" else native.load(x.device.type)
    if lib is None:
        if backend == "kernel":
            why = gap or (f"kernel unavailable: {native.unavailable_reason(x.device.type)}"
                          if native.unavailable_reason(x.device.type) else "kernel unavailable")
            raise SpecError(f"no compiled kernel serves this call: {why}")
        q = _spec.quantize(x, spec, outer_amax=outer_amax, outer_scale=outer_scale)
        q = q if scale_layout == "linear" else as_gemm_operand(q)
        return q if out is None else calls.copy_into(q, out)
    return calls.quantize_kernel(lib, x, spec, outer_amax, scale_layout == "swizzled", out)


def _batch_library(tensors: list[torch.Tensor], spec: NumericsSpec):
    """The kernel library that serves every tensor of a :func:`quantize_many` call in one
    batch (:func:`calls.launch_many`), or None: the tensors go one at a time.

    A batch needs a :func:`calls.batchable` spec and every tensor on one device with
    no :func:`kernel_gap`. The tensors are checked in order and a check error propagates:
    up to the tensor that fails, every one was kernel-served, so the per-tensor loop would
    have raised the same error there with nothing returned.
    """
    if not tensors or not calls.batchable(spec):
        return None
    dev = None
    for x in tensors:
        _spec.check_input(x, spec)
        dev = x.device if dev is None else dev
        if x.device != dev or kernel_gap(x, spec, None) is not None:
            return None
    return native.load(dev.type)


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

    In the row domain and for MXFP4, when the kernels serve every tensor on one device, the
    outputs of all tensors are views of one allocation (:func:`calls.launch_many`:
    the host does the least before the first kernel). A result kept alone keeps that
    buffer alive; ``clone()`` its tensors to keep one result's bytes only, and to write them
    with safetensors, which refuses tensors sharing memory.
    """
    spec = PRESETS["minite"] if spec is None else spec
    if scale_layout not in SCALE_LAYOUTS:
        raise SpecError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    lib = _batch_library(tensors, spec)
    if lib is not None:
        launched, flags = calls.launch_many(lib, tensors, spec, scale_layout == "swizzled")
        results = [calls.batch_result(t) for t in launched]  # device at work
        bad = [t.flags for t in launched] if flags is None else calls.read_flags(flags)
        for i, t in enumerate(launched):
            if bad[i]:  # in order: the first flagged tensor raises
                results[i] = calls.finish(t, bad[i])
        return results
    results: list = [None] * len(tensors)
    launched: list[tuple[int, calls.Pending]] = []
    flags, streams = {}, {}
    for i, x in enumerate(tensors):
        _spec.check_input(x, spec)
        lib = None if kernel_gap(x, spec, None) else native.load(x.device.type)
        if lib is None:
            q = _spec.quantize(x, spec)
            results[i] = q if scale_layout == "linear" else as_gemm_operand(q)
            continue
        slot = stream = None
        if x.device.type == "cuda":
            buf = flags.get(x.device)
            if buf is None:
                streams[x.device] = calls.current_stream_handle(x.device)
                buf = flags[x.device] = calls.take_flags(x.device, len(tensors),
                                                                streams[x.device])
            slot, stream = buf[i:i + 1], streams[x.device]
        t = calls.launch(lib, x, spec, None, scale_layout == "swizzled", flags=slot, stream=stream)
        launched.append((i, t))
        if isinstance(t.flags, torch.Tensor):  # assemble the result while the device works
            results[i] = calls.finish(t, 0)
    host_flags = {dev: calls.read_flags(buf) for dev, buf in flags.items()}  # a sync each
    for i, t in launched:
        bad = host_flags[t.x.device][i] if isinstance(t.flags, torch.Tensor) else t.flags
        if bad or results[i] is None:
            results[i] = calls.finish(t, bad)
    return results


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
    lib = native.load("cuda") if torch.cuda.is_available() else None
    if lib is None:
        yield
        return
    lib.nvfp4_cuda_set_variant(CUDA_KERNEL_VARIANTS[name])
    try:
        yield
    finally:
        lib.nvfp4_cuda_set_variant(0)
