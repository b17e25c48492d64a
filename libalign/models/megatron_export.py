"""Megatron GPT MoE <-> Hugging Face Qwen3-MoE weights: names, fused layouts, expert indices.

A learner trains in Megatron's layout; the converter and the samplers read Hugging Face's.
:func:`export_hf_state_dict` produces the tensors a ``Qwen3MoeForCausalLM`` loads (what
:meth:`~alignd.learner.engine.LearnerEngine.export_weights` publishes) and
:func:`load_hf_into_megatron` goes the other way (tests; starting a learner from a checkpoint).

The name map (``{i}`` a decoder layer, ``d`` the head dimension, ``g`` the query groups)
----------------------------------------------------------------------------------------
===============================================  ============================================
Megatron (pipeline and tensor parallel size 1)   Hugging Face Qwen3-MoE
===============================================  ============================================
``embedding.word_embeddings.weight``             ``model.embed_tokens.weight``
``decoder.layers.{i}.input_layernorm.weight``    ``model.layers.{i}.input_layernorm.weight``
  (TE spec: ``self_attention.linear_qkv.layer_norm_weight``)
``...self_attention.linear_qkv.weight``          ``...self_attn.{q,k,v}_proj.weight`` (split)
``...self_attention.q_layernorm.weight``         ``...self_attn.q_norm.weight`` (also ``k``)
``...self_attention.linear_proj.weight``         ``...self_attn.o_proj.weight``
``...pre_mlp_layernorm.weight``                  ``...post_attention_layernorm.weight``
``...mlp.router.weight``                         ``...mlp.gate.weight``
``...mlp.experts.*`` (see below)                 ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``
                                                 and ``...mlp.experts.down_proj`` ``[E, H, I]``
``decoder.final_layernorm.weight``               ``model.norm.weight``
``output_layer.weight``                          ``lm_head.weight`` (the embedding when tied)
===============================================  ============================================

**QKV.** Megatron fuses the three projections into ``linear_qkv`` with rows grouped per query
group: for each group ``g``, its ``np/g`` query heads (``np/g * d`` rows), then its key head
(``d`` rows), then its value head (``d`` rows). Hugging Face keeps ``q_proj`` (heads in order),
``k_proj`` and ``v_proj``; query head ``h`` belongs to group ``h // (np/g)`` on both sides.

**Experts.** Megatron's gated FC1 computes ``act(x W_1^T[:I]) * x W_1^T[I:]``: the first
half of its rows is the gate, the second the up projection, exactly Hugging Face's
``gate_up_proj[e]`` (gate rows first), so FC1 maps without reordering (with expert tensor
parallelism each rank would hold interleaved halves; that is not supported). FC2 is
``down_proj[e]`` ``[H, I]``. Four Megatron layouts are read and written:
libalign's :class:`~libalign.models.megatron.LibalignGroupedMLP` (``linear_fc1.weight``
``[E, 2I, H]``, ``linear_fc2.weight`` ``[E, H, I]``: the Hugging Face stacks themselves),
``TEGroupedMLP`` (``linear_fc1.weight{j}`` per expert), ``SequentialMLP``
(``local_experts.{j}.linear_fc1.weight``) and the legacy ``GroupedMLP`` (``weight1``
``[H, E*2I]``, ``weight2`` ``[E*I, H]``).

**Expert parallelism.** On an expert-parallel rank the ``j``-th local expert is global expert
``layer.local_expert_indices[j]`` (``ep_rank * E_local + j``). ``expert_layout="fused"``
needs every expert: with more than one rank it all-gathers the stacks over the
expert-parallel group. ``expert_layout="per_expert"`` writes each local expert under its
global index with the names of the released checkpoints
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) and communicates nothing;
:func:`fuse_experts` stacks the union of all ranks' dicts into the fused layout.
``expert_layout="local"`` keeps the fused names but only this rank's slice of each stack
(``[E/P, ...]``, global experts ``ep_rank * E/P ..``); :func:`local_expert_ranges` says which
slice. ``expert_layout="none"`` leaves the experts out (the dense tensors alone). A sharded
conversion quantizes :func:`local_expert_stacks` (the slices, not copied) where they live
(:mod:`alignd.sync.sharded`) and communicates nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from libalign.errors import ConfigError, ShapeError
from libalign.models.megatron import hf_config_value, moe_layers

EXPERT_LAYOUTS = ("fused", "per_expert", "local", "none")
_EXTRA = "_extra_state"


# --- attention --------------------------------------------------------------------------------

def _attn_shape(hf_config) -> tuple[int, int, int]:
    heads = int(hf_config_value(hf_config, "num_attention_heads"))
    groups = int(hf_config_value(hf_config, "num_key_value_heads") or heads)
    d = int(hf_config_value(hf_config, "head_dim") or int(hf_config_value(hf_config, "hidden_size")) // heads)
    return heads, groups, d


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron's fused ``linear_qkv`` (weight ``[rows, H]`` or bias ``[rows]``) -> q, k, v."""
    per = heads // groups
    rows = groups * (per + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ShapeError(f"linear_qkv has {qkv.shape[0]} rows, {groups} groups of {per}+2 heads "
                         f"of {head_dim} need {rows}")
    t = qkv.reshape(groups, per + 2, head_dim, *qkv.shape[1:])
    q = t[:, :per].reshape(heads * head_dim, *qkv.shape[1:])
    k = t[:, per].reshape(groups * head_dim, *qkv.shape[1:])
    v = t[:, per + 1].reshape(groups * head_dim, *qkv.shape[1:])
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int,
              head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    per = heads // groups
    rest = q.shape[1:]
    t = torch.cat([q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                   v.reshape(groups, 1, head_dim, *rest)], dim=1)
    return t.reshape(groups * (per + 2) * head_dim, *rest)


# --- experts ----------------------------------------------------------------------------------

def read_expert_stacks(experts_sd: Mapping[str, torch.Tensor], num_local: int):
    """``(fc1 [E_local, 2I, H], fc2 [E_local, H, I])`` from an experts module's state dict,
    whichever of the four layouts (module docstring) it is in."""
    sd = {k: v for k, v in experts_sd.items() if not k.endswith(_EXTRA)}
    if "linear_fc1.weight" in sd:  # libalign
        return sd["linear_fc1.weight"], sd["linear_fc2.weight"]
    if "linear_fc1.weight0" in sd:  # TEGroupedMLP
        return (torch.stack([sd[f"linear_fc1.weight{j}"] for j in range(num_local)]),
                torch.stack([sd[f"linear_fc2.weight{j}"] for j in range(num_local)]))
    if "local_experts.0.linear_fc1.weight" in sd:  # SequentialMLP
        return (torch.stack([sd[f"local_experts.{j}.linear_fc1.weight"] for j in range(num_local)]),
                torch.stack([sd[f"local_experts.{j}.linear_fc2.weight"] for j in range(num_local)]))
    if "weight1" in sd:  # legacy GroupedMLP
        w1, w2 = sd["weight1"], sd["weight2"]
        hidden = w1.shape[0]
        return (w1.view(hidden, num_local, -1).permute(1, 2, 0).contiguous(),
                w2.view(num_local, -1, hidden).transpose(1, 2).contiguous())
    raise ConfigError(f"unknown experts layout (keys: {sorted(sd)[:6]})")


def write_expert_stacks(experts_sd: Mapping[str, torch.Tensor], fc1: torch.Tensor,
                        fc2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The experts module's state-dict entries holding ``fc1``/``fc2`` in its own layout."""
    n = fc1.shape[0]
    if "linear_fc1.weight" in experts_sd:
        return {"linear_fc1.weight": fc1, "linear_fc2.weight": fc2}
    if "linear_fc1.weight0" in experts_sd:
        return {**{f"linear_fc1.weight{j}": fc1[j] for j in range(n)},
                **{f"linear_fc2.weight{j}": fc2[j] for j in range(n)}}
    if "local_experts.0.linear_fc1.weight" in experts_sd:
        return {**{f"local_experts.{j}.linear_fc1.weight": fc1[j] for j in range(n)},
                **{f"local_experts.{j}.linear_fc2.weight": fc2[j] for j in range(n)}}
    if "weight1" in experts_sd:
        return {"weight1": fc1.permute(2, 0, 1).reshape(fc1.shape[2], -1),
                "weight2": fc2.transpose(1, 2).reshape(-1, fc2.shape[1])}
    raise ConfigError(f"unknown experts layout (keys: {sorted(experts_sd)[:6]})")


def _gather_experts(t: torch.Tensor, group) -> torch.Tensor:
    size = 1 if group is None else group.size()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def fuse_experts(state_dicts: Iterable[Mapping[str, torch.Tensor]], num_experts: int,
                 ) -> dict[str, torch.Tensor]:
    """Merge per-expert exports (one per expert-parallel rank) into the fused layout."""
    pat = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for sd in state_dicts:
        for k, v in sd.items():
            m = pat.match(k)
            if m is None:
                out.setdefault(k, v)
            else:
                parts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
    for prefix, by_expert in parts.items():
        missing = sorted(set(range(num_experts)) - set(by_expert))
        if missing:
            raise ShapeError(f"{prefix}: experts {missing[:8]} are in no shard")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in range(num_experts)])
    return out


