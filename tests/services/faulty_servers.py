"""Test helpers: servers that misbehave the way a sick daemon or a proxy in front of it does.

:class:`Drip` is a bare TCP server that answers every request a byte at a time, slower than
any whole answer should take but never slow enough to trip a per-read timeout.
:class:`FailSome` wraps the API app and answers chosen requests with a 500, before the app
runs them (nothing happened) or after (it happened, the answer is lost). Both are context
managers; what they start ends when the block does.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

from starlette.responses import JSONResponse

#: The answer :class:`Drip` sends by default: a SpecInfo-shaped JSON body.
DRIP_BODY = json.dumps({"preset": "minite", "spec": {}, "sha256": "0" * 64,
                        "sampler_path": "nvfp4_minite", "learner_path": "bf16"}).encode()


class Drip:
    """A TCP server answering ``200`` with ``body``, one byte every ``interval_s``: the
    status line and headers too (``mode="head"``), or only the body (``mode="body"``)."""

    def __init__(self, mode: str = "head", interval_s: float = 0.2, body: bytes = DRIP_BODY):
        self.mode, self.interval_s = mode, interval_s
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        self.head, self.body = head, body
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, name="drip-accept", daemon=True)

    @property
    def drip_s(self) -> float:
        """How long one whole answer takes to drip out."""
        dripped = self.head + self.body if self.mode == "head" else self.body
        return len(dripped) * self.interval_s

    def __enter__(self) -> Drip:
        self._accept.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._accept.join(5)
        self.sock.close()
        for t in self._threads:
            t.join(5)
        assert not any(t.is_alive() for t in [self._accept, *self._threads])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(conn,), name="drip-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            seen = b""
            while b"\r\n\r\n" not in seen and not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                seen += chunk
            try:
                if self.mode == "body":
                    conn.sendall(self.head)
                    dripped = self.body
                else:
                    dripped = self.head + self.body
                for i in range(len(dripped)):
                    if self._stop.wait(self.interval_s):
                        return
                    conn.sendall(dripped[i:i + 1])
            except OSError:
                return  # the client gave up and closed the connection


class FailSome:
    """The ASGI app ``app``, answering 500 ``internal_error`` to the requests ``fail(method,
    path, n)`` picks (``n`` counts the requests of that method and path, from 1): ``before`` the
    app runs them, or after (the app's answer is thrown away, as when it is lost)."""

    def __init__(self, app, fail: Callable[[str, str, int], bool], *, before: bool = True):
        self.app, self.fail, self.before = app, fail, before
        self.seen: dict[tuple[str, str], int] = {}
        self.failed = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = (scope["method"], scope["path"])
        self.seen[key] = n = self.seen.get(key, 0) + 1
        if not self.fail(*key, n):
            return await self.app(scope, receive, send)
        self.failed += 1
        if not self.before:
            async def swallow(message):
                return None
            await self.app(scope, receive, swallow)
        answer = JSONResponse({"error": {"code": "internal_error", "type": "InternalError",
                                         "message": "internal error (test); see the API's log"}},
                              status_code=500)
        await answer(scope, receive, send)
