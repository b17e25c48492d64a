"""The Megatron-core learner engine: the embedded GRPO + TIS step on a Megatron GPT MoE.

It is :class:`~services.learner.engine.TorchLearnerEngine` with two parts swapped: the forward
pass (a Megatron ``GPTModel`` whose experts are libalign's, see
:mod:`libalign.models.megatron`) and the weight export (Megatron names and fused layouts
mapped to Hugging Face Qwen3-MoE's, :mod:`libalign.models.megatron_export`). The loss, the
advantages (:func:`~services.learner.engine.grpo_advantages`), the truncated importance
weights and the fp32-master Adam update are inherited unchanged, so the two engines train the
same way and differ only in how the model computes.

What is and is not here
-----------------------
World size 1 (one process; ``gloo`` on a CPU): the caller creates the process group and
Megatron's model-parallel state (:func:`libalign.models.megatron_cpu.single_process_group`).
Scoring and training run under :func:`~libalign.models.megatron_cpu.cpu_shims` (a no-op on
a GPU). Megatron's distributed optimizer, gradient buffers and pipeline schedules are not
used: at world size 1 they compute what the plain fp32-master Adam here computes.

One modelling difference to know: Hugging Face's embedding has a ``padding_idx`` whose row
gets no gradient; Megatron's has none. Padding positions never reach the loss, so the two agree
unless the pad id occurs inside a scored sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext

import torch
from torch import nn

from libalign.models import megatron as mg
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.megatron_export import export_hf_state_dict, load_hf_into_megatron
from libalign.models.scoring import completion_logprobs, right_padded_batch

from .engine import TorchLearnerEngine, TrainBatch


class MegatronLearnerEngine(TorchLearnerEngine):
    """GRPO + TIS on a Megatron-core GPT MoE whose expert GEMMs run ``path``."""

    def __init__(self, model: nn.Module, hf_config, path: str = "bf16", **kwargs):
        super().__init__(model, path, **kwargs)
        self.hf_config = hf_config
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
        """Log-probs of completion tokens for one right-padded batch through the Megatron model."""
        dev = next(self.model.parameters()).device
        ids, mask, keys = right_padded_batch(seqs, ids_of, self.pad_id, dev)
        mg.set_row_keys(self.model, keys.T)  # Megatron's tokens are [s, b]
        try:
            with torch.set_grad_enabled(grad), mg.use_path(self.model, self.path), \
                    (mg.use_guidance(self.model, table) if table is not None else nullcontext()):
                logits = mg.gpt_logits(self.model, ids, mask)
        finally:
            mg.set_row_keys(self.model, None)
        return completion_logprobs(logits, ids, [len(s) for s in seqs], plens)

    def score(self, sequences, prompt_lens, guidance=None) -> list[list[float]]:
        """Teacher-forced log-probs (see :meth:`TorchLearnerEngine.score`)."""
        with cpu_shims():
            return super().score(sequences, prompt_lens, guidance)

    def train_step(self, batch: TrainBatch) -> dict:
        """One GRPO + TIS step (see :meth:`TorchLearnerEngine.train_step`)."""
        with cpu_shims():
            return super().train_step(batch)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """bf16 CPU tensors named and laid out as Hugging Face Qwen3-MoE's state dict."""
        return export_hf_state_dict(self.model, self.hf_config)
