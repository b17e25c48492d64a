"""How the API reports errors: one typed JSON shape, one mapping from exceptions to it.

Every error response is ``{"error": {"code", "type", "message"}}`` with the HTTP status the
error class declares (``libalign.errors``: each class has a ``code`` and an
``http_status``), so a client maps the code back to the class. :func:`error_response` is
the one helper that does this; the handlers below only turn other exceptions into
``AlignError``\\ s first:

* pydantic/FastAPI validation errors: 422 ``invalid_input`` whose message names each
  field path (``body.rollouts.0.logprobs.3: ...``); a body that is not JSON at all: 400
  ``malformed_body``;
* Starlette's own HTTP errors: 404 ``route_not_found``, 405 ``method_not_allowed``;
* a Redis connection error that escaped the bus's retries: 503 ``bus_unavailable``;
* anything else: 500 ``internal_error`` with the exception's class name only; the
  traceback goes to the log, never into the body.
"""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from libalign.errors import (
    AlignError,
    BusUnavailableError,
    InputError,
    InternalError,
    MalformedBodyError,
    MethodNotAllowedError,
    RouteNotFoundError,
)

log = logging.getLogger(__name__)

#: Validation problems listed in one message at most.
MAX_LISTED = 5


def error_response(err: AlignError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The response for a typed error: its wire form under ``error``, its HTTP status."""
    return JSONResponse({"error": err.to_dict()}, status_code=err.http_status, headers=headers)


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def validation_error(exc: RequestValidationError) -> AlignError:
    """A typed error for FastAPI's validation failure: malformed JSON, or which fields."""
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            return MalformedBodyError(f"request body is not valid JSON: "
                                      f"{ctx.get('error', e.get('msg', ''))}")
    parts = [f"{_loc(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:MAX_LISTED]]
    more = f" (and {len(errors) - MAX_LISTED} more)" if len(errors) > MAX_LISTED else ""
    return InputError("; ".join(parts) + more if parts else "invalid request")


def http_error(exc: StarletteHTTPException) -> AlignError:
    """A typed error for an HTTP error raised by Starlette or FastAPI themselves."""
    if exc.status_code == 404:
        return RouteNotFoundError(f"no route {exc.detail}" if exc.detail != "Not Found"
                                  else "no such route")
    if exc.status_code == 405:
        return MethodNotAllowedError("method not allowed on this route")
    if exc.status_code == 400:
        return MalformedBodyError(f"request body could not be read: {exc.detail}")
    err = InputError(str(exc.detail)) if exc.status_code < 500 else InternalError(str(exc.detail))
    err.http_status = exc.status_code
    return err


def unexpected_error(exc: BaseException) -> AlignError:
    """The 500 for an exception nobody anticipated (logged with its traceback by the caller)."""
    return InternalError(f"internal error ({type(exc).__name__}); see the API's log")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that route every exception through :func:`error_response`."""

    async def on_align(request: Request, exc: AlignError) -> JSONResponse:
        if exc.http_status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc)
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(http_error(exc), headers=getattr(exc, "headers", None))

    async def on_redis(request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            return error_response(BusUnavailableError(f"Redis unreachable: {exc}"))
        log.error("%s %s: Redis error", request.method, request.url.path, exc_info=exc)
        return error_response(unexpected_error(exc))

    app.add_exception_handler(AlignError, on_align)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(redis.exceptions.RedisError, on_redis)
