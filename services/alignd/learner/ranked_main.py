"""The learner service with a Megatron-core learner over several expert-parallel ranks.

``alignd serve learner --engine megatron --ep P`` (or ``python -m alignd.learner.main``
with the same flags) starts ``P`` rank processes (:func:`libalign.models.megatron_parallel.launch`:
``nccl`` with one GPU per rank when ``ALIGN_LEARNER_DEVICE`` is ``cuda``, ``gloo`` on CPUs).
Each builds the Megatron GPT of the embedded tiny model (trained and cached once, by the parent,
before the ranks start) with ``P``-way expert parallelism on ``ALIGN_LEARNER_PATH``. Rank 0 runs
the same loop as the single-process learner (:mod:`alignd.learner.service`) through a
:class:`~alignd.learner.ranks.RankGroupEngine`; the others follow. Each version is written as
``P`` parts, one per rank, and announced converted: no converter service is needed for it.

Signals: SIGTERM or SIGINT to the parent is passed on to rank 0, which ends after its current
step and releases the other ranks; the other ranks ignore both (a failing rank still stops the
whole group, see :func:`~libalign.models.megatron_parallel.launch`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass

from alignclient.errors import AlignError

from alignd.infra.service_main import stop_on_signals
from alignd.infra.settings import LearnerSettings
from alignd.infra.telemetry import Metrics
from alignd.learner.service import build_loop, engine_options, run_loop
from libalign.models import trained_tiny_model
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.megatron_parallel import RankInfo, launch

log = logging.getLogger("alignd.learner")

#: How long the rank group may run before it is stopped: a week (a training run, not a test).
RUN_LIMIT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class RankedOptions:
    """The learner's command-line options that reach every rank."""

    ep: int
    steps: int
    lr: float = 2e-5
    use_tis: bool = True
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    run_id: str | None = None
    backend: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RankedOptions:
        """The options of :func:`alignd.learner.main.parser`'s namespace."""
        return cls(ep=args.ep, steps=args.steps, lr=args.lr, use_tis=not args.no_tis,
                   prompts_per_step=args.prompts_per_step,
                   samples_per_prompt=args.samples_per_prompt, run_id=args.run_id,
                   backend=args.backend)


def rank_main(info: RankInfo, settings: LearnerSettings, opts: RankedOptions) -> int:
    """One rank of the learner: rank 0 drives the RL loop, the others follow it."""
    # megatron-core is an optional engine: only these ranks need it
    from alignd.learner.megatron_engine import MegatronLearnerEngine
    from alignd.learner.ranks import RankGroupEngine, follow

    logging.basicConfig(level=settings.log_level,
                        format=f"%(asctime)s rank{info.rank} %(name)s %(levelname)s %(message)s")
    stop = stop_on_signals(ignore=info.rank != 0)
    with cpu_shims(enabled=info.device.type == "cpu"):
        model, task = trained_tiny_model(device="cpu")
        engine = MegatronLearnerEngine.from_hf_state_dict(
            model.state_dict(), model.config, settings.learner_path, device=info.device,
            lr=opts.lr, use_tis=opts.use_tis, pad_id=task.pad_id, strict=settings.strict,
            strict_ops=settings.strict_ops,
            rope_inv_freq=model.model.rotary_emb.inv_freq, **engine_options(settings))
        if info.rank != 0:
            follow(engine)
            return 0
        group = RankGroupEngine(engine)
        try:
            metrics = Metrics()
            loop = build_loop(settings, engine=group, prompts_per_step=opts.prompts_per_step,
                              samples_per_prompt=opts.samples_per_prompt, run_id=opts.run_id,
                              metrics=metrics)
            return run_loop(loop, settings, stop, opts.steps, metrics)
        finally:
            group.close()


def run_ranked(opts: RankedOptions, settings: LearnerSettings, stop: threading.Event) -> int:
    """Start the ranks, wait for them, return rank 0's exit status (1 if a rank failed)."""
    device = "cuda" if settings.learner_device.startswith("cuda") else "cpu"
    backend = opts.backend or ("nccl" if device == "cuda" else "gloo")
    try:
        trained_tiny_model(device="cpu")  # train and cache once, not once per rank
        results = launch(rank_main, opts.ep, args=(settings, opts), backend=backend,
                         device=device, timeout_s=RUN_LIMIT_S, stop=stop)
    except AlignError as e:
        log.error("learner ranks stopped: %s", e)
        return 1
    return int(results[0])
