"""The API's front door: one ASGI middleware that every HTTP request passes first.

In this order, before any route code runs or any body byte is parsed:

1. **Route.** The request is matched against the app's routes to learn its template
   (``/v1/versions/{version_id}``), which labels the metrics; raw paths never do, since
   they hold ids.
2. **Token.** Two rules, both answered here, so an unauthenticated caller cannot make the
   server read or parse a body, or run a route at all:

   * a *mutating* request (POST, PUT, PATCH, DELETE) to a route needs ``Authorization:
     Bearer <api_token>`` when an ``api_token`` is configured. The ``read_token`` never
     changes state: sent here it answers 403 ``forbidden``;
   * a *read* (GET, HEAD and any other method) needs ``Authorization: Bearer <api_token or
     read_token>`` when either is configured and ``open_reads`` is off: rollouts, guidance
     bytes, version ``meta``, store paths, host names and pids are the daemon's data. Reads
     fail closed: a path outside the route table needs the token as well (its 404 is only
     for those who hold one). Open to every caller are only the routes marked with
     :func:`open_route`: ``/healthz``, ``/readyz``, ``/metrics`` (route templates, states
     and counts; no ids, paths or bytes), the status page's HTML at ``/`` (its data comes
     from guarded routes, with the token the page is given) and FastAPI's ``/docs`` and
     ``/openapi.json`` (the schema: no data).

   No header gives 401 ``unauthorized``, a token that is not accepted 403 ``forbidden``.
   Every comparison is constant-time (:func:`hmac.compare_digest`), and a given token is
   compared with every accepted one, so the time does not tell which one came closest.
   With no token at all (``dev_mode``) both kinds are open; ``create_app`` logs it.
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
_OPEN = "_align_open_route"
_READ_HINT = ("this route reads the daemon's data: send 'Authorization: Bearer <token>' "
              "(the API's ALIGN_READ_TOKEN or ALIGN_API_TOKEN)")
_WRITE_HINT = ("this route changes state: send 'Authorization: Bearer <token>' "
               "(the API's ALIGN_API_TOKEN)")


def streamed_body(fn: Callable) -> Callable:
    """Mark a route that reads its own (large) body with ``request.stream()``."""
    setattr(fn, _STREAMED, True)
    return fn


def open_route(fn: Callable) -> Callable:
    """Mark a route that every caller may read without a token (it serves no daemon data)."""
    setattr(fn, _OPEN, True)
    return fn


def is_open_route(fn: Callable | None) -> bool:
    """Whether ``fn`` was marked with :func:`open_route`."""
    return bool(getattr(fn, _OPEN, False))


class Frontdoor:
    """Route template, bearer tokens, body size limits, request metrics, typed 500s.

    ``token`` is the API token (writes and reads), ``read_token`` a second token good for
    reads only; ``open_reads`` serves reads without either.
    """

    def __init__(self, app: ASGIApp, *, routes: Iterable[Any], metrics: Metrics,
                 token: str | None, max_body_bytes: int, max_streamed_bytes: int,
                 read_token: str | None = None, open_reads: bool = False):
        self.app = app
        self.metrics = metrics
        self.token = token.encode() if token else None
        self.read_token = read_token.encode() if read_token else None
        self.reads_guarded = not open_reads and (self.token or self.read_token) is not None
        self.max_body_bytes = max_body_bytes
        self.max_streamed_bytes = max_streamed_bytes
        # (template, compiled path, methods, endpoint) from the routes' public attributes
        self.table = [(r.path, compile_path(r.path)[0], frozenset(getattr(r, "methods", None)
                                                                    or ()), r.endpoint)
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

    def _auth_error(self, scope: Scope, *, write: bool) -> AlignError | None:
        """Why this request may not pass the token rule (None if it may).

        ``write``: the request changes state, so only ``api_token`` is accepted.
        """
        if (write and self.token is None) or (not write and not self.reads_guarded):
            return None
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)
        if header is None:
            return UnauthorizedError(_WRITE_HINT if write else _READ_HINT)
        scheme, _, given = header.partition(b" ")
        given = given.strip()
        if scheme.lower() != b"bearer" or not given:
            return UnauthorizedError("the Authorization header must be 'Bearer <token>'")
        # compare with both, always: the time taken does not depend on which one matched
        is_api = self.token is not None and hmac.compare_digest(given, self.token)
        is_read = self.read_token is not None and hmac.compare_digest(given, self.read_token)
        if is_api or (is_read and not write):
            return None
        if is_read:
            return ForbiddenError("the read token (ALIGN_READ_TOKEN) cannot change state: this "
                                  "route needs the API token (ALIGN_API_TOKEN)")
        return ForbiddenError("the bearer token is not one this API was started with")

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
        err = None
        if method in MUTATING:
            if endpoint is not None:
                err = self._auth_error(scope, write=True)
        elif not is_open_route(endpoint):
            err = self._auth_error(scope, write=False)
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
