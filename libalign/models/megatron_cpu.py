"""Every shim that lets Megatron-core run where it was not written to run, in one place.

Megatron-core is written for CUDA devices with Transformer Engine (TE) installed. Its local
(pure PyTorch) modules, though, compute everything with ordinary torch ops, so a small GPT
with MoE layers runs forward and backward on a CPU under a one-process ``gloo`` group once a
few hard-coded CUDA calls are redirected. This module holds all of those redirections, says
what each replaces and why, and undoes them on exit. Nothing else in libalign patches
Megatron.

The shims (found by running a tiny MoE GPT forward and backward on a CPU-only torch build
with megatron-core 0.16.1 until nothing raised; the same set serves 0.19.2)
-------------------------------------------------------------------------------------------
``torch.cuda.current_device`` -> ``torch.device("cpu")``
    Megatron allocates buffers and moves tensors with ``device=torch.cuda.current_device()``
    in many places, unconditionally: RoPE moves its inverse frequencies to "the GPU" on the
    first forward, the router moves its weight, the tensor-parallel gather helpers allocate
    their output there, GPTModel builds index tensors there. On a CPU-only build the call
    raises ("Torch not compiled with CUDA enabled"); returning the CPU device makes each of
    those a no-op move or a CPU allocation.
A no-op CUDA RNG tracker (``tensor_parallel.random._CUDA_RNG_STATE_TRACKER``)
    Megatron keeps named CUDA RNG streams (model-parallel, expert-parallel, data-parallel)
    and *forks* one around every dropout and weight initialization, saving and restoring
    ``torch.cuda`` RNG state. With no CUDA RNG to fork, the tracker here forks nothing: the
    ops inside draw from the CPU generator. Dropout is zero in every model libalign builds,
    and weights are initialized on the CPU (``use_cpu_initialization``), so nothing random
    depends on it.
``fused_softmax.get_default_causal_mask`` -> a CPU mask
    When no attention mask is passed, the unfused softmax builds the causal mask with
    ``device="cuda"`` hard-coded. The replacement builds the same upper-triangular boolean
    mask on the CPU (callers that pass a mask, as libalign's engine does, never reach it).
``torch.cuda.Stream``, ``torch.cuda.current_stream``, ``torch.cuda.stream`` -> :class:`CpuStream`
    The *alltoall* token dispatcher creates a side stream when it is built and copies its
    split sizes to the host on it (``wait_stream``, ``with torch.cuda.stream(s)``,
    ``record_event().synchronize()``). On the CPU every tensor already is on the host and
    every op is synchronous, so one stream that does nothing stands for all of them.
``token_dispatcher.maybe_move_tensor_to_cpu`` -> also turns host tensors into NumPy arrays
    At that same point the dispatcher turns its all-to-all split sizes into NumPy arrays
    (what ``all_to_all_single`` accepts as a list of sizes), but only for CUDA tensors: on
    the CPU they would stay tensors, which ``all_to_all_single`` refuses. The replacement
    converts CPU tensors too when asked for NumPy.

One shim for the training schedules only
----------------------------------------
:func:`cpu_factories` (not part of :func:`cpu_shims`: it puts a Python hook on every torch
call while open) turns ``device="cuda"`` in tensor factories (``torch.zeros``, ``torch.tensor``,
...) into the CPU. Megatron's schedules (``get_forward_backward_func()``'s functions) allocate
their token counter that way; open it around a schedule call. Megatron's optimizer classes
need more than this (they compare ``param.type()`` with ``'torch.cuda.BFloat16Tensor'``) and
have no CPU path here.

One fix that is not about the CPU
---------------------------------
``moe_utils.te_general_gemm`` -> ``None`` when the name is missing
    megatron-core 0.16 imports ``te_general_gemm`` only when TE is installed but tests it
    with ``is not None`` in the router's gating GEMM, so without TE the router raises
    ``NameError`` on any device. 0.19 defines it as ``None``; :func:`fix_missing_te` does the
    same for 0.16 and is applied on GPUs too (it is idempotent and touches nothing when TE
    is present).

What is not a shim
------------------
Choices made through Megatron's own configuration rather than patches: the *allgather* token
dispatcher by default (the *alltoall* one runs under the stream shim above; the *flex* one
needs DeepEP's or HybridEP's CUDA kernels and has no CPU path), no fused
kernels (``bias_activation_fusion``, ``masked_softmax_fusion``, ``bias_dropout_fusion``,
``gradient_accumulation_fusion``, ``apply_rope_fusion``, ``persist_layer_norm`` all off) and
``use_cpu_initialization``. :func:`single_process_group` creates the one-process ``gloo``
group (``nccl`` on a GPU) and Megatron's model-parallel state with every size 1.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from libalign.models.megatron_parallel import free_port

_LOCK = threading.Lock()
_DEPTH = 0
_SAVED: dict[str, object] = {}


class NoopRNGTracker:
    """Stands in for Megatron's ``CudaRNGStatesTracker``: the same methods, no CUDA state."""

    def __init__(self) -> None:
        self.states_: dict = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        """Always initialized: there is nothing to seed."""
        return True

    def reset(self) -> None:
        """Forget the (empty) named states."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        """No CUDA states to hand out."""
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        """Accept and keep whatever a checkpoint restores."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Record the name (Megatron seeds a stream per parallel group)."""
        self.states_[name] = seed
        self.seeds_.add(seed)

    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager:
        """A context that changes nothing: the ops inside use the CPU generator."""
        return contextlib.nullcontext()


