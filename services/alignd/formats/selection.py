"""Which tensors of a checkpoint get quantized: the one expert-selection policy.

Both writers use it: the weight store (a published version converted for a sampler) and the
Hugging Face export (``alignd convert``, the SGLang export). By default only the experts of
Mixture-of-Experts layers, the weights whose GEMMs the sampler runs in NVFP4:

* per-expert 2-D projections ``...experts.<i>.{gate,up,down}_proj.weight`` (Qwen3-MoE) and
  Mixtral's ``...experts.<i>.w{1,2,3}.weight``, ``[N, K]`` with K the reduction axis;
* 3-D expert stacks, any 3-D tensor under an ``experts`` module (for example
  ``...mlp.experts.gate_up_proj``), taken as ``[E, N, K]`` with K last. The weight store takes
  them all; a Hugging Face export takes those it can name per expert (:data:`STACK_NAMES`,
  split into ``...experts.<e>.<proj>`` weights, the formats being per-expert 2-D) and copies
  any other stack unchanged.

With ``all_linear`` every other 2-D ``*.weight`` of a linear layer is quantized too, except
the modules NVFP4 checkpoints keep in high precision (:func:`is_never_quantized`):
embeddings (``*embed*``, GPT-2's ``wte``/``wpe``), ``lm_head``, norms and MoE routers
(``...mlp.gate``, ``shared_expert_gate``, ``*router*``). Names are matched by their dotted
module parts, so ``gate_proj`` is a projection and ``gate`` a router.

The weight store selects by name and rank only, not dtype: an integer tensor named like an
expert weight is selected and then refused by the quantizer with a typed error, rather than
silently stored raw. The export checks dtype and shape up front (:func:`select_for_export`),
since it plans every output shard before reading a tensor.

Fused siblings
    Samplers fuse ``gate_proj`` with ``up_proj`` (Mixtral's ``w1``/``w3``) and
    ``q/k/v_proj`` into one GEMM with one outer scale; :func:`fused_groups` names those groups
    among the tensors chosen for conversion.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from alignclient.errors import DTypeError, LayoutError, ShapeError

from alignd.formats.hf_checkpoint import SourceTensor

#: Per-expert projections: Qwen3-MoE names, and Mixtral's w1 (gate), w3 (up), w2 (down).
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
EXPERT_2D = re.compile(r"(?:^|\.)experts\.\d+\.(?:" + "|".join(EXPERT_PROJS) + r")\.weight$")
UNDER_EXPERTS = re.compile(r"(?:^|\.)experts(?:\.|$)")
#: Last module part of a router (the MoE gate, Qwen2-MoE's shared-expert gate).
ROUTER_NAMES = ("gate", "shared_expert_gate")
#: Last names of 3-D expert stacks an export splits per expert (``gate_up_proj``: gate rows
#: first, then up, as transformers 5 stacks them).
STACK_NAMES = ("gate_up_proj", *EXPERT_PROJS)
#: safetensors dtype codes the export quantizes (anything else is copied, or refused if an expert).
QUANTIZABLE = ("BF16", "F16", "F32")
#: Sibling projections a sampler fuses into one GEMM with one outer scale.
FUSED_SIBLINGS: dict[str, str] = {
    "gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up",
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
}

Select = Callable[[str, torch.Tensor], bool]


def module_parts(name: str) -> list[str]:
    """Dotted parts of a tensor's module: ``"a.b.weight"`` -> ``["a", "b"]``."""
    return name.removesuffix(".weight").split(".")


def is_expert_weight(name: str, t: torch.Tensor | None = None) -> bool:
    """A routed expert's weight: a per-expert 2-D projection, or a 3-D stack under ``experts``.

    Without ``t`` the name alone decides, which recognises the per-expert projections
    (``...experts.<i>.<proj>.weight``); with ``t`` its rank decides too (a projection is 2-D,
    a stack 3-D).
    """
    if t is None or t.ndim == 2:
        return EXPERT_2D.search(name) is not None
    return t.ndim == 3 and UNDER_EXPERTS.search(name) is not None


def is_embedding(name: str) -> bool:
    """A token or position embedding (``*embed*``, ``wte``, ``wpe``)."""
    return any("embed" in c or c in ("wte", "wpe") for c in module_parts(name))


