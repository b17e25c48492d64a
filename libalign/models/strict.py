"""Strict execution: a Qwen3-MoE whose every row comes out the same in any batch.

What strictness buys
--------------------
The sampler decodes with a KV cache, one token per step, prompts left-padded; the learner scores
the finished sequences in one pass, right-padded. On the same weights the two should report the
same log-probability for every token; with stock kernels they do not quite, even in BF16 (a
GEMM, a reduction or a vectorized ``exp`` picks its summation order from the call's shape, see
:mod:`libalign.strict.ops`). miniTE's *strict* configuration closes that gap completely: every
shape-dependent operation gets one batch-invariant implementation shared by both sides, and
the learner's log-probs equal the sampler's bit for bit (δ = 0), so RL needs no importance
correction.

:func:`enable` turns a stock Hugging Face ``Qwen3MoeForCausalLM`` strict in place (instance
attributes only, like :mod:`libalign.models.paths`; :func:`disable` gives everything back). The
table names the portable forms (:mod:`libalign.strict.ops`); in the default ``device`` mode a
GPU runs the same steps on the batch-invariant kernels of :mod:`libalign.strict.tensorcore`
(:mod:`libalign.strict.device` says which op runs where):

==========================  =====================================================================
what                        strict form (portable)
==========================  =====================================================================
every ``nn.Linear``         ``linear``: fp32 accumulation in K order, one rounding (q/k/v/o, LM
                            head)
RMSNorm (layers, q/k norm)  ``rms_norm``: tree sum of squares
router                      ``linear`` logits, ``softmax`` (tree sum), ``topk_indices`` (ties to
                            the lower expert), top-k renormalized left to right
experts                     :func:`experts_forward`: per expert the K-ordered product (bf16, or
                            NVFP4 inner values with the path's row-scaled epilogue), ``silu``,
                            each token's expert outputs added in its top-k order
rotary embedding            a cos/sin table per position computed once (libm in float64), looked
                            up by position, so a decode step and a full pass use the same values
attention                   ``attention`` (registered as the ``libalign_strict`` implementation):
                            keys summed in cache-slot order, masked slots add exact zeros, so a
                            left-padded cache and a right-padded batch agree
log-probabilities           ``log_softmax`` (:func:`log_softmax_for`, used by the scoring and
                            decoding helpers)
==========================  =====================================================================

The NVFP4 paths keep their bits: ``nvfp4_minite`` quantizes each activation row with its own
scale (row-local, so batch-invariant already); ``nvfp4_naive``'s per-tensor activation scale
takes its maximum over every row of the call and has no strict form (:func:`check_path`
refuses it).

Composing
---------
Strictness sits *under* the execution paths: :func:`libalign.models.set_path` still chooses
the experts' arithmetic, observers (capture) and activation hooks (TRACE guidance) still see
every call, and a KV cache that transforms keys and values on update feeds the strict
attention whatever it stores. Enable strict mode before forcing routing
(:func:`~libalign.models.capture.force_routing` wraps the router it finds).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeMLP,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
    Qwen3MoeTopKRouter,
)

from libalign import gemm
from libalign.errors import ConfigError, ShapeError, SpecError
from libalign.gemm.inner import row_epilogue_scales
from libalign.gemm.paths import Epilogue
from libalign.models.paths import set_experts_impl
from libalign.strict import ops as strict_ops
from libalign.strict.device import DeviceOps, Kernels, PortableOps, op_set

STRICT_ATTENTION = "libalign_strict"
"""The attention implementation name strict mode registers and sets on the model's config."""

_STATE = "_libalign_strict"
_OPS = "_libalign_strict_ops"  # the op set on each module strict mode rewired
_ROPE_TABLE = "_libalign_strict_rope"
_ROPE_COPIES = "_libalign_strict_rope_copies"  # the table's copies on other devices
_ROPE_CHUNK = 256


# --- attention ---------------------------------------------------------------------------------

def _strict_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False  # always a materialized boolean mask
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(*args, **kwargs)