class CpuStream:
    """Stands in for a CUDA stream and its events on the CPU, where every op is synchronous."""

    def wait_stream(self, _other) -> None:
        """Nothing to wait for."""

    def wait_event(self, _event) -> None:
        """Nothing to wait for."""

    def record_event(self, _event=None) -> CpuStream:
        """An event already complete (this stream itself: ``synchronize`` returns at once)."""
        return self

    def synchronize(self) -> None:
        """Returns at once."""

    def query(self) -> bool:
        """Always done."""
        return True


_CPU_STREAM = CpuStream()


def _cpu_stream(*_args, **_kwargs) -> CpuStream:
    return _CPU_STREAM


def _cpu_stream_context(_stream=None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


_FACTORIES = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor,
                        torch.arange, torch.zeros_like, torch.ones_like, torch.empty_like})


class CpuFactoryMode(TorchFunctionMode):
    """Tensor factories asked for ``device="cuda"`` (or a CUDA device) allocate on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if func in _FACTORIES and dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = torch.device("cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_factories(enabled: bool | None = None) -> Iterator[None]:
    """:class:`CpuFactoryMode` while inside (``enabled=None``: only without CUDA)."""
    if not (needs_cpu_shims() if enabled is None else enabled):
        yield
        return
    with CpuFactoryMode():
        yield


def fix_missing_te() -> None:
    """Define ``moe_utils.te_general_gemm = None`` where megatron-core 0.16 left it undefined."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _install() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    fix_missing_te()
    _SAVED["current_device"] = torch.cuda.current_device
    _SAVED["tracker"] = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    _SAVED["causal_mask"] = fused_softmax.get_default_causal_mask
    from megatron.core.transformer.moe import token_dispatcher

    _SAVED["host_copy"] = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _SAVED["streams"] = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = \
        _cpu_stream, _cpu_stream, _cpu_stream_context
    torch.cuda.current_device = _cpu_device
    mrandom._CUDA_RNG_STATE_TRACKER = NoopRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    fused_softmax.get_default_causal_mask = _cpu_causal_mask


def _uninstall() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = _SAVED.pop("current_device")
    mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = _SAVED.pop("tracker")
    fused_softmax.get_default_causal_mask = _SAVED.pop("causal_mask")
    torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = _SAVED.pop("streams")
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _SAVED.pop("host_copy")


def needs_cpu_shims() -> bool:
    """True on a machine without a usable CUDA device."""
    return not torch.cuda.is_available()


def shims_active() -> bool:
    """True while some :func:`cpu_shims` block is open."""
    return _DEPTH > 0


@contextlib.contextmanager
def cpu_shims(enabled: bool | None = None) -> Iterator[None]:
    """Apply the CPU shims while inside (``enabled=None``: only without CUDA). Blocks nest;
    the outermost exit restores every patched name. :func:`fix_missing_te` always applies."""
    global _DEPTH
    fix_missing_te()
    if enabled is None:
        enabled = needs_cpu_shims()
    if not enabled:
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _install()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _uninstall()


@contextlib.contextmanager
def single_process_group(backend: str | None = None, *,
                         expert_model_parallel_size: int = 1) -> Iterator[None]:
    """A one-process ``torch.distributed`` group and Megatron's model-parallel state (every
    parallel size 1), destroyed on exit. ``backend`` defaults to ``nccl`` with CUDA, else
    ``gloo``. An already initialized process group is used as is and left alone."""
    from megatron.core import parallel_state

    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=expert_model_parallel_size)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
