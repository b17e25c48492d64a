"""Errors the client raises: the daemon's own error classes, rebuilt from the reply.

The API answers every error as ``{"error": {"code", "type", "message"}}``. The client
looks the ``code`` up among the classes of ``libalign.errors`` and raises an instance of
that class, so ``except VersionNotFoundError`` works the same in-process and over HTTP.
The instance carries the server's message (``str(e)``), the HTTP status (``e.status``) and
the request it answered (``e.method``, ``e.url``); attributes a class's constructor would
set from its arguments (``version_id``, ``rollout_id``) are filled in when the call knew
them and are otherwise absent, since the reply carries only the message.

A code the client does not know (a newer server) raises :class:`RemoteError` with the
status and code; a failure to reach the API at all, after the retries the call allowed,
raises :class:`ApiUnreachableError`.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from libalign import errors as _errors
from libalign.errors import AlignError


class RemoteError(AlignError):
    """An error reply whose code names no known error class (or a reply that is not JSON)."""

    code = "remote_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        if code is not None:
            self.code = code
        if status is not None:
            self.http_status = status


class ApiUnreachableError(RemoteError):
    """The API could not be reached (connection refused, timeout) within the call's retries."""

    code = "api_unreachable"
    http_status = 503


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_classes() -> dict[str, type[AlignError]]:
    """``code -> class`` for every error class in ``libalign.errors`` (first one wins)."""
    table: dict[str, type[AlignError]] = {AlignError.code: AlignError}
    for cls in _all_subclasses(AlignError):
        if cls.__module__ == _errors.__name__:
            table.setdefault(cls.code, cls)
    return table


_CLASSES = error_classes()


def rebuild(code: str, message: str, *, status: int, context: dict[str, Any] | None = None
            ) -> AlignError:
    """An instance of the class for ``code`` carrying ``message``, without calling its __init__."""
    cls = _CLASSES.get(code)
    if cls is None:
        return RemoteError(f"{code}: {message}", status=status, code=code)
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.status = status
    params = inspect.signature(cls.__init__).parameters
    for k, v in (context or {}).items():
        if k in params and v is not None:
            setattr(err, k, v)
    return err


def error_from_response(status: int, body: bytes, *, method: str = "", url: str = "",
                        context: dict[str, Any] | None = None) -> AlignError:
    """The typed error for an error reply (``RemoteError`` if the body is not the API's)."""
    try:
        e = json.loads(body)["error"]
        code, message = str(e["code"]), str(e["message"])
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode(errors="replace")
        err: AlignError = RemoteError(f"HTTP {status} from {method} {url}: {text}", status=status,
                                      code=f"http_{status}")
    else:
        err = rebuild(code, message, status=status, context=context)
    err.method, err.url = method, url
    return err
