"""Several processes, one Megatron expert-parallel group: starting them and joining them.

Expert parallelism in one picture
---------------------------------
With ``P`` processes (ranks) and expert-parallel size ``P``, every rank holds the whole dense
model (embeddings, attention, norms, routers: replicated, as data parallelism replicates them)
and ``E/P`` of each MoE layer's ``E`` experts. Each rank feeds its own micro-batch. In every MoE
layer the *allgather* token dispatcher gathers all ranks' tokens (``all_gather``), each rank runs
its local experts on the tokens routed to them, and the partial outputs are summed back to the
rank that owns each token (``reduce_scatter``). Backward mirrors it. Expert weights get
gradients from every rank's tokens without any further reduction; the replicated dense weights
would be all-reduced by a data-parallel optimizer (the benchmark here times forward and backward
only, so it leaves them alone).

What this module provides
-------------------------
:func:`process_group` turns the current process into rank ``r`` of ``N``: ``torch.distributed``
(``nccl`` with one GPU per rank, ``gloo`` on CPUs) plus Megatron's model-parallel state with the
requested expert-parallel size, torn down on exit. :func:`launch` starts ``N`` such processes
(``spawn``: no state is inherited), runs a module-level function in each and returns what each
returned, or raises :class:`DistributedRunError` with the failing ranks' tracebacks.

NVLink multicast stays off
--------------------------
On the hosts libalign runs on, NVLink SHARP / multicast objects must not be used by NCCL,
torch's symmetric memory or NVSHMEM. :data:`NO_MULTICAST_ENV` holds the three switches;
:func:`process_group` sets them in every rank before any communicator exists, and
:func:`launch` sets them in the parent too, so every process of a run has them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DistributedRunError

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: its rank, the world, its expert-parallel place, its device."""

    rank: int
    world_size: int
    ep_rank: int
    ep_size: int
    backend: str
    device: torch.device


def no_multicast_env() -> dict[str, str]:
    """Set :data:`NO_MULTICAST_ENV` in this process's environment; return it."""
    os.environ.update(NO_MULTICAST_ENV)
    return dict(NO_MULTICAST_ENV)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_layout(world_size: int, expert_model_parallel_size: int, backend: str) -> None:
    """Refuse a world that cannot be built, before any process starts."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    ep = expert_model_parallel_size
    if ep < 1 or world_size % ep:
        raise ConfigError(f"expert_model_parallel_size {ep} must divide world_size {world_size}")
    if backend == "nccl":
        have = torch.cuda.device_count()
        if have < world_size:
            raise ConfigError(f"nccl needs one GPU per rank: world_size {world_size}, "
                              f"{have} GPU(s) visible")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {v!r}") from None


@contextlib.contextmanager
def process_group(rank: int | None = None, world_size: int | None = None, *,
                  expert_model_parallel_size: int | None = None, backend: str | None = None,
                  master_addr: str | None = None, master_port: int | None = None,
                  timeout_s: float = 600.0, device: str | None = None) -> Iterator[RankInfo]:
    """Make this process rank ``rank`` of ``world_size`` with Megatron's parallel state.

    Tensor and pipeline parallel sizes are 1; the expert-parallel size defaults to the world
    size. ``device`` is where the rank computes: ``cuda`` (GPU ``$LOCAL_RANK``, else ``rank %
    device_count``; the default with ``nccl``, which needs a GPU per rank) or ``cpu`` (the
    default with ``gloo``). ``gloo`` with ``cuda`` lets several ranks share one GPU,
    communicating through host memory: a functional check, not a speed one.

    Under ``torchrun`` call it with no arguments: ``rank``, ``world_size``, ``master_addr`` and
    ``master_port`` default to ``$RANK``, ``$WORLD_SIZE``, ``$MASTER_ADDR`` (else 127.0.0.1)
    and ``$MASTER_PORT`` (every rank must use the same one).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if rank is None or world_size is None:
        raise ConfigError("process_group needs rank and world_size (or $RANK and $WORLD_SIZE, "
                          "as torchrun sets them)")
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    backend = backend or default_backend()
    ep = world_size if expert_model_parallel_size is None else int(expert_model_parallel_size)
    check_layout(world_size, ep, backend)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world_size {world_size}")
    if dist.is_initialized():
        raise ConfigError("a torch.distributed process group already exists in this process")
    no_multicast_env()
    os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    elif "MASTER_PORT" not in os.environ:
        raise ConfigError("process_group needs master_port (or $MASTER_PORT) shared by all ranks")
    kind = device or ("cuda" if backend == "nccl" else "cpu")
    if kind not in ("cuda", "cpu") or (kind == "cpu" and backend == "nccl"):
        raise ConfigError(f"device must be 'cuda' or 'cpu' ('cuda' with nccl), got {device!r}")
    dev = torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for, but CUDA is not available")
        local = _env_int("LOCAL_RANK")
        dev = torch.device("cuda", (rank if local is None else local) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep)
        try:
            yield RankInfo(rank, world_size, parallel_state.get_expert_model_parallel_rank(),
                           parallel_state.get_expert_model_parallel_world_size(), backend, dev)
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., Any], world_size: int, ep: int, backend: str,
           device: str | None, port: int, timeout_s: float, out_dir: str, args: tuple) -> None:
    """What each spawned rank runs: join the group, call ``fn``, leave its result on disk."""
    out = Path(out_dir) / f"rank-{rank:05d}.pkl"
    try:
        with process_group(rank, world_size, expert_model_parallel_size=ep, backend=backend,
                           master_port=port, timeout_s=timeout_s, device=device) as info:
            result = ("ok", fn(info, *args))
    except BaseException as e:
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        out.write_bytes(pickle.dumps(result))
        raise
    out.write_bytes(pickle.dumps(result))


