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
A Megatron MoE layer routes with its router, permutes tokens so that rows are sorted by local
expert (its *token dispatcher*), and calls its *experts* module. The modules libalign puts
there (:class:`LibalignGroupedLinear`, :class:`LibalignGroupedMLP`, and the Hugging
Face-order :class:`Qwen3RMSNorm` and :class:`SDPACoreAttention`) are defined, with how they
fit Megatron's slots, in :mod:`libalign.models.megatron_modules`; this module builds the
layer specs, the config and the model from them, and steers a built model (paths, guidance).

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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from libalign import gemm
from libalign.errors import ConfigError, SpecError
from libalign.guidance import GuidanceTable
from libalign.models.megatron_cpu import cpu_shims, fix_missing_te
from libalign.models.megatron_grouped import LibalignColumnGroupedLinear, LibalignRowGroupedLinear
from libalign.models.megatron_modules import (
    LibalignGroupedLinear,
    LibalignGroupedMLP,
    MegatronActivationHook,
    PathLike,
    Qwen3RMSNorm,
    SDPACoreAttention,
    global_expert_index,
)

__all__ = [  # the modules are megatron_modules', re-exported
    "EXPERT_WEIGHTS",
    "NUMERICS",
    "LibalignGroupedLinear",
    "LibalignGroupedMLP",
    "MegatronActivationHook",
    "PathLike",
    "Qwen3RMSNorm",
    "SDPACoreAttention",
    "bind_layers",
    "build_gpt_model",
    "causal_padding_mask",
    "clear_weight_cache",
    "current_paths",
    "experts_modules",
    "get_block_spec",
    "get_moe_layer_spec",
    "global_expert_index",
    "gpt_logits",
    "hf_config_value",
    "moe_layers",
    "moe_submodules",
    "rope_theta",
    "set_finite_check",
    "set_path",
    "set_row_keys",
    "transformer_config_from_hf",
    "use_guidance",
    "use_path",
    "use_qwen3_numerics",
]

NUMERICS = ("qwen3", "megatron")
EXPERT_WEIGHTS = ("stack", "per_expert")


# --- specs, config, model ---------------------------------------------------------------------

def moe_submodules(mlp) -> MoESubmodules:
    """The MoESubmodules inside a layer spec's ``mlp`` (a ModuleSpec in 0.16, a partial in 0.19)."""
    subs = getattr(mlp, "submodules", None)
    if subs is None and isinstance(mlp, functools.partial):
        subs = mlp.keywords.get("submodules")
    if not isinstance(subs, MoESubmodules):
        raise ConfigError(f"the layer spec's mlp is not an MoE layer: {mlp!r}")
    return subs


