"""Liveness, readiness, Prometheus exposition and the status page.

The status page is one self-contained HTML file, ``alignd/api/static/status.html`` (package
data, read through :mod:`importlib.resources` when this module loads, so a missing file stops
the API at start, not at the first visit).
"""

from __future__ import annotations

from importlib import resources

from alignclient.errors import AlignError, BusUnavailableError
from alignclient.models import Health, Ready
from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

from alignd.api.state import State, error_responses

#: The HTML of the status page served at ``/``.
STATUS_PAGE = resources.files("alignd.api").joinpath("static", "status.html").read_text("utf-8")

router = APIRouter()


@router.get("/healthz", operation_id="healthz", response_model=Health, tags=["health"])
def healthz() -> Health:
    """The process is alive."""
    return Health()


@router.get("/readyz", operation_id="readyz", response_model=Ready, tags=["health"],
            responses=error_responses(503))
def readyz(st: State) -> Ready:
    """Redis answers (503 bus_unavailable if not)."""
    try:
        st.bus.call("PING", st.text.ping)
    except AlignError:
        raise
    except Exception as e:
        raise BusUnavailableError(f"Redis did not answer PING: {e}") from e
    return Ready(status="ready", redis=True)


@router.get("/metrics", operation_id="metrics", tags=["health"], include_in_schema=False)
def metrics(st: State) -> Response:
    """Prometheus exposition of the API's metrics (the shared-state gauges read from Redis)."""
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", operation_id="status_page", response_class=HTMLResponse, tags=["health"],
            include_in_schema=False)
def status_page() -> HTMLResponse:
    """The HTML status page."""
    return HTMLResponse(STATUS_PAGE)
