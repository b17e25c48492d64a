"""The guidance store: rollout guidance records in Redis, under a byte budget and a TTL.

The sampler writes one opaque record (bytes, typically 10 KB to 100 MB) per rollout of a
weight version; the learner reads them back later. This module never parses a record.

Key layout (``P`` is ``<key_prefix>:guidance``, ``v`` a version id, ``r`` a rollout id,
``g`` the generation of one put, ``i`` a chunk number)::

    P:index                  zset   v -> order of its first put (oldest first)
    P:seq                    string counter behind that order
    P:bytes                  hash   v -> payload bytes the version holds
    P:total                  string payload bytes of all versions (the budget's measure)
    P:v:<v>                  hash   created (server time), seq, deadline_ms (0: no TTL)
    P:v:<v>:rollouts         set    rollout ids of the version
    P:v:<v>:r:<r>            hash   len, n (chunks), cs (chunk size), gen, crc32, created
    P:v:<v>:c:<r>:<g>:<i>    string chunk i of generation g (at most ``chunk_bytes``)
    P:v:<v>:lessees          set    consumers that took a lease on the version
    P:v:<v>:lease:<c>        string one consumer's lease, expiring by itself (PX)
    P:tomb:<v>               string JSON: when and why the version was evicted (EX a day)

Why a put is atomic. A put is one MULTI/EXEC transaction: the chunk SETs of the new
generation, then one Lua script that reads the old meta, checks the budget, evicts,
deletes the old generation's chunks, writes the new meta and updates the accounting.
Redis runs the queued commands of an EXEC back to back, with no other client in between,
and writes them to the append-only file as one block that is replayed whole or not at
all. The chunks carry the generation in their names, so the new ones never overwrite the
old ones: until EXEC a reader sees the old meta and the old chunks, after it the new
meta and the new chunks. A client that dies (or loses Redis) before EXEC leaves a
MULTI that the server discards with the connection; nothing was applied. Both payload
paths (below) send this same transaction, so the argument holds for either. Because the
script reads the old meta inside the same EXEC, no WATCH (and no WatchError retry) is
needed; readers detect a generation replaced between their two round trips (its chunks
are gone) and read again. Every record also carries the crc32 and length of the whole
blob, checked on every read.

Budget and eviction. ``P:total`` counts payload bytes (not Redis' own overhead). When a
put would take it over ``budget_bytes``, whole versions are evicted, oldest first put
first, never the version being written: first those no consumer holds a lease on
(:meth:`GuidanceStore.acquire`; a lease is a key with a TTL, so a crashed learner's
lease runs out by itself). If that is not enough, ``on_in_use="evict"`` evicts leased
versions too, oldest first, loudly: a warning in the log, the eviction counted with
``in_use="true"``, and a tombstone that says "evicted while in use by <consumers>", which
a reader receives as :class:`GuidanceEvictedError`. ``on_in_use="refuse"`` refuses the
put instead (:class:`GuidanceBudgetError`) and evicts and writes nothing. A version
larger than the whole budget is always refused. The accounting and the eviction run in
Lua scripts, so concurrent puts keep ``P:total`` equal to the sum of ``P:bytes``.

TTL. With ``ttl_s`` every key of a version expires at one moment, ``ttl_s`` after the
version's first put (later puts to it share that deadline). Redis deletes expired keys by
itself but tells nobody, so every script first reconciles: a version in ``P:index``
whose ``P:v:<v>`` is gone leaves the accounting and gets an "expired" tombstone.

Speed. Payload bytes move on one of two paths, chosen when the store is made
(``payload_path``). The socket path, for a real Redis, runs on connections of its own:
chunks are sent from memoryviews of the caller's buffer (no copies), and read replies are
received straight into the record's buffer (``recv_into``) instead of through redis-py's
parser. The crc32 of a large put is computed in a worker thread while the chunks are on
the wire; that of a large read while the next record is received. The pipeline path is
for clients without a socket to read from, the embedded in-process server
(``services/alignd/infra/redis_clients.py``) in particular: it uses only redis-py's public API,
a put is one ``pipeline(transaction=True)`` holding the chunk SETs and the same commit
script, and a read pipelines the chunk GETs and joins the replies. Same keys, scripts,
checks and errors; its speed is the server's (the embedded one: hundreds of MB/s for
MB-sized records, tens of MB/s for 10 KB ones). ``"auto"`` takes the pipeline path for
an embedded client, and switches to it for good the first time a payload connection
turns out to have no real socket. Keys are computed inside the scripts, so the store
needs one Redis (standalone or Sentinel), not Redis Cluster.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple

import redis
from alignclient.errors import (
    ConfigError,
    GuidanceBudgetError,
    GuidanceChecksumError,
    GuidanceEvictedError,
    GuidanceNotFoundError,
    InputError,
    PayloadTooLargeError,
    StoreError,
)

from alignd.infra.bus import Backoff, RedisBus
from alignd.infra.redis_clients import BINARY_TIMEOUT_S, binary_client, client_for, is_embedded
from alignd.infra.settings import Settings
from alignd.infra.telemetry import Metrics

log = logging.getLogger(__name__)

#: Version ids, rollout ids and consumer names: safe as key parts, no ``:``.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Redis refuses bulk strings above 512 MiB (``proto-max-bulk-len``).
MAX_CHUNK_BYTES = 512 << 20
#: Buffers at least this large are sent as they are; smaller ones are joined first.
_SEND_WHOLE = 64 << 10
#: Records at least this large get their crc32 in the worker thread.
_CRC_IN_THREAD = 1 << 20
_TOMBSTONE_TTL_S = 86_400

# ---------------------------------------------------------------------------------
# Lua. Every script starts with the helpers; ARGV[1] is always the prefix P and
# KEYS are P:index, P:bytes, P:total, P:seq.
_LUA_HELPERS = """
local P = ARGV[1]
local INDEX, BYTES, TOTAL, SEQ = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function vkey(v) return P .. ':v:' .. v end
local function rkey(v, r) return P .. ':v:' .. v .. ':r:' .. r end
local function ckey(v, r, g, i) return P .. ':v:' .. v .. ':c:' .. r .. ':' .. g .. ':' .. i end
local function lkey(v, c) return P .. ':v:' .. v .. ':lease:' .. c end
local function tkey(v) return P .. ':tomb:' .. v end
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function vbytes(v) return tonumber(redis.call('HGET', BYTES, v) or '0') end

