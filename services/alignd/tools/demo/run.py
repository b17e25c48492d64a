"""``alignd demo``: RL of the tiny MoE through the real services, per execution configuration.

What runs
---------
Everything in one process over the embedded Redis (no setup): the converter and a sampler
as threads, the control API (when it can bind a port) so ``/metrics`` and the status page
show the run live, and the learner loop (:class:`alignd.learner.loop.LearnerLoop`) in the
foreground. The policy starts from a supervised warm start with headroom: the tiny
Qwen3-MoE trained on reversed-sum addition until its teacher-forced sequence accuracy reaches
``WARM_START_ACCURACY`` (0.6: greedy held-out accuracy about 0.64, sampled reward at T = 1
about 0.5; :func:`libalign.models.trained_tiny_model`, cached after its first CPU minute or
two), so GRPO has something to improve and a numerical gap has a reward to cost. Every
configuration starts from the same weights:

======================  =============  ==================  ====
configuration           sampler path   learner path        TIS
======================  =============  ==================  ====
``bf16``                bf16           bf16                no
``nvfp4_naive``         nvfp4_naive    nvfp4_naive         yes
``nvfp4_naive_notis``   nvfp4_naive    nvfp4_naive         no
``nvfp4_minite``        nvfp4_minite   nvfp4_minite        yes
``nvfp4_trace``         nvfp4_minite   nvfp4_trace         yes
======================  =============  ==================  ====

``nvfp4_trace_kv`` (not in the default set: ``alignd demo --configs nvfp4_trace_kv``) is
TRACE's joint FP4 rollout: the sampler ``nvfp4_minite_kv_nvfp4`` also keeps K and V as
row-scaled NVFP4 (:mod:`libalign.models.kv_cache`) and records them; the learner
``nvfp4_trace_kv_nvfp4`` rounds activations and K/V as the records say
(:mod:`libalign.models.kv_guided`).

``nvfp4_minite_r3`` (not in the default set: ``alignd demo --configs nvfp4_minite_r3``) is
``nvfp4_minite`` with routing replay (R3, ``routing_replay=recompute``): the sampler records
the experts it routed every token to and the learner routes as recorded, with gate weights
from its own router logits (:mod:`libalign.models.routing_replay`). Every other
configuration measures routing without forcing it (``routing_replay=measure``), so the table's
*routing disagreement* (share of token×layer routing decisions where the learner's own top-k
set differs from the sampler's; under R3 counted before forcing) is filled for each.

``strict_bf16`` and ``strict_minite`` (not in the default set: ``alignd demo --configs
strict_bf16,strict_minite``) run sampler and learner in strict execution
(:mod:`libalign.models.strict`: batch-invariant ops shared by the sampler's decode and the
learner's scoring) on bf16 and on nvfp4_minite, without TIS as in the miniTE paper: every
step's ``max_abs_delta`` is 0.0 exactly and the gradient comes from that same forward.

Each step publishes a version converted for the sampler's path, waits until it serves,
samples a group per prompt (16 prompts x 4 rollouts), scores, and takes a GRPO step
(:mod:`alignd.learner.engine`).
``nvfp4_naive_notis`` shows what the TIS correction is for. The learning rate (1e-4, Adam)
rises linearly over the first ``lr_warmup_steps`` (10) steps. Each configuration runs with
``seeds`` seeds (``seed``, ``seed + 1``, …); seed ``s`` draws the same prompts and the same
sampling seeds (:func:`alignd.infra.work.sampling_seed` of ``s`` and the step) in every
configuration, so configurations are compared on common random numbers, and seeds differ in
both.
The objective's knobs are the learner's (``--tis-cap``, default 2, TRACE uses 5;
``--ppo-clip-eps``, default off; ``--ppo-epochs``, optimizer steps per batch, default 1;
``--max-version-diff``, default unbounded, TRACE uses 3);
the report keeps them per configuration (``objective``) with the mean fraction of TIS weights
truncated, of tokens the PPO clip held, and the rollouts dropped as stale. The demo rolls out
each version right after publishing it, so its rollouts are never stale, and with one update
per batch the PPO ratio is 1 (the clip binds from the second of ``--ppo-epochs`` on); the
staleness bound matters for rollouts that lag the learner (:mod:`alignd.infra.staleness`).
The summary gives, per configuration and seed, the reward (mean over the first and the last
quarter of the steps, and their difference, the gain), mean and P99 |δ| and clip potential
over all scored tokens, and the sync seconds by stage; :mod:`alignd.tools.demo.report` gives
each as the mean over seeds with its 95 % interval, prints the table and draws the figure
(mean |δ| and reward per step as moving averages, mean over seeds with a band), as the
miniTE paper's training figure does. ``DEFAULT_RUN`` is what ``./dev.sh demo`` runs within
its time budget; ``FULL_RUN`` (``--full``) every configuration, longer, with more seeds.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from alignclient.errors import InputError

from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.redis_clients import binary_client, run_namespace
from alignd.infra.settings import AllInOneSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from alignd.learner.engine import TorchLearnerEngine
from alignd.learner.loop import IterationResult, LearnerLoop, LoopParts, RolloutPlan
from alignd.learner.service import engine_options
from alignd.sampler.engine import TorchSamplerEngine
from alignd.tools.demo.report import aggregate, plot_demo
from alignd.tools.in_process import ServiceThreads
from libalign import metrics as lm
from libalign import models

#: strict configurations (ALIGN_STRICT on both sides), run only when named
STRICT_CONFIGS: dict[str, tuple[str, str, bool]] = {
    "strict_bf16": ("bf16", "bf16", False),
    "strict_minite": ("nvfp4_minite", "nvfp4_minite", False),
}
#: configuration -> (sampler path, learner path, TIS)
CONFIGS: dict[str, tuple[str, str, bool]] = {
    "bf16": ("bf16", "bf16", False),
    "nvfp4_naive": ("nvfp4_naive", "nvfp4_naive", True),
    "nvfp4_naive_notis": ("nvfp4_naive", "nvfp4_naive", False),
    "nvfp4_minite": ("nvfp4_minite", "nvfp4_minite", True),
    "nvfp4_trace": ("nvfp4_minite", "nvfp4_trace", True),
    "nvfp4_trace_kv": ("nvfp4_minite_kv_nvfp4", "nvfp4_trace_kv_nvfp4", True),
    "nvfp4_minite_r3": ("nvfp4_minite", "nvfp4_minite", True),
}
#: configuration -> routing replay mode of its learner (the others: ``measure``)
ROUTING_REPLAY: dict[str, str] = {"nvfp4_minite_r3": "recompute"}


#: what ``./dev.sh demo`` runs; ``--full`` runs every configuration
DEFAULT_CONFIGS = ("bf16", "nvfp4_naive", "nvfp4_naive_notis", "nvfp4_minite", "nvfp4_trace")
#: steps and seeds of the default run and of ``--full`` (16 prompts x 4 samples a step in both)
DEFAULT_RUN = {"steps": 24, "seeds": 5}
FULL_RUN = {"steps": 60, "seeds": 5}
#: where the supervised warm start stops (:func:`libalign.models.trained_tiny_model`)
WARM_START_ACCURACY = 0.6


@dataclass
class DemoConfig:
    """Options of a demo run (the CLI maps its flags one to one)."""

    configs: Sequence[str] = tuple(CONFIGS)
    steps: int = 30
    seeds: int = 1
    """how many seeds each configuration runs with: ``seed``, ``seed + 1``, ..."""
    prompts_per_step: int = 16
    samples_per_prompt: int = 4
    """16 prompts x 4 rollouts a step: as cheap as 8 x 8, but prompts differ in difficulty
    far more than the samples of one prompt, so a step's mean reward is less noisy (BF16 over
    24 steps: the gain's spread over seeds fell from 0.07 to 0.02, the gain itself did not)"""
    temperature: float = 1.0
    lr: float = 1e-4
    lr_warmup_steps: int = 10
    """the learning rate rises linearly to ``lr`` over this many steps (Adam's first steps,
    before its moment estimates settle, otherwise throw the policy off)"""
    warm_start_accuracy: float | None = WARM_START_ACCURACY
    """the supervised warm start stops at this teacher-forced accuracy (None: trained through)"""
    seed: int = 0
    out_dir: Path = Path("align-demo")
    tis_cap: float = lm.DEFAULT_TIS_CAP
    ppo_clip_eps: float | None = None
    ppo_epochs: int = 1
    max_version_diff: int | None = None

    def check(self) -> None:
        """InputError naming the first bad option."""
        unknown = [c for c in self.configs if c not in CONFIGS and c not in STRICT_CONFIGS]
        if unknown or not self.configs:
            raise InputError(f"unknown configuration(s) {unknown}; choose from {[*CONFIGS, *STRICT_CONFIGS]}")
        for name, v in (("steps", self.steps), ("seeds", self.seeds),
                        ("prompts_per_step", self.prompts_per_step),
                        ("samples_per_prompt", self.samples_per_prompt)):
            if v < 1:
                raise InputError(f"{name} must be at least 1, got {v}")
        if self.samples_per_prompt < 2:
            raise InputError("samples_per_prompt must be at least 2 (GRPO compares within groups)")
        if not self.tis_cap > 0 or self.tis_cap == float("inf"):
            raise InputError(f"tis_cap must be a finite number > 0, got {self.tis_cap}")
        if self.ppo_clip_eps is not None and not 0 < self.ppo_clip_eps < 1:
            raise InputError(f"ppo_clip_eps must lie in (0, 1), got {self.ppo_clip_eps}")
        if self.lr_warmup_steps < 0:
            raise InputError(f"lr_warmup_steps must be at least 0, got {self.lr_warmup_steps}")
        if not 1 <= self.ppo_epochs <= 64:
            raise InputError(f"ppo_epochs must lie in 1..64, got {self.ppo_epochs}")
        if self.max_version_diff is not None and self.max_version_diff < 0:
            raise InputError(f"max_version_diff must be at least 0, got {self.max_version_diff}")


