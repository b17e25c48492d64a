"""Liveness, readiness, Prometheus exposition and the status page.

The status page is one self-contained HTML file, ``alignd/api/static/status.html`` (package
data, read through :mod:`importlib.resources` when this module loads, so a missing file stops
the API at start, not at the first visit).

Health never queues behind heavy routes: ``/healthz`` and the page are ``async`` and answer
from the event loop; ``/readyz`` pings Redis from threads of its own
(:attr:`ApiState.ping_limiter <alignd.api.state.ApiState.ping_limiter>`, not the pool the
other routes share) and gives up after the request's Redis budget plus a second.
"""

from __future__ import annotations

from importlib import resources

import anyio
from alignclient.errors import AlignError, BusUnavailableError
from alignclient.models import Health, Ready
from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

from alignd.api.state import ApiState, State, error_responses

#: The HTML of the status page served at ``/``.
STATUS_PAGE = resources.files("alignd.api").joinpath("static", "status.html").read_text("utf-8")

router = APIRouter()


@router.get("/healthz", operation_id="healthz", response_model=Health, tags=["health"])
async def healthz() -> Health:
    """The process is alive."""
    return Health()


@router.get("/readyz", operation_id="readyz", response_model=Ready, tags=["health"],
            responses=error_responses(503))
async def readyz(st: State) -> Ready:
    """Redis answers (503 bus_unavailable if not)."""
    limit_s = st.give_up_s + 1.0
    try:
        with anyio.fail_after(limit_s):
            await anyio.to_thread.run_sync(_ping, st, limiter=st.ping_limiter,
                                           abandon_on_cancel=True)
    except TimeoutError:
        raise BusUnavailableError(f"Redis did not answer PING within {limit_s:g} s") from None
    return Ready(status="ready", redis=True)


def _ping(st: ApiState) -> None:
    try:
        st.bus.call("PING", st.text.ping)
    except AlignError:
        raise
    except Exception as e:
        raise BusUnavailableError(f"Redis did not answer PING: {e}") from e


@router.get("/metrics", operation_id="metrics", tags=["health"], include_in_schema=False)
def metrics(st: State) -> Response:
    """Prometheus exposition of the API's metrics (the shared-state gauges read from Redis)."""
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", operation_id="status_page", response_class=HTMLResponse, tags=["health"],
            include_in_schema=False)
async def status_page() -> HTMLResponse:
    """The HTML status page."""
    return HTMLResponse(STATUS_PAGE)