-- consumers whose lease on v is alive (forgets the ones that ran out)
local function lessees(v)
  local set = vkey(v) .. ':lessees'
  local out = {}
  for _, c in ipairs(redis.call('SMEMBERS', set)) do
    if redis.call('EXISTS', lkey(v, c)) == 1 then out[#out + 1] = c
    else redis.call('SREM', set, c) end
  end
  table.sort(out)
  return out
end

-- delete every key of v and its accounting; returns the bytes it held
local function drop_version(v)
  local rs = vkey(v) .. ':rollouts'
  for _, r in ipairs(redis.call('SMEMBERS', rs)) do
    local m = redis.call('HMGET', rkey(v, r), 'n', 'gen')
    if m[1] then
      for i = 0, tonumber(m[1]) - 1 do redis.call('UNLINK', ckey(v, r, m[2], i)) end
    end
    redis.call('UNLINK', rkey(v, r))
  end
  local ls = vkey(v) .. ':lessees'
  for _, c in ipairs(redis.call('SMEMBERS', ls)) do redis.call('UNLINK', lkey(v, c)) end
  redis.call('UNLINK', rs, ls, vkey(v))
  local b = vbytes(v)
  redis.call('HDEL', BYTES, v)
  redis.call('ZREM', INDEX, v)
  redis.call('DECRBY', TOTAL, b)
  return b
end

local function tombstone(v, at, reason, users, b, ttl)
  redis.call('SET', tkey(v), cjson.encode({at = at, reason = reason, in_use_by = users,
                                           bytes = b}), 'EX', ttl)
end

-- versions whose keys expired leave the accounting; ARGV[2] tombstone ttl, ARGV[3] ttl text
local function reconcile(now)
  local gone = 0
  for _, v in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
    if redis.call('EXISTS', vkey(v)) == 0 then
      local b = drop_version(v)
      if redis.call('EXISTS', tkey(v)) == 0 then
        tombstone(v, now, 'expired: its TTL' .. ARGV[3] .. ' since the first put ran out', {},
                  b, tonumber(ARGV[2]))
      end
      gone = gone + 1
    end
  end
  return gone
end
"""

# ARGV: P, tomb_ttl, ttl_text, version, gen, budget (-1: none), on_in_use, ttl_ms (0: none),
#       chunk size, then per rollout: id, len, chunks, crc
_COMMIT_LUA = _LUA_HELPERS + """
local v, gen, budget, on_in_use = ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local ttl_ms, cs = tonumber(ARGV[8]), ARGV[9]
local now = now_s()
reconcile(now)
local recs, delta = {}, 0
for k = 10, #ARGV, 4 do
  local r, len, n = ARGV[k], tonumber(ARGV[k + 1]), tonumber(ARGV[k + 2])
  local old = redis.call('HMGET', rkey(v, r), 'len', 'n', 'gen')
  delta = delta + len - tonumber(old[1] or '0')
  recs[#recs + 1] = {r, len, n, ARGV[k + 3], old[2], old[3]}
end
local function unlink_new()
  for _, x in ipairs(recs) do
    for i = 0, x[3] - 1 do redis.call('UNLINK', ckey(v, x[1], gen, i)) end
  end
end
local total = tonumber(redis.call('GET', TOTAL) or '0')
local mine = vbytes(v)
local evict = {}
if budget >= 0 and total + delta > budget then
  if mine + delta > budget then
    unlink_new()
    return {'too_large', mine + delta, total}
  end
  local need = total + delta - budget
  local leased = {}
  for _, c in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
    if c ~= v then
      local who = lessees(c)
      if #who > 0 then leased[#leased + 1] = {c, who}
      elseif need > 0 then
        evict[#evict + 1] = {c, who}
        need = need - vbytes(c)
      end
    end
  end
  if need > 0 then
    if on_in_use ~= 'evict' then
      unlink_new()
      local out = {'in_use', need, total}
      for _, e in ipairs(leased) do
        out[#out + 1] = e[1]
        out[#out + 1] = table.concat(e[2], ',')
      end
      return out
    end
    for _, e in ipairs(leased) do
      if need > 0 then
        evict[#evict + 1] = e
        need = need - vbytes(e[1])
      end
    end
  end
end
local reply = {'ok', 0}
for _, e in ipairs(evict) do
  local c, who = e[1], e[2]
  local b = drop_version(c)
  local why = 'evicted to keep the guidance store within its budget of ' .. ARGV[6] ..
              ' bytes, making room for version ' .. v
  if #who > 0 then
    why = 'evicted while in use by ' .. table.concat(who, ', ') .. " (on_in_use='evict'): " ..
          'the budget of ' .. ARGV[6] .. ' bytes had no room for version ' .. v ..
          ' otherwise'
  end
  tombstone(c, now, why, who, b, tonumber(ARGV[2]))
  reply[#reply + 1] = c
  reply[#reply + 1] = b
  reply[#reply + 1] = table.concat(who, ',')
end
local vk = vkey(v)
local deadline = 0
if redis.call('EXISTS', vk) == 0 then
  local seq = redis.call('INCR', SEQ)
  if ttl_ms > 0 then deadline = math.floor(now * 1000) + ttl_ms end
  redis.call('HSET', vk, 'created', string.format('%.6f', now), 'seq', seq,
             'deadline_ms', string.format('%d', deadline))
  redis.call('ZADD', INDEX, seq, v)
  redis.call('DEL', tkey(v))
else
  deadline = tonumber(redis.call('HGET', vk, 'deadline_ms') or '0')
end
local created = string.format('%.6f', now)
local rs = vk .. ':rollouts'
for _, x in ipairs(recs) do
  local r, n, old_n, old_gen = x[1], x[3], x[5], x[6]
  if old_gen and old_gen ~= gen then
    for i = 0, tonumber(old_n) - 1 do redis.call('UNLINK', ckey(v, r, old_gen, i)) end
  end
  local rk = rkey(v, r)
  redis.call('HSET', rk, 'len', x[2], 'n', n, 'cs', cs, 'gen', gen, 'crc', x[4],
             'created', created)
  redis.call('SADD', rs, r)
  if deadline > 0 then
    redis.call('PEXPIREAT', rk, deadline)
    for i = 0, n - 1 do redis.call('PEXPIREAT', ckey(v, r, gen, i), deadline) end
  end
end
if deadline > 0 then
  redis.call('PEXPIREAT', vk, deadline)
  redis.call('PEXPIREAT', rs, deadline)
end
redis.call('HINCRBY', BYTES, v, delta)
reply[2] = redis.call('INCRBY', TOTAL, delta)
return reply
"""

# ARGV: P, tomb_ttl, ttl_text. Returns the total after reconciling.
_RECONCILE_LUA = _LUA_HELPERS + """
reconcile(now_s())
return tonumber(redis.call('GET', TOTAL) or '0')
"""

# ARGV: P, tomb_ttl, ttl_text, version. Returns {existed, bytes, total}.
_DELETE_LUA = _LUA_HELPERS + """
local now = now_s()
reconcile(now)
local v = ARGV[4]
if redis.call('EXISTS', vkey(v)) == 0 then
  return {0, 0, tonumber(redis.call('GET', TOTAL) or '0')}
end
local b = drop_version(v)
tombstone(v, now, 'deleted by request (delete_version)', {}, b, tonumber(ARGV[2]))
return {1, b, tonumber(redis.call('GET', TOTAL) or '0')}
"""

# ARGV: P, tomb_ttl, ttl_text, version, consumer, ttl_ms
_ACQUIRE_LUA = _LUA_HELPERS + """
local v, c, ttl = ARGV[4], ARGV[5], tonumber(ARGV[6])
redis.call('SET', lkey(v, c), string.format('%.6f', now_s()), 'PX', ttl)
local set = vkey(v) .. ':lessees'
redis.call('SADD', set, c)
if redis.call('PTTL', set) < ttl then redis.call('PEXPIRE', set, ttl) end  -- -1: new set
return 1
"""

# ARGV: P, tomb_ttl, ttl_text, version, consumer. Returns 1 if the lease was held.
_RELEASE_LUA = _LUA_HELPERS + """
local v, c = ARGV[4], ARGV[5]
redis.call('SREM', vkey(v) .. ':lessees', c)
return redis.call('DEL', lkey(v, c))
"""

# ARGV: P, tomb_ttl, ttl_text. Returns {total, v1, bytes1, rollouts1, created1, lessees1, ...}.
_LIST_LUA = _LUA_HELPERS + """
reconcile(now_s())
local out = {tonumber(redis.call('GET', TOTAL) or '0')}
for _, v in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
  out[#out + 1] = v
  out[#out + 1] = vbytes(v)
  out[#out + 1] = redis.call('SCARD', vkey(v) .. ':rollouts')
  out[#out + 1] = redis.call('HGET', vkey(v), 'created') or '0'
  out[#out + 1] = table.concat(lessees(v), ',')
end
return out
"""


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


@dataclass
class _Meta:
    length: int
    chunks: int
    chunk_bytes: int
    gen: str
    crc: int


class _NoSocket(Exception):
    """A payload connection without a real socket: use the pipeline path instead."""


class _RespError(Exception):
    """An error reply read in the middle of a reply stream (raised once it is consumed)."""


class _RespReader:
    """Minimal RESP2 reader on a socket; bulk replies land straight in caller buffers."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def _more(self) -> None:
        """Receive whatever is there (at least one byte) into the line buffer."""
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        data = self.sock.recv(1 << 16)
        if not data:
            raise redis.exceptions.ConnectionError("Redis closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        """The next CRLF-terminated line, without the CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.pos)
            if i >= 0:
                line = bytes(self.buf[self.pos : i])
                self.pos = i + 2
                return line
            self._more()

    def _into(self, dst: memoryview) -> None:
        """Fill ``dst`` from the buffer, then from the socket directly; eat the CRLF."""
        n = len(dst)
        have = min(len(self.buf) - self.pos, n)
        dst[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        while have < n:
            got = self.sock.recv_into(dst[have:])
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection")
            have += got
        while len(self.buf) - self.pos < 2:
            self._more()
        self.pos += 2

    def reply(self) -> Any:
        """One whole reply (error replies are returned as _RespError, not raised)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return _RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self._into(memoryview(out))
            return bytes(out)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise redis.exceptions.InvalidResponse(f"unexpected RESP reply {line[:40]!r}")

    def bulk_into(self, dst: memoryview) -> int | _RespError | None:
        """A bulk reply of ``len(dst)`` bytes into ``dst``: its length, None (nil) or the error.

        A bulk of another length is read and thrown away (the stream stays in step) and
        its length returned, so that the caller can report it.
        """
        line = self._line()
        if line[:1] == b"-":
            return _RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"expected a bulk reply, got {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        self._into(dst if n == len(dst) else memoryview(bytearray(n)))
        return n

    @property
    def drained(self) -> bool:
        """True when nothing past the replies read so far has arrived."""
        return self.pos == len(self.buf)


def _pack(commands: Iterable[Sequence[bytes | memoryview]]) -> list[bytes | memoryview]:
    """RESP-encode commands; arguments of 64 KiB or more stay separate buffers (no copy)."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for cmd in commands:
        small.append(b"*%d\r\n" % len(cmd))
        for arg in cmd:
            n = len(arg)
            small.append(b"$%d\r\n" % n)
            if n >= _SEND_WHOLE:
                out.append(b"".join(small))
                out.append(arg)
                small = [b"\r\n"]
            else:
                small.append(arg)
                small.append(b"\r\n")
    if small:
        out.append(b"".join(small))
    return out


def _check_id(value: object, what: str) -> str:
    """``value`` if it is a safe id (``ID_RE``), else InputError."""
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise InputError(f"{what} {value!r} must be a string matching {ID_RE.pattern}")
    return value


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


def _b(x: object) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _crc_and_copy(buf: bytearray) -> tuple[int, bytes]:
    return zlib.crc32(buf), bytes(buf)


def _raise_if_corrupt(version: str, metas: dict[str, _Meta], bad: dict[str, str]) -> None:
    """GuidanceChecksumError naming the first corrupt record of a read, if there is one."""
    if bad:
        r = next(iter(bad))
        raise GuidanceChecksumError(f"guidance record of rollout {r!r}, weight version "
                                    f"{version!r} ({metas[r].length} bytes) is corrupt: {bad[r]}")


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
        backoff: Backoff | None = None,
        metrics: Metrics | None = None,
        socket_timeout_s: float = BINARY_TIMEOUT_S,
        payload_path: Literal["auto", "socket", "pipeline"] = "auto",
    ):
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
        pool = client.connection_pool
        if pool.connection_kwargs.get("decode_responses"):
            raise ConfigError("the guidance store needs a binary-safe client "
                              "(decode_responses=False)")
        self.client = client
        on_retry = (lambda what, e: metrics.redis_retries.inc()) if metrics is not None else None
        self.bus = RedisBus(client, backoff=backoff, on_retry=on_retry)
        self.prefix = f"{prefix}:guidance"
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.max_record_bytes = max_record_bytes
        self.on_in_use = on_in_use
        self.tombstone_ttl_s = int(tombstone_ttl_s)
        self.metrics = metrics
        #: "socket" or "pipeline": how payload bytes move (see the module docstring).
        self.payload_path = payload_path
        if payload_path == "auto":
            self.payload_path = "pipeline" if is_embedded(client) else "socket"
        self._bulk: redis.ConnectionPool | None = None
        if self.payload_path == "socket":
            # payload connections: same server and options, RESP2, driven only by this module
            kwargs = {k: v for k, v in pool.connection_kwargs.items()
                      if not k.startswith(("maint_notifications", "orig_"))}  # RESP3-only extras
            kwargs.update(protocol=2, decode_responses=False)
            self._bulk = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        self._workers: ThreadPoolExecutor | None = None
        self._keys = [f"{self.prefix}:{k}" for k in ("index", "bytes", "total", "seq")]
        self._scripts = {name: client.register_script(src) for name, src in (
            ("reconcile", _RECONCILE_LUA), ("delete", _DELETE_LUA), ("acquire", _ACQUIRE_LUA),
            ("release", _RELEASE_LUA), ("list", _LIST_LUA))}

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> GuidanceStore:
        """A store on ``settings.redis_url`` (None: embedded) with the ``guidance_*``
        settings; it owns (and closes) its client."""
        backoff = Backoff(give_up_after_s=settings.redis_retry_s)
        store = cls(binary_client(settings), prefix=settings.key_prefix,
                    budget_bytes=settings.guidance_budget_bytes, ttl_s=settings.guidance_ttl_s,
                    chunk_bytes=settings.guidance_chunk_bytes,
                    max_record_bytes=settings.guidance_max_record_bytes,
                    on_in_use=settings.guidance_on_in_use, backoff=backoff, metrics=metrics)
        store._own_client = True
        return store

    def close(self) -> None:
        """Close the payload connections, the worker thread and an owned client."""
        if self._bulk is not None:
            self._bulk.disconnect()
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._workers = None
        if self._own_client:
            self.client.close()

    def __enter__(self) -> GuidanceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- keys and small helpers ---------------------------------------------------

    def _vkey(self, version: str) -> str:
        return f"{self.prefix}:v:{version}"

    def _rkey(self, version: str, rollout: str) -> str:
        return f"{self.prefix}:v:{version}:r:{rollout}"

    def _ckey(self, version: str, rollout: str, gen: str, i: int) -> bytes:
        return f"{self.prefix}:v:{version}:c:{rollout}:{gen}:{i}".encode()

    def _argv(self, *extra: object) -> list[object]:
        ttl_text = "" if self.ttl_s is None else f" of {self.ttl_s:g} s"
        return [self.prefix, self.tombstone_ttl_s, ttl_text, *extra]

    def _script(self, name: str, *extra: object) -> Any:
        fn = self._scripts[name]
        return self.bus.call(f"guidance {name}",
                             lambda: fn(keys=self._keys, args=self._argv(*extra)))

    def _pool(self) -> ThreadPoolExecutor:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(1, thread_name_prefix="guidance-crc")
        return self._workers

    def _exchange(self, fn):
        """Run ``fn(conn, reader)`` on a payload connection; drop the connection on failure."""
        conn = self._bulk.get_connection()
        ok = False
        try:
            sock = getattr(conn, "_sock", None)
            if sock is None:
                raise redis.exceptions.ConnectionError("payload connection has no socket")
            if not isinstance(sock, socket.socket):  # connected, but not over a socket
                raise _NoSocket(type(sock).__name__)
            reader = _RespReader(sock)
            try:
                out = fn(conn, reader)
            except TimeoutError as e:  # socket.timeout
                raise redis.exceptions.TimeoutError(f"reading from Redis: {e}") from e
            except OSError as e:
                raise redis.exceptions.ConnectionError(f"reading from Redis: {e}") from e
            ok = reader.drained
            if not ok:
                log.warning("guidance store: unexpected bytes after the replies; reconnecting")
            return out
        finally:
            if not ok:
                conn.disconnect()
            self._bulk.release(conn)

    def _payload(self, what: str, on_socket, pipelined):
        """Run one payload operation: ``on_socket(conn, reader)`` on the socket path,
        ``pipelined()`` on the pipeline path (both retried by the bus)."""
        if self.payload_path == "socket":
            try:
                return self.bus.call(what, lambda: self._exchange(on_socket))
            except _NoSocket as e:
                log.info("guidance store: payload connections have no real socket (%s); "
                         "using the pipeline path from now on", e)
                self.payload_path = "pipeline"
        return self.bus.call(what, pipelined)

    def _set_stored(self, total: int) -> None:
        if self.metrics is not None:
            self.metrics.guidance_stored_bytes.set(total)

    # --- put ------------------------------------------------------------------------

    def put(self, version: str, rollout_id: str, blob: bytes | bytearray | memoryview) -> PutResult:
        """Store one rollout's record, replacing any previous one atomically."""
        return self.put_many(version, {rollout_id: blob})

    def put_many(self, version: str,
                 records: Mapping[str, bytes | bytearray | memoryview]) -> PutResult:
        """Store many rollouts' records of one version in one atomic transaction."""
        _check_id(version, "version id")
        if not isinstance(records, Mapping) or not records:
            raise InputError("put_many needs a non-empty mapping of rollout id -> record")
        views: dict[str, memoryview] = {}
        for rid, blob in records.items():
            _check_id(rid, "rollout id")
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
        if size >= _CRC_IN_THREAD:
            crcs: Future | dict[str, int] = self._pool().submit(
                lambda: {r: zlib.crc32(mv) for r, mv in views.items()})
        else:
            crcs = {r: zlib.crc32(mv) for r, mv in views.items()}
        reply = self._payload(f"guidance put {version}",
                              lambda c, rd: self._put_once(c, rd, version, views, crcs),
                              lambda: self._put_pipelined(version, views, crcs))
        return self._put_outcome(version, views, size, reply)

    def _put_once(self, conn, reader: _RespReader, version: str, views: dict[str, memoryview],
                  crcs: Future | dict[str, int]) -> list:
        """MULTI, chunk SETs, (crc32 ready) commit script, EXEC; the script's reply."""
        gen = uuid.uuid4().hex[:16]  # fresh per attempt: a retried put never meets its chunks
        step = self.chunk_bytes
        sets: list[tuple[bytes, bytes, memoryview]] = [(b"MULTI",)]
        counts: dict[str, int] = {}
        for rid, mv in views.items():
            n = (mv.nbytes + step - 1) // step
            counts[rid] = n
            for i in range(n):
                part = mv[i * step : (i + 1) * step]
                sets.append((b"SET", self._ckey(version, rid, gen, i),
                             part if part.nbytes >= _SEND_WHOLE else part.tobytes()))
        conn.send_packed_command(_pack(sets), check_health=False)
        args = self._commit_args(version, gen, views, counts, crcs)
        commit = [b"EVAL", _COMMIT_LUA.encode(), b"4", *(k.encode() for k in self._keys),
                  *(_b(a) for a in args)]
        conn.send_packed_command(_pack([commit, (b"EXEC",)]), check_health=False)
        queued = [reader.reply() for _ in range(len(sets) + 1)]
        result = reader.reply()
        errors = [q for q in queued if isinstance(q, _RespError)]
        if isinstance(result, _RespError) or errors:
            raise StoreError(f"guidance put {version}: Redis refused the transaction: "
                             f"{errors[0] if errors else result}")
        script = result[-1]
        if isinstance(script, _RespError):
            # the SETs ran but the script did not: remove the unreferenced new chunks
            self._unlink_quietly([s[1] for s in sets[1:]])
            raise StoreError(f"guidance put {version}: the commit script failed: {script}")
        return script

    def _commit_args(self, version: str, gen: str, views: dict[str, memoryview],
                     counts: dict[str, int], crcs: Future | dict[str, int]) -> list[object]:
        """ARGV of the commit script (waits for the crc32s if a worker computes them)."""
        crc = crcs.result() if isinstance(crcs, Future) else crcs
        budget = -1 if self.budget_bytes is None else self.budget_bytes
        ttl_ms = 0 if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        args = self._argv(version, gen, budget, self.on_in_use, ttl_ms, self.chunk_bytes)
        for rid, mv in views.items():
            args += [rid, mv.nbytes, counts[rid], crc[rid]]
        return args

    def _put_pipelined(self, version: str, views: dict[str, memoryview],
                       crcs: Future | dict[str, int]) -> list:
        """The same transaction as :meth:`_put_once` through redis-py's pipeline."""
        gen = uuid.uuid4().hex[:16]  # fresh per attempt: a retried put never meets its chunks
        step = self.chunk_bytes
        pipe = self.client.pipeline(transaction=True)
        keys: list[bytes] = []
        counts: dict[str, int] = {}
        for rid, mv in views.items():
            n = (mv.nbytes + step - 1) // step
            counts[rid] = n
            for i in range(n):
                keys.append(self._ckey(version, rid, gen, i))
                pipe.set(keys[-1], mv[i * step : (i + 1) * step])
        pipe.eval(_COMMIT_LUA, 4, *self._keys, *self._commit_args(version, gen, views, counts,
                                                                   crcs))
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.exceptions.ResponseError as e:  # EXECABORT: nothing was applied
            raise StoreError(f"guidance put {version}: Redis refused the transaction: {e}") from e
        script = results[-1]
        if isinstance(script, Exception):
            # the SETs ran but the script did not: remove the unreferenced new chunks
            self._unlink_quietly(keys)
            raise StoreError(f"guidance put {version}: the commit script failed: {script}")
        return script

    def _unlink_quietly(self, keys: list[bytes]) -> None:
        try:
            for i in range(0, len(keys), 1000):
                self.client.unlink(*keys[i : i + 1000])
        except redis.exceptions.RedisError as e:
            log.warning("guidance store: could not remove orphan chunks: %s", e)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.guidance_refused_puts.inc()

    def _put_outcome(self, version: str, views: dict[str, memoryview], size: int,
                     reply: list) -> PutResult:
        """Turn the commit script's reply into a PutResult, or raise the refusal."""
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
            who = tuple(w for w in reply[i + 2].decode().split(",") if w)
            ev = Eviction(reply[i].decode(), int(reply[i + 1]), who)
            evicted.append(ev)
            if who:
                log.warning("guidance store: evicted version %r (%d bytes) while in use by %s "
                            "to make room for version %r (on_in_use='evict')",
                            ev.version, ev.bytes, ", ".join(who), version)
            else:
                log.info("guidance store: evicted version %r (%d bytes) to make room for %r",
                         ev.version, ev.bytes, version)
            if self.metrics is not None:
                in_use = "true" if who else "false"
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
        _check_id(version, "version id")
        if missing not in ("raise", "skip"):
            raise InputError(f"missing must be 'raise' or 'skip', not {missing!r}")
        ids = list(dict.fromkeys(_check_id(r, "rollout id") for r in rollout_ids))
        out: dict[str, bytes] = {}
        absent: list[str] = []
        todo = ids
        for attempt in range(2):
            metas = self._metas(version, todo)
            absent += [r for r in todo if metas[r] is None]
            found = {r: m for r, m in metas.items() if m is not None}
            got, stale = self._payload(
                f"guidance get {version}",
                lambda c, rd, f=found: self._read_chunks(c, rd, version, f),
                lambda f=found: self._read_chunks_pipelined(version, f)) if found else ({}, [])
            out.update(got)
            if not stale:
                break
            if attempt == 1:
                raise GuidanceNotFoundError(version, stale[0], detail="replaced or removed "
                                            "while being read, twice in a row")
            todo = stale
        if self.metrics is not None:
            self.metrics.guidance_hits.inc(len(out))
            self.metrics.guidance_get_bytes.inc(sum(len(b) for b in out.values()))
            self.metrics.guidance_misses.inc(len(absent))
        if absent and missing == "raise":
            raise self._missing_error(version, absent[0])
        return {r: out[r] for r in ids if r in out}

    def _metas(self, version: str, ids: list[str]) -> dict[str, _Meta | None]:
        """One pipelined round trip: the meta of every rollout in ``ids`` (None if absent)."""
        def fetch() -> list:
            pipe = self.client.pipeline(transaction=False)
            for r in ids:
                pipe.hmget(self._rkey(version, r), "len", "n", "cs", "gen", "crc")
            return pipe.execute()
        rows = self.bus.call(f"guidance metas {version}", fetch) if ids else []
        out: dict[str, _Meta | None] = {}
        for r, (length, n, cs, gen, crc) in zip(ids, rows, strict=True):
            out[r] = None if length is None else _Meta(int(length), int(n), int(cs),
                                                       gen.decode(), int(crc))
        return out

    def _read_chunks(self, conn, reader: _RespReader, version: str,
                     metas: dict[str, _Meta]) -> tuple[dict[str, bytes], list[str]]:
        """GET every chunk into its record's buffer; check lengths and crc32s."""
        gets = [(b"GET", self._ckey(version, r, m.gen, i))
                for r, m in metas.items() for i in range(m.chunks)]
        if not gets:
            return {}, []
        conn.send_packed_command(_pack(gets), check_health=False)
        done: dict[str, tuple[int, bytes] | Future] = {}
        stale: list[str] = []
        bad: dict[str, str] = {}
        error: _RespError | None = None
        for r, m in metas.items():
            buf = bytearray(m.length)
            view = memoryview(buf)
            off = 0
            ok = True
            for i in range(m.chunks):
                size = m.chunk_bytes  # the last chunk is shorter: the view ends there
                dst = view[off : off + size] if ok else memoryview(bytearray(0))
                got = reader.bulk_into(dst)
                if isinstance(got, _RespError):
                    error, ok = got, False
                elif got is None:
                    if ok:
                        stale.append(r)
                    ok = False
                elif got != len(dst) and ok:
                    bad[r] = f"chunk {i} holds {got} bytes, {len(dst)} expected"
                    ok = False
                off += size
            if ok and off < m.length:
                bad[r] = f"{m.chunks} chunks hold less than the recorded {m.length} bytes"
                ok = False
            if ok:
                done[r] = (self._pool().submit(_crc_and_copy, buf) if m.length >= _CRC_IN_THREAD
                           else _crc_and_copy(buf))
        if error is not None:
            raise StoreError(f"guidance get {version}: {error}")
        out: dict[str, bytes] = {}
        for r, res in done.items():
            crc, data = res.result() if isinstance(res, Future) else res
            if crc != metas[r].crc:
                bad[r] = f"crc32 {crc:08x}, the meta records {metas[r].crc:08x}"
            else:
                out[r] = data
        _raise_if_corrupt(version, metas, bad)
        return out, stale

    def _read_chunks_pipelined(self, version: str, metas: dict[str, _Meta]
                               ) -> tuple[dict[str, bytes], list[str]]:
        """:meth:`_read_chunks` through redis-py's pipeline: GETs, then join and check."""
        pipe = self.client.pipeline(transaction=False)
        for r, m in metas.items():
            for i in range(m.chunks):
                pipe.get(self._ckey(version, r, m.gen, i))
        replies = iter(pipe.execute(raise_on_error=False))
        out: dict[str, bytes] = {}
        stale: list[str] = []
        bad: dict[str, str] = {}
        error: Exception | None = None
        for r, m in metas.items():
            parts = [next(replies) for _ in range(m.chunks)]
            ok = True
            for i, got in enumerate(parts):
                want = max(0, min(m.chunk_bytes, m.length - i * m.chunk_bytes))
                if isinstance(got, Exception):
                    error, ok = got, False
                elif got is None:
                    if ok:
                        stale.append(r)
                    ok = False
                elif len(got) != want and ok:
                    bad[r] = f"chunk {i} holds {len(got)} bytes, {want} expected"
                    ok = False
            if ok and m.chunks * m.chunk_bytes < m.length:
                bad[r] = f"{m.chunks} chunks hold less than the recorded {m.length} bytes"
                ok = False
            if ok:
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                crc = zlib.crc32(data)
                if crc != m.crc:
                    bad[r] = f"crc32 {crc:08x}, the meta records {m.crc:08x}"
                else:
                    out[r] = data
        if error is not None:
            raise StoreError(f"guidance get {version}: {error}")
        _raise_if_corrupt(version, metas, bad)
        return out, stale

    def _missing_error(self, version: str, rollout_id: str | None) -> GuidanceNotFoundError:
        """Not found, with the reason: unknown version, unknown rollout, or evicted (why)."""
        self._script("reconcile")
        vkey, tkey = self._vkey(version), f"{self.prefix}:tomb:{version}"

        def look() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(vkey)
            pipe.get(tkey)
            return pipe.execute()
        exists, tomb = self.bus.call(f"guidance lookup {version}", look)
        if exists:
            return GuidanceNotFoundError(version, rollout_id)
        if tomb is None:
            return GuidanceNotFoundError(version)
        t = json.loads(tomb)
        at = float(t.get("at", 0.0))
        detail = (f"weight version {version!r} was evicted at {_when(at)}, "
                  f"{max(0.0, time.time() - at):.0f} s ago: {t.get('reason', 'no reason recorded')}")
        return GuidanceEvictedError(version, rollout_id, detail=detail)

    def rollouts(self, version: str) -> list[str]:
        """Sorted rollout ids stored for ``version``; not found / evicted if none."""
        _check_id(version, "version id")
        key = f"{self._vkey(version)}:rollouts"
        ids = self.bus.call(f"guidance rollouts {version}", lambda: self.client.smembers(key))
        if not ids:
            raise self._missing_error(version, None)
        return sorted(r.decode() for r in ids)

    # --- leases, listing, deletion ------------------------------------------------

    def acquire(self, version: str, consumer: str, ttl_s: float) -> None:
        """Protect ``version`` from budget eviction for ``ttl_s`` (renewable) for ``consumer``."""
        _check_id(version, "version id")
        _check_id(consumer, "consumer name")
        if not ttl_s > 0:
            raise InputError(f"lease ttl_s must be positive, not {ttl_s}")
        self._script("acquire", version, consumer, max(1, round(ttl_s * 1000)))

    def release(self, version: str, consumer: str) -> bool:
        """Drop ``consumer``'s lease on ``version``; False if it held none (any more)."""
        _check_id(version, "version id")
        _check_id(consumer, "consumer name")
        return bool(self._script("release", version, consumer))

    def versions(self) -> list[VersionInfo]:
        """Stored versions, oldest first put first, with bytes, rollouts and live lessees."""
        flat = self._script("list")
        self._set_stored(int(flat[0]))
        out = []
        for i in range(1, len(flat), 5):
            who = tuple(w for w in flat[i + 4].decode().split(",") if w)
            out.append(VersionInfo(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2]),
                                   float(flat[i + 3]), who))
        return out

    def delete_version(self, version: str) -> bool:
        """Delete every record of ``version`` (a tombstone says so); False if unknown."""
        _check_id(version, "version id")
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