# --- whole model ------------------------------------------------------------------------------

def _layer_of(key: str) -> int | None:
    m = re.match(r"^decoder\.layers\.(\d+)\.", key)
    return None if m is None else int(m[1])


def export_hf_state_dict(model: nn.Module, hf_config, *, expert_layout: str = "fused",
                         dtype: torch.dtype | None = torch.bfloat16, device: str | None = "cpu",
                         ) -> dict[str, torch.Tensor]:
    """The Hugging Face Qwen3-MoE state dict of a Megatron GPT MoE model (detached copies).

    ``expert_layout``: ``fused`` (transformers 5: ``gate_up_proj``/``down_proj`` stacks of
    every expert, all-gathered over the expert-parallel group), ``per_expert`` (this rank's
    experts under their global indices, as released checkpoints name them) or ``local`` (the
    fused names holding this rank's slice of each stack; see :func:`local_expert_ranges`) or
    ``none`` (no expert tensors). ``dtype`` and ``device`` of the copies (``None`` keeps them).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ConfigError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    heads, groups, d = _attn_shape(hf_config)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA)}
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    layers = sorted({i for i in map(_layer_of, sd) if i is not None})
    moe = moe_layers(model)
    for i in layers:
        pre, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        ln = pre + "input_layernorm.weight"
        out[hp + "input_layernorm.weight"] = sd[ln if ln in sd else
                                                pre + "self_attention.linear_qkv.layer_norm_weight"]
        q, k, v = split_qkv(sd[pre + "self_attention.linear_qkv.weight"], heads, groups, d)
        out.update({hp + "self_attn.q_proj.weight": q, hp + "self_attn.k_proj.weight": k,
                    hp + "self_attn.v_proj.weight": v})
        if pre + "self_attention.linear_qkv.bias" in sd:
            qb, kb, vb = split_qkv(sd[pre + "self_attention.linear_qkv.bias"], heads, groups, d)
            out.update({hp + "self_attn.q_proj.bias": qb, hp + "self_attn.k_proj.bias": kb,
                        hp + "self_attn.v_proj.bias": vb})
        for mk, hk in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if pre + f"self_attention.{mk}.weight" in sd:
                out[hp + f"self_attn.{hk}.weight"] = sd[pre + f"self_attention.{mk}.weight"]
        out[hp + "self_attn.o_proj.weight"] = sd[pre + "self_attention.linear_proj.weight"]
        out[hp + "post_attention_layernorm.weight"] = sd[pre + "pre_mlp_layernorm.weight"]
        if i not in moe:
            raise ConfigError(f"layer {i} is not an MoE layer; only all-MoE models export")
        if pre + "mlp.router.expert_bias" in sd:
            raise ConfigError("router expert bias has no Qwen3-MoE counterpart")
        out[hp + "mlp.gate.weight"] = sd[pre + "mlp.router.weight"]
        if expert_layout == "none":
            continue
        layer = moe[i]
        esd = {k[len(pre + "mlp.experts."):]: v for k, v in sd.items()
               if k.startswith(pre + "mlp.experts.")}
        fc1, fc2 = read_expert_stacks(esd, layer.num_local_experts)
        if expert_layout == "fused":
            group = getattr(layer, "ep_group", None)
            out[hp + "mlp.experts.gate_up_proj"] = _gather_experts(fc1, group)
            out[hp + "mlp.experts.down_proj"] = _gather_experts(fc2, group)
        elif expert_layout == "local":
            out[hp + "mlp.experts.gate_up_proj"] = fc1
            out[hp + "mlp.experts.down_proj"] = fc2
        else:
            half = fc1.shape[1] // 2
            for j, e in enumerate(layer.local_expert_indices):
                base = f"{hp}mlp.experts.{e}."
                out[base + "gate_proj.weight"] = fc1[j, :half]
                out[base + "up_proj.weight"] = fc1[j, half:]
                out[base + "down_proj.weight"] = fc2[j]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    return {k: _copy(v, dtype, device) for k, v in out.items()}


def local_expert_stacks(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                        ) -> dict[str, torch.Tensor]:
    """This rank's slice of every expert stack under its fused Hugging Face name, where the
    model holds it: no copy when the weights already are ``dtype`` and in libalign's layout
    (the other layouts are stacked). Slices as :func:`local_expert_ranges` describes them."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in moe_layers(model).items():
        fc1, fc2 = read_expert_stacks(layer.experts.state_dict(), layer.num_local_experts)
        hp = f"model.layers.{i}.mlp.experts."
        out[hp + "gate_up_proj"] = fc1.detach().to(dtype)
        out[hp + "down_proj"] = fc2.detach().to(dtype)
    return out


