"""The weight-version registry: one state machine per version, kept in Redis.

A version moves along ``published -> converting -> converted -> loading -> serving``;
from any state before ``serving`` it may instead go to ``failed`` with a reason. A
``failed`` version can come back through an operator's retry
(:meth:`Registry.retry_and_announce`, ``failed -> published`` with a new ``published`` event,
once the cause, say a full disk, is gone). Both ``serving`` and ``failed`` end in
``retired``, the one terminal state: the retention pass (:mod:`alignd.infra.retention`)
retires a ``serving`` version that no live sampler serves once ``retain_versions`` newer ones
serve, and a ``failed`` one that nobody retried for ``retired_ttl_s``. A retired version is
never loaded or retried again (publish its weights anew), and :meth:`Registry.prune` deletes
its record once its store directories are gone.

One self-loop is legal, ``converting -> converting``, and only when the caller says it
reclaimed the work (``reclaim=True``): a converter that crashed mid-way left the version in
``converting``, and the consumer that takes over its message re-enters the state under its
own name. Without the flag a second
``published -> converting`` loses: of two clients racing for the same transition
exactly one wins, the other gets :class:`StateTransitionError`.

Every transition is one Lua script, so the check of the current state and the write of
the new one are atomic on the server. Each change appends ``{from, to, at, reason,
actor}`` to the version's history; timestamps come from the Redis server's clock, so
entries written by different hosts are ordered consistently. A transition carries a
random token: if a reply is lost and the client retries, the script recognises its own
completed write and reports success instead of an illegal ``X -> X``.

Keys (``P`` is the key prefix): ``P:version:<id>`` (hash: state, path, reason, owner,
created_at, updated_at, meta), ``P:version:<id>:history`` (list of JSON),
``P:versions`` (sorted set of ids by creation time) and ``P:versions:pruned`` (the creation
times of the newest :data:`MAX_TOMBSTONES` pruned ids, so a page cursor outlives its version).

A record that cannot be served never breaks a reader of the others: one whose ``meta`` is
not a JSON object within the wire limits (:func:`alignclient.models.check_meta`) is read
with its ``meta`` replaced by ``{"meta_unreadable": why}``; one missing a field or holding
an unknown state reads as not found (naming why), and :meth:`Registry.list_versions` skips it.

On a Redis Cluster every key here lives in the slot of the key prefix's hash tag (see
:mod:`alignd.infra.keyspace`), so each script and each MULTI/EXEC touches one slot. With
``redis_wait_replicas`` set, every write returns only after ``WAIT`` (:meth:`RedisBus.confirm`).

Reads cost what they return, not the history: :meth:`Registry.page` walks the index newest
first and fetches a page's records in one pipelined round trip, with a cursor (``before``, a
version id) for the next, older page; a cursor whose version was pruned meanwhile still
leads on, from its tombstone's creation time. :meth:`Registry.count` is one ``ZCARD``.
Creating a version checks its ``meta`` against the same limits (InputError), whoever writes.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from alignclient.errors import (
    ConfigError,
    InputError,
    StateTransitionError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignclient.ids import check_version_id
from alignclient.models import check_meta
from redis.commands.core import Script

from alignd.infra.bus import RedisBus, redis_transient

log = logging.getLogger(__name__)

STATES = ("published", "converting", "converted", "loading", "serving", "failed", "retired")

#: Legal moves; the single source of truth the Lua scripts are fed from.
TRANSITIONS: dict[str, frozenset[str]] = {
    "published": frozenset({"converting", "failed"}),
    "converting": frozenset({"converting", "converted", "failed"}),
    "converted": frozenset({"loading", "failed"}),
    "loading": frozenset({"serving", "failed"}),
    "serving": frozenset({"retired"}),  # retention: no live sampler serves it any more
    "failed": frozenset({"published", "retired"}),  # an operator's retry; retention
    "retired": frozenset(),  # terminal: pruned (record and store directories) after a while
}
#: Self-loops that are legal only for a reclaimed piece of work.
REENTRANT = frozenset({"converting"})
MAX_REASON = 2000
#: Records fetched per pipelined round trip when every version is listed.
LIST_CHUNK = 500
#: Pruned ids whose creation time is kept for page cursors (the oldest are forgotten first).
MAX_TOMBSTONES = 10_000

_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return nil end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[1], 'version_id', ARGV[1], 'state', 'published', 'path', ARGV[2],
           'reason', '', 'owner', ARGV[3], 'meta', ARGV[4], 'created_at', now, 'updated_at', now)
redis.call('RPUSH', KEYS[2], cjson.encode({['from']='', to='published', at=now, reason='',
                                           actor=ARGV[3]}))
redis.call('ZADD', KEYS[3], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: record, history, index, tombstones. ARGV: id, the state it must be in, tombstone cap.
# A record already gone still has its history and index entry cleaned (a pass that died
# half-way is finished by the next).
_PRUNE_LUA = """
local cur = redis.call('HGET', KEYS[1], 'state')
if cur and cur ~= ARGV[2] then return {'illegal', cur} end
local score = redis.call('ZSCORE', KEYS[3], ARGV[1])
if score then
  redis.call('ZADD', KEYS[4], score, ARGV[1])
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -tonumber(ARGV[3]) - 1)
end
local n = redis.call('DEL', KEYS[1], KEYS[2]) + redis.call('ZREM', KEYS[3], ARGV[1])
if n > 0 then return {'ok'} end
return {'gone'}
"""

# ARGV: target, token, reason, actor, allowed-from (comma list), expected owner ('' = any)
_TRANSITION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing'} end
if redis.call('HGET', KEYS[1], 'last_token') == ARGV[2] and cur == ARGV[1] then
  return {'ok', redis.call('HGETALL', KEYS[1])}
end
local allowed = false
for s in string.gmatch(ARGV[5], '[^,]+') do
  if s == cur then allowed = true end
end
if not allowed then return {'illegal', cur} end
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
if ARGV[6] ~= '' and owner ~= ARGV[6] then return {'owner', cur, owner} end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', now, 'last_token', ARGV[2],
           'owner', ARGV[4])
if ARGV[1] == 'failed' then redis.call('HSET', KEYS[1], 'reason', ARGV[3])
elseif cur == 'failed' then redis.call('HSET', KEYS[1], 'reason', '') end
redis.call('RPUSH', KEYS[2], cjson.encode({['from']=cur, to=ARGV[1], at=now, reason=ARGV[3],
                                           actor=ARGV[4]}))
return {'ok', redis.call('HGETALL', KEYS[1])}
"""


