"""The learner service with a Megatron-core learner over several expert-parallel ranks.

``alignd serve learner --engine megatron --ep P`` (or ``python -m alignd.learner.main``
with the same flags) starts ``P`` rank processes (:func:`libalign.models.megatron_parallel.launch`:
``nccl`` with one GPU per rank when ``ALIGN_LEARNER_DEVICE`` is ``cuda``, ``gloo`` on CPUs).
Each builds the Megatron GPT of the embedded tiny model (trained and cached once, by the parent,
before the ranks start) with ``P``-way expert parallelism on ``ALIGN_LEARNER_PATH``. Rank 0 runs
the same loop as the single-process learner through a
:class:`~alignd.learner.ranks.RankGroupEngine`; the others follow. Each version is written as
``P`` parts, one per rank, and announced converted: no converter service is needed for it.

Signals: SIGTERM or SIGINT to the parent is passed on to rank 0, which ends after its current
step and releases the other ranks; the other ranks ignore both (a failing rank still stops the
whole group, see :func:`~libalign.models.megatron_parallel.launch`).
"""

from __future__ import annotations

import logging
import signal
import threading

from alignclient.errors import AlignError

from alignd.infra.settings import Settings
from alignd.infra.telemetry import Metrics

log = logging.getLogger("alignd.learner")


def rank_main(info, opts: dict) -> int:
    """One rank of the learner: rank 0 drives the RL loop, the others follow it."""
    from alignd.learner.main import build_loop, run_loop
    from alignd.learner.megatron_engine import MegatronLearnerEngine
    from alignd.learner.ranks import RankGroupEngine, follow
    from libalign.models import trained_tiny_model
    from libalign.models.megatron_cpu import cpu_shims

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{info.rank} %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, (lambda *_: stop.set()) if info.rank == 0 else signal.SIG_IGN)
    settings = Settings()
    with cpu_shims(enabled=info.device.type == "cpu"):
        model, task = trained_tiny_model(device="cpu")
        engine = MegatronLearnerEngine.from_hf_state_dict(
            model.state_dict(), model.config, settings.learner_path, device=info.device,
            lr=opts["lr"], use_tis=not opts["no_tis"], pad_id=task.pad_id)
        if info.rank != 0:
            follow(engine)
            return 0
        group = RankGroupEngine(engine)
        try:
            metrics = Metrics()
            loop = build_loop(settings, engine=group, prompts_per_step=opts["prompts_per_step"],
                              samples_per_prompt=opts["samples_per_prompt"],
                              run_id=opts["run_id"], metrics=metrics)
            return run_loop(loop, settings, stop, opts["steps"], metrics)
        finally:
            group.close()


def run_ranked(args, settings: Settings, stop: threading.Event) -> int:
    """Start the ranks, wait for them, return rank 0's exit status (1 if a rank failed)."""
    from libalign.models import trained_tiny_model
    from libalign.models.megatron_parallel import launch

    device = "cuda" if settings.learner_device.startswith("cuda") else "cpu"
    backend = args.backend or ("nccl" if device == "cuda" else "gloo")
    try:
        trained_tiny_model(device="cpu")  # train and cache once, not once per rank
        results = launch(rank_main, args.ep, args=(vars(args),), backend=backend, device=device,
                         timeout_s=7 * 24 * 3600.0, stop=stop)
    except AlignError as e:
        log.error("learner ranks stopped: %s", e)
        return 1
    return int(results[0])
