"""What a learner engine does, and the embedded one: GRPO with truncated importance sampling.

The protocol
------------
A learner engine holds the policy being trained. It can

* :meth:`~LearnerEngine.score` sequences teacher-forced under its execution path (with the
  sampler's guidance records when the path is guided, :attr:`ExecutionPath.guided`), the learner
  side of δ. A path with a KV format (``nvfp4_trace_kv_nvfp4``) also quantizes K and V in
  its forward (straight-through backward), rounded as the sampler's K/V records say after
  :func:`libalign.models.check_records` has refused records made for another model, bit
  width or KV format (:class:`~alignclient.errors.GuidanceMismatchError`). A KV format with
  one global scale per layer for K and for V (SGLang's ``kv_sglang_nvfp4``) writes with the
  engine's ``kv_scales``: the scales the versions for the sampler carry (the services give
  the learner the same ``kv_scales_file`` as the converter), so the learner's K/V bits are
  the sampler's; the loop refuses a version whose scales differ
  (:func:`alignd.formats.convert.check_kv_scales`);
* :meth:`~LearnerEngine.train_step` on a batch of rollouts: the sampler's tokens, the
  sampler's log-probs, rewards and group ids;
* replay the sampler's routing (R3, ``routing_replay``): with ``recompute`` (R3) or
  ``record`` every MoE layer routes each token the sampler fed to the experts its routing
  record names (:mod:`libalign.models.routing_replay`; gate weights from the learner's own
  router logits, or the recorded ones), in scoring and in training; a rollout without a
  record, or one made for another layer list, top-k, expert count or token count, is refused
  (:class:`~alignclient.errors.RoutingMissingError`,
  :class:`~alignclient.errors.RoutingMismatchError`), never trained unreplayed. ``measure``
  only counts; every mode but ``off`` reports the routing disagreement of the last call
  (:attr:`TorchLearnerEngine.routing_stats`: token×layer decisions whose own top-k set
  differs from the sampler's, before forcing);
* :meth:`~LearnerEngine.export_weights`: the BF16 tensors of the current policy, named as
  the Hugging Face model names them, for publishing a version.

The embedded GRPO step
----------------------
Rollouts come in groups that share a prompt. A rollout's advantage is its reward minus the
group mean, divided by the group's standard deviation (plus 1e-6; a group whose rewards are
all equal teaches nothing). The loss is the token-mean of ``-w_t · A · log π(y_t)`` where
``log π`` is the learner's log-prob under its own execution path (a W4A4 path runs NVFP4
experts forward and the straight-through bf16 product backward) and ``w_t`` the truncated
importance weight ``min(exp(log π_old(y_t) − log p_sampler(y_t)), C)`` (detached): the
correction for having sampled with a different execution than the one being trained.

The objective's knobs (``LearnerSettings``: ``tis_cap``, ``tis_level``, ``ppo_clip_eps``):

* ``tis_cap`` is ``C``: 2 by default, TRACE uses 5; ``use_tis=False`` sets every weight to 1.
* ``tis_level``: ``token`` (one weight per token, the default), ``sequence`` (one per
  rollout from the product of its ratios) or ``geometric`` (from their geometric mean), as
  :func:`libalign.metrics.tis_weights` defines them.
* ``ppo_clip_eps`` ``ε`` turns the loss into PPO's clipped surrogate, weighted by TIS:
  ``-w_t · min(r_t · A, clip(r_t, 1 − ε, 1 + ε) · A)`` with ``r_t = π_θ(y_t) / π_old(y_t)``.
  ``π_old`` is the learner's own policy when the rollout was generated: the learner's scores
  of the rollout under the version that sampled it (:attr:`TrainBatch.old_logprobs`, what
  the loop reports as scores), or, if the batch has none, the current policy (detached, so
  ``r = 1`` where the gradient is taken). The two ratios stay apart: TIS corrects the
  *execution* gap between sampler and learner on the same weights (``π_old / p_sampler``,
  capped, never clipped to a band), PPO bounds the *policy update* (``π_θ / π_old``). Where
  the clip is active (``A > 0`` and ``r > 1 + ε``, or ``A < 0`` and ``r < 1 − ε``) the
  token gives no gradient; elsewhere the gradient is ``w · r · A · ∇ log π``. On the first
  step on a batch of on-policy rollouts ``r = 1`` and the clip never binds; it binds on the
  later steps of ``ppo_epochs`` (:class:`~alignd.learner.loop.LearnerLoop`) and for rollouts
  scored by an older learner version (asynchronous training within ``max_version_diff``,
  :mod:`alignd.infra.staleness`).

Without ``ε`` and without ``old_logprobs`` the loss keeps the REINFORCE form above (the same
gradient as the surrogate at ``r = 1``). Parameters stay in bf16 (what the sampler serves)
with fp32 master copies updated by Adam.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from alignclient.errors import AlignError, ConfigError, InputError
from torch import nn

from libalign import gemm, models
from libalign import metrics as lm
from libalign.gemm.finite_checks import deferred_finite_checks
from libalign.guidance import GuidanceRecord, GuidanceTable
from libalign.models import strict as strict_mode
from libalign.models.kv_cache import KVScales, full_sequence_kwargs, guide_kv, kv_scales_for
from libalign.models.paths import set_row_keys
from libalign.models.routing_replay import (
    RoutingStats,
    RoutingTable,
    replay_routing,
    routing_geometry,
)
from libalign.models.scoring import completion_logprobs, right_padded_batch
from libalign.routing.records import RoutingRecord, check_routing

#: routing replay modes: off; measure (count disagreement only); recompute (R3: forced experts,
#: the learner's gate weights); record (forced experts and the sampler's gate weights)
ROUTING_REPLAY = ("off", "measure", "recompute", "record")


@dataclass
class TrainBatch:
    """Rollouts of one step: sequences, prompt lengths, sampler log-probs, rewards, groups."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    sampler_logprobs: list[list[float]]
    rewards: list[float]
    groups: list[int]
    guidance: Mapping[int, GuidanceRecord] | None = None
    """Guidance record per batch index (``nvfp4_trace``)."""
    old_logprobs: list[list[float]] | None = None
    """``log π_old``: the learner's log-probs of the completion tokens under the policy that
    generated the rollouts (its scores then); None: the current policy's (detached)."""
    routing: Mapping[int, RoutingRecord] | None = None
    """Routing record per batch index (routing replay)."""

    def check(self) -> None:
        """InputError naming the first inconsistency."""
        n = len(self.sequences)
        for what, xs in (("prompt_lens", self.prompt_lens), ("sampler_logprobs",
                         self.sampler_logprobs), ("rewards", self.rewards), ("groups", self.groups),
                         ("old_logprobs", self.old_logprobs or [None] * n)):
            if len(xs) != n:
                raise InputError(f"{what} has {len(xs)} entries for {n} sequences")
        for i, old in enumerate(self.old_logprobs or []):
            if len(old) != len(self.sampler_logprobs[i]) or not all(map(math.isfinite, old)):
                raise InputError(f"rollout {i}: {len(old)} old log-probs (finite ones needed) for "
                                 f"{len(self.sampler_logprobs[i])} sampler log-probs")
        for i, (s, p, lp) in enumerate(zip(self.sequences, self.prompt_lens,
                                           self.sampler_logprobs, strict=True)):
            if not 1 <= p < len(s) or len(lp) != len(s) - p:
                raise InputError(f"rollout {i}: prompt_len {p}, {len(s)} tokens and {len(lp)} "
                                 "sampler log-probs do not fit")
            if not all(math.isfinite(v) for v in lp) or not math.isfinite(self.rewards[i]):
                raise InputError(f"rollout {i}: non-finite sampler log-prob or reward")


