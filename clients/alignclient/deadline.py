"""A total deadline for each call of the client, not only a timeout for each socket operation.

httpx's ``timeout`` bounds each connect, each write and each read on its own. A server that
answers one byte every few seconds never trips a 10 s read timeout, and the call lasts as
long as the server likes: the status line, the headers and the body all arrive a byte at a
time. The client runs every call under a deadline instead (:func:`deadline_scope`, a
context variable, so each thread and each asyncio task has its own). The transports here are
httpcore's connection pool over a network backend whose streams cut the timeout of every
socket operation (connect, TLS handshake, each write, each read) to the time left before the
current call's deadline, and raise a timeout at once when none is left. So a call ends at its
deadline, whatever phase it is in and however the server paces its bytes, and the connection
it was using is closed, never handed to the next call half-read.

Outside a deadline scope the streams behave as httpcore's own. The transports take no proxy
(a trainer talks to its daemon directly; ``HTTP_PROXY`` and friends are not read), speak
HTTP/1.1, and verify TLS with httpx's default context.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpcore
import httpx

#: The monotonic time the current call must end by (None: no deadline).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "alignclient_deadline", default=None)
#: Writes are cut into pieces this large, each with the time left as its timeout.
WRITE_CHUNK = 64 << 10


@contextlib.contextmanager
def deadline_scope(deadline: float | None) -> Iterator[None]:
    """Run the block under ``deadline`` (a ``time.monotonic()`` instant; None: none)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def time_left() -> float | None:
    """Seconds left before the current call's deadline (None without one; may be <= 0)."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


def _cut(timeout: float | None, expired: type[Exception]) -> float | None:
    """``timeout`` cut to the time left; ``expired`` raised when none is left."""
    left = time_left()
    if left is None:
        return timeout
    if left <= 0:
        raise expired("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _cut(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        for i in range(0, len(view), WRITE_CHUNK):
            self._inner.write(bytes(view[i:i + WRITE_CHUNK]), _cut(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname,
                                             _cut(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(host, port, _cut(timeout, httpcore.ConnectTimeout),
                                               local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(
            path, _cut(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, _cut(timeout, httpcore.ReadTimeout))

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        for i in range(0, len(view), WRITE_CHUNK):
            await self._inner.write(bytes(view[i:i + WRITE_CHUNK]),
                                    _cut(timeout, httpcore.WriteTimeout))

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.start_tls(
            ssl_context, server_hostname, _cut(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.connect_tcp(
            host, port, _cut(timeout, httpcore.ConnectTimeout), local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._inner.connect_unix_socket(
            path, _cut(timeout, httpcore.ConnectTimeout), socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


#: httpcore's errors and the httpx errors the client sees for them (most specific first).
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    """httpcore's errors raised as the httpx errors the client catches."""
    try:
        yield
    except Exception as e:
        for theirs, ours in _ERRORS:
            if isinstance(e, theirs):
                raise ours(str(e) or type(e).__name__) from e
        raise


def _core_request(request: httpx.Request, content: Any) -> httpcore.Request:
    url = request.url
    return httpcore.Request(
        method=request.method,
        url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                         target=url.raw_path),
        headers=request.headers.raw, content=content, extensions=request.extensions)


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: Any):
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._inner

    def close(self) -> None:
        with _as_httpx():
            self._inner.close()


class _AsyncBody(httpx.AsyncByteStream):
    def __init__(self, inner: Any):
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx():
            async for part in self._inner:
                yield part

    async def aclose(self) -> None:
        with _as_httpx():
            await self._inner.aclose()


def _pool_args(limits: httpx.Limits) -> dict[str, Any]:
    return {"ssl_context": httpx.create_ssl_context(),
            "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry}


class DeadlineTransport(httpx.BaseTransport):
    """An httpx transport whose socket operations end by the current call's deadline."""

    def __init__(self, limits: httpx.Limits | None = None):
        self._pool = httpcore.ConnectionPool(network_backend=_Backend(),
                                             **_pool_args(limits or httpx.Limits()))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with _as_httpx():
            resp = self._pool.handle_request(_core_request(request, request.stream))
        return httpx.Response(resp.status, headers=resp.headers, stream=_Body(resp.stream),
                              extensions=resp.extensions)

    def close(self) -> None:
        self._pool.close()


class AsyncDeadlineTransport(httpx.AsyncBaseTransport):
    """The asynchronous :class:`DeadlineTransport`."""

    def __init__(self, limits: httpx.Limits | None = None):
        self._pool = httpcore.AsyncConnectionPool(network_backend=_AsyncBackend(),
                                                  **_pool_args(limits or httpx.Limits()))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with _as_httpx():
            resp = await self._pool.handle_async_request(_core_request(request, request.stream))
        return httpx.Response(resp.status, headers=resp.headers, stream=_AsyncBody(resp.stream),
                              extensions=resp.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()
