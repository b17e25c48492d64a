"""The embedded learner as a service: ``python -m alignd.learner.main [--steps N]``.

It warm-starts the tiny Qwen3-MoE (trained on the synthetic task, cached), then runs
:class:`~alignd.learner.loop.LearnerLoop` against whatever converter and samplers share its
Redis and weight store (``ALIGN_*`` settings): ``--steps`` iterations, each publishing a
version for ``ALIGN_SAMPLER_PATH``, training with ``ALIGN_LEARNER_PATH``. One line of JSON per
step goes to stdout (step, version, reward, δ statistics, seconds by stage); SIGTERM stops
after the current step. With ``ALIGN_METRICS_PORT`` set it serves ``/metrics`` and ``/healthz``:
the learner reports the scores, so the |δ| histogram (``libalign_logprob_abs_delta``) and the
guidance reads (hits, misses) are counted here.

``--engine megatron --ep P`` runs the same loop with the model's Megatron-core twin over ``P``
expert-parallel rank processes, each publishing its part of every version
(:mod:`alignd.learner.ranked_main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from alignclient.errors import AlignError

from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.service_main import start_service
from alignd.infra.settings import Settings
from alignd.infra.telemetry import Metrics, serve_metrics_for

log = logging.getLogger("alignd.learner")


def build_loop(settings: Settings, *, lr: float = 2e-5, use_tis: bool = True,
               prompts_per_step: int = 8, samples_per_prompt: int = 8, metrics=None,
               run_id: str | None = None, engine=None):
    """The embedded learner engine (or ``engine``, e.g. a multi-rank group) and its loop."""
    from alignd.infra.bus import RedisBus
    from alignd.infra.redis_clients import binary_client
    from alignd.infra.stores.guidance import GuidanceStore
    from alignd.infra.stores.rollouts import RolloutStore
    from alignd.learner.engine import TorchLearnerEngine
    from alignd.learner.loop import LearnerLoop
    from libalign import models

    task = models.SyntheticTask()
    if engine is None:
        model, task = models.trained_tiny_model(device=settings.learner_device)
        engine = TorchLearnerEngine(model, settings.learner_path, lr=lr, use_tis=use_tis,
                                    pad_id=task.pad_id)
    bus = RedisBus.from_settings(settings)
    rollouts = RolloutStore(binary_client(settings), settings.key_prefix, metrics=metrics)
    guidance = GuidanceStore.from_settings(settings, metrics=metrics)
    return LearnerLoop(settings, engine, bus, rollouts=rollouts, guidance=guidance,
                       sampler_path=settings.sampler_path, run_id=run_id,
                       prompts=lambda step: task.prompts(prompts_per_step, step, split="train"),
                       reward=task.verify, prompts_per_step=prompts_per_step,
                       samples_per_prompt=samples_per_prompt,
                       max_new_tokens=task.max_completion_len)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="alignd serve learner", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--no-tis", action="store_true")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--engine", choices=("torch", "megatron"), default="torch",
                    help="torch: the embedded Hugging Face learner; megatron: a Megatron-core "
                         "GPT over --ep expert-parallel ranks that publishes sharded versions")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (--engine megatron)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                    help="process-group backend (default: nccl with CUDA, else gloo)")
    return ap


def run_loop(loop, settings: Settings, stop, steps: int, metrics) -> int:
    """``steps`` iterations of ``loop`` with a heartbeat and the metrics endpoint; a JSON line
    per step on stdout; stops after the current step once ``stop`` is set."""
    try:
        beat = ServiceHeartbeat(loop.bus, "learner", loop.run_id, settings.service_heartbeat_s,
                                settings.service_heartbeat_ttl_s, prefix=settings.key_prefix,
                                info=lambda: {"path": loop.engine.path}).start()
    except AlignError as e:
        log.error("learner could not start: %s", e)
        return 1
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: settings from the environment, ``--steps`` iterations, exit status."""
    args = _parser().parse_args(argv)
    started = start_service(log)
    if started is None:
        return 2
    settings, stop = started
    if args.engine == "megatron":
        from alignd.learner.ranked_main import run_ranked

        return run_ranked(args, settings, stop)
    metrics = Metrics()
    try:
        loop = build_loop(settings, lr=args.lr, use_tis=not args.no_tis,
                          prompts_per_step=args.prompts_per_step,
                          samples_per_prompt=args.samples_per_prompt, run_id=args.run_id,
                          metrics=metrics)
    except AlignError as e:
        log.error("learner could not start: %s", e)
        return 1
    return run_loop(loop, settings, stop, args.steps, metrics)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
