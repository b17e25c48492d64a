"""Pins the rollout store: write-once batches, idempotent scores, windows across versions, expiry."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from alignclient.errors import ConfigError, InputError, RolloutExistsError
from alignd.infra.stores.rollouts import Rollout, RolloutStore, Score, summarize

from libalign.metrics import delta_stats


def make(url: str, **kw) -> RolloutStore:
    return RolloutStore(redis.Redis.from_url(url), "t", **kw)


def put_scored(store: RolloutStore, version: str, rid: str, deltas: list[float],
               learner: str = "bf16", sampler: str = "nvfp4_minite") -> None:
    lp = [-1.0] * len(deltas)
    store.put_rollouts(version, [Rollout(rollout_id=rid, prompt_len=1, tokens=[0] * (len(deltas) + 1),
                                         logprobs=lp, path=sampler)])
    store.put_scores(version, [Score(rollout_id=rid, logprobs=[x + d for x, d in zip(lp, deltas,
                                                                                      strict=True)],
                                     path=learner)])


def test_needs_a_binary_client(redis_url):
    """A decoding client would mangle the float32 strings: refused up front."""
    with pytest.raises(ConfigError, match="decode_responses"):
        RolloutStore(redis.Redis.from_url(redis_url, decode_responses=True))


def test_batches_are_write_once_and_keys_expire(redis_url):
    """A batch with a stored id stores nothing; every key of a version carries the TTL."""
    s = make(redis_url, ttl_s=100)
    put_scored(s, "v1", "a", [0.1, -0.2])
    with pytest.raises(RolloutExistsError) as ei:
        s.put_rollouts("v1", [Rollout(rollout_id="b", prompt_len=1, tokens=[1, 2], logprobs=[-1],
                                      path="p"),
                              Rollout(rollout_id="a", prompt_len=1, tokens=[1, 2], logprobs=[-1],
                                      path="p")])
    assert ei.value.rollout_ids == ["a"]
    assert s.list_rollout_ids("v1") == ["a"]
    c = s.client
    for k in c.keys("t:*:v1*"):
        assert 0 < c.pttl(k) <= 100_000, k
    with pytest.raises(InputError):
        s.discrepancy("v1", window_tokens=0)


def test_window_spans_recent_versions_newest_first(redis_url):
    """No version: the last N tokens across the most recently scored versions; per pair windows."""
    s = make(redis_url)
    put_scored(s, "old", "a", [0.5] * 4)
    put_scored(s, "new", "a", [0.1] * 3)
    put_scored(s, "new", "b", [0.2] * 2, learner="nvfp4_minite")
    d = s.discrepancy(None, window_tokens=6)
    assert d.versions == ["new", "old"] and d.stats.count == 6
    want = np.array([0.5, 0.1, 0.1, 0.1, 0.2, 0.2], dtype=np.float32).astype(np.float64)
    assert d.stats.mean_abs == pytest.approx(summarize(want).mean_abs)
    assert d.stats.p99_abs == pytest.approx(delta_stats(torch.tensor(want)).p99_abs)
    pairs = {(p.learner_path, p.sampler_path): p.stats.count for p in d.by_path}
    assert pairs == {("bf16", "nvfp4_minite"): 6, ("nvfp4_minite", "nvfp4_minite"): 2}
    only = s.discrepancy("old", window_tokens=100)
    assert only.versions == ["old"] and only.stats.count == 4
    empty = s.discrepancy("never", window_tokens=10)
    assert empty.stats.count == 0 and empty.stats.mean_abs is None


def test_expired_versions_leave_the_window(redis_url):
    """A version whose δ string expired is dropped from the recent index."""
    s = make(redis_url)
    put_scored(s, "v1", "a", [0.3])
    s.client.delete("t:delta:v1")
    assert s.recent_versions() == []
    assert s.client.zcard("t:delta:index") == 0