def strict_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface entry: :func:`libalign.strict.ops.attention` on the
    mask the model built (boolean, True = attend); returns ``[B, Tq, H, D]``."""
    if attention_mask is None:
        raise SpecError("strict attention needs the materialized mask; the model's config must "
                        f"use the {STRICT_ATTENTION!r} attention implementation")
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    allowed = allowed[..., :key.shape[-2]]
    ops = module.__dict__.get(_OPS) or PortableOps()
    out = ops.attention(query, key, value, allowed, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    if STRICT_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(STRICT_ATTENTION, strict_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(STRICT_ATTENTION, _strict_mask)


# --- module forwards ---------------------------------------------------------------------------

def module_ops(module: nn.Module) -> DeviceOps | PortableOps:
    """The strict op set :func:`set_ops` gave ``module``."""
    return module.__dict__[_OPS]


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module_ops(self).linear(x, self.weight, self.bias)


def _rms_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module_ops(self).rms_norm(x, self.weight, self.variance_epsilon)


def _router_forward(self: nn.Module, hidden_states: torch.Tensor):
    return route(module_ops(self), hidden_states.reshape(-1, self.hidden_dim), self.weight, self.top_k,
                 self.norm_topk_prob)


def route(ops: DeviceOps | PortableOps, h: torch.Tensor, weight: torch.Tensor, top_k: int,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The strict router: ``linear`` logits, ``softmax``, ``topk_indices`` (ties to the lower
    expert), the top-k renormalized left to right; ``(logits, weights, indices)``."""
    logits = ops.linear(h, weight)
    probs = ops.softmax(logits)
    index = ops.topk_indices(probs, top_k)
    top = probs.gather(-1, index)
    if normalize:
        top = top / ops.sequential_sum(top, -1, keepdim=True)
    return logits, top.to(logits.dtype), index


def rope_table(module: nn.Module, positions: int,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[P, dim]`` for positions ``0..P-1``, extended in chunks as needed:
    ``f = fp32(p) * inv_freq`` (fp32), then ``cos f`` and ``sin f`` by Python's libm in float64,
    each element on its own, rounded to fp32 and scaled by the rope's attention scaling. The
    table is computed on the host; on another ``device`` a copy of it is kept there (copied
    again only when the table grows), so a step looks positions up where they live."""
    have = module.__dict__.get(_ROPE_TABLE)
    if have is None or have[0].shape[0] < positions:
        have = _grow_rope_table(module, positions)
    device = torch.device(device)
    if device.type == "cpu":
        return have
    copies = module.__dict__.setdefault(_ROPE_COPIES, {})
    copy = copies.get(device)
    if copy is None or copy[0].shape[0] != have[0].shape[0]:
        copy = copies[device] = (have[0].to(device), have[1].to(device))
    return copy


def _grow_rope_table(module: nn.Module, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    size = -(-positions // _ROPE_CHUNK) * _ROPE_CHUNK
    inv = module.inv_freq.detach().float().cpu()
    freqs = (torch.arange(size, dtype=torch.float32).unsqueeze(-1) * inv).tolist()
    scale = float(getattr(module, "attention_scaling", 1.0))
    cos = torch.tensor([[math.cos(f) for f in row] for row in freqs], dtype=torch.float32)
    sin = torch.tensor([[math.sin(f) for f in row] for row in freqs], dtype=torch.float32)
    cos, sin = torch.cat([cos, cos], -1) * scale, torch.cat([sin, sin], -1) * scale
    module.__dict__[_ROPE_TABLE] = (cos, sin)
    return cos, sin


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    need = 1
    if position_ids.numel():  # the one read back of a step: the positions' range
        lo, hi = torch.stack(torch.aminmax(position_ids.detach())).tolist()
        if lo < 0:
            raise ShapeError("strict rotary embedding: negative position ids")
        need = hi + 1
    cos, sin = rope_table(self, need, x.device)
    idx = position_ids.detach().to(x.device, torch.long)
    return cos[idx].to(x.dtype), sin[idx].to(x.dtype)


# --- experts -----------------------------------------------------------------------------------

def check_path(path: str | gemm.ExecutionPath) -> gemm.ExecutionPath:
    """The path, if it has a strict form: bf16, or activations scaled per row (else SpecError)."""
    p = gemm.get_path(path)
    if p.quantized and p.act_spec.outer_domain != "row":
        raise SpecError(f"path {p.name!r} scales activations per {p.act_spec.outer_domain}: the "
                        "scale depends on every row of the call, so it has no batch-invariant "
                        "(strict) form; use a row-scaled path such as nvfp4_minite")
    return p


class ExpertCounts:
    """The rows per expert of one MoE call (rows sorted by expert): an integer tensor on the
    rows' device, read to the host only where a loop over experts needs it (:attr:`host`,
    once). Device mode's grouped product takes the tensor, so a forward on the GPU never
    waits for the router."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @functools.cached_property
    def host(self) -> list[int]:
        """The counts as a list (one read from the device)."""
        return self.tensor.tolist()


