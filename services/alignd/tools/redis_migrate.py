"""Copy a daemon's keys from one Redis to another, into the target's key layout.

Earlier releases (and every single server or Sentinel-managed master) name keys
``<key_prefix>:...``. On a Redis Cluster the prefix carries a hash tag (``{libalign}``, see
:mod:`alignd.infra.keyspace`), so the same data lives under ``{libalign}:...``. A cluster
cannot read the untagged names (they hash all over the slots, and the daemon's transactions
would span them), so moving to a cluster is a copy with new names: :func:`migrate` reads
every key under the source prefix with ``SCAN``, ``DUMP``\\ s it and ``RESTORE``\\ s it under
the target prefix with its remaining TTL (``PTTL``): the registry and its history, the
streams with their consumer groups and pending entries, rollouts, heartbeats and guidance.

Guidance keys keep their layout only for one guidance shard (``<prefix>:guidance:...``
becomes ``{prefix}:guidance:...``): run the cluster with ``ALIGN_GUIDANCE_SHARDS=1`` to keep
serving the copied guidance, or leave guidance out (``skip_guidance``; records are per step
and expire anyway) and let the cluster's shards fill anew. Stop the daemon's writers first:
a key written during the copy may be missed. The source is never changed; a key that
already exists on the target is left alone and counted (``RESTORE`` without ``REPLACE``).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis


@dataclass
class Migration:
    """What a migration copied, skipped (existing on the target) and left out (guidance)."""

    copied: int = 0
    existing: int = 0
    left_out: int = 0


def migrate(source: redis.Redis, target: redis.Redis, source_prefix: str, target_prefix: str,
            *, skip_guidance: bool = False, batch: int = 500) -> Migration:
    """Copy every key under ``source_prefix`` on ``source`` to ``target_prefix`` on ``target``
    (binary clients, ``decode_responses=False``)."""
    src, dst = source_prefix.encode(), target_prefix.encode()
    guidance = src + b":guidance:"
    done = Migration()
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in source_prefix) + ":*"
    for key in source.scan_iter(match=pattern, count=batch):
        if not key.startswith(src + b":"):
            continue
        if skip_guidance and key.startswith(guidance):
            done.left_out += 1
            continue
        with source.pipeline(transaction=False) as pipe:
            pipe.dump(key)
            pipe.pttl(key)
            blob, ttl = pipe.execute()
        if blob is None or ttl == -2:  # gone meanwhile (expired)
            continue
        try:
            target.restore(dst + key[len(src):], max(0, ttl), blob)
            done.copied += 1
        except redis.exceptions.ResponseError as e:
            if "BUSYKEY" not in str(e):
                raise
            done.existing += 1
    return done
