"""Strict execution in a Megatron-core GPT: the embedded strict sampler's log-probs, bit for bit.

What it does
------------
:mod:`libalign.models.strict` makes a Hugging Face Qwen3-MoE batch-invariant: every operation
whose summation order a stock kernel picks from the call's shape is replaced by one of
:mod:`libalign.strict.ops`, so a token's log-probability no longer depends on what else shared
the call. :func:`enable` does the same to a Megatron ``GPTModel`` built by
:func:`libalign.models.megatron.build_gpt_model` (``numerics="qwen3"``), with **the same ops in
the same order**, so the Megatron learner's log-probs equal the embedded strict sampler's with
atol = 0 (the tests pin it on the CPU and, marked ``gpu``, on CUDA). The table names the
portable forms; :func:`enable`'s ``mode`` picks the op set (:mod:`libalign.strict.device`),
which the sampler must share:

=================================  ============================================================
Megatron module                    strict form
=================================  ============================================================
``ColumnParallelLinear`` /         ``linear``: fp32 accumulation in K order, one rounding
``RowParallelLinear``              (QKV, attention output, LM head)
:class:`Qwen3RMSNorm`              ``rms_norm`` (layer norms, Q/K norms, final norm)
``MoELayer``                       router logits by ``linear``, ``softmax`` over every expert,
                                   ``topk_indices`` (ties to the lower expert), top-k
                                   renormalized left to right (unless
                                   ``moe_router_pre_softmax``); then
                                   :func:`libalign.models.strict.experts_forward` on the
                                   experts' prepared weights: per expert K-ordered products,
                                   ``silu``, each token's expert outputs added in top-k order
rotary embedding                   the strict sampler's cos/sin table (libm, per position),
                                   applied inside the core attention
:class:`SDPACoreAttention`         ``attention``: keys summed in slot order
log-probabilities                  ``log_softmax`` (:func:`libalign.models.strict.log_softmax_for`
                                   answers it for a model this module made strict)
=================================  ============================================================

Guided rounding (``nvfp4_trace``, :func:`libalign.models.megatron.use_guidance`) keeps working:
the experts' activation hook names each row by its token's key (and, at FC2, its expert), as
the dispatcher-fed experts do, and the sampler's records are applied before the strict product.

The MoE layer runs without Megatron's token dispatcher: the dispatcher's combine adds a token's
expert outputs in expert order (and, across ranks, in whatever order the collective picks),
while the strict sampler adds them in its top-k order. Megatron's rotary embedding is asked
for zero angles (``cos 0 = 1``, ``sin 0 = 0``: the rotation leaves Q and K as they are, up to
the sign of a zero) and the core attention rotates with the sampler's table instead, because
Megatron computes ``torch.cos`` over the whole table, whose vectorized lanes and scalar tail
may round differently.

What it refuses
---------------
A layout whose reductions are not batch-invariant, or whose order is not the sampler's, is a
:class:`~libalign.errors.ConfigError` naming the option, never a quiet fallback: tensor,
expert, context or sequence parallelism (partial sums all-reduced or gathered in a
collective's order), Megatron's own norm and attention (``numerics="megatron"``), the
``te_grouped`` experts (probabilities multiplied before FC2), shared experts, router score
functions other than softmax, top-k scaling, expert bias or grouped routing, and FP4 K/V or
routing replay hooked into the model. Experts on a path without a strict form
(``nvfp4_naive``: a per-tensor activation scale) raise :class:`~libalign.errors.SpecError`
when they run, as in the embedded engine. The backward is the stock one
(:func:`libalign.strict.ops.strict_forward`): only forward values must match the sampler's.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

try:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.moe_layer import MoELayer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron_strict needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from libalign.errors import ConfigError
from libalign.guidance import RowGuide, guided_quantize
from libalign.models import strict as hf_strict
from libalign.models.megatron_modules import LibalignGroupedMLP, Qwen3RMSNorm, SDPACoreAttention
from libalign.strict.device import Kernels, op_set

__all__ = ["check_config", "disable", "enable", "is_strict", "use_strict"]

_STATE = "_libalign_strict"  # the same marker libalign.models.strict.is_strict reads
_ROPE = "_libalign_strict_rope_module"


def _refuse(option: str, why: str) -> ConfigError:
    return ConfigError(f"strict execution cannot honour {option}: {why}")


def check_config(cfg) -> None:
    """Refuse (:class:`~libalign.errors.ConfigError`, naming the option) a Megatron config whose
    reductions strict execution cannot make batch-invariant or put in the sampler's order."""
    for name in ("tensor_model_parallel_size", "expert_model_parallel_size",
                 "context_parallel_size", "expert_tensor_parallel_size"):
        if int(getattr(cfg, name, 1) or 1) != 1:
            raise _refuse(f"{name}={getattr(cfg, name)}", "partial sums are combined across "
                          "ranks in a collective's order, not the strict sampler's")
    if getattr(cfg, "sequence_parallel", False):
        raise _refuse("sequence_parallel=True", "norm and router inputs are gathered across ranks")
    if cfg.activation_func is not F.silu or not cfg.gated_linear_unit:
        raise _refuse("activation_func", "strict experts implement SwiGLU (silu, gated)")
    if getattr(cfg, "moe_router_score_function", "softmax") != "softmax":
        raise _refuse(f"moe_router_score_function={cfg.moe_router_score_function!r}",
                      "the strict router is a softmax")
    for name in ("moe_router_topk_scaling_factor", "moe_router_num_groups",
                 "moe_shared_expert_intermediate_size"):
        if getattr(cfg, name, None):
            raise _refuse(f"{name}={getattr(cfg, name)}", "the strict sampler has no such step")
    if getattr(cfg, "moe_router_enable_expert_bias", False):
        raise _refuse("moe_router_enable_expert_bias=True", "the strict sampler has no such step")
    if getattr(cfg, "rotary_interleaved", False):
        raise _refuse("rotary_interleaved=True", "the strict sampler rotates halves")


