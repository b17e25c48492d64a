"""Sharded NVFP4 versions: each rank writes its part, one manifest publishes them all.

An expert-parallel learner holds a dim-0 slice of every expert stack (experts
``[e0, e1)`` of ``...experts.gate_up_proj [E, 2I, H]``). Each rank converts its own slice
and writes it as a *part* with :func:`write_part`; the version becomes visible to
readers only when every part is written, as one directory with one manifest.

Layout while parts arrive (hidden, so :meth:`WeightStore.list_versions` ignores it and
:meth:`WeightStore.sweep` removes it once it is stale)::

    nvfp4/.tmp-parts-<version_id>-of-<N>/
        part-00000-of-0000N/        a complete mini-version (shards + manifest.json),
            nvfp4-00001.safetensors   written with atomic_directory: present whole or absent
            manifest.json
        part-00001-of-0000N/
        .tmp-part-00001-of-0000N.*  a part being written (or left by a killed rank)

Commit (:func:`commit_version`, run by every rank after its part, lock-free): when all
``N`` part manifests exist, the merged manifest is built from them deterministically
(parts in order), written to ``manifest.json`` in the staging root (temporary file,
fsync, ``os.replace``), and the staging directory is renamed onto ``nvfp4/<version_id>``.
Two ranks finishing at once build the same manifest; one rename wins, the other finds
the staging directory gone and the version present, and returns its manifest.

The merged manifest (``format_version`` 2) lists files by their path under the version
directory (``part-00000-of-00002/nvfp4-00001.safetensors``). A tensor written whole by
one part keeps its usual entry. A tensor written as :class:`Piece` s has one logical
entry with the full shape and ``pieces``: ``[{start, stop, file, stored}, ...]`` tiling
``[0, total)`` along dim 0; readers concatenate codes, block scales and outer scales in
piece order.

Bits: under the ``row`` and ``expert`` (3-D) outer domains and ``none``, every dim-0 row
of a stack is quantized on its own, so the pieces are bit-identical to quantizing the
whole tensor. Under ``tensor`` (and ``expert`` of a 2-D tensor) one outer scale spans
dim 0: each piece must carry the whole tensor's amax (all-reduced across ranks), else
:func:`write_part` raises :class:`InputError`, since per-slice maxima would give other bits.

A rank killed mid-part leaves only a hidden ``.tmp-part-*`` directory; running it again
writes the part anew (a part that is already present raises
:class:`VersionExistsError`: parts are written once). The commit removes such leftovers
from the staging directory before it renames it into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from alignclient.errors import InputError, ManifestError, VersionExistsError
from alignclient.ids import check_version_id

from alignd.formats.hf_checkpoint import MANIFEST_NAME
from alignd.formats.manifest import (
    SHARDED_FORMAT_VERSION,
    FileEntry,
    Manifest,
    PartInfo,
    PartSummary,
    PieceRange,
    TensorEntry,
    TensorPiece,
    Timings,
    Totals,
    default_naming,
)
from alignd.formats.selection import Select
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, WeightStore, scalar_outer, spec_key
from libalign.atomic_dir import TMP_PREFIX, DestinationExistsError, atomic_directory, fsync_path
from libalign.spec import NumericsSpec, NVFP4Tensor

__all__ = [
    "PartResult",
    "Piece",
    "commit_version",
    "part_dir_name",
    "part_status",
    "staging_path",
    "write_part",
]


@dataclass(frozen=True)
class Piece:
    """A dim-0 slice [start, start + tensor.shape[0]) of a logical tensor whose dim 0 is `total`."""

    tensor: torch.Tensor
    start: int
    total: int
    outer_amax: torch.Tensor | None = None  # whole-tensor amax (fp32 scalar) for outer_domain 'tensor'


@dataclass
class PartResult:
    """What :func:`write_part` did: the part's manifest and whether the version is visible."""

    manifest: Manifest
    committed: bool
    seconds: float
    source_bytes: int
    stored_bytes: int
    #: the merged manifest when ``committed``
    version_manifest: Manifest | None = None


