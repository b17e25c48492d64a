"""Flattened buckets: many named tensors as one byte buffer and a list of where each one lies.

A refit moves thousands of tensors (three per expert per layer, each with two scales); one
transfer per tensor would spend its time on per-call overhead. Trainers therefore pack them
into *buckets*, as SGLang's ``FlattenedTensorBucket`` does: every tensor's bytes one after the
other in a ``uint8`` buffer, and per tensor an entry of ``name, shape, dtype, start_idx,
end_idx, numel`` (byte offsets; ``numel`` counts bytes). :class:`BucketEntry` has exactly those
fields, so SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")`` and its
distributed receiver read a :class:`Bucket` as their own.

Layout
    Tensors lie contiguously with no padding, widest dtype first (4-byte, then 2-byte, then
    1-byte elements), so every tensor starts at a multiple of its element size: the layout
    SGLang's receiving side rebuilds from names, dtypes and shapes alone
    (``FlattenedTensorBucket.empty``), and every entry can be viewed in its dtype.

Size
    :func:`buckets` closes a bucket once it holds ``bucket_bytes``; a tensor larger than that
    travels alone in its own bucket (an embedding can be larger than a bucket), so a bucket
    exceeds ``bucket_bytes`` only by holding one such tensor. Peak memory while packing: the
    open bucket's tensors and the buffer they are copied into.

The header
    A libalign receiver (:mod:`alignd.sync.receive`) needs to know which version a bucket
    belongs to and whether it is the last; :class:`RefitHeader` says so, as JSON in a ``uint8``
    tensor named :data:`HEADER_NAME` sent beside the buffer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from alignclient.errors import DTypeError, InputError, LayoutError

#: Name of the header tensor beside a bucket's buffer.
HEADER_NAME = "libalign.refit.header"
#: Name of the buffer itself when a bucket travels as named tensors.
BUFFER_NAME = "libalign.refit.bucket"
#: dtypes a bucket carries (what a refit sends: codes, scales, raw weights), by name.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int32,
    torch.int64, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bool)}

_CARRIED = frozenset(DTYPES.values())


def dtype_named(name: str | torch.dtype) -> torch.dtype:
    """The dtype called ``name`` (``"bfloat16"``, ``"torch.uint8"``); DTypeError if a bucket
    cannot carry it."""
    if isinstance(name, torch.dtype):
        if name in _CARRIED:
            return name
        name = str(name)
    d = DTYPES.get(str(name).removeprefix("torch."))
    if d is None:
        raise DTypeError(f"dtype {name!r} cannot travel in a bucket; known: {sorted(DTYPES)}")
    return d


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a bucket: SGLang's ``FlattenedTensorMetadata`` fields."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def to_dict(self) -> dict:
        """JSON-ready form (dtype by name)."""
        return {"name": self.name, "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch."),
                "start_idx": self.start_idx, "end_idx": self.end_idx, "numel": self.numel}

    @classmethod
    def from_dict(cls, d: dict) -> BucketEntry:
        """The entry :meth:`to_dict` wrote, checked (LayoutError naming the tensor)."""
        try:
            e = cls(str(d["name"]), torch.Size([int(x) for x in d["shape"]]),
                    dtype_named(d["dtype"]), int(d["start_idx"]), int(d["end_idx"]),
                    int(d["numel"]))
        except (KeyError, TypeError, ValueError) as err:
            raise LayoutError(f"bucket entry {d!r} is malformed: {err}") from None
        size = e.shape.numel() * e.dtype.itemsize
        if any(x < 0 for x in e.shape) or e.end_idx - e.start_idx != size or e.numel != size:
            raise LayoutError(f"bucket entry {e.name!r}: bytes [{e.start_idx}, {e.end_idx}) do "
                              f"not hold shape {tuple(e.shape)} of {e.dtype}")
        return e


def layout(names: Sequence[str], dtypes: Sequence[torch.dtype | str],
           shapes: Sequence[Sequence[int]]) -> list[BucketEntry]:
    """Entries for tensors laid out back to back in the given order (SGLang's receiving
    layout); LayoutError where one would start off its element size's alignment."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype, shape = dtype_named(dtype), torch.Size(shape)
        if offset % dtype.itemsize:
            raise LayoutError(f"tensor {name!r} ({dtype}) would start at byte {offset}, not a "
                              f"multiple of {dtype.itemsize}")
        size = shape.numel() * dtype.itemsize
        out.append(BucketEntry(name, shape, dtype, offset, offset + size, size))
        offset += size
    return out