def _expert_rows(a: torch.Tensor, w: gemm.ExpertWeights, counts: ExpertCounts, act_q,
                 ops: DeviceOps | PortableOps) -> torch.Tensor:
    """Rows sorted by expert through ``w``'s path: in device mode on a GPU one grouped
    batch-invariant launch, else each expert's rows by the K-ordered product; backward: the
    bf16 product of the unquantized operands (the straight-through estimator)."""
    p = w.path
    out_dtype = a.dtype if a.dtype != torch.float32 else torch.bfloat16
    grouped = ops.mode == "device" and a.device.type != "cpu"
    inner_dtype = torch.bfloat16 if grouped else torch.float32
    if p.quantized:
        q = gemm.quantize_activations(a, p.act_spec)[0] if act_q is None else act_q
        a_in = gemm.inner_values(q, inner_dtype)
        a_dec = row_epilogue_scales(q, p)  # what the path's epilogue reads of each row
    if grouped:
        return _grouped_rows(ops, a, w, counts, a_in if p.quantized else None,
                             a_dec if p.quantized else None, out_dtype)
    parts, lo = [], 0
    for e, n in enumerate(counts.host):
        if n == 0:
            continue
        rows = slice(lo, lo + n)
        if p.quantized:
            def fn(_a, _w, e=e, rows=rows):
                acc = strict_ops.matmul_f32(a_in[rows], w.inner[e])
                return gemm.epilogue(acc, a_dec[rows], w.dec[e], out_dtype, path=p)
        else:
            def fn(_a, _w):
                return strict_ops.matmul_f32(_a, _w).to(out_dtype)
        stock = lambda _a, _w: (_a @ _w.to(_a.dtype).T).to(out_dtype)  # noqa: E731
        parts.append(strict_ops.strict_forward(fn, stock, a[rows], w.weight[e]))
        lo += n
    if not parts:
        return a.new_zeros((0, w.shape[1]), dtype=out_dtype)
    return torch.cat(parts)


