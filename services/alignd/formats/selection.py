"""Which tensors of a checkpoint the converter quantizes.

By default only the experts of Mixture-of-Experts layers, the weights whose GEMMs the
sampler runs in NVFP4:

* per-expert 2-D linear weights ``...experts.<i>.{gate,up,down}_proj.weight`` (and
  Mixtral's ``...experts.<i>.w{1,2,3}.weight``), ``[N, K]`` with K the reduction axis;
* 3-D expert stacks, any 3-D tensor under an ``experts`` module (for example
  ``...mlp.experts.gate_up_proj``), taken as ``[E, N, K]`` with K last.

With ``all_linear`` every other 2-D ``*.weight`` of a linear layer is quantized too,
except embeddings, the LM head, norms and MoE routers (``...mlp.gate.weight``,
``*router*``), which NVFP4 checkpoints keep in high precision. Selection looks at names
and ranks only, not dtypes: an integer tensor named like an expert weight is selected and
then refused by the quantizer with a typed error, rather than silently copied.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

EXPERT_2D = re.compile(r"(?:^|\.)experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
UNDER_EXPERTS = re.compile(r"(?:^|\.)experts(?:\.|$)")
NOT_LINEAR = re.compile(r"embed|lm_head|norm|router|(?:^|\.)gate\.weight$")


def is_expert_weight(name: str, t: torch.Tensor) -> bool:
    """A per-expert 2-D projection weight or a 3-D expert stack."""
    if t.ndim == 2:
        return EXPERT_2D.search(name) is not None
    return t.ndim == 3 and UNDER_EXPERTS.search(name) is not None


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    """A 2-D ``*.weight`` of a linear layer (not an embedding, head, norm or router)."""
    return t.ndim == 2 and name.endswith(".weight") and NOT_LINEAR.search(name) is None


def make_select(all_linear: bool = False) -> Callable[[str, torch.Tensor], bool]:
    """The predicate handed to WeightStore.write_version."""
    if all_linear:
        return lambda name, t: is_expert_weight(name, t) or is_linear_weight(name, t)
    return is_expert_weight
