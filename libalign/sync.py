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

The destinations are :class:`~libalign.spec.NVFP4Tensor` buffers of the sources' shapes
and spec with linear block scales; :func:`empty_destination` allocates them.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def quantize_into(sources: Sequence[torch.Tensor], destinations: Sequence[NVFP4Tensor],
                  spec: NumericsSpec | None = None) -> None:
    """Quantize ``sources[i]`` into ``destinations[i]`` for every i, as described above.

    Returns when every destination holds its bits (the spec's, bit for bit).
    """
    spec = PRESETS["minite"] if spec is None else spec
    if len(sources) != len(destinations):
        raise SpecError(f"{len(sources)} sources but {len(destinations)} destinations")
    for i, (x, d) in enumerate(zip(sources, destinations, strict=True)):
        _spec.check_input(x, spec)
        _check_destination(i, x, d, spec)
    gpu = [i for i, x in enumerate(sources) if x.device.type == "cuda"
           and ops.kernel_gap(x, spec, None) is None]
    lib = native.load("cuda") if gpu else None
    served = set(gpu) if lib is not None else set()
    for i, (x, d) in enumerate(zip(sources, destinations, strict=True)):
        if i not in served:
            same = d.codes.device == x.device
            q = ops.quantize(x, spec, out=d if same else None)
            if not same:
                _copy_result(q, d)
    if lib is not None:
        _quantize_on_gpu(lib, sources, destinations, spec, gpu)


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
    for i in indices:
        x, d = sources[i], destinations[i]
        slot = flags[i:i + 1]
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
        if bad == calls.FLAG_USE_SPEC:  # a corner only the spec reproduces
            _copy_result(_spec.quantize(sources[i], spec), destinations[i])
        elif bad:
            try:
                calls.raise_like_spec(t.x, spec, None)
            except Exception as e:
                e.add_note(f"quantize_into: source {i} of {len(sources)}")
                raise
