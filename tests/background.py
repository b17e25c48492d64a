"""Slow subprocesses of some tests, started in the background as soon as those tests are collected.

A few tests spend most of their time waiting for one subprocess they start and then check: nvcc
builds (tests/libalign/native_builds.py), the SGLang CPU script (test_sglang_quant), a torchrun
world (test_megatron_ep). pytest itself keeps about one core busy, so on a two-core machine that
waiting can overlap the rest of the run. A test module registers such a subprocess as a
:class:`Job` (:func:`register`, at import); when the collected tests include one that needs it,
tests/conftest.py queues the job (the jobs run one at a time, on a worker thread, in the order
their tests come) and moves the tests that wait for jobs to the end of the run. The test then
takes the job's :class:`Finished` result (:func:`result`, which waits) and checks it as it
would its own subprocess; a test run alone starts its job itself, the same way.

Every job gets a folder of its own under one temporary folder of the session, removed at the
end; a job still running then is killed (its whole process group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Job:
    """A subprocess some tests wait for: the node id parts of those tests, why it cannot run
    here (None: it can; the tests skip with the same reason), and its command and environment
    (the whole environment the process gets) given its folder; it runs in the repository
    root, or in its folder with ``in_folder``.

    ``command`` is called when the job is queued (at collection, before any test has changed
    the environment), not when it starts; an argument that must be fresh when the process
    starts (a free port) may be a callable, called then."""

    tests: tuple[str, ...]
    gap: Callable[[], str | None]
    command: Callable[[Path], tuple[list, dict[str, str]]]
    timeout_s: float = 900.0
    in_folder: bool = False


@dataclass(frozen=True)
class Finished:
    """What a job's subprocess left: exit status, output, its folder and how long it ran."""

    returncode: int
    stdout: str
    stderr: str
    folder: Path
    seconds: float

    def tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the output (stdout, then stderr), for a failure."""
        return (self.stdout + self.stderr)[-n:]


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None
    root: Path | None = None
    futures: dict[str, Future] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    stopped: bool = False


JOBS: dict[str, Job] = {}
_state = _State()


def register(name: str, job: Job) -> Job:
    """Make ``job`` known under ``name`` (a test module does this when it is imported)."""
    JOBS[name] = job
    return job


def waits(nodeid: str) -> bool:
    """Whether the test ``nodeid`` waits for a registered job."""
    return any(t in nodeid for job in JOBS.values() for t in job.tests)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the job's process group (the group outlives its leader while children run)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run(job: Job, folder: Path, cmd: list, env: dict[str, str]) -> Finished:
    with _state.lock:
        if _state.stopped:
            raise RuntimeError("the session's background jobs were stopped")
        cmd = [str(a()) if callable(a) else a for a in cmd]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=folder if job.in_folder else ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        _state.procs.append(proc)
    try:
        out, err = proc.communicate(timeout=job.timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        err += f"\n(killed after {job.timeout_s:g} s)"
    return Finished(proc.returncode, out, err, folder, time.perf_counter() - start)


def start(names: Iterable[str]) -> None:
    """Queue the jobs ``names`` (run one at a time, in this order) unless queued already; their
    commands and environments are taken now."""
    with _state.lock:
        _state.stopped = False
        if _state.pool is None:
            _state.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-job")
            _state.root = Path(tempfile.mkdtemp(prefix="libalign-test-jobs-"))
        for name in names:
            if name not in _state.futures:
                job = JOBS[name]
                folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_state.root))
                cmd, env = job.command(folder)
                _state.futures[name] = _state.pool.submit(_run, job, folder, cmd, env)


def start_for(nodeids: Iterable[str]) -> None:
    """Queue, in the order of ``nodeids``, the jobs those tests wait for that can run here."""
    wanted: list[str] = []
    for nodeid in nodeids:
        for name, job in JOBS.items():
            if name not in wanted and any(t in nodeid for t in job.tests):
                wanted.append(name)
    start([name for name in wanted if JOBS[name].gap() is None])


def result(name: str) -> Finished:
    """Job ``name``'s result, waiting for it (and starting it when nothing has)."""
    start([name])
    return _state.futures[name].result()


def stop() -> None:
    """Kill the jobs still running and remove the session's folder (by a detached ``rm``: a
    job's folder may hold whole virtual environments, and pytest need not wait for that)."""
    with _state.lock:
        _state.stopped = True
        pool, root, procs = _state.pool, _state.root, list(_state.procs)
        for f in _state.futures.values():
            f.cancel()
        _state.pool, _state.root = None, None
        _state.futures.clear()
        _state.procs.clear()
    for proc in procs:
        _kill(proc)
    if pool is not None:
        pool.shutdown(wait=True)
    if root is not None:
        subprocess.Popen(["rm", "-rf", str(root)], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
