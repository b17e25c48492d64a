"""Megatron-core glue: a Megatron GPT's MoE experts run libalign's execution paths.

Why a Megatron learner
----------------------
At scale the learner is Megatron-core (tensor, pipeline and expert parallelism), while the
sampler serves a Hugging Face-layout checkpoint. For the two to compute the same thing, the
learner's expert GEMMs must run the path the sampler runs (``bf16``, ``nvfp4_naive``,
``nvfp4_minite``, ``nvfp4_trace``), with the sampler's numerics forward and the straight-through
bf16 product backward. This module puts :func:`libalign.gemm.grouped_linear` under
Megatron's MoE layer; everything else (attention, router, token dispatch, optimizer) stays
Megatron's.

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
* :class:`LibalignGroupedMLP` is the experts module :func:`get_moe_layer_spec` uses. It holds
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

Numerics of the rest of the model
---------------------------------
:func:`get_moe_layer_spec` starts from Megatron's local (pure PyTorch) GPT layer spec with
RMSNorm and QK layernorm (Qwen3's architecture). With ``numerics="qwen3"`` (the default) it
also swaps in :class:`Qwen3RMSNorm` (normalize in fp32, round, then scale by the weight, as
Hugging Face's Qwen3 norm does; torch's fused RMSNorm rounds once after the scale) and
:class:`SDPACoreAttention` (``torch.nn.functional.scaled_dot_product_attention`` called as
Hugging Face's ``sdpa`` attention calls it, instead of Megatron's baddbmm/softmax/bmm). With
the same weights a Megatron learner then computes the Hugging Face model's logits bit for bit
on the CPU (the tests pin it on every path). One difference remains in principle: Megatron's
router takes the softmax over the ``k`` chosen logits, Hugging Face's over all of them and
renormalizes; the two are equal in exact arithmetic and gave equal bf16 probabilities in every
test, but could differ by one bf16 ulp. ``numerics="megatron"`` keeps Megatron's modules
(logits then differ by a few bf16 ulps).

Guided rounding (``nvfp4_trace``)
---------------------------------
:func:`use_guidance` rounds each expert activation row with the sampler's recorded scales and
low code bits (:func:`libalign.guidance.guided_quantize`). A row is named by its token's key
(:func:`libalign.guidance.row_keys`, set with :func:`set_row_keys` in Megatron's ``[s, b]``
token order) and, at FC2, its global expert. The experts module learns which token each
permuted row came from through its layer's token dispatcher (the *allgather* dispatcher's
``local_map``), which :func:`bind_layers` (called by :func:`build_gpt_model`) connects.
Under expert parallelism the dispatcher gathers every rank's tokens, so the experts module
gathers their keys the same way (each rank sets the keys of its own tokens; keys must be
unique across ranks, and every rank's table must hold the records of all of them).

Expert parallelism
------------------
With ``E`` experts over an expert-parallel group of size ``P``, rank ``r`` holds experts
``r*E/P .. (r+1)*E/P - 1`` as local experts ``0 .. E/P - 1``; :func:`global_expert_index`
maps one to the other (guidance keys and exported names use the global index). Expert
tensor parallelism is not supported (``expert_tensor_parallel_size`` must be 1): FC1 would
then be split per rank into interleaved gate/up halves.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

try:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from .. import gemm
from ..errors import ConfigError, SpecError
from ..guidance import GuidanceTable, guided_quantize
from .megatron_cpu import cpu_shims, fix_missing_te

PathLike = str | gemm.ExecutionPath
NUMERICS = ("qwen3", "megatron")
# hook(layer, site, activations, spec, row_keys) -> their NVFP4 quantization
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
        """``(grouped_linear(x, W), None)`` on the current path."""
        counts = tokens_per_expert
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        out = gemm.grouped_linear(x, self.prepared(), counts, backend=self.backend, act_q=act_q)
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
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None,
                 pg_collection=None, name: str | None = None, *, path: PathLike = "bf16",
                 backend: str = "auto", **_unused):
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
        make = functools.partial(LibalignGroupedLinear, num_local_experts, config=config,
                                 is_expert=True, pg_collection=pg_collection, path=path,
                                 backend=backend)
        self.linear_fc1 = make(config.hidden_size, 2 * ffn, init_method=config.init_method)
        self.linear_fc2 = make(ffn, config.hidden_size, init_method=config.output_layer_init_method)
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
            import torch.distributed as dist

            every = keys.new_empty((keys.numel() * self.ep_size,))
            dist.all_gather_into_tensor(every, keys.contiguous(), group=self.ep_group)
            keys = every
        if token_of.numel() != sum(counts) or keys.numel() != local_map.shape[0]:
            raise SpecError(f"{keys.numel()} row keys for {local_map.shape[0]} tokens "
                            f"and {sum(counts)} expert rows")
        expert_of = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=device) + self.local_expert_offset,
            torch.tensor(counts, device=device))
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
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, attn_mask_type=None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **_unused):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ConfigError("SDPACoreAttention runs without attention dropout")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        """Scaled dot-product attention over ``[b, heads, s, hn]`` views of the inputs."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ConfigError("SDPACoreAttention takes no packed sequences and no attention bias")
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


