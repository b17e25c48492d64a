"""The learner's RL loop through the services: publish, wait for serving, roll out, score, train.

One iteration of :class:`LearnerLoop` is one policy version's round trip:

1. **publish**: the engine's BF16 weights are written to the weight store's published
   directory, registered and announced (``published``), for the sampler's execution path;
2. **convert** and **load** happen in the converter and the samplers; the loop waits until the
   registry says ``serving`` (or ``failed``: an error naming the reason). A learner whose KV
   format takes per-layer global scales (``kv_sglang_nvfp4``) then checks the version carries
   the scales it writes K/V with (:func:`~alignd.formats.convert.check_kv_scales`: a
   :class:`~alignclient.errors.SpecError` with ``field="kv.scales"`` otherwise);
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
rollout, score, train here, with one :class:`Stopwatch`) and returned with the statistics.

The loop is built from three things: the settings, the learner engine, and its collaborators
(:class:`LoopParts`: bus, registry, weight store, rollout and guidance stores, staleness rule,
exports; :meth:`LoopParts.build` makes them from the settings) plus what each step asks for
(:class:`RolloutPlan`: prompts, reward, group size, seed). Optional engine abilities are
protocols (:class:`~alignd.learner.engine.SupportsConvertedPublish`,
:class:`~alignd.learner.engine.SupportsRoutingReplay`), and every Redis call goes through the
bus, the registry and the stores.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

from alignclient.errors import AlignError, ConfigError, LoopError, RoutingMissingError

from alignd.formats.convert import (
    check_kv_scales,
    load_kv_scales,
    path_kv_format,
    path_kv_scales,
    resolve_spec,
    target_spec,
)
from alignd.formats.modelopt_export import exports_for, holds
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.redis_clients import binary_client
from alignd.infra.registry import Registry
from alignd.infra.settings import LearnerSettings
from alignd.infra.staleness import StalenessGuard
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import Rollout, RolloutStore, Score, routing_record
from alignd.infra.telemetry import Metrics
from alignd.infra.work import (
    RolloutRequest,
    RolloutsReady,
    ready_stream,
    requests_stream,
    sampling_seed,
)
from alignd.learner.engine import (
    LearnerEngine,
    SupportsConvertedPublish,
    SupportsKVScales,
    SupportsRoutingReplay,
    TrainBatch,
)
from alignd.sync.announce import announce_converted
from alignd.sync.bf16 import publish_version
from libalign import gemm
from libalign.guidance import GuidanceRecord
from libalign.models.kv_cache import KVScales
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


@dataclass(frozen=True)
class RolloutPlan:
    """What every step asks the samplers for, and how its rollouts are rewarded."""

    prompts: Callable[[int], list[list[int]]]
    """step -> the step's prompts (token ids)"""
    reward: Callable[[list[int], list[int]], float]
    """(prompt, completion) -> reward"""
    sampler_path: str | None
    """the execution path the samplers run, versions are converted for it (None: the
    converter's preset)"""
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    """one GRPO group per prompt"""
    max_new_tokens: int = 8
    temperature: float = 1.0
    seed: int = 0
    """step ``t`` samples with :func:`~alignd.infra.work.sampling_seed` ``(seed, t)``"""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    """prefix of the run's version and request ids"""
    timeout_s: float = 300.0
    """longest wait for a version to serve and for a request's rollouts"""


def configured_kv_scales(settings: LearnerSettings) -> KVScales | None:
    """The K/V global scales of ``kv_scales_file`` (None: unset, SGLang's 1.0), read as the
    converter reads them; ConfigError naming the setting when the file holds no scales."""
    try:
        return load_kv_scales(settings.kv_scales_file)
    except AlignError as e:
        raise ConfigError(f"kv_scales_file: {e}") from None


