"""The weight store: NVFP4 versions on disk, complete and checksummed, or absent.

Layout under the store root::

    published/<version_id>/   BF16 input the learner publishes (see alignd.formats.published)
    nvfp4/<version_id>/       what the converter writes, read by samplers:
        nvfp4-00001.safetensors ...   shards of at most ``shard_bytes`` each
        manifest.json                 what every tensor is, and its checksums
    sglang/modelopt/<version_id>/     ModelOpt NVFP4 exports for SGLang samplers (default place;
                                      alignd.formats.modelopt_export)

:meth:`WeightStore.discard` removes all of a version's directories (the retention pass
prunes with it).

Tensor names follow ModelOpt's NVFP4 checkpoints. A quantized tensor ``X`` (for a
linear layer ``X = "<layer>.weight"``) is stored as three tensors:

``X``            uint8 ``[..., K/2]`` packed E2M1 codes, low nibble = even element
``X_scale``      float8_e4m3fn ``[..., K/16]`` block scales, linear (not swizzled) layout
                 (MXFP4 specs: float8_e8m0fnu ``[..., K/32]``)
``X_scale_2``    float32 outer scale; unlike ModelOpt's scalar it has the shape of the
                 spec's outer domain (``[]`` tensor, ``[E]`` expert, ``[..., M]`` row) and
                 holds the spec's stored convention (``outer_convention``: ``dec`` is
                 amax / 2688, as in ModelOpt). Absent for outer domain ``none``.

Tensors the converter does not quantize (norms, embeddings, routers) are stored as they
came (``kind: raw``), so a version is a complete, loadable model.

``manifest.json`` records, per logical tensor: kind, logical shape, source dtype, the key
of its numerics spec in the ``specs`` table (full :meth:`NumericsSpec.to_dict`), the file
holding it, and for each stored tensor its role, dtype, shape, byte count and the SHA-256
of its bytes. Then totals, per-file sizes and the stage timings of the write (read,
quantize, write seconds). Readers check every stored tensor against it and raise
:class:`ChecksumMismatchError` naming the tensor.

Atomicity: a version is built in a hidden ``.tmp-*`` sibling, every shard fsynced as it
is written, then renamed into place (:mod:`libalign.atomic_dir`). A writer killed
at any moment leaves either the complete version or no version (plus a hidden leftover
that :meth:`WeightStore.sweep` removes); :meth:`WeightStore.list_versions` ignores
leftovers. Deletion renames the version away before removing its files.

Sharded versions (:mod:`alignd.formats.sharded_version`): an expert-parallel learner
writes one *part* per rank, each a complete mini-version in its own subdirectory
``part-00000-of-00004/``; one rename publishes them all. The merged manifest
(``format_version`` 2) names files by their path under the version directory
(``part-00001-of-00004/nvfp4-00001.safetensors``), and a tensor that several ranks hold
slices of (dim 0, experts ``[e0, e1)``) has one logical entry with its full shape and
``pieces``: ``[{"start", "stop", "file", "stored"}, ...]`` in row order. The reader
concatenates each piece's codes, block scales and outer scales along dim 0; an outer
scale that spans dim 0 (the ``tensor`` domain) is the same in every piece and is kept
once. So a reader gets the same :class:`NVFP4Tensor` bits from a sharded version as
from one written whole, and never needs to know how it was written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from alignclient.errors import (
    AlignError,
    ChecksumMismatchError,
    InputError,
    LayoutError,
    ManifestError,
    NonFiniteError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignclient.ids import check_version_id

from alignd.formats.hf_checkpoint import MANIFEST_NAME, items
from alignd.formats.selection import Select
from libalign.atomic_dir import (
    TMP_PREFIX,
    DestinationExistsError,
    atomic_directory,
    discard_directory,
    fsync_path,
    sweep_stale,
)
from libalign.kernels import ops
from libalign.spec import NumericsSpec, NVFP4Tensor

FORMAT = "libalign-nvfp4"
FORMAT_VERSION = 1
#: format_version of a sharded version's merged manifest (entries may carry ``pieces``)
SHARDED_FORMAT_VERSION = 2
DEFAULT_SHARD_BYTES = 1 << 30
SUFFIXES = {"codes": "", "block_scales": "_scale", "outer_scale": "_scale_2"}

Item = torch.Tensor | NVFP4Tensor


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order."""
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def named_error(e: AlignError, name: str) -> AlignError:
    """The same kind of error with the tensor's name in front; ``.tensor`` is set."""
    if isinstance(e, NonFiniteError):
        out: AlignError = NonFiniteError(f"tensor {name!r}", e.count, e.nan, e.inf, e.first_indices)
    else:
        try:
            out = type(e)(f"tensor {name!r}: {e}")
        except TypeError:  # a class with a richer constructor: keep the code via InputError
            out = InputError(f"tensor {name!r}: {e}")
    out.tensor = name  # type: ignore[attr-defined]
    return out


