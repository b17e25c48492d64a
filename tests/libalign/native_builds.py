"""The nvcc builds of the build tests, started in the background once those tests are collected.

``test_gemm_sm100_build`` and ``test_native_build`` compile three CUDA libraries with nvcc
(the CUTLASS grouped GEMM for sm_100a, the same source for sm_90, the quantize kernels for
sm_90 and sm_100a): 30 to 100 s of one CPU core each, most of it cicc and ptxas. pytest keeps
about one core busy, so when the collected tests include them (tests/libalign/conftest.py)
the builds run one after the other on a worker thread, beside the tests that come first; a
test then waits for its build (:func:`result`), and checks it as it would its own build. A
test run alone starts its build itself. Every build writes under one temporary folder of the
session (never the user's kernel cache), removed at the end with any build still running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from libalign import _native

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Built:
    """What a background build left: its exit status, output, folder and seconds."""

    returncode: int
    output: str
    folder: Path
    seconds: float

    @property
    def path(self) -> Path:
        """The library ``_native.build`` printed (its last output line)."""
        return Path(self.output.strip().splitlines()[-1])


def nvcc_gap() -> str | None:
    """Why no nvcc build can run here, or None."""
    return None if shutil.which("nvcc") else "nvcc not installed"


def nvcc_sm100_gap() -> str | None:
    """Why no sm_100a build can run here (no nvcc, or one without compute_100), or None."""
    gap = nvcc_gap()
    if gap is None and "compute_100" not in _native.nvcc_archs(shutil.which("nvcc")):
        gap = "this nvcc cannot target sm_100a"
    return gap


def cutlass_gap() -> str | None:
    """Why the CUTLASS headers cannot be used here, or None."""
    try:
        _native.find_cutlass()
    except _native.KernelBuildError as exc:
        return f"CUTLASS headers absent: {exc}"
    return None


def sm100_gap() -> str | None:
    """Why the CUTLASS GEMM builds cannot run here, or None."""
    return nvcc_sm100_gap() or cutlass_gap()


def cuda_archs() -> str:
    """``ALIGN_CUDA_ARCHS`` of the quantize build: sm_90, and sm_100a where nvcc knows it."""
    return "90,100a" if "compute_100" in _native.nvcc_archs(shutil.which("nvcc")) else "90"


def variant_command(out: Path, arch_flag: str, *extra: str) -> list[str]:
    """gemm_nvfp4_sm100.cu's build command (``_native.build_command``) with another
    ``-gencode`` and extra flags (``-D...``), writing ``out``."""
    src = _native.CSRC / _native.SOURCES["gemm_sm100"]
    cmd = [arch_flag if a.startswith("-gencode") else a
           for a in _native.build_command("gemm_sm100", src, out)]
    cmd[1:1] = list(extra)
    return cmd


def _build_in_process(kind: str) -> list[str]:
    return [sys.executable, "-c", f"from libalign import _native; print(_native.build({kind!r}))"]


@dataclass(frozen=True)
class Job:
    """A build: the tests that need it (node id parts), why it cannot run here, and its
    command and environment given its folder."""

    tests: tuple[str, ...]
    gap: Callable[[], str | None]
    command: Callable[[Path], tuple[list[str], dict[str, str]]]


JOBS = {
    "gemm_sm100": Job(("test_gemm_sm100_build.py::test_sm100a_library_compiles",), sm100_gap,
                      lambda d: (_build_in_process("gemm_sm100"), {"ALIGN_KERNEL_CACHE": str(d)})),
    "gemm_sm100_for_sm90": Job(("test_gemm_sm100_build.py::test_other_arch_build",), sm100_gap,
                               lambda d: (variant_command(d / "libvariant.so",
                                                          "-gencode=arch=compute_90,code=sm_90"),
                                          {})),
    "cuda": Job(("test_native_build.py::test_cuda_source_compiles",), nvcc_gap,
                lambda d: (_build_in_process("cuda"),
                           {"ALIGN_KERNEL_CACHE": str(d), "ALIGN_CUDA_ARCHS": cuda_archs()})),
}

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_futures: dict[str, Future] = {}
_procs: list[subprocess.Popen] = []
_root: Path | None = None
_stopped = False


def _run(name: str) -> Built:
    with _lock:
        if _stopped:
            raise RuntimeError("the session's builds were stopped")
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_root))
        cmd, env = JOBS[name].command(folder)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: nvcc's children too
        _procs.append(proc)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
    return Built(proc.returncode, out, folder, time.perf_counter() - start)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the build's process group (the group outlives its leader while nvcc runs)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def start(names) -> None:
    """Queue the builds ``names`` (in that order, one at a time) unless queued already."""
    global _pool, _root, _stopped
    with _lock:
        _stopped = False
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvcc-build")
            _root = Path(tempfile.mkdtemp(prefix="libalign-test-builds-"))
        for name in names:
            if name not in _futures:
                _futures[name] = _pool.submit(_run, name)


def start_for(nodeids) -> None:
    """Queue the builds that the collected tests ``nodeids`` need and that can run here."""
    ids = list(nodeids)
    start([name for name, job in JOBS.items()
           if any(t in i for t in job.tests for i in ids) and job.gap() is None])


def result(name: str) -> Built:
    """Build ``name``'s result, waiting for it (and starting it when nothing has)."""
    start([name])
    return _futures[name].result()


def stop() -> None:
    """Kill the builds still running and remove the session's folder."""
    global _pool, _root, _stopped
    with _lock:
        _stopped = True
        pool, root, procs = _pool, _root, list(_procs)
        for f in _futures.values():
            f.cancel()
        _pool, _root = None, None
        _futures.clear()
        _procs.clear()
    for proc in procs:
        _kill(proc)
    if pool is not None:
        pool.shutdown(wait=True)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