@dataclass
class LoopParts:
    """The loop's collaborators over one Redis and one weight store (see :meth:`build`)."""

    bus: RedisBus
    registry: Registry
    store: WeightStore
    staleness: StalenessGuard
    rollouts: RolloutStore | None = None
    guidance: GuidanceStore | None = None
    exports: object | None = None
    """ModelOpt exports of the versions the loop converts itself (``sampler_layout``)"""
    metrics: Metrics | None = None
    kv_scales: KVScales | None = None
    """the configured K/V global scales (:func:`configured_kv_scales`), for the versions the
    loop converts itself"""

    @classmethod
    def build(cls, settings: LearnerSettings, *, metrics: Metrics | None = None,
              bus: RedisBus | None = None, stores: bool = True,
              rollouts: RolloutStore | None = None,
              guidance: GuidanceStore | None = None) -> LoopParts:
        """Everything from ``settings`` (a given ``bus``, ``rollouts`` or ``guidance`` is used
        as it is; ``stores=False`` leaves the stores out, for a loop that only publishes)."""
        bus = bus or RedisBus.from_settings(settings)
        registry = Registry(bus, settings.key_prefix)
        store = WeightStore(settings.store_dir)
        if stores and rollouts is None:
            rollouts = RolloutStore(binary_client(settings), settings.key_prefix, metrics=metrics,
                                    max_path_pairs=settings.max_path_pairs)
        if stores and guidance is None:
            guidance = GuidanceStore.from_settings(settings, metrics=metrics)
        return cls(bus=bus, registry=registry, store=store, rollouts=rollouts, guidance=guidance,
                   staleness=StalenessGuard(registry, settings.max_version_diff,
                                            settings.stale_rollouts, metrics),
                   exports=exports_for(settings.sampler_layout, store, settings.sglang_model_dir,
                                       settings.sglang_export_dir),
                   metrics=metrics, kv_scales=configured_kv_scales(settings))


