"""The manifest of a weight-store version (``manifest.json``), typed.

A converted version in the weight store (:mod:`alignd.formats.weight_store`) carries one
manifest: what every tensor is and the checksums of its bytes. This module is its one
home: the format constants, the typed :class:`Manifest` (frozen dataclasses all the way
down) and the translation to and from the JSON dict that is the file.

The file (``format`` ``libalign-nvfp4``) holds, in this order::

    format, format_version   "libalign-nvfp4", 1 (whole) or 2 (sharded, merged)
    version_id, created_at   the version and the time.time() of the write
    naming                   role -> stored name pattern ("codes": "<name>", ...)
    num_parts                (merged sharded manifests only) how many parts
    specs                    spec key -> NumericsSpec.to_dict()
    tensors                  logical name -> entry (below), in write order
    files                    file name -> {"bytes", "tensors"}
    totals                   tensors, nvfp4_tensors, raw_tensors, source_bytes,
                             stored_bytes, files
    timings                  read_s, quantize_s, write_s, total_s
    parts                    (merged) per part: part, created_at, timings, totals,
                             source, extra
    source, extra            free-form dicts the writer passes
    part                     (a part's own manifest) {"index", "num_parts"}

A tensor entry: ``kind`` (``nvfp4`` or ``raw``), logical ``shape``, source ``dtype`` (None
for an NVFP4Tensor written as given), ``spec`` (a key of ``specs``; nvfp4 only),
``source_bytes`` (None when unknown), then either ``stored`` + ``file`` (stored name ->
role, dtype, shape, bytes, sha256; the shard holding them) or, in a merged manifest, a
tensor several parts hold slices of, ``pieces`` (start, stop, file, stored each, in row
order). An entry of a part's manifest that is such a slice also has ``piece`` (start,
stop, total).

:meth:`Manifest.to_dict` writes exactly the dict the writers always wrote (same keys, same
order), so ``json.dumps(Manifest.from_dict(d).to_dict()) == json.dumps(d)`` for every
manifest on disk. :meth:`Manifest.from_dict` checks every field it reads and raises
:class:`ManifestError` whose ``field`` names the first one that is missing or of the wrong
type (``tensors['w'].stored['w_scale'].sha256``). Keys it does not know are ignored, as
the readers before it did.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from alignclient.errors import ManifestError

from libalign.spec import NumericsSpec

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SHARDED_FORMAT_VERSION",
    "SUFFIXES",
    "FileEntry",
    "Manifest",
    "PartInfo",
    "PartSummary",
    "PieceRange",
    "StoredTensor",
    "TensorEntry",
    "TensorPiece",
    "Timings",
    "Totals",
    "default_naming",
]

FORMAT = "libalign-nvfp4"
FORMAT_VERSION = 1
#: format_version of a sharded version's merged manifest (entries may carry ``pieces``)
SHARDED_FORMAT_VERSION = 2
#: role -> suffix of its stored tensor's name
SUFFIXES = {"codes": "", "block_scales": "_scale", "outer_scale": "_scale_2"}
KINDS = ("nvfp4", "raw")


def default_naming() -> dict[str, str]:
    """The ``naming`` block: role -> stored-name pattern."""
    return {role: f"<name>{suffix}" for role, suffix in SUFFIXES.items()}


# --- reading checked fields -------------------------------------------------------------------


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an int", float: "a float", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


class _Fields:
    """Typed reads of a manifest's JSON, each failure a ManifestError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: manifest field {path} {what}", field=path)

    def check(self, v: Any, path: str, kind: type | tuple[type, ...], *,
              nullable: bool = False) -> Any:
        """``v`` checked against ``kind`` (int never accepts a bool)."""
        if v is None and nullable:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            want = _type_name(kinds + ((type(None),) if nullable else ()))
            raise self.fail(path, f"is {type(v).__name__} {v!r:.40}, not {want}")
        return v

    def get(self, d: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...],
            *, nullable: bool = False, required: bool = True) -> Any:
        """``d[key]`` checked against ``kind``; None when absent and not ``required``."""
        if key not in d:
            if required:
                raise self.fail(path, "is missing")
            return None
        return self.check(d[key], path, kind, nullable=nullable)

    def obj(self, d: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
        """``d[key]``, which must be an object."""
        return self.get(d, key, path, dict)

    def shape(self, d: Mapping[str, Any], path: str) -> tuple[int, ...]:
        dims = self.get(d, "shape", f"{path}.shape", list)
        for i, n in enumerate(dims):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise self.fail(f"{path}.shape[{i}]", f"is {n!r}, not a size")
        return tuple(dims)

    def number(self, d: Mapping[str, Any], key: str, path: str) -> int | float:
        return self.get(d, key, path, (int, float))


# --- the parts of a manifest ------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored in a shard: its role, dtype, shape, size and checksum."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "dtype": self.dtype, "shape": list(self.shape),
                "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def _read(cls, f: _Fields, d: Mapping[str, Any], path: str) -> StoredTensor:
        return cls(role=f.get(d, "role", f"{path}.role", str),
                   dtype=f.get(d, "dtype", f"{path}.dtype", str),
                   shape=f.shape(d, path),
                   bytes=f.get(d, "bytes", f"{path}.bytes", int),
                   sha256=f.get(d, "sha256", f"{path}.sha256", str))


def _read_stored(f: _Fields, d: Mapping[str, Any], path: str) -> dict[str, StoredTensor]:
    stored = f.obj(d, "stored", f"{path}.stored")
    return {sn: StoredTensor._read(f, f.obj(stored, sn, f"{path}.stored[{sn!r}]"),
                                   f"{path}.stored[{sn!r}]")
            for sn in stored}


@dataclass(frozen=True)
class PieceRange:
    """Rows ``[start, stop)`` of a logical tensor of ``total`` rows (a part's slice)."""

    start: int
    stop: int
    total: int

    def to_dict(self) -> dict[str, int]:
        return {"start": self.start, "stop": self.stop, "total": self.total}


@dataclass(frozen=True)
class TensorPiece:
    """Rows ``[start, stop)`` of a merged tensor: the file and stored tensors holding them."""

    start: int
    stop: int
    file: str
    stored: Mapping[str, StoredTensor]

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "stop": self.stop, "file": self.file,
                "stored": {sn: m.to_dict() for sn, m in self.stored.items()}}