def _grouped_rows(ops: DeviceOps, a, w: gemm.ExpertWeights, counts: ExpertCounts, a_in, a_dec,
                  out_dtype):
    """Device mode: all experts' rows in one grouped launch (NVFP4: bf16 inner values, the
    path's epilogue); backward as :func:`_expert_rows`."""
    p = w.path
    kern = ops.kernels
    scaled = p.quantized and p.epilogue == Epilogue.DEC_PRODUCT

    def fn(_a, _w):
        if not p.quantized:
            return kern.grouped_matmul(_a, _w.to(_a.dtype), counts.tensor, out_dtype=out_dtype)
        inner = w.inner.to(torch.bfloat16)
        if scaled:
            return kern.grouped_matmul(a_in, inner, counts.tensor, out_dtype=out_dtype,
                                       a_dec=a_dec, w_dec=w.dec)
        acc = kern.grouped_matmul(a_in, inner, counts.tensor, out_dtype=torch.float32)
        parts, lo = [], 0
        for e, n in enumerate(counts.host):
            parts.append(gemm.epilogue(acc[lo:lo + n], a_dec[lo:lo + n], w.dec[e], out_dtype,
                                       path=p))
            lo += n
        return torch.cat(parts) if parts else acc.to(out_dtype)

    def stock(_a, _w):
        outs = [(rows @ _w[e].to(_a.dtype).T).to(out_dtype)
                for e, rows in enumerate(_a.split(counts.host))]
        return torch.cat(outs) if outs else _a.new_zeros((0, _w.shape[1]), dtype=out_dtype)

    return strict_ops.strict_forward(fn, stock, a, w.weight)


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up: gemm.ExpertWeights, down: gemm.ExpertWeights, *, backend: str = "auto",
                    act_fn: Callable | None = None, observer: gemm.Observer | None = None,
                    act_hook: gemm.ActivationHook | None = None,
                    ops: DeviceOps | PortableOps | None = None) -> torch.Tensor:
    """:func:`libalign.gemm.moe_experts_forward`, batch-invariant (same arguments; ``backend``
    and ``act_fn`` are ignored: the products are strict ones and the activation SiLU; ``ops``
    the strict op set, default the portable one).

    Rows are sorted by expert (stable) exactly as there, FC1, ``silu(gate) * up`` and FC2 run
    through the mode's products (portable: per expert :func:`libalign.strict.ops.matmul_f32`;
    device: one grouped tensor-core launch), each row is weighted by its router weight, and
    each token's ``k`` expert outputs are added in fp32 in its top-k order (slot 0 first), then
    rounded once to the hidden dtype.
    """
    ops = PortableOps() if ops is None else ops
    if hidden.ndim != 2 or top_k_index.shape != top_k_weights.shape \
            or top_k_index.shape[0] != hidden.shape[0]:
        raise ShapeError(f"hidden {tuple(hidden.shape)}, routing {tuple(top_k_index.shape)} / "
                         f"{tuple(top_k_weights.shape)} do not fit")
    check_path(gate_up.path)
    check_path(down.path)
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    # rows per expert from the sorted ids' boundaries: no read back to the host (bincount
    # reads the largest id first)
    experts = torch.arange(gate_up.shape[0] + 1, device=flat.device, dtype=flat.dtype)
    sorted_ids = flat[order]
    counts = ExpertCounts(torch.searchsorted(sorted_ids, experts).diff())
    x = hidden[token_of]
    hook = act_hook if gate_up.path.quantized and down.path.quantized else None
    q1 = q2 = None
    if hook is not None:
        tokens = torch.arange(t, device=hidden.device)
        q1 = gemm.take_rows(hook("fc1", hidden, gate_up.path.act_spec, tokens, None), token_of)
    h = _expert_rows(x, gate_up, counts, q1, ops)
    gate, up = h.chunk(2, dim=-1)
    act = ops.silu(gate) * up
    if hook is not None:
        q2 = hook("fc2", act, down.path.act_spec, token_of, sorted_ids)
    y = _expert_rows(act, down, counts, q2, ops)
    if observer is not None:
        for name, value in (("routing", top_k_index), ("order", order), ("fc1_in", x),
                            ("fc1_out", h), ("fc2_in", act), ("fc2_out", y)):
            observer(name, value)
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=order.device)
    return ops.combine_experts(y, slot_of, top_k_weights, hidden.dtype)


# --- turning it on and off ---------------------------------------------------------------------

def is_strict(model: nn.Module) -> bool:
    """Whether :func:`enable` is in force on ``model``."""
    return _STATE in model.__dict__


def _swap(saved: list, module: nn.Module, fn: Callable) -> None:
    saved.append((module, module.__dict__.get("forward")))
    module.forward = types.MethodType(fn, module)


def set_ops(model: nn.Module, ops: DeviceOps | PortableOps | None) -> None:
    """Give every module of ``model`` the strict op set its rewired forwards call (None: take
    it away)."""
    for module in model.modules():
        if ops is None:
            module.__dict__.pop(_OPS, None)
        else:
            module.__dict__[_OPS] = ops