# --- specs, config, model ---------------------------------------------------------------------

def _moe_submodules(mlp) -> MoESubmodules:
    """The MoESubmodules inside a layer spec's ``mlp`` (a ModuleSpec in 0.16, a partial in 0.19)."""
    subs = getattr(mlp, "submodules", None)
    if subs is None and isinstance(mlp, functools.partial):
        subs = mlp.keywords.get("submodules")
    if not isinstance(subs, MoESubmodules):
        raise ConfigError(f"the layer spec's mlp is not an MoE layer: {mlp!r}")
    return subs


def get_moe_layer_spec(path: PathLike = "bf16", *, num_experts: int, backend: str = "auto",
                       numerics: str = "qwen3", qk_layernorm: bool = True,
                       experts: str = "libalign") -> ModuleSpec:
    """A GPT layer spec (Megatron's local modules, RMSNorm) whose MoE experts run ``path``.

    ``experts="libalign"``: :class:`LibalignGroupedMLP` (probabilities after FC2, the
    sampler's order). ``experts="te_grouped"``: Megatron's ``TEGroupedMLP`` with
    :class:`LibalignGroupedLinear` in its FC1/FC2 slots (Megatron's order: probabilities
    before FC2). ``numerics``: see the module docstring.
    """
    p = gemm.get_path(path)
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if backend not in gemm.BACKENDS:
        raise SpecError(f"backend must be one of {gemm.BACKENDS}, got {backend!r}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                  normalization="RMSNorm"))
    subs = spec.submodules
    moe = _moe_submodules(subs.mlp)
    linear = ModuleSpec(module=LibalignGroupedLinear, params={"path": p, "backend": backend})
    if experts == "libalign":
        moe.experts = ModuleSpec(module=LibalignGroupedMLP, params={"path": p, "backend": backend})
    elif experts == "te_grouped":
        from megatron.core.transformer.moe.experts import TEGroupedMLP
        try:
            from megatron.core.transformer.moe.experts import GroupedMLPSubmodules as _Subs
        except ImportError:  # 0.16: TEGroupedMLP takes MLPSubmodules
            from megatron.core.transformer.mlp import MLPSubmodules as _Subs
        grouped = _Subs(linear_fc1=linear, linear_fc2=linear)
        moe.experts = ModuleSpec(module=TEGroupedMLP, submodules=grouped)
    else:
        raise ConfigError(f"experts must be 'libalign' or 'te_grouped', got {experts!r}")
    moe.shared_experts = None
    if numerics == "qwen3":
        subs.input_layernorm = Qwen3RMSNorm
        subs.pre_mlp_layernorm = Qwen3RMSNorm
        attn = subs.self_attention.submodules
        attn.core_attention = SDPACoreAttention
        if qk_layernorm:
            attn.q_layernorm = Qwen3RMSNorm
            attn.k_layernorm = Qwen3RMSNorm
    return spec


def get_block_spec(path: PathLike = "bf16", *, num_experts: int, num_layers: int,
                   numerics: str = "qwen3", **kwargs) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder block: :func:`get_moe_layer_spec` for every layer, and with
    ``numerics="qwen3"`` a :class:`Qwen3RMSNorm` final norm (Megatron's own otherwise)."""
    layer = get_moe_layer_spec(path, num_experts=num_experts, numerics=numerics, **kwargs)
    if numerics == "megatron":
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=Qwen3RMSNorm)


def _hf_get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_theta(hf_config) -> float:
    """RoPE base of a Hugging Face config (``rope_parameters`` or the older ``rope_theta``)."""
    params = _hf_get(hf_config, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else _hf_get(hf_config, "rope_theta", 10000.0))


def _parallel_ep_size() -> int:
    """The expert-parallel size of Megatron's initialized parallel state (else 1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return int(ps.get_expert_model_parallel_world_size())


def transformer_config_from_hf(hf_config, *, dtype: torch.dtype = torch.bfloat16,
                               **overrides) -> TransformerConfig:
    """A Megatron ``TransformerConfig`` with a Hugging Face Qwen3-MoE config's architecture.

    Every layer MoE (``mlp_only_layers`` empty, ``decoder_sparse_step`` 1), no shared experts,
    no biases, top-k softmax routing (renormalized over the chosen experts when
    ``norm_topk_prob``), no router auxiliary loss, the allgather dispatcher, no fused kernels,
    weights initialized on the CPU. ``expert_model_parallel_size`` is the initialized
    parallel state's (1 without one). ``overrides`` set any other field.
    """
    g = functools.partial(_hf_get, hf_config)
    if g("mlp_only_layers") or int(g("decoder_sparse_step", 1) or 1) != 1:
        raise ConfigError("only all-MoE Qwen3 configs map to this Megatron spec "
                          "(mlp_only_layers empty, decoder_sparse_step 1)")
    rope = g("rope_parameters") or g("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError("only default RoPE maps to Megatron's rope here")
    heads = int(g("num_attention_heads"))
    fields = dict(
        num_layers=int(g("num_hidden_layers")), hidden_size=int(g("hidden_size")),
        num_attention_heads=heads, num_query_groups=int(g("num_key_value_heads") or heads),
        kv_channels=int(g("head_dim") or int(g("hidden_size")) // heads),
        ffn_hidden_size=int(g("intermediate_size") or 4 * int(g("hidden_size"))),
        num_moe_experts=int(g("num_experts")), moe_router_topk=int(g("num_experts_per_tok")),
        moe_ffn_hidden_size=int(g("moe_intermediate_size")),
        moe_router_pre_softmax=not bool(g("norm_topk_prob", True)),
        moe_router_score_function="softmax", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=float(g("rms_norm_eps", 1e-6)), qk_layernorm=True,
        add_bias_linear=False, add_qkv_bias=bool(g("attention_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=float(g("initializer_range", 0.02)),
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        expert_model_parallel_size=_parallel_ep_size(),
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(hf_config, path: PathLike = "bf16", *, backend: str = "auto",
                    numerics: str = "qwen3", experts: str = "libalign", seed: int = 0,
                    device: str | torch.device | None = None, **config_overrides) -> GPTModel:
    """A Megatron ``GPTModel`` shaped like the Hugging Face Qwen3-MoE ``hf_config``.

    Needs Megatron's model-parallel state (see
    :func:`libalign.models.megatron_cpu.single_process_group`). Weights are drawn on the CPU
    under a forked, seeded RNG, then moved to ``device`` (default: CUDA when available) and
    cast to the config's ``params_dtype`` (bf16 by default); layers are bound
    (:func:`bind_layers`) for guided rounding.
    """
    cfg = transformer_config_from_hf(hf_config, **config_overrides)
    block = get_block_spec(path, num_experts=cfg.num_moe_experts, num_layers=cfg.num_layers,
                           numerics=numerics, backend=backend, experts=experts)
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.random.fork_rng(devices=[]), cpu_shims():
        torch.manual_seed(seed)
        model = GPTModel(config=cfg, transformer_layer_spec=block,
                         vocab_size=int(_hf_get(hf_config, "vocab_size")),
                         max_sequence_length=int(_hf_get(hf_config, "max_position_embeddings", 4096)),
                         position_embedding_type="rope", rotary_base=rope_theta(hf_config),
                         share_embeddings_and_output_weights=bool(
                             _hf_get(hf_config, "tie_word_embeddings", False)))
    # as Megatron's Float16Module does: every floating tensor in the training dtype (torch's
    # norms create fp32 weights)
    model = model.to(device=dev, dtype=cfg.params_dtype)
    bind_layers(model)
    return model


# --- finding and steering the experts ---------------------------------------------------------

def moe_layers(model: nn.Module) -> dict[int, MoELayer]:
    """The model's MoE layers by 0-based layer index (Megatron's ``layer_number - 1``)."""
    out = {}
    for m in model.modules():
        if isinstance(m, MoELayer):
            out[int(m.layer_number) - 1] = m
    if not out:
        raise SpecError(f"{type(model).__name__} has no Megatron MoE layers")
    return dict(sorted(out.items()))


def experts_modules(model: nn.Module) -> dict[int, LibalignGroupedMLP]:
    """The :class:`LibalignGroupedMLP` of every MoE layer that has one, by layer index."""
    return {i: m.experts for i, m in moe_layers(model).items()
            if isinstance(m.experts, LibalignGroupedMLP)}


def _linears(model: nn.Module) -> Iterator[tuple[int, LibalignGroupedLinear]]:
    for i, layer in moe_layers(model).items():
        for m in layer.experts.modules():
            if isinstance(m, LibalignGroupedLinear):
                yield i, m


def bind_layers(model: nn.Module) -> None:
    """Tell each :class:`LibalignGroupedMLP` its layer index and its layer's token dispatcher."""
    fix_missing_te()
    for i, layer in moe_layers(model).items():
        if isinstance(layer.experts, LibalignGroupedMLP):
            layer.experts.layer = i
            layer.experts.dispatcher = layer.token_dispatcher


