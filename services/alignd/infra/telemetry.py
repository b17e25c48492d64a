"""Every Prometheus metric of the libalign services, defined in this one module.

Names start with ``libalign_`` and end in their base unit: ``_seconds``, ``_bytes``,
``_total`` for counters, ratios in 0..1. Latencies are histograms (aggregatable across
instances, unlike summaries). Label values come from small fixed sets, never from ids or
free text: a version id as a label would create one time series per version.

:class:`Metrics` registers everything on its own :class:`CollectorRegistry` (a fresh one
unless given), never on prometheus_client's global default, so several services or
tests in one process do not collide. :func:`serve_metrics` exposes a registry on
``/metrics`` (and ``/healthz``) from a background HTTP server. Only prometheus_client's
public API is used: its metric classes for what a process counts itself, and two custom
collectors (``collect()`` yielding metric families) where the ready-made classes do not fit.

The execution gap. ``libalign_logprob_abs_delta`` is a histogram of |δ| = |log p_learner −
log p_sampler| per scored token, by ``learner_path`` and ``sampler_path``; its buckets span
1e-4 to 2 nats on a 1-2.5-5 grid, the range between "bit-identical but for reduction order"
and "a different token distribution". Scoring a batch adds tens of thousands of tokens at
once, and prometheus_client's ``Histogram`` takes one value per call, so this histogram is a
:class:`BatchHistogram`: it counts a whole array per bucket in one vectorized pass. Its path
labels, like those of the windowed gauges below, are the pairs the rollout store keeps apart
(:mod:`alignd.infra.stores.rollouts`): at most ``max_path_pairs`` (learner path, sampler path)
pairs, the first ones scored, and ``other``/``other``, the aggregate of every further pair
(its buckets, sum and gauges cover the tokens of all of them). The histogram itself never
holds more label sets than it was allowed (:meth:`Metrics.allow_path_pairs`), so writers
inventing paths cannot grow ``/metrics``. ``libalign_rollout_tokens_total`` labels by the
sampler path alone, an execution path name (:data:`libalign.gemm.PATHS`) or ``other``.

Shared state, read from Redis when scraped. Whether each service has a live heartbeat
(``libalign_service_up``), the weight-version lag and the windowed discrepancy
(``libalign_discrepancy_*``, ``libalign_clip_potential_ratio``,
``libalign_tis_truncated_ratio``: the last ``discrepancy_window_tokens`` scored tokens)
describe Redis, not the process. :class:`ClusterGauges` yields them from a
:class:`ClusterState` that the control API reads at every scrape
(:meth:`Metrics.watch_cluster`); other processes expose these families without samples.

Weight sync. ``libalign_sync_stage_seconds`` is observed once per version when it reaches
``serving``, from the registry's history timestamps (server clock): ``convert`` from the
first ``converting`` to ``converted``, ``load`` from ``loading`` to ``serving``, ``total``
from ``published`` to ``serving``.

Kernels. ``libalign_kernel_backend_info{device, backend}`` is 1 for the implementation that
serves NVFP4 quantization on each device type of the process: the compiled kernel (``cpu``,
``cuda``) or ``spec``, the reference implementation that a missing or failed kernel build
falls back to (same bits, about 20x slower), as :func:`libalign.kernels.backends` finds them. A
service reports it when it starts (:func:`serve_metrics_for`), so a fallback shows in
``/metrics``, not only in a warning; its log says why (the build or load error).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import numpy as np
from alignclient.errors import AlignError
from alignclient.models import OTHER_PATH
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from alignd.infra.settings import DEFAULT_MAX_PATH_PAIRS, ServiceSettings
from libalign.gemm import PATHS
from libalign.kernels import DeviceBackend, backends

if TYPE_CHECKING:
    from alignd.formats.manifest import Manifest

log = logging.getLogger(__name__)

#: Conversion stages, the values of the ``stage`` label.
STAGES = ("read", "quantize", "write")

#: Failure reasons, the values of the ``reason`` label (error codes; the rest is "other").
FAILURE_REASONS = (
    "non_finite", "invalid_dtype", "invalid_shape", "invalid_spec", "undefined_scale",
    "invalid_layout", "invalid_input", "missing_shard", "invalid_event", "version_not_found",
    "checksum_mismatch", "invalid_manifest", "too_many_deliveries", "no_space", "other",
)

#: Stages of a weight sync, the values of the ``stage`` label of libalign_sync_stage_seconds.
SYNC_STAGES = ("convert", "load", "total")
#: What the retention pass counts (``libalign_retention_actions_total{action}``).
RETENTION_ACTIONS = ("retired", "pruned", "exports_pruned", "consumers_removed",
                     "groups_destroyed")
#: What happens to a rollout beyond ``max_version_diff`` (``libalign_rollouts_stale_total{action}``).
STALE_ACTIONS = ("dropped", "refused")

#: Services that write heartbeats, the values of the ``service`` label.
SERVICES = ("api", "converter", "sampler", "learner")

#: HTTP status classes, the values of the ``status_class`` label.
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")

#: Upper bounds of the |δ| histogram, nats.
ABS_DELTA_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.0)

_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: Values of ``reason`` (libalign_redis_refusals_total) and ``cause`` (..._vanished_total).
REDIS_REFUSAL_REASONS, VANISHED_CAUSES = ("oom", "auth", "noperm"), ("expired", "lost", "unknown")

# Process-wide: counted wherever this process meets them (bus, stores, start-up check, see
# alignd.infra.redis_checks); every Metrics registers them on its own registry.
REDIS_REFUSALS = Counter(
    "libalign_redis_refusals_total", "Redis commands refused for a reason no retry fixes: oom "
    "(full, noeviction), auth (bad credentials), noperm (the ACL user may not run it).",
    ["reason"], registry=None)
REDIS_POLICY_UNVERIFIED = Counter(
    "libalign_redis_policy_unverified_total", "Start-up checks that could not read the Redis "
    "maxmemory-policy and went on (redis_allow_unverified_policy).", registry=None)
REDIS_UNREPLICATED = Counter(
    "libalign_redis_unreplicated_writes_total", "Registry writes and guidance puts that fewer "
    "replicas than redis_wait_replicas acknowledged within redis_wait_timeout_ms (WAIT): a "
    "failover of their master may lose them.", registry=None)
PROCESS_COUNTERS = (REDIS_REFUSALS, REDIS_POLICY_UNVERIFIED, REDIS_UNREPLICATED)
for _reason in REDIS_REFUSAL_REASONS:
    REDIS_REFUSALS.labels(reason=_reason)


def failure_reason(err: BaseException | str) -> str:
    """Bounded ``reason`` label of an error (its code if known, else ``other``)."""
    if isinstance(err, str):
        code = err
    elif isinstance(err, AlignError):
        code = err.code
    else:
        code = "other"
    return code if code in FAILURE_REASONS else "other"


def path_label(name: str) -> str:
    """Bounded ``learner_path``/``sampler_path`` label: a known execution path, else ``other``."""
    return name if name in PATHS else OTHER_PATH


def status_class(status: int) -> str:
    """``2xx`` .. ``5xx`` for an HTTP status (1xx and odd values count as ``5xx``)."""
    cls = f"{status // 100}xx"
    return cls if cls in STATUS_CLASSES else "5xx"


class BatchHistogram(Collector):
    """A labelled histogram that takes a whole array of observations in one call.

    It exposes what a prometheus_client ``Histogram`` with the same name, labels and buckets
    would after one ``observe`` per value: a value lands in the first bucket whose upper
    bound is >= it (``searchsorted(side="left")``), ``_count`` is the ``+Inf`` bucket.
    With ``max_series``, at most that many label sets besides ``overflow`` get their own
    series; the values of any later new one are added to ``overflow``'s.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], *, max_series: int | None = None,
                 overflow: Sequence[str] = ()):
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.max_series, self.overflow = max_series, tuple(overflow)
        if max_series is not None and len(self.overflow) != len(self.labelnames):
            raise ValueError(f"{name}: max_series needs an overflow label set of "
                             f"{len(self.labelnames)} values")
        self.bounds = np.asarray(sorted(buckets), dtype=np.float64)
        self.le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], np.ndarray] = {}  # per bucket, not cumulative
        self._sums: dict[tuple[str, ...], float] = {}

    def observe_many(self, label_values: Sequence[str], values) -> None:
        """Add every value of ``values`` (any array-like) under ``label_values``."""
        key = tuple(label_values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
        x = np.asarray(values, dtype=np.float64).ravel()
        if x.size == 0:
            return
        counts = np.bincount(np.searchsorted(self.bounds, x, side="left"),
                             minlength=len(self.le))
        total = float(x.sum())
        with self._lock:
            if (key not in self._counts and self.max_series is not None
                    and key != self.overflow
                    and len(self._counts) - (self.overflow in self._counts) >= self.max_series):
                key = self.overflow
            if key in self._counts:
                self._counts[key] += counts
                self._sums[key] += total
            else:
                self._counts[key], self._sums[key] = counts, total

    def describe(self) -> Iterator[HistogramMetricFamily]:
        """The family's name and type, so the registry can refuse a duplicate."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        """Cumulative buckets and the sum of every label set observed so far."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            rows = [(k, np.cumsum(c), self._sums[k]) for k, c in self._counts.items()]
        for key, cumulative, total in rows:
            family.add_metric(list(key), list(zip(self.le, cumulative.tolist(), strict=True)),
                              total)
        yield family


@dataclass(frozen=True)
class PathGap:
    """Windowed discrepancy statistics of one (learner path, sampler path) pair."""

    learner_path: str
    sampler_path: str
    mean_abs: float
    p99_abs: float
    clip_potential: float
    tis_truncated: float


@dataclass(frozen=True)
class ClusterState:
    """What :class:`ClusterGauges` exposes: shared state as read from Redis."""

    services_up: Mapping[str, bool]
    weight_version_lag: int
    gaps: Sequence[PathGap] = ()


#: name, help and labels of each gauge of :class:`ClusterGauges`.
CLUSTER_GAUGES = (
    ("libalign_service_up",
     "1 if at least one instance of the service has a live heartbeat, else 0.", ("service",)),
    ("libalign_weight_version_lag",
     "Versions between the newest one published and the newest one serving, by position in "
     "the registry's creation order.", ()),
    ("libalign_discrepancy_p99_abs",
     "P99 of |delta log p| over the discrepancy window (last N scored tokens), nats.",
     ("learner_path", "sampler_path")),
    ("libalign_discrepancy_mean_abs", "Mean |delta log p| over the discrepancy window, nats.",
     ("learner_path", "sampler_path")),
    ("libalign_clip_potential_ratio",
     "Fraction of window tokens whose ratio exp(delta) lies outside the clip band "
     "[0.8, 1.28] before any update.", ("learner_path", "sampler_path")),
    ("libalign_tis_truncated_ratio",
     "Fraction of window tokens whose token-level TIS weight is truncated at C=2.",
     ("learner_path", "sampler_path")),
)


class ClusterGauges(Collector):
    """The gauges of shared state, from a :class:`ClusterState` read at every scrape.

    Without a reader (every process but the control API) the families have no samples. A
    failed read is logged and the last state read is served again: stale gauges beat a
    failed scrape, which would drop the counters too. :class:`Metrics` registers this
    collector first, so whatever reading the state records in other metrics of the same
    registry (the API observes a version's sync latencies when it first sees it serving and
    refreshes the guidance byte gauge) is in the same scrape.
    """

    def __init__(self) -> None:
        self._read: Callable[[], ClusterState] | None = None
        self._last: ClusterState | None = None

    def watch(self, read: Callable[[], ClusterState] | None) -> None:
        """Read the state with ``read`` at every scrape from now on (None: stop)."""
        self._read, self._last = read, None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The families' names and types, so the registry can refuse a duplicate."""
        return self._families(None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges of the state read now (or of the last one read, if this read fails)."""
        read, state = self._read, self._last
        if read is not None:
            try:
                state = self._last = read()
            except Exception as e:  # any failure: serve the last state
                log.warning("reading the cluster state for /metrics failed, serving the "
                            "last one read: %s", e)
        return self._families(state)

    @staticmethod
    def _families(state: ClusterState | None) -> Iterator[GaugeMetricFamily]:
        fams = {name: GaugeMetricFamily(name, doc, labels=labels)
                for name, doc, labels in CLUSTER_GAUGES}
        if state is not None:
            for svc in SERVICES:
                fams["libalign_service_up"].add_metric(
                    [svc], 1.0 if state.services_up.get(svc) else 0.0)
            fams["libalign_weight_version_lag"].add_metric([], float(state.weight_version_lag))
            # the pairs the rollout store keeps apart (bounded there), other/other among them
            gaps = {(g.learner_path, g.sampler_path): g for g in state.gaps}
            for pair, g in gaps.items():
                fams["libalign_discrepancy_p99_abs"].add_metric(list(pair), g.p99_abs)
                fams["libalign_discrepancy_mean_abs"].add_metric(list(pair), g.mean_abs)
                fams["libalign_clip_potential_ratio"].add_metric(list(pair), g.clip_potential)
                fams["libalign_tis_truncated_ratio"].add_metric(list(pair), g.tis_truncated)
        return iter(fams.values())


class Metrics:
    """The metric objects, registered on one (private by default) registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.cluster = ClusterGauges()
        r.register(self.cluster)  # first: see ClusterGauges
        for counter in PROCESS_COUNTERS:
            r.register(counter)
        self.conversion_stage_seconds = Histogram(
            "libalign_conversion_stage_seconds",
            "Seconds one version's conversion spent per stage (read, quantize, write).",
            ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.conversion_seconds = Histogram(
            "libalign_conversion_seconds",
            "Seconds from taking a published version to it being converted and recorded.",
            buckets=_STAGE_BUCKETS, registry=r)
        self.conversion_input_bytes = Counter(
            "libalign_conversion_input_bytes_total",
            "Bytes of source (BF16) tensors read and converted.", registry=r)
        self.conversion_output_bytes = Counter(
            "libalign_conversion_output_bytes_total",
            "Bytes of NVFP4 (and raw) tensor files written to the weight store.", registry=r)
        self.versions_converted = Counter(
            "libalign_versions_converted_total", "Weight versions converted to NVFP4.", registry=r)
        self.versions_failed = Counter(
            "libalign_versions_failed_total", "Weight versions moved to failed, by reason.",
            ["reason"], registry=r)
        self.retention_actions = Counter(
            "libalign_retention_actions_total",
            "What the retention pass did: versions retired, versions pruned with their store "
            "directories, ModelOpt exports pruned, dead stream consumers and consumer groups "
            "removed.",
            ["action"], registry=r)
        self.messages_reclaimed = Counter(
            "libalign_bus_messages_reclaimed_total",
            "Stream messages taken over from a consumer that stopped (XAUTOCLAIM).", registry=r)
        self.redis_retries = Counter(
            "libalign_bus_redis_retries_total",
            "Redis calls retried after a connection error.", registry=r)
        self.converter_busy = Gauge(
            "libalign_converter_busy_ratio", "1 while the converter works on a version, else 0.",
            registry=r)
        self.guidance_stored_bytes = Gauge(
            "libalign_guidance_stored_bytes",
            "Payload bytes the guidance store holds (its byte budget's measure), read from Redis.",
            registry=r)
        self.guidance_hits = Counter(
            "libalign_guidance_hits_total", "Guidance records read and verified.", registry=r)
        self.guidance_misses = Counter(
            "libalign_guidance_misses_total",
            "Guidance records asked for and not there (unknown, expired or evicted).", registry=r)
        self.guidance_evictions = Counter(
            "libalign_guidance_evictions_total",
            "Versions evicted from the guidance store to stay within its budget; in_use=true "
            "when a consumer held a lease on the version.", ["in_use"], registry=r)
        self.guidance_put_bytes = Counter(
            "libalign_guidance_put_bytes_total", "Guidance record bytes stored.", registry=r)
        self.guidance_get_bytes = Counter(
            "libalign_guidance_get_bytes_total", "Guidance record bytes read and verified.",
            registry=r)
        self.guidance_vanished = Counter(
            "libalign_guidance_vanished_total", "Guidance versions whose keys Redis removed: "
            "expired (TTL ran out), lost (gone before the deadline: evicted, or deleted outside "
            "the store), unknown (no deadline recorded).", ["cause"], registry=r)
        self.guidance_lost_records = Counter(
            "libalign_guidance_lost_records_total", "Guidance records found gone while their "
            "version was still stored (evicted, or deleted outside the store).", registry=r)
        self.guidance_refused_puts = Counter(
            "libalign_guidance_refused_puts_total",
            "Guidance puts refused because the byte budget had no room.", registry=r)
        self.logprob_abs_delta = BatchHistogram(
            "libalign_logprob_abs_delta",
            "|log p_learner - log p_sampler| per scored token, nats.",
            ["learner_path", "sampler_path"], ABS_DELTA_BUCKETS,
            max_series=DEFAULT_MAX_PATH_PAIRS, overflow=(OTHER_PATH, OTHER_PATH))
        r.register(self.logprob_abs_delta)
        self.scores_folded = Counter(
            "libalign_scores_folded_total",
            "Learner scores recorded under the path pair other/other because max_path_pairs "
            "other pairs were already kept apart.", registry=r)
        self.rollouts_stale = Counter(
            "libalign_rollouts_stale_total",
            "Rollouts whose version was more than max_version_diff versions older than the "
            "current one, dropped or refused.", ["action"], registry=r)
        self.rollouts_unreplayed = Counter(
            "libalign_rollouts_unreplayed_total",
            "Rollouts refused for training under routing replay (R3) because they carry no "
            "routing record.", registry=r)
        self.rollout_tokens = Counter(
            "libalign_rollout_tokens_total",
            "Generated (non-prompt) tokens of the rollouts stored, by sampler path.",
            ["sampler_path"], registry=r)
        self.sync_stage_seconds = Histogram(
            "libalign_sync_stage_seconds",
            "Seconds a weight version spent per sync stage (convert, load, total), from the "
            "registry's history, observed when it reaches serving.",
            ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.sampler_load_seconds = Histogram(
            "libalign_sampler_load_seconds",
            "Seconds a sampler took to verify and switch to a weight version.",
            buckets=_STAGE_BUCKETS, registry=r)
        self.sampler_loads = Counter(
            "libalign_sampler_loads_total",
            "Weight-version loads a sampler attempted, by outcome (loaded, refused).",
            ["outcome"], registry=r)
        self.sampler_requests = Counter(
            "libalign_sampler_requests_total",
            "Rollout requests a sampler answered, by outcome (served, error).",
            ["outcome"], registry=r)
        self.kernel_backend = Gauge(
            "libalign_kernel_backend_info",
            "1 for the implementation serving NVFP4 quantization on each device type of the "
            "process: its compiled kernel (cpu, cuda) or spec (the reference fallback).",
            ["device", "backend"], registry=r)
        self.api_requests = Counter(
            "libalign_api_requests_total",
            "Control API requests answered, by route template and status class.",
            ["route", "status_class"], registry=r)
        self.api_request_seconds = Histogram(
            "libalign_api_request_seconds",
            "Seconds the control API took to answer a request, by route template.",
            ["route"], buckets=_REQUEST_BUCKETS, registry=r)
        for s in STAGES:
            self.conversion_stage_seconds.labels(stage=s)
        for s in SYNC_STAGES:
            self.sync_stage_seconds.labels(stage=s)
        for reason in FAILURE_REASONS:
            self.versions_failed.labels(reason=reason)
        for action in RETENTION_ACTIONS:
            self.retention_actions.labels(action=action)
        for cause in VANISHED_CAUSES:
            self.guidance_vanished.labels(cause=cause)
        for in_use in ("true", "false"):
            self.guidance_evictions.labels(in_use=in_use)
        for outcome in ("loaded", "refused"):
            self.sampler_loads.labels(outcome=outcome)
        for outcome in ("served", "error"):
            self.sampler_requests.labels(outcome=outcome)

    def observe_conversion(self, manifest: Manifest, total_s: float) -> None:
        """Record one successful conversion from its manifest's timings and totals."""
        for s in STAGES:
            self.conversion_stage_seconds.labels(stage=s).observe(
                float(getattr(manifest.timings, f"{s}_s")))
        self.conversion_seconds.observe(total_s)
        self.conversion_input_bytes.inc(manifest.totals.source_bytes)
        self.conversion_output_bytes.inc(manifest.totals.stored_bytes)
        self.versions_converted.inc()

    def observe_failure(self, err: BaseException | str) -> None:
        """Count one failed version under its bounded reason."""
        self.versions_failed.labels(reason=failure_reason(err)).inc()

    def observe_abs_deltas(self, learner_path: str, sampler_path: str, abs_delta) -> None:
        """Add many |δ| values (any array-like) to the histogram in one pass, under the pair
        the rollout store recorded them under."""
        self.logprob_abs_delta.observe_many([learner_path, sampler_path], abs_delta)

    def allow_path_pairs(self, n: int) -> None:
        """Let the |δ| histogram keep up to ``n`` path pairs apart besides other/other (a
        rollout store calls it with its cap; the largest asked for holds)."""
        h = self.logprob_abs_delta
        h.max_series = max(n, h.max_series or 0)

    def watch_cluster(self, read: Callable[[], ClusterState] | None) -> None:
        """Expose the shared-state gauges from ``read()`` at every scrape (None: stop)."""
        self.cluster.watch(read)

    def report_kernel_backends(self, found: Mapping[str, DeviceBackend] | None = None
                               ) -> dict[str, DeviceBackend]:
        """Set ``libalign_kernel_backend_info`` from ``found`` (default: :func:`libalign.kernels.backends`,
        which builds or loads the kernels now)."""
        found = dict(backends() if found is None else found)
        self.kernel_backend.clear()
        for device, b in found.items():
            self.kernel_backend.labels(device=device, backend=b.backend).set(1)
        return found

    def observe_sync(self, stages: dict[str, float]) -> None:
        """Record one version's sync stage durations (keys from ``SYNC_STAGES``)."""
        for stage, seconds in stages.items():
            if stage in SYNC_STAGES:
                self.sync_stage_seconds.labels(stage=stage).observe(max(0.0, float(seconds)))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """Count one API request and its latency under its route template."""
        self.api_requests.labels(route=route, status_class=status_class(status)).inc()
        self.api_request_seconds.labels(route=route).observe(seconds)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0.0 if absent); for tests and health output."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v


def serve_metrics(registry: CollectorRegistry, port: int = 0, addr: str = "0.0.0.0",
                  healthy: Callable[[], bool] | None = None) -> ThreadingHTTPServer:
    """Serve ``/metrics`` and ``/healthz`` in a daemon thread; ``server.server_port``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            """``/metrics``: exposition text; ``/healthz``: 200 ok or 503."""
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, status, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            elif path == "/healthz":
                ok = healthy() if healthy is not None else True
                body, status, ctype = (b"ok\n" if ok else b"unhealthy\n"), (200 if ok else 503), "text/plain"
            else:
                body, status, ctype = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            """Silence per-request logging."""

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def serve_metrics_for(settings: ServiceSettings, metrics: Metrics) -> Callable[[], None]:
    """What a service does with its metrics when it starts: report its kernel backends and
    serve the registry on ``settings.metrics_port`` (if set); returns the function that
    stops the server again (a no-op when none was started)."""
    for device, b in metrics.report_kernel_backends().items():
        if b.fallback:
            log.warning("NVFP4 quantization on %s falls back to the reference spec: %s", device,
                        b.reason)
        else:
            log.info("NVFP4 quantization on %s: %s", device, b.reason)
    if settings.metrics_port is None:
        return lambda: None
    server = serve_metrics(metrics.registry, settings.metrics_port, settings.metrics_addr)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return stop


#: Outcomes of one batch a trainer pushes to the daemon (``libalign_integration_pushes_total``).
PUSH_OUTCOMES = ("delivered", "dropped", "rejected", "abandoned")


class TrainerMetrics:
    """What a trainer process exports when it measures the gap itself (``alignd.integrations``).

    The gap families carry the daemon's names and labels: ``libalign_logprob_abs_delta`` (the
    same histogram as :attr:`Metrics.logprob_abs_delta`) and the four gap gauges of
    :data:`CLUSTER_GAUGES`, here over the last batch the trainer observed rather than the
    daemon's window. The push families count what became of each batch sent to the daemon in
    the background: ``delivered``, ``dropped`` (the queue was at its batch or byte bound), ``rejected`` (the
    API refused it: a 4xx other than a retryable one) or ``abandoned`` (the bounded retries ran
    out, or the monitor closed first); retried attempts and the queue depth beside them.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.logprob_abs_delta = BatchHistogram(
            "libalign_logprob_abs_delta",
            "|log p_learner - log p_sampler| per scored token, nats.",
            ["learner_path", "sampler_path"], ABS_DELTA_BUCKETS)
        r.register(self.logprob_abs_delta)
        pair = ("learner_path", "sampler_path")
        self.gap = {name: Gauge(name, doc, pair, registry=r) for name, doc in (
            ("libalign_discrepancy_p99_abs",
             "P99 of |delta log p| over the last batch the trainer observed, nats."),
            ("libalign_discrepancy_mean_abs",
             "Mean |delta log p| over the last batch the trainer observed, nats."),
            ("libalign_clip_potential_ratio",
             "Fraction of the last observed batch's tokens whose ratio exp(delta) lies outside "
             "the clip band before any update."),
            ("libalign_tis_truncated_ratio",
             "Fraction of the last observed batch's tokens whose token-level TIS weight is "
             "truncated at the cap."))}
        self.pushes = Counter(
            "libalign_integration_pushes_total",
            "Batches of rollouts and scores a trainer pushed to the daemon, by outcome "
            "(delivered, dropped, rejected, abandoned).", ["outcome"], registry=r)
        self.push_retries = Counter(
            "libalign_integration_push_retries_total",
            "Push attempts that failed with a transient error and were retried.", registry=r)
        self.push_queue = Gauge(
            "libalign_integration_push_queue_batches",
            "Batches waiting in the trainer's push queue.", registry=r)
        self.push_queue_bytes = Gauge(
            "libalign_integration_push_queue_bytes",
            "Bytes of the batches the trainer's push queue holds (waiting or being sent); "
            "a batch that would take it past its byte bound is dropped.", registry=r)
        for outcome in PUSH_OUTCOMES:
            self.pushes.labels(outcome=outcome)

    def observe_gap(self, learner_path: str, sampler_path: str, abs_delta, *, mean_abs: float,
                    p99_abs: float, clip_potential: float, tis_truncated: float) -> None:
        """Add one batch's |δ| to the histogram and set the gap gauges from its summary."""
        pair = [path_label(learner_path), path_label(sampler_path)]
        self.logprob_abs_delta.observe_many(pair, abs_delta)
        for name, value in (("libalign_discrepancy_p99_abs", p99_abs),
                            ("libalign_discrepancy_mean_abs", mean_abs),
                            ("libalign_clip_potential_ratio", clip_potential),
                            ("libalign_tis_truncated_ratio", tis_truncated)):
            self.gap[name].labels(*pair).set(value)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0.0 if absent)."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v