def manifest_totals(entries: Mapping[str, dict[str, Any]],
                    files: Mapping[str, dict[str, int]]) -> dict[str, int]:
    """The ``totals`` block of a manifest: tensor counts by kind, source and stored bytes."""
    return {
        "tensors": len(entries),
        "nvfp4_tensors": sum(e["kind"] == "nvfp4" for e in entries.values()),
        "raw_tensors": sum(e["kind"] == "raw" for e in entries.values()),
        "source_bytes": sum(e["source_bytes"] or 0 for e in entries.values()),
        "stored_bytes": sum(f["bytes"] for f in files.values()),
        "files": len(files),
    }


class StageTimer:
    """Seconds spent per stage: ``read`` (waiting on the input), ``quantize``, ``write``."""

    def __init__(self) -> None:
        self.seconds = {"read": 0.0, "quantize": 0.0, "write": 0.0}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Add the block's wall time to ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def timed(self, it: Iterator[Any]) -> Iterator[Any]:
        """Yield from ``it``, charging the time each ``next`` takes to ``read``."""
        while True:
            with self.stage("read"):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item


@dataclass
class StoredVersion:
    """A version read back from the store: its manifest and its tensors."""

    version_id: str
    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, Item]

    def __getitem__(self, name: str) -> Item:
        return self.tensors[name]


def spec_key(spec: NumericsSpec, specs: dict[str, dict]) -> str:
    """Key of ``spec`` in the manifest's spec table (its name unless that is taken)."""
    d = spec.to_dict()
    if specs.get(spec.name, d) == d:
        specs[spec.name] = d
        return spec.name
    key = f"{spec.name}-{hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]}"
    specs[key] = d
    return key