def current_paths(model: nn.Module) -> dict[int, str]:
    """The path name each MoE layer's libalign linears run."""
    return {i: lin.path.name for i, lin in _linears(model)}


def set_path(model: nn.Module, path: PathLike, *, backend: str | None = None,
             layers: Iterable[int] | None = None) -> dict[int, str]:
    """Run ``path`` in the libalign linears of ``layers`` (all MoE layers by default)."""
    p = gemm.get_path(path)
    if backend is not None and backend not in gemm.BACKENDS:
        raise SpecError(f"backend must be one of {gemm.BACKENDS}, got {backend!r}")
    chosen = None if layers is None else {int(x) for x in layers}
    found = False
    for i, lin in _linears(model):
        if chosen is None or i in chosen:
            lin.path = p
            if backend is not None:
                lin.backend = backend
            found = True
    if not found:
        raise SpecError("no libalign expert linears in the chosen layers")
    return current_paths(model)


@contextmanager
def use_path(model: nn.Module, path: PathLike, *, backend: str | None = None) -> Iterator[nn.Module]:
    """:func:`set_path` for the duration of a ``with`` block (the previous paths come back)."""
    before = [(lin, lin.path, lin.backend) for _, lin in _linears(model)]
    try:
        set_path(model, path, backend=backend)
        yield model
    finally:
        for lin, p, be in before:
            lin.path, lin.backend = p, be


