"""The RL loop with an expert-parallel Megatron learner: two ``gloo`` ranks train, each converts
and writes its own experts, the version is announced converted with no converter running, and a
sampler loads it, rolls out and is scored."""

from __future__ import annotations

import threading

import pytest
import redis
import torch

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
        assert manifest.num_parts == 2  # both ranks wrote a part
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
    b.routing = {0: "r0", 5: "r5"}
    left, right = split_batch(b, 2)
    assert left.routing == {0: "r0"} and right.routing == {1: "r5"}
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
    routed = split_rollouts(seqs, [1] * 5, None, 2, {0: "r0", 3: "r3", 4: "r4"})
    assert [x[4] for x in routed] == [0, 3]  # offsets: global index of a share's first rollout
    assert [x[5] for x in routed] == [{0: "r0"}, {0: "r3", 1: "r4"}]  # top-up copy: no record
    assert [x[5] for x in split_rollouts(seqs[:1], [1], None, 2, {0: "r0"})] == [{0: "r0"}, None]


@pytest.fixture(scope="module")
def replay_runs():
    """Rollouts sampled on nvfp4_minite with an FP4 KV cache (routers slightly perturbed)
    with their routing and guidance (activation and K/V) records, then routing replay
    (measure, recompute) on a bf16 Megatron learner of the unperturbed weights, and the
    KV-guided path: one process, and two ranks through a RankGroupEngine, each launched once."""
    from libalign.models.routing_replay import capture_routing

    hf = models.build_model(config(), seed=1)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the sampler's routers off by a little: some decisions differ
        for name, w in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                w.add_(0.02 * torch.randn(w.shape, generator=g).to(w.dtype))
    prompts = [p for p in L.TASK.prompts(4, 2) for _ in range(2)]
    with cpu_threads(1), models.use_kv_format(hf, "kv_nvfp4"), \
            models.capture_guidance(hf) as gcap, models.capture_kv(hf, gcap), \
            capture_routing(hf) as cap:
        r = models.generate(hf, prompts, "nvfp4_minite", max_new_tokens=6, seed=5,
                            eos_id=L.TASK.eos_id, pad_id=L.TASK.pad_id)
    rollouts = (r.sequences, r.prompt_lens, [t.tolist() for t in r.logprobs])
    args = (sd, rollouts, cap.records(), ("measure", "recompute"), gcap.records(1))
    one = launch(L.replay_ranks, 1, args=args, backend="gloo", timeout_s=240)[0]
    two = launch(L.replay_ranks, 2, args=args, backend="gloo", timeout_s=240)[0]
    return r, one, two


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU-shim test (gloo ranks on the CPU); see tests/libalign/test_megatron_ep.py")
def test_routing_replay_on_two_ranks_is_the_one_process_replay(replay_runs):
    """Two expert-parallel ranks under routing replay: each rank routes its share by its
    records, and the group's scores (a topped-up share included), routing counts and training
    step equal one process's (scores bit for bit); R3 changes the scores (the learner's routers
    disagree with the sampler's, so forcing is not a no-op); bad records are refused by
    the same typed errors, before any rank works, and the group goes on."""
    r, one, two = replay_runs
    positions = sum(len(s) - 1 for s in r.sequences[:-1])
    for mode in ("measure", "recompute"):
        for call in ("score", "some", "train"):
            if call not in one[mode]:
                continue
            (got, (dec, diff)), (want, (dec1, diff1)) = two[mode][call], one[mode][call]
            assert dec == dec1 and diff == diff1, (mode, call)
            if call == "train":
                assert got["tokens"] == want["tokens"]
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
                assert sum(dec.values()) == sum(len(s) - 1 for s in r.sequences) * 2
            else:
                assert got == want, (mode, call)
        (_s, (dec, diff)) = two[mode]["score"]
        assert sum(dec.values()) == positions * 2 and sum(diff.values()) > 0
    assert sum(two["measure"]["some"][1][0].values()) == \
        positions * 2 - 2 * (len(r.sequences[2]) - 1)
    assert two["recompute"]["score"][0] != two["measure"]["score"][0]
    assert two["recompute"]["errors"] == one["recompute"]["errors"] == [
        ("RoutingMissingError", None), ("RoutingMismatchError", "top_k")]


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU-shim test (gloo ranks on the CPU); see tests/libalign/test_megatron_ep.py")
def test_kv_guided_path_on_two_ranks_scores_as_one_process(replay_runs):
    """FP4 K/V in Megatron's attention, guided by the sampler's K/V records (global keys on
    every rank), on two expert-parallel ranks: the one-process scores bit for bit, a topped-up
    share included, and not the unquantized model's."""
    _r, one, two = replay_runs
    assert two["kv"] == one["kv"]
    assert two["kv"] != two["measure"]["score"][0]


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
