"""How the API reports errors: one typed JSON shape, one table from error classes to HTTP statuses.

Every error response is ``{"error": {"code", "type", "message"}}`` (the error's
``to_dict()``); a client maps the ``code`` back to the class (``alignclient.errors``). The
classes say what went wrong and carry no transport; the HTTP status of each is
:data:`HTTP_STATUS`, here, looked up along the class's MRO by :func:`status_for`, so a
subclass answers its nearest listed ancestor's status unless it is listed itself.
:func:`error_response` is the one helper that builds a response; the handlers below only
turn other exceptions into ``AlignError``\\ s first:

* pydantic/FastAPI validation errors: 422 ``invalid_input`` whose message names each
  field path (``body.rollouts.0.logprobs.3: ...``); a body that is not JSON at all: 400
  ``malformed_body``;
* Starlette's own HTTP errors: 404 ``route_not_found``, 405 ``method_not_allowed``, any
  other with Starlette's status;
* a Redis connection error that escaped the bus's retries: 503 ``bus_unavailable``;
* anything else: 500 ``internal_error`` with the exception's class name only; the
  traceback goes to the log, never into the body.
"""

from __future__ import annotations

import logging

import redis
from alignclient.errors import (
    AlignError,
    ApiTimeoutError,
    ApiUnreachableError,
    BadResponseError,
    BusUnavailableError,
    EngineMismatchError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    ForbiddenError,
    GuidanceBudgetError,
    GuidanceEvictedError,
    GuidanceNotFoundError,
    GuidanceUnsupportedError,
    InputError,
    InternalError,
    LoopError,
    MalformedBodyError,
    MethodNotAllowedError,
    OverloadedError,
    PayloadTooLargeError,
    RedisFullError,
    RemoteError,
    RolloutExistsError,
    RolloutNotFoundError,
    RouteNotFoundError,
    SpecMismatchError,
    StaleRolloutError,
    StateTransitionError,
    UnauthorizedError,
    VersionExistsError,
    VersionNotFoundError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

#: Validation problems listed in one message at most.
MAX_LISTED = 5


#: HTTP status of each error class. A class not listed answers the status of its nearest
#: listed ancestor (:func:`status_for`): every input error is a 422, every store error a 500.
HTTP_STATUS: dict[type[AlignError], int] = {
    AlignError: 500,
    InputError: 422,
    MalformedBodyError: 400,
    UnauthorizedError: 401,
    ForbiddenError: 403,
    VersionNotFoundError: 404,
    GuidanceNotFoundError: 404,
    RolloutNotFoundError: 404,
    RouteNotFoundError: 404,
    MethodNotAllowedError: 405,
    VersionExistsError: 409,
    StateTransitionError: 409,
    RolloutExistsError: 409,
    StaleRolloutError: 409,
    SpecMismatchError: 409,
    EngineMismatchError: 409,
    WeightVersionMismatchError: 409,
    GuidanceEvictedError: 410,
    PayloadTooLargeError: 413,
    InternalError: 500,
    GuidanceUnsupportedError: 501,
    EngineRequestError: 502,
    WeightUpdateError: 502,
    LoopError: 502,
    BusUnavailableError: 503,
    EngineUnavailableError: 503,
    ApiUnreachableError: 503,
    ApiTimeoutError: 504,
    BadResponseError: 502,
    OverloadedError: 503,
    EngineTimeoutError: 504,
    GuidanceBudgetError: 507,
    RedisFullError: 507,
}


def status_for(err: AlignError | type[AlignError]) -> int:
    """The HTTP status the API answers ``err`` (an error or its class) with.

    A :class:`~alignclient.errors.RemoteError` passed on from another API keeps the status
    it came with.
    """
    if isinstance(err, RemoteError) and err.status is not None:
        return err.status
    cls = err if isinstance(err, type) else type(err)
    for base in cls.__mro__:
        if base in HTTP_STATUS:
            return HTTP_STATUS[base]
    raise TypeError(f"{cls.__name__} is not an AlignError")


def error_response(err: AlignError, headers: dict[str, str] | None = None, *,
                   status: int | None = None) -> JSONResponse:
    """The response for a typed error: its wire form under ``error``, its HTTP status
    (``status`` overrides the class's, for an error that came with one)."""
    return JSONResponse({"error": err.to_dict()},
                        status_code=status if status is not None else status_for(err),
                        headers=headers)


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
    """A typed error for an HTTP error raised by Starlette or FastAPI themselves (answered
    with Starlette's own status, see :func:`install_error_handlers`)."""
    if exc.status_code == 404:
        return RouteNotFoundError(f"no route {exc.detail}" if exc.detail != "Not Found"
                                  else "no such route")
    if exc.status_code == 405:
        return MethodNotAllowedError("method not allowed on this route")
    if exc.status_code == 400:
        return MalformedBodyError(f"request body could not be read: {exc.detail}")
    return InputError(str(exc.detail)) if exc.status_code < 500 else InternalError(str(exc.detail))


def unexpected_error(exc: BaseException) -> AlignError:
    """The 500 for an exception nobody anticipated (logged with its traceback by the caller)."""
    return InternalError(f"internal error ({type(exc).__name__}); see the API's log")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that route every exception through :func:`error_response`."""

    async def on_align(request: Request, exc: AlignError) -> JSONResponse:
        if status_for(exc) >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc)
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(http_error(exc), headers=getattr(exc, "headers", None),
                              status=exc.status_code)

    async def on_redis(request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            return error_response(BusUnavailableError(f"Redis unreachable: {exc}"))
        log.error("%s %s: Redis error", request.method, request.url.path, exc_info=exc)
        return error_response(unexpected_error(exc))

    app.add_exception_handler(AlignError, on_align)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(redis.exceptions.RedisError, on_redis)
