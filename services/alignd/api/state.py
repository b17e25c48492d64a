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

Two things keep reads cheap under load: :class:`Snapshot` holds the last ``/v1/status``
(which the metrics' cluster gauges read too) for ``status_cache_s``, computed by one caller
at a time while the others wait for it (single flight), and ``ping_limiter`` gives
``/readyz`` threads of its own, so readiness never waits behind heavy reads in the shared
thread pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

import anyio
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
from alignd.infra.staleness import StalenessGuard
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from libalign.spec import PRESETS

#: Seconds a request's Redis calls keep retrying before the request answers 503.
REQUEST_GIVE_UP_S = 2.0
#: Threads ``/readyz`` may use at once for its PING (apart from the shared pool).
PING_THREADS = 2

T = TypeVar("T")


class Snapshot(Generic[T]):
    """One value, recomputed when older than ``max_age_s``, by one caller at a time.

    :meth:`get` answers the held value while it is fresh; otherwise the first caller
    computes a new one and callers arriving meanwhile wait for it and share it (single
    flight). The age counts from when the computation started. ``max_age_s`` 0 keeps
    nothing: every call computes.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        self.value: T | None = None
        self.at = float("-inf")
        self.computed = 0

    def fresh(self) -> T | None:
        """The held value if it is younger than ``max_age_s``, else None."""
        value, at = self.value, self.at
        return value if time.monotonic() - at < self.max_age_s else None

    def get(self, compute: Callable[[], T]) -> T:
        """The fresh value, or ``compute()``'s (computed once for all who wait meanwhile)."""
        if self.max_age_s <= 0:
            self.computed += 1
            return compute()
        value = self.fresh()
        if value is not None:
            return value
        with self.lock:
            value = self.fresh()
            if value is not None:
                return value
            started = time.monotonic()
            value = compute()
            self.value, self.at = value, started
            self.computed += 1
            return value


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
    #: the max_version_diff bound on rollouts put over the API (against the newest version)
    staleness: StalenessGuard = field(init=False)
    spec: dict[str, Any] = field(init=False)
    spec_sha256: str = field(init=False)
    #: serving versions whose sync latency this process has settled (observed or seen observed)
    sync_seen: set[str] = field(init=False, default_factory=set)
    #: the last status snapshot (``/v1/status`` and the cluster gauges), ``status_cache_s`` old
    status_cache: Snapshot = field(init=False)
    #: the threads ``/readyz`` pings Redis from (never the heavy reads' pool)
    ping_limiter: anyio.CapacityLimiter = field(init=False)

    def __post_init__(self) -> None:
        s, m = self.settings, self.metrics
        retry = RetryPolicy(initial_s=0.05, max_s=0.5, deadline_s=self.give_up_s)
        self.bus = RedisBus(self.text, retry=retry, stream_maxlen=s.stream_maxlen,
                            on_retry=lambda what, e: m.redis_retries.inc(),
                            wait_replicas=s.redis_wait_replicas,
                            wait_timeout_ms=s.redis_wait_timeout_ms)
        self.registry = Registry(self.bus, s.key_prefix)
        self.rollouts = RolloutStore(self.binary, s.key_prefix, m, ttl_s=s.guidance_ttl_s,
                                     retry=retry, max_path_pairs=s.max_path_pairs)
        self.guidance = GuidanceStore.from_settings(s, m, client=self.binary, retry=retry)
        self.staleness = StalenessGuard(self.registry, s.max_version_diff, s.stale_rollouts, m)
        self.heartbeat = ServiceHeartbeat(
            self.text, "api", instance_name(s), period_s=s.service_heartbeat_s,
            ttl_s=max(s.service_heartbeat_ttl_s, 2 * s.service_heartbeat_s),
            info=lambda: {"preset": s.preset, "url": s.resolved_api_url,
                          **self.staleness.describe()}, prefix=s.key_prefix)
        self.spec = PRESETS[s.preset].to_dict()
        self.spec_sha256 = spec_sha256(self.spec)
        self.status_cache = Snapshot(s.status_cache_s)
        self.ping_limiter = anyio.CapacityLimiter(PING_THREADS)

    def close(self) -> None:
        """Stop the heartbeat, close the guidance store's connections (and owned clients)."""
        self.heartbeat.stop()
        self.guidance.close()
        if self.own_clients:
            self.text.close()
            self.binary.close()


async def get_state(request: Request) -> ApiState:
    """The app's shared state (a FastAPI dependency; ``async``, so it takes no thread)."""
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
