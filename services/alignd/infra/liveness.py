"""Service heartbeats: each running service says, every few seconds, that it is alive.

A service instance (``api``, ``converter``, ``sampler``, ``learner``; many instances of a
kind run under different names) owns one hash ``P:heartbeat:<service>:<name>``::

    at       Redis server time of the last beat (epoch seconds; one clock for all hosts)
    pid      process id
    host     host name
    state    what it is doing ("running", "loading", "idle", ... "stopped" on a clean exit)
    version  the weight version it serves or trains ("" if none)
    info     JSON object of whatever else the service reports

A beat rewrites the hash and sets its expiry to ``ttl_s`` (``PX``), all in one Lua script
that reads the server clock, so a process that dies stops beating and its hash vanishes
by itself ``ttl_s`` later. The sorted set ``P:heartbeats`` (member ``<service>:<name>``,
score the time of the last beat) remembers instances after their hash expired, so status
output can still list a dead instance as down with the age of its last beat; members
older than :data:`FORGET_AFTER_S` are dropped.

What an instance *holds* outlives its hash: the same script writes the weight versions it
serves or is loading (``version`` and :attr:`ServiceHeartbeat.loading`) as a JSON list into
the hash ``P:heartbeats:holds`` (field ``<service>:<name>``), which does not expire, and a
clean stop (state ``stopped``) deletes that field. :func:`held_versions` reads it against
the index's last-beat times: an instance that stopped beating without a clean stop (paused,
partitioned, killed) still holds its versions for a grace period after its last beat, far
longer than its heartbeat's ttl, so the retention pass (:mod:`alignd.infra.retention`) does
not delete a version under a sampler that merely missed a few beats.

An instance is *up* while its hash exists, its last beat is younger than ``ttl_s`` and its
state is not ``stopped``. :class:`ServiceHeartbeat` beats from a daemon thread; a failed
beat (Redis briefly down) is logged and retried at the next period, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import redis
from alignclient.errors import InputError
from alignclient.ids import check_id
from alignclient.retry import RetryPolicy

from alignd.infra.bus import RedisBus

log = logging.getLogger(__name__)

#: Instances whose last beat is older than this are no longer listed (a week).
FORGET_AFTER_S = 7 * 86_400.0
#: Known service kinds.
SERVICES = ("api", "converter", "sampler", "learner")

# KEYS[1] hash, KEYS[2] index, KEYS[3] holds. ARGV: member, ttl_ms, pid, host, state, version,
# info, held versions (a JSON list).
_BEAT_LUA = """
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[1], 'at', now, 'pid', ARGV[3], 'host', ARGV[4], 'state', ARGV[5],
           'version', ARGV[6], 'info', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(now), ARGV[1])
if ARGV[5] == 'stopped' or ARGV[8] == '[]' then
  redis.call('HDEL', KEYS[3], ARGV[1])
