"""The guidance store: rollout guidance records in Redis, under a byte budget and a TTL.

The sampler writes one opaque record (bytes, typically 10 KB to 100 MB) per rollout of a
weight version; the learner reads them back later. The store never parses a record: it
keeps it whole, checks it on every read, and bounds what all versions hold together.

Three modules share the work:

* this one, the store API: what a put, a read, a lease and an eviction mean, and the
  typed errors a caller gets;
* :mod:`~alignd.infra.stores.guidance_scripts`: the key layout (the stored format) and the
  Lua scripts that keep the accounting exact;
* :mod:`~alignd.infra.stores.guidance_wire`: how the bytes move (chunks, the put
  transaction, checked reads) through redis-py's public API.

A put is atomic. :meth:`GuidanceStore.put_many` writes the records of one version in one
``MULTI``/``EXEC``: the chunks of a new generation, then the commit script, which reads
the old metas, checks the budget, evicts, removes the replaced generations' chunks and
writes the new metas. A reader sees all the old records or all the new ones; a writer
that dies before ``EXEC`` leaves nothing (see ``guidance_wire`` for why). A read gets the
metas in one round trip and the chunks in a second; a record replaced in between is read
again. Every record carries the crc32 and length of the whole, checked on every read
(:class:`GuidanceChecksumError`).

Budget and eviction. ``P:total`` counts payload bytes (not Redis' own overhead). When a
put would take it over ``budget_bytes``, whole versions are evicted, oldest first put
first, never the version being written: first those no consumer holds a lease on
(:meth:`GuidanceStore.acquire`; a lease is a key with a TTL, so a crashed learner's lease
runs out by itself). If that is not enough, ``on_in_use="evict"`` evicts leased versions
too, oldest first, loudly: a warning in the log, the eviction counted with
``in_use="true"``, and a tombstone that says "evicted while in use by <consumers>", which
a reader receives as :class:`GuidanceEvictedError`. ``on_in_use="refuse"`` refuses the
put instead (:class:`GuidanceBudgetError`) and evicts and writes nothing. A version
larger than the whole budget is always refused.

TTL. With ``ttl_s`` every key of a version expires at one moment, ``ttl_s`` after the
version's first put (later puts to it share that deadline). Every script first drops
versions whose keys are gone from the accounting and leaves a tombstone, so a reader learns
why its version is gone: "expired" when its deadline had passed, "lost" when its keys
vanished before it (or had no TTL): a Redis that evicts under ``maxmemory``, or a delete
outside the store. Lost versions are logged as errors; ``libalign_guidance_vanished_total``
counts each version once by cause. A record gone while its version is still stored is
reported the same way (:class:`GuidanceEvictedError` saying "lost", an error in the log,
``libalign_guidance_lost_records_total``). The start-up check
(:mod:`alignd.infra.redis_checks`) refuses an evicting Redis, so "lost" means something is
wrong with the server or with who else writes to it. ``clock`` (epoch seconds) replaces the
server's clock in the scripts, for tests that move time.

Payload path. ``"socket"`` (a real Redis) streams chunks on connections of the store's
own and overlaps checksums with the transfer; ``"pipeline"`` (the embedded in-process
server, ``services/alignd/infra/redis_clients.py``, and a Redis Cluster, whose client routes
each transaction to the master of its slot) sends the same commands as redis-py
pipelines. ``"auto"`` picks by the client.

Shards. One store is one shard: every key it names starts with one prefix, so on a Redis
Cluster all of them share a slot (see :mod:`alignd.infra.keyspace`). ``shard``/``shards``
name which shard of how many this store is (its keys' prefix, :func:`~alignd.infra.keyspace.
shard_prefix`); :mod:`~alignd.infra.stores.guidance_shards` spreads versions over many, and
:meth:`GuidanceStore.from_settings` builds that when ``guidance_shards`` is above 1.
Durability: with ``wait_replicas`` a put returns after ``WAIT`` on its shard's master
(:meth:`alignd.infra.bus.RedisBus.confirm`). Same keys, scripts, checks and errors either way.
Every Redis call is retried on connection errors by the project's one retry policy
(:class:`alignclient.retry.RetryPolicy`, through :meth:`RedisBus.call`); a put retried
after a lost connection writes a fresh generation, so it never meets its own chunks.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple

import redis
from alignclient.errors import (
    ConfigError,
    GuidanceBudgetError,
    GuidanceEvictedError,
    GuidanceNotFoundError,
    InputError,
    PayloadTooLargeError,
)
from alignclient.ids import check_id, check_rollout_id, check_version_id
from alignclient.retry import RetryPolicy

from alignd.infra.bus import RedisBus
from alignd.infra.keyspace import shard_prefix
from alignd.infra.redis_clients import (
    BINARY_TIMEOUT_S,
    binary_client,
    client_for,
    decodes,
    payload_pool,
    topology,
)
from alignd.infra.settings import GuidanceStoreSettings
from alignd.infra.stores.guidance_scripts import GuidanceKeys, source
from alignd.infra.stores.guidance_shards import ShardedGuidanceStore
from alignd.infra.stores.guidance_wire import Command, Meta, PayloadWire, chunk_count
from alignd.infra.telemetry import Metrics

log = logging.getLogger(__name__)

#: Redis refuses bulk strings above 512 MiB (``proto-max-bulk-len``).
MAX_CHUNK_BYTES = 512 << 20
_TOMBSTONE_TTL_S = 86_400

#: The commit script. It is sent as EVAL inside each put's MULTI (a script loaded by
#: SCRIPT LOAD could be gone after a restart, and a NOSCRIPT inside EXEC cannot be retried).
_COMMIT_LUA = source("commit")
#: The scripts run on their own, through redis-py's Script (EVALSHA, loaded on demand).
_SCRIPTS = ("reconcile", "delete", "acquire", "release", "list")


class VersionInfo(NamedTuple):
    """One stored version: id, payload bytes, rollouts, first put (epoch s), lessees."""

    version: str
    bytes: int
    rollouts: int
    created: float
    leased_by: tuple[str, ...]


@dataclass(frozen=True)
class Eviction:
    """A version evicted to make room; ``in_use_by`` lists its lessees at the time."""

    version: str
    bytes: int
    in_use_by: tuple[str, ...]


@dataclass(frozen=True)
class PutResult:
    """What one put wrote, the store's total afterwards and what it evicted."""

    version: str
    rollouts: int
    bytes: int
    total_bytes: int
    evicted: tuple[Eviction, ...]


