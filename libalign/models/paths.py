"""Execution-path glue: run a stock Hugging Face Qwen3-MoE model's experts through libalign's GEMM.

What is swapped, and what is not
--------------------------------
A Qwen3-MoE decoder layer is attention, then a sparse MoE block: a router
(``mlp.gate``, a linear map to one logit per expert, softmax, top-k, optional renormalization)
and the routed experts (``mlp.experts``, a ``Qwen3MoeExperts`` holding the stacks
``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``). Native W4A4 execution touches
only the expert GEMMs, so the glue replaces exactly one thing: the ``forward`` of each
``Qwen3MoeExperts`` **instance** (an attribute on the object, never the class), with one that
calls :func:`libalign.gemm.moe_experts_forward` with the instance's own weights prepared for
the chosen :class:`~libalign.gemm.ExecutionPath`. Attention, norms, router and LM head keep
their Hugging Face code, and checkpoints load with ``from_pretrained`` unchanged.

Removing the attribute restores the class's forward (Hugging Face's dispatcher over its
``experts_implementation``), so leaving a path is exact.

Paths per layer
---------------
A path assignment names one path per MoE layer: a single path (for all layers, or for those
in ``layers=``) or a dict ``{layer: path}``. Layers an assignment does not name run the
``bf16`` path of :mod:`libalign.gemm`, which on the CPU equals Hugging Face's eager and
grouped expert loops bit for bit. ``None`` means "no override": the stock forward.

Prepared weights
----------------
Quantizing an expert stack costs far more than one forward pass, and weights only change when
a new version is loaded. Each experts module therefore keeps, per path, the
:class:`~libalign.gemm.ExpertWeights` it prepared last, keyed by the parameter's storage
pointer, autograd version counter, device, dtype and shape: an in-place update through the
autograd-visible tensor (``optimizer.step()``, ``load_state_dict``, ``param.copy_`` under
``no_grad``) bumps the version and triggers a fresh quantization; writing through
``param.data`` does not, so call :func:`clear_weight_cache` after that. The fused ``gate_up``
stack is quantized as one tensor: its row-scaled outer scales are per output row anyway, and
the per-expert scale of the naive path spans gate and up rows together.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from libalign import gemm
from libalign.errors import SpecError

_GLUE = "_libalign_glue"
_WEIGHTS = "_libalign_weight_cache"
_MISSING = object()

PathLike = str | gemm.ExecutionPath
PathAssignment = PathLike | Mapping[int, PathLike] | None
# observer(layer, record): record maps names to the tensors of one experts call.
ExpertsObserver = Callable[[int, dict], None]


# --- finding the layers -----------------------------------------------------------------------

def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Qwen3-MoE causal LM (or of its base model)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise SpecError(f"{type(model).__name__} has no decoder layers at .model.layers; "
                        "expected a Qwen3-MoE model")
    return layers


def _experts_of(layer: nn.Module) -> nn.Module | None:
    ex = getattr(getattr(layer, "mlp", None), "experts", None)
    if ex is None or not isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor):
        return None
    return ex


def moe_layer_indices(model: nn.Module) -> list[int]:
    """Indices of the decoder layers whose MLP is a routed MoE block."""
    return [i for i, layer in enumerate(decoder_layers(model)) if _experts_of(layer) is not None]


def experts_module(model: nn.Module, layer: int) -> nn.Module:
    """The ``Qwen3MoeExperts`` of decoder layer ``layer``."""
    layers = decoder_layers(model)
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise SpecError(f"layer {layer!r} does not exist; the model has {len(layers)} layers")
    ex = _experts_of(layers[layer])
    if ex is None:
        raise SpecError(f"layer {layer} has no routed experts; MoE layers: {moe_layer_indices(model)}")
    return ex


# --- the per-instance forward -----------------------------------------------------------------

@dataclass(eq=False)
class _Glue:
    layer: int
    saved: object
    path: gemm.ExecutionPath | None = None
    backend: str = "auto"
    observers: list = field(default_factory=list)
    act_hook: Callable | None = None
    impl: Callable | None = None  # replaces gemm.moe_experts_forward (strict execution)


def _glued_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    glue: _Glue = self.__dict__[_GLUE]
    if glue.path is None and not glue.observers and glue.act_hook is None and glue.impl is None:
        return _call_saved(self, glue, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    path = glue.path or gemm.PATHS["bf16"]
    gate_up, down = prepared_weights(self, path)
    record: dict | None = {} if glue.observers else None
    out = (glue.impl or gemm.moe_experts_forward)(
        hidden_states, top_k_index, top_k_weights, gate_up, down, backend=glue.backend,
        act_fn=getattr(self, "act_fn", None),
        observer=None if record is None else record.__setitem__,
        act_hook=None if glue.act_hook is None else functools.partial(glue.act_hook, glue.layer))
    if record is not None:
        record.update(moe_in=hidden_states, router_weights=top_k_weights, moe_out=out,
                      path=path.name)
        for fn in list(glue.observers):
            fn(glue.layer, record)
    return out


def _call_saved(module, glue, *args, **kwargs):
    if glue.saved is not _MISSING:
        return glue.saved(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _glue_of(module: nn.Module, layer: int) -> _Glue:
    glue = module.__dict__.get(_GLUE)
    if glue is None:
        glue = _Glue(layer, module.__dict__.get("forward", _MISSING))
        module.__dict__[_GLUE] = glue
        module.forward = types.MethodType(_glued_forward, module)
    return glue


def _release_if_idle(module: nn.Module) -> None:
    glue = module.__dict__.get(_GLUE)
    if glue is None or glue.path is not None or glue.observers or glue.act_hook is not None \
            or glue.impl is not None:
        return
    del module.__dict__[_GLUE]
    if glue.saved is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.forward = glue.saved


def _set_glue(module: nn.Module, layer: int, name: str, value, **also) -> None:
    """Set the glue's ``name`` (``path``, ``act_hook`` or ``impl``) to ``value``, and the
    fields in ``also``. None never installs the glue, and gives the module its own forward
    back when nothing is left for the glue to do."""
    glue = module.__dict__.get(_GLUE) if value is None else _glue_of(module, layer)
    if glue is None:
        return
    for field_name, v in {name: value, **also}.items():
        setattr(glue, field_name, v)
    if value is None:
        _release_if_idle(module)


def add_observer(model: nn.Module, layer: int, fn: ExpertsObserver) -> Callable[[], None]:
    """Call ``fn(layer, record)`` after every experts call of ``layer``; returns the remover.

    A layer with no path set runs the ``bf16`` path while observed (the stock forward exposes
    no FC1/FC2 outputs). ``record`` holds ``routing``, ``order``, ``fc1_in``, ``fc1_out``,
    ``fc2_in``, ``fc2_out`` (expert-sorted rows, as :func:`~libalign.gemm.moe_experts_forward`
    gives them), ``moe_in``, ``router_weights``, ``moe_out`` and the ``path`` name.
    """
    module = experts_module(model, layer)
    glue = _glue_of(module, layer)
    glue.observers.append(fn)

    def remove() -> None:
        g = module.__dict__.get(_GLUE)
        if g is not None and fn in g.observers:
            g.observers.remove(fn)
            _release_if_idle(module)

    return remove


@contextmanager
def wrapped_method(modules: Mapping[int, nn.Module], name: str,
                   make: Callable[[int, Callable], Callable]) -> Iterator[None]:
    """While inside, each module's ``name`` method is ``make(key, current method)``: an
    attribute on the instance, never the class, as the glue above sets ``forward``. On exit,
    also when the block raises, each module gets back what it had, in reverse order: its own
    earlier attribute, or the class's method. How routing capture, replay and forcing wrap the
    routers (``forward`` of a Hugging Face router, ``routing`` of a Megatron one)."""
    saved = []
    try:
        for key, module in modules.items():
            saved.append((module, module.__dict__.get(name)))
            setattr(module, name, make(key, getattr(module, name)))
        yield
    finally:
        for module, before in reversed(saved):
            if before is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, before)


# layer-bound activation hook: hook(layer, site, activations, spec, token_of, expert_of)
LayerActivationHook = Callable[..., object]


def set_activation_hook(model: nn.Module, layer: int, hook: LayerActivationHook | None) -> None:
    """Quantize layer ``layer``'s expert activations through ``hook`` (None removes it).

    The hook only acts on layers running a quantized path; see
    :func:`libalign.gemm.moe_experts_forward` for when it is called and what it returns.
    """
    _set_glue(experts_module(model, layer), layer, "act_hook", hook)


def set_experts_impl(model: nn.Module, impl: Callable | None) -> None:
    """Run every MoE layer's experts through ``impl`` instead of
    :func:`libalign.gemm.moe_experts_forward` (same signature; None restores it).

    Strict execution (:mod:`libalign.models.strict`) installs its batch-invariant experts
    here; paths, observers and activation hooks keep working on top of it, and a layer with
    no path set runs ``bf16`` through ``impl``.
    """
    for layer in moe_layer_indices(model):
        _set_glue(experts_module(model, layer), layer, "impl", impl)


_ROW_KEYS = "_libalign_row_keys"


def set_row_keys(model: nn.Module, keys: torch.Tensor | None) -> None:
    """Name the token rows of the next forward calls (int64 ``[batch, seq]``, -1 = padding).

    The scoring and decoding helpers set these (sequence id and position of every token, see
    :func:`libalign.guidance.row_keys`) so that guidance capture and lookup can tell which
    rollout token each expert row belongs to.
    """
    model.__dict__[_ROW_KEYS] = None if keys is None else keys.reshape(-1)


def row_keys_of(model: nn.Module) -> torch.Tensor | None:
    """The flat row keys of the current forward call, if the caller set them."""
    return model.__dict__.get(_ROW_KEYS)


# --- prepared weights -------------------------------------------------------------------------

def _signature(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape))


def prepared_weights(module: nn.Module, path: PathLike) -> tuple[gemm.ExpertWeights, gemm.ExpertWeights]:
    """``(gate_up, down)`` of an experts module prepared for ``path``, cached per weight version."""
    p = gemm.get_path(path)
    cache = module.__dict__.setdefault(_WEIGHTS, {})
    out = []
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name)
        sig = _signature(w)
        hit = cache.get((p, name))
        if hit is None or hit[0] != sig:
            # The entry holds the storage it was made from, so no other tensor can be given the
            # same address while the entry lives: an equal pointer means the same storage.
            hit = (sig, w.detach(), gemm.prepare_weights(w, p))
            cache[(p, name)] = hit
        out.append(hit[2])
    return out[0], out[1]


def install_prepared_weights(module: nn.Module, path: PathLike, name: str,
                             weights: gemm.ExpertWeights) -> None:
    """Make ``prepared_weights`` hand out ``weights`` for ``module.<name>`` on ``path``.

    A sampler that loads converted bits installs them here, so the GEMM multiplies exactly
    the stored codes; the entry stays valid until the parameter changes (its signature).
    """
    p = gemm.get_path(path)
    w = getattr(module, name)
    if tuple(w.shape) != weights.shape:
        raise SpecError(f"{name}: prepared weights of shape {weights.shape} for a parameter of "
                        f"shape {tuple(w.shape)}")
    module.__dict__.setdefault(_WEIGHTS, {})[(p, name)] = (_signature(w), w.detach(), weights)


def clear_weight_cache(model: nn.Module) -> None:
    """Drop every prepared weight stack the glue holds for ``model``."""
    for i in moe_layer_indices(model):
        experts_module(model, i).__dict__.pop(_WEIGHTS, None)


# --- path assignments -------------------------------------------------------------------------

def _resolve(model: nn.Module, path: PathAssignment,
             layers: Iterable[int] | None) -> dict[int, gemm.ExecutionPath | None]:
    moe = moe_layer_indices(model)
    if not moe:
        raise SpecError(f"{type(model).__name__} has no routed-expert layers")
    if isinstance(path, Mapping):
        if layers is not None:
            raise SpecError("give the layers either as the keys of a path dict or as layers=, not both")
        chosen = {}
        for layer, p in path.items():
            experts_module(model, layer)
            chosen[layer] = None if p is None else gemm.get_path(p)
        unknown = [layer for layer in chosen if layer not in moe]
        if unknown:
            raise SpecError(f"layers {unknown} have no routed experts; MoE layers: {moe}")
        return {i: chosen.get(i, gemm.PATHS["bf16"]) for i in moe}
    p = None if path is None else gemm.get_path(path)
    if layers is None:
        return dict.fromkeys(moe, p)
    sel = list(layers)
    for layer in sel:
        experts_module(model, layer)
    if p is None:
        return dict.fromkeys(sel)
    return {i: (p if i in sel else gemm.PATHS["bf16"]) for i in moe}


def _check_backend(backend: str) -> None:
    if backend not in gemm.BACKENDS:
        raise SpecError(f"backend must be one of {gemm.BACKENDS}, got {backend!r}")


def _assign(model: nn.Module, layer: int, path: gemm.ExecutionPath | None, backend: str) -> None:
    _set_glue(experts_module(model, layer), layer, "path", path, backend=backend)


def current_paths(model: nn.Module) -> dict[int, str | None]:
    """The path name each MoE layer runs (``None``: the stock forward)."""
    out = {}
    for i in moe_layer_indices(model):
        glue = experts_module(model, i).__dict__.get(_GLUE)
        out[i] = None if glue is None or glue.path is None else glue.path.name
    return out


def set_path(model: nn.Module, path: PathAssignment, *, backend: str = "auto",
             layers: Iterable[int] | None = None) -> dict[int, str | None]:
    """Make the model's MoE layers run ``path`` until changed; returns the new assignment.

    ``path``: a path name, an :class:`~libalign.gemm.ExecutionPath`, a dict ``{layer: path}``
    (layers not in it run ``bf16``) or ``None`` (stock forward). ``layers`` restricts a single
    path to some layers (the others run ``bf16``; with ``None``, the others stay as they are).
    Everything is validated before anything changes: an unknown path or layer raises
    :class:`~libalign.errors.SpecError`.
    """
    _check_backend(backend)
    plan = _resolve(model, path, layers)
    for layer, p in plan.items():
        _assign(model, layer, p, backend)
    return current_paths(model)


def reset_paths(model: nn.Module) -> None:
    """Give every MoE layer its stock forward back (observers, if any, stay attached)."""
    for i in moe_layer_indices(model):
        _assign(model, i, None, "auto")


@contextmanager
def use_path(model: nn.Module, path: PathAssignment, *, backend: str = "auto",
             layers: Iterable[int] | None = None) -> Iterator[nn.Module]:
    """:func:`set_path` for the duration of a ``with`` block; the previous assignment comes back
    on exit, also when the block raises. Blocks nest."""
    _check_backend(backend)
    plan = _resolve(model, path, layers)
    before = {}
    for i in plan:
        glue = experts_module(model, i).__dict__.get(_GLUE)
        before[i] = (None, "auto") if glue is None else (glue.path, glue.backend)
    try:
        for layer, p in plan.items():
            _assign(model, layer, p, backend)
        yield model
    finally:
        for layer, (p, be) in before.items():
            _assign(model, layer, p, be)
