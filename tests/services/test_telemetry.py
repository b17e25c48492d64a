"""Pins telemetry's own collectors: the batch |δ| histogram against prometheus_client's
Histogram, the shared-state gauges read at scrape time, and the kernel-backend info metric."""

from __future__ import annotations

import logging
import types

import httpx
import numpy as np
import pytest
import torch
from alignd.infra.telemetry import (
    ABS_DELTA_BUCKETS,
    SERVICES,
    ClusterState,
    Metrics,
    PathGap,
    serve_metrics_for,
)
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from libalign.kernels import DeviceBackend
from tests import kernel_env
from tests.services.conftest import free_port

PAIR = {"learner_path": "bf16", "sampler_path": "nvfp4_minite"}


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    """``{sorted labels: value}`` of every sample called ``name``."""
    return {tuple(sorted(s.labels.items())): s.value
            for fam in registry.collect() for s in fam.samples if s.name == name}


def test_bulk_histogram_matches_observe():
    """observe_abs_deltas fills the same buckets and sum as one observe() per value."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal(2000)) * rng.choice([1e-4, 1e-2, 1.0, 5.0], 2000)
    x[:len(ABS_DELTA_BUCKETS)] = ABS_DELTA_BUCKETS  # values exactly on the bounds
    a = Metrics()
    a.observe_abs_deltas("bf16", "nvfp4_minite", x[:700])
    a.observe_abs_deltas("bf16", "nvfp4_minite", x[700:])  # a second batch adds up
    ref = CollectorRegistry()  # prometheus_client's own Histogram, one observe() per value
    child = Histogram("libalign_logprob_abs_delta", "reference", list(PAIR),
                      buckets=ABS_DELTA_BUCKETS, registry=ref).labels(**PAIR)
    for v in x:
        child.observe(float(v))
    for le in [*map(str, ABS_DELTA_BUCKETS), "+Inf"]:
        labels = {**PAIR, "le": le}
        assert a.value("libalign_logprob_abs_delta_bucket", labels) == \
            ref.get_sample_value("libalign_logprob_abs_delta_bucket", labels), le
    assert samples(a.registry, "libalign_logprob_abs_delta_bucket") == \
        samples(ref, "libalign_logprob_abs_delta_bucket")  # the same le strings, no others
    assert a.value("libalign_logprob_abs_delta_sum", PAIR) == pytest.approx(
        ref.get_sample_value("libalign_logprob_abs_delta_sum", PAIR))
    assert a.value("libalign_logprob_abs_delta_count", PAIR) == 2000
    a.observe_abs_deltas("someone-elses-path", "x", [0.1])  # the pair the store recorded
    assert a.value("libalign_logprob_abs_delta_count",
                   {"learner_path": "someone-elses-path", "sampler_path": "x"}) == 1
    a.observe_abs_deltas("bf16", "nvfp4_minite", [])  # nothing observed, nothing changes
    assert a.value("libalign_logprob_abs_delta_count", PAIR) == 2000


def test_cluster_gauges_are_read_at_every_scrape():
    """Without a reader: the families, no samples; with one: what it reads now, every scrape."""
    m = Metrics()
    text = generate_latest(m.registry).decode()
    assert "# TYPE libalign_service_up gauge" in text and "\nlibalign_service_up{" not in text
    assert m.registry.get_sample_value("libalign_weight_version_lag") is None

    lag = iter([3, 1])
    reads = []

    def read() -> ClusterState:
        reads.append(1)
        return ClusterState(
            services_up={"api": True, "sampler": False}, weight_version_lag=next(lag),
            gaps=[PathGap("bf16", "nvfp4_minite", mean_abs=0.01, p99_abs=0.2,
                          clip_potential=0.05, tis_truncated=0.001)])

    m.watch_cluster(read)
    assert m.value("libalign_weight_version_lag") == 3
    assert m.value("libalign_weight_version_lag") == 1  # read again, not cached
    assert len(reads) == 2
    assert {s: m.value("libalign_service_up", {"service": s}) for s in SERVICES} == {
        "api": 1, "converter": 0, "sampler": 0, "learner": 0}
    assert m.value("libalign_discrepancy_p99_abs", PAIR) == 0.2
    assert m.value("libalign_discrepancy_mean_abs", PAIR) == 0.01
    assert m.value("libalign_clip_potential_ratio", PAIR) == 0.05
    assert m.value("libalign_tis_truncated_ratio", PAIR) == 0.001
    m.watch_cluster(None)
    assert m.registry.get_sample_value("libalign_weight_version_lag") is None


def test_a_failed_read_serves_the_last_state(caplog):
    """Redis down at scrape time: the last gauges read and every counter are still served."""
    m = Metrics()
    state = {"ok": True}

    def read() -> ClusterState:
        if not state["ok"]:
            raise ConnectionError("redis is gone")
        return ClusterState(services_up={"api": True}, weight_version_lag=2,
                            gaps=[PathGap("mystery", "path", 0.1, 0.3, 0.0, 0.0),
                                  PathGap("other-mystery", "path", 0.1, 0.4, 0.0, 0.0)])

    m.watch_cluster(read)
    m.versions_converted.inc()
    assert m.value("libalign_weight_version_lag") == 2
    for lp, p99 in (("mystery", 0.3), ("other-mystery", 0.4)):  # the pairs as the store kept them
        assert m.value("libalign_discrepancy_p99_abs", {"learner_path": lp,
                                                        "sampler_path": "path"}) == p99
    state["ok"] = False
    text = generate_latest(m.registry).decode()
    assert "libalign_weight_version_lag 2.0" in text
    assert "libalign_versions_converted_total 1.0" in text
    assert "redis is gone" in caplog.text


def test_kernel_backends_are_reported_per_device(monkeypatch):
    """One series per device type, value 1; a fallback to the spec shows as backend="spec"."""
    want = {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    m = Metrics()
    got = m.report_kernel_backends()
    assert set(got) == want
    for device, b in got.items():
        assert b.backend in (device, "spec")
        assert m.value("libalign_kernel_backend_info", {"device": device, "backend": b.backend}) == 1
    kernel_env.setenv(monkeypatch, "ALIGN_KERNELS", "spec")  # the compiled kernels switched off
    m.report_kernel_backends()
    assert samples(m.registry, "libalign_kernel_backend_info") == {
        (("backend", "spec"), ("device", d)): 1.0 for d in want}  # the old series are gone
    m.report_kernel_backends({"cpu": DeviceBackend("cpu", "cpu", "compiled C++ kernel"),
                              "cuda": DeviceBackend("cuda", "spec", "nvcc not found")})
    assert samples(m.registry, "libalign_kernel_backend_info") == {
        (("backend", "cpu"), ("device", "cpu")): 1.0,
        (("backend", "spec"), ("device", "cuda")): 1.0}


def test_a_service_reports_its_backends_on_its_metrics_port(monkeypatch, caplog):
    """serve_metrics_for reports the kernel backends, serves them on /metrics and logs why."""
    kernel_env.setenv(monkeypatch, "ALIGN_KERNELS", "spec")
    port = free_port()
    settings = types.SimpleNamespace(metrics_port=port, metrics_addr="127.0.0.1")
    with caplog.at_level(logging.INFO, logger="alignd.infra.telemetry"):
        stop = serve_metrics_for(settings, Metrics())
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        stop()
    assert 'libalign_kernel_backend_info{backend="spec",device="cpu"} 1.0' in text
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                  and "on cpu falls back to the reference spec" in r.getMessage()]
    assert "ALIGN_KERNELS" in warning