def _as_view(blob: object, what: str) -> memoryview:
    """A flat byte view of ``blob`` (bytes, bytearray or contiguous memoryview)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise InputError(f"{what} must be bytes, bytearray or memoryview, not "
                         f"{type(blob).__name__}")
    mv = memoryview(blob)
    if not mv.c_contiguous:
        raise InputError(f"{what} must be a contiguous buffer")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.nbytes == 0:
        raise InputError(f"{what} is empty")
    return mv


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _names(reply: bytes) -> tuple[str, ...]:
    """A comma-joined list of names from a script's reply."""
    return tuple(w for w in reply.decode().split(",") if w)


def store_options(settings: GuidanceStoreSettings) -> dict[str, Any]:
    """The keyword arguments of :class:`GuidanceStore` that ``settings`` decide."""
    return {"prefix": settings.key_prefix, "budget_bytes": settings.guidance_budget_bytes,
            "ttl_s": settings.guidance_ttl_s, "chunk_bytes": settings.guidance_chunk_bytes,
            "max_record_bytes": settings.guidance_max_record_bytes,
            "on_in_use": settings.guidance_on_in_use,
            "retry": RetryPolicy(deadline_s=settings.redis_retry_s),
            "wait_replicas": settings.redis_wait_replicas,
            "wait_timeout_ms": settings.redis_wait_timeout_ms}


