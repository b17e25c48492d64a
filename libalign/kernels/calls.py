"""How libalign calls its compiled quantize kernels: parameter blocks, launches, results.

:mod:`libalign.kernels` is the door callers use; this module is the machinery behind it,
shared with :mod:`libalign.sync`. A call goes in two steps so that several can
run back to back on a GPU with one synchronisation for all:

1. :func:`launch` checks nothing (the caller did), allocates the outputs (or takes an
   ``out`` result's buffers), fills the kernels' parameter block (:func:`params`, cached:
   the kernels only read it) and launches. CUDA work stays asynchronous; the kernels OR
   their flags into a device int the caller owns.
2. :func:`finish` turns a launched call and its flags into the result: the
   :class:`~libalign.spec.NVFP4Tensor` (or :class:`GemmOperand`) viewing the outputs, the
   spec's result for a corner the kernels do not reproduce, or the spec's typed error
   (:func:`raise_like_spec`) for a flagged input.

:func:`launch_many` is step 1 for several tensors at once (``quantize_many`` in the row
domain and MXFP4): one allocation holds every output, laid out by a cached
:func:`plan_for`, so the host does the least possible before the first kernel starts. The
CUDA flag ints come from a pool of zeroed buffers (:func:`take_flags`,
:func:`read_flags`): a call that flags nothing leaves its buffer zero for the next one, so
no fill kernel runs before the first quantize kernel.

:class:`GemmOperand` lives here because :func:`finish` builds it; :mod:`libalign.kernels`
re-exports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

import torch

from libalign import spec as _spec
from libalign.errors import SpecError
from libalign.kernels import native
from libalign.spec import NumericsSpec, NVFP4Tensor, scale_math
from libalign.spec.four_over_six import stored_outer
from libalign.spec.packing import swizzled_size, unswizzle_scales

#: op_order -> NV_ORDER_* of csrc/nvfp4_abi.h; the MX orders make the call MXFP4 (E8M0 bytes
#: per 32 values, no outer scale: the kernels skip the outer-scale steps).
ORDERS = {"te": 0, "torchao": 1, "modelopt": 2,
          "mx_floor": 3, "mx_ceil": 4, "mx_even": 5, "mx_te": 6}
SIGNED_ZERO = {"positive": 0, "sign_of_input": 1, "sign_of_nonzero": 2}
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
CONVENTIONS = {"amax": 0, "enc": 1, "dec": 2}
FOUR_OVER_SIX = {"off": 0, "te": 1, "flashinfer": 2}
ERROR_METRICS = {"mae": 0, "mse": 1}
FLAG_NONFINITE, FLAG_UNDEFINED, FLAG_USE_SPEC = 1, 2, 4


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
        nb = -(-self.shape[-1] // self.spec.block_size)
        lin = unswizzle_scales(self.block_scales, (*self.shape[:-1], nb))
        return NVFP4Tensor(self.codes, lin, self.outer_scale, self.spec, self.shape,
                           self.outer_amax)


def check_out(out, x, spec, layout) -> None:
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


def copy_into(q, out):
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


def params(x3: torch.Tensor, spec: NumericsSpec, swizzled: bool) -> native.NvParams:
    """The kernels' parameter block for this call (shared: the kernels only read it)."""
    return params_for(tuple(x3.shape), x3.dtype, spec, swizzled)


@functools.lru_cache(maxsize=256)
def params_for(shape: tuple[int, int, int], dtype: torch.dtype, spec: NumericsSpec,
                swizzled: bool) -> native.NvParams:
    e, m, k = shape
    p = native.NvParams()
    p.experts, p.rows, p.k = e, m, k
    p.in_dtype = DTYPES[dtype]
    p.op_order = ORDERS[spec.op_order]
    p.outer_mode = 1 if spec.outer_domain == "row" else 0
    p.outer_stride = 1 if spec.outer_domain == "expert" else 0
    p.store_conv = CONVENTIONS[spec.outer_convention]
    p.has_amax_floor = int(spec.amax_floor is not None)
    p.amax_floor = spec.amax_floor or 0.0
    p.block_scale_floor = spec.block_scale_floor or 0.0
    p.has_zero_prescale = int(spec.zero_prescale_to is not None)
    p.zero_prescale_to = spec.zero_prescale_to or 0.0
    p.zero_saturate = int(spec.zero_scale_encode == "saturate")
    p.signed_zero = SIGNED_ZERO[spec.signed_zero]
    p.nonfinite_saturate = int(spec.nonfinite == "saturate")
    p.in_max = torch.finfo(dtype).max
    p.swizzled = int(swizzled)
    p.e4m3_max = spec.e4m3_max
    p.four_over_six = FOUR_OVER_SIX[spec.four_over_six]
    p.four_over_six_error = ERROR_METRICS[spec.four_over_six_error]
    return p