@dataclass(frozen=True)
class VersionRecord:
    """A version as the registry holds it."""

    version_id: str
    state: str
    path: str
    reason: str
    owner: str
    created_at: float
    updated_at: float
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> VersionRecord:
        """Build from the Redis hash; UnreadableRecordError if a field is missing or wrong."""
        try:
            rec = cls(
                version_id=h["version_id"], state=h["state"], path=h.get("path", ""),
                reason=h.get("reason", ""), owner=h.get("owner", ""),
                created_at=float(h["created_at"]), updated_at=float(h["updated_at"]),
                meta=stored_meta(h.get("meta") or "{}"),
            )
        except (KeyError, ValueError) as e:
            raise UnreadableRecordError(h.get("version_id", "?"), f"{type(e).__name__}: {e}") from e
        if rec.state not in STATES:
            raise UnreadableRecordError(rec.version_id, f"unknown state {rec.state!r}")
        return rec


class VersionState(NamedTuple):
    """A version's id and state, all a summary (the status page) needs of it."""

    version_id: str
    state: str


class VersionAge(NamedTuple):
    """A version's id, state and since when it is in it (server time): what retention reads."""

    version_id: str
    state: str
    since: float


@dataclass(frozen=True)
class VersionPage:
    """One page of versions, oldest first; ``next_before`` is the cursor of the next (older)
    page, None when this one reaches the oldest version."""

    records: list[VersionRecord]
    next_before: str | None


class UnreadableRecordError(VersionNotFoundError):
    """A registry record that cannot be served (a field missing or wrong): not found, and why."""

    def __init__(self, version_id: str, why: str):
        super().__init__(version_id, f"registry (its record is unreadable: {why[:200]})")


def meta_json(meta: dict[str, Any] | None) -> str:
    """``meta`` as the JSON a record stores; InputError if it breaks the wire limits."""
    try:
        check_meta(meta or {})
    except ValueError as e:
        raise InputError(str(e)) from e
    return json.dumps(meta or {}, sort_keys=True)


def stored_meta(text: str) -> dict[str, Any]:
    """A stored ``meta``, or ``{"meta_unreadable": why}`` if it is not a servable JSON object."""
    try:
        meta = json.loads(text)
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, not an object")
        return check_meta(meta)
    except (ValueError, RecursionError) as e:
        return {"meta_unreadable": str(e)[:200]}


