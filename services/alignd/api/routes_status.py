"""``/v1/status``, and the same snapshot as gauges at every scrape of ``/metrics``.

:func:`collect_status` reads the shared state from Redis (versions, heartbeats, the
windowed discrepancy, guidance totals). The app hands :func:`cluster_state` of it to
:meth:`Metrics.watch_cluster <alignd.infra.telemetry.Metrics.watch_cluster>`, so the gauges
of shared state are read when Prometheus scrapes: an idle API costs nothing. The route and
the gauges both read :func:`current_status`, the snapshot of
:attr:`ApiState.status_cache <alignd.api.state.ApiState.status_cache>`, which one caller at a
time recomputes once it is older than ``status_cache_s`` (40 clients looping on the route
cost one computation a second, not forty at once). ``GET /v1/status`` is ``async``: a fresh
snapshot is answered from the event loop without a thread.

Sync stage latencies are observed once per version: when a version is first seen in
``serving``, its id is added to ``P:api:sync_observed`` (a Redis set) and only the API
process whose ``SADD`` added it observes the histogram, so several API replicas do not
count a version twice. The stages come from the registry's history (server timestamps).
"""

from __future__ import annotations

import time

from alignclient.models import Discrepancy, GuidanceSummary, ServiceStatus, Status
from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from alignd.api.state import ApiState, State
from alignd.infra.liveness import list_heartbeats
from alignd.infra.registry import STATES, HistoryEntry, VersionState
from alignd.infra.telemetry import ClusterState, PathGap

router = APIRouter(prefix="/v1", tags=["status"])


def sync_stages(history: list[HistoryEntry]) -> dict[str, float]:
    """convert / load / total seconds of a version that reached serving, from its history."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for h in history:
        first.setdefault(h.to_state, h.at)
        last[h.to_state] = h.at
    out: dict[str, float] = {}
    if "converting" in first and "converted" in last:
        out["convert"] = last["converted"] - first["converting"]
    if "loading" in last and "serving" in last:
        out["load"] = last["serving"] - last["loading"]
    if "published" in first and "serving" in last:
        out["total"] = last["serving"] - first["published"]
    return out


def version_lag(versions: list[VersionState]) -> int:
    """Newest version's position minus the newest serving one's (all, if none serves);
    ``versions`` oldest first (the status page: at most its page)."""
    serving = [i for i, v in enumerate(versions) if v.state == "serving"]
    if not versions:
        return 0
    return len(versions) - 1 - serving[-1] if serving else len(versions)


def _observe_syncs(st: ApiState, versions: list[VersionState]) -> None:
    key = f"{st.settings.key_prefix}:api:sync_observed"
    for v in versions:
        if v.state != "serving" or v.version_id in st.sync_seen:
            continue
        added = st.bus.call("sync observed", lambda v=v: st.text.sadd(key, v.version_id))
        if added:
            st.metrics.observe_sync(sync_stages(st.registry.history(v.version_id)))
        st.sync_seen.add(v.version_id)  # settled either way: no more round trips for it


def _services(st: ApiState) -> list[ServiceStatus]:
    rows = list_heartbeats(st.bus, st.settings.key_prefix, ttl_s=st.settings.service_heartbeat_ttl_s)
    return [ServiceStatus(**r) for r in rows]


def _guidance(st: ApiState) -> GuidanceSummary:
    g = st.guidance.stats()
    return GuidanceSummary(**{k: g[k] for k in GuidanceSummary.model_fields if k in g})


def collect_status(st: ApiState) -> Status:
    """Versions, services, discrepancy and guidance in one snapshot.

    The versions are the newest page (``status_versions``, default 100): the counts per
    state, the newest per state and the lag cover that page (``versions_counted`` of
    ``versions_total``), so the snapshot costs the same at 10 versions or 100,000.
    Reading it observes the sync latencies of versions newly serving and refreshes the
    guidance store's byte gauge.
    """
    versions = st.registry.recent_states(st.settings.status_versions)
    _observe_syncs(st, versions)
    lag = version_lag(versions)
    by_state = {s: 0 for s in STATES}
    latest: dict[str, str | None] = {s: None for s in STATES}
    for v in versions:  # oldest first: the last one seen per state is the newest
        by_state[v.state] += 1
        latest[v.state] = v.version_id
    disc: Discrepancy = st.rollouts.discrepancy(None, st.settings.discrepancy_window_tokens)
    return Status(time=time.time(), versions_by_state=by_state, latest=latest,
                  weight_version_lag=lag, versions_total=st.registry.count(),
                  versions_counted=len(versions), services=_services(st), discrepancy=disc,
                  guidance=_guidance(st))


def current_status(st: ApiState) -> Status:
    """:func:`collect_status`, reused for ``status_cache_s`` (one computation at a time)."""
    return st.status_cache.get(lambda: collect_status(st))


def cluster_state(status: Status) -> ClusterState:
    """The gauges' view of a status snapshot (path pairs with tokens in the window)."""
    up: dict[str, bool] = {}
    for s in status.services:
        up[s.service] = up.get(s.service, False) or s.up
    gaps = [PathGap(p.learner_path, p.sampler_path, mean_abs=p.stats.mean_abs,
                    p99_abs=p.stats.p99_abs, clip_potential=p.stats.clip_potential,
                    tis_truncated=p.stats.tis_truncated_fraction)
            for p in status.discrepancy.by_path if p.stats.count]
    return ClusterState(services_up=up, weight_version_lag=status.weight_version_lag, gaps=gaps)


@router.get("/status", operation_id="get_status", response_model=Status)
async def get_status(st: State) -> Status:
    """Versions per state, services' heartbeats, the current discrepancy, guidance totals."""
    fresh = st.status_cache.fresh()
    return fresh if fresh is not None else await run_in_threadpool(current_status, st)
