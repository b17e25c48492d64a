"""Rank bodies of the expert-parallel RL loop test (spawned; an importable module)."""

from __future__ import annotations

import redis
from alignd.infra.settings import AllInOneSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore

from libalign.models.megatron_cpu import cpu_shims
from libalign.models.task import SyntheticTask
from libalign.models.train import cpu_threads
from tests.libalign.ep_workers import config

TASK = SyntheticTask()


def settings_for(redis_url: str, store_dir: str, sampler_path: str) -> AllInOneSettings:
    return AllInOneSettings(redis_url=redis_url, store_dir=store_dir, sampler_path=sampler_path,
                            block_ms=50, heartbeat_ms=100, claim_idle_ms=2000,
                            sampler_name="s1")


def learner_ranks(info, hf_sd, redis_url, store_dir, sampler_path, learner_path, steps):
    """Rank 0 runs the RL loop through a RankGroupEngine; the other ranks follow."""
    from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
    from alignd.learner.megatron_engine import MegatronLearnerEngine
    from alignd.learner.ranks import RankGroupEngine, follow

    with cpu_shims(enabled=info.device.type == "cpu"), cpu_threads(1):
        eng = MegatronLearnerEngine.from_hf_state_dict(hf_sd, config(), learner_path, device="cpu",
                                                       lr=1e-4, pad_id=TASK.pad_id)
        if info.rank != 0:
            return {"rank": info.rank, "commands": follow(eng)}
        group = RankGroupEngine(eng)
        try:
            s = settings_for(redis_url, store_dir, sampler_path)
            parts = LoopParts.build(
                s, rollouts=RolloutStore(redis.Redis.from_url(redis_url), s.key_prefix),
                guidance=GuidanceStore(redis_url, budget_bytes=1 << 26))
            loop = LearnerLoop(s, group, parts, RolloutPlan(
                prompts=lambda step: TASK.prompts(2, step), reward=TASK.verify,
                sampler_path=sampler_path, prompts_per_step=2, samples_per_prompt=2,
                max_new_tokens=4, timeout_s=60))
            results = loop.run(steps)
        finally:
            group.close()
        return {"rank": 0, "results": [
            {"version_id": r.version_id, "delta": r.delta, "train": r.train,
             "seconds": r.seconds, "reward_mean": r.reward_mean} for r in results]}


def learner_with_dying_follower(info, hf_sd, redis_url, store_dir, sampler_path):
    """Rank 1 SIGKILLs itself right after the first shard file of its first part; rank 0 runs
    the loop as usual (it must not hang, and no version may appear)."""
    import os
    import signal

    from alignd.learner import ranks
    from alignd.sync.sharded import publish_sharded

    if info.rank == 1:
        def dying(*args, **kwargs):
            def on_step(what):
                if what.startswith("shard"):
                    os.kill(os.getpid(), signal.SIGKILL)
            return publish_sharded(*args, **kwargs, shard_bytes=1 << 12, on_step=on_step)

        ranks.publish_sharded = dying
    return learner_ranks(info, hf_sd, redis_url, store_dir, sampler_path, "nvfp4_minite", 1)


def replay_ranks(info, hf_sd, rollouts, records, modes, guidance=None):
    """Routing replay through a RankGroupEngine (one process: the plain engine), one engine
    per mode of ``modes`` on every rank: score ``rollouts[:-1]`` (an odd count, so a share is
    topped up), score with a record missing under ``measure``, refuse bad records, then train
    one step on all rollouts; each call's scores or stats with its routing counts. With
    ``guidance`` (activation and K/V records), also the scores of ``rollouts[:-1]`` on
    nvfp4_trace_kv_nvfp4 (FP4 K/V in Megatron's attention, guided) under ``"kv"``."""
    from alignclient.errors import RoutingMismatchError, RoutingMissingError
    from alignd.learner.engine import TrainBatch
    from alignd.learner.megatron_engine import MegatronLearnerEngine
    from alignd.learner.ranks import RankGroupEngine, follow

    from libalign.routing.records import RoutingRecord

    seqs, plens, samp = rollouts
    n = len(seqs)
    out = {}
    with cpu_shims(enabled=info.device.type == "cpu"), cpu_threads(1):
        for mode in modes:
            eng = MegatronLearnerEngine.from_hf_state_dict(hf_sd, config(), "bf16", device="cpu",
                                                           lr=1e-3, pad_id=TASK.pad_id,
                                                           routing_replay=mode)
            if info.rank != 0:
                follow(eng)
                continue
            group = eng if info.world_size == 1 else RankGroupEngine(eng)
            got = {}

            def counts(g=group):
                return g.routing_stats.decisions, g.routing_stats.differ

            try:
                short = {i: r for i, r in records.items() if i < n - 1}
                got["score"] = (group.score(seqs[:-1], plens[:-1], None, short), counts())
                if mode == "measure":
                    some = {i: r for i, r in short.items() if i != 2}
                    got["some"] = (group.score(seqs[:-1], plens[:-1], None, some), counts())
                else:
                    bad = {i: RoutingRecord(r.experts[..., :1].contiguous(), r.layers,
                                            r.num_experts) for i, r in records.items()}
                    errors = []
                    for recs in ({i: r for i, r in records.items() if i != 3}, bad):
                        try:
                            group.score(seqs, plens, None, recs)
                        except (RoutingMissingError, RoutingMismatchError) as e:
                            errors.append((type(e).__name__, getattr(e, "field", None)))
                    got["errors"] = errors
                batch = TrainBatch(seqs, plens, samp, [float(i % 2) for i in range(n)],
                                   [i // 2 for i in range(n)], routing=records)
                got["train"] = (group.train_step(batch), counts())
            finally:
                if group is not eng:
                    group.close()
            out[mode] = got
        if guidance is not None:
            eng = MegatronLearnerEngine.from_hf_state_dict(hf_sd, config(), "nvfp4_trace_kv_nvfp4",
                                                           device="cpu", pad_id=TASK.pad_id)
            if info.rank != 0:
                follow(eng)
                return out
            group = eng if info.world_size == 1 else RankGroupEngine(eng)
            try:
                out["kv"] = group.score(seqs[:-1], plens[:-1],
                                        {i: g for i, g in guidance.items() if i < n - 1})
            finally:
                if group is not eng:
                    group.close()
    return out
