"""The Megatron-core learner engine: the embedded GRPO + TIS step on a Megatron GPT MoE.

It is :class:`~alignd.learner.engine.TorchLearnerEngine` with two parts swapped: the forward
pass (a Megatron ``GPTModel`` whose experts are libalign's, see
:mod:`libalign.models.megatron`) and the weight export (Megatron names and fused layouts
mapped to Hugging Face Qwen3-MoE's, :mod:`libalign.models.megatron_export`). The loss, the
advantages (:func:`~alignd.learner.engine.grpo_advantages`), the truncated importance
weights, the objective's knobs (``tis_cap``, ``tis_level``, ``ppo_clip_eps``: keywords of the
constructor, from :class:`~alignd.infra.settings.LearnerSettings` in the services) and the
fp32-master Adam update are inherited unchanged, so the two engines train the same way and
differ only in how the model computes. Routing replay (``routing_replay``) forces Megatron's
routers (:mod:`libalign.models.megatron_routing`) where the embedded engine forces Hugging
Face's; the records, checks and statistics are the same. Routers are replicated and run on
each rank's own tokens before the dispatcher gathers them, so under expert parallelism a rank
needs only the records of its own share (keyed by global rollout index, like its rows) and
counts only its own tokens; :class:`~alignd.learner.ranks.RankGroupEngine` sums the counts.
A path with a KV format (``nvfp4_minite_kv_nvfp4``, ``nvfp4_trace_kv_nvfp4``, the ``kv_mxfp4``
ones) quantizes K and V in Megatron's attention as the embedded engine does in Hugging Face's,
rounded by the records' K/V sections on the trace paths (:mod:`libalign.models.megatron_kv`;
``numerics="qwen3"`` only: Megatron's own core attention has no hook, such a model is refused),
SGLang's ``kv_sglang_nvfp4`` with the engine's per-layer ``kv_scales`` (the versions' own).

What is and is not here
-----------------------
The caller creates the process group and Megatron's model-parallel state: one process with
:func:`libalign.models.megatron_cpu.single_process_group`, or one process per rank with
:func:`libalign.models.megatron_parallel.launch` (expert parallelism ``P``; tensor and pipeline
parallel sizes 1). Scoring and training run under
:func:`~libalign.models.megatron_cpu.cpu_shims` (a no-op on a GPU).

With several ranks each one trains on its own share of the batch (split it by GRPO group, so
every group's advantages are computed where its rollouts are) and the step is the whole
batch's:

* the loss divides by the completion tokens of **all** ranks;
* dense gradients (replicated weights) are summed over the data-parallel group; expert
  gradients already hold every rank's tokens (the dispatcher's backward brings them), and are
  summed only over expert-data-parallel replicas, if any;
* the clipping norm is global: the dense part once, the expert parts summed over the
  expert-parallel group;
* the returned statistics are sums and means over all ranks.

So a step on ``P`` ranks updates the weights as one process would on the concatenated batch
(to floating-point summation order; the tests pin it). Every rank must run the same number of
micro-batches (each forward is collective); a step where they differ is refused on all ranks.
Megatron's distributed optimizer, gradient buffers and pipeline schedules are not used: the
plain fp32-master Adam here computes what they would, without their memory savings.

One modelling difference to know: Hugging Face's embedding has a ``padding_idx`` whose row
gets no gradient; Megatron's has none. Padding positions never reach the loss, so the two agree
unless the pad id occurs inside a scored sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from alignclient.errors import ConfigError, SpecError
from torch import nn

from alignd.learner.engine import TorchLearnerEngine, TrainBatch
from libalign import gemm
from libalign.models import megatron as mg
from libalign.models import megatron_kv, megatron_routing, megatron_strict
from libalign.models import strict as strict_mode
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.megatron_export import export_hf_state_dict, load_hf_into_megatron
from libalign.models.scoring import completion_logprobs, right_padded_batch


class MegatronLearnerEngine(TorchLearnerEngine):
    """GRPO + TIS on a Megatron-core GPT MoE whose expert GEMMs run ``path``."""

    def __init__(self, model: nn.Module, hf_config, path: str = "bf16", *, strict: bool = False,
                 strict_ops: str = "device", rope_inv_freq: torch.Tensor | None = None, **kwargs):
        if strict:  # the embedded strict forms, checked before anything is built
            strict_mode.check_path(path)
            if kwargs.get("routing_replay", "off") != "off":
                raise ConfigError("strict execution cannot honour routing_replay="
                                  f"{kwargs['routing_replay']!r}: the strict router picks the "
                                  "experts itself")
            megatron_strict.enable(model, inv_freq=rope_inv_freq, mode=strict_ops)
        super().__init__(model, path, **kwargs)
        self.strict = strict
        """Strict execution (:mod:`libalign.models.megatron_strict`): scores and the training
        forward are the embedded strict sampler's log-probs bit for bit (``rope_inv_freq``:
        the sampler's RoPE inverse frequencies where they are not Megatron's fp32 ones)."""
        self.hf_config = hf_config
        # added to in-batch rollout indices to name rows for guidance (a rank's share starts
        # at its offset in the whole batch; see alignd.learner.ranks)
        self.key_offset = 0
        # in a rank's score share, the rollouts past this many are top-up copies (None: all
        # count): they need no routing record, and are neither replayed nor counted
        self.scored_rows: int | None = None
        mg.bind_layers(model)

    @classmethod
    def from_hf_state_dict(cls, state_dict: Mapping[str, torch.Tensor], hf_config,
                           path: str = "bf16", *, numerics: str = "qwen3", backend: str = "auto",
                           device: str | torch.device | None = None,
                           **kwargs) -> MegatronLearnerEngine:
        """Build the Megatron model for ``hf_config``, load the Hugging Face weights, wrap it."""
        model = mg.build_gpt_model(hf_config, path, numerics=numerics, backend=backend, device=device)
        load_hf_into_megatron(model, state_dict, hf_config)
        return cls(model, hf_config, path, **kwargs)

    def _forward(self, seqs, plens, ids_of, table, grad: bool) -> list[torch.Tensor]:
        """Log-probs of completion tokens for one right-padded batch through the Megatron model.

        With several ranks every rank pads to the longest sequence of any rank (the token
        dispatcher gathers equal-sized token blocks), and the rows' guidance keys use global
        rollout indices (``key_offset`` + the index within this rank's share).
        """
        dev = next(self.model.parameters()).device
        ids_of = [i + self.key_offset for i in ids_of]
        ids, mask, keys = right_padded_batch(seqs, ids_of, self.pad_id, dev)
        if self._world() > 1:
            longest = int(self._all_reduce([float(ids.shape[1])], op=dist.ReduceOp.MAX)[0])
            extra = longest - ids.shape[1]
            if extra:
                ids = F.pad(ids, (0, extra), value=self.pad_id)
                mask = F.pad(mask, (0, extra), value=0)
                keys = F.pad(keys, (0, extra), value=-1)
        mg.set_row_keys(self.model, keys.T)  # Megatron's tokens are [s, b]
        try:
            with torch.set_grad_enabled(grad), mg.use_path(self.model, self.path), \
                    (mg.use_guidance(self.model, table) if table is not None else nullcontext()), \
                    self._kv(table), self._replay():
                logits = mg.gpt_logits(self.model, ids, mask)
        finally:
            mg.set_row_keys(self.model, None)
        return completion_logprobs(logits, ids, [len(s) for s in seqs], plens,
                                   strict_mode.log_softmax_for(self.model))

    def score(self, sequences, prompt_lens, guidance=None, routing=None) -> list[list[float]]:
        """Teacher-forced log-probs (see :meth:`TorchLearnerEngine.score`)."""
        with cpu_shims():
            return super().score(sequences, prompt_lens, guidance, routing)

    def kv_geometry(self) -> dict[str, int]:
        """The Megatron model's layers, K/V heads and head size (K/V records must match)."""
        return megatron_kv.kv_geometry(self.model)

    def _path_kv_scales(self, scales):
        """The embedded engine's check of ``scales``, after refusing (ConfigError naming the
        path) a KV path the model cannot quantize K/V for (Megatron's own core attention, a
        head size the format cannot block)."""
        kv_spec = gemm.get_path(self.path).kv_spec
        if kv_spec is not None:
            try:
                megatron_kv.check_kv_capable(self.model, kv_spec)
            except SpecError as e:
                raise ConfigError(f"path {self.path!r}: {e}") from None
        return super()._path_kv_scales(scales)

    def _kv(self, table):
        """FP4 K/V in Megatron's attention on a KV path (:mod:`libalign.models.megatron_kv`),
        rounded by the table's K/V records, with the engine's per-layer ``kv_scales``."""
        kv_spec = gemm.get_path(self.path).kv_spec
        return nullcontext() if kv_spec is None else \
            megatron_kv.use_kv(self.model, kv_spec, table, scales=self.kv_scales)

    def routing_geometry(self) -> dict:
        """The Megatron model's MoE layers, top-k and expert count (routing records must match)."""
        return megatron_routing.routing_geometry(self.model)

    def _set_routing(self, routing, sequences) -> None:
        """The embedded engine's check and table, for the rollouts that count
        (``scored_rows``; see :mod:`alignd.learner.ranks`)."""
        rows = sequences if self.scored_rows is None else sequences[:self.scored_rows]
        super()._set_routing(routing, rows)

    def _routing_table(self, records):
        """Records keyed by global rollout index (``key_offset`` + index in this rank's share),
        as :meth:`_forward` names the rows; each rank's routers see only its own tokens."""
        return super()._routing_table({i + self.key_offset: r for i, r in records.items()})

    def _replay(self):
        """Routing replay on Megatron's routers (:mod:`libalign.models.megatron_routing`)."""
        if self._route is None:
            return nullcontext()
        mode = "off" if self.routing_replay == "measure" else self.routing_replay
        return megatron_routing.replay_routing(self.model, self._route, weights=mode,
                                               stats=self.routing_stats)

    def train_step(self, batch: TrainBatch) -> dict:
        """One GRPO + TIS step (see :meth:`TorchLearnerEngine.train_step`)."""
        with cpu_shims():
            return super().train_step(batch)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """bf16 CPU tensors named and laid out as Hugging Face Qwen3-MoE's state dict."""
        return export_hf_state_dict(self.model, self.hf_config)

    # --- several ranks -----------------------------------------------------------------------

    @staticmethod
    def _world() -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _all_reduce(self, values: list[float], op=None, group=None) -> list[float]:
        dev = next(self.model.parameters()).device
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        return t.tolist()

    def _global_count(self, local: int) -> int:
        """Completion tokens of every rank's share of the batch."""
        if self._world() == 1:
            return local
        return int(self._all_reduce([float(local)])[0])

    def _check_chunks(self, chunks: int) -> None:
        """Refuse, on every rank, a step whose ranks would run different micro-batch counts."""
        if self._world() == 1:
            return
        lo, hi = self._all_reduce([-float(chunks), float(chunks)], op=dist.ReduceOp.MAX)
        if -lo != hi:
            raise ConfigError(f"ranks would run {int(-lo)} to {int(hi)} micro-batches in this "
                              f"step; every rank needs the same count (each forward is collective)")

    def _groups(self):
        """(data-parallel group, expert-parallel group or None, expert-data-parallel or None)."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_group()
        ep = ps.get_expert_model_parallel_group() \
            if ps.get_expert_model_parallel_world_size() > 1 else None
        edp_fn = getattr(ps, "get_expert_data_parallel_group", None)
        edp = edp_fn() if edp_fn is not None else None
        if edp is not None and edp.size() == 1:
            edp = None
        return dp, ep, edp

    def _sync_grads(self) -> None:
        """Sum dense gradients over data-parallel ranks, expert ones over their replicas."""
        if self._world() == 1:
            return
        dp, _ep, edp = self._groups()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if _is_expert(p):
                if edp is not None:
                    dist.all_reduce(p.grad, group=edp)
            elif dp.size() > 1:
                dist.all_reduce(p.grad, group=dp)

    def _clip_grads(self) -> float:
        """Clip to ``max_grad_norm`` by the global norm (dense once, experts over the group)."""
        if self._world() == 1:
            return super()._clip_grads()
        _dp, ep, _edp = self._groups()
        # squared norms summed on the device, read back once (not once per parameter)
        sq = {False: [], True: []}
        for p, m in zip(self.params, self.master, strict=True):
            if m.grad is not None:
                sq[_is_expert(p)].append(m.grad.double().square().sum())
        dense, expert = (float(torch.stack(v).sum()) if v else 0.0 for v in (sq[False], sq[True]))
        if ep is not None:
            expert = self._all_reduce([expert], group=ep)[0]
        norm = math.sqrt(dense + expert)
        coef = self.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for m in self.master:
                if m.grad is not None:
                    m.grad.mul_(coef)
        return norm

    def _global_sums(self, values: list[float]) -> list[float]:
        """Statistics summed over every rank."""
        return values if self._world() == 1 else self._all_reduce([float(v) for v in values])


def _is_expert(p: torch.Tensor) -> bool:
    """An expert weight on an expert-parallel rank (Megatron's ``allreduce = False`` mark)."""
    return getattr(p, "allreduce", True) is False
