"""Events on Redis Streams with consumer groups: at-least-once, never lost.

A stream is an append-only log (``XADD``). A consumer group remembers, per message,
which consumer it was delivered to and whether that consumer has acknowledged it. The
pattern the services follow:

1. ``XGROUP CREATE ... MKSTREAM`` once (idempotent here);
2. ``XREADGROUP ... >`` hands each new message to exactly one consumer of the group and
   puts it in the group's pending entries list (PEL);
3. the consumer does the work, makes its result durable, and only then ``XACK``s, which
   removes the message from the PEL. A consumer that dies before the ack leaves the
   message pending;
4. a live consumer periodically runs ``XAUTOCLAIM`` for messages idle longer than
   ``claim_idle_ms`` and takes them over, so work a dead consumer started is finished.
   While working, a consumer refreshes its message (:meth:`RedisBus.touch`) so that a
   slow but alive consumer is not mistaken for a dead one.

Streams stay bounded: every ``XADD`` made through the bus (:meth:`RedisBus.publish`, and
:meth:`RedisBus.queue_publish` inside a caller's transaction) carries ``MAXLEN ~ N`` with the
bus's :attr:`RedisBus.stream_maxlen` (``ALIGN_STREAM_MAXLEN``), so a stream's length stays
near N however many events were ever published. Trimming ignores consumer groups: N must
exceed any group's backlog; an entry trimmed while pending comes back from ``XAUTOCLAIM`` as
deleted and :meth:`RedisBus.reclaim` acks it away.

Delivery is therefore at least once: handlers must be idempotent. Every Redis call goes
through :meth:`RedisBus.call`, which retries connection errors and timeouts (a restarting
Redis answers ``LOADING`` or refuses connections for a while) with the project's one retry
policy (:class:`alignclient.retry.RetryPolicy`: jittered exponential backoff, a deadline),
and recreates the group if Redis came back empty (``NOGROUP``). What no retry fixes is not
retried: bad credentials (which redis-py raises as a connection error), a command the ACL
user may not run and a write a full server refuses come back at once as the typed errors of
:func:`alignd.infra.redis_checks.refusal` (a configuration error, "Redis is full").

Failover. On a Sentinel set or a Redis Cluster a master that dies is replaced by its replica
after a few seconds; until then calls fail with connection errors, ``CLUSTERDOWN`` or
``TRYAGAIN``, all retried like a restart. While a cluster slot migrates, redis-py follows
``ASK``/``MOVED`` for single commands; a transaction redirected that way was aborted whole
by the server and is retried here until the slot has settled on its new master.
Replication is asynchronous, so a write the old master acknowledged may not have reached
the replica that takes over. Where a store promises that an acknowledged write survives, it
calls :meth:`RedisBus.confirm` after the write: ``WAIT`` for ``wait_replicas`` replicas
(``ALIGN_REDIS_WAIT_REPLICAS``), on the master that holds the written key. What that does
and does not promise is written in RELIABILITY.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import redis
from alignclient.errors import BusUnavailableError
from alignclient.retry import RetryPolicy
from redis.cluster import RedisCluster

from alignd.infra.redis_checks import CREDENTIAL_ERRORS, refusal
from alignd.infra.redis_clients import client_for, text_client
from alignd.infra.settings import DEFAULT_STREAM_MAXLEN, ServiceSettings
from alignd.infra.telemetry import REDIS_UNREPLICATED

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors after which the same call may simply be tried again: a lost connection, a timeout,
#: a cluster whose slots are failing over (CLUSTERDOWN, a slot no node serves yet) or moving
#: (TRYAGAIN: a multi-key command on a slot half-migrated; ASK or MOVED answered to a
#: MULTI/EXEC, which redis-py hands back instead of following: the server aborted the whole
#: transaction, so nothing in it ran).
RETRYABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
             redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
             redis.exceptions.SlotNotCoveredError, redis.exceptions.AskError)
#: How long the key that :meth:`RedisBus.confirm` writes lives.
_BARRIER_TTL_MS = 60_000


def redis_transient(error: BaseException) -> bool:
    """Whether a Redis call that raised ``error`` may be tried again (:data:`RETRYABLE`, but
    never refused credentials, which redis-py raises as a connection error)."""
    return isinstance(error, RETRYABLE) and not isinstance(error, CREDENTIAL_ERRORS)

#: Error replies that mean "the consumer group (or its whole stream) is gone". Redis says
#: NOGROUP; the embedded server answers XREADGROUP on a missing stream with XGROUP's
#: "requires the key to exist" instead, which Redis never sends for the calls we guard.
_NOGROUP = ("NOGROUP", "requires the key to exist")

# Refresh a pending message's idle time only if this consumer still owns it.
_TOUCH_LUA = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""


@dataclass(frozen=True)
class Message:
    """One stream entry as a consumer sees it."""

    stream: str
    id: str
    fields: dict[str, str]
    deliveries: int = 1
    reclaimed: bool = False


def connect(url: str | None, *, socket_timeout_s: float = 10.0) -> redis.Redis:
    """A client for ``url`` with string replies and no hidden retries (we retry ourselves).

    ``url=None`` gives a client of the embedded in-process server
    (see ``services/alignd/infra/redis_clients.py``).
    """
    return client_for(url, decode_responses=True, socket_timeout_s=socket_timeout_s)


class RedisBus:
    """Streams, consumer groups and retries over one Redis client.

    ``retry`` is how connection errors are retried (default: backoff from 50 ms to 2 s, no
    deadline); ``stop_event`` ends the retrying at once; ``on_retry(what, error)`` runs
    before each wait (a metric); ``stream_maxlen`` caps every stream this bus adds to
    (approximately, ``MAXLEN ~``).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        retry: RetryPolicy | None = None,
        stop_event: threading.Event | None = None,
        on_retry: Callable[[str, Exception], None] | None = None,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1_000,
    ):
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be positive, got {stream_maxlen}")
        self.client = client
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self.stream_maxlen = stream_maxlen
        self.retry = retry or RetryPolicy()
        self.stop_event = stop_event
        self.on_retry = on_retry
        self._touch = client.register_script(_TOUCH_LUA)

    @classmethod
    def from_settings(cls, settings: ServiceSettings, **kw) -> RedisBus:
        """A bus on ``settings.redis_url`` (None: embedded) that gives up after
        ``settings.redis_retry_s`` and caps streams at ``settings.stream_maxlen``."""
        timeout = settings.block_ms / 1000 + 10.0
        retry = RetryPolicy(deadline_s=settings.redis_retry_s)
        kw.setdefault("stream_maxlen", settings.stream_maxlen)
        kw.setdefault("wait_replicas", settings.redis_wait_replicas)
        kw.setdefault("wait_timeout_ms", settings.redis_wait_timeout_ms)
        return cls(text_client(settings, socket_timeout_s=timeout), retry=retry, **kw)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying connection errors by :attr:`retry`; raise BusUnavailableError,
        or at once the typed error of a refusal no retry fixes (see the module docstring)."""
        start = time.monotonic()

        def on_retry(_attempt: int, wait_s: float, error: BaseException | None) -> None:
            if self.on_retry is not None:
                self.on_retry(what, error)
            log.warning("%s: %s; retrying in %.2fs", what, error, wait_s)
            self._refresh_routes()

        try:
            return self.retry.call(fn, transient=redis_transient, stop_event=self.stop_event,
                                   on_retry=on_retry)
        except redis.exceptions.RedisError as e:
            typed = refusal(e, what)
            if typed is not None:
                raise typed from e
            if not isinstance(e, RETRYABLE):
                raise
            waited = time.monotonic() - start
            raise BusUnavailableError(f"{what}: Redis unreachable for {waited:.1f}s: {e}") from e

    def _refresh_routes(self) -> None:
        """On a cluster, ask the nodes again which master serves which slot (after a failed
        call: its master may have failed over, or its slot moved). redis-py does so after most
        commands, not after a transaction's; a node that does not answer is for the next try."""
        if isinstance(self.client, RedisCluster):
            try:
                self.client.nodes_manager.initialize()
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as e:
                log.info("cluster slot map not refreshed yet: %s", e)

    def confirm(self, what: str, key: str | bytes) -> int | None:
        """After a write to ``key``: ``WAIT`` until :attr:`wait_replicas` replicas hold it, at
        most :attr:`wait_timeout_ms`; how many did (None when not asked to wait).

        ``WAIT`` counts the replicas that acknowledged the last write *of its connection*, so
        it goes out on one connection to the master that holds ``key`` right behind a write of
        its own (a short-lived barrier key in ``key``'s slot): replication is one ordered
        stream, and a replica that has the barrier has every write the master made before it,
        ours included. Fewer than asked is logged and counted
        (``libalign_redis_unreplicated_writes_total``), not raised: the write is done, only
        its survival of a failover is not promised.
        """
        if self.wait_replicas == 0:
            return None
        barrier = (key + b":replicated") if isinstance(key, bytes) else f"{key}:replicated"

        def once() -> int:
            node = self.client
            if isinstance(node, RedisCluster):
                node = node.get_redis_connection(node.get_node_from_key(barrier))
            try:
                with node.pipeline(transaction=False) as pipe:
                    pipe.set(barrier, b"1", px=_BARRIER_TTL_MS)
                    pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                    return int(pipe.execute()[1])
            except redis.exceptions.MovedError as e:  # the slot map is stale: refresh, retry
                self.client.nodes_manager.initialize()
                raise redis.exceptions.ConnectionError(f"slot moved: {e}") from e

        acked = self.call(f"WAIT {what}", once)
        if acked < self.wait_replicas:
            REDIS_UNREPLICATED.inc()
            log.warning("%s: only %d of %d replicas acknowledged it within %d ms; a failover "
                        "of its master now may lose it", what, acked, self.wait_replicas,
                        self.wait_timeout_ms)
        return acked

    def ensure_group(self, stream: str, group: str, start_id: str = "0") -> bool:
        """Create ``group`` on ``stream`` (and the stream); False if it already existed."""
        def create() -> bool:
            try:
                self.client.xgroup_create(stream, group, id=start_id, mkstream=True)
                return True
            except redis.exceptions.ResponseError as e:
                if "BUSYGROUP" in str(e):
                    return False
                raise
        return self.call(f"XGROUP CREATE {stream} {group}", create)

    def _grouped(self, stream: str, group: str, what: str, fn: Callable[[], T]) -> T:
        """``call`` that recreates a group lost to a Redis restart without persistence."""
        def attempt() -> T:
            try:
                return fn()
            except redis.exceptions.ResponseError as e:
                if not any(m in str(e) for m in _NOGROUP):
                    raise
                log.warning("%s: group %s vanished (Redis restarted empty?); recreating",
                            what, group)
                self.client.xgroup_create(stream, group, id="0", mkstream=True)
                return fn()
        return self.call(what, attempt)

    def publish(self, stream: str, fields: Mapping[str, str], *, maxlen: int | None = None) -> str:
        """XADD one event, trimming ``stream`` to about ``maxlen`` (default
        :attr:`stream_maxlen`) entries; returns its id. A retried XADD may duplicate, never
        lose, it."""
        return self.call(f"XADD {stream}",
                         lambda: self.queue_publish(self.client, stream, fields, maxlen=maxlen))

    def queue_publish(self, client: redis.Redis, stream: str, fields: Mapping[str, str], *,
                      maxlen: int | None = None):
        """The capped XADD of :meth:`publish` on ``client``, say a caller's MULTI pipeline
        (where it is queued and its id comes back from ``EXECUTE``); no retrying here."""
        data = {k: str(v) for k, v in fields.items()}
        return client.xadd(stream, data, maxlen=maxlen or self.stream_maxlen, approximate=True)

    def read(self, stream: str, group: str, consumer: str, *, count: int = 1,
             block_ms: int = 1000) -> list[Message]:
        """XREADGROUP new messages (``>``) for ``consumer``, waiting up to ``block_ms``."""
        reply = self._grouped(stream, group, f"XREADGROUP {stream}", lambda: self.client.xreadgroup(
            group, consumer, {stream: ">"}, count=count, block=block_ms))
        out: list[Message] = []
        for _name, entries in reply or []:
            for msg_id, fields in entries:
                if fields is not None:
                    out.append(Message(stream, msg_id, dict(fields)))
        return out

    def last_id(self, stream: str) -> str:
        """The id of ``stream``'s newest entry (``0-0`` when empty): where a reader that wants
        only what comes next starts (:meth:`read_after`)."""
        last = self.call(f"XREVRANGE {stream}", lambda: self.client.xrevrange(stream, count=1))
        return last[0][0] if last else "0-0"

    def read_after(self, stream: str, after: str, *, count: int = 64,
                   block_ms: int = 200) -> list[Message]:
        """XREAD the entries of ``stream`` after id ``after`` (no consumer group: every reader
        sees every entry), waiting up to ``block_ms`` for one."""
        reply = self.call(f"XREAD {stream}", lambda: self.client.xread(
            {stream: after}, count=count, block=block_ms))
        return [Message(stream, msg_id, dict(fields)) for _name, entries in reply or []
                for msg_id, fields in entries if fields is not None]

    def reclaim(self, stream: str, group: str, consumer: str, *, min_idle_ms: int,
                count: int = 100, limit: int | None = None) -> list[Message]:
        """XAUTOCLAIM messages idle at least ``min_idle_ms`` (at most ``limit``); trimmed ones are acked.

        Claim only what you will work on next: a claimed message waits in this consumer's
        name, and other consumers leave it alone until it is idle again.
        """
        out: list[Message] = []
        cursor = "0-0"
        if limit is not None:
            count = min(count, limit)
        while limit is None or len(out) < limit:
            reply = self._grouped(stream, group, f"XAUTOCLAIM {stream}", lambda c=cursor:
                                  self.client.xautoclaim(stream, group, consumer, min_idle_ms,
                                                         start_id=c, count=count))
            cursor, entries = reply[0], reply[1]
            deleted = reply[2] if len(reply) > 2 else []
            for msg_id, fields in entries:
                if fields is None:
                    continue
                n = self.deliveries(stream, group, msg_id)
                out.append(Message(stream, msg_id, dict(fields), deliveries=n, reclaimed=True))
            for msg_id in deleted:  # entry trimmed away: nothing left to do, drop it from the PEL
                self.ack(stream, group, msg_id)
            if cursor in ("0-0", "0"):
                break
        return out

    def deliveries(self, stream: str, group: str, msg_id: str) -> int:
        """How many times the group has delivered ``msg_id`` (0 if no longer pending)."""
        rows = self._grouped(stream, group, f"XPENDING {stream}", lambda: self.client.xpending_range(
            stream, group, min=msg_id, max=msg_id, count=1))
        return int(rows[0]["times_delivered"]) if rows else 0

    def touch(self, stream: str, group: str, consumer: str, msg_id: str, *,
              retry: bool = True) -> bool:
        """Reset ``msg_id``'s idle time if ``consumer`` still owns it; False if it does not."""
        def once() -> bool:
            return bool(self._touch(keys=[stream], args=[group, consumer, msg_id]))
        return self._grouped(stream, group, f"touch {stream}", once) if retry else once()

    def ack(self, stream: str, group: str, msg_id: str) -> int:
        """XACK: the work for ``msg_id`` is durably done. Idempotent."""
        return int(self.call(f"XACK {stream}", lambda: self.client.xack(stream, group, msg_id)))

    def pending_count(self, stream: str, group: str) -> int:
        """Messages delivered to the group and not yet acknowledged."""
        info = self._grouped(stream, group, f"XPENDING {stream}",
                             lambda: self.client.xpending(stream, group))
        return int(info["pending"])


