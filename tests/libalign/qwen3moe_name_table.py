"""What slime's Qwen3-MoE converter produces, written out as a table.

The facts come from ``convert_qwen3moe_to_hf`` in
``slime/backends/megatron_utils/megatron_to_hf/qwen3moe.py`` at THUDM/slime
624b824a898ab0ec1fcb4d373004c7f3852bf515 (Miles ships the same converter as
``miles/backends/megatron_utils/megatron_to_hf/qwen3moe.py`` at radixark/miles
31f1ca961a94cb860cec3b2dea34ec332bfa8f76): which Hugging Face names each Megatron parameter
becomes, and how a fused tensor is cut. slime's weight sync hands the converter
``module.module.<Megatron name>`` with each expert's local index already raised to its global
one; this table takes the bare Megatron name.

The cuts, all plain slicing (so the pieces are the original bits):

* ``linear_fc1`` (dense, shared or per-expert) stacks gate over up: the first half of the rows
  is ``gate_proj``, the second half ``up_proj``;
* ``linear_qkv`` is grouped by key/value head: each of the ``groups`` blocks holds
  ``heads / groups`` query heads, then one key head, then one value head, each ``head_dim``
  rows; ``q_proj`` / ``k_proj`` / ``v_proj`` gather their rows from every block in order.
"""

from __future__ import annotations

import torch

# Megatron name outside the decoder layers → Hugging Face name.
TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}

# Inside ``decoder.layers.<i>.``: Megatron suffix → Hugging Face suffixes under
# ``model.layers.<i>.`` (one name: the tensor as it is; two: fc1's gate/up halves; three: qkv).
LAYER = {
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                       "self_attn.v_proj.bias"),
    # Transformer Engine fuses the norm into the next linear; slime knows it by that name.
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                             "mlp.shared_expert.up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
}

# Per-expert grouped linears: ``mlp.experts.<linear>.weight<e>`` → ``mlp.experts.<e>.<...>``.
EXPERT = {
    "linear_fc1": ("gate_proj.weight", "up_proj.weight"),
    "linear_fc2": ("down_proj.weight",),
}


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face names slime's converter gives the Megatron parameter ``name``."""
    if name in TOP:
        return (TOP[name],)
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise KeyError(name)
    layer, rest = parts[2], ".".join(parts[3:])
    prefix = f"model.layers.{layer}."
    if rest.startswith("mlp.experts."):
        linear, weight = parts[5], parts[6]
        expert = int(weight.removeprefix("weight"))
        return tuple(f"{prefix}mlp.experts.{expert}.{s}" for s in EXPERT[linear])
    return tuple(prefix + s for s in LAYER[rest])


def to_hf(name: str, tensor: torch.Tensor, *, heads: int, groups: int,
          head_dim: int) -> dict[str, torch.Tensor]:
    """``name``'s tensor under each of its Hugging Face names, cut as described above."""
    names = hf_names(name)
    if len(names) == 1:
        return {names[0]: tensor}
    if len(names) == 2:  # gate rows, then up rows
        half = tensor.shape[0] // 2
        return {names[0]: tensor[:half], names[1]: tensor[half:]}
    per_group = heads // groups
    block = tensor.reshape(groups, per_group + 2, head_dim, *tensor.shape[1:])
    q = block[:, :per_group].reshape(-1, *tensor.shape[1:])
    k = block[:, per_group].reshape(-1, *tensor.shape[1:])
    v = block[:, per_group + 1].reshape(-1, *tensor.shape[1:])
    return dict(zip(names, (q, k, v), strict=True))