class LearnerEngine(Protocol):
    """Score, train on rollouts, export weights."""

    path: str

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
              guidance: Mapping[int, GuidanceRecord] | None = None,
              routing: Mapping[int, RoutingRecord] | None = None) -> list[list[float]]:
        """Teacher-forced log-probs of the completion tokens under the learner's path (routed
        as ``routing`` says under routing replay)."""

    def train_step(self, batch: TrainBatch) -> dict:
        """One policy update; returns its statistics."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The current policy's tensors (bf16, CPU), as the model names them."""

    def objective(self) -> dict:
        """The objective's settings: ``tis``, ``tis_cap``, ``tis_level``, ``ppo_clip_eps``."""


@runtime_checkable
class SupportsConvertedPublish(Protocol):
    """An engine that converts its own weights and writes the NVFP4 version itself (every
    expert-parallel rank its own experts); the loop then announces it as converted."""

    def publish_converted(self, store, version_id: str, spec, *, quantize: bool = True,
                          kv_format: str | None = None,
                          kv_scales: KVScales | None = None) -> None:
        """Write ``version_id`` (NVFP4 under ``spec``, or as it is with ``quantize=False``),
        its manifest naming the sampler's KV format and scales
        (:func:`alignd.formats.convert.kv_manifest`)."""


