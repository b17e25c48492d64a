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
requested expert-parallel size, torn down on exit. Under ``torchrun`` it reads everything from
the environment torchrun sets.

:func:`launch` is the same from Python: it starts ``N`` ranks on this host with torch's own
launcher, the elastic agent behind ``torchrun`` (``torch.distributed.launcher.api.
elastic_launch``: a c10d rendezvous on 127.0.0.1, ``spawn``ed workers, no restarts), runs a
module-level function in each inside :func:`process_group`, and returns what each returned in
rank order. When a rank fails the agent stops the others (they would wait forever in their
next collective) and :func:`launch` raises :class:`DistributedRunError` naming every failed
rank with its error and traceback, or its exit code when it died without one.

NVLink multicast stays off
--------------------------
On the hosts libalign runs on, NVLink SHARP / multicast objects must not be used by NCCL,
torch's symmetric memory or NVSHMEM. :data:`NO_MULTICAST_ENV` holds the three switches;
:func:`process_group` sets them in every rank before any communicator exists, and
:func:`launch` sets them in the parent too, so every process of a run has them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from libalign.errors import ConfigError, DistributedRunError

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
    tp_rank: int = 0
    tp_size: int = 1


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


def check_layout(world_size: int, expert_model_parallel_size: int, backend: str,
                 tensor_model_parallel_size: int = 1) -> None:
    """Refuse a world that cannot be built, before any process starts."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    ep = expert_model_parallel_size
    if ep < 1 or world_size % ep:
        raise ConfigError(f"expert_model_parallel_size {ep} must divide world_size {world_size}")
    tp = tensor_model_parallel_size
    if tp < 1 or world_size % tp:
        raise ConfigError(f"tensor_model_parallel_size {tp} must divide world_size {world_size}")
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
                  timeout_s: float = 600.0, device: str | None = None,
                  tensor_model_parallel_size: int = 1) -> Iterator[RankInfo]:
    """Make this process rank ``rank`` of ``world_size`` with Megatron's parallel state.

    The pipeline-parallel size is 1; the expert-parallel size defaults to the world size.
    ``tensor_model_parallel_size`` splits the dense layers (attention, shared experts);
    experts are never split (expert tensor-parallel size 1), so with ``T`` and ``P`` both 2
    on two ranks, the ranks share the dense layers' work and hold half of the experts each
    (Megatron's "parallel folding").

    ``device`` is where the rank computes: ``cuda`` (GPU ``$LOCAL_RANK``, else ``rank %
    device_count``; the default with ``nccl``, which needs a GPU per rank) or ``cpu`` (the
    default with ``gloo``). ``gloo`` with ``cuda`` lets several ranks share one GPU,
    communicating through host memory: a functional check, not a speed one.

    Under ``torchrun`` call it with no arguments: ``rank``, ``world_size``, ``master_addr`` and
    ``master_port`` default to ``$RANK``, ``$WORLD_SIZE``, ``$MASTER_ADDR`` (else 127.0.0.1)
    and ``$MASTER_PORT`` (every rank must use the same one).
    """
    from megatron.core import parallel_state

    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if rank is None or world_size is None:
        raise ConfigError("process_group needs rank and world_size (or $RANK and $WORLD_SIZE, "
                          "as torchrun sets them)")
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    backend = backend or default_backend()
    ep = world_size if expert_model_parallel_size is None else int(expert_model_parallel_size)
    tp = int(tensor_model_parallel_size)
    check_layout(world_size, ep, backend, tp)
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
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        try:
            yield RankInfo(rank, world_size, parallel_state.get_expert_model_parallel_rank(),
                           parallel_state.get_expert_model_parallel_world_size(), backend, dev,
                           parallel_state.get_tensor_model_parallel_rank(), tp)
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


#: Signals the elastic agent turns into a clean stop of every rank (torchrun's default set).
#: With a ``stop`` event, SIGTERM and SIGINT stay the caller's: its handler sets the event.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: Seconds a rank has to exit after SIGTERM before it is killed.
SHUTDOWN_GRACE_S = 10


def _rank_entry(fn: Callable[..., Any], ep: int, backend: str, device: str | None,
                timeout_s: float, run_dir: str, args: tuple, tp: int = 1) -> Any:
    """What each rank runs: join the group from the agent's environment, call ``fn``.

    The rank's pid goes to ``run_dir`` first (for :func:`launch`'s stop and timeout), and an
    error with its traceback before the exception propagates (for :class:`DistributedRunError`).
    """
    rank = int(os.environ["RANK"])
    (Path(run_dir) / f"rank-{rank:05d}.pid").write_text(str(os.getpid()))
    try:
        with process_group(expert_model_parallel_size=ep, backend=backend, timeout_s=timeout_s,
                           device=device, tensor_model_parallel_size=tp) as info:
            return fn(info, *args)
    except BaseException as e:
        (Path(run_dir) / f"rank-{rank:05d}.err").write_text(
            f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise


class _Watch(threading.Thread):
    """Beside the agent: pass ``stop`` on to rank 0 as SIGTERM (once), and end a run that
    outlives ``timeout_s`` (SIGTERM to every rank, SIGKILL after the grace period)."""

    def __init__(self, run_dir: Path, world_size: int, timeout_s: float, stop):
        super().__init__(name="libalign-launch-watch", daemon=True)
        self.run_dir, self.world_size, self.stop = run_dir, world_size, stop
        self.deadline = time.monotonic() + timeout_s
        self.done = threading.Event()
        self.timed_out = False

    def _pid(self, rank: int) -> int | None:
        try:
            return int((self.run_dir / f"rank-{rank:05d}.pid").read_text())
        except (OSError, ValueError):
            return None

    def _signal(self, ranks, sig) -> None:
        for r in ranks:
            pid = self._pid(r)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def run(self) -> None:
        forwarded = False
        termed: dict[int, float] = {}  # rank -> when it was sent SIGTERM (after the deadline)
        while not self.done.wait(0.2):
            asked = self.stop is not None and self.stop.is_set() and not forwarded
            if asked and self._pid(0) is not None:  # rank 0 ends its step, releases the others
                self._signal([0], signal.SIGTERM)
                forwarded = True
            now = time.monotonic()
            if now > self.deadline:  # ranks may still be starting: keep at it until all ended
                self.timed_out = True
                fresh = [r for r in range(self.world_size)
                         if r not in termed and self._pid(r) is not None]
                self._signal(fresh, signal.SIGTERM)
                termed.update(dict.fromkeys(fresh, now))
                self._signal([r for r, t in termed.items() if now - t > SHUTDOWN_GRACE_S],
                             signal.SIGKILL)


def _failure_report(failures: dict, run_dir: Path) -> list[str]:
    """One entry per failed rank: its error and traceback, or how it ended without one."""
    out = []
    for rank in sorted(failures):
        err = run_dir / f"rank-{rank:05d}.err"
        if err.is_file():
            out.append(f"rank {rank}: {err.read_text().rstrip()}")
        else:
            out.append(f"rank {rank}: no result (exit code {failures[rank].exitcode})")
    return out


@contextlib.contextmanager
def _caller_signals_kept(names: tuple[str, ...]) -> Iterator[None]:
    """Restore the handlers (and the agent's environment switch) the elastic agent replaces."""
    main = threading.current_thread() is threading.main_thread()
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names} if main else {}
    env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    try:
        yield
    finally:
        for n, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, n), handler)
        if env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = env


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
           expert_model_parallel_size: int | None = None, backend: str | None = None,
           device: str | None = None, timeout_s: float = 600.0, stop=None,
           tensor_model_parallel_size: int = 1) -> list[Any]:
    """Run ``fn(rank_info, *args)`` in ``world_size`` fresh processes; return their results.

    The ranks are started by torch's elastic agent (what ``torchrun`` runs), on this host,
    without restarts. ``fn`` must be importable by name (a module-level function), and its
    arguments and result picklable. Results come back in rank order. Any rank that raises,
    or dies without a result, makes the whole call raise :class:`DistributedRunError` naming
    the ranks and their errors; the agent stops the other ranks. ``device``: see
    :func:`process_group`, as is ``tensor_model_parallel_size``.

    ``stop`` (a ``threading.Event``, e.g. set by the caller's SIGTERM handler) is passed on to
    rank 0 as SIGTERM, once: a driving rank 0 can then end cleanly and release the others;
    SIGTERM and SIGINT then stay the caller's. Without ``stop`` the agent handles them, as
    torchrun does: the ranks are stopped and the signal's exception propagates. ``timeout_s``
    bounds the whole run (a long training run wants a large one).
    """
    backend = backend or default_backend()
    ep = world_size if expert_model_parallel_size is None else int(expert_model_parallel_size)
    tp = int(tensor_model_parallel_size)
    check_layout(world_size, ep, backend, tp)
    no_multicast_env()  # in this process too, so every process of the run has them
    agent_signals = AGENT_SIGNALS if stop is None else ("SIGHUP", "SIGQUIT")
    with tempfile.TemporaryDirectory(prefix="libalign-launch-") as tmp:
        run_dir = Path(tmp)
        options = {"signals_to_handle": ",".join(agent_signals),
                   "shutdown_timeout": SHUTDOWN_GRACE_S}
        known = {f.name for f in dataclasses.fields(LaunchConfig)}  # torch 2.11: no shutdown_timeout
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
            max_restarts=0, start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs")),
            **{k: v for k, v in options.items() if k in known})
        watch = _Watch(run_dir, world_size, timeout_s, stop)
        watch.start()
        try:
            with _caller_signals_kept(AGENT_SIGNALS):
                values = elastic_launch(config, _rank_entry)(fn, ep, backend, device, timeout_s,
                                                             str(run_dir), args, tp)
        except ChildFailedError as e:
            errors = _failure_report(e.failures, run_dir)
            why = f" (timed out after {timeout_s:g} s)" if watch.timed_out else ""
            raise DistributedRunError(f"{len(errors)} of {world_size} ranks failed{why}:\n"
                                      + "\n".join(errors)) from None
        finally:
            watch.done.set()
            watch.join()
        return [values[r] for r in range(world_size)]
