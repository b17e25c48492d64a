"""Capture what a forward pass computes per layer, and pin the experts a layer routes to.

What is captured
----------------
Inside ``with capture(model, layers) as cap:``, every forward pass fills ``cap[layer]`` with:

``hidden_in`` / ``hidden_out``
    The decoder layer's input and output, ``[B, T, H]`` (residual stream before and after).
``moe_in``
    The MoE block's input ``[B*T, H]`` (after the post-attention RMSNorm), what the router and
    FC1 see.
``routing`` / ``router_weights``
    The expert assignment ``top_k_index`` ``[B*T, k]`` and the router coefficients that scale
    each expert's output.
``fc1_out`` / ``fc2_in`` / ``fc2_out``
    FC1's output ``[B*T*k, 2I]`` (gate columns, then up), FC2's input ``act(gate) * up``
    ``[B*T*k, I]`` and FC2's output ``[B*T*k, H]`` (before the router weight), in **token
    order**: row ``t*k + j`` belongs to token ``t`` and its ``j``-th expert
    ``routing[t, j]``. The grouped GEMM works on expert-sorted rows; ``order`` (also stored)
    is that permutation, so ``fc1_out[order]`` gives the kernel's row order back, which is
    also the "concatenated in expert-index order" layout of the replay comparisons.
``moe_out``
    The routed experts' combined output ``[B*T, H]``.

Tensors are detached, never copied (nothing downstream writes to them in place). A later
forward overwrites the previous one's entries unless ``keep_all=True``, which appends to a
list per name instead (e.g. one entry per decoding step).

A MoE layer with no execution path set runs libalign's ``bf16`` path while captured, because
the stock expert forward exposes no FC1/FC2 outputs; on the CPU the two agree bit for bit.

Routing control
---------------
``force_routing(model, {layer: (top_k_index, top_k_weights)})`` makes the named layers' routers
return the given assignment (the router logits are still computed, so auxiliary outputs stay
valid). This is how a diagnosis conditions on routing: feed the sampler's inputs to the
learner's path with the learner's expert choices held fixed, and what remains differs only
through the arithmetic. ``top_k_weights=None`` keeps the router's own probabilities of the
forced experts (renormalized when the model renormalizes top-k).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from libalign.errors import ShapeError, SpecError
from libalign.models.paths import add_observer, decoder_layers, experts_module, wrapped_method

TOKEN_ORDER_ROWS = ("fc1_out", "fc2_in", "fc2_out")


def _check_layers(model: nn.Module, layers: Iterable[int]) -> list[int]:
    n = len(decoder_layers(model))
    out = []
    for layer in layers:
        if not isinstance(layer, int) or not 0 <= layer < n:
            raise SpecError(f"layer {layer!r} does not exist; the model has {n} layers")
        out.append(layer)
    return out


def _has_experts(model: nn.Module, layer: int) -> bool:
    try:
        experts_module(model, layer)
    except SpecError:
        return False
    return True


def to_token_order(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in the grouped GEMM's expert-sorted order, put back in ``(token, slot)`` order."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


@contextmanager
def capture(model: nn.Module, layers: Iterable[int] | int, *,
            keep_all: bool = False) -> Iterator[dict[int, dict]]:
    """Record per-layer activations of the forward passes run inside the block (module docstring)."""
    chosen = _check_layers(model, [layers] if isinstance(layers, int) else layers)
    store: dict[int, dict] = {layer: {} for layer in chosen}

    def put(layer: int, name: str, value) -> None:
        if keep_all:
            store[layer].setdefault(name, []).append(value)
        else:
            store[layer][name] = value

    def on_experts(layer: int, rec: dict) -> None:
        order = rec["order"]
        put(layer, "routing", rec["routing"].detach())
        put(layer, "router_weights", rec["router_weights"].detach())
        put(layer, "order", order.detach())
        put(layer, "moe_in", rec["moe_in"].detach())
        for name in TOKEN_ORDER_ROWS:
            put(layer, name, to_token_order(rec[name].detach(), order))
        put(layer, "moe_out", rec["moe_out"].detach())

    with ExitStack() as stack:
        layer_mods = decoder_layers(model)
        for layer in chosen:
            mod = layer_mods[layer]

            def pre(_m, args, kwargs, layer=layer):
                h = args[0] if args else kwargs["hidden_states"]
                put(layer, "hidden_in", h.detach())

            def post(_m, _args, _kwargs, out, layer=layer):
                h = out[0] if isinstance(out, tuple) else out
                put(layer, "hidden_out", h.detach())

            stack.callback(mod.register_forward_pre_hook(pre, with_kwargs=True).remove)
            stack.callback(mod.register_forward_hook(post, with_kwargs=True).remove)
            if _has_experts(model, layer):
                stack.callback(add_observer(model, layer, on_experts))
        yield store


# --- routing control --------------------------------------------------------------------------

RoutingSpec = tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor


def _router_of(model: nn.Module, layer: int) -> nn.Module:
    experts_module(model, layer)
    return decoder_layers(model)[layer].mlp.gate


def _split(spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(spec, torch.Tensor):
        return spec, None
    if isinstance(spec, tuple | list) and len(spec) == 2:
        return spec[0], spec[1]
    raise SpecError("a forced routing is top_k_index or a pair (top_k_index, top_k_weights)")


def _forced_forward(router: nn.Module, original, index: torch.Tensor, weights: torch.Tensor | None,
                    layer: int):
    experts = getattr(router, "num_experts", None)
    if index.ndim != 2 or (weights is not None and weights.shape != index.shape):
        raise ShapeError(f"layer {layer}: forced top_k_index must be [tokens, k] with weights of the "
                         f"same shape, got {tuple(index.shape)} / "
                         f"{None if weights is None else tuple(weights.shape)}")
    if index.is_floating_point() or (experts is not None and index.numel()
                                     and not (int(index.min()) >= 0 and int(index.max()) < experts)):
        raise SpecError(f"layer {layer}: forced expert indices must be integers in [0, {experts})")

    def forward(hidden_states, *args, **kwargs):
        out = original(hidden_states, *args, **kwargs)
        logits = out[0]
        if logits.shape[0] != index.shape[0]:
            raise ShapeError(f"layer {layer}: forced routing holds {index.shape[0]} tokens, the "
                             f"forward pass has {logits.shape[0]}")
        idx = index.to(device=logits.device, dtype=torch.long)
        if weights is None:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, idx)
            if getattr(router, "norm_topk_prob", False):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            w = probs.to(logits.dtype)
        else:
            w = weights.to(device=logits.device, dtype=logits.dtype)
        return (logits, w, idx, *out[3:])

    return forward


@contextmanager
def force_routing(model: nn.Module, routing: Mapping[int, RoutingSpec]) -> Iterator[nn.Module]:
    """Within the block, the named layers route to the given experts instead of their router's top-k.

    ``routing`` maps a layer to ``(top_k_index, top_k_weights)`` (``[tokens, k]`` each, tokens
    as the MoE block flattens them: ``B*T`` in batch-major order) or to ``top_k_index`` alone
    (the router's own probabilities of those experts are used). A forward pass whose token
    count differs raises :class:`~libalign.errors.ShapeError`. Nested blocks restore in order.
    """
    routers = {layer: _router_of(model, layer) for layer in routing}
    plan = {layer: _split(spec) for layer, spec in routing.items()}

    def make(layer, original):
        return _forced_forward(routers[layer], original, *plan[layer], layer)

    with wrapped_method(routers, "forward", make):
        yield model