def outer_given(lib, x3, is_3d, spec, p, outer_amax, flags, stream, nthreads):
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
            check_launch(code, "amax")
            if code > 0:
                return None
        else:  # NaN/Inf rows are flagged again by the encode kernel: flags are read once
            code = lib.nvfp4_amax_cuda(x3.data_ptr(), per_expert.data_ptr(), p,
                                       flags.data_ptr(), stream)
            check_launch(code, "amax")
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
    outer = scale_math.outer_from_amax(amax, spec.op_order, torch.float32, spec.e4m3_max)
    stored = stored_outer(scale_math.stored_from_outer(outer, amax, spec.outer_convention),
                          amax, spec.four_over_six, spec.outer_convention)
    return outer.enc.reshape(-1).contiguous(), outer.dec.reshape(-1).contiguous(), stored, amax


def current_stream_handle(dev: torch.device) -> int:
    """The raw handle of CUDA device ``dev``'s current stream (what the kernels are launched
    on), through torch's public API."""
    return torch.cuda.current_stream(dev).cuda_stream


def check_launch(code: int, what: str) -> None:
    if code < 0:
        raise SpecError(f"the {what} kernel refused its parameters (code {code})")


def encode(lib, cuda: bool, x: int, codes: int, scales: int, amax: int, stored: int, enc: int,
           dec: int, p, flags: int, stream, nthreads: int) -> int:
    """One launch of the encode kernel on raw addresses. On CUDA it is queued on ``stream``
    and its flags land at ``flags`` (0 is returned); on the CPU it has run when this returns,
    and its flags are returned. A refused parameter block is a SpecError, a CUDA launch error
    a RuntimeError."""
    if cuda:
        code = lib.nvfp4_quantize_cuda(x, codes, scales, amax, stored, enc, dec, p, flags, stream)
        check_launch(code, "quantize")
        if code:
            raise RuntimeError(f"CUDA error {code} in the NVFP4 quantize kernel")
        return 0
    bad = lib.nvfp4_quantize_cpu(x, codes, scales, amax, stored, enc, dec, p, nthreads)
    check_launch(bad, "quantize")
    return bad


@dataclass
class Pending:
    """A launched kernel call whose flags are not read yet (see :func:`quantize_many`)."""

    x: torch.Tensor | None  # None for launch_gather's calls
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
    # a device int (CUDA, read later; launch_many: the call's flag buffer, one slot per
    # tensor) or the CPU kernel's result
    flags: torch.Tensor | int


def launch(lib, x, spec, outer_amax, swizzled, out=None, flags=None, stream=None) -> Pending:
    """Allocate outputs and launch the kernel(s); CUDA work stays asynchronous.

    ``stream``: the raw CUDA stream to launch on (default: the device's current stream).
    """
    is_3d = x.ndim == 3
    x3 = (x if is_3d else x.unsqueeze(0)).contiguous()
    e, m, k = x3.shape
    nb = k // spec.block_size  # scale columns: 16-value blocks, or MXFP4's 32
    dev = x3.device
    p = params(x3, spec, swizzled)
    cuda = dev.type == "cuda"
    if cuda and flags is None:
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
    if cuda and stream is None:
        stream = current_stream_handle(dev)
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
    pending = Pending(x, spec, outer_amax, swizzled, out, codes, scales, amax_out, stored_out,
                       None, None, 0)
    same = not cuda or dev.index is None or dev.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(dev):
        if row:
            enc = dec = amax_out  # unused in ROW mode
        else:
            given = outer_given(lib, x3, is_3d, spec, p, outer_amax, flags, stream, nthreads)
            if given is None:  # the CPU amax pass met NaN/Inf
                pending.flags = FLAG_NONFINITE
                return pending
            enc, dec, stored, amax = given
            if spec.four_over_six != "off":  # the kernel reads the outer maxima here
                amax_out = amax.reshape(-1).contiguous()
        bad = encode(lib, cuda, x3.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                     amax_out.data_ptr(), stored_out.data_ptr(), enc.data_ptr(), dec.data_ptr(),
                     p, flags.data_ptr() if cuda else 0, stream, nthreads)
        pending.flags = flags if cuda else bad
    pending.stored, pending.amax = stored, amax
    return pending