@dataclass
class Bucket:
    """A flattened bucket: ``flat`` (uint8) and the :class:`BucketEntry` of each tensor."""

    flat: torch.Tensor
    entries: list[BucketEntry]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self.flat.numel()

    @classmethod
    def empty(cls, entries: list[BucketEntry], device: torch.device | str) -> Bucket:
        """An uninitialised bucket for ``entries`` (a receiver's, before the bytes arrive)."""
        end = max((e.end_idx for e in entries), default=0)
        return cls(torch.empty(end, dtype=torch.uint8, device=device), list(entries))

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every entry: views of the buffer."""
        if any(e.end_idx > self.flat.numel() for e in self.entries):
            raise LayoutError(f"bucket entries reach past its {self.flat.numel()} bytes")
        return [(e.name, self.flat[e.start_idx:e.end_idx].view(e.dtype).reshape(e.shape))
                for e in self.entries]

    def sglang_payload(self) -> dict:
        """What SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")``
        reads: ``{"flattened_tensor": ..., "metadata": [...]}``."""
        return {"flattened_tensor": self.flat, "metadata": list(self.entries)}


def pack(named: Sequence[tuple[str, torch.Tensor]], device: torch.device | str | None = None
         ) -> Bucket:
    """One bucket of ``named`` (on ``device``, default the first tensor's), widest dtype first."""
    if not named:
        raise InputError("a bucket needs at least one tensor")
    order = sorted(range(len(named)), key=lambda i: -named[i][1].element_size())
    names = [named[i][0] for i in order]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InputError(f"tensor {dup!r} appears twice in one bucket")
    entries = layout(names, [named[i][1].dtype for i in order],
                     [named[i][1].shape for i in order])
    dev = torch.device(device) if device is not None else named[0][1].device
    bucket = Bucket.empty(entries, dev)
    run: list[torch.Tensor] = []
    start = 0
    for e, i in zip(entries, order, strict=True):
        t = named[i][1]
        if t.device != dev or not t.is_contiguous():  # copied alone (across devices too)
            bucket.flat[e.start_idx:e.end_idx].view(e.dtype).view(e.shape).copy_(t)
            _cat(run, bucket.flat, start)
            run, start = [], e.end_idx
            continue
        run.append(t.reshape(-1).view(torch.uint8))
    _cat(run, bucket.flat, start)
    return bucket


def _cat(run: list[torch.Tensor], flat: torch.Tensor, start: int) -> None:
    """Bytes of ``run`` into ``flat`` from ``start``, back to back: one batched copy (a few
    launches on a GPU) instead of one per tensor."""
    if run:
        n = sum(t.numel() for t in run)
        torch.cat(run, out=flat[start:start + n])


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
            device: torch.device | str | None = None) -> Iterator[Bucket]:
    """``named`` packed into buckets of about ``bucket_bytes`` each (see the module doc)."""
    for bucket, _last in ended_buckets(named, bucket_bytes, device):
        yield bucket


def ended_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  device: torch.device | str | None = None) -> Iterator[tuple[Bucket, bool]]:
    """:func:`buckets` with whether each is the last: known by looking one tensor ahead (the
    one that did not fit), never a bucket ahead."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    open_: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        dtype_named(t.dtype)
        n = t.numel() * t.element_size()
        if open_ and size + n > bucket_bytes:
            bucket = pack(open_, device)
            open_, size = [], 0
            yield bucket, False
            del bucket
        open_.append((name, t))
        size += n
    if open_:
        yield pack(open_, device), True


@dataclass(frozen=True)
class RefitHeader:
    """Which version a bucket belongs to, and where in it.

    ``bucket`` counts from 0; the last bucket has ``last`` set and ``tensors``, the number of
    tensors of the whole version, and ``digest``, a sha256 over every entry's name, dtype and
    shape in sending order (what a receiver checks it got). ``model`` and ``quantization``
    (the SGLang method, or ``bf16``) let a receiver refuse a version made for another server.
    """

    version_id: str
    bucket: int
    last: bool = False
    model: str | None = None
    quantization: str | None = None
    spec: str | None = None
    tensors: int | None = None
    digest: str | None = None
    entries: list[dict] = field(default_factory=list)

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The header as a uint8 tensor (JSON bytes)."""
        raw = json.dumps(asdict(self), separators=(",", ":")).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RefitHeader:
        """The header :meth:`to_tensor` wrote; LayoutError when it is not one."""
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.ndim != 1:
            raise LayoutError(f"{HEADER_NAME} must be a 1-D uint8 tensor")
        try:
            d = json.loads(bytes(t.cpu().tolist()).decode())
            h = cls(**d)
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise LayoutError(f"{HEADER_NAME} is not a refit header: {e}") from None
        if not isinstance(h.version_id, str) or not isinstance(h.bucket, int) or h.bucket < 0:
            raise LayoutError(f"{HEADER_NAME}: version_id and bucket are malformed ({d!r})")
        return h


class Digest:
    """The running sha256 of a version's entries (name, dtype, shape), in sending order."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.count = 0

    def add(self, entries: Iterable[BucketEntry]) -> None:
        """Account for ``entries``."""
        for e in entries:
            self._h.update(f"{e.name}\0{e.dtype}\0{tuple(e.shape)}\n".encode())
            self.count += 1

    def hexdigest(self) -> str:
        """The digest so far."""
        return self._h.hexdigest()
