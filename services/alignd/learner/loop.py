"""The learner's RL loop through the services: publish, wait for serving, roll out, score, train.

One iteration of :class:`LearnerLoop` is one policy version's round trip:

1. **publish**: the engine's BF16 weights are written to the weight store's published
   directory, registered and announced (``published``), for the sampler's execution path;
2. **convert** and **load** happen in the converter and the samplers; the loop waits until the
   registry says ``serving`` (or ``failed``: an error naming the reason);
3. **roll out**: a :class:`~alignd.infra.work.RolloutRequest` (prompts of the task, a group
   of samples per prompt, guidance records when the learner runs ``nvfp4_trace``) goes to the
   samplers; the loop waits for its :class:`~alignd.infra.work.RolloutsReady`;
4. **score**: rollouts (and guidance records) are read back, the learner scores them
   teacher-forced, the scores are reported to the rollout store (which turns them into δ
   statistics and metrics). Under routing replay (the engine's ``routing_replay``) the
   samplers are asked for routing records, a rollout without one is refused
   (:class:`~alignclient.errors.RoutingMissingError`, counted in
   ``libalign_rollouts_unreplayed_total``) and records made for another version, layer list,
   top-k or expert count are refused by field
   (:class:`~alignclient.errors.RoutingMismatchError`); the routing disagreement of the
   scoring pass is returned with the step (``routing``);
5. **train**: rewards from the task's verifier, GRPO advantages, truncated importance weights
   against the sampler's log-probs, one optimizer step (PPO-clipped when the engine has
   ``ppo_clip_eps``, with the scores of step 4 as ``π_old``; ``ppo_epochs`` steps on the same
   batch, the statistics of the last returned). A rollout batch whose version is
   more than ``max_version_diff`` versions older than the loop's newest published version is
   dropped (not trained on, counted) or refused (:class:`~alignclient.errors.StaleRolloutError`)
   as ``stale_rollouts`` says (:mod:`alignd.infra.staleness`); this loop rolls out each version
   right after publishing it, so its own batches are 0 versions old.

The seconds of each stage are measured (publish, convert, load from the registry's history;
rollout, score, train here) and returned with the statistics.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from alignclient.errors import LoopError, RoutingMissingError

from alignd.formats.convert import resolve_spec, target_spec
from alignd.formats.modelopt_export import exports_for, holds
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import LearnerSettings
from alignd.infra.staleness import StalenessGuard
from alignd.infra.stores.rollouts import Rollout, Score, routing_record
from alignd.infra.telemetry import Metrics
from alignd.infra.work import (
    RolloutRequest,
    RolloutsReady,
    ready_stream,
    requests_stream,
    sampling_seed,
)
from alignd.learner.engine import LearnerEngine, TrainBatch
from alignd.sync.announce import announce_converted
from alignd.sync.bf16 import publish_version
from libalign import gemm
from libalign.guidance import GuidanceRecord
from libalign.models.kv_guided import check_records
from libalign.routing.records import RoutingRecord, check_routing


@dataclass
class IterationResult:
    """What one iteration did and measured."""

    step: int
    version_id: str
    reward_mean: float
    delta: dict
    train: dict
    seconds: dict[str, float] = field(default_factory=dict)
    deltas: list[float] = field(default_factory=list)
    """δ = learner − sampler of every scored token, rollout after rollout."""
    routing: dict = field(default_factory=dict)
    """Routing disagreement of the scoring pass (routing replay on): ``decisions``,
    ``disagreement`` (share of token×layer decisions whose own top-k differs from the
    sampler's, before forcing) and ``by_layer``."""
    sampling_seed: int | None = None
    """The seed the rollouts were sampled with (:func:`~alignd.infra.work.sampling_seed`)."""


class LearnerLoop:
    """Drives iterations against the services over one Redis and one weight store."""

    def __init__(self, settings: LearnerSettings, engine: LearnerEngine, bus: RedisBus, *, rollouts,
                 guidance=None, sampler_path: str, prompts: Callable[[int], list[list[int]]],
                 reward: Callable[[list[int], list[int]], float], run_id: str | None = None,
                 prompts_per_step: int = 8, samples_per_prompt: int = 8,
                 max_new_tokens: int = 8, temperature: float = 1.0, timeout_s: float = 300.0,
                 metrics: Metrics | None = None, seed: int = 0):
        self.settings = settings
        self.engine = engine
        self.bus = bus
        self.registry = Registry(bus, settings.key_prefix)
        self.staleness = StalenessGuard(self.registry, settings.max_version_diff,
                                        settings.stale_rollouts, metrics)
        self.metrics = metrics
        self.current_version: str | None = None
        """The newest version this loop published: what staleness is measured against."""
        self.store = WeightStore(settings.store_dir)
        self.exports = exports_for(settings.sampler_layout, self.store, settings.sglang_model_dir,
                                   settings.sglang_export_dir)
        """ModelOpt exports of the versions this loop converts itself (sampler_layout)."""
        self.rollouts = rollouts
        self.guidance = guidance
        self.sampler_path = sampler_path
        self.prompts = prompts
        self.reward = reward
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.seed = seed
        """The run's seed: step ``t`` samples with :func:`~alignd.infra.work.sampling_seed`
        ``(seed, t)``, so runs with different seeds differ in sampling too."""
        self.requests_stream = requests_stream(settings.key_prefix)
        self.ready_stream = ready_stream(settings.key_prefix)
        self._ready_last = self._tail(self.ready_stream)

    def _tail(self, stream: str) -> str:
        last = self.bus.call("tail", lambda: self.bus.client.xrevrange(stream, count=1))
        return last[0][0] if last else "0-0"

    # --- stages ---------------------------------------------------------------------------

    def publish(self, step: int) -> str:
        """Write, register and announce the current weights; returns the version id.

        An engine that converts its own weights (``publish_converted``: the expert-parallel
        :class:`~alignd.learner.ranks.RankGroupEngine`, each rank quantizing its experts)
        writes the NVFP4 version itself (and with ``sampler_layout=modelopt`` its ModelOpt
        export, from the parts) and announces it as converted; any other engine
        publishes BF16 weights for the converter service.
        """
        vid = f"{self.run_id}-{step:05d}"
        if hasattr(self.engine, "publish_converted"):
            spec, quantize = target_spec(resolve_spec(self.settings.preset), self.sampler_path)
            self.engine.publish_converted(self.store, vid, spec, quantize=quantize)
            if self.exports is not None and holds(spec, quantize):  # for SGLang samplers, once
                self.exports.write(vid)
            announce_converted(self.registry, self.bus, self.settings.converted_stream,
                               self.store, vid, spec.name, target_path=self.sampler_path)
        else:
            publish_version(self.store.published_root, self.registry, self.bus,
                            self.settings.published_stream, vid, self.engine.export_weights(),
                            actor="learner", target_path=self.sampler_path)
        self.current_version = vid
        return vid

    def objective(self) -> dict:
        """The engine's objective settings and the staleness rule, as the learner reports them."""
        return {**self.engine.objective(), "ppo_epochs": self.settings.ppo_epochs,
                **self.staleness.describe()}

    def train(self, vid: str, batch: TrainBatch) -> dict:
        """``ppo_epochs`` optimizer steps on ``batch`` (rollouts of version ``vid``; the last
        step's statistics), unless ``vid`` is more than ``max_version_diff`` versions older
        than :attr:`current_version`: then ``{"dropped_stale": rollouts}`` (StaleRolloutError
        under ``stale_rollouts=refuse``)."""
        if not self.staleness.admit(vid, self.current_version or vid,
                                    rollouts=len(batch.sequences)):
            return {"dropped_stale": len(batch.sequences)}
        for _ in range(self.settings.ppo_epochs):
            stats = self.engine.train_step(batch)
        return stats

    @property
    def replay_mode(self) -> str:
        """The engine's routing replay mode (``off`` for engines without one)."""
        return getattr(self.engine, "routing_replay", "off")

    def routing_records(self, vid: str, items: list[Rollout]) -> dict[int, RoutingRecord] | None:
        """The rollouts' routing records by batch index, checked against ``vid`` and the
        engine's model (None with routing replay off). Under ``recompute``/``record`` a rollout
        without a record is counted and refused (RoutingMissingError)."""
        if self.replay_mode == "off":
            return None
        recs = {i: routing_record(r.routing) for i, r in enumerate(items) if r.routing is not None}
        missing = [r.rollout_id for r in items if r.routing is None]
        if missing and self.replay_mode != "measure":
            if self.metrics is not None:
                self.metrics.rollouts_unreplayed.inc(len(missing))
            raise RoutingMissingError(f"routing replay ({self.replay_mode}) needs a routing "
                                      f"record for every rollout; {len(missing)} of "
                                      f"{len(items)} of version {vid} have none, e.g. "
                                      f"{missing[0]!r}")
        check_routing(recs, positions={i: len(items[i].tokens) - 1 for i in recs},
                      version=vid, **self.engine.routing_geometry())
        return recs

    def wait_serving(self, vid: str) -> dict[str, float]:
        """Block until ``vid`` serves; seconds per stage from the registry's history."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            rec = self.registry.get(vid)
            if rec.state == "serving":
                break
            if rec.state == "failed":
                raise LoopError(f"version {vid} failed: {rec.reason}")
            if time.monotonic() > deadline:
                raise LoopError(f"version {vid} not serving after {self.timeout_s:.0f}s "
                                f"(state {rec.state})")
            time.sleep(0.01)
        at = {h.to_state: h.at for h in self.registry.history(vid)}
        return {"convert": at["converted"] - at["published"],
                "load": at["serving"] - at["converted"],
                "sync": at["serving"] - at["published"]}

    def rollout_request(self, vid: str, step: int) -> RolloutRequest:
        """The request for ``step``'s rollouts of ``vid``: the step's prompts, a group per
        prompt, sampled with seed ``sampling_seed(self.seed, step)``."""
        return RolloutRequest(request_id=f"{self.run_id}-{step:05d}-r", version_id=vid,
                              prompts=json.dumps(self.prompts(step)),
                              samples_per_prompt=self.samples_per_prompt,
                              max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              seed=sampling_seed(self.seed, step),
                              guidance_bits=self.settings.guidance_bits
                              if gemm.get_path(self.engine.path).guided else 0,
                              routing=self.replay_mode != "off")

    def rollout(self, vid: str, step: int) -> RolloutsReady:
        """Ask the samplers for a group of rollouts per prompt and wait for them."""
        req = self.rollout_request(vid, step)
        rid = req.request_id
        self.bus.publish(self.requests_stream, req.to_fields())
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            got = self.bus.call("wait ready", lambda: self.bus.client.xread(
                {self.ready_stream: self._ready_last}, count=64, block=200))
            for _stream, entries in got or []:
                for mid, fields in entries:
                    self._ready_last = mid
                    ev = RolloutsReady.from_fields(fields)
                    if ev.request_id != rid:
                        continue
                    if ev.error:
                        raise LoopError(f"sampler {ev.sampler} could not serve {rid}: {ev.error}")
                    return ev
        raise LoopError(f"no rollouts for request {rid} after {self.timeout_s:.0f}s")

    def iteration(self, step: int) -> IterationResult:
        """One version's round trip (see the module doc)."""
        sec: dict[str, float] = {}
        t = time.perf_counter()
        vid = self.publish(step)
        sec["publish"] = time.perf_counter() - t
        sec.update(self.wait_serving(vid))
        t = time.perf_counter()
        ready = self.rollout(vid, step)
        seed = sampling_seed(self.seed, step)
        sec["rollout"] = time.perf_counter() - t
        t = time.perf_counter()
        ids = ready.ids()
        items = self.rollouts.get_rollouts(vid, ids)
        seqs = [list(r.tokens) for r in items]
        plens = [r.prompt_len for r in items]
        samp = [list(r.logprobs) for r in items]
        recs = None
        if ready.guidance and self.guidance is not None:
            blobs = self.guidance.get_many(vid, ids)
            recs = {i: GuidanceRecord.decode(blobs[r]) for i, r in enumerate(ids)}
            check_records(recs, version=vid, bits=self.settings.guidance_bits)
        routing = self.routing_records(vid, items)
        mine = self.engine.score(seqs, plens, recs) if routing is None else \
            self.engine.score(seqs, plens, recs, routing)
        route_stats = self.engine.routing_stats.to_dict() if routing is not None else {}
        delta = self.rollouts.put_scores(vid, [Score(rollout_id=r, logprobs=lp,
                                                     path=self.engine.path)
                                               for r, lp in zip(ids, mine, strict=True)])
        sec["score"] = time.perf_counter() - t
        t = time.perf_counter()
        rewards = [float(self.reward(s[:p], s[p:])) for s, p in zip(seqs, plens, strict=True)]
        groups = [i // self.samples_per_prompt for i in range(len(seqs))]
        old = mine if self.engine.objective().get("ppo_clip_eps") is not None else None
        train = self.train(vid, TrainBatch(seqs, plens, samp, rewards, groups, recs, old,
                                           routing))
        sec["train"] = time.perf_counter() - t
        summary = delta.model_dump() if hasattr(delta, "model_dump") else dict(delta)
        flat = [a - b for x, y in zip(mine, samp, strict=True) for a, b in zip(x, y, strict=True)]
        return IterationResult(step, vid, sum(rewards) / len(rewards), summary, train, sec, flat,
                               route_stats, seed)

    def run(self, steps: int, start: int = 0,
            on_step: Callable[[IterationResult], None] | None = None) -> list[IterationResult]:
        """``steps`` iterations; ``on_step`` sees each result."""
        out = []
        for s in range(start, start + steps):
            r = self.iteration(s)
            out.append(r)
            if on_step:
                on_step(r)
        return out