class Stopwatch:
    """Seconds per stage: ``with watch("train"): ...`` adds the block's time under ``train``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t


@dataclass
class Collected:
    """One step's rollouts as the learner reads them back (token lists built once, for both
    scoring and training)."""

    ids: list[str]
    items: list[Rollout]
    guidance: dict[int, GuidanceRecord] | None
    routing: dict[int, RoutingRecord] | None

    @cached_property
    def sequences(self) -> list[list[int]]:
        return [list(r.tokens) for r in self.items]

    @cached_property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.items]

    @cached_property
    def sampler_logprobs(self) -> list[list[float]]:
        return [list(r.logprobs) for r in self.items]


class LearnerLoop:
    """Drives iterations against the services: ``settings``, an ``engine``, its ``parts`` and
    the ``plan`` of every step."""

    def __init__(self, settings: LearnerSettings, engine: LearnerEngine, parts: LoopParts,
                 plan: RolloutPlan):
        self.settings, self.engine, self.parts, self.plan = settings, engine, parts, plan
        self.current_version: str | None = None
        """The newest version this loop published: what staleness is measured against."""
        self.requests_stream = requests_stream(settings.key_prefix)
        self.ready_stream = ready_stream(settings.key_prefix)
        self._ready_last = parts.bus.last_id(self.ready_stream)

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def bus(self) -> RedisBus:
        return self.parts.bus

    @property
    def exports(self):
        return self.parts.exports

    # --- stages ---------------------------------------------------------------------------

    def publish(self, step: int) -> str:
        """Write, register and announce the current weights; returns the version id.

        An engine that converts its own weights (:class:`SupportsConvertedPublish`: the
        expert-parallel :class:`~alignd.learner.ranks.RankGroupEngine`, each rank quantizing its
        experts) writes the NVFP4 version itself, naming the sampler path's KV format and the
        configured scales as the converter would (and with ``sampler_layout=modelopt`` its
        ModelOpt export, from the parts) and announces it as converted; any other engine
        publishes BF16 weights for the converter service.
        """
        p, vid = self.parts, f"{self.plan.run_id}-{step:05d}"
        if isinstance(self.engine, SupportsConvertedPublish):
            target = self.plan.sampler_path
            spec, quantize = target_spec(resolve_spec(self.settings.preset), target)
            self.engine.publish_converted(p.store, vid, spec, quantize=quantize,
                                          kv_format=path_kv_format(target),
                                          kv_scales=path_kv_scales(target, p.kv_scales))
            if p.exports is not None and holds(spec, quantize):  # for SGLang samplers, once
                p.exports.write(vid)
            announce_converted(p.registry, p.bus, self.settings.converted_stream, p.store, vid,
                               spec.name, target_path=self.plan.sampler_path)
        else:
            publish_version(p.store.published_root, p.registry, p.bus,
                            self.settings.published_stream, vid, self.engine.export_weights(),
                            actor="learner", target_path=self.plan.sampler_path)
        self.current_version = vid
        return vid

    def wait_serving(self, vid: str) -> dict[str, float]:
        """Block until ``vid`` serves; seconds per stage from the registry's history."""
        deadline = time.monotonic() + self.plan.timeout_s
        while True:
            rec = self.parts.registry.get(vid)
            if rec.state == "serving":
                break
            if rec.state == "failed":
                raise LoopError(f"version {vid} failed: {rec.reason}")
            if time.monotonic() > deadline:
                raise LoopError(f"version {vid} not serving after {self.plan.timeout_s:.0f}s "
                                f"(state {rec.state})")
            time.sleep(0.01)
        at = {h.to_state: h.at for h in self.parts.registry.history(vid)}
        return {"convert": at["converted"] - at["published"],
                "load": at["serving"] - at["converted"],
                "sync": at["serving"] - at["published"]}

    def check_kv(self, vid: str) -> None:
        """Refuse ``vid`` if the learner writes K/V with other global scales than the version
        carries for the sampler (SpecError ``field="kv.scales"``); nothing to check for a
        learner whose KV format takes none."""
        scales = self.engine.kv_scales if isinstance(self.engine, SupportsKVScales) else None
        if scales is None:
            return
        kv_spec = gemm.get_path(self.engine.path).kv_spec
        check_kv_scales(self.parts.store.read_manifest(vid).extra, kv_spec.name, scales)

    def rollout_request(self, vid: str, step: int) -> RolloutRequest:
        """The request for ``step``'s rollouts of ``vid``: the step's prompts, a group per
        prompt, sampled with seed ``sampling_seed(plan.seed, step)``."""
        plan = self.plan
        return RolloutRequest(request_id=f"{plan.run_id}-{step:05d}-r", version_id=vid,
                              prompts=json.dumps(plan.prompts(step)),
                              samples_per_prompt=plan.samples_per_prompt,
                              max_new_tokens=plan.max_new_tokens, temperature=plan.temperature,
                              seed=sampling_seed(plan.seed, step),
                              guidance_bits=self.settings.guidance_bits
                              if gemm.get_path(self.engine.path).guided else 0,
                              routing=self.replay_mode != "off")

    def rollout(self, vid: str, step: int) -> RolloutsReady:
        """Ask the samplers for a group of rollouts per prompt and wait for them."""
        req = self.rollout_request(vid, step)
        rid = req.request_id
        self.bus.publish(self.requests_stream, req.to_fields())
        deadline = time.monotonic() + self.plan.timeout_s
        while time.monotonic() < deadline:
            for msg in self.bus.read_after(self.ready_stream, self._ready_last):
                self._ready_last = msg.id
                ev = RolloutsReady.from_fields(msg.fields)
                if ev.request_id != rid:
                    continue
                if ev.error:
                    raise LoopError(f"sampler {ev.sampler} could not serve {rid}: {ev.error}")
                return ev
        raise LoopError(f"no rollouts for request {rid} after {self.plan.timeout_s:.0f}s")

    def collect(self, vid: str, ready: RolloutsReady) -> Collected:
        """The request's rollouts read back, with their guidance and routing records checked
        against ``vid`` and the engine's model."""
        ids = ready.ids()
        items = self.parts.rollouts.get_rollouts(vid, ids)
        recs = None
        if ready.guidance and self.parts.guidance is not None:
            blobs = self.parts.guidance.get_many(vid, ids)
            recs = {i: GuidanceRecord.decode(blobs[r]) for i, r in enumerate(ids)}
            check_records(recs, version=vid, bits=self.settings.guidance_bits)
        return Collected(ids, items, recs, self.routing_records(vid, items))

    def score(self, vid: str, got: Collected) -> tuple[list[list[float]], dict, dict]:
        """The learner's teacher-forced log-probs of ``got`` (routed as recorded under routing
        replay), reported to the rollout store; the scores, the batch's δ summary and the
        routing disagreement."""
        seqs, plens = got.sequences, got.prompt_lens
        mine = self.engine.score(seqs, plens, got.guidance) if got.routing is None else \
            self.engine.score(seqs, plens, got.guidance, got.routing)
        route = self.engine.routing_stats.to_dict() if got.routing is not None else {}
        delta = self.parts.rollouts.put_scores(vid, [
            Score(rollout_id=r, logprobs=lp, path=self.engine.path)
            for r, lp in zip(got.ids, mine, strict=True)])
        return mine, delta.model_dump(), route

    def train(self, vid: str, batch: TrainBatch) -> dict:
        """``ppo_epochs`` optimizer steps on ``batch`` (rollouts of version ``vid``; the last
        step's statistics), unless ``vid`` is more than ``max_version_diff`` versions older
        than :attr:`current_version`: then ``{"dropped_stale": rollouts}`` (StaleRolloutError
        under ``stale_rollouts=refuse``)."""
        if not self.parts.staleness.admit(vid, self.current_version or vid,
                                          rollouts=len(batch.sequences)):
            return {"dropped_stale": len(batch.sequences)}
        for _ in range(self.settings.ppo_epochs):
            stats = self.engine.train_step(batch)
        return stats

    def train_batch(self, got: Collected, mine: list[list[float]]) -> TrainBatch:
        """The rollouts with their rewards and GRPO groups (``π_old``: the learner's scores
        when the objective clips)."""
        seqs, plens = got.sequences, got.prompt_lens
        rewards = [float(self.plan.reward(s[:p], s[p:])) for s, p in zip(seqs, plens, strict=True)]
        groups = [i // self.plan.samples_per_prompt for i in range(len(seqs))]
        old = mine if self.engine.objective().get("ppo_clip_eps") is not None else None
        return TrainBatch(seqs, plens, got.sampler_logprobs, rewards, groups, got.guidance, old,
                          got.routing)

    # --- the round trip -------------------------------------------------------------------

    def iteration(self, step: int) -> IterationResult:
        """One version's round trip (see the module doc)."""
        watch = Stopwatch()
        with watch("publish"):
            vid = self.publish(step)
        watch.seconds.update(self.wait_serving(vid))
        self.check_kv(vid)
        with watch("rollout"):
            ready = self.rollout(vid, step)
        with watch("score"):
            got = self.collect(vid, ready)
            mine, delta, route = self.score(vid, got)
        with watch("train"):
            batch = self.train_batch(got, mine)
            train = self.train(vid, batch)
        flat = [a - b for x, y in zip(mine, batch.sampler_logprobs, strict=True)
                for a, b in zip(x, y, strict=True)]
        return IterationResult(step, vid, sum(batch.rewards) / len(batch.rewards), delta, train,
                               watch.seconds, flat, route, sampling_seed(self.plan.seed, step))

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

    # --- the objective and routing replay -------------------------------------------------

    def objective(self) -> dict:
        """The engine's objective settings and the staleness rule, as the learner reports them."""
        return {**self.engine.objective(), "ppo_epochs": self.settings.ppo_epochs,
                **self.parts.staleness.describe()}

    @property
    def replay_mode(self) -> str:
        """The engine's routing replay mode (``off`` for engines without one)."""
        return self.engine.routing_replay if isinstance(self.engine, SupportsRoutingReplay) \
            else "off"

    def routing_records(self, vid: str, items: list[Rollout]) -> dict[int, RoutingRecord] | None:
        """The rollouts' routing records by batch index, checked against ``vid`` and the
        engine's model (None with routing replay off). Under ``recompute``/``record`` a rollout
        without a record is counted and refused (RoutingMissingError)."""
        if self.replay_mode == "off":
            return None
        recs = {i: routing_record(r.routing) for i, r in enumerate(items) if r.routing is not None}
        missing = [r.rollout_id for r in items if r.routing is None]
        if missing and self.replay_mode != "measure":
            if self.parts.metrics is not None:
                self.parts.metrics.rollouts_unreplayed.inc(len(missing))
            raise RoutingMissingError(f"routing replay ({self.replay_mode}) needs a routing "
                                      f"record for every rollout; {len(missing)} of "
                                      f"{len(items)} of version {vid} have none, e.g. "
                                      f"{missing[0]!r}")
        check_routing(recs, positions={i: len(items[i].tokens) - 1 for i in recs},
                      version=vid, **self.engine.routing_geometry())
        return recs