@dataclass
class ConfigRun:
    """One configuration's steps and its summary, for one seed."""

    name: str
    sampler_path: str
    learner_path: str
    tis: bool
    seed: int = 0
    objective: dict = field(default_factory=dict)
    """tis, tis_cap, tis_level, ppo_clip_eps, max_version_diff, stale_rollouts as used"""
    steps: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    routing_replay: str = "off"
    """the learner's routing replay mode (recompute for ``*_r3``, measure otherwise)"""


#: the stages one step consists of (``sync`` = convert + load, counted once)
STEP_STAGES = ("publish", "sync", "rollout", "score", "train")


class Services:
    """Converter and sampler threads (:class:`~alignd.tools.in_process.ServiceThreads`) for one
    configuration, a sampler engine on ``model``, and the stores and bus the learner loop uses,
    all on a Redis namespace of the run's own (:func:`~alignd.infra.redis_clients.run_namespace`:
    on the embedded default, a private server dropped at :meth:`close`). ``settings`` is the
    run's settings, the ones every other client of the run must be built from."""

    def __init__(self, settings: AllInOneSettings, model, task, metrics: Metrics):
        self._scope = ExitStack()
        try:
            self.settings = settings = self._scope.enter_context(run_namespace(settings))
            self.stop = threading.Event()
            self.bus = RedisBus.from_settings(settings, stop_event=self.stop)
            self.rollouts = RolloutStore(binary_client(settings), settings.key_prefix,
                                         metrics=metrics, max_path_pairs=settings.max_path_pairs)
            self.guidance = GuidanceStore.from_settings(settings, metrics=metrics)
            engine = TorchSamplerEngine(model, WeightStore(settings.store_dir),
                                        settings.sampler_path, eos_id=task.eos_id,
                                        pad_id=task.pad_id,
                                        guidance_last_layers=settings.guidance_last_layers,
                                        strict=settings.strict,
                                        strict_ops=settings.strict_ops)
            self.threads = ServiceThreads(settings, engine, rollouts=self.rollouts,
                                          guidance=self.guidance, metrics=metrics,
                                          stop=self.stop)
            self._scope.callback(self.threads.close)
        except BaseException:
            self._scope.close()
            raise

    def close(self) -> None:
        """Stop the threads, wait for them and drop the run's namespace."""
        self._scope.close()