@runtime_checkable
class SupportsKVScales(Protocol):
    """An engine whose KV format may take per-layer global K/V scales (the loop checks each
    version carries the same: :meth:`alignd.learner.loop.LearnerLoop.check_kv`)."""

    path: str
    kv_scales: KVScales | None
    """the scales K/V are written with (None: the path's KV format takes none)"""


@runtime_checkable
class SupportsRoutingReplay(Protocol):
    """An engine that scores and trains routed as the sampler recorded (routing replay)."""

    routing_replay: str
    """``off``, ``measure``, ``recompute`` or ``record`` (:data:`ROUTING_REPLAY`)"""
    routing_stats: RoutingStats
    """the disagreement counted by the last scoring pass"""

    def routing_geometry(self) -> dict:
        """``num_layers`` / ``top_k`` / ``num_experts`` a routing record must fit."""


def grpo_advantages(rewards: Sequence[float], groups: Sequence[int]) -> torch.Tensor:
    """Group-normalized advantages: (r − mean of the group) / (std of the group + 1e-6)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups)
    adv = torch.zeros_like(r)
    for gid in torch.unique(g):
        m = g == gid
        x = r[m]
        std = x.std(unbiased=False) if x.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        adv[m] = (x - x.mean()) / (std + 1e-6)
    return adv.float()


class TorchLearnerEngine:
    """The embedded learner: a Hugging Face Qwen3-MoE trained with GRPO + TIS on one path."""

    def __init__(self, model: nn.Module, path: str = "bf16", *, lr: float = 2e-5,
                 tis_cap: float = lm.DEFAULT_TIS_CAP, use_tis: bool = True,
                 tis_level: str = "token", ppo_clip_eps: float | None = None,
                 batch_size: int = 64, pad_id: int = 0, max_grad_norm: float = 1.0,
                 strict: bool = False, strict_ops: str = "device", routing_replay: str = "off",
                 kv_scales: KVScales | None = None):
        self.path = (strict_mode.check_path(path) if strict else gemm.get_path(path)).name
        if routing_replay not in ROUTING_REPLAY:
            raise ConfigError(f"routing_replay must be one of {ROUTING_REPLAY}, got "
                              f"{routing_replay!r}")
        self.routing_replay = routing_replay
        self.routing_stats = RoutingStats()
        """routing disagreement counted in the last score or train_step call"""
        self._route: RoutingTable | None = None
        self.model = model
        self.kv_scales = self._path_kv_scales(kv_scales)
        """The per-layer K/V global scales the path's KV format writes with (None: the path
        has no KV format, or one that computes its own scales; unset: SGLang's 1.0)."""
        self.tis_cap = float(tis_cap)
        if not (math.isfinite(self.tis_cap) and self.tis_cap > 0):
            raise ConfigError(f"tis_cap must be a finite number > 0, got {tis_cap!r}")
        if tis_level not in lm.TIS_LEVELS:
            raise ConfigError(f"tis_level must be one of {lm.TIS_LEVELS}, got {tis_level!r}")
        if ppo_clip_eps is not None and not 0 < ppo_clip_eps < 1:
            raise ConfigError(f"ppo_clip_eps must lie in (0, 1) (or be None), got {ppo_clip_eps!r}")
        self.tis_level = tis_level
        self.ppo_clip_eps = None if ppo_clip_eps is None else float(ppo_clip_eps)
        self.use_tis = use_tis
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.Adam(self.master, lr=lr)
        self.steps = 0
        self.strict = strict
        """Strict execution (:mod:`libalign.models.strict`): scores and the training forward
        are a strict sampler's log-probs bit for bit (δ = 0); the backward is the stock one;
        ``strict_ops`` picks the strict mode (:data:`libalign.strict.device.MODES`)."""
        if strict:
            strict_mode.enable(model, strict_ops)

    # --- the learner's log-probs ----------------------------------------------------------

    def _table(self, guidance):
        if not gemm.get_path(self.path).guided or not guidance:
            return None
        kv_spec = gemm.get_path(self.path).kv_spec
        if kv_spec is not None:
            models.check_records(guidance, geometry=self.kv_geometry(), kv_spec=kv_spec)
        return GuidanceTable(dict(guidance), next(self.model.parameters()).device)

    def kv_geometry(self) -> dict[str, int]:
        """``layers``, ``kv_heads``, ``head_dim`` of the model (what K/V records must name)."""
        return models.model_geometry(self.model)

    def _path_kv_scales(self, scales: KVScales | None) -> KVScales | None:
        """``scales`` checked against the path's KV format and the model's layers (default
        1.0 where the format takes scales and none are given); None where it takes none, as
        a version for a path without them names none. ConfigError naming the path."""
        kv_spec = gemm.get_path(self.path).kv_spec
        if kv_spec is None or kv_spec.outer_source != "given":
            return None
        try:
            return kv_scales_for(kv_spec, scales, self.kv_geometry()["layers"])
        except AlignError as e:
            raise ConfigError(f"path {self.path!r} kv_scales: {e}") from None

    def _kv(self, table):
        """The KV format of the learner's path (and its guidance) for one forward, if any."""
        kv_spec = gemm.get_path(self.path).kv_spec
        if kv_spec is None:
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(models.use_kv_format(self.model, kv_spec, self.kv_scales))
        stack.enter_context(guide_kv(self.model, table))
        return stack

    def _forward(self, seqs, plens, ids_of, table, grad: bool) -> list[torch.Tensor]:
        """Log-probs of completion tokens for one padded batch (with or without autograd)."""
        dev = next(self.model.parameters()).device
        ids, mask, keys = right_padded_batch(seqs, ids_of, self.pad_id, dev)
        set_row_keys(self.model, keys)
        try:
            with torch.set_grad_enabled(grad), models.use_path(self.model, self.path), \
                    (models.use_guidance(self.model, table) if table is not None
                     else nullcontext()), self._kv(table), self._replay():
                logits = self.model(input_ids=ids, attention_mask=mask,
                                    **full_sequence_kwargs(self.model)).logits
        finally:
            set_row_keys(self.model, None)
        return completion_logprobs(logits, ids, [len(s) for s in seqs], plens,
                                   strict_mode.log_softmax_for(self.model))

    def score(self, sequences, prompt_lens, guidance=None, routing=None) -> list[list[float]]:
        """Teacher-forced log-probs (the records of ``guidance`` steer ``nvfp4_trace``; those
        of ``routing`` the experts under routing replay)."""
        table = self._table(guidance)
        self._set_routing(routing, sequences)
        out: list[list[float]] = []
        try:
            for a in range(0, len(sequences), self.batch_size):
                b = min(len(sequences), a + self.batch_size)
                with deferred_finite_checks():  # the GEMMs' NaN/Inf checks read once a batch
                    lps = self._forward([list(map(int, s)) for s in sequences[a:b]],
                                        list(prompt_lens[a:b]), list(range(a, b)), table,
                                        grad=False)
                out += [t.tolist() for t in lps]
        finally:
            self._route = None
        return out

    # --- routing replay -------------------------------------------------------------------

    def routing_geometry(self) -> dict:
        """``layers``, ``top_k``, ``num_experts`` of the model's MoE layers (records must match)."""
        return routing_geometry(self.model)

    def routing_for(self, routing: Mapping[int, RoutingRecord] | None,
                    sequences: Sequence[Sequence[int]]) -> dict[int, RoutingRecord] | None:
        """The records routing replay uses for ``sequences``, by batch index, checked against
        the batch and the model (None: nothing to replay or count).

        Under ``recompute``/``record`` every rollout needs a record (RoutingMissingError), of
        this model's layers, top-k and experts and of its rollout's token count
        (RoutingMismatchError); ``measure`` takes the records there are; ``off`` none. A
        caller that splits a batch (:class:`alignd.learner.ranks.RankGroupEngine`) asks here
        first, so a bad batch is refused as one process refuses it.
        """
        if self.routing_replay == "off":
            return None
        need = {i: len(s) - 1 for i, s in enumerate(sequences)}
        if self.routing_replay == "measure":
            routing = {i: r for i, r in (routing or {}).items() if r is not None}
            need = {i: n for i, n in need.items() if i in routing}
        if not need:
            return None
        check_routing(routing or {}, positions=need, **self.routing_geometry())
        return {i: routing[i] for i in need}

    def _set_routing(self, routing: Mapping[int, RoutingRecord] | None, sequences) -> None:
        """Check ``routing`` (:meth:`routing_for`) and index it for the forwards."""
        self.routing_stats = RoutingStats()
        self._route = None
        records = self.routing_for(routing, sequences)
        if records:
            self._route = self._routing_table(records)

    def _routing_table(self, records: Mapping[int, RoutingRecord]) -> RoutingTable:
        """The lookup table of one call's records, keyed as the forward names its rows (here:
        by batch index)."""
        return RoutingTable(records, next(self.model.parameters()).device)

    def _replay(self):
        """The routing replay of one forward (HF routers), counting into routing_stats."""
        if self._route is None:
            return nullcontext()
        mode = "off" if self.routing_replay == "measure" else self.routing_replay
        return replay_routing(self.model, self._route, weights=mode, stats=self.routing_stats)

    # --- one update -----------------------------------------------------------------------

    def objective(self) -> dict:
        """The objective's settings, as the learner reports them (heartbeat, demo summary)."""
        return {"tis": self.use_tis, "tis_cap": self.tis_cap, "tis_level": self.tis_level,
                "ppo_clip_eps": self.ppo_clip_eps}

    def importance_weights(self, old: list[torch.Tensor], samp: list[torch.Tensor]
                           ) -> tuple[list[torch.Tensor], int, int]:
        """Per-rollout TIS weights ``min(exp(log π_old − log p_sampler), C)`` at ``tis_level``
        (a sequence's weight repeated over its tokens), with how many weights were truncated
        of how many (all ones, 0 of 0, without TIS)."""
        if not self.use_tis:
            return [torch.ones_like(o) for o in old], 0, 0
        got = lm.tis_weights([o - s for o, s in zip(old, samp, strict=True)], cap=self.tis_cap,
                             level=self.tis_level)
        per = got.weights if self.tis_level == "token" else [
            got.weights[i].expand(len(o)) for i, o in enumerate(old)]
        return [w.to(o.dtype) for w, o in zip(per, old, strict=True)], got.truncated, got.total

    def rollout_objective(self, lp: torch.Tensor, old: torch.Tensor | None, w: torch.Tensor,
                          a: float) -> tuple[torch.Tensor, int]:
        """One rollout's objective summed over its tokens (the loss is minus its token mean)
        from its log-probs ``lp`` (with autograd), ``log π_old`` (None: ``lp`` detached), TIS
        weights ``w`` and advantage ``a``; and how many tokens the PPO clip held."""
        if old is None and self.ppo_clip_eps is None:
            return (w * a * lp).sum(), 0
        r = torch.exp(lp - (lp.detach() if old is None else old))
        if self.ppo_clip_eps is None:
            return (w * r * a).sum(), 0
        lo, hi = 1.0 - self.ppo_clip_eps, 1.0 + self.ppo_clip_eps
        surrogate = torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
        held = int((r.detach() > hi).sum()) if a > 0 else int((r.detach() < lo).sum()) if a < 0 \
            else 0
        return (w * surrogate).sum(), held

    def train_step(self, batch: TrainBatch) -> dict:
        """GRPO + TIS (PPO-clipped with ``ppo_clip_eps``) on ``batch``: one optimizer step
        over all its rollouts. ``signal_rollouts`` in the result counts rollouts of nonzero
        advantage: a group whose rewards are all equal teaches nothing, and a step of only such
        groups has a gradient norm of exactly 0."""
        batch.check()
        adv = grpo_advantages(batch.rewards, batch.groups)
        table = self._table(batch.guidance)
        self._set_routing(batch.routing, batch.sequences)
        try:
            return self._train(batch, adv, table)
        finally:
            self._route = None

    def _train(self, batch: TrainBatch, adv: torch.Tensor, table) -> dict:
        """The body of :meth:`train_step` (routing records already indexed)."""
        for p in self.params:
            p.grad = None
        local_tokens = sum(len(lp) for lp in batch.sampler_logprobs)
        tokens = self._global_count(local_tokens)
        ratios: list[torch.Tensor] = []
        n = len(batch.sequences)
        self._check_chunks(-(-n // self.batch_size))
        # the expert GEMMs' NaN/Inf checks are read once, before any weight changes
        with deferred_finite_checks():
            loss_sum, truncated, weights, clipped = self._micro_batches(
                batch, adv, table, tokens, ratios)
        self._sync_grads()
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        norm = self._clip_grads()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m.to(p.dtype))
        self.steps += 1
        r = torch.cat(ratios) if ratios else torch.zeros(0)
        (loss_sum, truncated, weights, clipped, r_sum, r_n, reward_sum, n_all,
         signal) = self._global_sums(
            [loss_sum, truncated, weights, clipped, float(r.sum()), r.numel(),
             float(sum(batch.rewards)), n, int((adv != 0).sum())])
        return {"loss": loss_sum, "grad_norm": norm, "tokens": tokens,
                "reward_mean": reward_sum / max(1, n_all),
                "signal_rollouts": int(signal),
                "tis_truncated_fraction": truncated / max(1, weights),
                "ppo_clipped_fraction": clipped / max(1, tokens),
                "ratio_mean": r_sum / r_n if r_n else 1.0}

    def _micro_batches(self, batch: TrainBatch, adv: torch.Tensor, table, tokens: int,
                       ratios: list) -> tuple[float, int, int, int]:
        """Forward and backward of every micro-batch of ``batch`` (gradients summed);
        ``(loss, TIS-truncated, weights, PPO-clipped)`` sums, ``ratios`` appended to."""
        loss_sum, truncated, weights, clipped = 0.0, 0, 0, 0
        n = len(batch.sequences)
        for a in range(0, n, self.batch_size):
            b = min(n, a + self.batch_size)
            lps = self._forward(batch.sequences[a:b], batch.prompt_lens[a:b], list(range(a, b)),
                                table, grad=True)
            dev = lps[0].device
            samp = [torch.tensor(batch.sampler_logprobs[i], device=dev) for i in range(a, b)]
            old = None if batch.old_logprobs is None else [
                torch.tensor(batch.old_logprobs[i], device=dev) for i in range(a, b)]
            behind = [lp.detach() for lp in lps] if old is None else old
            ws, cut, total = self.importance_weights(behind, samp)
            truncated, weights = truncated + cut, weights + total
            loss = 0.0
            for j, i in enumerate(range(a, b)):
                ratios.append(torch.exp(behind[j] - samp[j]).cpu())
                term, held = self.rollout_objective(lps[j], None if old is None else old[j], ws[j],
                                                   adv[i].item())
                clipped += held
                loss = loss - term
            loss = loss / tokens
            loss.backward()
            loss_sum += float(loss.detach())
        return loss_sum, truncated, weights, clipped

    # --- what a data-parallel subclass distributes (one process: nothing) -----------------

    def _global_count(self, local: int) -> int:
        """The batch's completion tokens over every rank (the loss's denominator)."""
        return local

    def _check_chunks(self, chunks: int) -> None:
        """Refuse a step whose micro-batch count differs between ranks (one process: fine)."""

    def _sync_grads(self) -> None:
        """Make each gradient the whole batch's (one process: it already is)."""

    def _clip_grads(self) -> float:
        """Clip the fp32 master gradients to ``max_grad_norm``; return their norm before."""
        return float(torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm))

    def _global_sums(self, values: list[float]) -> list[float]:
        """Per-step statistics summed over every rank (one process: as they are)."""
        return values

    def export_weights(self) -> dict[str, torch.Tensor]:
        """bf16 CPU copies of every tensor of the model's state dict."""
        return {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype)
                .contiguous().clone() for k, v in self.model.state_dict().items()}


