"""The BF16 transport for the converter: the learner's weights as a published directory.

The learner's BF16 weights are written as a published version
(:func:`alignd.formats.published.write_published`, atomic), then the version is created in the
registry and a ``published`` event carrying its id and path goes on the stream
(:func:`alignd.sync.announce.announce_published`, one transaction), in that order, so
whoever sees the event finds everything it names. The converter takes it from there.
"""

from __future__ import annotations

from pathlib import Path

from alignd.formats.hf_checkpoint import Tensors
from alignd.formats.published import DEFAULT_SHARD_BYTES, write_published
from alignd.infra.bus import RedisBus
from alignd.infra.events import PublishedEvent
from alignd.infra.registry import Registry
from alignd.sync.announce import announce_published


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
    return announce_published(registry, stream, path, version_id, target_path=target_path,
                              actor=actor).event
