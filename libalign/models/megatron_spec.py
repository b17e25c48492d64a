"""A ``--spec`` for slime and Miles: Megatron's own GPT block with libalign's expert GEMM.

How slime loads a spec
----------------------
slime (``slime/backends/megatron_utils/model_provider.py``, THUDM/slime) builds its actor with
``--spec MODULE NAME``: Megatron's ``import_module((MODULE, NAME))`` fetches the attribute, and
when it is callable slime calls it as ``NAME(args, config, vp_stage)`` (``args`` its parsed
arguments, ``config`` the ``TransformerConfig`` built from them, ``vp_stage`` the virtual
pipeline stage or ``None``) and builds ``GPTModel(config, transformer_layer_spec=result, ...)``.
Miles (radixark/miles) keeps the same provider. This module holds such callables, one per
execution path, so the whole set-up is one flag::

    --spec libalign.models.megatron_spec nvfp4_minite

What the spec is
----------------
:func:`make_spec` builds the block Megatron would build without ``--spec``
(``get_gpt_decoder_block_spec(config, use_transformer_engine=args.transformer_impl ==
"transformer_engine", vp_stage=...)``: attention, norms, router, token dispatcher and
shared experts exactly as the user configured them) and changes one thing,
:func:`use_libalign_experts`: every MoE layer's routed experts run libalign's grouped GEMM on
the chosen path.

* ``experts="te_grouped"`` (default): Megatron's ``TEGroupedMLP`` with
  :class:`~libalign.models.megatron_grouped.LibalignColumnGroupedLinear` /
  :class:`~libalign.models.megatron_grouped.LibalignRowGroupedLinear` in its FC1/FC2 slots:
  Transformer Engine's parameter names (``mlp.experts.linear_fc1.weight{i}``), so slime's and
  Miles' weight sync and ``megatron_to_hf`` converters and Megatron's distributed checkpoints
  see what they see with Transformer Engine. Megatron's order: the router probability
  multiplies FC2's input.
* ``experts="libalign"``: :class:`~libalign.models.megatron_modules.LibalignGroupedMLP` with
  the same per-expert linears (same names): the sampler's order, the probability multiplying
  FC2's output, and guided rounding (``nvfp4_trace`` records, after
  :func:`libalign.models.megatron.bind_layers` on the built model).

Shared experts stay Megatron's (``SharedExpertMLP`` with its dense, tensor-parallel linears,
in bf16). Token dispatchers: ``allgather`` and ``alltoall`` run anywhere (on the CPU through
:mod:`libalign.models.megatron_cpu`); ``flex`` needs DeepEP (or HybridEP) kernels on CUDA
devices and is refused with a :class:`~libalign.errors.ConfigError` naming the option where
they are missing. Guided rounding needs the ``allgather`` dispatcher (it learns each row's
token from it). Expert tensor parallelism is refused
(:func:`~libalign.models.megatron_grouped.check_expert_tensor_parallel`); dense tensor,
pipeline and expert parallelism are Megatron's.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable

import torch

try:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron_spec needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from libalign import gemm
from libalign.errors import ConfigError, SpecError
from libalign.models.megatron import NUMERICS, moe_submodules, use_qwen3_numerics
from libalign.models.megatron_grouped import (
    LibalignColumnGroupedLinear,
    LibalignRowGroupedLinear,
    check_expert_tensor_parallel,
)
from libalign.models.megatron_modules import LibalignGroupedMLP, PathLike, Qwen3RMSNorm

__all__ = [
    "DISPATCHERS",
    "EXPERTS",
    "bf16",
    "check_config",
    "make_spec",
    "nvfp4_minite",
    "nvfp4_naive",
    "nvfp4_trace",
    "use_libalign_experts",
]

EXPERTS = ("te_grouped", "libalign")
DISPATCHERS = ("allgather", "alltoall", "flex")


def _grouped_submodules(fc1, fc2):
    try:
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules as Subs
    except ImportError:  # 0.16: TEGroupedMLP takes MLPSubmodules
        from megatron.core.transformer.mlp import MLPSubmodules as Subs
    return Subs(linear_fc1=fc1, linear_fc2=fc2)


def _layer_specs(spec) -> list[ModuleSpec]:
    if isinstance(spec, TransformerBlockSubmodules):
        return list(spec.layer_specs)
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return list(spec.submodules.layer_specs)
    if isinstance(spec, ModuleSpec):
        return [spec]
    raise ConfigError(f"not a Megatron layer or block spec: {type(spec).__name__}")


def use_libalign_experts(spec, path: PathLike = "bf16", *, backend: str = "auto",
                         experts: str = "te_grouped"):
    """A copy of ``spec`` (a block or layer spec) whose MoE layers' routed experts run
    libalign's grouped GEMM on ``path`` (module docstring); dense layers are left alone."""
    p = gemm.get_path(path)
    if backend not in gemm.BACKENDS:
        raise SpecError(f"backend must be one of {gemm.BACKENDS}, got {backend!r}")
    if experts not in EXPERTS:
        raise ConfigError(f"experts must be one of {EXPERTS}, got {experts!r}")
    spec = copy.deepcopy(spec)
    params = {"path": p, "backend": backend}
    found = 0
    for layer in _layer_specs(spec):
        mlp = getattr(layer.submodules, "mlp", None)
        try:
            moe = moe_submodules(mlp)
        except ConfigError:
            continue  # a dense layer
        found += 1
        fc1 = ModuleSpec(module=LibalignColumnGroupedLinear, params=dict(params))
        fc2 = ModuleSpec(module=LibalignRowGroupedLinear, params=dict(params))
        if experts == "te_grouped":
            moe.experts = ModuleSpec(module=TEGroupedMLP, submodules=_grouped_submodules(fc1, fc2))
        else:
            moe.experts = ModuleSpec(module=LibalignGroupedMLP, params={
                **params, "linears": (LibalignColumnGroupedLinear, LibalignRowGroupedLinear)})
    if not found:
        raise ConfigError("the spec has no MoE layer (set --num-experts)")
    return spec


