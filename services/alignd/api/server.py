"""How the control API is served so that load cannot take it down: one place builds the server.

:func:`build_server` is the only way the daemon starts uvicorn (``python -m alignd.api.main``,
``alignd serve api`` and the API thread of ``alignd up``). What it adds to a plain
``uvicorn.Server``, from the socket inwards:

* **File descriptors.** The soft ``RLIMIT_NOFILE`` is raised to the hard limit once per
  process (:func:`raise_fd_limit`, logged once): every connection is a descriptor, and
  :func:`connection_budget` sizes the backlog and the waiting connections to fit in them.
* **Connection limits** (uvicorn's own options): ``api_backlog`` is the listen backlog
  (at most a fifth of the descriptors), ``api_keep_alive_s`` closes an idle kept-alive connection, and beyond
  ``api_max_connections`` open connections uvicorn answers new requests 503.
* **Request-head deadline** (:class:`HeadDeadline`, passed as uvicorn's ``http=`` protocol
  class). uvicorn starts no timer for a connection that has not finished its first request
  head, so a client that opens sockets and sends half a request keeps each one forever
  (slowloris: 21,000 of them exhausted the descriptors and healthz stopped answering). The
  guard wraps uvicorn's protocol, forwarding every ``asyncio.Protocol`` call unchanged, and
  watches the bytes go by: a connection whose first request head (up to its blank line) has
  not arrived within ``api_header_timeout_s`` is closed, and at most half of
  ``api_max_connections`` (and of the descriptors left) may wait for a head at once: a new
  connection beyond that closes the *oldest* waiting one. A real client sends its head
  within milliseconds of connecting, so it is never the oldest; a flood of idle sockets
  evicts only itself. Later requests of a kept-alive connection are covered by uvicorn's
  keep-alive timer while idle, not by this guard.
* **Bounded shutdown** (uvicorn's ``timeout_graceful_shutdown``): on SIGTERM the server stops
  accepting at once and waits at most ``shutdown_timeout_s`` for requests in flight (a
  client trickling an upload included); what is still running then is cancelled, so the
  process exits within the bound whatever its clients do.
* **Bounded logs** (:class:`RepeatFilter`, on the handlers of the root and uvicorn loggers):
  within :data:`LOG_REPEAT_INTERVAL_S` only the first of identical records (same logger,
  level, source line and message) is written; the next one after the interval says how
  many were held back. A storm of identical errors (``accept()`` out of descriptors, one
  per attempt) writes a few lines a minute, not a traceback per attempt.

Inside the app, :class:`HeavyReads` (an ASGI middleware behind the front door) admits at most
``heavy_read_concurrency`` heavy reads at once (the GETs under ``/v1`` but ``/v1/spec``, and
guidance batch reads); one that waits more than :data:`HEAVY_WAIT_S` for a slot is answered
503 ``overloaded`` with ``Retry-After``. The health routes are ``async`` and run on the event
loop, so neither heavy reads nor the thread pool they use can make them queue.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import anyio
import uvicorn
from alignclient.errors import OverloadedError
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from alignd.api.errors import error_response
from alignd.infra.settings import ApiSettings

log = logging.getLogger(__name__)

#: Seconds a heavy read waits for a slot before it is answered 503 overloaded.
HEAVY_WAIT_S = 2.0
#: The ``Retry-After`` (seconds) of an overloaded answer.
RETRY_AFTER_S = 1
#: Descriptors kept out of the connection budget (Redis, logs, the store, the runtime).
FD_RESERVE = 64
#: Seconds within which repeated identical log records are written once.
LOG_REPEAT_INTERVAL_S = 10.0
#: The end of a request head: a blank line (h11 also accepts bare ``\n`` line endings).
HEAD_END = re.compile(rb"\n\r?\n")

_fd_limit_lock = threading.Lock()
_fd_limit: tuple[int, int] | None = None


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (once per process, logged); (soft, hard)."""
    global _fd_limit
    with _fd_limit_lock:
        if _fd_limit is None:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != hard:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                    log.info("open files limit raised from %d to %d", soft, hard)
                    soft = hard
                except (ValueError, OSError) as e:
                    log.warning("open files limit stays %d (hard %d): %s", soft, hard, e)
            else:
                log.info("open files limit %d", soft)
            _fd_limit = (soft, hard)
        return _fd_limit


