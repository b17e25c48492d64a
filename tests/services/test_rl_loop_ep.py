"""The RL loop with an expert-parallel Megatron learner: two ``gloo`` ranks train, each converts
and writes its own experts, the version is announced converted with no converter running, and a
sampler loads it, rolls out and is scored."""

from __future__ import annotations

import threading

import pytest
import redis

pytest.importorskip("megatron.core")

from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.learner.engine import TrainBatch
from alignd.learner.ranks import split_batch, split_rollouts
from alignd.sampler.engine import TorchSamplerEngine
from alignd.sampler.main import run_sampler

from libalign import models
from libalign.models.megatron_parallel import launch
from libalign.models.train import cpu_threads
from tests.libalign.ep_workers import config
from tests.services import ep_loop_workers as L


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU-shim test (gloo ranks on the CPU); see tests/libalign/test_megatron_ep.py")
@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_trace"])
def test_two_rank_learner_drives_the_loop_with_sharded_versions(redis_url, tmp_path, path):
    sampler_path = "nvfp4_minite"
    s = L.settings_for(redis_url, str(tmp_path / "store"), sampler_path)
    hf = models.build_model(config(), seed=1)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    store = WeightStore(s.store_dir)
    stop = threading.Event()
    with cpu_threads(1):
        engine = TorchSamplerEngine(models.build_model(config(), seed=2), store, sampler_path,
                                    batch_size=16, eos_id=L.TASK.eos_id, pad_id=L.TASK.pad_id)
        t = threading.Thread(target=run_sampler, args=(s, engine, stop), daemon=True,
                             kwargs=dict(rollouts=RolloutStore(redis.Redis.from_url(redis_url),
                                                               s.key_prefix),
                                         guidance=GuidanceStore(redis_url, budget_bytes=1 << 26)))
        t.start()
        try:
            out = launch(L.learner_ranks, 2, args=(sd, redis_url, s.store_dir, sampler_path, path, 2),
                         backend="gloo", timeout_s=240)
        finally:
            stop.set()
            t.join(10)
    results = out[0]["results"]
    assert out[1]["commands"] >= 2 * 3  # publish, score, train each step (plus trace's own)
    registry = Registry(RedisBus.from_settings(s), s.key_prefix)
    for r in results:
        vid = r["version_id"]
        manifest = store.read_manifest(vid)
        assert manifest.get("num_parts") == 2  # both ranks wrote a part
        history = registry.history(vid)
        assert [h.to_state for h in history] == ["published", "converting", "converted",
                                                 "loading", "serving"]
        assert {h.actor for h in history[:3]} == {"learner"}  # no converter involved
        assert r["delta"]["tokens"] > 0 and r["train"]["tokens"] == r["delta"]["tokens"]
        assert set(r["seconds"]) >= {"publish", "convert", "load", "rollout", "score", "train"}
    assert not store.published_root.exists() or not any(store.published_root.iterdir())
    assert results[0]["version_id"] != results[1]["version_id"]


def test_batches_split_into_whole_groups():
    b = TrainBatch([[1, 2, 3]] * 8, [1] * 8, [[-1.0, -1.0]] * 8, [0.0, 1.0] * 4,
                   [0, 0, 1, 1, 2, 2, 3, 3], {5: "rec5"})
    left, right = split_batch(b, 2)
    assert left.groups == [0, 0, 1, 1] and right.groups == [2, 2, 3, 3]
    assert left.guidance is None and right.guidance == {1: "rec5"}
    with pytest.raises(ValueError, match="straddles"):
        split_batch(TrainBatch(*[x[:6] for x in (b.sequences, b.prompt_lens, b.sampler_logprobs,
                                                  b.rewards)], [0, 0, 1, 1, 1, 1]), 2)
    with pytest.raises(ValueError, match="equal shares"):
        split_batch(TrainBatch(*[x[:6] for x in (b.sequences, b.prompt_lens, b.sampler_logprobs,
                                                  b.rewards)], [0, 0, 1, 1, 2, 2]), 4)


def test_rollouts_to_score_are_topped_up_to_equal_shares():
    seqs = [[i, i + 1, i + 2] for i in range(5)]
    shares = split_rollouts(seqs, [1] * 5, {4: "r4"}, 2)
    assert [len(x[0]) for x in shares] == [3, 3] and [x[3] for x in shares] == [3, 2]
    assert shares[1][0] == [seqs[3], seqs[4], seqs[4]] and shares[1][2] == {1: "r4", 2: "r4"}
    one = split_rollouts(seqs[:1], [1], None, 2)
    assert [x[3] for x in one] == [1, 0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU-shim test (gloo ranks on the CPU); see tests/libalign/test_megatron_ep.py")
def test_a_rank_killed_mid_publish_stops_the_group_and_leaves_no_version(redis_url, tmp_path):
    """A follower SIGKILLed while writing its part: the launcher stops rank 0 instead of letting
    it wait forever in its next collective, nothing is registered or announced, the store lists
    no version, and only a hidden staging directory is left for the sweeper."""
    import time

    from alignclient.errors import DistributedRunError

    s = L.settings_for(redis_url, str(tmp_path / "store"), "nvfp4_minite")
    hf = models.build_model(config(), seed=1)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"rank 1: no result \(exit code -9\)"):
        launch(L.learner_with_dying_follower, 2, args=(sd, redis_url, s.store_dir, "nvfp4_minite"),
               backend="gloo", timeout_s=240)
    assert time.monotonic() - t0 < 120
    store = WeightStore(s.store_dir)
    assert store.list_versions() == []
    registry = Registry(RedisBus.from_settings(s), s.key_prefix)
    assert registry.list_versions() == []
    left = [p.name for p in store.versions_root.iterdir()]
    assert left and all(n.startswith(".tmp-") for n in left)
    assert {p.name for p in store.sweep(min_age_s=0)} == set(left)
