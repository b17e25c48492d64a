"""The one typed configuration of libalign's kernels and fused passes.

Which kernels serve, where they are built and which fused GPU passes run are choices of the
process, not of a call, and every one of them gives the same bits (the spec is pinned bitwise;
a fused pass and its unfused twin agree exactly). They live in one frozen
:class:`KernelConfig`, read from the environment once, at the edge:

* a process's configuration is read from its ``ALIGN_*`` variables on first use (or set
  with :func:`configure`, which the ``alignd`` commands call at start);
* :func:`scoped` changes fields inside a ``with`` block (the current thread and the tasks it
  starts), which is how tests and benchmarks compare a fused pass with its unfused twin;
* code reads :func:`current`, never ``os.environ``.

:func:`variables` lists every variable with its type, default and meaning; the settings page
of the docs is generated from it and from the daemon's settings classes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from libalign.errors import ConfigError


@dataclass(frozen=True)
class KernelConfig:
    """Every process-wide kernel choice (each field's variable is in :func:`variables`)."""

    kernels: str = "auto"
    """``auto``: compiled kernels where they build and serve; ``spec``: the reference serves
    every call (no compiler needed)."""
    cpu_kernel: str | None = None
    """the CPU kernel's SIMD path (``avx512``, ``avx2``, ``scalar``); None: the best the CPU has"""
    cpu_march: str | None = None
    """``-march`` of the CPU build (``native`` for a host-specific build); None: portable x86-64"""
    cuda_archs: str = "native"
    """CUDA architectures the CUDA kernels are built for (``native``, ``all`` or a list)"""
    kernel_cache: Path | None = None
    """where built kernels are cached; None: ``~/.cache/libalign/kernels``"""
    cutlass_dir: Path | None = None
    """CUTLASS sources for the Blackwell GEMM; None: the ``nvidia-cutlass`` package's"""
    nvcc: str | None = None
    """the CUDA compiler; None: ``nvcc`` on the PATH"""
    cxx: str = "g++"
    """the C++ compiler of the CPU kernels"""
    gemm_chunks: int = 1
    """chunks the Triton W4A4 GEMM splits a call into to overlap the activation pass"""
    triton_decode: bool = True
    """decode bf16 inner values with the Triton pass (off: the table gather, same bits)"""
    fused_guidance: bool = True
    """round guided activations inside the Triton activation pass (off: quantize first)"""
    fused_kv: bool = True
    """quantize and read back FP4 K/V in one Triton pass (off: the unfused ops, same bits)"""
    model_cache: Path | None = None
    """where the tiny model is trained once and cached; None: ``~/.cache/libalign/models``"""

    def __post_init__(self) -> None:
        if self.kernels not in ("auto", "spec"):
            raise ConfigError(f"ALIGN_KERNELS={self.kernels}: expected auto or spec")
        if self.gemm_chunks < 1:
            raise ConfigError(f"ALIGN_GEMM_CHUNKS={self.gemm_chunks}: expected a positive count")


@dataclass(frozen=True)
class Variable:
    """One environment variable of :class:`KernelConfig`: its field, type and default."""

    name: str
    field: str
    type: str
    default: str
    description: str


_ENV = {  # field -> environment variable
    "kernels": "ALIGN_KERNELS", "cpu_kernel": "ALIGN_CPU_KERNEL", "cpu_march": "ALIGN_CPU_MARCH",
    "cuda_archs": "ALIGN_CUDA_ARCHS", "kernel_cache": "ALIGN_KERNEL_CACHE",
    "cutlass_dir": "ALIGN_CUTLASS_DIR", "nvcc": "NVCC", "cxx": "CXX",
    "gemm_chunks": "ALIGN_GEMM_CHUNKS", "triton_decode": "ALIGN_TRITON_DECODE",
    "fused_guidance": "ALIGN_FUSED_GUIDANCE", "fused_kv": "ALIGN_FUSED_KV",
    "model_cache": "ALIGN_MODEL_CACHE",
}


def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(KernelConfig)).body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(
                nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def variables() -> tuple[Variable, ...]:
    """Every variable :class:`KernelConfig` reads, in field order (made on first call, from the
    field docstrings in this file: only the settings page asks)."""
    docs = _field_docs()
    out = []
    for f in dataclasses.fields(KernelConfig):
        default = f.default
        out.append(Variable(_ENV[f.name], f.name, str(f.type).replace("'", ""),
                            "unset" if default is None else str(default).lower()
                            if isinstance(default, bool) else str(default), docs.get(f.name, "")))
    return tuple(out)



def _parse(field: dataclasses.Field, name: str, raw: str):
    text = raw.strip()
    kind = str(field.type)
    if kind == "bool":
        if text.lower() in ("1", "true", "on", "yes"):
            return True
        if text.lower() in ("0", "false", "off", "no"):
            return False
        raise ConfigError(f"{name}={raw}: expected 0 or 1")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}={raw}: expected an integer") from None
    if not text:
        return None if "None" in kind else field.default
    if "Path" in kind:
        return Path(text).expanduser()
    return text.lower() if field.name in ("kernels", "cpu_kernel", "cuda_archs") else text


def from_env(environ: Mapping[str, str] | None = None) -> KernelConfig:
    """The configuration ``environ`` (default ``os.environ``) describes; ConfigError names a
    variable whose value does not parse."""
    env = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(KernelConfig):
        name = _ENV[f.name]
        if name in env:
            values[f.name] = _parse(f, name, env[name])
    return KernelConfig(**values)


_lock = threading.Lock()
_process: KernelConfig | None = None
_scoped: contextvars.ContextVar[KernelConfig | None] = contextvars.ContextVar(
    "libalign_kernel_config", default=None)


def current() -> KernelConfig:
    """The configuration in force: the innermost :func:`scoped` one, else the process's (read
    from the environment on first use)."""
    scoped_config = _scoped.get()
    if scoped_config is not None:
        return scoped_config
    global _process
    with _lock:
        if _process is None:
            _process = from_env()
        return _process


def configure(config: KernelConfig | None) -> None:
    """Set the process's configuration (None: read the environment again at the next use)."""
    global _process
    with _lock:
        _process = config


@contextlib.contextmanager
def scoped(**changes) -> Iterator[KernelConfig]:
    """The current configuration with ``changes`` inside the block (this thread and the tasks
    it starts); e.g. ``with scoped(fused_kv=False):``."""
    config = dataclasses.replace(current(), **changes)
    token = _scoped.set(config)
    try:
        yield config
    finally:
        _scoped.reset(token)