def _check_parts(version_id: str, num_parts: int, part: int | None = None) -> None:
    check_version_id(version_id)
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise InputError(f"version {version_id!r}: num_parts must be an int >= 1, got {num_parts!r}")
    if part is not None and (isinstance(part, bool) or not isinstance(part, int)
                             or not 0 <= part < num_parts):
        raise InputError(f"version {version_id!r}: part {part!r} is not in [0, {num_parts})")


def staging_path(store: WeightStore, version_id: str, num_parts: int) -> Path:
    """The hidden directory where the parts of a version gather before the commit."""
    _check_parts(version_id, num_parts)
    return store.versions_root / f"{TMP_PREFIX}parts-{version_id}-of-{num_parts}"


def part_dir_name(part: int, num_parts: int) -> str:
    """``part-00001-of-00004``: a part's directory, also the prefix of its files."""
    return f"part-{part:05d}-of-{num_parts:05d}"


def _check_piece(version_id: str, part: int, name: str, p: Piece) -> None:
    """Refuse a Piece whose slice does not fit its logical tensor."""
    where = f"version {version_id!r} part {part}: tensor {name!r}"
    if not isinstance(p.tensor, torch.Tensor) or p.tensor.ndim < 1:
        raise InputError(f"{where}: a Piece holds a torch.Tensor of at least 1 dimension")
    for attr in ("start", "total"):
        v = getattr(p, attr)
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{where}: Piece.{attr} must be an int, got {v!r}")
    n = p.tensor.shape[0]
    if n < 1 or p.start < 0 or p.start + n > p.total:
        raise InputError(f"{where}: Piece rows [{p.start}, {p.start + n}) do not fit in "
                         f"[0, {p.total}) or are empty")


def write_part(
    store: WeightStore,
    version_id: str,
    part: int,
    num_parts: int,
    tensors: Mapping[str, torch.Tensor | NVFP4Tensor | Piece] | Iterable[tuple[str, Any]],
    spec: NumericsSpec,
    *,
    select: Select | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: str = "cpu",
    on_step: Callable[[str], None] | None = None,
    source: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    commit: bool = True,
) -> PartResult:
    """Quantize and write part ``part`` of ``num_parts`` of a version; commit if it is the last.

    ``tensors`` is like :meth:`WeightStore.write_version`'s, and may also hold
    :class:`Piece` s (dim-0 slices). A part is written whole or not at all. A part that
    is already present, or a version already committed, raises
    :class:`VersionExistsError`. ``on_step`` gets ``shard <file>`` after each durable
    shard, ``manifest`` after the part's manifest and ``part`` once the part is in place.
    With ``commit`` (default) :func:`commit_version` runs after the part is written.
    """
    _check_parts(version_id, num_parts, part)
    if store.has_version(version_id):
        raise VersionExistsError(version_id, "weight store")
    staging = staging_path(store, version_id, num_parts)
    pdir = staging / part_dir_name(part, num_parts)
    if (pdir / MANIFEST_NAME).is_file():
        raise VersionExistsError(version_id, f"weight store (part {part} of {num_parts} is "
                                             f"already written)")
    t0 = time.perf_counter()

    def prepare(name: str, value: Any, specs: dict[str, dict]):
        if not isinstance(value, Piece):
            return store.prepare_entry(name, value, spec, select, specs, device)
        _check_piece(version_id, part, name, value)
        t = value.tensor
        if (t.is_floating_point() and (select is None or select(name, t))
                and scalar_outer(spec, t.ndim) and value.outer_amax is None):
            raise InputError(
                f"version {version_id!r} part {part}: tensor {name!r} is a Piece without "
                f"outer_amax, but spec {spec.name!r} ({spec.outer_domain} outer domain) has one "
                f"outer scale for the whole tensor; pass the whole tensor's amax")
        entry, stored = store.prepare_entry(name, t, spec, select, specs, device,
                                       outer_amax=value.outer_amax)
        piece = PieceRange(start=value.start, stop=value.start + t.shape[0], total=value.total)
        return replace(entry, piece=piece), stored

    def step(what: str) -> None:
        # keep the staging directory young while this part is written, so a sweep
        # (which looks at its mtime only) does not take it from under a slow rank
        with contextlib.suppress(FileNotFoundError):
            os.utime(staging)
        if on_step is not None:
            on_step(what)

    try:
        with atomic_directory(pdir) as tmp:
            manifest = store.write_into(
                tmp, version_id, tensors, prepare, shard_bytes=shard_bytes, source=source,
                extra=extra, on_step=step, part=PartInfo(index=part, num_parts=num_parts))
    except DestinationExistsError as e:
        raise VersionExistsError(version_id, f"weight store (part {part} of {num_parts} is "
                                             f"already written)") from e
    seconds = time.perf_counter() - t0
    if on_step is not None:
        on_step("part")
    merged = commit_version(store, version_id, num_parts) if commit else None
    return PartResult(manifest=manifest, committed=merged is not None, seconds=seconds,
                      source_bytes=manifest.totals.source_bytes,
                      stored_bytes=manifest.totals.stored_bytes, version_manifest=merged)