def _summary(deltas: list[np.ndarray], results: list[IterationResult]) -> dict:
    d = np.concatenate(deltas) if deltas else np.zeros(0)
    stats = lm.delta_stats(torch.from_numpy(d)).to_dict() if d.size else {}
    tail = max(1, len(results) // 4)
    sync = {k: float(np.mean([r.seconds[k] for r in results])) for k in
            ("publish", "convert", "load", "rollout", "score", "train")}
    trained = [r.train for r in results if "dropped_stale" not in r.train]
    last = float(np.mean([r.reward_mean for r in results[-tail:]]))
    first = float(np.mean([r.reward_mean for r in results[:tail]]))
    return {
        "reward_last_quarter": last,
        "reward_first_quarter": first,
        "reward_gain": last - first,
        "reward_first": results[0].reward_mean if results else None,
        "tokens": int(d.size),
        "mean_abs_delta": stats.get("mean_abs"),
        "p99_abs_delta": stats.get("p99_abs"),
        "max_abs_delta": stats.get("max_abs"),
        "clip_potential": stats.get("clip_potential"),
        "tis_truncated_fraction": float(np.mean([t["tis_truncated_fraction"] for t in trained]))
        if trained else None,
        "ppo_clipped_fraction": float(np.mean([t["ppo_clipped_fraction"] for t in trained]))
        if trained else None,
        "rollouts_dropped_stale": sum(r.train.get("dropped_stale", 0) for r in results),
        "seconds_by_stage": sync,
        "seconds_per_step": float(np.mean([sum(r.seconds[k] for k in STEP_STAGES)
                                           for r in results])),
    }


def _pooled_disagreement(steps: list[dict]) -> float | None:
    """Routing disagreement over every step's decisions (None when none was compared)."""
    n = sum(s["routing_decisions"] for s in steps if s["routing_disagreement"] is not None)
    return sum(s["routing_disagreement"] * s["routing_decisions"] for s in steps
               if s["routing_disagreement"] is not None) / n if n else None


def run_demo(cfg: DemoConfig, *,
             on_step: Callable[[str, int, IterationResult], None] | None = None,
             settings: AllInOneSettings | None = None, metrics: Metrics | None = None) -> dict:
    """Run every configuration with every seed; returns the report (also written to
    ``out_dir``): ``configs`` one entry per configuration and seed, ``summary`` one per
    configuration with its numbers over seeds (:func:`~alignd.tools.demo.report.aggregate`)."""
    cfg.check()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    metrics = metrics or Metrics()
    base_model, task = models.trained_tiny_model(stop_at_accuracy=cfg.warm_start_accuracy)
    base = settings or AllInOneSettings(store_dir=cfg.out_dir / "store", dev_mode=True)
    report = {"configs": [], "started_unix": time.time(), "options": {
        k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
        for k, v in asdict(cfg).items()}}
    rng_prompts = task.prompts
    for name, seed in [(n, cfg.seed + i) for n in cfg.configs for i in range(cfg.seeds)]:
        sampler_path, learner_path, tis = {**CONFIGS, **STRICT_CONFIGS}[name]
        s = base.model_copy(update={"sampler_path": sampler_path, "learner_path": learner_path,
                                    "sampler_name": f"demo-{name}",
                                    "consumer_name": f"conv-{name}", "tis_cap": cfg.tis_cap,
                                    "ppo_clip_eps": cfg.ppo_clip_eps, "ppo_epochs": cfg.ppo_epochs,
                                    "max_version_diff": cfg.max_version_diff,
                                    "strict": name in STRICT_CONFIGS,
                                    "routing_replay": ROUTING_REPLAY.get(name, "measure")})
        run = ConfigRun(name, sampler_path, learner_path, tis, seed,
                        routing_replay=s.routing_replay)
        svc = Services(s, copy.deepcopy(base_model), task, metrics)
        s = svc.settings
        try:
            torch.manual_seed(seed)
            engine = TorchLearnerEngine(copy.deepcopy(base_model), learner_path, lr=cfg.lr,
                                        use_tis=tis, pad_id=task.pad_id, strict=s.strict,
                                        strict_ops=s.strict_ops,
                                        **engine_options(s))
            plan = RolloutPlan(
                prompts=lambda step, seed=seed: rng_prompts(
                    cfg.prompts_per_step, seed * 100_003 + step, split="train"),
                reward=task.verify, sampler_path=sampler_path,
                prompts_per_step=cfg.prompts_per_step, samples_per_prompt=cfg.samples_per_prompt,
                max_new_tokens=task.max_completion_len, temperature=cfg.temperature, seed=seed,
                run_id=f"{name}-s{seed}-{uuid.uuid4().hex[:6]}")
            parts = LoopParts.build(s, metrics=metrics, bus=svc.bus, rollouts=svc.rollouts,
                                    guidance=svc.guidance)
            loop = LearnerLoop(s, engine, parts, plan)
            run.objective = loop.objective()
            warmup = torch.optim.lr_scheduler.LambdaLR(
                engine.opt, lambda i: min(1.0, (i + 1) / max(1, cfg.lr_warmup_steps)))
            deltas, results = [], []
            for step in range(cfg.steps):
                r = loop.iteration(step)
                warmup.step()
                d = np.asarray(r.deltas, dtype=np.float64)
                deltas.append(d)
                results.append(r)
                run.steps.append({"step": step, "version_id": r.version_id,
                                  "reward": r.reward_mean, "tokens": int(d.size),
                                  "sampling_seed": r.sampling_seed,
                                  "mean_abs_delta": float(np.abs(d).mean()) if d.size else None,
                                  "max_abs_delta": float(np.abs(d).max()) if d.size else None,
                                  "routing_disagreement": r.routing.get("disagreement"),
                                  "routing_decisions": r.routing.get("decisions", 0),
                                  "train": r.train, "seconds": r.seconds})
                if on_step:
                    on_step(name, seed, r)
            run.summary = _summary(deltas, results)
            run.summary["routing_disagreement"] = _pooled_disagreement(run.steps)
        finally:
            svc.close()
        report["configs"].append(asdict(run))
    report["finished_unix"] = time.time()
    report["summary"] = aggregate(report["configs"])
    (cfg.out_dir / "demo_report.json").write_text(json.dumps(report, indent=1))
    plot_path = plot_demo(report, cfg.out_dir / "demo.png")
    report["outputs"] = {"report": str(cfg.out_dir / "demo_report.json"), "figure": str(plot_path)}
    return report