@dataclass(frozen=True)
class HistoryEntry:
    """One state change: from, to, server time, reason and who made it."""

    from_state: str
    to_state: str
    at: float
    reason: str
    actor: str


def _flat_to_dict(flat: list[str]) -> dict[str, str]:
    """HGETALL's flat [k1, v1, k2, v2, ...] reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def allowed_sources(target: str, *, reclaim: bool = False) -> frozenset[str]:
    """States from which ``target`` may be entered (self-loops only with ``reclaim``)."""
    if target not in TRANSITIONS:
        raise InputError(f"unknown version state {target!r}; states are {STATES}")
    srcs = {s for s, nxt in TRANSITIONS.items() if target in nxt}
    if target in REENTRANT and not reclaim:
        srcs.discard(target)
    return frozenset(srcs)


def queue_script(pipe: redis.client.Pipeline, script: Script, keys: list[str],
                 args: list[Any]) -> None:
    """Queue ``script`` in ``pipe``'s MULTI as ``EVAL`` with its source, never ``EVALSHA``.

    Redis runs every command of an ``EXEC`` even when one of them fails: an ``EVALSHA`` of a
    script the server does not hold fails with ``NOSCRIPT`` at ``EXEC`` while the ``XADD``
    queued after it is applied, leaving an event without its version. redis-py loads a
    pipeline's scripts before ``MULTI`` on one server, but not through a cluster's pipeline,
    and a replica promoted by a failover holds none; the source travels with each
    transaction instead (a few hundred bytes).
    """
    pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)


class Registry:
    """Create, move and inspect weight versions in Redis."""

    def __init__(self, bus: RedisBus, prefix: str = "libalign"):
        self.bus = bus
        self.prefix = prefix
        self._create = bus.client.register_script(_CREATE_LUA)
        self._transition = bus.client.register_script(_TRANSITION_LUA)
        self._prune = bus.client.register_script(_PRUNE_LUA)

    def _key(self, version_id: str) -> str:
        return f"{self.prefix}:version:{check_version_id(version_id)}"

    def _history_key(self, version_id: str) -> str:
        return f"{self._key(version_id)}:history"

    @property
    def _index_key(self) -> str:
        return f"{self.prefix}:versions"

    @property
    def _tombstones_key(self) -> str:
        return f"{self.prefix}:versions:pruned"

    @property
    def creation_keys(self) -> tuple[str, str]:
        """The sorted sets of creation times: live versions (the index) and pruned ones
        (tombstones); what :mod:`alignd.infra.staleness` counts versions between."""
        return self._index_key, self._tombstones_key

    def create(self, version_id: str, path: str, *, actor: str = "",
               meta: dict[str, Any] | None = None) -> VersionRecord:
        """Register a new version in state ``published``; VersionExistsError if known."""
        keys = [self._key(version_id), self._history_key(version_id), self._index_key]
        args = [version_id, str(path), actor, meta_json(meta)]
        flat = self.bus.call(f"registry create {version_id}",
                             lambda: self._create(keys=keys, args=args))
        if flat is None:
            raise VersionExistsError(version_id)
        self.bus.confirm(f"registry create {version_id}", keys[0])
        return VersionRecord.from_hash(_flat_to_dict(flat))

    def create_and_announce(self, version_id: str, path: str, stream: str,
                            fields: dict[str, str], *, actor: str = "",
                            meta: dict[str, Any] | None = None) -> tuple[VersionRecord, str]:
        """:meth:`create` and the ``XADD`` of its event to ``stream`` in one MULTI/EXEC.

        Both happen or neither (a version never exists without its event, nor an event
        without its version); returns the record and the stream entry id. VersionExistsError
        if the id is taken (also when another client creates it concurrently).
        """
        check_version_id(version_id)
        keys = [self._key(version_id), self._history_key(version_id), self._index_key]
        args = [version_id, str(path), actor, meta_json(meta)]

        def check(pipe: redis.client.Pipeline) -> None:
            if pipe.exists(keys[0]):
                raise VersionExistsError(version_id)

        try:
            flat, event_id = self._write_and_announce(
                "publish", "published", version_id, stream, fields, check,
                lambda pipe: queue_script(pipe, self._create, keys, args))
        except redis.exceptions.WatchError as e:
            raise VersionExistsError(version_id) from e
        if flat is None:  # cannot happen under WATCH; never report a version that was not made
            raise VersionExistsError(version_id)
        self.bus.confirm(f"registry publish {version_id}", keys[0])
        return VersionRecord.from_hash(_flat_to_dict(flat)), event_id

    def retry_and_announce(self, version_id: str, stream: str, fields: dict[str, str], *,
                           actor: str = "", reason: str = "") -> tuple[VersionRecord, str]:
        """An operator's retry: ``failed -> published`` and the ``XADD`` of the version's
        ``published`` event to ``stream`` in one MULTI/EXEC, as :meth:`create_and_announce`.

        Both happen or neither; the failure reason stays in the history (``reason`` is the
        retry's own entry) and the record's is cleared. Returns the record and the stream
        entry id. VersionNotFoundError if unknown; StateTransitionError (409) if the version
        is not ``failed`` (also when another client moved it concurrently).
        """
        keys = [self._key(version_id), self._history_key(version_id)]
        args = ["published", uuid.uuid4().hex, reason[:MAX_REASON], actor,
                ",".join(sorted(allowed_sources("published"))), ""]

        def check(pipe: redis.client.Pipeline) -> None:
            current = pipe.hget(keys[0], "state")
            if current is None:
                raise VersionNotFoundError(version_id)
            if current != "failed":
                raise StateTransitionError(version_id, current, "published",
                                           "only a failed version can be retried")

        try:
            reply, event_id = self._write_and_announce(
                "retry", "retried", version_id, stream, fields, check,
                lambda pipe: queue_script(pipe, self._transition, keys, args))
        except redis.exceptions.WatchError as e:
            raise StateTransitionError(version_id, self.state(version_id), "published",
                                       "the version changed while retrying it") from e
        if reply[0] != "ok":  # cannot happen under WATCH; never report a retry that did not happen
            raise StateTransitionError(version_id, reply[1] if len(reply) > 1 else "?",
                                       "published", "only a failed version can be retried")
        self.bus.confirm(f"registry retry {version_id}", keys[0])
        return VersionRecord.from_hash(_flat_to_dict(reply[1])), event_id

    def _write_and_announce(self, op: str, done: str, version_id: str, stream: str,
                            fields: dict[str, str],
                            check: Callable[[redis.client.Pipeline], None],
                            write: Callable[[redis.client.Pipeline], None]) -> tuple[Any, str]:
        """The one MULTI/EXEC behind :meth:`create_and_announce` and :meth:`retry_and_announce`.

        Under WATCH of the version's record: ``check`` reads and may raise, the stream key must
        be a stream (or absent); then ``write`` queues the record's script and the event's XADD
        is queued after it. Returns ``(write's reply, event id)``; a concurrent change to the
        record raises ``WatchError`` for the caller to name.
        """
        key = self._key(version_id)

        def attempt() -> tuple[Any, str]:
            try:
                with self.bus.client.pipeline(transaction=True) as pipe:
                    pipe.watch(key)
                    check(pipe)
                    kind = pipe.type(stream)
                    if kind not in ("none", "stream"):
                        raise ConfigError(f"the stream key {stream!r} holds a {kind}, not a "
                                          f"stream; nothing was {done}")
                    pipe.multi()
                    write(pipe)
                    self.bus.queue_publish(pipe, stream, fields)
                    reply, event_id = pipe.execute()
            except redis.exceptions.WatchError as e:
                # A cluster's pipeline reports a lost connection or a slot redirect while
                # watching as WatchError, raised from that error: nothing was written and
                # the record did not change, so it is the failover or migration to retry,
                # not a concurrent writer to name
                if e.__cause__ is not None and redis_transient(e.__cause__):
                    raise e.__cause__ from None
                raise
            return reply, event_id

        return self.bus.call(f"registry {op} {version_id}", attempt)

    def get(self, version_id: str) -> VersionRecord:
        """The version's record; VersionNotFoundError if unknown."""
        key = self._key(version_id)
        h = self.bus.call(f"registry get {version_id}", lambda: self.bus.client.hgetall(key))
        if not h:
            raise VersionNotFoundError(version_id)
        return VersionRecord.from_hash(h)

    def state(self, version_id: str) -> str:
        """The version's current state."""
        return self.get(version_id).state

    def transition(self, version_id: str, target: str, *, actor: str = "", reason: str = "",
                   reclaim: bool = False, expect_owner: str | None = None) -> VersionRecord:
        """Move a version to ``target`` atomically, or raise StateTransitionError.

        ``reclaim`` allows the ``converting -> converting`` re-entry; ``expect_owner``
        makes the move conditional on the last actor (a fence for work another consumer
        may have taken over). ``failed`` needs a reason.
        """
        srcs = allowed_sources(target, reclaim=reclaim)
        if target == "failed" and not reason:
            raise InputError("a version moves to 'failed' only with a reason")
        keys = [self._key(version_id), self._history_key(version_id)]
        token = uuid.uuid4().hex
        args = [target, token, reason[:MAX_REASON], actor, ",".join(sorted(srcs)) or "-",
                expect_owner or ""]
        reply = self.bus.call(f"registry {version_id} -> {target}",
                              lambda: self._transition(keys=keys, args=args))
        status = reply[0]
        if status == "ok":
            self.bus.confirm(f"registry {version_id} -> {target}", keys[0])
            return VersionRecord.from_hash(_flat_to_dict(reply[1]))
        if status == "missing":
            raise VersionNotFoundError(version_id)
        current = reply[1]
        if status == "owner":
            raise StateTransitionError(version_id, current, target,
                                       f"owned by {reply[2]!r}, not {expect_owner!r}")
        reentry = current == target and target in REENTRANT
        detail = "re-entry needs reclaim=True" if reentry else ""
        raise StateTransitionError(version_id, current, target, detail)

    def fail(self, version_id: str, reason: str, *, actor: str = "",
             expect_owner: str | None = None) -> VersionRecord:
        """Move a version to ``failed`` with ``reason``."""
        return self.transition(version_id, "failed", actor=actor, reason=reason,
                               expect_owner=expect_owner)

    def history(self, version_id: str) -> list[HistoryEntry]:
        """Every state change of the version, oldest first."""
        key = self._history_key(version_id)
        rows = self.bus.call(f"registry history {version_id}",
                             lambda: self.bus.client.lrange(key, 0, -1))
        if not rows:
            self.get(version_id)  # raises VersionNotFoundError for an unknown id
        out = []
        for r in rows:
            try:
                d = json.loads(r)
                out.append(HistoryEntry(str(d["from"]), str(d["to"]), float(d["at"]),
                                        str(d.get("reason", "")), str(d.get("actor", ""))))
            except (KeyError, TypeError, ValueError, RecursionError) as e:
                log.warning("history of %s: skipping an unreadable entry (%s)", version_id, e)
        return out

    def count(self) -> int:
        """How many versions the index holds (one ``ZCARD``)."""
        return int(self.bus.call("registry count", lambda: self.bus.client.zcard(self._index_key)))

    def page(self, limit: int, *, before: str | None = None,
             state: str | None = None) -> VersionPage:
        """The newest ``limit`` versions created before version ``before`` (None: the newest),
        optionally only those in ``state``; oldest first, with the cursor of the next page.

        The index (``P:versions``, scored by creation time) is read newest first in chunks
        of ``limit + 1`` ids, each chunk's records fetched by one pipelined round trip, so a
        page costs O(``limit``) whatever the history holds (with ``state``, O(versions
        scanned until ``limit`` match)). ``next_before`` is None once the page reaches the
        oldest version (with ``state``, it may instead lead to an empty last page).
        ``before`` is the ``next_before`` of the previous page (a version id);
        VersionNotFoundError if the index does not hold it. InputError if ``limit`` < 1.
        """
        if limit < 1:
            raise InputError(f"limit must be at least 1, got {limit}")
        newest_first: list[VersionRecord] = []
        cursor, more = before, True
        while more and len(newest_first) < limit:
            start = 0 if cursor is None else self._rank_after(cursor)
            ids = self.bus.call("registry list", lambda s=start: self.bus.client.zrevrange(
                self._index_key, s, s + limit))  # limit + 1 ids: one more says there is more
            newest_first += [r for r in self._records(ids) if state is None or r.state == state]
            more = len(ids) > limit
            cursor = ids[-1] if ids else cursor
        more = more or len(newest_first) > limit
        newest_first = newest_first[:limit]
        next_before = newest_first[-1].version_id if more and newest_first else None
        return VersionPage(records=newest_first[::-1], next_before=next_before)

    def recent_states(self, limit: int) -> list[VersionState]:
        """Id and state of the newest ``limit`` versions, oldest first: one ``ZREVRANGE`` and
        one pipelined round trip of ``HGET state``s, nothing parsed but the state (records
        gone or in an unknown state are skipped)."""
        ids = self.bus.call("registry list", lambda: self.bus.client.zrevrange(
            self._index_key, 0, limit - 1))

        def fetch() -> list[str | None]:
            with self.bus.client.pipeline(transaction=False) as pipe:
                for vid in ids:
                    pipe.hget(self._key(vid), "state")
                return pipe.execute()

        states = self.bus.call("registry list states", fetch) if ids else []
        return [VersionState(vid, st) for vid, st in zip(ids, states, strict=True)
                if st in STATES][::-1]

    def _rank_after(self, version_id: str) -> int:
        """Index position (newest first) just past ``version_id``; for a pruned id, just past
        the versions created after it (its tombstone's time; one created at the very same
        microsecond is listed, never skipped). VersionNotFoundError if neither the index nor
        the tombstones hold it."""
        check_version_id(version_id)

        def lookup() -> list[Any]:
            with self.bus.client.pipeline(transaction=False) as pipe:
                pipe.zrevrank(self._index_key, version_id)
                pipe.zscore(self._tombstones_key, version_id)
                return pipe.execute()

        rank, pruned_at = self.bus.call("registry cursor", lookup)
        if rank is not None:
            return int(rank) + 1
        if pruned_at is None:
            raise VersionNotFoundError(version_id, "registry index (the page cursor 'before')")
        return int(self.bus.call("registry cursor", lambda: self.bus.client.zcount(
            self._index_key, f"({pruned_at!r}", "+inf")))

    def ages(self) -> list[VersionAge]:
        """Id, state and time of its last change of every version, oldest first: the index
        and, per :data:`LIST_CHUNK`, one pipelined round trip of ``HMGET``s (records gone or
        unreadable are skipped). What the retention pass decides on."""
        ids = self.bus.call("registry list", lambda: self.bus.client.zrange(self._index_key, 0, -1))
        out: list[VersionAge] = []
        for i in range(0, len(ids), LIST_CHUNK):
            chunk = ids[i:i + LIST_CHUNK]

            def fetch(chunk: list[str] = chunk) -> list[list[str | None]]:
                with self.bus.client.pipeline(transaction=False) as pipe:
                    for vid in chunk:
                        pipe.hmget(self._key(vid), ["state", "updated_at"])
                    return pipe.execute()

            for vid, (st, at) in zip(chunk, self.bus.call("registry ages", fetch), strict=True):
                try:
                    if st in STATES:
                        out.append(VersionAge(vid, st, float(at)))
                except (TypeError, ValueError):
                    log.warning("registry ages skips %s (updated_at %r)", vid, at)
        return out

    def prune(self, version_id: str) -> bool:
        """Delete a ``retired`` version's record, history and index entry in one script,
        keeping its creation time as a tombstone for page cursors. Call it after the
        version's store directories are gone. Idempotent: False if nothing was left (an
        index entry without its record is cleaned too); StateTransitionError if the version
        is in another state."""
        keys = [self._key(version_id), self._history_key(version_id), self._index_key,
                self._tombstones_key]
        reply = self.bus.call(f"registry prune {version_id}", lambda: self._prune(
            keys=keys, args=[version_id, "retired", MAX_TOMBSTONES]))
        if reply[0] == "illegal":
            raise StateTransitionError(version_id, reply[1], "pruned",
                                       "only a retired version is pruned")
        self.bus.confirm(f"registry prune {version_id}", keys[0])
        return reply[0] == "ok"

    def _records(self, ids: list[str]) -> list[VersionRecord]:
        """The readable records of ``ids``, in order, fetched in one pipelined round trip;
        vanished or unreadable ones are skipped (logged)."""
        if not ids:
            return []

        def fetch() -> list[dict[str, str]]:
            with self.bus.client.pipeline(transaction=False) as pipe:
                for vid in ids:
                    pipe.hgetall(self._key(vid))
                return pipe.execute()

        out = []
        for vid, h in zip(ids, self.bus.call("registry list records", fetch), strict=True):
            if not h:
                continue  # the index outlived the record: not found, skip it
            try:
                out.append(VersionRecord.from_hash(h))
            except UnreadableRecordError as e:
                log.warning("registry list skips %s (%s)", vid, e)
        return out

    def list_versions(self, state: str | None = None, *, limit: int | None = None,
                      before: str | None = None) -> list[VersionRecord]:
        """Versions, oldest first, optionally only those in ``state``: all of them, or with
        ``limit`` the newest ``limit`` (created before ``before``; see :meth:`page`)."""
        if limit is not None:
            return self.page(limit, before=before, state=state).records
        ids = self.bus.call("registry list", lambda: self.bus.client.zrange(self._index_key, 0, -1))
        out: list[VersionRecord] = []
        for i in range(0, len(ids), LIST_CHUNK):
            out += [r for r in self._records(ids[i:i + LIST_CHUNK])
                    if state is None or r.state == state]
        return out