class ClaimKeeper:
    """Keeps this consumer's claim on one in-flight message: touches it every ``period_s``.

    A context manager around the work on ``msg``: a thread resets the message's idle time
    (:meth:`RedisBus.touch`) so that other consumers' ``XAUTOCLAIM`` does not take a message
    whose consumer is slow but alive. ``lost`` turns True (and the touching stops) if another
    consumer claimed it anyway. This is about one message;
    whether a *service* is alive is :mod:`alignd.infra.liveness`'s ``ServiceHeartbeat``.
    """

    def __init__(self, bus: RedisBus, msg: Message, group: str, consumer: str, period_s: float):
        self.bus, self.msg, self.group, self.consumer = bus, msg, group, consumer
        self.period_s = period_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"claim-{msg.id}", daemon=True)

    def _run(self) -> None:
        """Touch until stopped; a failed touch is logged, never raised."""
        while not self._stop.wait(self.period_s):
            try:
                if not self.bus.touch(self.msg.stream, self.group, self.consumer, self.msg.id,
                                      retry=False):
                    self.lost = True
                    log.warning("message %s was claimed by another consumer", self.msg.id)
                    return
            except Exception as e:  # Redis down: the work goes on, the next touch may succeed
                log.warning("touching in-flight message %s failed: %s", self.msg.id, e)

    def __enter__(self) -> ClaimKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
