"""Publishing a version: files first, then the registry, then the event.

The learner's BF16 weights are written as a published version
(:func:`alignd.formats.published.write_published`, atomic), the version is created in the
registry, and a ``published`` event carrying its id and path goes on the stream, in that
order, so whoever sees the event finds everything it names.
"""

from __future__ import annotations

from pathlib import Path

from alignd.formats.hf_checkpoint import Tensors
from alignd.formats.published import DEFAULT_SHARD_BYTES, write_published
from alignd.infra.bus import RedisBus
from alignd.infra.events import PublishedEvent
from alignd.infra.registry import Registry


def publish_version(
    published_root: Path,
    registry: Registry,
    bus: RedisBus,
    stream: str,
    version_id: str,
    tensors: Tensors,
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