@dataclass(frozen=True)
class TensorEntry:
    """One logical tensor: what it is and where its stored tensors are.

    ``file`` and ``stored`` are unset (None, empty) while a writer is still placing it, and
    for a merged tensor held in ``pieces``.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str | None
    source_bytes: int | None
    spec: str | None = None
    piece: PieceRange | None = None
    stored: Mapping[str, StoredTensor] = field(default_factory=dict)
    file: str | None = None
    pieces: tuple[TensorPiece, ...] | None = None

    def locations(self) -> list[tuple[str, Mapping[str, StoredTensor]]]:
        """``(file, stored)`` of every place the tensor's bytes are: its pieces in row order,
        or the one file of a whole tensor."""
        if self.pieces is not None:
            return [(p.file, p.stored) for p in self.pieces]
        return [(self.file or "", self.stored)]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype}
        if self.spec is not None:
            d["spec"] = self.spec
        d["source_bytes"] = self.source_bytes
        if self.piece is not None:
            d["piece"] = self.piece.to_dict()
        if self.pieces is None:
            d["stored"] = {sn: m.to_dict() for sn, m in self.stored.items()}
            d["file"] = self.file
        else:
            d["pieces"] = [p.to_dict() for p in self.pieces]
        return d

    @classmethod
    def _read(cls, f: _Fields, d: Mapping[str, Any], path: str,
              specs: Mapping[str, Any]) -> TensorEntry:
        kind = f.get(d, "kind", f"{path}.kind", str)
        if kind not in KINDS:
            raise f.fail(f"{path}.kind", f"is {kind!r}, not one of {list(KINDS)}")
        spec = f.get(d, "spec", f"{path}.spec", str, nullable=True, required=kind == "nvfp4")
        if spec is not None and spec not in specs:
            raise f.fail(f"{path}.spec", f"names spec {spec!r}, which specs does not hold")
        piece = None
        pd = f.get(d, "piece", f"{path}.piece", dict, required=False)
        if pd is not None:
            piece = PieceRange(*(f.get(pd, k, f"{path}.piece.{k}", int)
                                 for k in ("start", "stop", "total")))
        common = dict(kind=kind, shape=f.shape(d, path),
                      dtype=f.get(d, "dtype", f"{path}.dtype", str, nullable=True),
                      source_bytes=f.get(d, "source_bytes", f"{path}.source_bytes", int,
                                         nullable=True),
                      spec=spec, piece=piece)
        if "pieces" not in d:
            return cls(**common, stored=_read_stored(f, d, path),
                       file=f.get(d, "file", f"{path}.file", str))
        listed = f.get(d, "pieces", f"{path}.pieces", list)
        if not listed:
            raise f.fail(f"{path}.pieces", "is empty")
        pieces = []
        for i, p in enumerate(listed):
            pp = f"{path}.pieces[{i}]"
            f.check(p, pp, dict)
            pieces.append(TensorPiece(start=f.get(p, "start", f"{pp}.start", int),
                                      stop=f.get(p, "stop", f"{pp}.stop", int),
                                      file=f.get(p, "file", f"{pp}.file", str),
                                      stored=_read_stored(f, p, pp)))
        return cls(**common, pieces=tuple(pieces))


@dataclass(frozen=True)
class FileEntry:
    """One shard file: its size and how many stored tensors it holds."""

    bytes: int
    tensors: int

    def to_dict(self) -> dict[str, int]:
        return {"bytes": self.bytes, "tensors": self.tensors}


@dataclass(frozen=True)
class Totals:
    """Tensor counts by kind, source and stored bytes, file count."""

    tensors: int
    nvfp4_tensors: int
    raw_tensors: int
    source_bytes: int
    stored_bytes: int
    files: int

    @classmethod
    def of(cls, entries: Mapping[str, TensorEntry], files: Mapping[str, FileEntry]) -> Totals:
        """The totals of these entries and files (plain and sharded manifests alike)."""
        return cls(tensors=len(entries),
                   nvfp4_tensors=sum(e.kind == "nvfp4" for e in entries.values()),
                   raw_tensors=sum(e.kind == "raw" for e in entries.values()),
                   source_bytes=sum(e.source_bytes or 0 for e in entries.values()),
                   stored_bytes=sum(f.bytes for f in files.values()),
                   files=len(files))

    def to_dict(self) -> dict[str, int]:
        return {"tensors": self.tensors, "nvfp4_tensors": self.nvfp4_tensors,
                "raw_tensors": self.raw_tensors, "source_bytes": self.source_bytes,
                "stored_bytes": self.stored_bytes, "files": self.files}

    @classmethod
    def _read(cls, f: _Fields, d: Mapping[str, Any], path: str) -> Totals:
        return cls(*(f.get(d, k, f"{path}.{k}", int) for k in (
            "tensors", "nvfp4_tensors", "raw_tensors", "source_bytes", "stored_bytes", "files")))


@dataclass(frozen=True)
class Timings:
    """Seconds of a write by stage (waiting on the input, quantizing, writing) and in all."""

    read_s: float
    quantize_s: float
    write_s: float
    total_s: float

    @classmethod
    def sum(cls, timings: list[Timings]) -> Timings:
        """Stage by stage sums (the parts of a sharded version), rounded to microseconds."""
        return cls(*(round(sum(getattr(t, k) for t in timings), 6)
                     for k in ("read_s", "quantize_s", "write_s", "total_s")))

    def to_dict(self) -> dict[str, float]:
        return {"read_s": self.read_s, "quantize_s": self.quantize_s, "write_s": self.write_s,
                "total_s": self.total_s}

    @classmethod
    def _read(cls, f: _Fields, d: Mapping[str, Any], path: str) -> Timings:
        return cls(*(f.number(d, k, f"{path}.{k}")
                     for k in ("read_s", "quantize_s", "write_s", "total_s")))


@dataclass(frozen=True)
class PartInfo:
    """Which part of a sharded version a part's own manifest describes."""

    index: int
    num_parts: int

    def to_dict(self) -> dict[str, int]:
        return {"index": self.index, "num_parts": self.num_parts}


