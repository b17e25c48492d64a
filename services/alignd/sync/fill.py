"""Quantize straight into the bucket: the refit's producer for row-scaled presets.

:func:`alignd.sync.stream.quantize_named` then :func:`alignd.sync.buckets.buckets` quantizes a
batch into fresh memory and copies every output into a bucket: the bytes are written twice,
and the quantized batch, the bucket being packed and the bucket in flight all exist at once.
For a row-scaled preset whose stored outer scale is the decode scale (``minite``: the stored
scale *is* SGLang's ``weight_scale_2``) no copy is needed: every output has a fixed place in
the bucket, known from the input's shape alone, so the kernels write there
(:func:`libalign.sync.quantize_into`, one device synchronisation per batch). :func:`filled_buckets`
does that:

Layout of a filled bucket
    The 1-byte outputs first, weight by weight (``<module>.weight`` codes then
    ``<module>.weight_scale``), then every weight's fp32 ``<module>.weight_scale_2`` ``[N, 1]``
    at the end. Each entry starts at a multiple of its element size (the 1-byte part is a
    multiple of 4 bytes whenever K is a multiple of 64, as in every model here; otherwise the
    refit falls back to the packing producer), entries lie back to back, so SGLang's receivers
    rebuild them from names, dtypes and shapes as for a packed bucket. A 3-D expert stack is
    one region of codes and one of scales; its per-expert entries (a ``gate_up_proj`` split in
    gate and up rows) are sub-ranges of them. A batch's 2-D weights of one shape (a trainer's
    per-expert tensors, whatever order their shapes come in) are grouped into a run, laid out
    the same way: its codes, then its scales.
Launches
    A run quantizes as one stack, one launch where each weight on its own costs a launch and
    its host work. Per-expert views of one stacked parameter, back to back in memory, are
    viewed as the stack; other inputs are read where they lie (a
    :class:`libalign.sync.Stacked` source: the kernels take one pointer per weight), so no
    input is copied. Every weight keeps its own row scales, so the bits are those of one
    launch per weight.
Memory
    The bucket being filled and its fp32 tail, kept per run until the bucket closes (4 bytes
    a row: under 1 % of the bucket at K = 768), plus the row maxima of the batch being quantized
    (scratch); the inputs of one batch (at most ``bucket_bytes`` of them) are referenced until
    the batch is quantized, never copied. With the bucket in flight: two buckets.
Passed-through tensors
    Everything not quantized goes to buckets of its own, packed as before.

The bits are exactly those of the packing producer (the tests compare every entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from alignclient.errors import AlignError, DTypeError, InputError

from alignd.formats.convert import resolve_spec
from alignd.formats.selection import make_select, module_parts, stack_members
from alignd.formats.weight_store import named_error
from alignd.sync.buckets import Bucket, BucketEntry, ended_buckets
from alignd.sync.stream import quantize_named
from libalign.kernels import ops
from libalign.kernels.calls import readable_in_place
from libalign.spec import NumericsSpec, NVFP4Tensor
from libalign.sync import Stacked, quantize_into


def fills(spec: NumericsSpec) -> bool:
    """Whether buckets of ``spec`` can be filled in place: one decode scale stored per row."""
    return (not spec.is_mx and spec.outer_domain == "row" and spec.outer_convention == "dec"
            and spec.block_size == 16)


@dataclass
class _Slot:
    """One quantized tensor's place: its input and the destination viewing the bucket."""

    name: str
    x: torch.Tensor
    codes_at: int
    scales_at: int
    rows_at: int  # index of its first row in the fp32 tail


#: A run of same-shape 2-D weights quantizes as one launch of at most this many input bytes
#: (None: no bound but the batch's; 0: one launch a weight).
RUN_BYTES: int | None = None


