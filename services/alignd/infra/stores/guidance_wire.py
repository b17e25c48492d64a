"""How a guidance record's bytes move between the caller and Redis, and how they are checked.

Chunks. A record of ``n`` bytes is stored as ``ceil(n / chunk_bytes)`` string values
(Redis refuses a value above 512 MiB, and smaller values keep one command from holding
the server for long). Chunk names carry the generation of the put that wrote them
(``P:v:<v>:c:<r>:<gen>:<i>``, see :mod:`~alignd.infra.stores.guidance_scripts`), so a new
put never overwrites the chunks a reader may be fetching.

A put is one transaction: ``MULTI``, one ``SET`` per chunk of the new generation, the
commit script with every record's length and crc32, ``EXEC``. Redis runs the queued
commands of an ``EXEC`` back to back, with no other client in between, and writes them to
the append-only file as one block that is replayed whole or not at all: until ``EXEC`` a
reader sees the old meta and the old chunks, after it the new ones. A client that dies
before ``EXEC`` leaves a ``MULTI`` that the server discards with the connection. Because
the script reads the old meta inside the same ``EXEC``, no ``WATCH`` is needed. If the
script itself fails, the ``SET``\\ s did run: their chunks are unlinked again.

A read sends the ``GET`` of every chunk of the records asked for at once, then checks
each record: every chunk present (a missing one means the record was replaced or removed
after its meta was read: the record is *stale* and the store reads it again), every chunk
of the length the meta implies, and the crc32 of the whole equal to the meta's.

Two carriers of the same commands, chosen by the store (``payload_path``):

* ``"socket"``: connections of a pool of the store's own, driven through redis-py's
  connection interface (``send_packed_command``, ``read_response``). :func:`pack` encodes
  the requests so that chunk values go to the socket as views of the caller's buffer
  (redis-py's hiredis command packer copies every value twice). Replies are parsed by
  redis-py's parser (hiredis when installed) one at a time, so the crc32 of a large record
  is checked in a worker thread while the next one arrives, and a put's crc32s are
  computed in that thread while its chunks are on the wire (the commit goes last).
* ``"pipeline"``: redis-py's pipeline on the store's client, one ``execute()`` per
  exchange: for the embedded in-process server, where there is no wire to overlap with.

Both carriers feed the same checks, so they answer alike, errors included.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis
from alignclient.errors import GuidanceChecksumError, StoreError
from redis.connection import ConnectionInterface

from alignd.infra.redis_checks import refusal
from alignd.infra.stores.guidance_scripts import GuidanceKeys

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Buffers at least this large go to the socket as they are; smaller ones are joined first.
SEND_WHOLE = 64 << 10
#: Records (and puts) at least this large get their crc32 in the worker thread.
CRC_IN_THREAD = 1 << 20

#: One Redis command: name, then arguments (bytes, memoryview, str, int or float).
Command = Sequence[Any]


@dataclass(frozen=True)
class Meta:
    """A record's meta hash: length, chunk count, chunk size, generation, crc32."""

    length: int
    chunks: int
    chunk_bytes: int
    gen: str
    crc: int


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks of ``chunk_bytes`` hold ``nbytes``."""
    return (nbytes + chunk_bytes - 1) // chunk_bytes


def _arg(x: Any) -> bytes | memoryview:
    if isinstance(x, (bytes, memoryview)):
        return x
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, int) and not isinstance(x, bool):
        return b"%d" % x
    if isinstance(x, float):
        return repr(x).encode()
    raise TypeError(f"a Redis argument must be bytes, str, int or float, not {type(x).__name__}")


def pack(commands: Iterable[Command]) -> list[bytes | memoryview]:
    """RESP-encode ``commands``; arguments of :data:`SEND_WHOLE` or more stay separate
    buffers, sent as they are (no copy)."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for cmd in commands:
        small.append(b"*%d\r\n" % len(cmd))
        for arg in map(_arg, cmd):
            n = len(arg)
            small.append(b"$%d\r\n" % n)
            if n >= SEND_WHOLE:
                out.append(b"".join(small))
                out.append(arg)
                small = [b"\r\n"]
            else:
                small += [arg, b"\r\n"]
    if small:
        out.append(b"".join(small))
    return out


class _Replies:
    """The next replies on ``conn``, error replies as exception objects (not raised).

    ``left`` counts the replies sent for and not yet read: a connection released with
    replies left would hand them to its next user, so it is dropped instead.
    """

    def __init__(self, conn: ConnectionInterface):
        self.conn = conn
        self.left = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if not self.left:
            raise StopIteration
        try:
            reply = self.conn.read_response()
        except redis.exceptions.ResponseError as e:  # read whole: the stream stays in step
            reply = e
        self.left -= 1
        return reply


def _crc_and_join(parts: list[bytes]) -> tuple[int, bytes]:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc, parts[0] if len(parts) == 1 else b"".join(parts)


def _raise_if_corrupt(version: str, metas: Mapping[str, Meta], bad: dict[str, str]) -> None:
    """GuidanceChecksumError naming the first corrupt record of a read, if there is one."""
    if bad:
        r = next(iter(bad))
        raise GuidanceChecksumError(f"guidance record of rollout {r!r}, weight version "
                                    f"{version!r} ({metas[r].length} bytes) is corrupt: {bad[r]}")


