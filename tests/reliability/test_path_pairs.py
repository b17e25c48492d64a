"""Paths a writer invents: what they cost is capped, and the rest is one real aggregate.

Every (learner path, sampler path) pair used to get its own δ string, its own window read in
``/v1/status`` and its own gauges at every scrape: 5,000 invented sampler paths made the status
2.0 MB and 3 s, and every scrape as slow, while the gauges of ``other``/``other`` showed
whichever folded pair came last. These tests pin the cap (``max_path_pairs``): what status,
``/metrics`` and Redis hold is counted (entries, series, keys, bytes), never timed; the
aggregate is checked against δ computed here from the data posted.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import redis
from alignclient.models import OTHER_PATH, Rollout, Score
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import Registry
from alignd.infra.stores.rollouts import RolloutStore, summarize
from alignd.infra.telemetry import BatchHistogram, Metrics
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.services.api_server import TOKEN, api_settings, publish_files

AUTH = {"Authorization": f"Bearer {TOKEN}"}
OTHER = {"learner_path": OTHER_PATH, "sampler_path": OTHER_PATH}
SAMPLER_LP = [-1.0, -1.5, -2.0]  # every rollout's three completion log-probs
GAUGES = ("libalign_discrepancy_p99_abs", "libalign_discrepancy_mean_abs",
          "libalign_clip_potential_ratio", "libalign_tis_truncated_ratio")


def shift(i: int) -> float:
    """δ of every token of rollout ``i``: distinct per rollout, so no folded pair stands in
    for the aggregate by luck."""
    return -0.001 * (1 + i % 97)


def pairs_of(text: str, family: str) -> set[tuple[str, str]]:
    """The (learner_path, sampler_path) label pairs of one family in exposition text."""
    return {(s.labels["learner_path"], s.labels["sampler_path"])
            for fam in text_string_to_metric_families(text) if fam.name == family
            for s in fam.samples}


def sample(text: str, name: str, labels: dict[str, str]) -> float:
    """The value of one sample in exposition text."""
    (value,) = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == name and s.labels == labels]
    return value


def test_five_thousand_invented_paths_cost_what_the_cap_allows(redis_url, tmp_path):
    """5,000 distinct sampler paths through the API (cap 64): status holds 65 pairs in under
    48 KiB, /metrics 65 pairs per path family, Redis 64 pair strings + other:other; other/other
    holds every folded token, its statistics those of all 4,936 folded pairs together."""
    n, cap = 5_000, 64
    store = tmp_path / "store"
    publish_files(store, "v1")
    settings = api_settings(redis_url, store, max_body_bytes=4 << 20,
                            discrepancy_window_tokens=1 << 16)
    assert settings.max_path_pairs == cap  # the default
    metrics = Metrics()
    with TestClient(create_app(settings, metrics=metrics), raise_server_exceptions=False) as http:
        assert http.post("/v1/versions", json={"version_id": "v1"}, headers=AUTH).status_code == 201
        for lo in range(0, n, 2_500):
            rollouts = [{"rollout_id": f"r{i}", "prompt_len": 1, "tokens": [0, 1, 2, 3],
                         "logprobs": SAMPLER_LP, "path": f"sp{i:05d}"} for i in range(lo, lo + 2_500)]
            r = http.post("/v1/versions/v1/rollouts", json={"rollouts": rollouts}, headers=AUTH)
            assert r.status_code == 201, r.text
            scores = [{"rollout_id": f"r{i}", "logprobs": [x + shift(i) for x in SAMPLER_LP],
                       "path": "bf16"} for i in range(lo, lo + 2_500)]
            r = http.post("/v1/versions/v1/scores", json={"scores": scores}, headers=AUTH)
            assert r.status_code == 200, r.text
            assert len(r.json()["by_path"]) <= cap + 1
        status = http.get("/v1/status", headers=AUTH)
        text = http.get("/metrics").text

    by_path = {(p["learner_path"], p["sampler_path"]): p["stats"]
               for p in status.json()["discrepancy"]["by_path"]}
    kept = {("bf16", f"sp{i:05d}") for i in range(cap)}  # the first pairs scored
    assert set(by_path) == kept | {(OTHER_PATH, OTHER_PATH)}
    assert len(status.content) < 48 << 10, len(status.content)  # 2.0 MB before the cap
    for family in ("libalign_logprob_abs_delta", *GAUGES):
        assert pairs_of(text, family) == set(by_path), family
    raw = redis.Redis.from_url(redis_url)
    try:
        pair_strings = [k for k in raw.keys(f"{settings.key_prefix}:delta:v1:*")
                        if not k.endswith((b":pairs", b":scored"))]
        assert len(pair_strings) == cap + 1
        assert raw.scard(f"{settings.key_prefix}:path_pairs") == cap
        assert raw.dbsize() < 100  # 5,011 before the cap
    finally:
        raw.close()

    folded = np.concatenate([np.full(3, shift(i), dtype=np.float32) for i in range(cap, n)])
    want = summarize(folded.astype(np.float64))
    got = by_path[(OTHER_PATH, OTHER_PATH)]
    assert got["count"] == folded.size == 3 * (n - cap)
    for k in ("mean_abs", "p99_abs", "max_abs", "clip_potential", "tis_truncated_fraction"):
        assert math.isclose(got[k], getattr(want, k), rel_tol=1e-9, abs_tol=1e-12), k
    last = abs(shift(n - 1))
    assert not math.isclose(got["mean_abs"], last, rel_tol=1e-3)  # not the last pair's
    assert metrics.value("libalign_logprob_abs_delta_count", OTHER) == folded.size
    for gauge, stat in (("libalign_discrepancy_mean_abs", "mean_abs"),
                        ("libalign_discrepancy_p99_abs", "p99_abs")):  # the scrape's gauges
        assert sample(text, gauge, OTHER) == got[stat], gauge
    assert metrics.value("libalign_scores_folded_total") == n - cap


@pytest.fixture
def stores(redis_url):
    """A factory of rollout stores on one prefix (version v1, v2 registered), closed after."""
    clients = []

    def make(cap: int, metrics: Metrics | None = None) -> RolloutStore:
        c = redis.Redis.from_url(redis_url)
        clients.append(c)
        return RolloutStore(c, "pp", metrics, max_path_pairs=cap)

    registry = Registry(RedisBus(connect(redis_url)), "pp")
    for vid in ("v1", "v2"):
        registry.create(vid, f"/published/{vid}", actor="test")
    yield make
    for c in clients:
        c.close()


def rollouts_and_scores(paths: list[tuple[str, str]], start: int = 0
                        ) -> tuple[list[Rollout], list[Score]]:
    """One rollout per (learner, sampler) pair, its tokens' δ ``shift(start + i)``."""
    rs, ss = [], []
    for i, (lp, sp) in enumerate(paths, start):
        rs.append(Rollout(rollout_id=f"r{i}", prompt_len=1, tokens=[0, 1, 2, 3],
                          logprobs=SAMPLER_LP, path=sp))
        ss.append(Score(rollout_id=f"r{i}", logprobs=[x + shift(i) for x in SAMPLER_LP], path=lp))
    return rs, ss