def _join(procs, timeout_s: float, stop_on_failure: bool, stop=None) -> str | None:
    """Wait for every process; stop the rest when one fails (if asked) or time runs out;
    pass a set ``stop`` event on to rank 0 as SIGTERM (once)."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    why = None
    forwarded = False
    while any(p.is_alive() for p in procs):
        if stop is not None and stop.is_set() and not forwarded and procs[0].is_alive():
            procs[0].terminate()  # SIGTERM: rank 0 finishes its step and releases the others
            forwarded = True
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"timed out after {timeout_s:g} s"
        elif stop_on_failure and any(p.exitcode not in (None, 0) for p in procs):
            why = "a rank failed; the others were stopped"
        if why is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
            break
        wait([p.sentinel for p in procs if p.is_alive()], timeout=min(left, 1.0))
    return why


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
           expert_model_parallel_size: int | None = None, backend: str | None = None,
           device: str | None = None, timeout_s: float = 600.0,
           stop_on_failure: bool = True, stop=None) -> list[Any]:
    """Run ``fn(rank_info, *args)`` in ``world_size`` fresh processes; return their results.

    ``fn`` must be importable by name (a module-level function), and its result picklable.
    Results come back in rank order. Any rank that raises, or dies without a result, makes
    the whole call raise :class:`DistributedRunError` naming the ranks and their errors.
    When one rank fails the others are stopped (they would wait forever in their next
    collective), unless ``stop_on_failure`` is False. ``device``: see :func:`process_group`.
    ``stop`` (a ``threading.Event``, e.g. set by the caller's SIGTERM handler) is passed on to
    rank 0 as SIGTERM, once: a driving rank 0 can then end cleanly and release the others.
    ``timeout_s`` bounds the whole run (a long training run wants a large one).
    """
    import torch.multiprocessing as mp

    backend = backend or default_backend()
    ep = world_size if expert_model_parallel_size is None else int(expert_model_parallel_size)
    check_layout(world_size, ep, backend)
    no_multicast_env()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="libalign-launch-") as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, ep, backend, device, port,
                                               timeout_s, out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        why = _join(ctx.processes, timeout_s + 30.0, stop_on_failure, stop)
        results, errors = [], []
        for r, p in enumerate(ctx.processes):
            f = Path(out_dir) / f"rank-{r:05d}.pkl"
            if not f.is_file():
                errors.append(f"rank {r}: no result (exit code {p.exitcode})")
                continue
            status, value = pickle.loads(f.read_bytes())
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {r}: {value}")
        if errors or why is not None:
            head = f"{len(errors)} of {world_size} ranks failed" + (f" ({why})" if why else "")
            raise DistributedRunError(head + ":\n" + "\n".join(errors))
        return results