def check_config(config: TransformerConfig, *, experts: str = "te_grouped") -> None:
    """Refuse, by the option's name, what libalign's experts cannot run under ``config``."""
    check_expert_tensor_parallel(getattr(config, "expert_tensor_parallel_size", 1) or 1)
    kind = config.moe_token_dispatcher_type
    if kind not in DISPATCHERS:
        raise ConfigError(f"moe_token_dispatcher_type must be one of {DISPATCHERS}, got {kind!r}")
    if kind == "flex":
        backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
        module = {"deepep": "deep_ep", "hybridep": "deep_ep"}.get(backend, backend)
        if not torch.cuda.is_available() or importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"--moe-token-dispatcher-type flex (backend {backend!r}) needs CUDA devices and "
                f"the {module!r} package, which this process lacks; use "
                "--moe-token-dispatcher-type alltoall (or allgather)")
    if config.add_bias_linear:
        raise ConfigError("libalign's expert GEMM has no bias: set --disable-bias-linear")
    if experts == "libalign" and not config.gated_linear_unit:
        raise ConfigError("experts='libalign' runs gated experts: set --swiglu")


def make_spec(path: PathLike = "bf16", *, backend: str = "auto", experts: str = "te_grouped",
              numerics: str = "megatron") -> Callable[..., TransformerBlockSubmodules]:
    """``spec(args, config, vp_stage=None)`` as slime's ``--spec`` calls it (module docstring).

    ``numerics="qwen3"`` (local spec only, ``--transformer-impl local``) also fills the norms
    and core attention with Hugging Face's order
    (:func:`~libalign.models.megatron.use_qwen3_numerics`); it is the local spec's way to
    sequence parallelism, which Megatron's torch norm refuses.
    """
    gemm.get_path(path)
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {NUMERICS}, got {numerics!r}")

    def spec(args, config: TransformerConfig, vp_stage: int | None = None):
        check_config(config, experts=experts)
        use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
        if numerics == "qwen3" and use_te:
            raise ConfigError("numerics='qwen3' fills the local spec: use --transformer-impl local")
        if config.sequence_parallel and not use_te and numerics != "qwen3":
            raise ConfigError("--sequence-parallel on the local spec needs numerics='qwen3' "
                              "(Megatron's torch norm refuses it) or --transformer-impl "
                              "transformer_engine")
        kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, **kwargs)
        block = use_libalign_experts(block, path, backend=backend, experts=experts)
        if numerics == "qwen3":
            for layer in block.layer_specs:
                use_qwen3_numerics(layer)
            block.layer_norm = Qwen3RMSNorm
        return block

    spec.__name__ = spec.__qualname__ = str(getattr(path, "name", path))
    spec.__doc__ = f"slime's --spec provider: Megatron's block, experts on {spec.__name__}."
    return spec


# --spec libalign.models.megatron_spec <path>
bf16 = make_spec("bf16")
nvfp4_naive = make_spec("nvfp4_naive")
nvfp4_minite = make_spec("nvfp4_minite")
nvfp4_trace = make_spec("nvfp4_trace")
