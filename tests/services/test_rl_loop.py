"""The RL loop through the services (converter and sampler threads, real redis-server)."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import redis

pytest.importorskip("transformers")

from alignclient.errors import InputError
from alignd.converter.main import run_converter
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.settings import AllInOneSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.work import sampling_seed
from alignd.learner.engine import TorchLearnerEngine
from alignd.learner.loop import LearnerLoop, LoopError, LoopParts, RolloutPlan
from alignd.sampler.engine import TorchSamplerEngine
from alignd.sampler.main import run_sampler

from libalign import models
from tests.services.moved_time import age_pending

TASK = models.SyntheticTask()


pytestmark = pytest.mark.usefixtures("one_thread")


class Deployment:
    """Converter and sampler threads over one Redis and store; the loop runs in the test."""

    def __init__(self, redis_url, tmp_path, sampler_path):
        self.settings = AllInOneSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                                         sampler_path=sampler_path, block_ms=50,
                                         heartbeat_ms=100, claim_idle_ms=2000,
                                         consumer_name="conv", sampler_name="s1")
        self.stop = threading.Event()
        self.bus = RedisBus.from_settings(self.settings)
        base = models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)
        self.learner_model = copy.deepcopy(base)
        engine = TorchSamplerEngine(base, WeightStore(self.settings.store_dir), sampler_path,
                                    batch_size=16, eos_id=TASK.eos_id, pad_id=TASK.pad_id)
        self.engine = engine
        self.rollouts = RolloutStore(redis.Redis.from_url(redis_url), self.settings.key_prefix)
        self.guidance = GuidanceStore(redis_url, budget_bytes=1 << 26)
        self.threads = [
            threading.Thread(target=run_converter, args=(self.settings, self.stop), daemon=True),
            threading.Thread(target=run_sampler, args=(self.settings, engine, self.stop),
                             kwargs=dict(rollouts=self.rollouts, guidance=self.guidance),
                             daemon=True),
        ]
        for t in self.threads:
            t.start()

    def loop(self, learner_path, **kw):
        eng = TorchLearnerEngine(self.learner_model, learner_path, pad_id=TASK.pad_id, lr=1e-4)
        parts = LoopParts.build(self.settings, bus=self.bus, rollouts=self.rollouts,
                                guidance=self.guidance)
        return LearnerLoop(self.settings, eng, parts, RolloutPlan(
            prompts=lambda step: TASK.prompts(2, step), reward=TASK.verify,
            sampler_path=self.settings.sampler_path, prompts_per_step=2, samples_per_prompt=2,
            max_new_tokens=4, timeout_s=60, **kw))

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(10)


@pytest.fixture
def deploy(redis_url, tmp_path):
    made = []

    def make(path):
        d = Deployment(redis_url, tmp_path, path)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.mark.parametrize(("sampler", "learner"), [("nvfp4_minite", "nvfp4_minite"),
                                                  ("nvfp4_minite", "nvfp4_trace"),
                                                  ("bf16", "bf16")])
def test_iterations_publish_convert_load_roll_out_score_train(deploy, sampler, learner):
    """Each iteration's version is converted for the sampler, served, rolled out, scored, trained."""
    d = deploy(sampler)
    loop = d.loop(learner)
    results = loop.run(2)
    for r in results:
        assert d.bus.client.hget(f"libalign:version:{r.version_id}", "state") == "serving"
        assert r.delta["tokens"] > 0 and r.train["tokens"] == r.delta["tokens"]
        assert set(r.seconds) >= {"publish", "convert", "load", "sync", "rollout", "score", "train"}
        assert 0.0 <= r.reward_mean <= 1.0
    if learner == "nvfp4_trace":
        assert d.guidance.versions()  # records were stored for the versions
    assert results[1].version_id != results[0].version_id


def test_a_failed_version_stops_the_loop_with_its_reason(deploy):
    """A version the sampler cannot serve (converted with another spec) fails by name."""
    d = deploy("nvfp4_naive")
    loop = d.loop("bf16")
    # no target: the converter's preset (minite), not servable by naive
    loop.plan = dataclasses.replace(loop.plan, sampler_path=None)
    with pytest.raises(LoopError, match=r"failed: .*needs 'te_expert'"):
        loop.iteration(0)


