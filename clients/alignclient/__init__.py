"""Python client of the libalign control API.

``AlignClient`` (sync) and ``AsyncAlignClient`` (async) have one method per API route,
named after its operation id, returning the wire models of :mod:`alignclient.models`;
errors are raised as the daemon's own ``libalign.errors`` classes
(:mod:`alignclient.errors`). Batched guidance replies use :mod:`alignclient.framing`.

    with AlignClient("http://127.0.0.1:8000", token="...") as api:
        api.publish_version("step-000123")
        api.put_scores("step-000123", [Score(rollout_id="r1", logprobs=[...], path="bf16")])
"""

from .client import AlignClient, AsyncAlignClient, Call
from .errors import ApiUnreachableError, RemoteError
from .models import spec_sha256

__version__ = "0.1.0"
__all__ = ["AlignClient", "ApiUnreachableError", "AsyncAlignClient", "Call", "RemoteError",
           "spec_sha256"]