# --- the strict forwards ----------------------------------------------------------------------

def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    w = self.weight if weight is None else weight
    bias = self.bias if not self.skip_bias_add else None
    return hf_strict.module_ops(self).linear(input_, w, bias), (self.bias if self.skip_bias_add
                                                                 else None)


def _row_forward(self, input_):
    bias = self.bias if not self.skip_bias_add else None
    return hf_strict.module_ops(self).linear(input_, self.weight, bias), (
        self.bias if self.skip_bias_add else None)


def _norm_forward(self, x):
    return hf_strict.module_ops(self).rms_norm(x, self.weight, self.eps)


def _zero_rope_forward(self, *args, **kwargs):
    emb = type(self).forward(self, *args, **kwargs)
    return torch.zeros_like(emb)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _attention_forward(self, query, key, value, attention_mask, attn_mask_type=None,
                       attention_bias=None, packed_seq_params=None, **_unused):
    if packed_seq_params is not None or attention_bias is not None:
        raise ConfigError("strict attention takes no packed sequences and no attention bias")
    if self.kv_hook is not None:
        raise _refuse("an FP4 K/V path", "K/V would be quantized before the strict rotation")
    sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
    if sq != sk:
        raise _refuse("a KV cache", "the strict learner scores whole sequences")
    cos, sin = hf_strict.rope_table(self.__dict__[_ROPE], sq, query.device)
    cos, sin = cos[:sq].to(query.dtype), sin[:sq].to(query.dtype)
    # Hugging Face's apply_rotary_pos_emb on [b, h, s, d], in the activations' dtype
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    if attention_mask is None:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril().expand(b, 1, sq, sk)
    else:
        allowed = ~attention_mask.bool()
    out = hf_strict.module_ops(self).attention(q, k, v, allowed, self.scale)
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _experts_hook(ex: LibalignGroupedMLP) -> Callable | None:
    """:class:`LibalignGroupedMLP`'s activation hook (guided rounding) in the form
    :func:`libalign.models.strict.experts_forward` calls it: rows named by their tokens' keys
    (Megatron's ``[s, b]`` order, the strict layer's row order) and, at FC2, global expert."""
    if ex.act_hook is None or not ex.path.quantized:
        return None
    if ex.row_keys is None:
        raise ConfigError("guided rounding needs row keys: set_row_keys(model, keys)")

    def hook(site, a, spec, tokens, experts):
        keys = ex.row_keys.to(a.device)[tokens]
        if site == "fc2":
            keys = keys | (experts.to(torch.int64) + 1)
        got = ex.act_hook(ex.layer, site, a, spec, keys)
        # a sampler's records: quantized here, as the strict products take quantized rows
        return guided_quantize(a.detach(), spec, got) if isinstance(got, RowGuide) else got
    return hook


