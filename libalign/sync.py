"""Weight sync: quantize a learner's weights straight into the buffers a sampler loads from.

A sync after every optimizer step moves each expert weight from the learner's memory to
where the sampler reads it. Quantizing first and copying the NVFP4 bytes moves about a
quarter of the BF16 bytes, but done naively it adds a pass: the kernel writes its codes
into fresh memory, then a copy reads them again, and the conversion of one tensor waits
for the copy of the previous one. :func:`quantize_into` removes both costs:

Colocated (destination on the source's device)
    Each kernel writes its codes, block scales and row scales into the destination
    buffers themselves (:func:`libalign.kernels.quantize` with ``out=``): the sync reads the
    BF16 once and writes only the NVFP4 bytes, nothing else.

To the host (destination in pinned CPU memory)
    The kernels write into device staging buffers, two per shape used in turn, on the
    caller's stream; a second stream copies each finished staging set to the host while
    the next tensor is quantized, so the conversion hides under the device-to-host copy,
    which is the slower of the two. A staging set is reused only after its copy is done
    (CUDA events order the two streams; the host never waits in between).

Errors
    Each kernel ORs its flags (NaN/Inf input, an undefined scale) into one slot of a
    device array that is read once, after everything was launched: one synchronisation
    for the whole sync. A flagged tensor raises the spec's typed error (positions
    included) with a note naming its index; the destinations of a failed sync hold
    unspecified bytes. The calls no kernel serves (see :func:`libalign.kernels.kernel_gap`),
    and CPU sources, are quantized by :func:`libalign.kernels.quantize` and copied in, with the
    same bits.

Stacks that are never made
    A source may be a :class:`Stacked`: the stack ``[E, M, K]`` of E same-shape 2-D
    tensors (a trainer's per-expert weights, each its own allocation). Under a preset
    scaled per row the kernels read each tensor's rows where it lies, through a table of
    one pointer per tensor, and write the stack's outputs: one launch for E weights and no
    copy of the inputs (the bits of the stack's call). Elsewhere (another outer-scale
    domain, a destination on the host, a call no kernel serves) the stack is made first.

The destinations are :class:`~libalign.spec.NVFP4Tensor` buffers of the sources' shapes
and spec with linear block scales; :func:`empty_destination` allocates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libalign import spec as _spec
from libalign.errors import SpecError
from libalign.kernels import calls, native, ops
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor


def empty_destination(x: torch.Tensor, spec: NumericsSpec | None = None, *,
                      device: torch.device | str | None = None,
                      pin_memory: bool = False) -> NVFP4Tensor:
    """Uninitialised buffers for the NVFP4 form of ``x`` under ``spec`` on ``device``
    (default: ``x``'s), pinned when asked (host destinations of :func:`quantize_into`)."""
    spec = PRESETS["minite"] if spec is None else spec
    _spec.check_input(x, spec)
    dev = torch.device(device) if device is not None else x.device
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if k % spec.block_size:
        raise SpecError(f"quantize_into needs K a multiple of {spec.block_size}, got K={k}")

    def empty(shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=dev, pin_memory=pin_memory)

    domain = spec.outer_domain  # one outer scale per row, per expert, per tensor, or none
    outer_shape = {"row": lead, "expert": lead[:1] if x.ndim == 3 else (), "tensor": ()}
    outer = amax = None
    if domain in outer_shape:
        outer = empty(outer_shape[domain], torch.float32)
        amax = empty(outer_shape[domain], torch.float32)
    return NVFP4Tensor(codes=empty((*lead, k // 2), torch.uint8),
                       block_scales=empty((*lead, k // spec.block_size),
                                          torch.float8_e8m0fnu if spec.is_mx else torch.float8_e4m3fn),
                       outer_scale=outer, spec=spec, shape=tuple(x.shape), outer_amax=amax)


def _buffers(q: NVFP4Tensor) -> list[torch.Tensor]:
    """The result's buffers, as raw tensors, in a fixed order."""
    return [t for t in (q.codes, q.block_scales.view(torch.uint8), q.outer_scale, q.outer_amax)
            if t is not None]


def _check_destination(i: int, x: torch.Tensor, d: NVFP4Tensor, spec: NumericsSpec) -> None:
    if not isinstance(d, NVFP4Tensor):
        raise SpecError(f"destination {i} must be an NVFP4Tensor, got {type(d).__name__}")
    if d.shape != tuple(x.shape) or d.spec != spec:
        raise SpecError(f"destination {i} has shape {d.shape} and spec {d.spec.name!r}; "
                        f"source {i} needs {tuple(x.shape)} and {spec.name!r}")
    for t in _buffers(d):
        if not t.is_contiguous():
            raise SpecError(f"destination {i}'s buffers must be contiguous")


def _copy_result(q: NVFP4Tensor, d: NVFP4Tensor) -> None:
    for dst, src in zip(_buffers(d), _buffers(q), strict=True):
        dst.copy_(src)


@dataclass(frozen=True)
class Stacked:
    """A :func:`quantize_into` source: the stack ``[len(tensors), M, K]`` of same-shape 2-D
    tensors, read where each one lies (module doc); :meth:`stack` makes it where a call
    needs the tensor itself."""

    tensors: tuple[torch.Tensor, ...]

    def __post_init__(self):
        ts = self.tensors
        if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
            raise SpecError("a Stacked source needs at least one tensor, and only tensors")
        t0 = ts[0]
        odd = next((i for i, t in enumerate(ts) if t.ndim != 2 or t.shape != t0.shape
                    or t.dtype != t0.dtype or t.device != t0.device), None)
        if odd is not None:
            t = ts[odd]
            raise SpecError(f"a Stacked source's tensors must be 2-D of one shape, dtype and "
                            f"device: tensor {odd} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                            f"tensor 0 {tuple(t0.shape)} {t0.dtype} on {t0.device}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.tensors), *self.tensors[0].shape))

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def stack(self) -> torch.Tensor:
        """The stack itself (a copy)."""
        return torch.stack(self.tensors)


def quantize_into(sources: Sequence[torch.Tensor | Stacked], destinations: Sequence[NVFP4Tensor],
                  spec: NumericsSpec | None = None) -> None:
    """Quantize ``sources[i]`` into ``destinations[i]`` for every i, as described above.

    Returns when every destination holds its bits (the spec's, bit for bit).
    """
    spec = PRESETS["minite"] if spec is None else spec
    if len(sources) != len(destinations):
        raise SpecError(f"{len(sources)} sources but {len(destinations)} destinations")
    sources = list(sources)
    for i, (x, d) in enumerate(zip(sources, destinations, strict=True)):
        stacked = isinstance(x, Stacked)  # checked by its shape and dtype, not stacked yet
        _spec.check_input(torch.empty(x.shape, dtype=x.tensors[0].dtype, device="meta")
                          if stacked else x, spec)
        _check_destination(i, x, d, spec)
        if stacked and not _gathers(x, d, spec):
            sources[i] = x.stack()
    gpu = [i for i, x in enumerate(sources) if x.device.type == "cuda"
           and (isinstance(x, Stacked) or ops.kernel_gap(x, spec, None) is None)]
    lib = native.load("cuda") if gpu else None
    served = set(gpu) if lib is not None else set()
    for i, (x, d) in enumerate(zip(sources, destinations, strict=True)):
        if isinstance(x, Stacked) and x.device.type == "cpu":
            _gather_on_cpu(x, d, spec)
        elif i not in served:  # never a Stacked source: on a CPU it went above, on CUDA it is served
            same = d.codes.device == x.device
            q = ops.quantize(x, spec, out=d if same else None)
            if not same:
                _copy_result(q, d)
    if lib is not None:
        _quantize_on_gpu(lib, sources, destinations, spec, gpu)


def _gathers(x: Stacked, d: NVFP4Tensor, spec: NumericsSpec) -> bool:
    """Whether the kernels read ``x``'s tensors in place: a preset and tensors they serve so
    (:func:`libalign.kernels.calls.gatherable`), the destination on their device, and a
    compiled library for it."""
    t0 = x.tensors[0]
    return (calls.gatherable(x.tensors, spec) and ops.kernel_gap(t0, spec, None) is None
            and d.codes.device == t0.device and native.load(t0.device.type) is not None)


def _gather_on_cpu(x: Stacked, d: NVFP4Tensor, spec: NumericsSpec) -> None:
    """A CPU :class:`Stacked` source through the CPU library; a flagged call is redone on the
    stack by :func:`libalign.kernels.quantize`, which raises the spec's error or gives its
    bits."""
    t, _table = calls.launch_gather(native.load("cpu"), x.tensors, spec, d)
    if t.flags:
        ops.quantize(x.stack(), spec, out=d)


def _quantize_on_gpu(lib, sources, destinations, spec, indices) -> None:
    dev = sources[indices[0]].device
    if any(sources[i].device != dev for i in indices):
        raise SpecError("quantize_into takes CUDA sources on one device per call")
    compute = torch.cuda.current_stream(dev)
    copier = None
    flags = torch.zeros(len(sources), dtype=torch.int32, device=dev)
    staging: dict[tuple, list[NVFP4Tensor]] = {}
    free: dict[int, torch.cuda.Event] = {}  # id(staging set) -> its last copy's end
    turn: dict[tuple, int] = {}
    launched = []
    tables = []  # the gathered calls' pointer tables, held until the kernels have run
    for i in indices:
        x, d = sources[i], destinations[i]
        slot = flags[i:i + 1]
        if isinstance(x, Stacked):  # colocated (else it was stacked): tensors read in place
            t, table = calls.launch_gather(lib, x.tensors, spec, d, flags=slot,
                                           stream=compute.cuda_stream)
            tables.append(table)
            launched.append((i, t))
            continue
        if d.codes.device == dev:  # colocated: the kernel writes the destination itself
            t = calls.launch(lib, x, spec, None, False, out=d, flags=slot,
                                    stream=compute.cuda_stream)
            calls.finish(t, 0)  # tensor/expert domains: outer scales into d
            launched.append((i, t))
            continue
        key = (tuple(x.shape), x.dtype)
        sets = staging.setdefault(key, [])
        n = turn.get(key, 0)
        turn[key] = n + 1
        if len(sets) < 2:
            sets.append(empty_destination(x, spec))
        stage = sets[n % 2]
        if id(stage) in free:
            compute.wait_event(free[id(stage)])
        t = calls.launch(lib, x, spec, None, False, out=stage, flags=slot,
                                stream=compute.cuda_stream)
        calls.finish(t, 0)  # tensor/expert domains: outer scales into the stage
        launched.append((i, t))
        done = torch.cuda.Event()
        done.record(compute)
        copier = copier or torch.cuda.Stream(dev)
        copier.wait_event(done)
        with torch.cuda.stream(copier):
            for dst, src in zip(_buffers(d), _buffers(stage), strict=True):
                dst.copy_(src, non_blocking=True)
        ended = torch.cuda.Event()
        ended.record(copier)
        free[id(stage)] = ended
    host_flags = flags.tolist()  # the one synchronisation (of the caller's stream)
    if copier is not None:
        copier.synchronize()
    for i, t in launched:
        bad = host_flags[i]
        x = sources[i].stack() if bad and isinstance(sources[i], Stacked) else t.x
        if bad == calls.FLAG_USE_SPEC:  # a corner only the spec reproduces
            _copy_result(_spec.quantize(x, spec), destinations[i])
        elif bad:
            try:
                calls.raise_like_spec(x, spec, None)
            except Exception as e:
                e.add_note(f"quantize_into: source {i} of {len(sources)}")
                raise
