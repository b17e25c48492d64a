"""Building and loading the compiled kernels in ``csrc/`` (for :mod:`libalign.kernels` and
:mod:`libalign.gemm.cutlass_grouped`).

The kernels export a plain C ABI (``csrc/nvfp4_abi.h``) and are loaded with ctypes, so a
build is a single ``g++`` or ``nvcc`` call with no Python or PyTorch headers: seconds for
the CPU library, about half a minute for the CUDA one. Builds are cached under
``$ALIGN_KERNEL_CACHE`` (default ``~/.cache/libalign/kernels``) in a file named by a hash
of the sources, the compiler's version and the flags, and written by rename so concurrent
first uses are safe. When a compiler is missing or a build fails, :func:`load` returns
``None``, warns once and keeps the reason (:func:`unavailable_reason`, what
:func:`libalign.kernels.backends` reports); the caller then uses the spec.
``ALIGN_KERNELS=spec`` disables the compiled kernels altogether.

The CPU library and the host's CPU
----------------------------------
The CPU library is built for the baseline x86-64, not ``-march=native``: it holds three
instruction-set paths (scalar; AVX2 + F16C; AVX-512 F/BW/VL/DQ), each compiled for its own
target, and picks the best one this CPU supports when it runs (:func:`cpu_path`). So the
build does not depend on the host, the CPU's features are not part of its cache key, and a
cached library that travels to another x86-64 host runs there. ``ALIGN_CPU_KERNEL``
(``scalar``, ``avx2`` or ``avx512``) forces a path for the process, and
:func:`set_cpu_path` does at run time; a path this CPU lacks is refused with a
:class:`~libalign.errors.ConfigError`. ``ALIGN_CPU_MARCH`` still adds a ``-march=`` for
the portable parts (with ``native`` the CPU's flags join the cache key again).

Where the sources are (:data:`CSRC`): an installed wheel carries them as the package
``libalign.csrc`` (``site-packages/libalign/csrc/``); in a checkout (also an editable install)
they are the repository's ``csrc/`` beside the ``libalign/`` folder.

The native Blackwell grouped GEMM (kind ``gemm_sm100``, ``csrc/gemm_abi.h``) also needs the
CUTLASS headers (see :func:`find_cutlass` below), is built for sm_100a only (about a minute)
and has no spec to fall back on: :func:`load_or_raise` returns it or says why it cannot.

Where the CUTLASS headers come from
-----------------------------------
CUTLASS is header-only, so building ``csrc/gemm_nvfp4_sm100.cu`` needs nothing but two
include folders: ``include`` (``cute/`` and ``cutlass/``) and ``tools/util/include``
(``cutlass/util/``). :func:`find_cutlass` looks, in this order:

1. ``$ALIGN_CUTLASS_DIR``: the root of a CUTLASS source tree (a git checkout, or the
   ``source`` folder of the wheel) holding both folders. When it is set it must be right:
   a wrong path is an error, not a silent fallback to another copy.
2. The installed ``nvidia-cutlass`` PyPI package (the ``gpu`` / ``cutlass`` extras), whose
   ``cutlass_library`` package carries the headers under ``cutlass_library/source``. It is
   located without being imported.

Anything else raises :class:`KernelBuildError` saying how to get them. The version is read
from ``cutlass/version.h``; the kernel is written against the 4.x block-scaled grouped API
and is tested to compile with :data:`CUTLASS_MIN_VERSION`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from libalign.errors import ConfigError
from libalign.kernels import config


def _find_csrc() -> Path:
    """The kernel sources: ``libalign/csrc`` of an installed wheel, else the checkout's ``csrc/``."""
    package = Path(__file__).resolve().parent.parent  # libalign/
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "nvfp4_abi.h").is_file():
            return candidate
    return package / "csrc"  # neither holds them: build() says which file is missing


CSRC = _find_csrc()
HEADERS = ("nvfp4_abi.h", "nvfp4_math.h")
SOURCES = {"cpu": "quantize_cpu.cpp", "cuda": "quantize_cuda.cu",
           "gemm_sm100": "gemm_nvfp4_sm100.cu"}
# Headers only one kind includes (they join that kind's cache key).
KIND_HEADERS = {"gemm_sm100": ("gemm_abi.h",),
                "cpu": ("quantize_cpu_rows.h", "quantize_cpu_avx2.h", "quantize_cpu_avx512.h"),
                "cuda": ("quantize_cuda_mx.h",)}