def ops_of(model: nn.Module) -> DeviceOps | PortableOps:
    """The op set :func:`enable` gave ``model`` (:class:`~libalign.errors.ConfigError` when it
    is not strict)."""
    ops = model.__dict__.get(_OPS)
    if ops is None:
        raise ConfigError("the model is not in strict mode")
    return ops


def enable(model: nn.Module, mode: str = "device", kernels: Kernels | None = None) -> nn.Module:
    """Make ``model`` (a Qwen3-MoE causal LM) run strict until :func:`disable`; returns it.

    ``mode`` (:data:`~libalign.strict.device.MODES`): ``device``, batch-invariant tensor-core
    kernels on a GPU (``kernels``: another set of them, such as SGLang's) and the portable ops
    on a CPU; ``portable``, the element-wise ops everywhere, the same bits on CPU and GPU.
    Refuses (:class:`~libalign.errors.ConfigError`) a model whose activation is not SiLU or whose
    rotary embedding changes with the sequence length, an unknown mode, or a model already
    strict in another mode. Experts on a path without a strict form (:func:`check_path`) raise
    :class:`~libalign.errors.SpecError` when they run.
    """
    ops = op_set(mode, kernels)
    if is_strict(model):
        have = ops_of(model)
        if have.mode != mode or (kernels is not None and have.kernels is not kernels):
            raise ConfigError(f"the model is strict in {have.mode} mode already; disable it first")
        return model
    conf = model.config
    if getattr(conf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"strict execution implements SiLU experts, the model uses "
                          f"{conf.hidden_act!r}")
    forwards: list = []
    acts: list = []
    ropes = [m for m in model.modules() if isinstance(m, Qwen3MoeRotaryEmbedding)]
    for rope in ropes:
        if any(w in str(rope.rope_type) for w in ("dynamic", "longrope")):
            raise ConfigError(f"strict execution needs a static rotary embedding, the model's is "
                              f"{rope.rope_type!r}")
    _register()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            _swap(forwards, module, _linear_forward)
        elif isinstance(module, Qwen3MoeRMSNorm):
            _swap(forwards, module, _rms_forward)
        elif isinstance(module, Qwen3MoeTopKRouter):
            _swap(forwards, module, _router_forward)
        elif isinstance(module, Qwen3MoeRotaryEmbedding):
            _swap(forwards, module, _rotary_forward)
        elif isinstance(module, Qwen3MoeMLP):
            acts.append((module, module.act_fn))
            module.act_fn = ops.silu
    model.__dict__[_STATE] = (conf._attn_implementation, forwards, acts)
    conf._attn_implementation = STRICT_ATTENTION
    set_ops(model, ops)
    set_experts_impl(model, functools.partial(experts_forward, ops=ops))
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: stock forwards, attention implementation and experts come back."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return model
    attn, forwards, acts = state
    for module, before in reversed(forwards):
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = before
    for module, act in acts:
        module.act_fn = act
    model.config._attn_implementation = attn
    set_ops(model, None)
    set_experts_impl(model, None)
    return model


@contextmanager
def use_strict(model: nn.Module, strict: bool = True, mode: str = "device",
               kernels: Kernels | None = None) -> Iterator[nn.Module]:
    """Strict execution (:func:`enable`'s ``mode`` and ``kernels``) for the duration of a
    ``with`` block (``strict=False``: no change)."""
    with scoped(model, strict and not is_strict(model), lambda: enable(model, mode, kernels),
                lambda: disable(model)):
        yield model


@contextmanager
def scoped(model: nn.Module, on: bool, turn_on: Callable[[], object],
           turn_off: Callable[[], object]) -> Iterator[nn.Module]:
    """``turn_on()`` before the block and ``turn_off()`` after it, even on an exception, when
    ``on``; else the block alone (the shape of every ``use_strict``)."""
    if not on:
        yield model
        return
    turn_on()
    try:
        yield model
    finally:
        turn_off()


def log_softmax_for(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The log-softmax over the vocabulary that ``model``'s log-probs use: strict in strict mode,
    else ``torch.log_softmax`` (fp32 input either way)."""
    if is_strict(model):
        return ops_of(model).log_softmax
    return lambda x: torch.log_softmax(x, dim=-1)
