"""The embedded learner as a service: ``python -m alignd.learner.main [--steps N]``.

It warm-starts the tiny Qwen3-MoE (trained on the synthetic task, cached), then runs
:class:`~alignd.learner.loop.LearnerLoop` against whatever converter and samplers share its
Redis and weight store (:class:`~alignd.infra.settings.LearnerSettings`): ``--steps``
iterations, each publishing a version for ``ALIGN_SAMPLER_PATH``, training with
``ALIGN_LEARNER_PATH``, with the objective of ``ALIGN_TIS_CAP``, ``ALIGN_TIS_LEVEL``,
``ALIGN_PPO_CLIP_EPS``, ``ALIGN_PPO_EPOCHS``, ``ALIGN_MAX_VERSION_DIFF`` and
``ALIGN_STALE_ROLLOUTS`` (its heartbeat reports them: ``/v1/status``, the learner's
``info.objective``). One line of JSON per step goes to stdout (step, version, reward, δ
statistics, seconds by stage); SIGTERM stops after the current step. With
``ALIGN_METRICS_PORT`` set it serves ``/metrics`` and ``/healthz``: the learner reports the
scores, so the |δ| histogram (``libalign_logprob_abs_delta``) and the guidance reads (hits,
misses) are counted here.

``--engine megatron --ep P`` runs the same loop with the model's Megatron-core twin over ``P``
expert-parallel rank processes, each publishing its part of every version
(:mod:`alignd.learner.ranked_main`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from alignd.infra.service_main import run_service
from alignd.infra.settings import LearnerSettings
from alignd.infra.telemetry import Metrics
from alignd.learner.ranked_main import RankedOptions, run_ranked
from alignd.learner.service import build_loop, run_loop

log = logging.getLogger("alignd.learner")


def parser() -> argparse.ArgumentParser:
    """The learner's command line (``alignd serve learner`` passes its arguments through)."""
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


def serve(args: argparse.Namespace, settings: LearnerSettings, stop: threading.Event) -> int:
    """The learner process's work: ``--steps`` iterations on the chosen engine."""
    if args.engine == "megatron":
        return run_ranked(RankedOptions.from_args(args), settings, stop)
    metrics = Metrics()
    loop = build_loop(settings, lr=args.lr, use_tis=not args.no_tis,
                      prompts_per_step=args.prompts_per_step,
                      samples_per_prompt=args.samples_per_prompt, run_id=args.run_id,
                      metrics=metrics)
    return run_loop(loop, settings, stop, args.steps, metrics)


def main(argv: list[str] | None = None) -> int:
    """Entry point: arguments, settings from the environment, the steps, exit status."""
    args = parser().parse_args(argv)
    return run_service(log, LearnerSettings, lambda settings, stop: serve(args, settings, stop))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
