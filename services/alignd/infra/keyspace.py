"""Where the daemon's keys live on a Redis Cluster: hash tags, the control slot, shards.

A Redis Cluster splits the keyspace into 16,384 slots spread over its masters; a key's slot
is the CRC16 of its name, or of the part between the first ``{`` and the next ``}`` when the
name has such a *hash tag*. A transaction (``MULTI``/``EXEC``) or a script may only touch
keys of one slot, because one master runs it. The daemon's atomic writes touch several keys
(the registry's record, its history, the version index and the event stream in one
``MULTI``; the guidance store's accounting and a version's records in one script), so on a
cluster the keys each of them touches must share a tag. Two placements do that:

* **The control slot.** Every key and stream named under ``key_prefix`` (the registry,
  every event stream and its consumer groups, heartbeats, rollouts, the probe of the
  start-up check) lives in the slot of the prefix itself: on a cluster the prefix carries a
  hash tag, ``{libalign}`` for the default ``libalign`` (:func:`tagged_prefix`; a prefix
  that already has one, say ``{team-a}:align``, is kept as it is). So a version's record,
  its history and its events share a slot, with the index and the streams that a
  transaction writes beside them. This is small, hot metadata; one master holds it, and
  its replica takes over when it fails.
* **Guidance shards.** Guidance records, the bulk of the data (gigabytes per step), are
  spread over ``guidance_shards`` shards (:func:`shard_prefix`), each a complete guidance
  store of its own in a slot of its own (``{libalign:guidance:3}``), so that the shards
  land on different masters. A version's records, its meta, its leases and its share of
  the accounting all sit in its shard (:func:`shard_of`), so every guidance script still
  touches one slot; see :mod:`alignd.infra.stores.guidance_shards` for the budget.

On a single server or a Sentinel-managed master nothing changes: the prefix has no tag
unless the operator gave it one, and keys are named exactly as earlier releases named them.
Moving a single server's data to a cluster is ``alignd redis-migrate`` (it renames keys
into the tagged layout; see :mod:`alignd.tools.redis_migrate`).
"""

from __future__ import annotations

import zlib

#: URL schemes of a Redis Cluster (TLS with ``rediss``).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: URL schemes of a Sentinel-managed master.
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


def url_scheme(url: str | None) -> str:
    """The scheme of a Redis URL (``""`` for None: the embedded server)."""
    return "" if url is None or "://" not in url else url.split("://", 1)[0].lower()


def is_cluster_url(url: str | None) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url_scheme(url) in CLUSTER_SCHEMES


def hash_tag(key: str) -> str | None:
    """The hash tag of ``key`` as Redis finds it (the text inside the first ``{...}``, when
    not empty), or None: the whole name is hashed."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1:end]


def tagged_prefix(prefix: str) -> str:
    """``prefix`` with a hash tag: unchanged if it has one, else ``{prefix}``."""
    return prefix if hash_tag(prefix) is not None else "{" + prefix + "}"


def untagged(prefix: str) -> str:
    """``prefix`` without the braces of its hash tag (``{libalign}`` -> ``libalign``)."""
    tag = hash_tag(prefix)
    return prefix if tag is None else prefix.replace("{" + tag + "}", tag, 1)


def shard_prefix(prefix: str, shard: int, shards: int) -> str:
    """The key prefix of guidance shard ``shard`` of ``shards``: ``<prefix>:guidance`` for a
    single shard (the layout of earlier releases), else ``{<prefix>:guidance:<shard>}``,
    a slot of its own (``prefix`` is named without its braces)."""
    if shards == 1:
        return f"{prefix}:guidance"
    return "{" + f"{untagged(prefix)}:guidance:{shard}" + "}"


def shard_of(version: str, shards: int) -> int:
    """The guidance shard that holds ``version``'s records: crc32 of its id, mod ``shards``
    (stable across processes and releases, unlike Python's ``hash``)."""
    return zlib.crc32(version.encode()) % shards
