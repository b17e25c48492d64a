"""Guidance records spread over shards: many guidance stores, one slot each, one face.

On a Redis Cluster one guidance store would live in one slot, on one master, and hold no
more than that master's memory. :class:`ShardedGuidanceStore` keeps ``shards`` complete
:class:`~alignd.infra.stores.guidance.GuidanceStore`\\ s side by side, each under a prefix
with a hash tag of its own (:func:`alignd.infra.keyspace.shard_prefix`), so the cluster
spreads them over its masters. A version lives whole in one shard
(:func:`~alignd.infra.keyspace.shard_of`, crc32 of its id): its records, meta, leases and
accounting are in one slot, and every put, read, eviction and expiry is the single-slot
script it is on one server, atomic as before.

The budget is kept per shard and in total: each shard may hold ``budget_bytes // shards``
payload bytes and evicts its own oldest versions to stay within that; the shards together
therefore never hold more than ``budget_bytes``. The price: eviction is oldest-first within
a shard, not across the store (a put may evict a version of its shard while an older one
lives in another), and one version may hold at most one shard's part of the budget (a
larger put is refused with :class:`~alignclient.errors.GuidanceBudgetError`). Choose
``guidance_shards`` a few times the number of masters and the budget at least ``shards``
times the largest version.

Every method takes and answers what ``GuidanceStore``'s does; the ones about one version go to
its shard, :meth:`versions`, :meth:`total_bytes` and :meth:`stats` ask every shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import redis

from alignd.infra.keyspace import shard_of

if TYPE_CHECKING:  # the stores are made by GuidanceStore.from_settings, which imports this
    from alignd.infra.stores.guidance import GuidanceStore, PutResult, VersionInfo


class ShardedGuidanceStore:
    """Guidance stores, shard ``i`` of ``len(stores)`` at index ``i``; a version in exactly one
    (built by ``GuidanceStore.from_settings`` when ``guidance_shards`` is above 1)."""

    def __init__(self, stores: Sequence[GuidanceStore], *, budget_bytes: int | None,
                 client: redis.Redis, own_client: bool = False):
        """``budget_bytes``: the whole budget (each store holds its part); ``own_client``:
        close ``client`` with the store."""
        self.budget_bytes = budget_bytes
        self.shard_budget = stores[0].budget_bytes
        self.stores = list(stores)
        self.client, self._own_client = client, own_client
        #: Each shard's payload bytes as last seen: the stored-bytes gauge shows their sum.
        self._totals = [0] * len(self.stores)

    def _stored(self, shard: int, total: int) -> None:
        self._totals[shard] = total
        metrics = self.stores[0].metrics
        if metrics is not None:
            metrics.guidance_stored_bytes.set(sum(self._totals))

    def shard(self, version: str) -> GuidanceStore:
        """The store that holds ``version``."""
        return self.stores[shard_of(version, len(self.stores))]

    def __getattr__(self, name: str) -> Any:
        """Settings every shard shares (``ttl_s``, ``chunk_bytes``, ``payload_path``, ...)."""
        if name.startswith("_") or name == "stores":
            raise AttributeError(name)
        return getattr(self.stores[0], name)

    # --- one version: its shard -------------------------------------------------------

    def put(self, version: str, rollout_id: str, blob: bytes | bytearray | memoryview) -> PutResult:
        return self.put_many(version, {rollout_id: blob})

    def put_many(self, version: str,
                 records: Mapping[str, bytes | bytearray | memoryview]) -> PutResult:
        """As ``GuidanceStore.put_many``; ``total_bytes`` of the result is the shard's."""
        i = shard_of(version, len(self.stores))
        result = self.stores[i].put_many(version, records)
        self._stored(i, result.total_bytes)
        return result

    def get(self, version: str, rollout_id: str) -> bytes:
        return self.shard(version).get(version, rollout_id)

    def get_many(self, version: str, rollout_ids: Iterable[str], *,
                 missing: Literal["raise", "skip"] = "raise") -> dict[str, bytes]:
        return self.shard(version).get_many(version, rollout_ids, missing=missing)

    def rollouts(self, version: str) -> list[str]:
        return self.shard(version).rollouts(version)

    def acquire(self, version: str, consumer: str, ttl_s: float) -> None:
        self.shard(version).acquire(version, consumer, ttl_s)

    def release(self, version: str, consumer: str) -> bool:
        return self.shard(version).release(version, consumer)

    def delete_version(self, version: str) -> bool:
        return self.shard(version).delete_version(version)

    # --- every shard ------------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Every shard's versions, oldest first put first (by the time of their first put)."""
        return sorted((v for s in self.stores for v in s.versions()), key=lambda v: v.created)

    def total_bytes(self) -> int:
        for i, s in enumerate(self.stores):
            self._stored(i, s.total_bytes())
        return sum(self._totals)

    def stats(self) -> dict[str, Any]:
        """``GuidanceStore.stats`` over all shards, with ``shards`` and ``shard_budget_bytes``."""
        vs = self.versions()
        total = sum(v.bytes for v in vs)
        out = self.stores[0].stats() | {
            "versions": len(vs), "rollouts": sum(v.rollouts for v in vs), "stored_bytes": total,
            "budget_bytes": self.budget_bytes,
            "budget_used_ratio": None if self.budget_bytes is None else total / self.budget_bytes,
            "leased_versions": [v.version for v in vs if v.leased_by],
            "oldest_version": vs[0].version if vs else None,
            "shards": len(self.stores), "shard_budget_bytes": self.shard_budget}
        self._totals = [0] * len(self.stores)
        self._stored(0, total)
        return out

    def close(self) -> None:
        for s in self.stores:
            s.close()
        if self._own_client:
            self.client.close()

    def __enter__(self) -> ShardedGuidanceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
