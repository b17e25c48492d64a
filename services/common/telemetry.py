"""Every Prometheus metric of the libalign services, defined in this one module.

Names start with ``libalign_`` and end in their base unit: ``_seconds``, ``_bytes``,
``_total`` for counters, ratios in 0..1. Latencies are histograms (aggregatable across
instances, unlike summaries). Label values come from small fixed sets, never from ids or
free text: a version id as a label would create one time series per version.

:class:`Metrics` registers everything on its own :class:`CollectorRegistry` (a fresh one
unless given), never on prometheus_client's global default, so several services or
tests in one process do not collide. :func:`serve_metrics` exposes a registry on
``/metrics`` (and ``/healthz``) from a background HTTP server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from libalign.errors import AlignError

#: Conversion stages, the values of the ``stage`` label.
STAGES = ("read", "quantize", "write")

#: Failure reasons, the values of the ``reason`` label (error codes; the rest is "other").
FAILURE_REASONS = (
    "non_finite", "invalid_dtype", "invalid_shape", "invalid_spec", "undefined_scale",
    "invalid_layout", "invalid_input", "missing_shard", "invalid_event", "version_not_found",
    "checksum_mismatch", "invalid_manifest", "too_many_deliveries", "other",
)

_STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def failure_reason(err: BaseException | str) -> str:
    """Bounded ``reason`` label of an error (its code if known, else ``other``)."""
    if isinstance(err, str):
        code = err
    elif isinstance(err, AlignError):
        code = err.code
    else:
        code = "other"
    return code if code in FAILURE_REASONS else "other"


class Metrics:
    """The metric objects, registered on one (private by default) registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
        self.guidance_refused_puts = Counter(
            "libalign_guidance_refused_puts_total",
            "Guidance puts refused because the byte budget had no room.", registry=r)
        for s in STAGES:
            self.conversion_stage_seconds.labels(stage=s)
        for reason in FAILURE_REASONS:
            self.versions_failed.labels(reason=reason)
        for in_use in ("true", "false"):
            self.guidance_evictions.labels(in_use=in_use)

    def observe_conversion(self, manifest: dict, total_s: float) -> None:
        """Record one successful conversion from its manifest's timings and totals."""
        timings = manifest.get("timings", {})
        for s in STAGES:
            self.conversion_stage_seconds.labels(stage=s).observe(float(timings.get(f"{s}_s", 0.0)))
        self.conversion_seconds.observe(total_s)
        totals = manifest.get("totals", {})
        self.conversion_input_bytes.inc(int(totals.get("source_bytes", 0)))
        self.conversion_output_bytes.inc(int(totals.get("stored_bytes", 0)))
        self.versions_converted.inc()

    def observe_failure(self, err: BaseException | str) -> None:
        """Count one failed version under its bounded reason."""
        self.versions_failed.labels(reason=failure_reason(err)).inc()

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
