"""Routing replay (R3) on a Hugging Face Qwen3-MoE: the sampler records, the learner replays.

Sampler side
------------
:func:`capture_routing` wraps the router (``mlp.gate``) of every MoE layer: after each
forward it keeps the top-k expert ids (and, asked, the gate weights) of every real token,
keyed by the sequence id and position the decoding helpers name
(:func:`libalign.models.paths.set_row_keys`; padding and finished rows have no key).
:meth:`RoutingCapture.records` turns what was kept into one
:class:`~libalign.routing.records.RoutingRecord` per sequence.

Learner side
------------
:func:`replay_routing` wraps the same routers with a lookup by row key. For every token with
a record it first lets the router compute its own top-k (counted in :class:`RoutingStats`:
the token×layer decisions where the learner's own top-k *set* differs from the sampler's,
the disagreement before forcing), then routes as the record says:

* ``weights="recompute"`` (R3): tokens whose own set equals the record keep the router's own
  output bit for bit; the others go to the recorded experts with gate weights computed from
  the learner's own router logits over them (softmax over all experts in fp32, gathered at
  the forced ids, renormalized when the model renormalizes top-k, cast as the router casts),
  so gradients reach the router as usual;
* ``weights="record"``: every token with a record takes the recorded experts *and* gate
  weights (no gradient to the router through them);
* ``weights="off"``: nothing is forced; only the disagreement is counted (the learner
  without replay).

Tokens without a record (the last token of a rollout, padding) keep their own routing. The
wrapper sits on top of whatever router forward is installed (strict execution's too).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from libalign.errors import InputError, RoutingRecordError, SpecError
from libalign.guidance import key_parts, row_keys
from libalign.models.paths import decoder_layers, moe_layer_indices, row_keys_of, wrapped_method
from libalign.routing.records import WEIGHT_DTYPE, RoutingRecord, id_dtype

REPLAY_MODES = ("off", "recompute", "record")


def _router(model: nn.Module, layer: int) -> nn.Module:
    return decoder_layers(model)[layer].mlp.gate


def routing_geometry(model: nn.Module) -> dict:
    """``layers`` (MoE layer indices), ``top_k`` and ``num_experts`` of a Qwen3-MoE model."""
    cfg = model.config
    return {"layers": moe_layer_indices(model), "top_k": int(cfg.num_experts_per_tok),
            "num_experts": int(cfg.num_experts)}


def _routers(model: nn.Module, layers: Iterable[int]) -> dict[int, nn.Module]:
    return {layer: _router(model, layer) for layer in layers}


def _real_keys(model: nn.Module, rows: int) -> torch.Tensor:
    keys = row_keys_of(model)
    if keys is None or keys.numel() != rows:
        raise SpecError("routing capture and replay need row keys for every forward call: run "
                        "the model through libalign.models.score_sequences / generate / "
                        "KVDecode or the learner engines (they set them)")
    return keys


class RoutingCapture:
    """What :func:`capture_routing` kept: per layer, row keys and top-k ids (and weights)."""

    def __init__(self, layers: list[int], num_experts: int, weights: bool,
                 weight_dtype: torch.dtype | None = WEIGHT_DTYPE):
        self.layers = layers
        self.num_experts = num_experts
        self.keep_weights = weights
        self.weight_dtype = weight_dtype
        """the dtype weights are kept in (None: the router's own, e.g. fp32)"""
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {
            x: [] for x in layers}

    def add(self, layer: int, keys: torch.Tensor, index: torch.Tensor,
            weights: torch.Tensor) -> None:
        """Keep the rows of one router call that have a key."""
        real = keys >= 0
        w = weights.detach()[real] if self.keep_weights else None
        if w is not None and self.weight_dtype is not None:
            w = w.to(self.weight_dtype)
        self._parts[layer].append((keys[real], index.detach()[real], w))

    def records(self, version: str | None = None) -> dict[int, RoutingRecord]:
        """One record per sequence id seen, positions ``0..P-1`` each (RoutingRecordError if
        a layer misses a token or a sequence has a gap)."""
        per_layer = []
        for layer in self.layers:
            parts = self._parts[layer]
            if not parts:
                return {}
            keys = torch.cat([p[0] for p in parts])
            order = torch.argsort(keys)
            ids = torch.cat([p[1] for p in parts])[order]
            w = torch.cat([p[2] for p in parts])[order] if self.keep_weights else None
            per_layer.append((keys[order], ids, w))
        keys = per_layer[0][0]
        for (k, _, _), layer in zip(per_layer, self.layers, strict=True):
            if not torch.equal(k, keys):
                raise RoutingRecordError(f"layer {layer} routed other tokens than layer "
                                         f"{self.layers[0]}")
        if bool((keys[1:] == keys[:-1]).any()):
            raise RoutingRecordError("a token was routed twice under the same key")
        ids = torch.stack([p[1] for p in per_layer], dim=1).cpu().to(id_dtype(self.num_experts))
        w = torch.stack([p[2] for p in per_layer], dim=1).cpu() if self.keep_weights else None
        keys = keys.cpu()
        seq, pos = key_parts(keys)
        out: dict[int, RoutingRecord] = {}
        bounds = torch.nonzero(seq[1:] != seq[:-1]).squeeze(-1) + 1
        starts = [0, *bounds.tolist()]
        ends = [*bounds.tolist(), int(seq.numel())]
        for a, b in zip(starts, ends, strict=True):
            sid = int(seq[a])
            if not torch.equal(pos[a:b], torch.arange(b - a)):
                raise RoutingRecordError(f"sequence {sid}: routed positions are not 0..{b - a - 1}")
            out[sid] = RoutingRecord(ids[a:b].contiguous(), tuple(self.layers), self.num_experts,
                                     None if w is None else w[a:b].contiguous(), version)
        return out


@contextmanager
def capture_routing(model: nn.Module, *, weights: bool = False) -> Iterator[RoutingCapture]:
    """Record every MoE layer's top-k expert ids (and gate weights) while inside (sampler)."""
    geo = routing_geometry(model)
    cap = RoutingCapture(geo["layers"], geo["num_experts"], weights)

    def make(layer, original):
        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            cap.add(layer, _real_keys(model, out[2].shape[0]), out[2], out[1])
            return out
        return forward

    with wrapped_method(_routers(model, cap.layers), "forward", make):
        yield cap


# --- learner side -----------------------------------------------------------------------------

@dataclass
class RoutingStats:
    """Per MoE layer: token×layer routing decisions that had a record, and how many of them the
    learner's own top-k set differed from the sampler's (before any forcing).

    Counts may arrive as device tensors; they are summed where they are and read back once,
    when a count is asked for, so a forward on a GPU does not wait on every layer."""

    _decisions: dict[int, int | torch.Tensor] = field(default_factory=dict)
    _differ: dict[int, int | torch.Tensor] = field(default_factory=dict)

    def add(self, layer: int, decisions, differ) -> None:
        """Accumulate one router call's counts (ints or 0-d tensors)."""
        self._decisions[layer] = self._decisions.get(layer, 0) + decisions
        self._differ[layer] = self._differ.get(layer, 0) + differ

    @property
    def decisions(self) -> dict[int, int]:
        """Compared decisions per layer."""
        return {x: int(v) for x, v in sorted(self._decisions.items())}

    @property
    def differ(self) -> dict[int, int]:
        """Decisions per layer whose top-k sets differed."""
        return {x: int(v) for x, v in sorted(self._differ.items())}

    def merge(self, other: RoutingStats) -> None:
        """Add another's counts to these."""
        differ = other.differ
        for layer, n in other.decisions.items():
            self.add(layer, n, differ.get(layer, 0))

    @property
    def total(self) -> int:
        """Decisions compared over all layers."""
        return sum(self.decisions.values())

    @property
    def disagreement(self) -> float | None:
        """Share of compared decisions whose top-k sets differ (None: nothing compared)."""
        n = self.total
        return sum(self.differ.values()) / n if n else None

    def to_dict(self) -> dict:
        """Plain JSON-ready summary: overall and per layer."""
        differ = self.differ
        return {"decisions": self.total, "disagreement": self.disagreement,
                "by_layer": {str(x): differ[x] / n for x, n in self.decisions.items() if n}}


class RoutingTable:
    """Records of many sequences, indexed by row key per layer for lookup on one device."""

    def __init__(self, records: Mapping[int, RoutingRecord], device: torch.device | str = "cpu"):
        if not records:
            raise InputError("a routing table needs at least one record")
        recs = list(records.items())
        first = recs[0][1]
        self.layers, self.top_k, self.num_experts = first.layers, first.top_k, first.num_experts
        for sid, r in recs:
            if (r.layers, r.top_k, r.num_experts) != (self.layers, self.top_k, self.num_experts):
                raise RoutingRecordError(f"sequence {sid}: records of one table differ in layers, "
                                         "top-k or expert count")
        keys = torch.cat([row_keys(sid, torch.arange(r.positions)) for sid, r in recs])
        order = torch.argsort(keys)
        self.keys = keys[order].to(device)
        self.experts = torch.cat([r.experts.long() for _, r in recs])[order].to(device)
        has_w = all(r.weights is not None for _, r in recs)
        self.weights = torch.cat([r.weights for _, r in recs])[order].to(device) if has_w else None
        self.column = {layer: j for j, layer in enumerate(self.layers)}
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(present [T], index [T])`` of rows with these keys; every MoE layer of one forward
        asks with the same keys tensor, so the search runs once a forward."""
        last = self._last
        if last is not None and last[0] is keys:
            return last[1], last[2]
        k = keys.to(self.keys.device)
        idx = torch.searchsorted(self.keys, k).clamp_(max=self.keys.numel() - 1)
        present = (self.keys[idx] == k) & (k >= 0)
        self._last = (keys, present, idx)
        return present, idx

    def lookup(self, layer: int, keys: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(present [T], experts [T, k], weights [T, k] or None)`` for rows with these keys."""
        j = self.column[layer]
        present, idx = self.rows(keys)
        w = None if self.weights is None else self.weights[idx, j]
        return present, self.experts[idx, j], w


def same_sets(own: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: whether each row's top-k *set* of ``own`` equals that of ``rec`` (ids are
    distinct within a row, so: every own id occurs in the record)."""
    own, rec = own.long(), rec.to(own.device).long()
    if own.shape[-1] > 16:
        return (own.sort(-1).values == rec.sort(-1).values).all(-1)
    return (own.unsqueeze(-1) == rec.unsqueeze(-2)).any(-1).all(-1)


def forced_weights(logits: torch.Tensor, index: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights of the experts ``index`` ``[T, k]`` from router ``logits`` ``[T, E]``, as a
    Qwen3-MoE router computes them for its own top-k (fp32 softmax over all experts, gathered,
    renormalized when ``normalize``, cast to the logits' dtype)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, index)
    if normalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


def check_replay_mode(weights: str) -> None:
    """InputError unless ``weights`` is one of :data:`REPLAY_MODES`."""
    if weights not in REPLAY_MODES:
        raise InputError(f"weights must be one of {REPLAY_MODES}, got {weights!r}")


def check_table_fits(table: RoutingTable, weights: str, geometry: dict) -> None:
    """RoutingRecordError unless ``table`` was made for a model of ``geometry`` (layers, top-k,
    experts) and keeps gate weights when ``weights='record'`` takes them from the records.
    One rule for every engine that replays (Hugging Face here, Megatron-core beside it)."""
    if weights == "record" and table.weights is None:
        raise RoutingRecordError("weights='record' needs records that keep gate weights")
    if list(table.layers) != geometry["layers"] or table.top_k != geometry["top_k"] \
            or table.num_experts != geometry["num_experts"]:
        raise RoutingRecordError(f"records for layers {list(table.layers)}, top-k {table.top_k}, "
                                 f"{table.num_experts} experts; the model has {geometry}")


@contextmanager
def replay_routing(model: nn.Module, table: RoutingTable | None, *, weights: str = "recompute",
                   stats: RoutingStats | None = None) -> Iterator[RoutingStats]:
    """Route by the sampler's records while inside (module docstring); yields the stats."""
    check_replay_mode(weights)
    stats = stats if stats is not None else RoutingStats()
    if table is None:
        yield stats
        return
    geo = routing_geometry(model)
    check_table_fits(table, weights, geo)

    def make(layer, original):
        router = _router(model, layer)
        normalize = bool(getattr(router, "norm_topk_prob", False))

        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)
            logits, w, idx = out[0], out[1], out[2]
            present, rec, rec_w = table.lookup(layer, _real_keys(model, idx.shape[0]))
            agree = same_sets(idx, rec)
            force = present & ~agree
            stats.add(layer, present.sum(), force.sum())
            if weights == "off":
                return out
            if weights == "record":
                force = present
            if force.device.type == "cpu" and not bool(force.any()):
                return out  # (on a GPU the check would wait for the device; where() is cheap)
            f = force.unsqueeze(-1)
            rec = rec.to(idx.device)
            new_idx = torch.where(f, rec.to(idx.dtype), idx)
            new_w = rec_w.to(w.dtype) if weights == "record" else \
                forced_weights(logits, rec, normalize)
            return (logits, torch.where(f, new_w, w), new_idx, *out[3:])
        return forward

    with wrapped_method(_routers(model, geo["layers"]), "forward", make):
        yield stats
