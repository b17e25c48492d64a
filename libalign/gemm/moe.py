"""A whole MoE expert block through prepared weights: permute, FC1, activation, FC2, combine.

The routed experts of one Qwen3-MoE layer as two grouped products (:func:`grouped_linear`):
tokens are permuted so rows sort by expert, FC1 runs grouped, ``act_fn(gate) * up`` forms FC2's
input, FC2 runs grouped, and each row is weighted by its router weight and summed back into its
token. Observers see the intermediate tensors (diagnosis), activation hooks quantize instead of
the path (guidance capture and guided rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from libalign.errors import ShapeError
from libalign.gemm.grouped import grouped_linear
from libalign.gemm.row_groups import group_layout
from libalign.gemm.weights import ExpertWeights
from libalign.spec import NumericsSpec, NVFP4Tensor

Observer = Callable[[str, torch.Tensor], None]
# hook(site, activations, spec, token_of, expert_of) -> their NVFP4 quantization
ActivationHook = Callable[[str, torch.Tensor, NumericsSpec, torch.Tensor, torch.Tensor | None],
                          NVFP4Tensor]


def take_rows(q: NVFP4Tensor, idx: torch.Tensor) -> NVFP4Tensor:
    """Rows ``idx`` of a 2-D NVFP4 tensor (row outer scales follow their rows)."""
    outer = q.outer_scale
    if outer is not None and q.spec.outer_domain == "row":
        outer = outer[idx]
    return NVFP4Tensor(q.codes[idx], q.block_scales[idx], outer, q.spec, (int(idx.numel()), q.k))


def moe_experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up: ExpertWeights, down: ExpertWeights, *, backend: str = "auto",
                        act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        observer: Observer | None = None,
                        act_hook: ActivationHook | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer (Qwen3-MoE layout) through prepared weights.

    ``hidden`` ``[T, H]``; ``top_k_index``/``top_k_weights`` ``[T, k]``; ``gate_up`` holds
    ``[E, 2I, H]`` (gate rows first, then up), ``down`` ``[E, H, I]``. Tokens are permuted
    so that rows are sorted by expert (stable, so ties keep token order), FC1 runs grouped,
    ``act_fn(gate) * up`` (SiLU by default) forms FC2's input, FC2 runs grouped, and each
    row is weighted by its router weight and summed back into its token.

    ``observer(name, tensor)``, when given, sees ``routing`` (``top_k_index``), ``fc1_in``,
    ``fc1_out``, ``fc2_in`` and ``fc2_out`` in the permuted (expert-sorted) row order, and
    ``order`` (the permutation) — what per-layer diagnosis compares between paths.

    ``act_hook``, on a quantized path, quantizes the activations instead of the path: it is
    called as ``hook("fc1", hidden, spec, token_of, None)`` once per token (``token_of`` is
    ``arange(T)``; row scales make a token's bits the same for each of its experts, so the
    rows are then gathered into expert order) and as ``hook("fc2", act, spec, token_of,
    expert_of)`` on the expert-sorted FC2 inputs. Guidance capture and guided rounding use it.
    """
    if hidden.ndim != 2:
        raise ShapeError(f"hidden states must be [tokens, hidden], got {tuple(hidden.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden.shape[0]:
        raise ShapeError(f"routing shapes {tuple(top_k_index.shape)} / {tuple(top_k_weights.shape)}"
                         f" do not match {hidden.shape[0]} tokens")
    e = gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=e)[:e]
    layout = group_layout(counts.cpu())
    x = hidden[token_of]
    hook = act_hook if gate_up.path.quantized and down.path.quantized else None
    q1 = q2 = None
    if hook is not None:
        tokens = torch.arange(hidden.shape[0], device=hidden.device)
        q1 = take_rows(hook("fc1", hidden, gate_up.path.act_spec, tokens, None), token_of)
    h = grouped_linear(x, gate_up, layout, backend=backend, act_q=q1)
    gate, up = h.chunk(2, dim=-1)
    act = (act_fn or torch.nn.functional.silu)(gate) * up
    if hook is not None:
        q2 = hook("fc2", act, down.path.act_spec, token_of, flat[order])
    y = grouped_linear(act, down, layout, backend=backend, act_q=q2)
    if observer is not None:
        observer("routing", top_k_index)
        observer("order", order)
        observer("fc1_in", x)
        observer("fc1_out", h)
        observer("fc2_in", act)
        observer("fc2_out", y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token_of, y.to(hidden.dtype))
