"""From a trainer's named BF16 tensors to the named NVFP4 tensors an SGLang server loads.

A trainer's weight sync already produces a stream of ``(hf_name, tensor)`` pairs: Megatron
trainers convert each parameter to its Hugging Face names as they gather it, FSDP trainers
walk the state dict. :func:`quantize_named` sits in that stream and changes nothing else:

What it quantizes
    The tensors the one selection policy picks (:func:`alignd.formats.selection.make_select`):
    routed experts by default, per-expert 2-D projections and 3-D expert stacks alike; every
    linear weight but embeddings, ``lm_head``, norms and routers with ``all_linear``. Every
    other tensor passes through unchanged, in the order it came.

What it yields
    For each quantized tensor, the names and layout SGLang's loaders take
    (:func:`alignd.formats.modelopt_export.modelopt_parts`): ``<module>.weight`` (packed E2M1
    codes), ``<module>.weight_scale`` (E4M3 block scales), ``<module>.weight_scale_2`` (the
    fp32 decode scale: a scalar for tensor-scaled presets, ``[N, 1]`` for ``minite``); 3-D
    stacks split per expert (``...experts.<e>.gate_proj`` ...). The bits are exactly those of
    :func:`libalign.kernels.quantize` (the fused kernels, on the tensors' own device), so
    a server fed by the stream multiplies the bits a store version of the same weights holds.

Fused siblings
    SGLang fuses ``gate_proj``/``up_proj`` (``w1``/``w3``) and ``q/k/v_proj`` into one GEMM
    with one outer scale. Under a tensor- or expert-scaled preset the members of such a group
    are held until the whole group has arrived, then quantized with one shared maximum
    (:func:`libalign.spec.shared_outer_amax`), as ``alignd convert`` does; under ``minite``
    every row is its own scale domain and nothing waits. A group still waiting when the held
    tensors pass ``bucket_bytes`` is an error (the trainer does not send siblings together);
    one left incomplete at the end of the stream is quantized with the maximum of the members
    it has.

Memory
    Selected tensors are quantized a batch at a time, a batch closing once it holds
    ``bucket_bytes`` of input (one device synchronisation per batch,
    :func:`libalign.kernels.quantize_many`). The extra memory is the batch's inputs, kept
    alive until they are quantized, and its NVFP4 outputs (0.28 of the inputs), never the
    whole model.

Bad input
    A tensor that is not a floating tensor, a name the layout has no place for (a 3-D stack
    SGLang has no per-expert name for, a 2-D selected tensor not named ``<module>.weight``),
    a sibling whose K differs from its group's, NaN or Inf: a typed error naming the tensor
    (``.tensor`` set), raised before any of the failing batch's outputs is yielded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from alignclient.errors import AlignError, DTypeError, InputError, LayoutError, ShapeError

from alignd.formats.convert import resolve_spec
from alignd.formats.modelopt_export import modelopt_parts, sglang_method
from alignd.formats.selection import FUSED_SIBLINGS, make_select, module_parts
from alignd.formats.weight_store import named_error
from libalign.kernels import ops
from libalign.spec import NumericsSpec, NVFP4Tensor, shared_outer_amax

#: Layouts the stream yields: SGLang's ModelOpt names (``modelopt_fp4`` and ``libalign_minite``).
LAYOUTS = ("modelopt",)
#: Input bytes per quantized batch (and the transports' bucket size), as slime's default
#: ``update_weight_buffer_size``.
DEFAULT_BUCKET_BYTES = 512 << 20
#: The members each kind of fused group waits for, by the naming family of its first member.
GROUP_MEMBERS: dict[str, tuple[frozenset[str], ...]] = {
    "gate_up": (frozenset({"gate_proj", "up_proj"}), frozenset({"w1", "w3"})),
    "qkv": (frozenset({"q_proj", "k_proj", "v_proj"}),),
}


def _group_of(name: str) -> tuple[str, str] | None:
    """``(group key, member part)`` of a fused sibling, None for any other tensor."""
    parts = module_parts(name)
    kind = FUSED_SIBLINGS.get(parts[-1])
    if kind is None:
        return None
    return ".".join(parts[:-1]) + ":" + kind, parts[-1]


def _complete(key: str, members: Iterable[str]) -> bool:
    have = frozenset(members)
    return any(have == want for want in GROUP_MEMBERS[key.rpartition(":")[2]])


@dataclass
class _Held:
    """A fused group waiting for its members: member name -> tensor, in arrival order."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _Quantizer:
    """The batches and held groups of one :func:`quantize_named` call."""

    def __init__(self, spec: NumericsSpec, bucket_bytes: int):
        self.spec = spec
        self.bucket_bytes = bucket_bytes
        self.shares = not spec.is_mx and spec.outer_domain in ("tensor", "expert")
        self.batch: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        self.batch_bytes = 0
        self.held: dict[str, _Held] = {}

    def add(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Take selected tensor ``name``; yield whatever batch it closes."""
        group = _group_of(name) if self.shares else None
        if group is None:
            yield from self._queue([(name, t, None)])
            return
        key, part = group
        held = self.held.setdefault(key, _Held())
        if held.tensors:
            first, other = next(iter(held.tensors.items()))
            if other.shape[-1] != t.shape[-1] or other.ndim != t.ndim:
                raise ShapeError(f"tensor {name!r} has shape {tuple(t.shape)}; its fused "
                                 f"sibling {first!r} has {tuple(other.shape)} (one GEMM needs "
                                 "the same K and rank)")
        if name in held.tensors:
            raise InputError(f"tensor {name!r} arrived twice in one stream")
        held.tensors[name] = t
        held.parts.append(part)
        if _complete(key, held.parts):
            yield from self._release(key)
            return
        waiting = sum(h.nbytes for h in self.held.values())
        if waiting > self.bucket_bytes:
            family = next(f for f in GROUP_MEMBERS[key.rpartition(":")[2]] if part in f)
            missing = sorted(family - set(held.parts))
            raise LayoutError(
                f"tensor {name!r}: its fused siblings ({', '.join(missing)}) have not arrived "
                f"while {waiting} bytes of siblings wait (bucket_bytes={self.bucket_bytes}); "
                "send gate/up and q/k/v of a module together, or raise bucket_bytes")

    def _release(self, key: str) -> Iterator[tuple[str, torch.Tensor]]:
        held = self.held.pop(key)
        names = list(held.tensors)
        try:
            amax = shared_outer_amax(list(held.tensors.values()), self.spec)
        except AlignError as e:
            raise named_error(e, " + ".join(names)) from e
        yield from self._queue([(n, held.tensors[n], amax) for n in names])

    def _queue(self, items) -> Iterator[tuple[str, torch.Tensor]]:
        for item in items:
            self.batch.append(item)
            self.batch_bytes += item[1].numel() * item[1].element_size()
        if self.batch_bytes >= self.bucket_bytes:
            yield from self.flush()

    def flush(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize the open batch and yield its ModelOpt tensors."""
        batch, self.batch, self.batch_bytes = self.batch, [], 0
        if not batch:
            return
        results = self._quantize(batch)
        for (name, _, _), q in zip(batch, results, strict=True):
            for weight, stored_as in modelopt_parts(name, q):
                module = weight.removesuffix(".weight")
                for key, t in stored_as.items():
                    yield f"{module}.{key}", t

    def _quantize(self, batch) -> list[NVFP4Tensor]:
        plain = [t for _, t, amax in batch if amax is None]
        try:
            many = iter(ops.quantize_many(plain, self.spec)) if plain else iter(())
        except AlignError:
            many = None  # name the failing tensor: quantize them one at a time below
        out = []
        for name, t, amax in batch:
            try:
                if amax is None and many is not None:
                    out.append(next(many))
                else:
                    out.append(ops.quantize(t, self.spec, outer_amax=amax))
            except AlignError as e:
                raise named_error(e, name) from e
        return out

    def finish(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The end of the stream: incomplete groups with the maxima they have, then the batch."""
        for key in list(self.held):
            yield from self._release(key)
        yield from self.flush()


def quantize_named(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   spec: NumericsSpec | str = "minite", *, layout: str = "modelopt",
                   all_linear: bool = False,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``named_tensors`` with the selected ones quantized under ``spec`` into ``layout``'s
    names (see the module doc). Refuses up front a spec no SGLang method loads (MXFP4, a
    row-scaled preset other than ``minite``) and an unknown layout (LayoutError)."""
    spec = resolve_spec(spec)
    if layout not in LAYOUTS:
        raise LayoutError(f"layout {layout!r} is not one of {LAYOUTS}")
    if sglang_method(spec) is None:
        raise LayoutError(f"preset {spec.name!r} has no SGLang method to load it (one outer "
                          "scale per tensor or expert: modelopt_fp4; the 'minite' spec: "
                          "libalign_minite)")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    select = make_select(all_linear)
    work = _Quantizer(spec, bucket_bytes)
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not select(name, t):
            yield name, t
            continue
        if not t.is_floating_point():
            raise DTypeError(f"tensor {name!r} is selected for NVFP4 but has dtype {t.dtype}; "
                             "it must be bf16, fp16 or fp32")
        yield from work.add(name, t)
    yield from work.finish()