def test_the_cap_spans_versions_and_a_retried_batch_counts_once(stores):
    """Cap 2: pairs kept apart are the first two scored on any version; a third pair, on a new
    version, goes to other/other (batch summary, window, histogram); resending that batch
    counts nothing again."""
    metrics = Metrics()
    s = stores(2, metrics)
    rs, ss = rollouts_and_scores([("bf16", "a"), ("bf16", "b")])
    s.put_rollouts("v1", rs)
    s.put_scores("v1", ss)
    rs, ss = rollouts_and_scores([("bf16", "c"), ("bf16", "a"), ("x", "c")], start=2)
    s.put_rollouts("v2", rs)
    summary = s.put_scores("v2", ss)
    assert [(p.learner_path, p.sampler_path, p.stats.count) for p in summary.by_path] == [
        ("bf16", "a", 3), (OTHER_PATH, OTHER_PATH, 6)]
    again = s.put_scores("v2", ss)
    assert again.duplicates == 3 and again.by_path == summary.by_path
    d = s.discrepancy(None, 1 << 10)
    by_path = {(p.learner_path, p.sampler_path): p.stats for p in d.by_path}
    assert set(by_path) == {("bf16", "a"), ("bf16", "b"), (OTHER_PATH, OTHER_PATH)}
    assert by_path[(OTHER_PATH, OTHER_PATH)].count == 6
    assert math.isclose(by_path[(OTHER_PATH, OTHER_PATH)].mean_abs,
                        float(np.mean(np.abs(np.float32([shift(2), shift(4)])))), rel_tol=1e-6)
    assert metrics.value("libalign_logprob_abs_delta_count", OTHER) == 6
    assert metrics.value("libalign_scores_folded_total") == 2


def test_a_smaller_cap_reads_at_most_its_pairs(stores, caplog):
    """Pairs stored under cap 10 and read under cap 3: by_path names 3 pairs (logged), the
    overall statistics still count every token."""
    paths = [("bf16", f"p{i}") for i in range(10)]
    rs, ss = rollouts_and_scores(paths)
    wide = stores(10)
    wide.put_rollouts("v1", rs)
    wide.put_scores("v1", ss)
    with caplog.at_level(logging.WARNING):
        d = stores(3).discrepancy("v1", 1 << 10)
    assert [(p.learner_path, p.sampler_path) for p in d.by_path] == paths[:3]
    assert d.stats.count == 30
    assert "past max_path_pairs=3" in caplog.text


def test_the_histogram_holds_the_pairs_it_was_allowed():
    """max_series 2: the third and later label sets add to the overflow set; a Metrics'
    histogram keeps the largest cap a store asked for."""
    h = BatchHistogram("h", "doc", ["a", "b"], [1.0], max_series=2, overflow=("o", "o"))
    for i in range(5):
        h.observe_many([f"x{i}", "y"], [0.5] * (i + 1))
    counts = {tuple(s.labels[k] for k in ("a", "b")): s.value
              for fam in h.collect() for s in fam.samples if s.name == "h_count"}
    assert counts == {("x0", "y"): 1, ("x1", "y"): 2, ("o", "o"): 3 + 4 + 5}
    m = Metrics()
    m.allow_path_pairs(200)
    m.allow_path_pairs(8)
    assert m.logprob_abs_delta.max_series == 200
    with pytest.raises(ValueError, match="overflow"):
        BatchHistogram("h", "doc", ["a", "b"], [1.0], max_series=2)
