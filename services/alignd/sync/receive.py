"""The receiving side of a refit: buckets staged until a whole version has arrived and been
verified, then applied at once; the old weights serve until then.

A server that loads each bucket as it arrives (SGLang's own ``flattened_bucket`` handling) is
half old, half new if the sender dies in the middle, and SGLang says as much ("the full
weights ... are partially updated, please discard"). :class:`RefitReceiver` never is:

Staging
    Each bucket (:class:`~alignd.sync.buckets.RefitHeader` and the tensors) is checked and
    copied into receiver-owned memory (``stage_device``, default the bucket's), so the sender
    may reuse or free its buffer once :meth:`RefitReceiver.receive` returns. The model's
    parameters are not touched.

Checks, per bucket (nothing staged from a bucket that fails one)
    ``model`` and ``quantization`` in the header equal the receiver's (when both sides name
    them): :class:`~alignclient.errors.EngineMismatchError` with ``field`` set. The bucket
    continues the version being staged (index ``n`` after ``n - 1``); a bucket 0 of another
    version abandons the staged one (its sender restarted), any other gap is a
    :class:`~alignclient.errors.LayoutError`. A version already applied is refused
    (:class:`~alignclient.errors.WeightVersionMismatchError`). The buffer is at most
    ``max_bucket_bytes`` (:class:`~alignclient.errors.PayloadTooLargeError`). Every name is
    new in the version, and, once one version was applied (or ``expect`` was given), has the
    shape and dtype it had then (EngineMismatchError ``field="model"`` naming the tensor; on
    the last bucket, also for a tensor of that layout the version lacks).
    Floating tensors are finite and E4M3 scales hold no NaN byte
    (:class:`~alignclient.errors.NonFiniteError` naming the tensor).

On the last bucket
    The tensor count and the digest of all entries must equal the header's (a bucket lost or
    reordered on the way: LayoutError). Then ``apply`` gets every staged tensor in one call
    (for SGLang, the model's ``load_weights``); a failure there is
    :class:`~alignclient.errors.WeightUpdateError`. Any failed check discards what was staged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch
from alignclient.errors import (
    EngineMismatchError,
    LayoutError,
    NonFiniteError,
    PayloadTooLargeError,
    WeightUpdateError,
    WeightVersionMismatchError,
)

from alignd.sync.buckets import BUFFER_NAME, HEADER_NAME, Bucket, BucketEntry, Digest, RefitHeader
from libalign.spec import check_finite as spec_check_finite

#: The largest bucket a receiver takes unless told otherwise (4 GiB).
DEFAULT_MAX_BUCKET_BYTES = 4 << 30

Apply = Callable[[list[tuple[str, torch.Tensor]]], object]


def check_finite(name: str, t: torch.Tensor) -> None:
    """NonFiniteError naming ``name`` for NaN/Inf in a float tensor or NaN bytes in E4M3."""
    if t.dtype == torch.float8_e4m3fn:
        if bool(t.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any()):
            raise NonFiniteError(f"tensor {name!r}", 1, 1, 0, [])
    elif t.is_floating_point() and t.dtype.itemsize > 1:
        spec_check_finite(t, f"tensor {name!r}", limit=4)


def check_bucket_finite(bucket: Bucket) -> None:
    """:func:`check_finite` over a bucket, one check per run of same-dtype entries (a packed
    bucket holds each dtype's tensors together); the failing tensor is then named."""
    runs: list[list[BucketEntry]] = []
    for e in bucket.entries:
        if runs and runs[-1][-1].dtype == e.dtype and runs[-1][-1].end_idx == e.start_idx:
            runs[-1].append(e)
        else:
            runs.append([e])
    for run in runs:
        dtype = run[0].dtype
        if not (dtype.is_floating_point and (dtype.itemsize > 1 or dtype == torch.float8_e4m3fn)):
            continue
        span = bucket.flat[run[0].start_idx:run[-1].end_idx].view(dtype)
        try:
            check_finite("bucket", span)
        except NonFiniteError:
            for e in run:  # the error path only: name the tensor
                check_finite(e.name, bucket.flat[e.start_idx:e.end_idx].view(dtype))
            raise


class RefitReceiver:
    """Stages a version's buckets, verifies them, applies the version whole (module doc)."""

    def __init__(self, apply: Apply, *, model: str | None = None,
                 quantization: str | None = None,
                 expect: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
                 max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
                 stage_device: torch.device | str | None = None):
        self.apply = apply
        self.model, self.quantization = model, quantization
        self.expect = ({k: (tuple(s), d) for k, (s, d) in expect.items()}
                       if expect is not None else None)
        self.max_bucket_bytes = max_bucket_bytes
        self.stage_device = stage_device
        self.applied: list[str] = []
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.version: str | None = None
        self._next = 0
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._names: set[str] = set()
        self._digest = Digest()

    @property
    def staged_version(self) -> str | None:
        """The version being staged (None when none is)."""
        return self.version

    def receive_named(self, named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """A bucket as named tensors: the header and the buffer (:data:`HEADER_NAME`,
        :data:`BUFFER_NAME`, the buffer laid out by the header's entries), or the header and
        the bucket's tensors themselves."""
        by_name = dict(named)
        if HEADER_NAME not in by_name:
            raise LayoutError(f"a refit bucket carries {HEADER_NAME!r}; got "
                              f"{sorted(by_name)[:4]}")
        header = RefitHeader.from_tensor(by_name.pop(HEADER_NAME))
        if BUFFER_NAME in by_name:
            flat = by_name.pop(BUFFER_NAME).reshape(-1).view(torch.uint8)
            entries = [BucketEntry.from_dict(d) for d in header.entries]
            return self.receive_bucket(header, Bucket(flat, entries))
        return self.receive(header, list(by_name.items()))

    def receive(self, header: RefitHeader,
                tensors: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """Take one bucket given as named tensors; returns the version id when it completed
        and applied a version."""
        return self._locked(header, tensors, None)

    def receive_bucket(self, header: RefitHeader, bucket: Bucket) -> str | None:
        """Take one bucket as its buffer and entries: checked a dtype range at a time (the
        layout puts each dtype's tensors together) and staged with one copy."""
        return self._locked(header, None, bucket)

    def _locked(self, header, tensors, bucket) -> str | None:
        with self._lock:
            try:
                return self._receive(header, tensors, bucket)
            except Exception:
                self._reset()
                raise

    def _receive(self, header: RefitHeader, tensors, bucket: Bucket | None) -> str | None:
        self._check_header(header)
        if bucket is not None:
            size = bucket.nbytes
            shapes = [(e.name, e.shape, e.dtype) for e in bucket.entries]
        else:
            size = sum(t.numel() * t.element_size() for _, t in tensors)
            shapes = [(n, t.shape, t.dtype) for n, t in tensors]
        if size > self.max_bucket_bytes:
            raise PayloadTooLargeError(f"bucket {header.bucket} of {header.version_id!r}", size,
                                       self.max_bucket_bytes)
        for name, shape, dtype in shapes:
            self._check_entry(name, shape, dtype)
        if bucket is not None:
            check_bucket_finite(bucket)
            flat = bucket.flat.to(self.stage_device or bucket.flat.device, copy=True)
            staged = Bucket(flat, bucket.entries).tensors()
        else:
            staged = []
            for name, t in tensors:
                check_finite(name, t)
                staged.append((name, t.to(self.stage_device or t.device, copy=True)))
        self._digest.add(BucketEntry(n, s, d, 0, 0, 0) for n, s, d in shapes)
        self._staged += staged
        self._names.update(n for n, _, _ in shapes)
        self._next += 1
        if not header.last:
            return None
        if header.tensors != self._digest.count or header.digest != self._digest.hexdigest():
            raise LayoutError(
                f"version {header.version_id!r} ended with {self._digest.count} tensors; its "
                f"sender sent {header.tensors} (or in another order): a bucket was lost")
        missing = sorted(set(self.expect or ()) - self._names)
        if missing:
            raise EngineMismatchError(f"version {header.version_id!r} lacks {len(missing)} "
                                      f"tensors this receiver's model loads, first "
                                      f"{missing[0]!r}", field="model")
        try:
            self.apply(self._staged)
        except Exception as e:
            raise WeightUpdateError(f"applying version {header.version_id!r} failed: {e}") from e
        if self.expect is None:  # the first version fixes the layout the next ones keep
            self.expect = {n: (tuple(t.shape), t.dtype) for n, t in self._staged}
        version = header.version_id
        self.applied.append(version)
        self._reset()
        return version

    def _check_header(self, h: RefitHeader) -> None:
        for field, mine, theirs in (("model", self.model, h.model),
                                    ("quantization", self.quantization, h.quantization)):
            if mine is not None and theirs is not None and mine != theirs:
                raise EngineMismatchError(f"version {h.version_id!r} was made for {field} "
                                          f"{theirs!r}; this receiver serves {mine!r}",
                                          field=field)
        if h.version_id in self.applied:
            raise WeightVersionMismatchError(f"version {h.version_id!r} was applied already")
        if self.version is None or h.version_id != self.version:
            if h.bucket != 0:
                raise LayoutError(f"bucket {h.bucket} of version {h.version_id!r} arrived "
                                  "without its bucket 0")
            self._reset()
            self.version = h.version_id
        elif h.bucket != self._next:
            raise LayoutError(f"bucket {h.bucket} of version {h.version_id!r} arrived; "
                              f"bucket {self._next} was next")

    def _check_entry(self, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
        if name in self._names:
            raise LayoutError(f"tensor {name!r} arrived twice in version {self.version!r}")
        if self.expect is not None:
            want = self.expect.get(name)
            if want is None:
                raise EngineMismatchError(f"tensor {name!r} is not one this receiver's model "
                                          "loads", field="model")
            if want != (tuple(shape), dtype):
                raise EngineMismatchError(
                    f"tensor {name!r} is {tuple(shape)} {dtype}; this receiver's model "
                    f"loads {want[0]} {want[1]}", field="model")