def _stored_tensors(name: str, q: NVFP4Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """Stored name -> (role, tensor) of one quantized tensor."""
    out = {
        name + SUFFIXES["codes"]: ("codes", q.codes),
        name + SUFFIXES["block_scales"]: ("block_scales", q.block_scales),
    }
    if q.outer_scale is not None:
        out[name + SUFFIXES["outer_scale"]] = ("outer_scale", q.outer_scale.to(torch.float32))
    return {k: (role, t.detach().contiguous().cpu()) for k, (role, t) in out.items()}


def scalar_outer(spec: NumericsSpec, ndim: int) -> bool:
    """True if the spec's outer scale spans dim 0 (one value for all rows of a piece).

    That is the ``tensor`` domain, and the ``expert`` domain of a 2-D tensor (one
    expert). Pieces of such a tensor must be quantized with the whole tensor's amax.
    """
    return spec.outer_domain == "tensor" or (spec.outer_domain == "expert" and ndim == 2)


def _join_pieces(version_id: str, name: str, entry: dict[str, Any], manifest: dict[str, Any],
                 parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Role -> tensor of a pieced entry: dim-0 concatenation in piece order.

    A scalar outer scale (see :func:`scalar_outer`) is the same in every piece, since
    every piece was quantized with the whole tensor's amax; it is checked and kept once.
    """
    scalar = False
    if entry["kind"] == "nvfp4":
        scalar = scalar_outer(NumericsSpec.from_dict(manifest["specs"][entry["spec"]]),
                              len(entry["shape"]))
    out: dict[str, torch.Tensor] = {}
    for role in parts[0]:
        ts = [p[role] for p in parts]
        if role == "outer_scale" and scalar:
            if any(not torch.equal(t.view(torch.int32), ts[0].view(torch.int32)) for t in ts[1:]):
                raise ManifestError(f"weight version {version_id!r}: tensor {name!r} has pieces "
                                    f"with different {entry['spec']!r} outer scales")
            out[role] = ts[0]
        else:
            out[role] = torch.cat(ts, dim=0)
    return out


class WeightStore:
    """A weight store directory: published BF16 input and NVFP4 versions."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.published_root = self.root / "published"
        self.versions_root = self.root / "nvfp4"
        #: default root of the SGLang sampler's exports (``<preset>/<version_id>/`` below it)
        self.exports_root = self.root / "sglang"

    def published_path(self, version_id: str) -> Path:
        """Directory of a published BF16 version."""
        return self.published_root / check_version_id(version_id)

    def version_path(self, version_id: str) -> Path:
        """Directory of an NVFP4 version."""
        return self.versions_root / check_version_id(version_id)

    def has_version(self, version_id: str) -> bool:
        """True if a complete NVFP4 version with this id is in the store."""
        return (self.version_path(version_id) / MANIFEST_NAME).is_file()

    def list_versions(self) -> list[str]:
        """Ids of complete NVFP4 versions, sorted; temporary leftovers are not listed."""
        if not self.versions_root.is_dir():
            return []
        return sorted(p.name for p in self.versions_root.iterdir()
                      if not p.name.startswith(TMP_PREFIX) and (p / MANIFEST_NAME).is_file())

    def write_version(
        self,
        version_id: str,
        tensors: Mapping[str, Item] | Iterable[tuple[str, Item]],
        spec: NumericsSpec,
        *,
        select: Select | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        source: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        overwrite: bool = False,
        on_step: Callable[[str], None] | None = None,
        device: str = "cpu",
        outer_amax: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """Quantize and write a version atomically; return its manifest.

        ``device`` is where tensors are quantized (``cuda`` runs the GPU kernel; the
        stored bits are the same on every device). ``outer_amax`` gives some tensors the
        outer maximum to quantize with (fused siblings sharing one outer scale, see
        :func:`alignd.formats.convert.fused_outer_amax`).

        ``tensors`` yields ``(name, tensor)``: a float tensor for which ``select(name,
        tensor)`` is true (every tensor when ``select`` is None) is quantized with
        :func:`libalign.kernels.quantize` under ``spec``; other tensors are stored raw; an
        :class:`NVFP4Tensor` is stored as given. Errors of one tensor are re-raised with
        its name. ``on_step`` is called after each durable step (a shard, the manifest).
        """
        check_version_id(version_id)
        try:
            with atomic_directory(self.version_path(version_id), overwrite=overwrite) as tmp:
                manifest = self.write_into(
                    tmp, version_id, tensors,
                    lambda name, value, specs: self.prepare_entry(
                        name, value, spec, select, specs, device,
                        outer_amax=(outer_amax or {}).get(name)),
                    shard_bytes=shard_bytes, source=source, extra=extra, on_step=on_step)
        except DestinationExistsError as e:
            raise VersionExistsError(version_id, "weight store") from e
        return manifest

    def write_into(
        self,
        out: Path,
        version_id: str,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        prepare: Callable[[str, Any, dict[str, dict]],
                          tuple[dict[str, Any], dict[str, tuple[str, torch.Tensor]]]],
        *,
        shard_bytes: int,
        source: dict[str, Any] | None,
        extra: dict[str, Any] | None,
        on_step: Callable[[str], None] | None,
        fields: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write shards and ``manifest.json`` of ``tensors`` into the directory ``out``.

        ``prepare(name, value, specs)`` turns one input into its manifest entry (without
        file and checksums) and its stored tensors (see :meth:`prepare_entry`). Every file is
        fsynced as it is written; making ``out`` visible is the caller's business.
        ``fields`` are added to the manifest's top level.
        """
        pairs = items(tensors)
        timer = StageTimer()
        t_start = time.perf_counter()
        entries: dict[str, dict[str, Any]] = {}
        specs: dict[str, dict] = {}
        files: dict[str, dict[str, int]] = {}
        taken: set[str] = set()
        pending: dict[str, torch.Tensor] = {}
        owners: list[str] = []
        size = 0

        def flush() -> None:
            """Checksum, write and fsync the pending tensors as the next shard."""
            nonlocal pending, owners, size
            fname = f"nvfp4-{len(files) + 1:05d}.safetensors"
            with timer.stage("write"):
                for owner in owners:
                    entries[owner]["file"] = fname
                    for sn, meta in entries[owner]["stored"].items():
                        meta["sha256"] = tensor_sha256(pending[sn])
                safetensors.torch.save_file(pending, out / fname)
                fsync_path(out / fname)
            files[fname] = {"bytes": (out / fname).stat().st_size, "tensors": len(pending)}
            pending, owners, size = {}, [], 0
            if on_step is not None:
                on_step(f"shard {fname}")

        for name, value in timer.timed(pairs):
            if name in entries:
                raise InputError(f"tensor {name!r} appears twice in version {version_id!r}")
            with timer.stage("quantize"):
                entry, stored = prepare(name, value, specs)
            clash = taken.intersection(stored)
            if clash:
                raise LayoutError(f"tensor {name!r}: stored name(s) {sorted(clash)} "
                                  f"already used by another tensor")
            nb = sum(t.numel() * t.element_size() for _r, t in stored.values())
            if pending and size + nb > shard_bytes:
                flush()
            entry["stored"] = {sn: {"role": role, "dtype": dtype_name(t.dtype),
                                    "shape": list(t.shape),
                                    "bytes": t.numel() * t.element_size()}
                               for sn, (role, t) in stored.items()}
            entries[name] = entry
            taken.update(stored)
            pending.update({sn: t for sn, (_r, t) in stored.items()})
            owners.append(name)
            size += nb
        if pending or not files:
            flush()
        manifest = self._manifest(version_id, entries, specs, files, timer,
                                  time.perf_counter() - t_start, source, extra)
        manifest.update(fields or {})
        with timer.stage("write"):
            (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
            fsync_path(out / MANIFEST_NAME)
        if on_step is not None:
            on_step("manifest")
        return manifest

    def prepare_entry(self, name: str, value: Any, spec: NumericsSpec, select: Select | None,
                 specs: dict[str, dict], device: str = "cpu",
                 outer_amax: torch.Tensor | None = None,
                 ) -> tuple[dict[str, Any], dict[str, tuple[str, torch.Tensor]]]:
        """Manifest entry (without checksums) and stored tensors of one input tensor.

        ``outer_amax`` is passed to :func:`libalign.kernels.quantize` (a slice of a tensor
        quantized with the whole tensor's outer maximum, see sharded_version).
        """
        if isinstance(value, NVFP4Tensor):
            q, source_dtype = value, None
        elif isinstance(value, torch.Tensor):
            if select is not None and not select(name, value):
                t = value.detach().contiguous().cpu()
                entry = {"kind": "raw", "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                         "source_bytes": t.numel() * t.element_size()}
                return entry, {name: ("raw", t)}
            try:
                q = ops.quantize(value.to(device), spec, outer_amax=outer_amax).to("cpu")
            except AlignError as e:
                raise named_error(e, name) from e
            source_dtype = dtype_name(value.dtype)
        else:
            raise InputError(f"tensor {name!r} is a {type(value).__name__}, "
                             f"not a torch.Tensor or NVFP4Tensor")
        entry = {"kind": "nvfp4", "shape": list(q.shape), "dtype": source_dtype,
                 "spec": spec_key(q.spec, specs),
                 "source_bytes": (math.prod(q.shape) * value.element_size()
                                  if isinstance(value, torch.Tensor) else None)}
        return entry, _stored_tensors(name, q)

    @staticmethod
    def _manifest(version_id, entries, specs, files, timer, elapsed, source, extra) -> dict[str, Any]:
        """The manifest dict (checksums already filled in)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version_id": version_id,
            "created_at": time.time(),
            "naming": {role: f"<name>{suffix}" for role, suffix in SUFFIXES.items()},
            "specs": specs,
            "tensors": entries,
            "files": files,
            "totals": manifest_totals(entries, files),
            "timings": {**{f"{k}_s": round(v, 6) for k, v in timer.seconds.items()},
                        "total_s": round(elapsed, 6)},
            "source": source or {},
            "extra": extra or {},
        }

    def read_manifest(self, version_id: str) -> dict[str, Any]:
        """The version's manifest; VersionNotFoundError or ManifestError."""
        path = self.version_path(version_id)
        if not path.is_dir():
            raise VersionNotFoundError(version_id, "weight store")
        try:
            manifest = json.loads((path / MANIFEST_NAME).read_text())
        except (OSError, ValueError) as e:
            raise ManifestError(f"weight version {version_id!r}: manifest unreadable: {e}") from e
        if (manifest.get("format") != FORMAT or manifest.get("version_id") != version_id
                or manifest.get("format_version") not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION)):
            raise ManifestError(f"weight version {version_id!r}: manifest is not a {FORMAT} "
                                f"manifest of this version")
        return manifest

    def _load_file(self, version_id: str, path: Path, fname: str,
                   expected: dict[str, dict[str, Any]], verify: bool) -> dict[str, torch.Tensor]:
        """Load one shard and check names, dtypes, shapes and (if ``verify``) checksums."""
        try:
            loaded = safetensors.torch.load_file(path / fname)
        except FileNotFoundError as e:
            raise ManifestError(f"weight version {version_id!r}: file {fname} is missing") from e
        except Exception as e:  # safetensors raises its own error type for a bad header
            raise ManifestError(f"weight version {version_id!r}: file {fname} unreadable: {e}") from e
        missing, unexpected = set(expected) - set(loaded), set(loaded) - set(expected)
        if missing or unexpected:
            raise ManifestError(f"weight version {version_id!r}: {fname} lacks {sorted(missing)} "
                                f"and has unlisted {sorted(unexpected)}")
        for sn, meta in expected.items():
            t = loaded[sn]
            if dtype_name(t.dtype) != meta["dtype"] or list(t.shape) != meta["shape"]:
                raise ManifestError(f"weight version {version_id!r}: tensor {sn!r} is "
                                    f"{dtype_name(t.dtype)}{list(t.shape)}, the manifest says "
                                    f"{meta['dtype']}{meta['shape']}")
            if verify:
                actual = tensor_sha256(t)
                if actual != meta["sha256"]:
                    raise ChecksumMismatchError(version_id, sn, meta["sha256"], actual)
        return loaded

    @staticmethod
    def _by_file(manifest: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
        """File name -> stored name -> stored-tensor metadata (pieces included)."""
        out: dict[str, dict[str, dict[str, Any]]] = {f: {} for f in manifest["files"]}
        for name, entry in manifest["tensors"].items():
            for loc in entry.get("pieces") or [entry]:
                if loc.get("file") not in out:
                    raise ManifestError(f"tensor {name!r} names file {loc.get('file')!r}, which "
                                        f"the manifest does not list")
                clash = set(out[loc["file"]]).intersection(loc["stored"])
                if clash:
                    raise ManifestError(f"tensor {name!r}: stored name(s) {sorted(clash)} listed "
                                        f"twice in file {loc['file']}")
                out[loc["file"]].update(loc["stored"])
        return out

    def verify_version(self, version_id: str) -> dict[str, Any]:
        """Check every stored tensor against the manifest, one shard at a time; return it."""
        manifest = self.read_manifest(version_id)
        path = self.version_path(version_id)
        for fname, expected in self._by_file(manifest).items():
            self._load_file(version_id, path, fname, expected, verify=True)
        return manifest

    def read_version(self, version_id: str, *, verify: bool = True) -> StoredVersion:
        """Load a whole version (NVFP4Tensor or raw tensor per name), checksums verified."""
        manifest = self.read_manifest(version_id)
        path = self.version_path(version_id)
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for fname, expected in self._by_file(manifest).items():
            loaded[fname] = self._load_file(version_id, path, fname, expected, verify)
        tensors: dict[str, Item] = {}
        for name, entry in manifest["tensors"].items():
            if "pieces" in entry:
                parts = [self._roles(loaded[p["file"]], p["stored"]) for p in entry["pieces"]]
                roles = _join_pieces(version_id, name, entry, manifest, parts)
            else:
                roles = self._roles(loaded[entry["file"]], entry["stored"])
            if entry["kind"] == "raw":
                tensors[name] = roles["raw"]
                continue
            spec = NumericsSpec.from_dict(manifest["specs"][entry["spec"]])
            tensors[name] = NVFP4Tensor(roles["codes"], roles["block_scales"],
                                        roles.get("outer_scale"), spec, tuple(entry["shape"]))
        return StoredVersion(version_id, path, manifest, tensors)

    def iter_version(self, version_id: str) -> Iterator[tuple[str, Item]]:
        """The version's tensors one at a time, in manifest order, each stored tensor checked
        against the manifest (dtype, shape, SHA-256) as it is read: a reader that never holds
        more than one logical tensor (an exporter of a large version)."""
        manifest = self.read_manifest(version_id)
        path = self.version_path(version_id)
        self._by_file(manifest)  # every file an entry names is listed
        with contextlib.ExitStack() as stack:
            opened: dict[str, Any] = {}

            def roles(fname: str, stored: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
                if fname not in opened:
                    if not (path / fname).is_file():
                        raise ManifestError(f"weight version {version_id!r}: file {fname} is "
                                            "missing")
                    opened[fname] = stack.enter_context(
                        safetensors.safe_open(path / fname, framework="pt"))
                out = {}
                for sn, meta in stored.items():
                    t = opened[fname].get_tensor(sn)
                    if dtype_name(t.dtype) != meta["dtype"] or list(t.shape) != meta["shape"]:
                        raise ManifestError(f"weight version {version_id!r}: tensor {sn!r} is "
                                            f"{dtype_name(t.dtype)}{list(t.shape)}, the manifest "
                                            f"says {meta['dtype']}{meta['shape']}")
                    actual = tensor_sha256(t)
                    if actual != meta["sha256"]:
                        raise ChecksumMismatchError(version_id, sn, meta["sha256"], actual)
                    out[meta["role"]] = t
                return out

            for name, entry in manifest["tensors"].items():
                if "pieces" in entry:
                    parts = [roles(p["file"], p["stored"]) for p in entry["pieces"]]
                    got = _join_pieces(version_id, name, entry, manifest, parts)
                else:
                    got = roles(entry["file"], entry["stored"])
                if entry["kind"] == "raw":
                    yield name, got["raw"]
                    continue
                spec = NumericsSpec.from_dict(manifest["specs"][entry["spec"]])
                yield name, NVFP4Tensor(got["codes"], got["block_scales"], got.get("outer_scale"),
                                        spec, tuple(entry["shape"]))

    @staticmethod
    def _roles(loaded: dict[str, torch.Tensor], stored: dict[str, dict[str, Any]]
               ) -> dict[str, torch.Tensor]:
        """Role -> loaded tensor of one stored entry (a whole tensor or one piece)."""
        return {meta["role"]: loaded[sn] for sn, meta in stored.items()}

    def delete_version(self, version_id: str) -> None:
        """Remove a version: renamed out of sight first, then its files deleted."""
        path = self.version_path(version_id)
        if not path.is_dir() or not discard_directory(path):
            raise VersionNotFoundError(version_id, "weight store")

    def discard(self, version_id: str) -> list[Path]:
        """Remove every directory of a version the store holds: its published BF16 input, its
        NVFP4 version and its exports under :attr:`exports_root`, each renamed out of sight
        first (a crash mid-way leaves ``.tmp-*`` leftovers for :meth:`sweep`). Returns the
        paths removed; idempotent (what is already gone is skipped)."""
        paths = [self.published_path(version_id), self.version_path(version_id)]
        if self.exports_root.is_dir():
            paths += [d / version_id for d in sorted(self.exports_root.iterdir())
                      if d.is_dir() and not d.name.startswith(".")]  # not staging, leftovers
        return [p for p in paths if p.is_dir() and discard_directory(p)]

    def sweep(self, min_age_s: float = 600.0) -> list[Path]:
        """Remove temporary leftovers of killed writers older than ``min_age_s`` (of versions,
        published inputs and exports under :attr:`exports_root`)."""
        exports = (sorted(d for d in self.exports_root.iterdir()
                          if d.is_dir() and not d.name.startswith("."))
                   if self.exports_root.is_dir() else [])
        return [p for parent in [self.versions_root, self.published_root, *exports]
                for p in sweep_stale(parent, min_age_s)]