def local_expert_ranges(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{fused Hugging Face name: (first global expert, number of experts)}`` of this rank's
    slice of every expert stack, as ``export_hf_state_dict(expert_layout="local")`` names them.

    Raises :class:`ConfigError` if a rank's experts are not one contiguous run (Megatron
    always assigns ``ep_rank * E/P + j``; anything else cannot be written as a slice).
    """
    out: dict[str, tuple[int, int]] = {}
    for i, layer in moe_layers(model).items():
        ids = [int(e) for e in layer.local_expert_indices]
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise ConfigError(f"layer {i}: local experts {ids[:8]} are not contiguous")
        total = int(layer.config.num_moe_experts)
        for stack in ("gate_up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.experts.{stack}"] = (ids[0], total)
    return out


def _copy(v: torch.Tensor, dtype, device) -> torch.Tensor:
    v = v.detach()
    if device is not None:
        v = v.to(device)
    if dtype is not None and v.is_floating_point():
        v = v.to(dtype)
    return v.contiguous().clone()


def _hf_experts(hf: Mapping[str, torch.Tensor], hp: str, global_ids: list[int]):
    fused = hp + "mlp.experts.gate_up_proj"
    if fused in hf:
        idx = torch.tensor(global_ids)
        return hf[fused][idx], hf[hp + "mlp.experts.down_proj"][idx]
    try:
        fc1 = torch.stack([torch.cat([hf[f"{hp}mlp.experts.{e}.gate_proj.weight"],
                                      hf[f"{hp}mlp.experts.{e}.up_proj.weight"]]) for e in global_ids])
        fc2 = torch.stack([hf[f"{hp}mlp.experts.{e}.down_proj.weight"] for e in global_ids])
    except KeyError as e:
        raise ShapeError(f"the Hugging Face state dict lacks {e.args[0]}") from None
    return fc1, fc2


def load_hf_into_megatron(model: nn.Module, hf_state_dict: Mapping[str, torch.Tensor],
                          hf_config) -> None:
    """Copy a Hugging Face Qwen3-MoE state dict (fused or per-expert) into a Megatron GPT.

    Every Megatron tensor must be found (else :class:`~libalign.errors.ShapeError`); each
    rank takes its own experts. Parameters are written with ``copy_`` (their autograd
    version moves, so prepared NVFP4 weights are re-quantized on the next forward).
    """
    heads, groups, d = _attn_shape(hf_config)
    hf = hf_state_dict
    own = {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA)}
    moe = moe_layers(model)
    new: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
                                    "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if "output_layer.weight" in own:
        new["output_layer.weight"] = hf["lm_head.weight"]
    for i in sorted({x for x in map(_layer_of, own) if x is not None}):
        pre, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        ln = pre + "input_layernorm.weight"
        new[ln if ln in own else pre + "self_attention.linear_qkv.layer_norm_weight"] = \
            hf[hp + "input_layernorm.weight"]
        new[pre + "self_attention.linear_qkv.weight"] = merge_qkv(
            hf[hp + "self_attn.q_proj.weight"], hf[hp + "self_attn.k_proj.weight"],
            hf[hp + "self_attn.v_proj.weight"], heads, groups, d)
        if pre + "self_attention.linear_qkv.bias" in own:
            new[pre + "self_attention.linear_qkv.bias"] = merge_qkv(
                hf[hp + "self_attn.q_proj.bias"], hf[hp + "self_attn.k_proj.bias"],
                hf[hp + "self_attn.v_proj.bias"], heads, groups, d)
        for mk, hk in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if pre + f"self_attention.{mk}.weight" in own:
                new[pre + f"self_attention.{mk}.weight"] = hf[hp + f"self_attn.{hk}.weight"]
        new[pre + "self_attention.linear_proj.weight"] = hf[hp + "self_attn.o_proj.weight"]
        new[pre + "pre_mlp_layernorm.weight"] = hf[hp + "post_attention_layernorm.weight"]
        new[pre + "mlp.router.weight"] = hf[hp + "mlp.gate.weight"]
        layer = moe[i]
        esd = {k[len(pre + "mlp.experts."):]: v for k, v in own.items()
               if k.startswith(pre + "mlp.experts.")}
        fc1, fc2 = _hf_experts(hf, hp, list(layer.local_expert_indices))
        new.update({pre + "mlp.experts." + k: v for k, v in write_expert_stacks(esd, fc1, fc2).items()})
    missing = sorted(set(own) - set(new))
    if missing:
        raise ShapeError(f"no Hugging Face source for {missing[:6]}")
    for k, v in new.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ShapeError(f"{k}: Hugging Face tensor of shape {tuple(v.shape)}, Megatron holds "
                             f"{tuple(own[k].shape)}")
    model.load_state_dict(new, strict=False)
