"""How two paths' top-k expert choices agree at one MoE layer.

In an MoE layer each token picks its top-k experts. Two paths (learner and sampler, or BF16 and
NVFP4) can pick different experts for the same token, after which their outputs differ by far
more than rounding. For top-k index tensors ``[T, k]`` from the two paths at one layer:

* set match: the fraction of tokens whose two top-k *sets* are identical (order ignored);
  its complement is the routing disagreement;
* mean overlap ``|A ∩ B| / k`` and mean Jaccard ``|A ∩ B| / |A ∪ B|`` per token;
* top-1 agreement: the first column is the highest-scoring expert (``torch.topk`` order), and
  this is the fraction of tokens whose first choices agree.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from libalign.arg_checks import check_same_shape
from libalign.errors import DTypeError, InputError, ShapeError


@dataclass(frozen=True)
class RoutingAgreement:
    """How two paths' top-k expert choices agree at one layer (fractions over tokens)."""

    tokens: int
    k: int
    set_match: float
    mean_overlap: float
    mean_jaccard: float
    top1_agreement: float

    @property
    def disagreement(self) -> float:
        """Fraction of tokens whose top-k sets differ: ``1 − set_match``."""
        return 1.0 - self.set_match

    def to_dict(self) -> dict:
        """Plain JSON-ready dict, with the disagreement."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["disagreement"] = self.disagreement
        return out


def _check_topk(idx, name: str, num_experts: int | None) -> None:
    if not isinstance(idx, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise DTypeError(f"{name} must be an integer tensor of expert indices, got {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ShapeError(f"{name} must be [T, k] with T ≥ 1 and k ≥ 1, got shape {tuple(idx.shape)}")
    invalid = idx < 0
    if num_experts is not None:
        invalid |= idx >= num_experts
    if bool(invalid.any()):
        t, j = invalid.nonzero()[0].tolist()
        limit = f"[0, {num_experts})" if num_experts is not None else "≥ 0"
        raise InputError(f"{name} has expert index {int(idx[t, j])} at (token {t}, slot {j}); "
                         f"indices must be {limit}")
    s = idx.sort(dim=1).values
    dup = s[:, 1:] == s[:, :-1]
    if bool(dup.any()):
        t, j = dup.nonzero()[0].tolist()
        raise InputError(f"{name} picks expert {int(s[t, j])} twice for token {t}; top-k indices "
                         "must be distinct")


def routing_agreement(idx_a: torch.Tensor, idx_b: torch.Tensor, *,
                      num_experts: int | None = None, where: str = "") -> RoutingAgreement:
    """Agreement of two ``[T, k]`` top-k expert index tensors (columns in descending score order).

    Indices must be distinct per token and non-negative (below ``num_experts`` when given).
    ``where`` prefixes error messages (the per-layer helper passes the layer).
    """
    prefix = f"{where}: " if where else ""
    _check_topk(idx_a, f"{prefix}idx_a", num_experts)
    _check_topk(idx_b, f"{prefix}idx_b", num_experts)
    check_same_shape(idx_a, idx_b, f"{prefix}idx_a", f"{prefix}idx_b")
    a = idx_a.detach().to(torch.int64)
    b = idx_b.detach().to(device=a.device, dtype=torch.int64)
    t, k = a.shape
    inter = (a.unsqueeze(2) == b.unsqueeze(1)).sum((1, 2)).to(torch.float64)
    return RoutingAgreement(
        tokens=t, k=k,
        set_match=float((inter == k).to(torch.float64).mean()),
        mean_overlap=float((inter / k).mean()),
        mean_jaccard=float((inter / (2 * k - inter)).mean()),
        top1_agreement=float((a[:, 0] == b[:, 0]).to(torch.float64).mean()),
    )


def routing_agreement_by_layer(
    layers_a: Mapping[Hashable, torch.Tensor] | Sequence[torch.Tensor],
    layers_b: Mapping[Hashable, torch.Tensor] | Sequence[torch.Tensor],
    *, num_experts: int | None = None,
) -> dict[Hashable, RoutingAgreement]:
    """:func:`routing_agreement` for every layer; lists are keyed by position, dicts by key.

    Both sides must name the same layers; a layer present on one side only is an InputError.
    """
    da = dict(layers_a) if isinstance(layers_a, Mapping) else dict(enumerate(layers_a))
    db = dict(layers_b) if isinstance(layers_b, Mapping) else dict(enumerate(layers_b))
    only_a = [k for k in da if k not in db]
    only_b = [k for k in db if k not in da]
    if only_a or only_b:
        raise InputError(f"layers differ: only in layers_a {only_a}, only in layers_b {only_b}")
    if not da:
        raise InputError("no layers given")
    return {key: routing_agreement(da[key], db[key], num_experts=num_experts, where=f"layer {key}")
            for key in da}
