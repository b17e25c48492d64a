"""The input side of the weight store: BF16 versions the learner publishes.

A published version is a directory ``<store>/published/<version_id>/`` laid out like a
Hugging Face checkpoint (:mod:`alignd.formats.hf_checkpoint`: safetensors shards and an
index), read back with :class:`~alignd.formats.hf_checkpoint.HFCheckpoint`. The learner
writes it through :func:`write_published`, which builds the directory under a temporary
name and renames it into place (:mod:`libalign.atomic_dir`), so a converter never
opens a half-written version. Registering the version and announcing it on the bus come
after the files, in :mod:`alignd.infra.publish`.

Tensors are written shard by shard from any iterable of ``(name, tensor)``, so the
learner never needs all its weights in one dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from alignclient.errors import VersionExistsError
from alignclient.ids import check_version_id

from alignd.formats.hf_checkpoint import Tensors, write_shards
from libalign.atomic_dir import DestinationExistsError, atomic_directory

DEFAULT_SHARD_BYTES = 2 << 30


def write_published(
    root: Path,
    version_id: str,
    tensors: Tensors,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``root/<version_id>/`` atomically as safetensors shards plus an index."""
    check_version_id(version_id)
    final = Path(root) / version_id
    try:
        with atomic_directory(final) as tmp:
            write_shards(tmp, tensors, shard_bytes=shard_bytes,
                         metadata={"version_id": version_id, **(metadata or {})},
                         what=f"version {version_id!r}")
    except DestinationExistsError as e:
        raise VersionExistsError(version_id, "published store") from e
    return final
