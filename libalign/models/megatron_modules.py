"""The Megatron modules libalign fills in: grouped expert linears, the experts module, and
Hugging Face-order norm and attention.

Where it plugs in
-----------------
A Megatron MoE layer (``MoELayer``) routes with its router, permutes tokens so that rows are
sorted by local expert (its *token dispatcher*), and calls its *experts* module as
``experts(permuted_tokens, tokens_per_expert, permuted_probs) -> (out, bias)``. Megatron ships
three experts modules: ``SequentialMLP`` (one ``MLP`` per expert, each a
``ColumnParallelLinear`` FC1 and ``RowParallelLinear`` FC2 built from an ``MLPSubmodules``
spec), ``TEGroupedMLP`` (two grouped linears built by a builder called as
``builder(num_local_experts, in, out, *, config, init_method, bias, skip_bias_add, is_expert,
tp_comm_buffer_name, pg_collection[, name])`` and run as ``linear(x, tokens_per_expert) ->
(out, bias)``) and the legacy ``GroupedMLP``. Here:

* :class:`LibalignGroupedLinear` is such a grouped linear: one ``[E, N, K]`` weight stack (the
  Hugging Face expert layout, so export needs no transpose), its forward one
  :func:`~libalign.gemm.grouped_linear` call on the path it is set to. It fits
  ``TEGroupedMLP``'s builder slots as is.
* :class:`LibalignGroupedMLP` is the experts module
  :func:`~libalign.models.megatron.get_moe_layer_spec` uses. It holds
  two of those linears and runs FC1, SwiGLU, FC2 **in the order libalign's reference (and the
  Hugging Face glue) runs them**: the router probability multiplies FC2's *output*.
  Megatron's own experts multiply it into FC2's *input* (``act(gate) * up * p``), which is
  the same real number but not the same NVFP4 operand: on ``nvfp4_naive`` a per-tensor scale
  then sees probability-weighted rows, and on every path the bf16 product ``act * p`` rounds
  before quantization. Under ``TEGroupedMLP`` the grouped linears run libalign's GEMM but
  FC2 multiplies Megatron's operand; :class:`LibalignGroupedMLP` multiplies the sampler's.

Weights are quantized once per weight version: each linear caches its
:class:`~libalign.gemm.ExpertWeights` per path, keyed by the parameter's storage pointer and
autograd version counter (an optimizer step or ``copy_`` bumps it), as the Hugging Face glue
does.

:class:`Qwen3RMSNorm` and :class:`SDPACoreAttention` fill Megatron's norm and core-attention
slots with Hugging Face Qwen3's order of operations (see :mod:`libalign.models.megatron`,
"Numerics of the rest of the model"). :mod:`libalign.models.megatron` builds the layer specs
and the model from these modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron_modules needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from libalign import gemm
from libalign.errors import ConfigError, SpecError
from libalign.guidance import RowGuide, guided_quantize

PathLike = str | gemm.ExecutionPath
# hook(layer, site, activations, spec, row_keys) -> their NVFP4 quantization, a RowGuide (the
# GEMM rounds them by a sampler's records) or None (the path's own quantization)
MegatronActivationHook = Callable[..., object]


def _pg_size(group) -> int:
    return 1 if group is None else int(group.size())


def _pg_rank(group) -> int:
    return 0 if group is None else int(group.rank())


def global_expert_index(local: int, ep_rank: int, num_local_experts: int) -> int:
    """The global index of local expert ``local`` on expert-parallel rank ``ep_rank``."""
    if not 0 <= local < num_local_experts or ep_rank < 0:
        raise SpecError(f"local expert {local} of {num_local_experts} on rank {ep_rank}")
    return ep_rank * num_local_experts + local


# --- the grouped linear -----------------------------------------------------------------------

def _signature(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape))


class LibalignGroupedLinear(MegatronModule):
    """``E`` expert linears as one ``[E, out, in]`` stack, multiplied through a libalign path.

    Built like a Megatron grouped linear (``TEGroupedMLP``'s ``linear_fc1``/``linear_fc2``
    builder signature) and called as ``linear(x, tokens_per_expert) -> (out, None)`` with
    ``x`` ``[rows, in]`` sorted by expert. ``path``/``backend`` choose the execution path and
    the GEMM backend (see :func:`libalign.gemm.grouped_linear`); both can change at any time.
    """

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *,
                 config: TransformerConfig, init_method: Callable | None = None, bias: bool = False,
                 skip_bias_add: bool = False, is_expert: bool = True,
                 tp_comm_buffer_name: str | None = None, pg_collection=None, name: str | None = None,
                 path: PathLike = "bf16", backend: str = "auto", **_unused):
        super().__init__(config=config)
        if bias:
            raise ConfigError("libalign's grouped linear has no bias (set add_bias_linear=False)")
        tp = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        if _pg_size(tp) != 1:
            raise ConfigError("libalign's grouped linear needs expert_tensor_parallel_size=1")
        self.num_local_experts = num_local_experts
        self.input_size, self.output_size = input_size, output_size
        self.path = gemm.get_path(path)
        self.backend = backend
        device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.device("cuda", torch.cuda.current_device())
        master = torch.empty((num_local_experts, output_size, input_size), dtype=torch.float32)
        if config.perform_initialization and init_method is not None:
            for e in range(num_local_experts):
                init_method(master[e])
        self.weight = nn.Parameter(master.to(device=device, dtype=config.params_dtype))
        # Megatron's DDP reduces expert gradients over the expert-data-parallel group only.
        # The group decides, not the config field (which a hand-built config may leave at 1).
        ep = getattr(pg_collection, "ep", None) if pg_collection is not None else None
        ep_size = max(_pg_size(ep), int(config.expert_model_parallel_size))
        self.weight.allreduce = not (is_expert and ep_size > 1)
        self._prepared: dict[str, tuple] = {}
        self.check_finite = True  # see libalign.models.megatron.set_finite_check

    def prepared(self, path: PathLike | None = None) -> gemm.ExpertWeights:
        """The weight stack prepared for ``path`` (default: the current one), cached per version."""
        p = self.path if path is None else gemm.get_path(path)
        w = self.weight
        sig = _signature(w)
        hit = self._prepared.get(p.name)
        if hit is None or hit[0] != sig or hit[2].path is not p:
            # The entry keeps the storage alive, so an equal pointer means the same storage.
            hit = (sig, w.detach(), gemm.prepare_weights(w, p))
            self._prepared[p.name] = hit
        return hit[2]

    def clear_cache(self) -> None:
        """Forget every prepared stack (after writing through ``weight.data``)."""
        self._prepared.clear()

    def forward(self, x: torch.Tensor, tokens_per_expert, act_q=None):
        """``(grouped_linear(x, W), None)`` on the current path; ``act_q`` is an activation
        hook's answer (see :data:`MegatronActivationHook`)."""
        counts = tokens_per_expert
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        w, guide = self.prepared(), None
        if isinstance(act_q, RowGuide):  # a sampler's records: fused, or quantized first
            if gemm.fuses_guidance(x, w, act_q, self.backend):
                guide, act_q = act_q, None
            else:
                act_q = guided_quantize(x.detach(), w.path.act_spec, act_q)
        out = gemm.grouped_linear(x, w, counts, backend=self.backend, act_q=act_q,
                                  check_finite=self.check_finite, act_guide=guide)
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (nothing delayed)."""

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}, in={self.input_size}, out={self.output_size}, "
                f"path={self.path.name}")


# --- the experts module -----------------------------------------------------------------------

class LibalignGroupedMLP(MegatronModule):
    """The routed experts of a Megatron MoE layer, in libalign's order of operations.

    ``forward(x, tokens_per_expert, probs)``: FC1 grouped (``[E, 2I, H]``, gate rows then up
    rows), ``act(gate) * up``, FC2 grouped (``[E, H, I]``), each row times its router
    probability (in the output dtype, as :func:`libalign.gemm.moe_experts_forward` does).
    Returns ``(out, None)`` as Megatron's experts do.

    ``linears``: the ``(FC1, FC2)`` classes, :class:`LibalignGroupedLinear` stacks by default;
    :mod:`libalign.models.megatron_grouped`'s per-expert ones give Transformer Engine's
    parameter names (``linear_fc1.weight{i}``) and distributed-checkpoint keys (those of
    ``TEGroupedMLP``), with the same bits.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None,
                 pg_collection=None, name: str | None = None, *, path: PathLike = "bf16",
                 backend: str = "auto", linears: tuple[type, type] | None = None, **_unused):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func not in (F.silu, F.gelu):
            raise ConfigError("LibalignGroupedMLP runs gated experts (SwiGLU/GeGLU): set "
                              "gated_linear_unit=True and activation_func=F.silu")
        if config.add_bias_linear or getattr(config, "moe_latent_size", None) or \
                config.moe_apply_probs_on_input:
            raise ConfigError("LibalignGroupedMLP supports no expert bias, no latent projection "
                              "and no moe_apply_probs_on_input")
        self.num_local_experts = num_local_experts
        ep = getattr(pg_collection, "ep", None) if pg_collection is not None else None
        self.ep_group = ep
        self.ep_rank, self.ep_size = _pg_rank(ep), _pg_size(ep)
        ffn = config.moe_ffn_hidden_size
        fc1_cls, fc2_cls = linears or (LibalignGroupedLinear, LibalignGroupedLinear)
        kw = dict(config=config, is_expert=True, pg_collection=pg_collection, path=path,
                  backend=backend)
        self.linear_fc1 = fc1_cls(num_local_experts, config.hidden_size, 2 * ffn,
                                  init_method=config.init_method, **kw)
        self.linear_fc2 = fc2_cls(num_local_experts, ffn, config.hidden_size,
                                  init_method=config.output_layer_init_method, **kw)
        self.tp_group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        self.activation_func = config.activation_func
        # set by bind_layers / use_guidance / set_row_keys
        self.layer: int | None = None
        self.dispatcher = None
        self.act_hook: MegatronActivationHook | None = None
        self.row_keys: torch.Tensor | None = None

    @property
    def path(self) -> gemm.ExecutionPath:
        """The execution path of both GEMMs."""
        return self.linear_fc1.path

    def set_path(self, path: PathLike, backend: str | None = None) -> None:
        """Run both GEMMs on ``path`` (and ``backend``, when given) from now on."""
        p = gemm.get_path(path)
        for lin in (self.linear_fc1, self.linear_fc2):
            lin.path = p
            if backend is not None:
                lin.backend = backend

    @property
    def local_expert_offset(self) -> int:
        """Global index of local expert 0."""
        return self.ep_rank * self.num_local_experts

    def _row_keys(self, counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of the permuted rows' tokens, and the global expert of each row."""
        local_map = getattr(self.dispatcher, "local_map", None)
        if local_map is None:
            raise SpecError("guided rounding needs the layer's token dispatcher (allgather) bound: "
                            "build the model with build_gpt_model or call bind_layers(model)")
        if self.row_keys is None:
            raise SpecError("guided rounding needs row keys for every forward call: "
                            "set_row_keys(model, keys) with keys in Megatron's [s, b] order")
        token_of = local_map.T.nonzero()[:, 1]  # expert-major, token order within an expert
        keys = self.row_keys.to(device)
        if self.ep_size > 1:  # the dispatcher gathered every rank's tokens: gather their keys
            every = keys.new_empty((keys.numel() * self.ep_size,))
            dist.all_gather_into_tensor(every, keys.contiguous(), group=self.ep_group)
            keys = every
        if token_of.numel() != sum(counts) or keys.numel() != local_map.shape[0]:
            raise SpecError(f"{keys.numel()} row keys for {local_map.shape[0]} tokens "
                            f"and {sum(counts)} expert rows")
        # counts queued without a blocking copy, the output size given: no synchronisation
        expert_of = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=device) + self.local_expert_offset,
            torch.tensor(counts).to(device, non_blocking=True), output_size=sum(counts))
        return keys[token_of.to(device)], expert_of

    def forward(self, x: torch.Tensor, tokens_per_expert, permuted_probs: torch.Tensor, **_unused):
        """Experts forward on expert-sorted rows; see the class docstring."""
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) \
            else [int(c) for c in tokens_per_expert]
        layout = gemm.group_layout(counts)
        path = self.path
        hook = self.act_hook if path.quantized else None
        q1 = q2 = None
        if hook is not None:
            keys, expert_of = self._row_keys(counts, x.device)
            q1 = hook(self.layer, "fc1", x, path.act_spec, keys)
        h, _ = self.linear_fc1(x, layout, act_q=q1)
        gate, up = h.chunk(2, dim=-1)
        act = self.activation_func(gate) * up
        if hook is not None:
            q2 = hook(self.layer, "fc2", act, path.act_spec, keys | (expert_of.to(torch.int64) + 1))
        y, _ = self.linear_fc2(act, layout, act_q=q2)
        y = y * permuted_probs.unsqueeze(-1).to(y.dtype)
        return y, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Per-expert linears: ``TEGroupedMLP``'s keys (global expert offsets, FC1's gate/up
        halves as Megatron's SwiGLU factory splits them); a stack: Megatron's default."""
        if hasattr(self.linear_fc1, "weight"):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        return TEGroupedMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def backward_dw(self) -> None:
        """Nothing delayed (see :meth:`LibalignGroupedLinear.backward_dw`)."""


# --- Hugging Face-order norm and attention ----------------------------------------------------

class Qwen3RMSNorm(nn.Module):
    """RMSNorm in Hugging Face Qwen3's order: fp32 normalize, round to the input dtype, scale.

    Built like Megatron's norms (``config, hidden_size, eps``)."""

    def __init__(self, config: TransformerConfig | None = None, hidden_size: int = 0,
                 eps: float = 1e-6, **_unused):
        super().__init__()
        dtype = config.params_dtype if config is not None else torch.float32
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``weight * dtype(x * rsqrt(mean(x²) + eps))`` with the mean in fp32."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class SDPACoreAttention(MegatronModule):
    """Megatron's core-attention slot filled with torch SDPA, called as Hugging Face calls it.

    Inputs ``query`` ``[sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]``; output
    ``[sq, b, np*hn]``. Without a mask: ``is_causal`` with grouped-query heads shared by
    ``enable_gqa``; with a Megatron mask (bool, ``True`` = masked out): key/value heads
    repeated and the inverted mask passed to SDPA. Dropout must be zero.

    ``kv_hook(site, x)`` (``site`` ``"k"`` or ``"v"``, ``x`` ``[sk, b, ng, hn]``), when set,
    replaces key and value before attention reads them (FP4 KV:
    :func:`libalign.models.megatron_kv.use_kv`); ``row_keys`` are the tokens' keys in
    Megatron's ``[s, b]`` order (:func:`libalign.models.megatron.set_row_keys`).
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, attn_mask_type=None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **_unused):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ConfigError("SDPACoreAttention runs without attention dropout")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.layer = int(layer_number) - 1  # 0-based, as guidance records name layers
        self.kv_hook: Callable[[str, torch.Tensor], torch.Tensor] | None = None
        self.row_keys: torch.Tensor | None = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        """Scaled dot-product attention over ``[b, heads, s, hn]`` views of the inputs."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ConfigError("SDPACoreAttention takes no packed sequences and no attention bias")
        if self.kv_hook is not None:
            key, value = self.kv_hook("k", key), self.kv_hook("v", value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        n_rep = q.shape[1] // k.shape[1]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=self.scale,
                                                 enable_gqa=n_rep > 1)
        else:
            out = F.scaled_dot_product_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep),
                                                 attn_mask=~attention_mask.bool(), scale=self.scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