def test_sync_request_switches_the_served_version(deploy):
    """A sync event (what POST /v1/sync adds) makes the sampler serve the named version."""
    import time

    from alignd.infra.events import SyncEvent, sync_stream

    d = deploy("nvfp4_minite")
    results = d.loop("nvfp4_minite").run(2)
    assert d.engine.version_id == results[1].version_id
    old = results[0].version_id
    d.bus.publish(sync_stream(d.settings.key_prefix), SyncEvent(version_id=old).to_fields())
    deadline = time.monotonic() + 20
    while d.engine.version_id != old and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.engine.version_id == old


def test_a_request_a_dead_sampler_took_is_served_by_another(deploy):
    """A rollout request read by a sampler that died before answering is reclaimed, once idle
    past claim_idle_ms (its idle time set to twice that, not waited for), and served."""
    import json
    import time

    from alignd.infra.work import READY, REQUESTS, SAMPLER_GROUP, RolloutRequest, RolloutsReady

    d = deploy("nvfp4_minite")
    vid = d.loop("nvfp4_minite").iteration(0).version_id
    d.close()  # the first sampler is gone
    req = RolloutRequest(request_id="orphan", version_id=vid,
                         prompts=json.dumps(TASK.prompts(2, 9)), samples_per_prompt=2,
                         max_new_tokens=3)
    d.bus.publish(REQUESTS, req.to_fields())
    taken = d.bus.read(REQUESTS, SAMPLER_GROUP, "dead-sampler", count=1, block_ms=100)
    assert [m.fields["request_id"] for m in taken] == ["orphan"]  # taken, never answered
    age_pending(d.bus.client, REQUESTS, SAMPLER_GROUP, taken[0].id, 120_000)
    settings = d.settings.model_copy(update={"sampler_name": "s2", "claim_idle_ms": 60_000,
                                             "heartbeat_ms": 100})
    engine = TorchSamplerEngine(models.build_model(models.tiny_config(num_hidden_layers=2), seed=5),
                                WeightStore(settings.store_dir), "nvfp4_minite", batch_size=16,
                                eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    stop = threading.Event()
    t = threading.Thread(target=run_sampler, args=(settings, engine, stop),
                         kwargs=dict(rollouts=d.rollouts, guidance=d.guidance), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        ready = None
        while ready is None and time.monotonic() < deadline:
            for _id, fields in d.bus.client.xrange(READY):
                ev = RolloutsReady.from_fields(fields)
                if ev.request_id == "orphan":
                    ready = ev
            time.sleep(0.05)
        assert ready is not None and ready.error is None and ready.sampler == "s2"
        assert len(ready.ids()) == 4
        assert d.bus.pending_count(REQUESTS, SAMPLER_GROUP) == 0
    finally:
        stop.set()
        t.join(10)


def test_rollout_requests_sample_with_a_seed_per_run_seed_and_step(redis_url, tmp_path):
    """LearnerLoop(seed=s) asks step t's rollouts with sampling_seed(s, t) = s·2³² + t: one
    seed per (run seed, step), the same from a rebuilt loop, seed 0 keeping the step number;
    seeds and steps outside the range are refused (InputError)."""
    settings = AllInOneSettings(redis_url=redis_url, store_dir=tmp_path / "store")
    model = models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)

    def loop(seed):
        eng = TorchLearnerEngine(model, "bf16", pad_id=TASK.pad_id)
        return LearnerLoop(settings, eng, LoopParts.build(settings, stores=False),
                           RolloutPlan(prompts=lambda step: TASK.prompts(2, step),
                                       reward=TASK.verify, sampler_path="bf16", seed=seed))

    seeds = {(s, t): loop(s).rollout_request("v1", t).seed for s in range(3) for t in range(4)}
    assert len(set(seeds.values())) == len(seeds)
    assert seeds == {(s, t): s * 2**32 + t for s, t in seeds}
    assert loop(2).rollout_request("v1", 3).seed == seeds[2, 3] == sampling_seed(2, 3)
    assert [seeds[0, t] for t in range(4)] == [0, 1, 2, 3]
    for bad in ((-1, 0), (2**31, 0), (0, -1), (0, 2**32)):
        with pytest.raises(InputError, match="sampling seed"):
            sampling_seed(*bad)