@dataclass(frozen=True)
class PartSummary:
    """What a merged manifest keeps of one part's manifest."""

    part: int
    created_at: float
    timings: Timings
    totals: Totals
    source: Mapping[str, Any]
    extra: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"part": self.part, "created_at": self.created_at,
                "timings": self.timings.to_dict(), "totals": self.totals.to_dict(),
                "source": copy.deepcopy(dict(self.source)),
                "extra": copy.deepcopy(dict(self.extra))}

    @classmethod
    def _read(cls, f: _Fields, d: Mapping[str, Any], path: str) -> PartSummary:
        return cls(part=f.get(d, "part", f"{path}.part", int),
                   created_at=f.number(d, "created_at", f"{path}.created_at"),
                   timings=Timings._read(f, f.obj(d, "timings", f"{path}.timings"),
                                         f"{path}.timings"),
                   totals=Totals._read(f, f.obj(d, "totals", f"{path}.totals"),
                                       f"{path}.totals"),
                   source=copy.deepcopy(f.obj(d, "source", f"{path}.source")),
                   extra=copy.deepcopy(f.obj(d, "extra", f"{path}.extra")))


# --- the manifest -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A weight-store version's manifest. :meth:`from_dict` / :meth:`to_dict` are the file."""

    version_id: str
    format_version: int
    created_at: float
    specs: Mapping[str, dict[str, Any]]
    tensors: Mapping[str, TensorEntry]
    files: Mapping[str, FileEntry]
    totals: Totals
    timings: Timings
    source: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    naming: Mapping[str, str] = field(default_factory=default_naming)
    #: merged sharded manifests: how many parts, and what each part's manifest said
    num_parts: int | None = None
    parts: tuple[PartSummary, ...] | None = None
    #: a part's own manifest: which part it is
    part: PartInfo | None = None
    format: str = FORMAT

    def spec(self, key: str) -> NumericsSpec:
        """The numerics spec stored under ``key`` in :attr:`specs`."""
        if key not in self.specs:
            raise ManifestError(f"weight version {self.version_id!r}: manifest field "
                                f"specs[{key!r}] is missing", field=f"specs[{key!r}]")
        return NumericsSpec.from_dict(self.specs[key])

    def spec_of(self, entry: TensorEntry) -> NumericsSpec | None:
        """The numerics spec of an entry: None for a raw tensor, that of its ``spec`` key for
        an nvfp4 one."""
        if entry.kind == "raw":
            return None
        if entry.spec is None:
            raise ManifestError(f"weight version {self.version_id!r}: an nvfp4 tensor entry has "
                                f"no spec", field="tensors[].spec")
        return self.spec(entry.spec)

    def to_dict(self) -> dict[str, Any]:
        """The JSON dict of ``manifest.json``: the keys and order the writers always used."""
        d: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            "version_id": self.version_id,
            "created_at": self.created_at,
            "naming": dict(self.naming),
        }
        if self.num_parts is not None:
            d["num_parts"] = self.num_parts
        d.update({
            "specs": copy.deepcopy(dict(self.specs)),
            "tensors": {n: e.to_dict() for n, e in self.tensors.items()},
            "files": {n: f.to_dict() for n, f in self.files.items()},
            "totals": self.totals.to_dict(),
            "timings": self.timings.to_dict(),
        })
        if self.parts is not None:
            d["parts"] = [p.to_dict() for p in self.parts]
        d["source"] = copy.deepcopy(dict(self.source))
        d["extra"] = copy.deepcopy(dict(self.extra))
        if self.part is not None:
            d["part"] = self.part.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "weight version") -> Manifest:
        """The manifest of a parsed ``manifest.json``; ManifestError (with ``field``) naming the
        first field that is missing or of the wrong type. ``where`` starts its message."""
        f = _Fields(where)
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: manifest is a {type(d).__name__}, not an object")
        fmt = f.get(d, "format", "format", str)
        if fmt != FORMAT:
            raise f.fail("format", f"is {fmt!r}, not {FORMAT!r}")
        specs = f.obj(d, "specs", "specs")
        for key in specs:
            f.obj(specs, key, f"specs[{key!r}]")
        tensors = f.obj(d, "tensors", "tensors")
        files = f.obj(d, "files", "files")
        part = f.get(d, "part", "part", dict, required=False)
        parts = f.get(d, "parts", "parts", list, required=False)
        return cls(
            format=fmt,
            format_version=f.get(d, "format_version", "format_version", int),
            version_id=f.get(d, "version_id", "version_id", str),
            created_at=f.number(d, "created_at", "created_at"),
            naming=dict(f.obj(d, "naming", "naming")),
            num_parts=f.get(d, "num_parts", "num_parts", int, required=False),
            specs=copy.deepcopy(specs),
            tensors={n: TensorEntry._read(f, f.obj(tensors, n, f"tensors[{n!r}]"),
                                          f"tensors[{n!r}]", specs)
                     for n in tensors},
            files={n: FileEntry(f.get(fd, "bytes", f"files[{n!r}].bytes", int),
                                f.get(fd, "tensors", f"files[{n!r}].tensors", int))
                   for n in files for fd in [f.obj(files, n, f"files[{n!r}]")]},
            totals=Totals._read(f, f.obj(d, "totals", "totals"), "totals"),
            timings=Timings._read(f, f.obj(d, "timings", "timings"), "timings"),
            parts=None if parts is None else tuple(
                PartSummary._read(f, f.check(p, f"parts[{i}]", dict), f"parts[{i}]")
                for i, p in enumerate(parts)),
            source=copy.deepcopy(f.obj(d, "source", "source")),
            extra=copy.deepcopy(f.obj(d, "extra", "extra")),
            part=None if part is None else PartInfo(
                f.get(part, "index", "part.index", int),
                f.get(part, "num_parts", "part.num_parts", int)),
        )
