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

``manifest.json`` (:class:`~alignd.formats.manifest.Manifest`, its one home) records, per
logical tensor: kind, logical shape, source dtype, the key of its numerics spec in the
``specs`` table (full :meth:`NumericsSpec.to_dict`), the file holding it, and for each stored
tensor its role, dtype, shape, byte count and the SHA-256 of its bytes. Then totals, per-file
sizes and the stage timings of the write (read, quantize, write seconds). Readers check every
stored tensor against it and raise :class:`ChecksumMismatchError` naming the tensor.

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
from dataclasses import dataclass, replace
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
from alignd.formats.manifest import (
    FORMAT,
    FORMAT_VERSION,
    SHARDED_FORMAT_VERSION,
    SUFFIXES,
    FileEntry,
    Manifest,
    PartInfo,
    StoredTensor,
    TensorEntry,
    Timings,
    Totals,
    default_naming,
)
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

DEFAULT_SHARD_BYTES = 1 << 30

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
    manifest: Manifest
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


def _join_pieces(version_id: str, name: str, entry: TensorEntry, manifest: Manifest,
                 parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Role -> tensor of a pieced entry: dim-0 concatenation in piece order.

    A scalar outer scale (see :func:`scalar_outer`) is the same in every piece, since
    every piece was quantized with the whole tensor's amax; it is checked and kept once.
    """
    spec = manifest.spec_of(entry)
    scalar = spec is not None and scalar_outer(spec, len(entry.shape))
    out: dict[str, torch.Tensor] = {}
    for role in parts[0]:
        ts = [p[role] for p in parts]
        if role == "outer_scale" and scalar:
            if any(not torch.equal(t.view(torch.int32), ts[0].view(torch.int32)) for t in ts[1:]):
                raise ManifestError(f"weight version {version_id!r}: tensor {name!r} has pieces "
                                    f"with different {entry.spec!r} outer scales")
            out[role] = ts[0]
        else:
            out[role] = torch.cat(ts, dim=0)
    return out


def _item(version_id: str, name: str, entry: TensorEntry, manifest: Manifest,
          parts: list[dict[str, torch.Tensor]]) -> Item:
    """The tensor of one entry from the role -> tensor maps of its locations (one, or its pieces
    in row order): the raw tensor, or an NVFP4Tensor under the entry's spec."""
    got = _join_pieces(version_id, name, entry, manifest, parts) if entry.pieces is not None \
        else parts[0]
    if entry.kind == "raw":
        return got["raw"]
    return NVFP4Tensor(got["codes"], got["block_scales"], got.get("outer_scale"),
                       manifest.spec_of(entry), entry.shape)


def _check_stored(version_id: str, sn: str, t: torch.Tensor, meta: StoredTensor,
                  verify: bool) -> None:
    """A loaded stored tensor against its manifest record: dtype, shape, (``verify``) SHA-256."""
    if dtype_name(t.dtype) != meta.dtype or tuple(t.shape) != meta.shape:
        raise ManifestError(f"weight version {version_id!r}: tensor {sn!r} is "
                            f"{dtype_name(t.dtype)}{list(t.shape)}, the manifest says "
                            f"{meta.dtype}{list(meta.shape)}")
    if verify:
        actual = tensor_sha256(t)
        if actual != meta.sha256:
            raise ChecksumMismatchError(version_id, sn, meta.sha256, actual)


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
    ) -> Manifest:
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
                          tuple[TensorEntry, dict[str, tuple[str, torch.Tensor]]]],
        *,
        shard_bytes: int,
        source: dict[str, Any] | None,
        extra: dict[str, Any] | None,
        on_step: Callable[[str], None] | None,
        part: PartInfo | None = None,
    ) -> Manifest:
        """Write shards and ``manifest.json`` of ``tensors`` into the directory ``out``.

        ``prepare(name, value, specs)`` turns one input into its manifest entry (without
        file and stored tensors) and its stored tensors (see :meth:`prepare_entry`). Every
        file is fsynced as it is written; making ``out`` visible is the caller's business.
        ``part`` marks the manifest as that part's of a sharded version.
        """
        pairs = items(tensors)
        timer = StageTimer()
        t_start = time.perf_counter()
        entries: dict[str, TensorEntry] = {}
        specs: dict[str, dict] = {}
        files: dict[str, FileEntry] = {}
        taken: set[str] = set()
        pending: dict[str, torch.Tensor] = {}
        roles: dict[str, str] = {}  # stored name -> role, of the pending tensors
        owners: list[str] = []
        stored_names: dict[str, list[str]] = {}
        size = 0

        def flush() -> None:
            """Checksum, write and fsync the pending tensors as the next shard."""
            nonlocal pending, roles, owners, size
            fname = f"nvfp4-{len(files) + 1:05d}.safetensors"
            with timer.stage("write"):
                for owner in owners:
                    entries[owner] = replace(entries[owner], file=fname, stored={
                        sn: StoredTensor(role=roles[sn], dtype=dtype_name(pending[sn].dtype),
                                         shape=tuple(pending[sn].shape),
                                         bytes=pending[sn].numel() * pending[sn].element_size(),
                                         sha256=tensor_sha256(pending[sn]))
                        for sn in stored_names[owner]})
                safetensors.torch.save_file(pending, out / fname)
                fsync_path(out / fname)
            files[fname] = FileEntry(bytes=(out / fname).stat().st_size, tensors=len(pending))
            pending, roles, owners, size = {}, {}, [], 0
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
            entries[name] = entry
            stored_names[name] = list(stored)
            taken.update(stored)
            pending.update({sn: t for sn, (_r, t) in stored.items()})
            roles.update({sn: role for sn, (role, _t) in stored.items()})
            owners.append(name)
            size += nb
        if pending or not files:
            flush()
        manifest = self._manifest(version_id, entries, specs, files, timer,
                                  time.perf_counter() - t_start, source, extra, part)
        with timer.stage("write"):
            (out / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=1))
            fsync_path(out / MANIFEST_NAME)
        if on_step is not None:
            on_step("manifest")
        return manifest

    def prepare_entry(self, name: str, value: Any, spec: NumericsSpec, select: Select | None,
                 specs: dict[str, dict], device: str = "cpu",
                 outer_amax: torch.Tensor | None = None,
                 ) -> tuple[TensorEntry, dict[str, tuple[str, torch.Tensor]]]:
        """Manifest entry (without file and stored tensors) and stored tensors of one input.

        ``outer_amax`` is passed to :func:`libalign.kernels.quantize` (a slice of a tensor
        quantized with the whole tensor's outer maximum, see sharded_version).
        """
        if isinstance(value, NVFP4Tensor):
            q, source_dtype = value, None
        elif isinstance(value, torch.Tensor):
            if select is not None and not select(name, value):
                t = value.detach().contiguous().cpu()
                entry = TensorEntry(kind="raw", shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                                    source_bytes=t.numel() * t.element_size())
                return entry, {name: ("raw", t)}
            try:
                q = ops.quantize(value.to(device), spec, outer_amax=outer_amax).to("cpu")
            except AlignError as e:
                raise named_error(e, name) from e
            source_dtype = dtype_name(value.dtype)
        else:
            raise InputError(f"tensor {name!r} is a {type(value).__name__}, "
                             f"not a torch.Tensor or NVFP4Tensor")
        entry = TensorEntry(kind="nvfp4", shape=tuple(q.shape), dtype=source_dtype,
                            spec=spec_key(q.spec, specs),
                            source_bytes=(math.prod(q.shape) * value.element_size()
                                          if isinstance(value, torch.Tensor) else None))
        return entry, _stored_tensors(name, q)

    @staticmethod
    def _manifest(version_id: str, entries: dict[str, TensorEntry], specs: dict[str, dict],
                  files: dict[str, FileEntry], timer: StageTimer, elapsed: float,
                  source: dict[str, Any] | None, extra: dict[str, Any] | None,
                  part: PartInfo | None) -> Manifest:
        """The manifest of a write (checksums already filled in)."""
        s = timer.seconds
        return Manifest(
            format_version=FORMAT_VERSION,
            version_id=version_id,
            created_at=time.time(),
            naming=default_naming(),
            specs=specs,
            tensors=entries,
            files=files,
            totals=Totals.of(entries, files),
            timings=Timings(read_s=round(s["read"], 6), quantize_s=round(s["quantize"], 6),
                            write_s=round(s["write"], 6), total_s=round(elapsed, 6)),
            source=source or {},
            extra=extra or {},
            part=part,
        )

    def read_manifest(self, version_id: str) -> Manifest:
        """The version's manifest; VersionNotFoundError or ManifestError."""
        path = self.version_path(version_id)
        if not path.is_dir():
            raise VersionNotFoundError(version_id, "weight store")
        try:
            raw = json.loads((path / MANIFEST_NAME).read_text())
        except (OSError, ValueError) as e:
            raise ManifestError(f"weight version {version_id!r}: manifest unreadable: {e}") from e
        if (not isinstance(raw, dict) or raw.get("format") != FORMAT
                or raw.get("version_id") != version_id
                or raw.get("format_version") not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION)):
            raise ManifestError(f"weight version {version_id!r}: manifest is not a {FORMAT} "
                                f"manifest of this version")
        return Manifest.from_dict(raw, where=f"weight version {version_id!r}")

    def _load_file(self, version_id: str, path: Path, fname: str,
                   expected: Mapping[str, StoredTensor], verify: bool) -> dict[str, torch.Tensor]:
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
            _check_stored(version_id, sn, loaded[sn], meta, verify)
        return loaded

    @staticmethod
    def _by_file(manifest: Manifest) -> dict[str, dict[str, StoredTensor]]:
        """File name -> stored name -> stored-tensor metadata (pieces included)."""
        out: dict[str, dict[str, StoredTensor]] = {f: {} for f in manifest.files}
        for name, entry in manifest.tensors.items():
            for fname, stored in entry.locations():
                if fname not in out:
                    raise ManifestError(f"tensor {name!r} names file {fname!r}, which "
                                        f"the manifest does not list", field=f"tensors[{name!r}]")
                clash = set(out[fname]).intersection(stored)
                if clash:
                    raise ManifestError(f"tensor {name!r}: stored name(s) {sorted(clash)} listed "
                                        f"twice in file {fname}", field=f"tensors[{name!r}]")
                out[fname].update(stored)
        return out

    def verify_version(self, version_id: str) -> Manifest:
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
        for name, entry in manifest.tensors.items():
            parts = [self._roles(loaded[fname], stored) for fname, stored in entry.locations()]
            tensors[name] = _item(version_id, name, entry, manifest, parts)
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

            def roles(fname: str, stored: Mapping[str, StoredTensor]) -> dict[str, torch.Tensor]:
                if fname not in opened:
                    if not (path / fname).is_file():
                        raise ManifestError(f"weight version {version_id!r}: file {fname} is "
                                            "missing")
                    opened[fname] = stack.enter_context(
                        safetensors.safe_open(path / fname, framework="pt"))
                out = {}
                for sn, meta in stored.items():
                    t = opened[fname].get_tensor(sn)
                    _check_stored(version_id, sn, t, meta, verify=True)
                    out[meta.role] = t
                return out

            for name, entry in manifest.tensors.items():
                parts = [roles(fname, stored) for fname, stored in entry.locations()]
                yield name, _item(version_id, name, entry, manifest, parts)

    @staticmethod
    def _roles(loaded: dict[str, torch.Tensor], stored: Mapping[str, StoredTensor]
               ) -> dict[str, torch.Tensor]:
        """Role -> loaded tensor of one stored entry (a whole tensor or one piece)."""
        return {meta.role: loaded[sn] for sn, meta in stored.items()}

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