def gatherable(xs, spec: NumericsSpec) -> bool:
    """Whether :func:`launch_gather` serves the stack of ``xs``: an NVFP4 preset scaled per
    row that the compiled kernels implement, and contiguous 2-D tensors of one shape, dtype
    and device whose data start on a 16-byte boundary (the CUDA kernels read 16 bytes at a
    time)."""
    if not xs or spec.is_mx or spec.outer_domain != "row":
        return False
    x0 = xs[0]
    return all(readable_in_place(x) and x.shape == x0.shape and x.dtype == x0.dtype
               and x.device == x0.device for x in xs)


def readable_in_place(x: torch.Tensor) -> bool:
    """Whether the kernels can read ``x`` as one tensor of a :func:`launch_gather` stack:
    2-D, contiguous, its data on a 16-byte boundary."""
    return x.ndim == 2 and x.is_contiguous() and x.data_ptr() % 16 == 0


def launch_gather(lib, xs, spec: NumericsSpec, out: NVFP4Tensor, flags=None, stream=None
                  ) -> tuple[Pending, object]:
    """:func:`launch` of the stack of the 2-D tensors ``xs`` into ``out`` (its ``[E, M, ...]``
    buffers), without making the stack: the kernels read tensor e's rows where it lies,
    through a table of one pointer per tensor (:func:`gatherable` says when this serves).
    The bits are those of the stack's call.

    Returns the pending call (``x`` None: a caller that meets a flag stacks ``xs`` and asks
    the spec) and the pointer table, which must outlive the kernels: on CUDA the caller
    holds it until it has read the flags (the launch is asynchronous); a CPU call is done
    when this returns, and its ``flags`` are the kernel's result.
    """
    x0 = xs[0]
    e, (m, k) = len(xs), x0.shape
    dev = x0.device
    cuda = dev.type == "cuda"
    p = native.NvParams.from_buffer_copy(params_for((e, m, k), x0.dtype, spec, False))
    ptrs = [x.data_ptr() for x in xs]
    if cuda:
        # queued on the stream the kernels run on: a blocking copy from pageable memory would
        # wait for every kernel queued before it (the driver stages the source at once)
        table = torch.tensor(ptrs, dtype=torch.int64).to(dev, non_blocking=True)
        p.gather = table.data_ptr()
    else:
        table = (ctypes.c_void_p * e)(*ptrs)
        p.gather = ctypes.cast(table, ctypes.c_void_p).value
    codes = out.codes.view(e, m, k // 2)
    scales = out.block_scales.view(torch.uint8).view(e, m, k // spec.block_size)
    amax_out, stored_out = out.outer_amax.view(-1), out.outer_scale.view(-1)
    if cuda and flags is None:
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
    if cuda and stream is None:
        stream = current_stream_handle(dev)
    same = not cuda or dev.index is None or dev.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(dev):
        # the encode/decode pointers are read only outside the row domain
        bad = encode(lib, cuda, x0.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                     amax_out.data_ptr(), stored_out.data_ptr(), amax_out.data_ptr(),
                     amax_out.data_ptr(), p, flags.data_ptr() if cuda else 0, stream,
                     torch.get_num_threads())
    pending = Pending(None, spec, None, False, out, codes, scales, amax_out, stored_out, None,
                      None, flags if cuda else bad)
    return pending, table


def finish(t: Pending, bad: int):
    """The result of a launched call, given its flags (the spec raises or answers on a flag)."""
    x, spec, out = t.x, t.spec, t.out
    if bad == FLAG_USE_SPEC:  # a corner the fast path does not reproduce: the spec's bits
        q = _spec.quantize(x, spec, outer_amax=t.outer_amax)
        q = as_gemm_operand(q) if t.swizzled else q
        return q if out is None else copy_into(q, out)
    if bad:
        return raise_like_spec(x, spec, t.outer_amax)
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
    scale_dtype = spec.scale_dtype
    if t.swizzled:
        return GemmOperand(codes, t.scales.view(scale_dtype), stored, amax, spec, shape)
    return NVFP4Tensor(codes=codes,
                       block_scales=t.scales.reshape(*lead, k // spec.block_size).view(scale_dtype),
                       outer_scale=stored, spec=spec, shape=shape, outer_amax=amax)


# --- several tensors, one output buffer (quantize_many) --------------------------------------

#: Byte alignment of each output inside the shared buffer (the CUDA caching allocator's own
#: block granularity: every view starts as aligned as a tensor of its own would).
ALIGN = 512
#: Flag buffers of this many ints at least; each holds one slot per tensor of a call.
FLAG_SLOTS = 64

# Zeroed CUDA flag buffers by (device index, stream), handed out one per call (take_flags).
_flag_pool: dict[tuple[int | None, int], list[torch.Tensor]] = {}


def batchable(spec: NumericsSpec) -> bool:
    """True when :func:`launch_many` serves ``spec``: the row domain (the encode kernel writes
    the outer scales itself) or MXFP4 (no outer scale). The tensor and expert domains need a
    max pass and torch ops between the kernels, so they go one tensor at a time."""
    return spec.outer_domain == "row" or spec.is_mx


def flag_pool_key(dev: torch.device, stream: int | None = None) -> tuple[int | None, int]:
    """The pool a call on ``dev`` takes its flags from: the device and its current stream's.

    A buffer only ever serves the stream it was allocated on, so when a call drops one with
    its kernels still queued (an error between launch and read), the caching allocator
    reuses that memory only after them, in the same stream's order.
    """
    if stream is None:
        stream = current_stream_handle(dev) if dev.type == "cuda" else 0
    return dev.index, stream


def take_flags(dev: torch.device, n: int, stream: int | None = None) -> torch.Tensor:
    """A zeroed int32 flag buffer of at least ``n`` slots for a call on ``dev`` (CUDA) and
    its current stream (``stream``: that stream's raw handle, when the caller has it).

    The buffers are reused: :func:`read_flags` reads one after the call's kernels, and a
    buffer that came back all zero goes back to the pool, still zero, so a steady-state call
    launches no fill before its first kernel. Each call takes its own buffer (a list pop is
    atomic), so concurrent calls never share one; a flagged buffer is dropped, not cleaned.
    """
    pool = _flag_pool.setdefault(flag_pool_key(dev, stream), [])
    while pool:
        buf = pool.pop()
        if buf.numel() >= n:
            return buf
    return torch.zeros(max(n, FLAG_SLOTS), dtype=torch.int32, device=dev)


def read_flags(buf: torch.Tensor) -> list[int]:
    """The flags of every slot of ``buf`` (one synchronisation of the current stream, which
    the kernels ran on); the buffer goes back to its pool when no kernel flagged anything."""
    host = buf.tolist()
    if not any(host):
        _flag_pool.setdefault(flag_pool_key(buf.device), []).append(buf)
    return host


@dataclass(frozen=True)
class Slot:
    """Where one tensor's outputs lie in :func:`launch_many`'s buffer (byte offsets) and
    their final shapes; ``params`` is the tensor's parameter block."""

    params: native.NvParams
    codes: int
    scales: int
    amax: int
    stored: int
    codes_shape: tuple[int, ...]
    scales_shape: tuple[int, ...]  # swizzled: the flat padded length
    lead: tuple[int, ...]  # the outer maxima's shape (row domain)


@dataclass(frozen=True)
class Plan:
    """One buffer's layout for a :func:`launch_many` call: ``nbytes`` in all, the first
    ``zeroed`` of them filled with zeros (the swizzled scales that have padding)."""

    slots: tuple[Slot, ...]
    nbytes: int
    zeroed: int


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements (as torch gives a contiguous tensor)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=256)
def plan_for(shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...], spec: NumericsSpec,
             swizzled: bool) -> Plan:
    """The layout for tensors of these ``(shape, dtype)`` (cached: a converter quantizes the
    same shapes every step). Swizzled scales with padding come first, so one fill zeroes all
    of them; each output starts :data:`ALIGN`-aligned."""
    row = spec.outer_domain == "row"
    items, end = [], 0

    def take(nbytes: int) -> int:
        nonlocal end
        at, end = end, end + -(-nbytes // ALIGN) * ALIGN
        return at

    for shape, _ in shapes:
        e, m, k = shape if len(shape) == 3 else (1, *shape)
        nb = k // spec.block_size
        padded = swizzled and (m % 128 != 0 or nb % 4 != 0)
        scales_len = e * swizzled_size(m, nb) if swizzled else e * m * nb
        items.append((e, m, k, nb, scales_len, take(scales_len) if padded else None))
    zeroed = end
    slots = []
    for (shape, dtype), (e, m, k, nb, scales_len, at) in zip(shapes, items, strict=True):
        lead = shape[:-1]
        codes = take(e * m * (k // 2))
        scales = take(scales_len) if at is None else at
        floats = 4 * e * m if row else 0
        slots.append(Slot(params_for((e, m, k), dtype, spec, swizzled), codes, scales,
                          take(floats), take(floats), (*lead, k // 2),
                          (scales_len,) if swizzled else (*lead, nb), lead))
    return Plan(tuple(slots), end, zeroed)


def launch_many(lib, xs, spec, swizzled) -> tuple[list[Pending], torch.Tensor | None]:
    """Launch the encode kernel of each tensor of ``xs`` (one device; :func:`batchable` spec;
    every tensor checked and kernel-served), all outputs carved from one allocation.

    Returns the launched calls (``flags`` of each: its CPU kernel's result, or on CUDA the
    call's flag buffer, slot ``i`` for ``xs[i]``) and that buffer (None on the CPU). Before
    the first launch the host looks up the layout (:func:`plan_for`), makes one
    ``torch.empty`` (and one fill when swizzled scales have padding) and launches: the
    kernels take raw addresses, so the output views are made after every launch, while the
    device works.
    """
    dev = xs[0].device
    cuda = dev.type == "cuda"
    plan = plan_for(tuple((tuple(x.shape), x.dtype) for x in xs), spec, swizzled)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=dev)
    if plan.zeroed:
        buf[:plan.zeroed].zero_()
    base = buf.data_ptr()
    stream = current_stream_handle(dev) if cuda else None
    flags = take_flags(dev, len(xs), stream) if cuda else None
    results: list[int | torch.Tensor] = [flags] * len(xs)
    same = not cuda or dev.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(dev):
        nthreads = torch.get_num_threads()
        for i, (x, slot) in enumerate(zip(xs, plan.slots, strict=True)):
            x3 = x if x.is_contiguous() else x.contiguous()
            codes, scales = base + slot.codes, base + slot.scales
            amax, stored = base + slot.amax, base + slot.stored
            # the encode/decode pointers are read only outside the row domain; MXFP4 has no
            # outer scale and its kernels never read them
            bad = encode(lib, cuda, x3.data_ptr(), codes, scales, amax, stored, amax, amax,
                         slot.params, flags.data_ptr() + 4 * i if cuda else 0, stream, nthreads)
            if not cuda:
                results[i] = bad
    return assemble(buf, xs, spec, swizzled, plan, results), flags


def assemble(buf, xs, spec, swizzled, plan, flags) -> list[Pending]:
    """The launched calls of :func:`launch_many`, their outputs viewed in ``buf`` in their
    final shapes (one ``as_strided`` each: nothing left to reshape in :func:`batch_result`)."""
    scale_dtype = spec.scale_dtype
    floats = buf.view(torch.float32)  # the buffer's length is a multiple of ALIGN
    row = spec.outer_domain == "row"
    pending = []
    for x, s, bad in zip(xs, plan.slots, flags, strict=True):
        codes = buf.as_strided(s.codes_shape, contiguous_strides(s.codes_shape), s.codes)
        scales = buf.as_strided(s.scales_shape, contiguous_strides(s.scales_shape), s.scales)
        scales = scales.view(scale_dtype)
        amax = stored = None
        if row:
            strides = contiguous_strides(s.lead)
            amax = floats.as_strided(s.lead, strides, s.amax // 4)
            stored = floats.as_strided(s.lead, strides, s.stored // 4)
        pending.append(Pending(x, spec, None, swizzled, None, codes, scales, amax, stored,
                               stored, amax, bad))
    return pending


def batch_result(t: Pending):
    """The result of a :func:`launch_many` call no kernel flagged (its views as they are)."""
    if t.swizzled:
        return GemmOperand(t.codes, t.scales, t.stored, t.amax, t.spec, tuple(t.x.shape))
    return NVFP4Tensor(codes=t.codes, block_scales=t.scales, outer_scale=t.stored,
                       spec=t.spec, shape=tuple(t.x.shape), outer_amax=t.amax)


def quantize_kernel(lib, x, spec, outer_amax, swizzled, out=None):
    cuda = x.device.type == "cuda"
    stream = current_stream_handle(x.device) if cuda else None
    flags = take_flags(x.device, 1, stream) if cuda else None
    t = launch(lib, x, spec, outer_amax, swizzled, out, flags=flags, stream=stream)
    return finish(t, t.flags if flags is None else read_flags(flags)[0])


def raise_like_spec(x, spec, outer_amax):
    _spec.quantize(x, spec, outer_amax=outer_amax)  # raises the typed error with positions
    raise RuntimeError("an NVFP4 kernel flagged its input but the spec accepted it; "
                       "please report this as a kernel bug")
