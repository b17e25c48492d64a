"""What the API's routes share: Redis clients, the stores built on them, settings, metrics.

One :class:`ApiState` lives on ``app.state.align``; routes receive it through the
:data:`State` dependency, the record of the version their path names through
:data:`KnownVersion`, and declare their error answers with :func:`error_responses` and
their bearer scheme with :data:`BEARER`. Redis calls made while a request waits give up after
:data:`REQUEST_GIVE_UP_S` (the bus's backoff budget) and the request answers 503
``bus_unavailable``: a caller retries a request, the API does not keep it hanging.

Two clients of one server: a text client (``decode_responses=True``) for the registry,
the streams and heartbeats, and a binary one for the guidance and rollout stores, whose
values are raw bytes. A client passed to ``create_app`` (the embedded server's, or a
test's) is used as the one of its flavour and the other flavour is derived from its
connection pool, so both talk to the same server, sockets or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import redis
from alignclient.ids import safe_id
from alignclient.models import ErrorResponse, spec_sha256
from alignclient.retry import RetryPolicy
from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from alignd.infra.bus import RedisBus
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.registry import Registry, VersionRecord
from alignd.infra.settings import ApiSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from libalign.spec import PRESETS

#: Seconds a request's Redis calls keep retrying before the request answers 503.
REQUEST_GIVE_UP_S = 2.0


def with_decoding(client: redis.Redis, decode: bool) -> redis.Redis:
    """``client`` if its replies are already (not) decoded, else a sibling on the same server."""
    pool = client.connection_pool
    if bool(pool.connection_kwargs.get("decode_responses")) == decode:
        return client
    kwargs = {k: v for k, v in pool.connection_kwargs.items()
              if not k.startswith(("maint_notifications", "orig_"))}  # redis-py's RESP3 extras
    kwargs["decode_responses"] = decode
    return redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **kwargs))


def instance_name(settings: ApiSettings) -> str:
    """This API process's heartbeat name: the consumer name in the safe id alphabet."""
    return safe_id(settings.consumer_name, "api")


@dataclass
class ApiState:
    """Everything a route needs, built once per app."""

    settings: ApiSettings
    metrics: Metrics
    text: redis.Redis
    binary: redis.Redis
    give_up_s: float = REQUEST_GIVE_UP_S
    own_clients: bool = False
    bus: RedisBus = field(init=False)
    registry: Registry = field(init=False)
    rollouts: RolloutStore = field(init=False)
    guidance: GuidanceStore = field(init=False)
    heartbeat: ServiceHeartbeat = field(init=False)
    spec: dict[str, Any] = field(init=False)
    spec_sha256: str = field(init=False)
    #: serving versions whose sync latency this process has settled (observed or seen observed)
    sync_seen: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        s, m = self.settings, self.metrics
        retry = RetryPolicy(initial_s=0.05, max_s=0.5, deadline_s=self.give_up_s)
        self.bus = RedisBus(self.text, retry=retry, stream_maxlen=s.stream_maxlen,
                            on_retry=lambda what, e: m.redis_retries.inc())
        self.registry = Registry(self.bus, s.key_prefix)
        self.rollouts = RolloutStore(self.binary, s.key_prefix, m, ttl_s=s.guidance_ttl_s,
                                     retry=retry)
        self.guidance = GuidanceStore(
            self.binary, prefix=s.key_prefix, budget_bytes=s.guidance_budget_bytes,
            ttl_s=s.guidance_ttl_s, chunk_bytes=s.guidance_chunk_bytes,
            max_record_bytes=s.guidance_max_record_bytes, on_in_use=s.guidance_on_in_use,
            retry=retry, metrics=m)
        self.heartbeat = ServiceHeartbeat(
            self.text, "api", instance_name(s), period_s=s.service_heartbeat_s,
            ttl_s=max(s.service_heartbeat_ttl_s, 2 * s.service_heartbeat_s),
            info=lambda: {"preset": s.preset, "url": s.resolved_api_url}, prefix=s.key_prefix)
        self.spec = PRESETS[s.preset].to_dict()
        self.spec_sha256 = spec_sha256(self.spec)

    def close(self) -> None:
        """Stop the heartbeat, close the guidance store's connections (and owned clients)."""
        self.heartbeat.stop()
        self.guidance.close()
        if self.own_clients:
            self.text.close()
            self.binary.close()


def get_state(request: Request) -> ApiState:
    """The app's shared state (a FastAPI dependency)."""
    return request.app.state.align


#: A route parameter receiving the shared state.
State = Annotated[ApiState, Depends(get_state)]


def known_version(version_id: str, st: State) -> VersionRecord:
    """The registry's record of the path's ``version_id`` (404 version_not_found if unknown)."""
    return st.registry.get(version_id)


#: A route parameter receiving the record of the version the path names (it must exist).
KnownVersion = Annotated[VersionRecord, Depends(known_version)]

#: ``dependencies=`` of a mutating route: documents the bearer scheme in OpenAPI (the front
#: door, :mod:`alignd.api.middleware`, enforces the token).
BEARER = [Depends(HTTPBearer(auto_error=False))]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=``: the error envelope for each of ``statuses``."""
    return {s: {"model": ErrorResponse} for s in statuses}