def _part_manifests(staging: Path, version_id: str, num_parts: int) -> list[Manifest] | None:
    """Every part's manifest in part order, or None while one is missing."""
    out = []
    for i in range(num_parts):
        try:
            raw = json.loads((staging / part_dir_name(i, num_parts) / MANIFEST_NAME).read_text())
        except FileNotFoundError:
            return None
        out.append(Manifest.from_dict(raw, where=f"sharded weight version {version_id!r} part {i}"))
    return out


def part_status(store: WeightStore, version_id: str, num_parts: int) -> dict[str, Any]:
    """Which parts are written: ``{"present": [...], "missing": [...], "committed": bool}``."""
    staging = staging_path(store, version_id, num_parts)
    if store.has_version(version_id):
        return {"present": list(range(num_parts)), "missing": [], "committed": True}
    present = [i for i in range(num_parts)
               if (staging / part_dir_name(i, num_parts) / MANIFEST_NAME).is_file()]
    committed = store.has_version(version_id)  # a commit may have happened meanwhile
    if committed:
        present = list(range(num_parts))
    return {"present": present, "missing": sorted(set(range(num_parts)) - set(present)),
            "committed": committed}


def commit_version(store: WeightStore, version_id: str, num_parts: int) -> Manifest | None:
    """Publish the version if every part is written; return its merged manifest.

    Returns the manifest when the version is (now, or already) visible and None while a
    part is missing. Lock-free and idempotent: concurrent callers build the same
    manifest and exactly one rename publishes it. Raises :class:`ManifestError` when the
    parts do not fit together (pieces that do not tile a tensor, a tensor in two parts).
    """
    staging = staging_path(store, version_id, num_parts)
    if store.has_version(version_id):
        return store.read_manifest(version_id)
    manifests = _part_manifests(staging, version_id, num_parts)
    if manifests is None:
        return store.read_manifest(version_id) if store.has_version(version_id) else None
    merged = merge_part_manifests(version_id, num_parts, manifests)
    final = store.version_path(version_id)
    tmp_name = f".manifest-{uuid.uuid4().hex[:12]}.tmp"
    try:
        # leftovers of killed part writers must not travel into the version
        for p in list(staging.iterdir()):
            if p.name.startswith(f"{TMP_PREFIX}part-"):
                shutil.rmtree(p, ignore_errors=True)
        with open(staging / tmp_name, "w") as f:
            f.write(json.dumps(merged.to_dict(), indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging / tmp_name, staging / MANIFEST_NAME)
        fsync_path(staging)
        os.rename(staging, final)
        fsync_path(final.parent)
    except OSError:
        # another rank renamed the staging directory first (ours may have been carried
        # along with our temporary file in it)
        for d in (staging, final):
            with contextlib.suppress(OSError):
                (d / tmp_name).unlink()
        if store.has_version(version_id):
            return store.read_manifest(version_id)
        raise
    return merged


def merge_part_manifests(version_id: str, num_parts: int,
                         manifests: list[Manifest]) -> Manifest:
    """The merged manifest of a sharded version from its parts' manifests (part order)."""
    specs: dict[str, dict] = {}
    files: dict[str, FileEntry] = {}
    tensors: dict[str, TensorEntry | None] = {}
    whole_part: dict[str, int] = {}
    pieces: dict[str, list[tuple[int, TensorEntry]]] = {}
    owner: dict[str, str] = {}  # stored name -> logical tensor
    where = f"sharded weight version {version_id!r}"
    for i, m in enumerate(manifests):
        if m.version_id != version_id or m.part != PartInfo(index=i, num_parts=num_parts):
            raise ManifestError(f"{where}: part {i} manifest is not part {i} of {num_parts} of "
                                f"this version")
        prefix = part_dir_name(i, num_parts)
        for fname, meta in m.files.items():
            files[f"{prefix}/{fname}"] = meta
        for name, e in m.tensors.items():
            e = replace(e, spec=None if e.spec is None else spec_key(m.spec(e.spec), specs),
                        file=f"{prefix}/{e.file}")
            for sn in e.stored:
                if owner.setdefault(sn, name) != name:
                    raise ManifestError(f"{where}: stored name {sn!r} of tensor {name!r} "
                                        f"(part {i}) is also used by tensor {owner[sn]!r}")
            if e.piece is None:
                if name in whole_part or name in pieces:
                    other = whole_part.get(name, pieces.get(name, [(None,)])[0][0])
                    raise ManifestError(f"{where}: tensor {name!r} is written by part {i} and "
                                        f"by part {other}")
                whole_part[name] = i
                tensors[name] = e
                continue
            if name in whole_part:
                raise ManifestError(f"{where}: tensor {name!r} is a whole tensor in part "
                                    f"{whole_part[name]} and a piece in part {i}")
            if name not in pieces:
                pieces[name] = []
                tensors[name] = None  # placeholder keeps first-appearance order
            pieces[name].append((i, e))
    for name, ps in pieces.items():
        tensors[name] = _merge_pieces(where, name, ps)
    merged = {name: e for name, e in tensors.items() if e is not None}
    source: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for m in manifests:
        source.update(m.source)
        extra.update(m.extra)
    return Manifest(
        format_version=SHARDED_FORMAT_VERSION,
        version_id=version_id,
        created_at=max(m.created_at for m in manifests),
        naming=default_naming(),
        num_parts=num_parts,
        specs=specs,
        tensors=merged,
        files=files,
        totals=Totals.of(merged, files),
        timings=Timings.sum([m.timings for m in manifests]),
        parts=tuple(PartSummary(part=i, created_at=m.created_at, timings=m.timings,
                                totals=m.totals, source=m.source, extra=m.extra)
                    for i, m in enumerate(manifests)),
        source=source,
        extra=extra,
    )


def _merge_pieces(where: str, name: str, ps: list[tuple[int, TensorEntry]]) -> TensorEntry:
    """One logical entry from a tensor's pieces; they must tile [0, total) exactly."""
    ps = sorted(ps, key=lambda ie: (ie[1].piece.start, ie[0]))  # type: ignore[union-attr]
    first = ps[0][1]
    assert first.piece is not None
    total = first.piece.total
    expect = 0
    for i, e in ps:
        pc = e.piece
        assert pc is not None
        if (e.kind, e.dtype, e.spec) != (first.kind, first.dtype, first.spec) \
                or e.shape[1:] != first.shape[1:] or pc.total != total:
            raise ManifestError(f"{where}: tensor {name!r}: the piece in part {i} differs from "
                                f"the others in kind, dtype, spec, trailing shape or total")
        if pc.start != expect:
            what = "gap" if pc.start > expect else "overlap"
            raise ManifestError(f"{where}: tensor {name!r}: pieces leave a {what} at row "
                                f"{min(expect, pc.start)} (part {i} starts at {pc.start}, "
                                f"rows before it end at {expect})")
        expect = pc.stop
    if expect != total:
        raise ManifestError(f"{where}: tensor {name!r}: pieces end at row {expect}, the tensor "
                            f"has {total}")
    src = [e.source_bytes for _i, e in ps]
    return TensorEntry(
        kind=first.kind,
        shape=(total, *first.shape[1:]),
        dtype=first.dtype,
        spec=first.spec,
        source_bytes=None if any(s is None for s in src) else sum(s or 0 for s in src),
        pieces=tuple(TensorPiece(start=e.piece.start, stop=e.piece.stop,  # type: ignore[union-attr]
                                 file=e.file or "", stored=e.stored) for _i, e in ps),
    )
