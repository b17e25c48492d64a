"""Liveness, readiness, Prometheus exposition and the status page."""

from __future__ import annotations

import logging

from alignclient.errors import AlignError, BusUnavailableError
from alignclient.models import ErrorResponse, Health, Ready
from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

from alignd.api.page import STATUS_PAGE
from alignd.api.routes_status import refresh_metrics
from alignd.api.state import State

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/healthz", operation_id="healthz", response_model=Health, tags=["health"])
def healthz() -> Health:
    """The process is alive."""
    return Health()


@router.get("/readyz", operation_id="readyz", response_model=Ready, tags=["health"],
            responses={503: {"model": ErrorResponse}})
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
    """Prometheus exposition of the API's metrics (gauges refreshed from Redis first)."""
    try:
        refresh_metrics(st)
    except Exception as e:  # stale gauges beat no metrics: Prometheus still gets the counters
        log.warning("metrics refresh failed: %s", e)
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", operation_id="status_page", response_class=HTMLResponse, tags=["health"],
            include_in_schema=False)
def status_page() -> HTMLResponse:
    """The HTML status page."""
    return HTMLResponse(STATUS_PAGE)
