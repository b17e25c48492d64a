"""Routing replay (R3) on a Megatron-core GPT MoE: the learner routes as the sampler recorded.

The same contract as :mod:`libalign.models.routing_replay` (the Hugging Face side), on
Megatron's router: its ``routing(logits)`` turns ``[tokens, E]`` router logits into dense
``probs`` and a boolean ``routing_map`` (tokens in Megatron's ``[s, b]`` order, named by the
row keys :func:`libalign.models.megatron.set_row_keys` gives the experts modules).
:func:`replay_routing` wraps it per layer instance: Megatron's own routing runs first (its
set of experts per token is compared with the record: :class:`RoutingStats`, before any
forcing), then tokens with a record are routed to the recorded experts:

* ``weights="recompute"`` (R3): tokens whose own set equals the record keep Megatron's output
  bit for bit; the others get the forced experts with probabilities computed from the
  learner's own logits as Megatron's top-k routing computes them for its own choice (softmax
  over the ``k`` gathered logits, or gathered from the softmax over all experts with
  ``moe_router_pre_softmax``; times ``moe_router_topk_scaling_factor`` if set), which is what
  Megatron-core's own ``RouterReplay`` does when it replays indices;
* ``weights="record"``: recorded experts and the sampler's gate weights;
* ``weights="off"``: count only.

Megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) keeps one global list of
routers and replays whole ``[tokens, k]`` index tensors; here each token is looked up by its
key, so padding, rollouts of different lengths and the last token (no record) need no
special layout, and the wrapper leaves nothing installed outside its ``with`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from libalign.errors import SpecError
from libalign.models.megatron import experts_modules, moe_layers
from libalign.models.paths import wrapped_method
from libalign.models.routing_replay import (
    RoutingStats,
    RoutingTable,
    check_replay_mode,
    check_table_fits,
)


def routing_geometry(model: nn.Module) -> dict:
    """``layers`` (0-based MoE layer indices), ``top_k`` and ``num_experts`` of a Megatron GPT."""
    layers = moe_layers(model)
    cfg = next(iter(layers.values())).config
    return {"layers": sorted(layers), "top_k": int(cfg.moe_router_topk),
            "num_experts": int(cfg.num_moe_experts)}


def _keys(model: nn.Module, layer: int, rows: int) -> torch.Tensor:
    ex = experts_modules(model).get(layer)
    keys = getattr(ex, "row_keys", None)
    if keys is None or keys.numel() != rows:
        raise SpecError("routing replay needs the row keys of every token "
                        "(libalign.models.megatron.set_row_keys) and libalign experts")
    return keys


def _forced_probs(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` probabilities of the experts ``index`` as Megatron's top-k routing gives them."""
    cfg = router.config
    if cfg.moe_router_pre_softmax:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, index)
    else:
        probs = torch.softmax(logits.gather(1, index), dim=-1, dtype=torch.float32).type_as(logits)
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return probs


@contextmanager
def replay_routing(model: nn.Module, table: RoutingTable | None, *, weights: str = "recompute",
                   stats: RoutingStats | None = None) -> Iterator[RoutingStats]:
    """Route a Megatron GPT's MoE layers by the sampler's records while inside (module doc)."""
    check_replay_mode(weights)
    stats = stats if stats is not None else RoutingStats()
    if table is None:
        yield stats
        return
    check_table_fits(table, weights, routing_geometry(model))
    routers = {i: layer.router for i, layer in moe_layers(model).items()}

    def make(layer: int, router: nn.Module, original):
        def routing(logits, *args, **kwargs):
            probs, rmap = original(logits, *args, **kwargs)
            flat = logits.reshape(-1, logits.shape[-1])
            present, rec, rec_w = table.lookup(layer, _keys(model, layer, flat.shape[0]))
            rec = rec.to(flat.device)
            rec_map = torch.zeros_like(rmap).scatter(1, rec, True)
            agree = (rec_map == rmap).all(-1)
            force = present & ~agree
            stats.add(layer, present.sum(), force.sum())
            if weights == "off":
                return probs, rmap
            if weights == "record":
                force = present
            if force.device.type == "cpu" and not bool(force.any()):
                return probs, rmap  # (on a GPU the check would wait for the device)
            p = rec_w.to(probs.dtype) if weights == "record" else _forced_probs(router, flat, rec)
            dense = torch.zeros_like(probs).scatter(1, rec, p)
            f = force.unsqueeze(-1)
            return torch.where(f, dense, probs), torch.where(f, rec_map, rmap)
        return routing

    with wrapped_method(routers, "routing", lambda i, original: make(i, routers[i], original)):
        yield stats
