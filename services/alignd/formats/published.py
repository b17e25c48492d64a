"""The input side of the weight store: BF16 versions the learner publishes.

A published version is a directory ``<store>/published/<version_id>/`` laid out like a
Hugging Face checkpoint: safetensors shards ``model-00001-of-0000N.safetensors`` and an
index ``model.safetensors.index.json`` whose ``weight_map`` says which shard holds each
tensor (a lone ``model.safetensors`` without index is read too). The learner writes it
through :func:`write_published`, which builds the directory under a temporary name and
renames it into place (:mod:`alignd.formats.atomic_dir`), so a converter never opens a
half-written version. :func:`publish_version` then registers the version and puts a
``published`` event carrying its id and path on the stream: files first, then the
registry, then the event, so whoever sees the event finds everything it names.

Tensors are written shard by shard from any iterable of ``(name, tensor)``, so the
learner never needs all its weights in one dict; reading is shard by shard as well.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from alignclient.errors import InputError, LayoutError, MissingShardError, VersionExistsError
from safetensors import safe_open

from alignd.formats.atomic_dir import DestinationExistsError, atomic_directory
from alignd.infra.events import PublishedEvent, check_version_id

if TYPE_CHECKING:
    from alignd.infra.bus import RedisBus
    from alignd.infra.registry import Registry

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 << 30


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def _items(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    """(name, tensor) pairs from a mapping or an iterable of pairs."""
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


def write_published(
    root: Path,
    version_id: str,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``root/<version_id>/`` atomically as safetensors shards plus an index."""
    check_version_id(version_id)
    final = Path(root) / version_id
    weight_map: dict[str, str] = {}
    total = 0
    try:
        with atomic_directory(final) as tmp:
            parts: list[str] = []
            shard: dict[str, torch.Tensor] = {}
            size = 0

            def flush() -> None:
                """Write the pending tensors as the next part file."""
                nonlocal shard, size
                part = f"part-{len(parts):05d}.safetensors"
                safetensors.torch.save_file(shard, tmp / part)
                for n in shard:
                    weight_map[n] = part
                parts.append(part)
                shard, size = {}, 0

            for name, t in _items(tensors):
                if not isinstance(t, torch.Tensor):
                    raise InputError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
                if name in weight_map or name in shard:
                    raise InputError(f"tensor {name!r} appears twice in version {version_id!r}")
                nb = tensor_nbytes(t)
                if shard and size + nb > shard_bytes:
                    flush()
                shard[name] = t.detach().contiguous().cpu()
                size += nb
                total += nb
            if shard or not parts:
                flush()
            names = {p: f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
                     for i, p in enumerate(parts)}
            for p, n in names.items():
                os.rename(tmp / p, tmp / n)
            index = {
                "metadata": {"total_size": total, "version_id": version_id, **(metadata or {})},
                "weight_map": {k: names[v] for k, v in sorted(weight_map.items())},
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1))
    except DestinationExistsError as e:
        raise VersionExistsError(version_id, "published store") from e
    return final


class PublishedVersion:
    """Read access to one published BF16 version directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise LayoutError(f"published version directory {self.path} does not exist")
        index_file = self.path / INDEX_NAME
        if index_file.exists():
            try:
                index = json.loads(index_file.read_text())
                self.weight_map: dict[str, str] = dict(index["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise LayoutError(f"{index_file}: not a safetensors index ({e})") from e
            self.metadata = dict(index.get("metadata", {}))
        elif (self.path / SINGLE_NAME).exists():
            with safe_open(self.path / SINGLE_NAME, framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}  # noqa: SIM118
            self.metadata = {}
        else:
            raise LayoutError(f"{self.path}: neither {INDEX_NAME} nor {SINGLE_NAME}")
        for shard in set(self.weight_map.values()):  # a shard is a file of this directory
            if (not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard
                    or "\\" in shard or "\x00" in shard):
                raise LayoutError(f"{index_file}: shard {str(shard)[:200]!r} is not a file name "
                                  f"inside {self.path}")

    def shards(self) -> dict[str, list[str]]:
        """Shard file name -> tensor names it holds, in file order."""
        out: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            out.setdefault(shard, []).append(name)
        return dict(sorted(out.items()))

    def check_shards(self) -> None:
        """Raise MissingShardError for the first shard the index names but the disk lacks."""
        for shard, names in self.shards().items():
            if not (self.path / shard).is_file():
                raise MissingShardError(shard, names, str(self.path))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as (name, tensor), one shard at a time."""
        self.check_shards()
        for shard, names in self.shards().items():
            try:
                f = safe_open(self.path / shard, framework="pt")
            except Exception as e:  # safetensors' own error type: truncated or foreign file
                raise LayoutError(f"shard {shard!r} of {self.path} is unreadable: {e}") from e
            with f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise LayoutError(f"tensor {name!r}: the index puts it in {shard}, "
                                          f"which does not hold it")
                    yield name, f.get_tensor(name)

    @property
    def total_bytes(self) -> int:
        """Total tensor bytes the shards hold (from the shard files' sizes if unknown)."""
        if "total_size" in self.metadata:
            return int(self.metadata["total_size"])
        return sum((self.path / s).stat().st_size for s in self.shards())


def publish_version(
    published_root: Path,
    registry: Registry,
    bus: RedisBus,
    stream: str,
    version_id: str,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    actor: str = "learner",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    target_path: str | None = None,
) -> PublishedEvent:
    """Learner side: write the BF16 version, register it, then announce it on ``stream``.

    ``target_path`` names the sampler execution path the version is converted for.
    """
    path = write_published(published_root, version_id, tensors, shard_bytes=shard_bytes)
    event = PublishedEvent(version_id=version_id, path=str(path), target_path=target_path)
    registry.create_and_announce(version_id, str(path), stream, event.to_fields(), actor=actor,
                                 meta={"target_path": target_path} if target_path else None)
    return event