def _moe_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None, **_unused):
    if intermediate_tensors is not None:
        raise _refuse("a partially captured MoE layer", "strict MoE runs the whole layer")
    if "forward" in self.router.__dict__:
        raise _refuse("routing replay", "the router is replaced by a recorded one")
    cfg = self.config
    s, b, h = hidden_states.shape
    x = hidden_states.reshape(-1, h)
    ops = hf_strict.module_ops(self)
    # not moe_router_pre_softmax: Hugging Face's norm_topk_prob
    _, top, index = hf_strict.route(ops, x, self.router.weight.to(x.dtype),
                                    int(cfg.moe_router_topk), not cfg.moe_router_pre_softmax)
    ex = self.experts
    out = hf_strict.experts_forward(x, index, top, ex.linear_fc1.prepared(),
                                    ex.linear_fc2.prepared(), act_hook=_experts_hook(ex), ops=ops)
    return out.reshape(s, b, h), None


# --- turning it on and off --------------------------------------------------------------------

def is_strict(model: nn.Module) -> bool:
    """Whether :func:`enable` is in force on ``model``."""
    return _STATE in model.__dict__


def _rope_module(model: nn.Module) -> RotaryEmbedding:
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if len(ropes) != 1:
        raise _refuse("position_embedding_type", f"strict attention needs one RoPE module, "
                      f"the model has {len(ropes)}")
    rope = ropes[0]
    if getattr(rope, "seq_len_interpolation_factor", None) is not None:
        raise _refuse("seq_len_interpolation_factor", "the strict sampler's table is static")
    return rope


def enable(model: nn.Module, *, inv_freq: torch.Tensor | None = None, mode: str = "device",
           kernels: Kernels | None = None) -> nn.Module:
    """Make a Megatron GPT run strict until :func:`disable`; returns it (see the module
    docstring for what changes and what is refused). ``mode`` and ``kernels`` as in
    :func:`libalign.models.strict.enable`: the same op set the strict sampler runs.

    ``inv_freq``: the sampler's RoPE inverse frequencies when they are not Megatron's fp32
    ones (a Hugging Face model whose buffers were cast to bf16 rotates by the rounded values;
    :func:`libalign.models.build_model` does so); the rotation table is built from them.
    """
    ops = op_set(mode, kernels)
    if is_strict(model):
        return model
    check_config(model.config)
    rope = _rope_module(model)
    table_of = rope if inv_freq is None else types.SimpleNamespace(inv_freq=inv_freq.detach())
    plan: list[tuple[nn.Module, Callable]] = [(rope, _zero_rope_forward)]
    for m in model.modules():
        if isinstance(m, MoELayer):
            if not isinstance(m.experts, LibalignGroupedMLP):
                raise _refuse(f"experts={type(m.experts).__name__}", "strict experts multiply "
                              "the router probability after FC2 (experts='libalign')")
            if getattr(m, "shared_experts", None) is not None:
                raise _refuse("shared experts", "the strict sampler has none")
            plan.append((m, _moe_forward))
        elif isinstance(m, ColumnParallelLinear):
            plan.append((m, _column_forward))
        elif isinstance(m, RowParallelLinear):
            plan.append((m, _row_forward))
        elif isinstance(m, Qwen3RMSNorm):
            plan.append((m, _norm_forward))
        elif isinstance(m, SDPACoreAttention):
            plan.append((m, _attention_forward))
        elif isinstance(m, nn.Module) and type(m).__name__ in ("RMSNorm", "WrappedTorchNorm",
                                                               "DotProductAttention"):
            raise _refuse(f"{type(m).__name__} (numerics='megatron')", "strict execution uses "
                          "the Hugging Face-order modules of numerics='qwen3'")
    saved = []
    for m, fn in plan:
        if isinstance(m, SDPACoreAttention):
            m.__dict__[_ROPE] = table_of
        saved.append((m, m.__dict__.get("forward")))
        m.forward = types.MethodType(fn, m)
    model.__dict__[_STATE] = saved
    hf_strict.set_ops(model, ops)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: every module's own forward comes back."""
    saved = model.__dict__.pop(_STATE, None)
    if saved is not None:
        hf_strict.set_ops(model, None)
    for m, before in reversed(saved or []):
        m.__dict__.pop(_ROPE, None)
        if before is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = before
    return model


@contextmanager
def use_strict(model: nn.Module, strict: bool = True, mode: str = "device",
               kernels: Kernels | None = None) -> Iterator[nn.Module]:
    """Strict execution for the duration of a ``with`` block (``strict=False``: no change)."""
    with hf_strict.scoped(model, strict and not is_strict(model),
                          lambda: enable(model, mode=mode, kernels=kernels),
                          lambda: disable(model)):
        yield model