else
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[8])
end
return now
"""


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def heartbeat_key(prefix: str, service: str, name: str) -> str:
    """The hash of one instance."""
    return f"{prefix}:heartbeat:{service}:{name}"


def holds_key(prefix: str) -> str:
    """The hash of the versions each instance holds (field ``<service>:<name>``)."""
    return f"{prefix}:heartbeats:holds"


class ServiceHeartbeat:
    """Beat for one service instance every ``period_s`` from a daemon thread."""

    def __init__(self, bus_or_client: RedisBus | redis.Redis, service: str, name: str,
                 period_s: float = 2.0, ttl_s: float = 10.0,
                 info: Callable[[], dict[str, Any]] | None = None, *, prefix: str = "libalign"):
        if service not in SERVICES:
            raise InputError(f"service must be one of {SERVICES}, not {service!r}")
        check_id(name, "instance name")  # a key part
        if not 0 < period_s < ttl_s:
            raise InputError(f"need 0 < period_s < ttl_s, got period_s={period_s}, ttl_s={ttl_s}")
        client = bus_or_client.client if isinstance(bus_or_client, RedisBus) else bus_or_client
        self._stop = threading.Event()
        # a beat gives up after one period (the next one tries again) and at once on stop()
        self.bus = RedisBus(client, retry=RetryPolicy(deadline_s=period_s),
                            stop_event=self._stop)
        self.service, self.name = service, name
        self.period_s, self.ttl_s = period_s, ttl_s
        self.info = info
        self.prefix = prefix
        self.state = "running"
        self.version = ""
        self.loading = ""
        self.beats = 0
        self._script = self.bus.client.register_script(_BEAT_LUA)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        return heartbeat_key(self.prefix, self.service, self.name)

    def set(self, *, state: str | None = None, version: str | None = None,
            loading: str | None = None) -> None:
        """Change the reported state, version or version being loaded ("" for none; sent
        with the next beat, or at once by :meth:`beat`)."""
        if state is not None:
            self.state = state
        if version is not None:
            self.version = version
        if loading is not None:
            self.loading = loading

    def beat(self) -> None:
        """Write one beat now (raises if Redis is unreachable).

        What it says is read under the lock that orders the writes: a beat that waited
        behind another one never writes an older state or version over it.
        """
        keys = [self.key, f"{self.prefix}:heartbeats", holds_key(self.prefix)]
        with self._lock:
            extra = dict(self.info()) if self.info is not None else {}
            state = str(extra.pop("state", self.state))
            version = str(extra.pop("version", self.version) or "")
            held = [v for v in dict.fromkeys((version, self.loading)) if v]
            args = [f"{self.service}:{self.name}", max(1, round(self.ttl_s * 1000)),
                    os.getpid(), socket.gethostname(), state, version,
                    json.dumps(extra, default=str), json.dumps(held)]
            self.bus.call(f"heartbeat {self.service}:{self.name}",
                          lambda: self._script(keys=keys, args=args))
            self.beats += 1

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as e:  # Redis down, a failing info(): the service goes on
                log.warning("heartbeat of %s:%s failed: %s", self.service, self.name, e)
            if self._stop.wait(self.period_s):
                return

    def start(self) -> ServiceHeartbeat:
        """Start beating (the first beat is immediate)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"heartbeat-{self.service}-{self.name}")
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and report ``stopped``, which also lets go of the versions held
        (best effort: Redis may be gone; they are then held for the grace period)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.state = "stopped"
        try:
            self.beat()
        except Exception as e:
            log.info("last heartbeat of %s:%s not written: %s", self.service, self.name, e)

    def __enter__(self) -> ServiceHeartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def list_heartbeats(client: redis.Redis | RedisBus, prefix: str = "libalign",
                    ttl_s: float | None = None, *, now: float | None = None
                    ) -> list[dict[str, Any]]:
    """Every known instance: service, name, age_s, up, state, version, info (sorted).

    ``up`` needs the hash to exist (its own expiry is the instance's ttl) and, if
    ``ttl_s`` is given, a beat younger than that. Ages are taken at ``now`` (epoch seconds;
    default the Redis server's clock, the one beats are stamped with).
    """
    bus = client if isinstance(client, RedisBus) else RedisBus(client)
    index = f"{prefix}:heartbeats"

    def members() -> tuple[list, Any]:
        pipe = bus.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(index, 0, -1, withscores=True)
        return pipe.execute()

    (sec, usec), rows = bus.call("heartbeats list", members)
    now = sec + usec / 1e6 if now is None else now
    rows = [(_text(m), float(score)) for m, score in rows]
    stale = [m for m, score in rows if now - score > FORGET_AFTER_S]
    if stale:
        def forget() -> None:
            pipe = bus.client.pipeline(transaction=False)
            pipe.zrem(index, *stale)
            pipe.hdel(holds_key(prefix), *stale)
            pipe.execute()
        bus.call("heartbeats forget", forget)
    rows = [(m, score) for m, score in rows if m not in stale]

    def hashes() -> list:
        pipe = bus.client.pipeline(transaction=False)
        for m, _ in rows:
            service, name = m.split(":", 1)
            pipe.hgetall(heartbeat_key(prefix, service, name))
        return pipe.execute()

    out = []
    for (m, last), h in zip(rows, bus.call("heartbeats read", hashes) if rows else [], strict=True):
        service, name = m.split(":", 1)
        h = {_text(k): _text(v) for k, v in (h or {}).items()}
        at = float(h.get("at", last))
        age = max(0.0, now - at)
        state = h.get("state", "gone")
        try:
            info = json.loads(h.get("info") or "{}")
        except ValueError:
            info = {}
        up = bool(h) and state != "stopped" and (ttl_s is None or age <= ttl_s)
        out.append({"service": service, "name": name, "age_s": round(age, 3), "up": up,
                    "state": state if h else "gone", "version": h.get("version", ""),
                    "info": info if isinstance(info, dict) else {"value": info}})
    return sorted(out, key=lambda d: (d["service"], d["name"]))


def held_versions(client: redis.Redis | RedisBus, prefix: str = "libalign", *,
                  grace_s: float, now: float | None = None) -> dict[str, list[str]]:
    """``<service>:<name>`` -> the weight versions that instance holds (serves or is loading).

    An instance holds what its last beat named until it stops cleanly, or until ``grace_s``
    after that beat (its heartbeat lapsed and nobody saw it go: it may only be paused).
    Ages are taken at ``now`` (default the Redis server's clock).
    """
    bus = client if isinstance(client, RedisBus) else RedisBus(client)

    def read() -> list[Any]:
        pipe = bus.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(f"{prefix}:heartbeats", 0, -1, withscores=True)
        pipe.hgetall(holds_key(prefix))
        return pipe.execute()

    (sec, usec), beats, holds = bus.call("heartbeats held versions", read)
    now = sec + usec / 1e6 if now is None else now
    last = {_text(m): float(score) for m, score in beats}
    out: dict[str, list[str]] = {}
    for member, raw in holds.items():
        member = _text(member)
        if member not in last or now - last[member] > grace_s:
            continue
        try:
            versions = json.loads(_text(raw))
        except ValueError:
            continue
        if isinstance(versions, list):
            out[member] = [str(v) for v in versions if v]
    return out
