"""Model factories: a tiny Qwen3-MoE for CPU experiments and a Qwen3-30B-A3B-shaped one for timing.

Both are stock Hugging Face ``Qwen3MoeForCausalLM`` models (no custom classes), so everything
in :mod:`libalign.models` works unchanged on real checkpoints of the family.

Shapes and the NVFP4 block
--------------------------
An NVFP4 operand is quantized in blocks of 16 along the contraction dimension K. The expert
GEMMs contract over the hidden size (FC1, ``gate_up_proj`` ``[E, 2I, H]``) and over the expert
intermediate size (FC2, ``down_proj`` ``[E, H, I]``), so both ``hidden_size`` and
``moe_intermediate_size`` are multiples of 16 here, as they are in every Qwen3-MoE release.
Odd sizes still work (the spec pads K) but would test padding rather than the common case.

Initialization
--------------
:func:`build_model` draws the weights with Hugging Face's own initializer (normal with
``initializer_range`` = 0.02, norms at one) in fp32 under a forked, seeded RNG, then casts to
the requested dtype: the same seed gives the same model on a device, and a bf16 model is the
rounding of the fp32 one.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from libalign.errors import ConfigError
from libalign.models.task import SyntheticTask


def tiny_config(**overrides) -> Qwen3MoeConfig:
    """A 4-layer, 8-expert (top-2) Qwen3-MoE sized for the synthetic task (about 1M parameters).

    Token ids (vocabulary, pad, bos, eos) come from :class:`~libalign.models.task.SyntheticTask`;
    any field can be overridden by keyword.
    """
    task = SyntheticTask()
    fields = dict(
        vocab_size=task.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=256,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        router_aux_loss_coef=0.01,
        pad_token_id=task.pad_id,
        bos_token_id=task.bos_id,
        eos_token_id=task.eos_id,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def qwen3_30b_a3b_shaped_config(num_layers: int = 2, **overrides) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's shapes with ``num_layers`` decoder layers (the real model has 48).

    Hidden 2048, 128 experts with top-8 routing and intermediate 768, 32 query and 4 key/value
    heads of dimension 128, vocabulary 151936, RoPE theta 1e6. Meant for random-weight timing
    runs on a GPU: one layer's experts alone hold 604M parameters.
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be at least 1, got {num_layers}")
    fields = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def build_model(config: Qwen3MoeConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> Qwen3MoeForCausalLM:
    """A randomly initialized ``Qwen3MoeForCausalLM`` in eval mode, deterministic by ``seed``.

    The global RNG state is left as it was (the draws happen under a forked RNG).
    """
    dev = torch.device(device)
    fork = {"devices": []} if dev.type == "cpu" else {"devices": [dev.index or 0], "device_type": dev.type}
    with torch.random.fork_rng(**fork):
        torch.manual_seed(seed)
        with dev:
            model = Qwen3MoeForCausalLM(config)
    return model.to(dtype=dtype).eval()