class GuidanceStore:
    """Guidance records in Redis keyed by (weight version, rollout), budgeted and evicted."""

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        prefix: str = "libalign",
        budget_bytes: int | None = None,
        ttl_s: float | None = None,
        chunk_bytes: int = 8 << 20,
        max_record_bytes: int = 256 << 20,
        on_in_use: Literal["evict", "refuse"] = "evict",
        tombstone_ttl_s: int = _TOMBSTONE_TTL_S,
        retry: RetryPolicy | None = None,
        metrics: Metrics | None = None,
        socket_timeout_s: float = BINARY_TIMEOUT_S,
        payload_path: Literal["auto", "socket", "pipeline"] = "auto",
        clock: Callable[[], float] | None = None,
        shard: int = 0,
        shards: int = 1,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1_000,
    ):
        """``retry``: how connection errors are retried (None: the bus's default);
        ``shard``/``shards``: which guidance shard this store is (see the module docstring);
        ``wait_replicas``/``wait_timeout_ms``: the ``WAIT`` after each put;
        ``socket_timeout_s`` applies to a client made from a URL;
        ``payload_path``: see the module docstring; ``clock``: epoch seconds the scripts use
        instead of the server's clock (None: the server's), deadlines and tombstones included."""
        if on_in_use not in ("evict", "refuse"):
            raise ConfigError(f"on_in_use must be 'evict' or 'refuse', not {on_in_use!r}")
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, not {chunk_bytes}")
        if budget_bytes is not None and budget_bytes < 1:
            raise ConfigError(f"budget_bytes must be positive (or None), not {budget_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"ttl_s must be positive (or None), not {ttl_s}")
        if max_record_bytes < 1 or tombstone_ttl_s < 1:
            raise ConfigError("max_record_bytes and tombstone_ttl_s must be positive")
        if payload_path not in ("auto", "socket", "pipeline"):
            raise ConfigError(f"payload_path must be 'auto', 'socket' or 'pipeline', not "
                              f"{payload_path!r}")
        self._own_client = isinstance(client, str)
        if isinstance(client, str):
            client = client_for(client, decode_responses=False, socket_timeout_s=socket_timeout_s)
        if decodes(client):
            raise ConfigError("the guidance store needs a binary-safe client "
                              "(decode_responses=False)")
        self.client = client
        on_retry = (lambda what, e: metrics.redis_retries.inc()) if metrics is not None else None
        self.bus = RedisBus(client, retry=retry, on_retry=on_retry, wait_replicas=wait_replicas,
                            wait_timeout_ms=wait_timeout_ms)
        if not 0 <= shard < shards:
            raise ConfigError(f"guidance shard {shard} of {shards} does not exist")
        self.prefix = shard_prefix(prefix, shard, shards)
        self.keys = GuidanceKeys(self.prefix)
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.max_record_bytes = max_record_bytes
        self.on_in_use = on_in_use
        self.tombstone_ttl_s = int(tombstone_ttl_s)
        self.metrics = metrics
        self.clock = clock
        #: "socket" or "pipeline": how payload bytes move (see guidance_wire).
        self.payload_path: Literal["socket", "pipeline"] = (
            ("pipeline" if topology(client) in ("embedded", "cluster") else "socket")
            if payload_path == "auto"
            else payload_path)
        self._bulk = payload_pool(client) if self.payload_path == "socket" else None
        self._wire = PayloadWire(client, self.keys, chunk_bytes, self.payload_path, self._bulk)
        self._scripts = {name: client.register_script(source(name)) for name in _SCRIPTS}

    @classmethod
    def from_settings(cls, settings: GuidanceStoreSettings, metrics: Metrics | None = None,
                      client: redis.Redis | None = None,
                      retry: RetryPolicy | None = None) -> GuidanceStore:
        """A store on ``settings.redis_url`` (None: embedded) with the ``guidance_*``
        settings, giving up on Redis after ``redis_retry_s`` (or retrying by ``retry``); it owns
        (and closes) its client unless one is given. With ``guidance_shards`` above 1, a
        :class:`~alignd.infra.stores.guidance_shards.ShardedGuidanceStore` of that many
        (the same methods)."""
        options = store_options(settings) | ({} if retry is None else {"retry": retry})
        own, client = client is None, binary_client(settings) if client is None else client
        shards = settings.guidance_shards
        if shards > 1:
            budget = settings.guidance_budget_bytes
            if budget is not None and budget < shards:
                raise ConfigError(f"a guidance budget of {budget} bytes cannot be split over "
                                  f"{shards} shards")
            part = None if budget is None else budget // shards
            stores = [cls(client, **(options | {"budget_bytes": part}), metrics=metrics,
                          shard=i, shards=shards) for i in range(shards)]
            return ShardedGuidanceStore(stores, budget_bytes=budget,  # type: ignore[return-value]
                                        client=client, own_client=own)
        store = cls(client, **options, metrics=metrics)
        store._own_client = own
        return store

    def close(self) -> None:
        """Close the payload connections, the worker thread and an owned client."""
        self._wire.close()
        if self._own_client:
            self.client.close()

    def __enter__(self) -> GuidanceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- small helpers --------------------------------------------------------------

    def _argv(self, *extra: object) -> list[object]:
        """ARGV of a script: P, tombstone TTL, TTL text, clock (guidance_common.lua), ``extra``."""
        ttl_text = "" if self.ttl_s is None else f" of {self.ttl_s:g} s"
        now = "" if self.clock is None else f"{self.clock():.6f}"
        return [self.prefix, self.tombstone_ttl_s, ttl_text, now, *extra]

    def _now(self) -> float:
        return time.time() if self.clock is None else self.clock()

    def _script(self, name: str, *extra: object) -> Any:
        fn = self._scripts[name]
        return self._settle(self.bus.call(
            f"guidance {name}", lambda: fn(keys=self.keys.script_keys, args=self._argv(*extra))))

    def _settle(self, reply: list) -> Any:
        """A script's own reply, once the versions it found gone are logged and counted."""
        gone, body = reply
        for i in range(0, len(gone), 2):
            version, cause = gone[i].decode(), gone[i + 1].decode()
            if cause == "expired":
                log.info("guidance store: version %r expired (its TTL ran out)", version)
            elif cause == "lost":
                log.error("guidance store: version %r is lost: Redis removed its keys before "
                          "their deadline (an evicting maxmemory-policy, or a delete outside "
                          "the store)", version)
            else:
                log.warning("guidance store: version %r is gone and no deadline was recorded "
                            "for it: it expired, or Redis evicted it", version)
            if self.metrics is not None:
                self.metrics.guidance_vanished.labels(cause=cause).inc()
        return body

    def _lost_record(self, version: str, rollout_id: str, what: str) -> GuidanceEvictedError:
        """The error for a record whose keys are gone while its version is stored (counted)."""
        log.error("guidance store: rollout %r of version %r is lost: %s while the version is "
                  "still stored", rollout_id, version, what)
        if self.metrics is not None:
            self.metrics.guidance_lost_records.inc()
        return GuidanceEvictedError(version, rollout_id, detail=(
            f"lost: {what} while weight version {version!r} is still stored: evicted by a "
            "maxmemory-policy other than noeviction, or deleted outside the guidance store"))

    def _set_stored(self, total: int) -> None:
        if self.metrics is not None:
            self.metrics.guidance_stored_bytes.set(total)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.guidance_refused_puts.inc()

    # --- put ------------------------------------------------------------------------

    def put(self, version: str, rollout_id: str, blob: bytes | bytearray | memoryview) -> PutResult:
        """Store one rollout's record, replacing any previous one atomically."""
        return self.put_many(version, {rollout_id: blob})

    def put_many(self, version: str,
                 records: Mapping[str, bytes | bytearray | memoryview]) -> PutResult:
        """Store many rollouts' records of one version in one atomic transaction."""
        check_version_id(version)
        if not isinstance(records, Mapping) or not records:
            raise InputError("put_many needs a non-empty mapping of rollout id -> record")
        views: dict[str, memoryview] = {}
        for rid, blob in records.items():
            check_rollout_id(rid)
            mv = _as_view(blob, f"guidance record of rollout {rid!r}")
            if mv.nbytes > self.max_record_bytes:
                raise PayloadTooLargeError(f"guidance record of rollout {rid!r} (version "
                                           f"{version!r})", mv.nbytes, self.max_record_bytes)
            views[rid] = mv
        size = sum(mv.nbytes for mv in views.values())
        if self.budget_bytes is not None and size > self.budget_bytes:
            self._count_refusal()
            biggest = max(views, key=lambda r: views[r].nbytes)
            raise GuidanceBudgetError(
                f"put of {size} bytes to version {version!r} (largest record: rollout "
                f"{biggest!r}, {views[biggest].nbytes} bytes) is larger than the whole "
                f"guidance budget of {self.budget_bytes} bytes")
        crcs = self._wire.checksums(views)

        def attempt() -> Any:
            gen = uuid.uuid4().hex[:16]  # fresh per attempt: a retried put never meets its chunks
            return self._wire.put(version, gen, views,
                                  lambda: self._commit(version, gen, views, crcs))
        reply = self.bus.call(f"guidance put {version}", attempt)
        return self._put_outcome(version, views, size, reply)

    def _commit(self, version: str, gen: str, views: Mapping[str, memoryview],
                crcs: Future | dict[str, int]) -> Command:
        """The commit script's EVAL (waits for the crc32s if the worker computes them)."""
        crc = crcs.result() if isinstance(crcs, Future) else crcs
        budget = -1 if self.budget_bytes is None else self.budget_bytes
        ttl_ms = 0 if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        args = self._argv(version, gen, budget, self.on_in_use, ttl_ms, self.chunk_bytes)
        for rid, mv in views.items():
            args += [rid, mv.nbytes, chunk_count(mv.nbytes, self.chunk_bytes), crc[rid]]
        keys = self.keys.script_keys
        return ("EVAL", _COMMIT_LUA, len(keys), *keys, *args)

    def _put_outcome(self, version: str, views: dict[str, memoryview], size: int,
                     reply: list) -> PutResult:
        """Turn the commit script's reply into a PutResult, or raise the refusal."""
        reply = self._settle(reply)
        if reply[0] == b"ok":
            self.bus.confirm(f"guidance put {version}", self.keys.version(version))
        status = reply[0].decode()
        if status == "too_large":
            self._count_refusal()
            raise GuidanceBudgetError(
                f"version {version!r} would hold {int(reply[1])} bytes after this put, more "
                f"than the whole guidance budget of {self.budget_bytes} bytes")
        if status == "in_use":
            self._count_refusal()
            leased = [(reply[i].decode(), reply[i + 1].decode()) for i in range(3, len(reply), 2)]
            names = ", ".join(f"{v!r} (leased by {who})" for v, who in leased)
            raise GuidanceBudgetError(
                f"put of {size} bytes to version {version!r} needs {int(reply[1])} more bytes "
                f"than the budget of {self.budget_bytes} bytes leaves after evicting every "
                f"unleased version; the rest is held by leased versions {names}, and "
                f"on_in_use='refuse' keeps them; nothing was written")
        total = int(reply[1])
        evicted = []
        for i in range(2, len(reply), 3):
            ev = Eviction(reply[i].decode(), int(reply[i + 1]), _names(reply[i + 2]))
            evicted.append(ev)
            if ev.in_use_by:
                log.warning("guidance store: evicted version %r (%d bytes) while in use by %s "
                            "to make room for version %r (on_in_use='evict')",
                            ev.version, ev.bytes, ", ".join(ev.in_use_by), version)
            else:
                log.info("guidance store: evicted version %r (%d bytes) to make room for %r",
                         ev.version, ev.bytes, version)
            if self.metrics is not None:
                in_use = "true" if ev.in_use_by else "false"
                self.metrics.guidance_evictions.labels(in_use=in_use).inc()
        if self.metrics is not None:
            self.metrics.guidance_put_bytes.inc(size)
        self._set_stored(total)
        return PutResult(version, len(views), size, total, tuple(evicted))

    # --- get ------------------------------------------------------------------------

    def get(self, version: str, rollout_id: str) -> bytes:
        """One rollout's record; GuidanceNotFoundError / GuidanceEvictedError if absent."""
        return self.get_many(version, [rollout_id])[rollout_id]

    def get_many(self, version: str, rollout_ids: Iterable[str], *,
                 missing: Literal["raise", "skip"] = "raise") -> dict[str, bytes]:
        """Records of many rollouts in two round trips (metas, then chunks), verified.

        A missing rollout raises (``missing="raise"``) or is left out (``"skip"``).
        """
        check_version_id(version)
        if missing not in ("raise", "skip"):
            raise InputError(f"missing must be 'raise' or 'skip', not {missing!r}")
        ids = list(dict.fromkeys(check_rollout_id(r) for r in rollout_ids))
        out: dict[str, bytes] = {}
        absent: list[str] = []
        todo = ids
        gens: dict[str, str] = {}
        for attempt in range(2):
            metas = self._metas(version, todo)
            absent += [r for r in todo if metas[r] is None]
            found = {r: m for r, m in metas.items() if m is not None}
            got, stale = self.bus.call(f"guidance get {version}",
                                       lambda f=found: self._wire.read(version, f))
            out.update(got)
            if not stale:
                break
            if attempt == 1:
                r = stale[0]
                if gens.get(r) == found[r].gen:  # the same meta twice, its chunks gone
                    raise self._lost_record(version, r, "chunks of its record are gone")
                raise GuidanceNotFoundError(version, r, detail="replaced or removed "
                                            "while being read, twice in a row")
            gens = {r: found[r].gen for r in stale}
            todo = stale
        if self.metrics is not None:
            self.metrics.guidance_hits.inc(len(out))
            self.metrics.guidance_get_bytes.inc(sum(len(b) for b in out.values()))
            self.metrics.guidance_misses.inc(len(absent))
        lost = [self._lost_record(version, r, "its meta key is gone")
                for r in self._listed(version, absent)]
        if lost and missing == "raise":
            raise lost[0]
        if absent and missing == "raise":
            raise self._missing_error(version, absent[0])
        return {r: out[r] for r in ids if r in out}

    def _listed(self, version: str, ids: list[str]) -> list[str]:
        """Those of ``ids`` the version's rollout set names (a record there and without a
        meta is lost, not unknown)."""
        if not ids:
            return []
        key = self.keys.rollouts(version)

        def ask() -> list:
            pipe = self.client.pipeline(transaction=False)
            for r in ids:
                pipe.sismember(key, r)
            return pipe.execute()
        return [r for r, yes in zip(ids, self.bus.call(f"guidance rollouts {version}", ask),
                                    strict=True) if yes]

    def _metas(self, version: str, ids: list[str]) -> dict[str, Meta | None]:
        """One pipelined round trip: the meta of every rollout in ``ids`` (None if absent)."""
        def fetch() -> list:
            pipe = self.client.pipeline(transaction=False)
            for r in ids:
                pipe.hmget(self.keys.rollout(version, r), "len", "n", "cs", "gen", "crc")
            return pipe.execute()
        rows = self.bus.call(f"guidance metas {version}", fetch) if ids else []
        out: dict[str, Meta | None] = {}
        for r, (length, n, cs, gen, crc) in zip(ids, rows, strict=True):
            out[r] = None if length is None else Meta(int(length), int(n), int(cs),
                                                      gen.decode(), int(crc))
        return out

    def _missing_error(self, version: str, rollout_id: str | None) -> GuidanceNotFoundError:
        """Not found, with the reason: unknown version, unknown rollout, or evicted (why)."""
        self._script("reconcile")

        def look() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(self.keys.version(version))
            pipe.get(self.keys.tombstone(version))
            pipe.zscore(self.keys.lost, version)
            return pipe.execute()
        exists, tomb, lost_at = self.bus.call(f"guidance lookup {version}", look)
        if exists:
            return GuidanceNotFoundError(version, rollout_id)
        if tomb is None and lost_at is None:
            return GuidanceNotFoundError(version)
        t = json.loads(tomb) if tomb is not None else {
            "at": lost_at, "cause": "lost", "reason": "lost: Redis removed its keys, and its "
            "tombstone since: evicted by a maxmemory-policy other than noeviction, or deleted "
            "outside the guidance store"}
        at, cause = float(t.get("at", 0.0)), t.get("cause")
        deadline = float(t.get("deadline_ms") or 0) / 1000
        reason = t.get("reason", "no reason recorded")
        if cause == "lost":
            before = f", before its deadline {_when(deadline)}" if deadline else ""
            detail = f"weight version {version!r} was lost (found gone at {_when(at)}{before}): "
        else:
            if cause == "expired" and deadline:
                at = deadline
            verb = "expired" if cause == "expired" else "was evicted"
            detail = (f"weight version {version!r} {verb} at {_when(at)}, "
                      f"{max(0.0, self._now() - at):.0f} s ago: ")
        return GuidanceEvictedError(version, rollout_id, detail=detail + reason)

    def rollouts(self, version: str) -> list[str]:
        """Sorted rollout ids stored for ``version``; not found / evicted if none."""
        check_version_id(version)
        key = self.keys.rollouts(version)
        ids = self.bus.call(f"guidance rollouts {version}", lambda: self.client.smembers(key))
        if not ids:
            raise self._missing_error(version, None)
        return sorted(r.decode() for r in ids)

    # --- leases, listing, deletion ------------------------------------------------

    def acquire(self, version: str, consumer: str, ttl_s: float) -> None:
        """Protect ``version`` from budget eviction for ``ttl_s`` (renewable) for ``consumer``."""
        check_version_id(version)
        check_id(consumer, "consumer name")
        if not ttl_s > 0:
            raise InputError(f"lease ttl_s must be positive, not {ttl_s}")
        self._script("acquire", version, consumer, max(1, round(ttl_s * 1000)))

    def release(self, version: str, consumer: str) -> bool:
        """Drop ``consumer``'s lease on ``version``; False if it held none (any more)."""
        check_version_id(version)
        check_id(consumer, "consumer name")
        return bool(self._script("release", version, consumer))

    def versions(self) -> list[VersionInfo]:
        """Stored versions, oldest first put first, with bytes, rollouts and live lessees."""
        flat = self._script("list")
        self._set_stored(int(flat[0]))
        return [VersionInfo(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2]),
                            float(flat[i + 3]), _names(flat[i + 4]))
                for i in range(1, len(flat), 5)]

    def delete_version(self, version: str) -> bool:
        """Delete every record of ``version`` (a tombstone says so); False if unknown."""
        check_version_id(version)
        existed, _bytes, total = self._script("delete", version)
        self._set_stored(int(total))
        return bool(existed)

    def total_bytes(self) -> int:
        """Payload bytes stored now (after dropping expired versions from the accounting)."""
        total = int(self._script("reconcile"))
        self._set_stored(total)
        return total

    def stats(self) -> dict[str, Any]:
        """Totals and configuration, for status output."""
        vs = self.versions()
        total = sum(v.bytes for v in vs)
        return {
            "versions": len(vs),
            "rollouts": sum(v.rollouts for v in vs),
            "stored_bytes": total,
            "budget_bytes": self.budget_bytes,
            "budget_used_ratio": None if self.budget_bytes is None else total / self.budget_bytes,
            "leased_versions": [v.version for v in vs if v.leased_by],
            "oldest_version": vs[0].version if vs else None,
            "ttl_s": self.ttl_s,
            "chunk_bytes": self.chunk_bytes,
            "max_record_bytes": self.max_record_bytes,
            "on_in_use": self.on_in_use,
        }
