"""The API's front door: one ASGI middleware that every HTTP request passes first.

In this order, before any route code runs or any body byte is parsed:

1. **Route.** The request is matched against the app's routes to learn its template
   (``/v1/versions/{version_id}``), which labels the metrics; raw paths never do, since
   they hold ids.
2. **Token.** A mutating request (POST, PUT, PATCH, DELETE) needs ``Authorization: Bearer
   <api_token>`` when a token is configured: none gives 401 ``unauthorized``, a wrong one
   403 ``forbidden``. The comparison is constant-time (:func:`hmac.compare_digest`).
   Checking here, not in a route dependency, means an unauthenticated caller cannot make
   the server read or parse a body at all.
3. **Size.** A declared ``Content-Length`` above the route's limit is refused with 413
   ``payload_too_large`` before reading; a body without one (chunked) is counted while it
   is read and refused as soon as it passes the limit. JSON routes get their body read
   here, up to ``max_body_bytes``, and replayed to the route. Routes that stream their
   body themselves (marked with :func:`streamed_body`: guidance uploads) get
   ``max_guidance_body_bytes`` and a ``receive`` that raises
   :class:`~alignclient.errors.PayloadTooLargeError` once the limit is passed, so the body is
   never held twice.
4. **Metrics and last resort.** Latency and status class are recorded per route template;
   an exception no handler took becomes a typed 500 ``internal_error`` (traceback in the
   log, not in the body).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from alignclient.errors import (
    AlignError,
    ForbiddenError,
    MalformedBodyError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignd.api.errors import error_response, unexpected_error
from alignd.infra.telemetry import Metrics

log = logging.getLogger(__name__)

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_STREAMED = "_align_streamed_body"


def streamed_body(fn: Callable) -> Callable:
    """Mark a route that reads its own (large) body with ``request.stream()``."""
    setattr(fn, _STREAMED, True)
    return fn


class Frontdoor:
    """Route template, bearer token, body size limits, request metrics, typed 500s."""

    def __init__(self, app: ASGIApp, *, routes: Iterable[Any], metrics: Metrics,
                 token: str | None, max_body_bytes: int, max_streamed_bytes: int):
        self.app = app
        self.metrics = metrics
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.max_streamed_bytes = max_streamed_bytes
        # (template, compiled path, methods, endpoint) from the routes' public attributes
        self.table = [(r.path, compile_path(r.path)[0], frozenset(r.methods or ()), r.endpoint)
                      for r in routes]

    def _route(self, scope: Scope) -> tuple[str, Any]:
        """The matching route's template (``unmatched`` if none) and its endpoint.

        A path that matches with another method gives its template and no endpoint (the
        router answers 405).
        """
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        method = scope.get("method", "GET")
        partial = None
        for template, regex, methods, endpoint in self.table:
            if regex.match(path):
                if method in methods or (method == "HEAD" and "GET" in methods):
                    return template, endpoint
                partial = partial or template
        return (partial, None) if partial else ("unmatched", None)

    def _auth_error(self, scope: Scope) -> AlignError | None:
        if self.token is None:
            return None
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)
        if header is None:
            return UnauthorizedError("this route changes state: send 'Authorization: Bearer "
                                     "<token>' (the API's ALIGN_API_TOKEN)")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return UnauthorizedError("the Authorization header must be 'Bearer <token>'")
        if not hmac.compare_digest(given.strip(), self.token):
            return ForbiddenError("the bearer token is not the one this API was started with")
        return None

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        raw = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if raw is None:
            return None
        try:
            n = int(raw)
        except ValueError:
            raise MalformedBodyError(f"Content-Length {raw[:40]!r} is not a number") from None
        if n < 0:
            raise MalformedBodyError(f"Content-Length {n} is negative")
        return n

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        template, endpoint = self._route(scope)
        status = {"code": 500, "started": False}

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
                status["started"] = True
            await send(message)

        try:
            await self._handle(scope, receive, tracked_send, endpoint)
        except Exception as e:
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
            if status["started"]:
                raise
            await error_response(unexpected_error(e))(scope, receive, tracked_send)
        finally:
            self.metrics.observe_request(template, status["code"], time.perf_counter() - t0)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Any) -> None:
        method = scope.get("method", "GET")
        if endpoint is not None and method in MUTATING:
            err = self._auth_error(scope)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        streamed = getattr(endpoint, _STREAMED, False)
        limit = self.max_streamed_bytes if streamed else self.max_body_bytes
        what = "guidance record upload" if streamed else "request body"
        try:
            declared = self._content_length(scope)
        except AlignError as err:
            await error_response(err)(scope, receive, send)
            return
        if declared is not None and declared > limit:
            await error_response(PayloadTooLargeError(what, declared, limit))(scope, receive, send)
            return
        if method not in MUTATING:
            await self.app(scope, receive, send)
            return
        if streamed:
            await self.app(scope, _counting(receive, limit, what), send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await error_response(PayloadTooLargeError(what, size, limit))(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` once, then waits on the real one (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _counting(receive: Receive, limit: int, what: str) -> Receive:
    """A ``receive`` that raises PayloadTooLargeError once more than ``limit`` bytes came."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLargeError(what, seen, limit)
        return message

    return counted
