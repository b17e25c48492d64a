"""The wire contract of the libalign control API, and its Python client.

The contract needs no torch and no daemon: :mod:`alignclient.errors` (the error tree and
its stable codes; standard library only), :mod:`alignclient.ids` (the id rule),
:mod:`alignclient.models` (the request and reply schemas; pydantic),
:mod:`alignclient.framing` (batched guidance bodies) and :mod:`alignclient.retry` (the one
retry policy). The client is :class:`AlignClient` (sync) and :class:`AsyncAlignClient`
(async): one method per API route, named after its operation id, returning the wire
models; errors are raised as the contract's classes.

    with AlignClient("http://127.0.0.1:8000", token="...") as api:
        api.publish_version("step-000123")
        api.put_scores("step-000123", [Score(rollout_id="r1", logprobs=[...], path="bf16")])

The names below are loaded on first use (PEP 562), so ``import alignclient.errors`` (what
the numerical core does) imports neither httpx nor pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import AlignClient, AsyncAlignClient, Call
    from .errors import ApiUnreachableError, RemoteError
    from .models import spec_sha256

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_HOMES = {
    "AlignClient": "client",
    "AsyncAlignClient": "client",
    "Call": "client",
    "ApiUnreachableError": "errors",
    "RemoteError": "errors",
    "spec_sha256": "models",
}

__all__ = ["AlignClient", "ApiUnreachableError", "AsyncAlignClient", "Call", "RemoteError",
           "spec_sha256"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
