"""Routing replay (R3) on a Megatron-core GPT MoE, at the ``TopKRouter``: any expert module.

The same contract as :mod:`libalign.models.routing_replay` (the Hugging Face side), on
Megatron's router. Replay sits where Megatron-core's own ``RouterReplay``
(``megatron/core/transformer/moe/router_replay.py``, ``moe_enable_routing_replay``) sits: the
router's ``router_replay`` slot, which ``topk_routing_with_score_function`` asks for the top-k
(``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``) before it
turns the choice into probabilities and a routing map. Everything after the router (token
dispatcher, experts: Megatron's ``SequentialMLP``, ``TEGroupedMLP``, libalign's own) sees an
ordinary routing, so replay works with any expert implementation.

Which token is which
    Tokens reach the router in Megatron's ``[s, b]`` order. :func:`set_router_keys` names them
    (int64 keys of :func:`libalign.guidance.row_keys`, ``-1`` for padding) on every router; a
    model with libalign experts may instead name them with
    :func:`libalign.models.megatron.set_row_keys`, which the routers fall back to. A token is
    looked up by its key, so padding, rollouts of different lengths and the last token (no
    record) need no special layout.

Replay (:func:`replay_routing`)
    Megatron's own top-k runs first; its set of experts per token is compared with the record
    (:class:`~libalign.models.routing_replay.RoutingStats`, before any forcing). Then:

    * ``weights="recompute"`` (R3): a token whose own set equals the record keeps Megatron's
      own choice, bit for bit; the others get the recorded ids *in the record's slot order*,
      with their scores gathered from the router's own scores, from which Megatron computes
      the probabilities as for its own choice (softmax over the ``k`` gathered logits, or the
      gathered softmax with ``moe_router_pre_softmax``; sigmoid normalised; times
      ``moe_router_topk_scaling_factor``): what Megatron-core's ``RouterReplay`` does in
      ``REPLAY_FORWARD``, for the tokens that need it, and gradients reach the router;
    * ``weights="record"``: every token with a record takes the recorded ids and the recorded
      gate weights, slot for slot, cast to the router's probability dtype (exact for bf16 and
      fp32 records). Ids alone do not pin the output: the weights a router computes from the
      same ids depend on its logits, and a softmax over the same ``k`` logits in another slot
      order can round differently. A record captured in fp32 (:func:`capture_routing` on a
      router with ``moe_router_dtype="fp32"``) replays the recording forward bit for bit;
    * ``weights="off"``: count only.

Capture (:func:`capture_routing`)
    The learner-side recorder, as ``RouterReplayAction.RECORD``: each token's top-k ids in
    Megatron's slot order and, asked, its gate weights in the router's own dtype (fp32 with
    ``moe_router_dtype="fp32"``), one :class:`~libalign.routing.records.RoutingRecord` per
    sequence.

Not covered: the fused router (``moe_router_fusion``, Transformer Engine's kernel skips the
top-k slot) and sinkhorn routing; both are refused with :class:`~libalign.errors.SpecError`.
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
    RoutingCapture,
    RoutingStats,
    RoutingTable,
    check_replay_mode,
    check_table_fits,
    same_sets,
)


def routing_geometry(model: nn.Module) -> dict:
    """``layers`` (0-based MoE layer indices), ``top_k`` and ``num_experts`` of a Megatron GPT."""
    return _geometry(routers(model))


def _geometry(rts: dict[int, nn.Module]) -> dict:
    if not rts:
        raise SpecError("the model has no MoE layer (no TopKRouter to capture or replay)")
    cfg = next(iter(rts.values())).config
    return {"layers": sorted(rts), "top_k": int(cfg.moe_router_topk),
            "num_experts": int(cfg.num_moe_experts)}


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """The ``TopKRouter`` of every MoE layer, by 0-based layer index."""
    return {i: layer.router for i, layer in moe_layers(model).items()}


def set_router_keys(model: nn.Module, keys: torch.Tensor | None) -> None:
    """Name the tokens of the next forward calls for routing capture and replay.

    ``keys`` int64 in Megatron's token order (``[s, b]`` flattened; pass ``keys_bs.T`` for a
    ``[b, s]`` batch), ``-1`` for padding; ``None`` clears them. Works with any expert module.
    """
    flat = None if keys is None else keys.reshape(-1)
    for r in routers(model).values():
        r.row_keys = flat


def _keys(model: nn.Module | None, router: nn.Module, layer: int, rows: int) -> torch.Tensor:
    keys = getattr(router, "row_keys", None)
    if keys is None and model is not None:
        keys = getattr(experts_modules(model).get(layer), "row_keys", None)
    if keys is None or keys.numel() != rows:
        raise SpecError(f"routing capture and replay need the key of every token the router "
                        f"sees ({rows} at layer {layer}): set them with "
                        "libalign.models.megatron_routing.set_router_keys (or, with libalign "
                        "experts, libalign.models.megatron.set_row_keys)")
    return keys


def _check_router(router: nn.Module, layer: int) -> None:
    cfg = router.config
    if getattr(cfg, "moe_router_fusion", False) or getattr(router, "routing_type", "") == "sinkhorn":
        raise SpecError(f"layer {layer}: routing capture and replay need Megatron's unfused "
                        "top-k routing (moe_router_fusion off, no sinkhorn)")


class TopKSlot:
    """What sits in one router's ``router_replay`` slot while capture or replay is on: it
    answers ``get_replay_topk`` as Megatron-core's ``RouterReplay`` does, and keeps what the
    last call chose for the router's ``routing`` wrapper."""

    def __init__(self, choose):
        self.choose = choose
        self.last: tuple | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        """Megatron's own top-k, then whatever ``choose`` makes of it."""
        vals, idx = default_compute_topk(scores, topk, num_groups=num_groups,
                                         group_topk=group_topk)
        vals, idx, self.last = self.choose(scores, vals, idx)
        return vals, idx