class _Filler:
    """The bucket being filled: 1-byte outputs from the front, fp32 rows staged aside."""

    def __init__(self, spec: NumericsSpec, capacity: int, device: torch.device):
        self.spec, self.capacity, self.device = spec, capacity, device
        self.flat = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.used, self.nrows = 0, 0
        self.slots: list[_Slot] = []
        self.outers: list[torch.Tensor] = []  # each run's rows' decode scales, in slot order
        self.batch: list[_Slot] = []
        self.batch_bytes = 0

    @staticmethod
    def sizes(x: torch.Tensor) -> tuple[int, int, int]:
        rows = x.numel() // x.shape[-1]
        return rows * x.shape[-1] // 2, rows * x.shape[-1] // 16, rows

    def fits(self, x: torch.Tensor) -> bool:
        codes, scales, rows = self.sizes(x)
        return self.used + codes + scales + 4 * (self.nrows + rows) <= self.capacity

    def add(self, name: str, x: torch.Tensor, batch_bytes: int) -> None:
        codes, scales, rows = self.sizes(x)
        slot = _Slot(name, x, self.used, self.used + codes, self.nrows)
        self.used += codes + scales
        self.nrows += rows
        self.slots.append(slot)
        self.batch.append(slot)
        self.batch_bytes += x.numel() * x.element_size()
        if self.batch_bytes >= batch_bytes:
            self.quantize()

    def quantize(self) -> None:
        """Quantize the open batch into its places (one synchronisation for the batch).
        Consecutive 2-D weights of one shape go as one stack (:func:`_runs`): one launch for
        the run, its codes then its block scales back to back in the run's bytes."""
        batch, self.batch, self.batch_bytes = self.batch, [], 0
        if not batch:
            return
        sources: list[torch.Tensor | Stacked] = []
        dests: list[NVFP4Tensor] = []
        # the batch's bytes and rows are laid out again, run by run: the batch occupies the
        # same span whatever the order of its slots within it
        start, first_row = batch[0].codes_at, batch[0].rows_at
        for run in _runs(_by_shape(batch)):
            x0, n = run[0].x, len(run)
            xs = [s.x for s in run]
            lead, k = tuple(x0.shape[:-1]), x0.shape[-1]
            codes, scales, rows = self.sizes(x0)
            outer = torch.empty((n, *lead), dtype=torch.float32, device=self.device)
            self.outers.append(outer)
            for i, s in enumerate(run):
                s.codes_at, s.scales_at = start + i * codes, start + n * codes + i * scales
                s.rows_at = first_row + i * rows
            shape = (n, *lead) if n > 1 else lead
            sources.append(x0 if n == 1 else _stacked(xs))
            dests.append(NVFP4Tensor(
                codes=self.flat[start:start + n * codes].view(*shape, k // 2),
                block_scales=self.flat[start + n * codes:start + n * (codes + scales)]
                .view(torch.float8_e4m3fn).view(*shape, k // 16),
                outer_scale=outer if n > 1 else outer[0], spec=self.spec,
                shape=(*shape, k), outer_amax=torch.empty(shape, dtype=torch.float32,
                                                          device=self.device)))  # scratch
            start += n * (codes + scales)
            first_row += n * rows
        self._quantize_into(sources, dests, batch)

    def _quantize_into(self, sources, dests, batch: list[_Slot]) -> None:
        try:
            quantize_into(sources, dests, self.spec)
        except AlignError as e:
            for s in batch:  # the failure path only: find the tensor it is about
                try:
                    ops.quantize(s.x, self.spec)
                except AlignError as one:
                    raise named_error(one, s.name) from e
            raise

    def close(self) -> Bucket:
        """The bucket: the fp32 tail copied behind the 1-byte part, entries in byte order."""
        self.quantize()
        tail = self.used
        if self.slots:  # every run's decode scales, in row order, in one batched copy
            torch.cat([o.reshape(-1) for o in self.outers],
                      out=self.flat[tail:tail + 4 * self.nrows].view(torch.float32))
        ones: list[BucketEntry] = []
        fours: list[BucketEntry] = []
        for s in self.slots:
            k = s.x.shape[-1]
            for weight, rows_from, n in _weights(s):
                module = weight.removesuffix(".weight")
                c0 = s.codes_at + rows_from * k // 2
                s0 = s.scales_at + rows_from * k // 16
                r0 = tail + 4 * (s.rows_at + rows_from)
                ones.append(BucketEntry(f"{module}.weight", torch.Size((n, k // 2)), torch.uint8,
                                        c0, c0 + n * k // 2, n * k // 2))
                ones.append(BucketEntry(f"{module}.weight_scale", torch.Size((n, k // 16)),
                                        torch.float8_e4m3fn, s0, s0 + n * k // 16, n * k // 16))
                fours.append(BucketEntry(f"{module}.weight_scale_2", torch.Size((n, 1)),
                                         torch.float32, r0, r0 + 4 * n, 4 * n))
        ones.sort(key=lambda e: e.start_idx)
        fours.sort(key=lambda e: e.start_idx)
        return Bucket(self.flat[:tail + 4 * self.nrows], ones + fours)


def _by_shape(batch: list[_Slot]) -> list[_Slot]:
    """The batch's slots with those of one shape, dtype and device side by side, in order of
    first appearance (a trainer's per-expert ``gate``/``up``/``down`` weights alternate
    shapes; grouped, each shape is one run, one launch, where alternating they were a launch
    or two each)."""
    groups: dict[tuple, list[_Slot]] = {}
    for s in batch:
        groups.setdefault((tuple(s.x.shape), s.x.dtype, str(s.x.device)), []).append(s)
    return [s for g in groups.values() for s in g]


def _runs(batch: list[_Slot]) -> Iterator[list[_Slot]]:
    """The batch cut into runs: consecutive contiguous 2-D inputs of one shape, dtype and
    device whose data start on a 16-byte boundary (what the kernels read in place; at most
    :data:`RUN_BYTES` of input each); every other slot a run of its own."""
    run: list[_Slot] = []
    size = 0
    for s in batch:
        x = s.x
        nbytes = x.numel() * x.element_size()
        joins = readable_in_place(x)
        if run and (not joins or run[0].x.shape != x.shape or run[0].x.dtype != x.dtype
                    or run[0].x.device != x.device
                    or (RUN_BYTES is not None and size + nbytes > RUN_BYTES)):
            yield run
            run, size = [], 0
        run.append(s)
        size += nbytes
        if not joins:
            yield run
            run, size = [], 0
    if run:
        yield run


def _adjacent(xs: list[torch.Tensor]) -> bool:
    """Whether the contiguous inputs lie back to back, in order, in one storage (a trainer's
    per-expert views of one stacked parameter)."""
    x0 = xs[0]
    step = x0.numel() * x0.element_size()
    base = x0.untyped_storage().data_ptr()
    return all(x.is_contiguous() and x.untyped_storage().data_ptr() == base
               and x.data_ptr() == x0.data_ptr() + i * step for i, x in enumerate(xs))


def _stacked(xs: list[torch.Tensor]) -> torch.Tensor | Stacked:
    """The stack of a run's inputs: viewed when they lie back to back (:func:`_adjacent`),
    else a :class:`~libalign.sync.Stacked` source the kernels read in place."""
    if _adjacent(xs):
        x0 = xs[0]
        return x0.as_strided((len(xs), *x0.shape), (x0.numel(), *x0.stride()))
    return Stacked(tuple(xs))


def _weights(s: _Slot) -> list[tuple[str, int, int]]:
    """``(module weight name, first row, rows)`` of each weight a slot holds, rows counted
    over the slot's stacked ``[E * N]`` rows."""
    if s.x.ndim == 2:
        return [(s.name, 0, s.x.shape[0])]
    n = s.x.shape[1]
    out = []
    for weight, x, rows in stack_members(s.name, tuple(s.x.shape)):
        lo, hi = (rows.start, rows.stop) if rows is not None else (0, n)
        out.append((weight, x * n + lo, hi - lo))
    return out


def filled_buckets(named: Iterable[tuple[str, torch.Tensor]], spec: NumericsSpec | str, *,
                   bucket_bytes: int, all_linear: bool = False,
                   device: torch.device | str | None = None) -> Iterator[tuple[Bucket, bool]]:
    """The buckets of a refit under a :func:`fills` spec, each with whether it is the last:
    quantized tensors written in place (module doc), the others packed. Bits and names equal
    :func:`~alignd.sync.stream.quantize_named`'s; its checks and errors apply. A bucket is
    yielded as soon as it is closed and before the next is allocated, so a caller that keeps
    one bucket in flight holds two at most (one being filled)."""
    spec = resolve_spec(spec)
    if not fills(spec):
        raise InputError(f"preset {spec.name!r} keeps no decode scale per row; its buckets are "
                         "packed (alignd.sync.stream)")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InputError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    select = make_select(all_linear)
    raw: list[tuple[str, torch.Tensor]] = []
    raw_bytes = 0
    filler: _Filler | None = None

    def flush_filler(last: bool = False) -> Iterator[tuple[Bucket, bool]]:
        # yielded before the next bucket is allocated: with the one in flight, two at most
        nonlocal filler
        if filler is not None:
            closed, filler = filler.close(), None
            yield closed, last

    def flush_raw(last: bool = False) -> Iterator[tuple[Bucket, bool]]:
        nonlocal raw, raw_bytes
        if raw:
            items, raw, raw_bytes = raw, [], 0
            packed = [b for b, _ in ended_buckets(items, 1 << 62, device)]
            for i, b in enumerate(packed):
                yield b, last and i == len(packed) - 1

    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not select(name, t):
            n = t.numel() * t.element_size()
            if raw and raw_bytes + n > bucket_bytes:  # the filler goes first: the packed
                yield from flush_filler()            # bucket is then the only one built
                yield from flush_raw()
            raw.append((name, t))
            raw_bytes += n
            continue
        if not _fillable(name, t):  # the packing producer's checks and names, for this one
            for q_name, q in quantize_named([(name, t)], spec, bucket_bytes=bucket_bytes):
                raw.append((q_name, q))
                raw_bytes += q.numel() * q.element_size()
            continue
        dev = torch.device(device) if device is not None else t.device
        if filler is not None and (filler.device != dev or not filler.fits(t)):
            yield from flush_filler()  # not the last: t follows
        if filler is None:
            codes, scales, rows = _Filler.sizes(t)
            filler = _Filler(spec, max(bucket_bytes, codes + scales + 4 * rows), dev)
        filler.add(name, t.to(dev) if t.device != dev else t, bucket_bytes)
    yield from flush_filler(last=not raw)
    yield from flush_raw(last=True)


def _fillable(name: str, t: torch.Tensor) -> bool:
    """A floating 2-D ``<module>.weight`` or a named 3-D expert stack, with K a multiple of 64
    (so the 1-byte part of a bucket stays 4-byte aligned) and no fused-sibling sharing needed."""
    if not t.is_floating_point() or t.shape[-1] % 64:
        return False
    if t.ndim == 2:
        return name.endswith(".weight") and len(module_parts(name)) > 1
    if t.ndim == 3:
        try:
            stack_members(name, tuple(t.shape))
        except AlignError:
            return False
        return True
    return False