def clear_weight_cache(model: nn.Module) -> None:
    """Drop every prepared weight stack (after writing weights through ``.data``)."""
    for _, lin in _linears(model):
        lin.clear_cache()


def set_row_keys(model: nn.Module, keys: torch.Tensor | None) -> None:
    """Name the tokens of the next forward calls for guidance lookup.

    ``keys`` int64 in Megatron's token order (``[s, b]`` flattened; pass ``keys_bs.T`` for a
    ``[b, s]`` batch), ``-1`` for padding; ``None`` clears them.
    """
    flat = None if keys is None else keys.reshape(-1)
    for ex in experts_modules(model).values():
        ex.row_keys = flat


@contextmanager
def use_guidance(model: nn.Module, table: GuidanceTable | None,
                 layers: Iterable[int] | None = None) -> Iterator[GuidanceTable | None]:
    """Round expert activations by ``table``'s records while inside (``nvfp4_trace``).

    Rows with a record are rounded with the sampler's scales and low bits, the others to
    nearest; ``table=None`` rounds every row to nearest through the same hook.
    """
    mods = experts_modules(model)
    chosen = sorted(mods) if layers is None else sorted({int(x) for x in layers})
    bad = [x for x in chosen if x not in mods]
    if bad:
        raise SpecError(f"layers {bad} have no libalign experts; they are {sorted(mods)}")

    def hook(layer, site, a, spec, keys):
        guide = None if table is None else table.lookup(layer, site, keys)
        return guided_quantize(a.detach(), spec, guide)

    for i in chosen:
        mods[i].act_hook = hook
    try:
        yield table
    finally:
        for i in chosen:
            mods[i].act_hook = None


# --- running the model ------------------------------------------------------------------------

def causal_padding_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Megatron's attention mask ``[b, 1, s, s]`` (``True`` = masked): causal, and keys past
    each row's length masked (what Hugging Face's mask does for right padding)."""
    dev = lengths.device
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=dev).triu(1)
    pad = torch.arange(seq_len, device=dev)[None, :] >= lengths[:, None]
    return (causal[None] | pad[:, None, :])[:, None]


def gpt_logits(model: GPTModel, input_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of a Megatron GPT for ``input_ids`` ``[b, s]``.

    ``attention_mask`` is Hugging Face's ``[b, s]`` (1 = token): when it has padding, the
    Megatron mask from :func:`causal_padding_mask` is passed; otherwise none (causal).
    """
    ids = input_ids
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    mask = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        mask = causal_padding_mask(attention_mask.sum(-1), ids.shape[1])
    with cpu_shims():
        return model(ids, pos, mask)