def is_never_quantized(name: str) -> bool:
    """Embeddings, ``lm_head``, norms and routers: always kept in their source dtype."""
    p = module_parts(name)
    if is_embedding(name) or "lm_head" in p or any("norm" in c for c in p):
        return True
    return p[-1] in ROUTER_NAMES or any("router" in c for c in p)


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    """A 2-D ``*.weight`` of a linear layer (not an embedding, head, norm or router)."""
    return t.ndim == 2 and name.endswith(".weight") and not is_never_quantized(name)


def make_select(all_linear: bool = False) -> Select:
    """The predicate handed to ``WeightStore.write_version``."""
    if all_linear:
        return lambda name, t: is_expert_weight(name, t) or is_linear_weight(name, t)
    return is_expert_weight


def select_for_export(tensors: Mapping[str, SourceTensor], all_linear: bool,
                      block: int = 16) -> tuple[list[str], list[str]]:
    """Tensors a Hugging Face export converts, and the modules it names as excluded.

    3-D expert stacks named in :data:`STACK_NAMES`, floating and with K a multiple of the
    block, are converted (split per expert by the export); any other stack is copied.
    Expert projections must be 2-D floating tensors with K a multiple of the block (16;
    MXFP4 32) (else :class:`ShapeError` / :class:`DTypeError` naming the tensor); under
    ``all_linear`` a linear weight whose K is not a multiple of it is kept unquantized and
    listed as excluded,
    like every linear-like weight that is not converted (embeddings are not listed).
    """
    convert, excluded = [], []
    for name, t in sorted(tensors.items()):
        if (len(t.shape) == 3 and UNDER_EXPERTS.search(name) and t.dtype in QUANTIZABLE
                and module_parts(name)[-1] in STACK_NAMES and t.shape[-1] % block == 0):
            convert.append(name)  # an expert stack, split per expert in the output
            continue
        if not name.endswith(".weight"):
            continue
        if is_expert_weight(name):
            if len(t.shape) != 2:
                raise ShapeError(f"{name}: expert weights are 2-D, got shape {t.shape}")
            if t.dtype not in QUANTIZABLE:
                raise DTypeError(f"{name}: expert weights must be bf16, fp16 or fp32 to "
                                 f"convert, got {t.dtype}")
            if t.shape[1] % block:
                raise ShapeError(f"{name}: K={t.shape[1]} is not a multiple of {block}")
            convert.append(name)
            continue
        linear_like = len(t.shape) == 2 and t.dtype in QUANTIZABLE
        if not linear_like or is_embedding(name):
            continue
        if all_linear and not is_never_quantized(name) and t.shape[1] % block == 0:
            convert.append(name)
        else:
            excluded.append(name.removesuffix(".weight"))
    return convert, excluded


def fused_groups(names: list[str]) -> dict[str, list[str]]:
    """Groups (of two or more of ``names``) that a sampler fuses: ``module:kind`` -> members."""
    groups: dict[str, list[str]] = {}
    for name in names:
        p = module_parts(name)
        kind = FUSED_SIBLINGS.get(p[-1])
        if kind is not None:
            groups.setdefault(".".join(p[:-1]) + ":" + kind, []).append(name)
    return {k: sorted(v) for k, v in groups.items() if len(v) > 1}


def stack_members(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, slice | None]]:
    """The per-expert weights of 3-D expert stack ``name`` ``[E, N, K]``: ``(weight name,
    expert, rows)`` in order, ``rows`` the stack rows of a split ``gate_up_proj`` (gate rows
    first, then up) and None for a whole expert. LayoutError for a stack of another name."""
    prefix, _, last = name.rpartition(".")
    if last not in STACK_NAMES or not prefix or len(shape) != 3:
        raise LayoutError(f"tensor {name!r} ({tuple(shape)}) is not a 3-D stack with a "
                          f"per-expert name (known: {', '.join(STACK_NAMES)})")
    e, n = shape[0], shape[1]
    out: list[tuple[str, int, slice | None]] = []
    for x in range(e):
        if last == "gate_up_proj":
            out += [(f"{prefix}.{x}.gate_proj.weight", x, slice(0, n // 2)),
                    (f"{prefix}.{x}.up_proj.weight", x, slice(n // 2, n))]
        else:
            out.append((f"{prefix}.{x}.{last}.weight", x, None))
    return out