# --- bounded logs ----------------------------------------------------------------------------


class RepeatFilter(logging.Filter):
    """Write the first record of a kind per ``interval_s``; count the rest and say so next time.

    A kind is (logger, level, source line, formatted message): only identical records are
    held back, so lines that differ (another version, another path) all pass. One instance
    may sit on several handlers: its verdict is remembered on the record, so each handler
    gets the same one.
    """

    VERDICT = "align_repeat_verdict"
    MAX_KINDS = 1024

    def __init__(self, interval_s: float = LOG_REPEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the seconds the windows are measured in (monotonic; tests move it)."""
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self.kinds: dict[tuple, list] = {}  # kind -> [window start, held back in it]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = getattr(record, self.VERDICT, None)
        if verdict is not None:
            return verdict
        kind = (record.name, record.levelno, record.pathname, record.lineno, record.getMessage())
        now = self.clock()
        with self.lock:
            entry = self.kinds.get(kind)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                verdict = False
            else:
                if entry is not None and entry[1]:
                    record.msg = (f"{record.msg} [{entry[1]} more like this in the "
                                  f"{now - entry[0]:.1f} s before were not logged]")
                if len(self.kinds) >= self.MAX_KINDS:
                    self.kinds = {k: v for k, v in self.kinds.items()
                                  if now - v[0] < self.interval_s}
                    if len(self.kinds) >= self.MAX_KINDS:
                        self.kinds.clear()
                self.kinds[kind] = [now, 0]
                verdict = True
        setattr(record, self.VERDICT, verdict)
        return verdict


#: The one filter of this process (its counts are shared by every handler it sits on).
REPEATS = RepeatFilter()


def bound_logs(logger_names: tuple[str, ...] = ("", "uvicorn", "uvicorn.access")) -> None:
    """Put :data:`REPEATS` on every handler of these loggers (root, uvicorn) that lacks it."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if REPEATS not in handler.filters:
                handler.addFilter(REPEATS)


# --- the request-head deadline ---------------------------------------------------------------


class WaitingHeads:
    """The connections of one server that have not sent a complete request head yet.

    Each is closed after ``timeout_s``; beyond ``limit`` waiting at once, a new one closes
    the oldest. ``timed_out`` and ``evicted`` count what was closed.
    """

    def __init__(self, timeout_s: float, limit: int) -> None:
        self.timeout_s = timeout_s
        self.limit = max(1, limit)
        self.waiting: OrderedDict[HeadDeadline, asyncio.TimerHandle] = OrderedDict()
        self.timed_out = 0
        self.evicted = 0

    def admit(self, conn: HeadDeadline, loop: asyncio.AbstractEventLoop) -> None:
        """Start ``conn``'s deadline; close the oldest waiting connection if over the limit."""
        while len(self.waiting) >= self.limit:
            oldest, timer = self.waiting.popitem(last=False)
            timer.cancel()
            self.evicted += 1
            log.warning("closed the oldest connection still waiting for a request head: "
                        "%d connections were waiting (the limit)", self.limit)
            oldest.close()
        self.waiting[conn] = loop.call_later(self.timeout_s, self.expire, conn)

    def expire(self, conn: HeadDeadline) -> None:
        """``conn``'s deadline passed without a complete request head: close it."""
        if self.waiting.pop(conn, None) is not None:
            self.timed_out += 1
            log.warning("closed a connection that sent no complete request head within %g s",
                        self.timeout_s)
            conn.close()

    def done(self, conn: HeadDeadline) -> None:
        """``conn`` sent its head, or closed: no deadline any more."""
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()


class HeadDeadline(asyncio.Protocol):
    """uvicorn's HTTP protocol (``inner_class``), with a deadline on the first request head.

    Every ``asyncio.Protocol`` call is forwarded to the wrapped protocol unchanged; this class
    only reads the bytes for the end of the first head and may close the transport. Built
    per server by :func:`head_deadline_protocol`.
    """

    inner_class: type[asyncio.Protocol]
    heads: WaitingHeads

    def __init__(self, **kwargs: Any) -> None:
        self.inner = self.inner_class(**kwargs)  # uvicorn's own keyword arguments
        self.transport: asyncio.BaseTransport | None = None
        self.waiting = True
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        if not transport.is_closing():
            self.heads.admit(self, asyncio.get_running_loop())

    def data_received(self, data: bytes) -> None:
        if self.waiting:
            seen = self.tail + data
            if HEAD_END.search(seen):
                self.waiting, self.tail = False, b""
                self.heads.done(self)
            else:
                self.tail = seen[-2:]
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.heads.done(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def close(self) -> None:
        """Close the connection (its head did not come in time, or it was evicted)."""
        if self.transport is not None:
            self.transport.close()


def head_deadline_protocol(inner: type[asyncio.Protocol], heads: WaitingHeads
                           ) -> type[HeadDeadline]:
    """A :class:`HeadDeadline` class wrapping ``inner`` whose connections share ``heads``."""
    return type("HeadDeadlineProtocol", (HeadDeadline,), {"inner_class": inner, "heads": heads})


def connection_budget(settings: ApiSettings, fd_soft: int) -> tuple[int, int]:
    """(listen backlog, connections that may wait for a head) within ``fd_soft`` descriptors.

    asyncio accepts up to a backlog's worth of connections at once before any of them is
    read, so the descriptors left after :data:`FD_RESERVE` are shared out: a fifth at most to
    the backlog, half the rest (and half of ``api_max_connections``) to waiting connections,
    the remainder to connections being served or closed. Waiting >= 2 x backlog: a client
    that sends its head at once is read before two more batches could evict it.
    """
    budget = max(8, fd_soft - FD_RESERVE)
    backlog = max(1, min(settings.api_backlog, budget // 5))
    waiting = max(1, min(settings.api_max_connections, budget - backlog) // 2)
    return backlog, waiting


def build_server(app: ASGIApp, settings: ApiSettings, *, host: str | None = None,
                 port: int | None = None, log_level: str = "info") -> uvicorn.Server:
    """The uvicorn server of ``app`` with ``settings``' limits (see the module docstring).

    Raises the process's descriptor limit (idempotent). Bounding the logs is the process
    entry's call (:func:`bound_logs`, in ``alignd.api.main.serve``): a server started inside
    another program (the demo, a test) leaves that program's log handlers alone.
    """
    soft, _ = raise_fd_limit()
    backlog, waiting = connection_budget(settings, soft)
    heads = WaitingHeads(settings.api_header_timeout_s, waiting)
    config = uvicorn.Config(
        app, host=host or settings.api_host, port=settings.api_port if port is None else port,
        log_level=log_level, access_log=False, backlog=backlog,
        timeout_keep_alive=settings.api_keep_alive_s,
        limit_concurrency=settings.api_max_connections,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,  # seconds; a float works
        http=head_deadline_protocol(AutoHTTPProtocol, heads))
    log.info("connections: %d open files, backlog %d, at most %d waiting %g s for a request "
             "head, 503 beyond %d", soft, backlog, waiting, settings.api_header_timeout_s,
             settings.api_max_connections)
    return uvicorn.Server(config)


# --- heavy reads -----------------------------------------------------------------------------


def is_heavy_read(method: str, path: str) -> bool:
    """A read that costs Redis round trips proportional to what it returns."""
    if method in ("GET", "HEAD"):
        return path.startswith("/v1/") and path != "/v1/spec"
    return method == "POST" and path.startswith("/v1/guidance/") and path.endswith(":batch")


class HeavyReads:
    """At most ``concurrency`` heavy reads at once; waiting longer than ``wait_s`` is 503."""

    def __init__(self, app: ASGIApp, *, concurrency: int, wait_s: float = HEAVY_WAIT_S) -> None:
        self.app = app
        self.concurrency = concurrency
        self.wait_s = wait_s
        self.slots = anyio.Semaphore(concurrency)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_heavy_read(scope.get("method", "GET"),
                                                         scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        acquired = False
        with anyio.move_on_after(self.wait_s):
            await self.slots.acquire()
            acquired = True
        if not acquired:
            err = OverloadedError(f"{self.concurrency} heavy reads are running and this one "
                                  f"waited {self.wait_s:g} s for a slot; retry after "
                                  f"{RETRY_AFTER_S} s")
            await error_response(err, headers={"Retry-After": str(RETRY_AFTER_S)})(
                scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.release()