class PayloadWire:
    """Moves records' chunks for one store: puts as transactions, reads checked.

    ``path`` is ``"socket"`` (then ``pool`` is the store's own connection pool) or
    ``"pipeline"`` (see the module docstring). Every method is one attempt: retries are
    the caller's (a put's generation must be fresh per attempt).
    """

    def __init__(self, client: redis.Redis, keys: GuidanceKeys, chunk_bytes: int,
                 path: Literal["socket", "pipeline"],
                 pool: redis.ConnectionPool | None = None):
        if path == "socket" and pool is None:
            raise ValueError("the socket path needs a connection pool of its own")
        self.client, self.keys, self.chunk_bytes = client, keys, chunk_bytes
        self.path, self.pool = path, pool
        self._workers: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Close the payload connections and the worker thread."""
        if self.pool is not None:
            self.pool.disconnect()
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._workers = None

    def _worker(self) -> ThreadPoolExecutor:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(1, thread_name_prefix="guidance-crc")
        return self._workers

    def checksums(self, views: Mapping[str, memoryview]) -> Future | dict[str, int]:
        """crc32 of every record; a Future (worker thread) for puts of CRC_IN_THREAD or more."""
        if sum(mv.nbytes for mv in views.values()) >= CRC_IN_THREAD:
            return self._worker().submit(lambda: {r: zlib.crc32(mv) for r, mv in views.items()})
        return {r: zlib.crc32(mv) for r, mv in views.items()}

    # --- exchanges --------------------------------------------------------------------

    def _exchange(self, commands: list[Command], then: Callable[[], list[Command]] | None,
                  consume: Callable[[Iterator[Any]], T]) -> T:
        """On a payload connection: send ``commands``, then ``then()``, and ``consume`` the
        replies; a connection left with unread replies is dropped, not reused."""
        assert self.pool is not None
        conn = self.pool.get_connection()
        replies = _Replies(conn)
        try:
            conn.send_packed_command(pack(commands))
            replies.left += len(commands)
            if then is not None:
                more = then()
                conn.send_packed_command(pack(more), check_health=False)
                replies.left += len(more)
            return consume(replies)
        finally:
            if replies.left:
                conn.disconnect()
            self.pool.release(conn)

    def _transaction(self, sets: list[Command], commit: Callable[[], Command]) -> list[Any]:
        """MULTI, ``sets``, ``commit()``, EXEC: EXEC's results (errors as objects).

        Raises ResponseError if Redis refused to queue a command (nothing was applied).
        """
        if self.path == "pipeline":
            pipe = self.client.pipeline(transaction=True)
            for name, *args in (*sets, commit()):  # a cluster's router wants names as str
                pipe.execute_command(name.decode() if isinstance(name, bytes) else name, *args)
            return pipe.execute(raise_on_error=False)

        def results(replies: Iterator[Any]) -> list[Any]:
            *queued, result = list(replies)
            for q in (*queued, result):
                if isinstance(q, Exception):
                    raise q
            return result
        return self._exchange([(b"MULTI",), *sets], lambda: [commit(), (b"EXEC",)], results)

    # --- put ------------------------------------------------------------------------

    def put(self, version: str, gen: str, views: Mapping[str, memoryview],
            commit: Callable[[], Command]) -> Any:
        """Write ``views`` as chunks of generation ``gen`` and run ``commit()`` (the commit
        script's EVAL) in one transaction; the script's reply."""
        step = self.chunk_bytes
        sets: list[Command] = []
        for rid, mv in views.items():
            for i in range(chunk_count(mv.nbytes, step)):
                part = mv[i * step : (i + 1) * step]
                sets.append((b"SET", self.keys.chunk(version, rid, gen, i),
                             part if part.nbytes >= SEND_WHOLE else part.tobytes()))
        try:
            results = self._transaction(sets, commit)
        except (redis.exceptions.AskError, redis.exceptions.TryAgainError):
            raise  # the slot is moving and EXEC was refused whole: the store tries again
        except redis.exceptions.ResponseError as e:  # EXECABORT: nothing was applied
            raise refusal(e, f"guidance put {version}") or StoreError(
                f"guidance put {version}: Redis refused the transaction: {e}") from e
        script = results[-1]
        if isinstance(script, Exception):
            # the SETs ran but the script did not: remove the unreferenced new chunks
            self._unlink_quietly([cmd[1] for cmd in sets])
            raise refusal(script, f"guidance put {version}") or StoreError(
                f"guidance put {version}: the commit script failed: {script}")
        return script

    def _unlink_quietly(self, keys: list[bytes]) -> None:
        try:
            for i in range(0, len(keys), 1000):
                self.client.unlink(*keys[i : i + 1000])
        except redis.exceptions.RedisError as e:
            log.warning("guidance store: could not remove orphan chunks: %s", e)

    # --- read -----------------------------------------------------------------------

    def read(self, version: str, metas: Mapping[str, Meta]) -> tuple[dict[str, bytes], list[str]]:
        """The records of ``metas``, checked: ``(records, stale rollout ids)``.

        Raises GuidanceChecksumError for a corrupt record, StoreError for an error reply.
        """
        keys = [self.keys.chunk(version, r, m.gen, i)
                for r, m in metas.items() for i in range(m.chunks)]
        if not keys:
            return {}, []
        if self.path == "pipeline":
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return self._check(version, metas, iter(pipe.execute(raise_on_error=False)))
        return self._exchange([(b"GET", k) for k in keys], None,
                              lambda replies: self._check(version, metas, replies))

    def _check(self, version: str, metas: Mapping[str, Meta],
               replies: Iterator[Any]) -> tuple[dict[str, bytes], list[str]]:
        """Join and verify each record from its chunks' replies (all of them are consumed).

        A record's crc32 is computed in the worker while the next record's replies are read.
        """
        done: dict[str, Future | tuple[int, bytes]] = {}
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
                done[r] = (self._worker().submit(_crc_and_join, parts)
                           if m.length >= CRC_IN_THREAD else _crc_and_join(parts))
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
