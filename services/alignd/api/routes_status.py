"""``/v1/status`` and the gauges derived from Redis state (refreshed on status and scrape).

Gauges that describe shared state (services up, weight-version lag, the windowed
discrepancy, guidance bytes) are recomputed from Redis when ``/v1/status`` or ``/metrics``
is asked for, so an idle API costs nothing and a scrape is never staler than Redis.

Sync stage latencies are observed once per version: when a version is first seen in
``serving``, its id is added to ``P:api:sync_observed`` (a Redis set) and only the API
process whose ``SADD`` added it observes the histogram, so several API replicas do not
count a version twice. The stages come from the registry's history (server timestamps).
"""

from __future__ import annotations

import time

from alignclient.models import Discrepancy, GuidanceSummary, ServiceStatus, Status
from fastapi import APIRouter

from alignd.api.state import ApiState, State
from alignd.infra.liveness import list_heartbeats
from alignd.infra.registry import STATES, HistoryEntry, VersionRecord
from alignd.infra.telemetry import SERVICES

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


def version_lag(versions: list[VersionRecord]) -> int:
    """Newest version's position minus the newest serving one's (all, if none serves)."""
    serving = [i for i, v in enumerate(versions) if v.state == "serving"]
    if not versions:
        return 0
    return len(versions) - 1 - serving[-1] if serving else len(versions)


def _observe_syncs(st: ApiState, versions: list[VersionRecord]) -> None:
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
    out = [ServiceStatus(**r) for r in rows]
    for svc in SERVICES:
        st.metrics.service_up.labels(service=svc).set(
            1.0 if any(s.up for s in out if s.service == svc) else 0.0)
    return out


def _guidance(st: ApiState) -> GuidanceSummary:
    g = st.guidance.stats()
    return GuidanceSummary(**{k: g[k] for k in GuidanceSummary.model_fields if k in g})


def collect_status(st: ApiState) -> Status:
    """Versions, services, discrepancy and guidance in one snapshot; updates the gauges."""
    versions = st.registry.list_versions()
    _observe_syncs(st, versions)
    lag = version_lag(versions)
    st.metrics.weight_version_lag.set(lag)
    by_state = {s: 0 for s in STATES}
    latest: dict[str, str | None] = {s: None for s in STATES}
    for v in versions:  # oldest first: the last one seen per state is the newest
        by_state[v.state] += 1
        latest[v.state] = v.version_id
    disc: Discrepancy = st.rollouts.discrepancy(None, st.settings.discrepancy_window_tokens)
    return Status(time=time.time(), versions_by_state=by_state, latest=latest,
                  weight_version_lag=lag, services=_services(st), discrepancy=disc,
                  guidance=_guidance(st))


def refresh_metrics(st: ApiState) -> None:
    """Recompute the Redis-derived gauges (what ``collect_status`` does, without the reply)."""
    collect_status(st)


@router.get("/status", operation_id="get_status", response_model=Status)
def get_status(st: State) -> Status:
    """Versions per state, services' heartbeats, the current discrepancy, guidance totals."""
    return collect_status(st)