def get_moe_layer_spec(path: PathLike = "bf16", *, num_experts: int, backend: str = "auto",
                       numerics: str = "qwen3", qk_layernorm: bool = True,
                       experts: str = "libalign", expert_weights: str = "stack") -> ModuleSpec:
    """A GPT layer spec (Megatron's local modules, RMSNorm) whose MoE experts run ``path``.

    ``experts="libalign"``: :class:`LibalignGroupedMLP` (probabilities after FC2, the
    sampler's order). ``experts="te_grouped"``: Megatron's ``TEGroupedMLP`` with
    libalign's grouped linears in its FC1/FC2 slots (Megatron's order: probabilities
    before FC2). ``expert_weights="stack"``: :class:`LibalignGroupedLinear` (one ``[E, N, K]``
    parameter); ``"per_expert"``: :mod:`libalign.models.megatron_grouped`'s
    (``weight0 .. weight{E-1}``, Transformer Engine's names; the same bits).
    ``numerics``: see the module docstring.
    """
    p = gemm.get_path(path)
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if backend not in gemm.BACKENDS:
        raise SpecError(f"backend must be one of {gemm.BACKENDS}, got {backend!r}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                  normalization="RMSNorm"))
    subs = spec.submodules
    moe = moe_submodules(subs.mlp)
    if expert_weights not in EXPERT_WEIGHTS:
        raise ConfigError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    classes = (LibalignGroupedLinear, LibalignGroupedLinear)
    if expert_weights == "per_expert":
        classes = (LibalignColumnGroupedLinear, LibalignRowGroupedLinear)
    params = {"path": p, "backend": backend}
    fc1, fc2 = (ModuleSpec(module=c, params=dict(params)) for c in classes)
    if experts == "libalign":
        moe.experts = ModuleSpec(module=LibalignGroupedMLP, params={**params, "linears": classes})
    elif experts == "te_grouped":
        from megatron.core.transformer.moe.experts import TEGroupedMLP
        try:
            from megatron.core.transformer.moe.experts import GroupedMLPSubmodules as _Subs
        except ImportError:  # 0.16: TEGroupedMLP takes MLPSubmodules
            from megatron.core.transformer.mlp import MLPSubmodules as _Subs
        grouped = _Subs(linear_fc1=fc1, linear_fc2=fc2)
        moe.experts = ModuleSpec(module=TEGroupedMLP, submodules=grouped)
    else:
        raise ConfigError(f"experts must be 'libalign' or 'te_grouped', got {experts!r}")
    moe.shared_experts = None
    if numerics == "qwen3":
        use_qwen3_numerics(spec)
    return spec


def use_qwen3_numerics(layer_spec: ModuleSpec) -> ModuleSpec:
    """Fill a local (non-Transformer-Engine) layer spec's norms with :class:`Qwen3RMSNorm`
    and its core attention with :class:`SDPACoreAttention`, in place (Hugging Face's order;
    the Q/K norms only where the spec has them). Also the local spec's way to sequence
    parallelism: Megatron's torch norm refuses it, :class:`Qwen3RMSNorm` marks its weight."""
    subs = layer_spec.submodules
    subs.input_layernorm = Qwen3RMSNorm
    subs.pre_mlp_layernorm = Qwen3RMSNorm
    attn = subs.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if getattr(attn, "q_layernorm", None) is not None:
        attn.q_layernorm = Qwen3RMSNorm
    if getattr(attn, "k_layernorm", None) is not None:
        attn.k_layernorm = Qwen3RMSNorm
    return layer_spec


def get_block_spec(path: PathLike = "bf16", *, num_experts: int, num_layers: int,
                   numerics: str = "qwen3", **kwargs) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder block: :func:`get_moe_layer_spec` for every layer, and with
    ``numerics="qwen3"`` a :class:`Qwen3RMSNorm` final norm (Megatron's own otherwise)."""
    layer = get_moe_layer_spec(path, num_experts=num_experts, numerics=numerics, **kwargs)
    if numerics == "megatron":
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=Qwen3RMSNorm)


def hf_config_value(cfg, key, default=None):
    """``cfg[key]`` of a Hugging Face config given as a dict (``config.json``) or an object."""
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_theta(hf_config) -> float:
    """RoPE base of a Hugging Face config (``rope_parameters`` or the older ``rope_theta``)."""
    params = hf_config_value(hf_config, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else hf_config_value(hf_config, "rope_theta", 10000.0))


def _parallel_sizes() -> dict[str, int]:
    """The tensor-, expert- and expert-tensor-parallel sizes of Megatron's initialized parallel
    state (else 1)."""
    ps = parallel_state
    if not ps.model_parallel_is_initialized():
        return {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": 1}
    return {"tensor_model_parallel_size": int(ps.get_tensor_model_parallel_world_size()),
            "expert_model_parallel_size": int(ps.get_expert_model_parallel_world_size()),
            "expert_tensor_parallel_size": int(ps.get_expert_tensor_parallel_world_size())}


def transformer_config_from_hf(hf_config, *, dtype: torch.dtype = torch.bfloat16,
                               **overrides) -> TransformerConfig:
    """A Megatron ``TransformerConfig`` with a Hugging Face Qwen3-MoE config's architecture.

    Every layer MoE (``mlp_only_layers`` empty, ``decoder_sparse_step`` 1), no shared experts,
    no biases, top-k softmax routing (renormalized over the chosen experts when
    ``norm_topk_prob``), no router auxiliary loss, the allgather dispatcher, no fused kernels,
    weights initialized on the CPU. The tensor-, expert- and expert-tensor-parallel sizes are
    the initialized parallel state's (1 without one); sequence parallelism is on with tensor
    parallelism (Megatron's MoE layer trains tensor-parallel only with it).
    ``overrides`` set any other field.
    """
    g = functools.partial(hf_config_value, hf_config)
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
        **_parallel_sizes(),
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    # Megatron's MoE layer refuses to train tensor-parallel without sequence parallelism
    fields["sequence_parallel"] = fields["tensor_model_parallel_size"] > 1
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(hf_config, path: PathLike = "bf16", *, backend: str = "auto",
                    numerics: str = "qwen3", experts: str = "libalign",
                    expert_weights: str = "stack", seed: int = 0,
                    device: str | torch.device | None = None, **config_overrides) -> GPTModel:
    """A Megatron ``GPTModel`` shaped like the Hugging Face Qwen3-MoE ``hf_config``.

    Needs Megatron's model-parallel state (see
    :func:`libalign.models.megatron_cpu.single_process_group`). Weights are drawn on the CPU
    under a forked, seeded RNG, then moved to ``device`` (default: CUDA when available) and
    cast to the config's ``params_dtype`` (bf16 by default); layers are bound
    (:func:`bind_layers`) for guided rounding. ``experts``, ``expert_weights``: see
    :func:`get_moe_layer_spec`.
    """
    cfg = transformer_config_from_hf(hf_config, **config_overrides)
    block = get_block_spec(path, num_experts=cfg.num_moe_experts, num_layers=cfg.num_layers,
                           numerics=numerics, backend=backend, experts=experts,
                           expert_weights=expert_weights)
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.random.fork_rng(devices=[]), cpu_shims():
        torch.manual_seed(seed)
        model = GPTModel(config=cfg, transformer_layer_spec=block,
                         vocab_size=int(hf_config_value(hf_config, "vocab_size")),
                         max_sequence_length=int(hf_config_value(hf_config, "max_position_embeddings", 4096)),
                         position_embedding_type="rope", rotary_base=rope_theta(hf_config),
                         share_embeddings_and_output_weights=bool(
                             hf_config_value(hf_config, "tie_word_embeddings", False)))
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


def set_finite_check(model: nn.Module, on: bool) -> None:
    """Whether the expert GEMMs check their activations for NaN/Inf on every call.

    On (the default), a NaN/Inf activation raises :class:`~libalign.errors.NonFiniteError` at
    its GEMM, at the price of one device synchronisation per call on the Triton backend:
    each one drains the stream the host had queued ahead (two per MoE layer's forward),
    unless the step runs inside :func:`libalign.gemm.finite_checks.deferred_finite_checks` (as
    the learner's does), where the checks are read once, when the block ends.
    Off, such rows come out NaN, which a training loop's NaN loss or gradient-norm check
    then sees (Megatron skips such steps); the bits of finite inputs are the same.
    """
    for _, lin in _linears(model):
        lin.check_finite = bool(on)


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
    for m in model.modules():  # FP4 KV guidance names K/V rows by them too
        if isinstance(m, SDPACoreAttention):
            m.row_keys = flat


@contextmanager
def use_guidance(model: nn.Module, table: GuidanceTable | None,
                 layers: Iterable[int] | None = None) -> Iterator[GuidanceTable | None]:
    """Round expert activations by ``table``'s records while inside (``nvfp4_trace``).

    Rows with a record are rounded with the sampler's scales and low bits, the others to
    nearest: the hook hands the GEMM the rows' records (:class:`~libalign.guidance.RowGuide`),
    which :func:`libalign.gemm.grouped_linear` applies (in the Triton activation pass where
    fused guidance is on). A site without records (or ``table=None``) runs the path's own
    round-to-nearest activation pass: the bits :func:`~libalign.guidance.guided_quantize`
    gives without a guide.
    """
    mods = experts_modules(model)
    chosen = sorted(mods) if layers is None else sorted({int(x) for x in layers})
    bad = [x for x in chosen if x not in mods]
    if bad:
        raise SpecError(f"layers {bad} have no libalign experts; they are {sorted(mods)}")

    def hook(layer, site, a, spec, keys):
        return None if table is None else table.lookup(layer, site, keys)

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
