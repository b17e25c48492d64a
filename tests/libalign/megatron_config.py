"""The small Qwen3-MoE config every CPU-shim Megatron test module builds (2 layers, 8 experts,
top-2, hidden 64); Megatron's world for them is the ``megatron_world`` fixture of
``tests/conftest.py``. Each module takes its own copy: a model keeps its config object and
strict mode or a path may write to it."""

from __future__ import annotations

from libalign.models import tiny_config


def small_config():
    """A fresh copy of the small config."""
    return tiny_config(num_hidden_layers=2, vocab_size=48, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32)
