"""The input side of the weight store: BF16 versions the learner publishes.

A published version is a directory ``<store>/published/<version_id>/`` laid out like a
Hugging Face checkpoint (:mod:`alignd.formats.hf_checkpoint`: safetensors shards and an
index), read back with :class:`~alignd.formats.hf_checkpoint.HFCheckpoint`. The learner
writes it through :func:`write_published`, which builds the directory under a temporary
name and renames it into place (:mod:`libalign.atomic_dir`), so a converter never
opens a half-written version. Registering the version and announcing it on the bus come
after the files, in :mod:`alignd.sync.bf16`.

Tensors are written shard by shard from any iterable of ``(name, tensor)``, so the
learner never needs all its weights in one dict.

Publishing again. A published directory is written once and never changed, so it has an
identity: a random ``publish_id`` written into its index when it is made
(:func:`publish_id`). The API records it with the version it registers from the directory,
and a second registration of the same id from the same directory answers that version
instead of a conflict: a publish whose answer was lost may simply be sent again. A writer
that finds the directory already there (its own earlier attempt) asks
:func:`differs_from` whether it holds the very tensors it would write: if so it registers
that directory, otherwise the id is taken by other weights.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from alignclient.errors import VersionExistsError
from alignclient.ids import check_version_id
from safetensors import safe_open

from alignd.formats.hf_checkpoint import HFCheckpoint, Tensors, items, write_shards
from libalign.atomic_dir import DestinationExistsError, atomic_directory

DEFAULT_SHARD_BYTES = 2 << 30
#: Index metadata key of a published directory's identity (see the module doc).
PUBLISH_ID_KEY = "publish_id"


def write_published(
    root: Path,
    version_id: str,
    tensors: Tensors,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``root/<version_id>/`` atomically as safetensors shards plus an index (with a
    fresh :data:`PUBLISH_ID_KEY`); VersionExistsError, with nothing read from ``tensors``,
    if the directory is already there."""
    check_version_id(version_id)
    final = Path(root) / version_id
    try:
        with atomic_directory(final) as tmp:
            write_shards(tmp, tensors, shard_bytes=shard_bytes,
                         metadata={"version_id": version_id, **(metadata or {}),
                                   PUBLISH_ID_KEY: uuid.uuid4().hex},
                         what=f"version {version_id!r}")
    except DestinationExistsError as e:
        raise VersionExistsError(version_id, "published store") from e
    return final


def publish_id(path: Path | str) -> str | None:
    """The identity written into a published directory's index (None if it has none)."""
    value = HFCheckpoint(path).metadata.get(PUBLISH_ID_KEY)
    return str(value) if value else None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 CPU tensor (NaN payloads and -0.0 compare as bytes)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differs_from(path: Path | str, tensors: Tensors) -> str | None:
    """How the published directory ``path`` differs from ``tensors`` (names, dtypes, shapes and
    bytes), or None when it holds exactly them. Reads one stored tensor at a time."""
    ckpt = HFCheckpoint(path)
    ckpt.check_shards()
    stored = dict(ckpt.weight_map)
    handles: dict[str, object] = {}
    try:
        for name, t in items(tensors):
            shard = stored.pop(name, None)
            if shard is None:
                return f"tensor {name!r} is not in {path}"
            if not isinstance(t, torch.Tensor):
                return f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor"
            if shard not in handles:
                handles[shard] = safe_open(Path(path) / shard, framework="pt")
            old = handles[shard].get_tensor(name)  # type: ignore[attr-defined]
            if old.dtype != t.dtype or old.shape != t.shape:
                return (f"tensor {name!r} is {tuple(old.shape)} {old.dtype} in {path}, "
                        f"{tuple(t.shape)} {t.dtype} now")
            if not torch.equal(_raw(old), _raw(t)):
                return f"tensor {name!r} holds other values than in {path}"
    finally:
        handles.clear()
    if stored:
        return f"{path} holds {len(stored)} more tensor(s), first {sorted(stored)[0]!r}"
    return None
