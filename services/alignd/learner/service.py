"""The learner as a service: its loop built from settings, and run with a heartbeat and metrics.

Both ways of running the learner use these two pieces: the single-process one
(:mod:`alignd.learner.main`) and rank 0 of the expert-parallel one
(:mod:`alignd.learner.ranked_main`), which hands :func:`build_loop` its rank-group engine.
"""

from __future__ import annotations

import json
import logging
import threading

from alignclient.errors import AlignError

from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.settings import LearnerSettings
from alignd.infra.telemetry import Metrics, serve_metrics_for
from alignd.learner.engine import LearnerEngine, TorchLearnerEngine
from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan, configured_kv_scales
from libalign import models

log = logging.getLogger("alignd.learner")


def objective_options(settings: LearnerSettings) -> dict:
    """The engine keywords of the objective's settings (``tis_cap``, ``tis_level``,
    ``ppo_clip_eps``) and of routing replay (``routing_replay``), for every engine the learner
    builds."""
    return {"tis_cap": settings.tis_cap, "tis_level": settings.tis_level,
            "ppo_clip_eps": settings.ppo_clip_eps, "routing_replay": settings.routing_replay}


def engine_options(settings: LearnerSettings) -> dict:
    """Every engine keyword the settings give: :func:`objective_options` and the K/V global
    scales of ``kv_scales_file`` (``kv_scales``, what the versions for the samplers carry)."""
    return {**objective_options(settings), "kv_scales": configured_kv_scales(settings)}


def build_loop(settings: LearnerSettings, *, lr: float = 2e-5, use_tis: bool = True,
               prompts_per_step: int = 8, samples_per_prompt: int = 8,
               metrics: Metrics | None = None, run_id: str | None = None,
               engine: LearnerEngine | None = None) -> LearnerLoop:
    """The loop on the synthetic task with the embedded learner engine warm-started from the
    cached tiny model (or with ``engine``, e.g. a multi-rank group), on ``settings``' Redis."""
    task = models.SyntheticTask()
    if engine is None:
        model, task = models.trained_tiny_model(device=settings.learner_device)
        engine = TorchLearnerEngine(model, settings.learner_path, lr=lr, use_tis=use_tis,
                                    pad_id=task.pad_id, strict=settings.strict,
                                    strict_ops=settings.strict_ops,
                                    **engine_options(settings))
    plan = RolloutPlan(prompts=lambda step: task.prompts(prompts_per_step, step, split="train"),
                       reward=task.verify, sampler_path=settings.sampler_path,
                       prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                       max_new_tokens=task.max_completion_len,
                       **({"run_id": run_id} if run_id else {}))
    return LearnerLoop(settings, engine, LoopParts.build(settings, metrics=metrics), plan)


def run_loop(loop: LearnerLoop, settings: LearnerSettings, stop: threading.Event, steps: int,
             metrics: Metrics) -> int:
    """``steps`` iterations of ``loop`` with a heartbeat and the metrics endpoint; a JSON line
    per step on stdout; stops after the current step once ``stop`` is set. Returns the exit
    status (1: a stage failed)."""
    beat = ServiceHeartbeat(loop.bus, "learner", loop.run_id, settings.service_heartbeat_s,
                            settings.service_heartbeat_ttl_s, prefix=settings.key_prefix,
                            info=lambda: {"path": loop.engine.path,
                                          "objective": loop.objective()}).start()
    stop_metrics = serve_metrics_for(settings, metrics)
    try:
        for step in range(steps):
            if stop.is_set():
                break
            r = loop.iteration(step)
            beat.set(version=r.version_id)
            print(json.dumps({"step": r.step, "version_id": r.version_id, "reward": r.reward_mean,
                              "delta": r.delta.get("stats"), "seconds": r.seconds}), flush=True)
    except AlignError as e:
        log.error("learner stopped: %s", e)
        return 1
    finally:
        beat.stop()
        stop_metrics()
    return 0