@contextmanager
def _slots(rts: dict[int, nn.Module], make) -> Iterator[None]:
    """Each router's ``router_replay`` is ``make(layer)`` while inside (restored on exit)."""
    saved = {i: r.router_replay for i, r in rts.items()}
    try:
        for i, r in rts.items():
            r.router_replay = make(i)
        yield
    finally:
        for i, r in rts.items():
            r.router_replay = saved[i]


@contextmanager
def replay_routing(model: nn.Module, table: RoutingTable | None, *, weights: str = "recompute",
                   stats: RoutingStats | None = None) -> Iterator[RoutingStats]:
    """Route a Megatron GPT's MoE layers by the sampler's records while inside (module doc)."""
    with replay_routers(routers(model), table, weights=weights, stats=stats,
                        model=model) as st:
        yield st


@contextmanager
def replay_routers(rts: dict[int, nn.Module], table: RoutingTable | None, *,
                   weights: str = "recompute", stats: RoutingStats | None = None,
                   model: nn.Module | None = None) -> Iterator[RoutingStats]:
    """:func:`replay_routing` on given ``TopKRouter`` modules (by layer index), which need not
    sit in a model: keys come from :func:`set_router_keys` or the routers' ``row_keys``
    (``model``, if given, lends its libalign experts' keys)."""
    check_replay_mode(weights)
    stats = stats if stats is not None else RoutingStats()
    if table is None:
        yield stats
        return
    check_table_fits(table, weights, _geometry(rts))
    for i, r in rts.items():
        _check_router(r, i)

    def make_slot(layer: int) -> TopKSlot:
        router = rts[layer]

        def choose(scores, vals, idx):
            present, rec, rec_w = table.lookup(layer, _keys(model, router, layer,
                                                            scores.shape[0]))
            rec = rec.to(idx.device)
            force = present & ~same_sets(idx, rec)
            stats.add(layer, present.sum(), force.sum())
            if weights == "off":
                return vals, idx, None
            if weights == "record":
                force = present
            if force.device.type == "cpu" and not bool(force.any()):
                return vals, idx, None  # (on a GPU the check would wait for the device)
            f = force.unsqueeze(-1)
            new_idx = torch.where(f, rec.to(idx.dtype), idx)
            new_vals = torch.where(f, scores.gather(1, rec), vals)
            return new_vals, new_idx, (force, rec, rec_w)
        return TopKSlot(choose)

    slots: dict[int, TopKSlot] = {}

    def make_routing(layer: int, original):
        def routing(logits, *args, **kwargs):
            slots[layer].last = None
            probs, rmap = original(logits, *args, **kwargs)
            last = slots[layer].last
            if weights != "record" or last is None:
                return probs, rmap
            force, rec, rec_w = last
            dense = torch.zeros_like(probs).scatter(1, rec, rec_w.to(probs.dtype))
            return torch.where(force.unsqueeze(-1), dense, probs), rmap
        return routing

    def slot(layer: int) -> TopKSlot:
        slots[layer] = make_slot(layer)
        return slots[layer]

    with _slots(rts, slot), wrapped_method(rts, "routing", make_routing):
        yield stats


@contextmanager
def capture_routing(model: nn.Module, *, weights: bool = False) -> Iterator[RoutingCapture]:
    """Record every MoE layer's top-k ids (and gate weights, in the router's dtype) while
    inside; ``.records(version)`` gives one record per sequence (module docstring)."""
    with capture_routers(routers(model), weights=weights, model=model) as cap:
        yield cap


@contextmanager
def capture_routers(rts: dict[int, nn.Module], *, weights: bool = False,
                    model: nn.Module | None = None) -> Iterator[RoutingCapture]:
    """:func:`capture_routing` on given ``TopKRouter`` modules (by layer index)."""
    geo = _geometry(rts)
    for i, r in rts.items():
        _check_router(r, i)
    cap = RoutingCapture(geo["layers"], geo["num_experts"], weights, weight_dtype=None)
    slots: dict[int, TopKSlot] = {}

    def slot(layer: int) -> TopKSlot:
        slots[layer] = TopKSlot(lambda scores, vals, idx: (vals, idx, idx))
        return slots[layer]

    def make_routing(layer: int, original):
        def routing(logits, *args, **kwargs):
            probs, rmap = original(logits, *args, **kwargs)
            idx = slots[layer].last
            keys = _keys(model, rts[layer], layer, probs.shape[0])
            cap.add(layer, keys, idx, probs.gather(1, idx))
            return probs, rmap
        return routing

    with _slots(rts, slot), wrapped_method(rts, "routing", make_routing):
        yield cap
