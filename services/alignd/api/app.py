"""``create_app``: the control API as a FastAPI application.

What a request meets, outside in: the front door (:mod:`alignd.api.middleware`: route
template, bearer tokens, body limits, metrics, typed 500s), then
FastAPI's routing and validation, then a route of one of the ``routes_*`` modules, which
call the registry, the stores and the streams through :class:`~alignd.api.state.ApiState`.
Every error leaves through :func:`alignd.api.errors.error_response`.

The API refuses to start without ``api_token`` unless ``dev_mode`` is set: a token-less
API lets anyone who reaches the port publish versions and overwrite guidance. Reads need a
token too (``api_token``, or ``read_token`` for readers that must not write) unless
``open_reads`` is set; open to all are only the routes in :data:`OPEN_ROUTES` and FastAPI's
schema and docs pages, which serve no daemon data.

While the app runs (its lifespan), it beats as service ``api`` (see
:mod:`alignd.infra.liveness`) and its metrics read the shared state from Redis at every
scrape (:func:`alignd.api.routes_status.cluster_state` of
:func:`~alignd.api.routes_status.collect_status`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from alignclient.errors import ConfigError
from fastapi import FastAPI
from starlette.routing import Route

from alignd.api import (
    routes_guidance,
    routes_health,
    routes_rollouts,
    routes_spec,
    routes_status,
    routes_versions,
)
from alignd.api.errors import install_error_handlers
from alignd.api.middleware import Frontdoor, open_route
from alignd.api.routes_status import cluster_state, current_status
from alignd.api.server import HeavyReads
from alignd.api.state import REQUEST_GIVE_UP_S, ApiState, with_decoding
from alignd.infra.redis_clients import binary_client, text_client
from alignd.infra.settings import ApiSettings
from alignd.infra.telemetry import Metrics

log = logging.getLogger(__name__)
API_VERSION = "1"

#: Routes any caller may read without a token: liveness, readiness, the Prometheus
#: exposition (route templates and counts, no ids) and the status page's HTML, whose data
#: comes from the guarded routes with the token the page is given.
OPEN_ROUTES = tuple(open_route(fn) for fn in (routes_health.healthz, routes_health.readyz,
                                              routes_health.metrics, routes_health.status_page))


def create_app(settings: ApiSettings, *, client: redis.Redis | None = None,
               metrics: Metrics | None = None,
               redis_give_up_s: float = REQUEST_GIVE_UP_S) -> FastAPI:
    """The control API for ``settings``; ``client`` overrides the Redis it talks to."""
    if not settings.api_token and not settings.dev_mode:
        raise ConfigError("the control API needs a bearer token (ALIGN_API_TOKEN) for its "
                          "mutating routes; set ALIGN_DEV_MODE=1 to run without one locally")
    metrics = metrics if metrics is not None else Metrics()
    if client is None:
        text, binary, own = text_client(settings), binary_client(settings), True
    else:
        text, binary, own = with_decoding(client, True), with_decoding(client, False), False
    st = ApiState(settings, metrics, text, binary, give_up_s=redis_give_up_s, own_clients=own)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.heartbeat.start()
        metrics.watch_cluster(lambda: cluster_state(current_status(st)))
        try:
            yield
        finally:
            metrics.watch_cluster(None)
            st.close()

    app = FastAPI(title="libalign control API", version=API_VERSION, lifespan=lifespan,
                  redoc_url=None)
    app.state.align = st
    install_error_handlers(app)
    routers = [m.router for m in (routes_health, routes_status, routes_versions, routes_rollouts,
                                  routes_guidance, routes_spec)]
    for router in routers:
        app.include_router(router)
    # FastAPI's own routes (schema, docs): open, they describe the API and hold no data
    docs = {app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url} - {None}
    own = [r for r in app.routes if isinstance(r, Route) and r.path in docs]
    for r in own:
        open_route(r.endpoint)
    app.add_middleware(HeavyReads, concurrency=settings.heavy_read_concurrency)  # inside the door
    app.add_middleware(Frontdoor, routes=[r for router in routers for r in router.routes] + own,
                       metrics=metrics, token=settings.api_token,
                       read_token=settings.read_token, open_reads=settings.open_reads,
                       max_body_bytes=settings.max_body_bytes,
                       max_streamed_bytes=settings.max_guidance_body_bytes)
    if settings.dev_mode and not settings.api_token:
        log.warning("control API without a bearer token (dev mode): mutating routes are open")
    if settings.open_reads or not (settings.api_token or settings.read_token):
        log.warning("control API read routes are open (%s): rollouts, guidance, versions and "
                    "status answer without a token",
                    "open_reads" if settings.open_reads else "dev mode, no token")
    return app