class NvParams(ctypes.Structure):
    """Mirror of ``NvParams`` in csrc/nvfp4_abi.h (field order and types must match)."""

    _fields_ = [
        ("experts", ctypes.c_int64), ("rows", ctypes.c_int64), ("k", ctypes.c_int64),
        ("in_dtype", ctypes.c_int32), ("op_order", ctypes.c_int32),
        ("outer_mode", ctypes.c_int32), ("outer_stride", ctypes.c_int32),
        ("store_conv", ctypes.c_int32), ("has_amax_floor", ctypes.c_int32),
        ("amax_floor", ctypes.c_float), ("block_scale_floor", ctypes.c_float),
        ("has_zero_prescale", ctypes.c_int32), ("zero_prescale_to", ctypes.c_float),
        ("zero_saturate", ctypes.c_int32), ("signed_zero", ctypes.c_int32),
        ("nonfinite_saturate", ctypes.c_int32), ("in_max", ctypes.c_float),
        ("swizzled", ctypes.c_int32), ("e4m3_max", ctypes.c_float),
        ("four_over_six", ctypes.c_int32), ("four_over_six_error", ctypes.c_int32),
        ("gather", ctypes.c_void_p),
    ]


class GemmSm100Args(ctypes.Structure):
    """Mirror of ``NvGemmSm100Args`` in csrc/gemm_abi.h (field order and types must match)."""

    _fields_ = [
        ("experts", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
        ("a_dec_per_row", ctypes.c_int32), ("w_dec_mode", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("row_offsets", ctypes.c_void_p), ("a_codes", ctypes.c_void_p),
        ("a_scales", ctypes.c_void_p), ("a_dec", ctypes.c_void_p),
        ("w_codes", ctypes.c_void_p), ("w_scales", ctypes.c_void_p),
        ("w_dec", ctypes.c_void_p), ("out", ctypes.c_void_p),
    ]


class KernelBuildError(RuntimeError):
    """A kernel library could not be built or loaded (the spec is used instead)."""


# --- the CUTLASS headers (the native Blackwell GEMM only) --------------------------------------

CUTLASS_ENV = "ALIGN_CUTLASS_DIR"
CUTLASS_MIN_VERSION = (4, 2)


@dataclass(frozen=True)
class CutlassHeaders:
    """The two include folders of one CUTLASS copy and its version."""

    root: Path
    include: Path
    util_include: Path
    version: tuple[int, int, int]

    def flags(self) -> list[str]:
        """``-I`` flags for a compiler."""
        return [f"-I{self.include}", f"-I{self.util_include}"]

    def version_header(self) -> Path:
        """``cutlass/version.h`` (its bytes go into the build cache key)."""
        return self.include / "cutlass" / "version.h"


def _version(include: Path) -> tuple[int, int, int] | None:
    try:
        text = (include / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+CUTLASS_{name}\s+(\d+)", text) for name in
             ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    return tuple(int(p.group(1)) for p in parts)  # type: ignore[union-attr, return-value]


def _at(root: Path) -> CutlassHeaders | str:
    """The headers under ``root``, or why ``root`` does not hold them."""
    include, util = root / "include", root / "tools" / "util" / "include"
    if not (include / "cutlass" / "cutlass.h").is_file():
        return f"{include}/cutlass/cutlass.h is missing"
    if not (include / "cute" / "tensor.hpp").is_file():
        return f"{include}/cute/tensor.hpp is missing"
    if not (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
        return f"{util}/cutlass/util/packed_stride.hpp is missing"
    version = _version(include)
    if version is None:
        return f"{include}/cutlass/version.h has no readable version"
    return CutlassHeaders(root, include, util, version)


def cutlass_package_root() -> Path | None:
    """``cutlass_library/source`` of the installed ``nvidia-cutlass`` package, or None."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "source"


def find_cutlass() -> CutlassHeaders:
    """The CUTLASS headers to build with; raise KernelBuildError when there are none."""
    env = config.current().cutlass_dir
    if env is not None:
        root = env
        found = _at(root)
        if isinstance(found, str) and (root / "source").is_dir():
            found = _at(root / "source")  # the cutlass_library package folder itself
        if isinstance(found, str):
            raise KernelBuildError(f"{CUTLASS_ENV}={env} holds no CUTLASS headers: {found}")
    else:
        root = cutlass_package_root()
        if root is None:
            raise KernelBuildError(
                "the CUTLASS headers were not found: install the PyPI package nvidia-cutlass "
                f"(pip install 'libalign[cutlass]') or set {CUTLASS_ENV} to a CUTLASS source tree")
        found = _at(root)
        if isinstance(found, str):
            raise KernelBuildError(f"the installed nvidia-cutlass package ({root}) lacks its "
                                   f"C++ headers: {found}")
    if found.version[:2] < CUTLASS_MIN_VERSION:
        have = ".".join(map(str, found.version))
        need = ".".join(map(str, CUTLASS_MIN_VERSION))
        raise KernelBuildError(f"CUTLASS {have} at {found.root} is too old: the sm_100a "
                               f"grouped NVFP4 GEMM needs {need} or newer")
    return found


# --- the build cache ------------------------------------------------------------------------

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}
_warned: set[str] = set()
_strict: dict[str, ctypes.CDLL | KernelBuildError] = {}
DISABLED = "compiled kernels are disabled (ALIGN_KERNELS=spec)"


def cache_dir() -> Path:
    """Where built kernel libraries are kept."""
    root = config.current().kernel_cache
    return root if root is not None else Path.home() / ".cache" / "libalign" / "kernels"


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty where there is none): the CPU features
    ``ALIGN_CPU_MARCH=native`` compiles for, then part of the CPU library's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(cmd: str) -> str:
    try:
        return subprocess.run([cmd, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def nvcc_archs(nvcc: str) -> list[str]:
    """The virtual architectures ``nvcc`` can target (``compute_90``, ...); empty if it fails."""
    try:
        return subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True,
                              timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []


def cuda_archs(nvcc: str) -> list[str]:
    """``-gencode`` flags from ``$ALIGN_CUDA_ARCHS``.

    ``native`` (default): the current device's architecture only (sm_90 on Hopper,
    sm_100a on Blackwell), which keeps a first-use build short; ``all``: sm_90, plus
    sm_100a where this nvcc knows compute_100, plus PTX for newer chips; or an explicit
    comma-separated list such as ``90,100a``.
    """
    want = config.current().cuda_archs
    if want == "native":
        try:
            major, minor = torch.cuda.get_device_capability()
            want = f"{major}{minor}" + ("a" if major >= 10 else "")
        except Exception:  # no device visible: build the portable set
            want = "all"
    if want == "all":
        want = "90,100a" if "compute_100" in nvcc_archs(nvcc) else "90"
        want += ",ptx90"
    flags = []
    for arch in (a.strip() for a in want.split(",") if a.strip()):
        if arch.startswith("ptx"):
            flags.append(f"-gencode=arch=compute_{arch[3:]},code=compute_{arch[3:]}")
        else:
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def build_command(kind: str, src: Path, out: Path) -> list[str]:
    """The compiler invocation for ``kind`` ('cpu', 'cuda' or 'gemm_sm100')."""
    inc = f"-I{CSRC}"
    if kind == "gemm_sm100":  # Blackwell only (sm_100a), CUTLASS headers, no other arch
        nvcc = config.current().nvcc or "nvcc"
        return [nvcc, "-O3", "-std=c++17", "-fmad=false", "--expt-relaxed-constexpr",
                "-DNDEBUG", "-Xcompiler", "-fPIC", "-shared",
                "-gencode=arch=compute_100a,code=sm_100a", inc, *find_cutlass().flags(),
                str(src), "-o", str(out)]
    if kind == "cpu":
        cxx = config.current().cxx
        march = config.current().cpu_march
        return [cxx, "-O3", *([f"-march={march}"] if march else []), "-ffp-contract=off",
                "-fno-fast-math", "-std=c++17", "-fPIC", "-shared", "-pthread", inc, str(src),
                "-o", str(out)]
    nvcc = config.current().nvcc or "nvcc"
    return [nvcc, "-O3", "-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC", "-shared",
            *cuda_archs(nvcc), inc, str(src), "-o", str(out)]


def cache_key(kind: str, cmd: list[str]) -> str:
    """The cache name part of ``kind``'s library built by ``cmd``: a hash of the sources and
    headers, the flags, the compiler's version (and CUTLASS's, or with ``-march=native``
    the CPU's flags)."""
    h = hashlib.sha256()
    for name in (*HEADERS, *KIND_HEADERS.get(kind, ()), SOURCES[kind]):
        h.update((CSRC / name).read_bytes())
    if kind == "gemm_sm100":  # the CUTLASS copy's version, also when it is upgraded in place
        h.update(find_cutlass().version_header().read_bytes())
    h.update(" ".join(cmd[1:]).replace(str(CSRC), "CSRC").encode())
    h.update(_compiler_version(cmd[0]).encode())
    if kind == "cpu" and "-march=native" in cmd:  # else the build is the same on every host
        h.update(cpu_flags().encode())
    return h.hexdigest()[:16]


def build(kind: str) -> Path:
    """Build (or find in the cache) the library for ``kind``; raise KernelBuildError."""
    src = CSRC / SOURCES[kind]
    if not src.exists():
        raise KernelBuildError(f"kernel source {src} is missing")
    compiler = build_command(kind, src, Path("x"))[0]
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"compiler {compiler!r} not found on PATH")
    if kind == "cuda" and not config.current().nvcc and shutil.which("nvcc") is None:
        raise KernelBuildError("nvcc not found on PATH")
    if kind == "gemm_sm100" and "compute_100" not in nvcc_archs(compiler):
        raise KernelBuildError(f"{compiler} cannot target sm_100a (CUDA 12.8 or newer needed)")
    probe = build_command(kind, src, Path("OUT"))
    target = cache_dir() / f"libnvfp4_{kind}-{cache_key(kind, probe)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = build_command(kind, src, Path(tmp))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise KernelBuildError(f"{kind} kernel build failed ({' '.join(cmd)}):\n"
                                   f"{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def declare(lib: ctypes.CDLL, kind: str) -> None:
    """Give ctypes the argument and result types of ``kind``'s C ABI (``csrc/*_abi.h``)."""
    p, f, i, vp = ctypes.c_void_p, ctypes.POINTER(NvParams), ctypes.c_int, ctypes.c_void_p
    if kind == "gemm_sm100":
        g = ctypes.POINTER(GemmSm100Args)
        lib.nvfp4_gemm_sm100_available.argtypes = []
        lib.nvfp4_gemm_sm100_workspace_size.argtypes = [g, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvfp4_grouped_gemm_sm100.argtypes = [g, vp, ctypes.c_size_t, vp]
        lib.nvfp4_gemm_sm100_status_string.argtypes = [i]
        lib.nvfp4_gemm_sm100_status_string.restype = ctypes.c_char_p
        lib.nvfp4_gemm_sm100_args_size.argtypes = []
        lib.nvfp4_gemm_sm100_args_size.restype = ctypes.c_size_t
        for fn in ("nvfp4_gemm_sm100_available", "nvfp4_gemm_sm100_workspace_size",
                   "nvfp4_grouped_gemm_sm100"):
            getattr(lib, fn).restype = i
    elif kind == "cpu":
        lib.nvfp4_quantize_cpu.argtypes = [p, p, p, p, p, p, p, f, i]
        lib.nvfp4_amax_cpu.argtypes = [p, p, f, i]
        lib.nvfp4_cpu_supported_paths.argtypes = []
        lib.nvfp4_cpu_path.argtypes = []
        lib.nvfp4_cpu_set_path.argtypes = [i]
        for fn in ("nvfp4_quantize_cpu", "nvfp4_amax_cpu", "nvfp4_cpu_supported_paths",
                   "nvfp4_cpu_path", "nvfp4_cpu_set_path"):
            getattr(lib, fn).restype = i
    else:
        lib.nvfp4_quantize_cuda.argtypes = [p, p, p, p, p, p, p, f, p, vp]
        lib.nvfp4_amax_cuda.argtypes = [p, p, f, p, vp]
        lib.nvfp4_cuda_set_variant.argtypes = [i]
        for fn in ("nvfp4_quantize_cuda", "nvfp4_amax_cuda", "nvfp4_cuda_set_variant"):
            getattr(lib, fn).restype = i


# --- the CPU library's instruction-set paths -------------------------------------------------

CPU_PATHS = ("scalar", "avx2", "avx512")  # index = NV_CPU_* in csrc/nvfp4_abi.h
CPU_PATH_ENV = "ALIGN_CPU_KERNEL"


def cpu_paths(lib: ctypes.CDLL) -> tuple[str, ...]:
    """The CPU kernel paths this CPU can run, best first (``scalar`` always)."""
    mask = lib.nvfp4_cpu_supported_paths()
    return tuple(name for i, name in reversed(list(enumerate(CPU_PATHS))) if mask >> i & 1)


def cpu_path(lib: ctypes.CDLL) -> str:
    """The CPU kernel path serving calls now: ``'avx512'``, ``'avx2'`` or ``'scalar'``."""
    return CPU_PATHS[lib.nvfp4_cpu_path()]


def set_cpu_path(lib: ctypes.CDLL, name: str | None) -> str:
    """Force the CPU kernel path ``name`` for this process (None or ``'auto'``: the best
    this CPU supports) and return the path now serving; ConfigError for an unknown name
    or a path this CPU lacks (the path serving is then unchanged)."""
    if name is None or name == "auto":
        lib.nvfp4_cpu_set_path(-1)
        return cpu_path(lib)
    if name not in CPU_PATHS:
        raise ConfigError(f"unknown CPU kernel path {name!r}: expected one of "
                          f"{', '.join(CPU_PATHS)} or auto")
    if lib.nvfp4_cpu_set_path(CPU_PATHS.index(name)) != 0:
        raise ConfigError(f"the CPU kernel path {name!r} needs instructions this CPU lacks "
                          f"(it runs {', '.join(cpu_paths(lib))})")
    return cpu_path(lib)


def _apply_cpu_path_env(lib: ctypes.CDLL) -> None:
    """At each load: the path ``$ALIGN_CPU_KERNEL`` forces, else the best (the library may be
    the one already mapped into this process, path choice included); ConfigError if bad."""
    want = config.current().cpu_kernel or ""
    try:
        set_cpu_path(lib, want or None)
    except ConfigError as exc:
        raise ConfigError(f"{CPU_PATH_ENV}={want}: {exc}") from None


def disabled() -> bool:
    """True when ``ALIGN_KERNELS`` is ``spec`` (:attr:`KernelConfig.kernels`): every call is
    served by the reference."""
    return config.current().kernels == "spec"


def unavailable_reason(kind: str) -> str | None:
    """Why :func:`load` returned None for ``kind`` (the build or load error), or None when it
    has not (the library is loaded, or was never asked for)."""
    if disabled():
        return DISABLED
    with _lock:
        return _reasons.get(kind) if kind in _libs and _libs[kind] is None else None


def attempted(kind: str) -> bool:
    """True once this process has tried to build or load ``kind`` (until :func:`forget`)."""
    with _lock:
        return kind in _libs or kind in _strict


def forget() -> None:
    """Drop every loaded library and remembered failure (not the on-disk cache): the next
    use builds or finds them again, e.g. after ``$ALIGN_KERNEL_CACHE``, ``CXX`` or ``NVCC``
    changed. A warning already given for a kind is given again on its next failure."""
    with _lock:
        _libs.clear()
        _reasons.clear()
        _warned.clear()
        _strict.clear()


def load(kind: str) -> ctypes.CDLL | None:
    """The loaded library for ``kind``, building it on first use; None (warned once) if not."""
    if disabled():
        return None
    with _lock:
        if kind in _libs:
            return _libs[kind]
        lib = None
        try:
            lib = ctypes.CDLL(str(build(kind)))
            declare(lib, kind)
            if kind == "cpu":
                _apply_cpu_path_env(lib)  # a ConfigError propagates: the setting is wrong
        except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            _reasons[kind] = str(exc)
            if kind not in _warned:
                _warned.add(kind)
                warnings.warn(f"libalign: the {kind} NVFP4 kernel is unavailable, using the "
                              f"reference spec instead (same bits, slower): {exc}",
                              RuntimeWarning, stacklevel=3)
            lib = None
        _libs[kind] = lib
        return lib


def load_or_raise(kind: str) -> ctypes.CDLL:
    """The loaded library for ``kind``, built on first use; KernelBuildError (why) if not.

    For kernels that have no spec fallback (the native GEMM): no warning, and a failed
    build is remembered for the process, so a missing compiler costs one attempt.
    """
    if disabled():
        raise KernelBuildError(DISABLED)
    with _lock:
        got = _strict.get(kind)
        if got is None:
            try:
                got = ctypes.CDLL(str(build(kind)))
                declare(got, kind)
            except KernelBuildError as exc:
                got = exc
            except (OSError, subprocess.SubprocessError) as exc:
                got = KernelBuildError(f"the {kind} library could not be built or loaded: {exc}")
            _strict[kind] = got
    if isinstance(got, KernelBuildError):
        raise KernelBuildError(str(got))
    return got
