"""Building and loading the compiled kernels in ``csrc/`` (used only by :mod:`libalign.ops`).

The kernels export a plain C ABI (``csrc/nvfp4_abi.h``) and are loaded with ctypes, so a
build is a single ``g++`` or ``nvcc`` call with no Python or PyTorch headers: seconds for
the CPU library, about half a minute for the CUDA one. Builds are cached under
``$ALIGN_KERNEL_CACHE`` (default ``~/.cache/libalign/kernels``) in a file named by a hash
of the sources, the compiler's version, the flags and (for ``-march=native``) the CPU's
feature flags, and written by rename so concurrent first uses are safe. When a compiler is
missing or a build fails, :func:`load` returns ``None`` and warns once; the caller then
uses the spec. ``ALIGN_KERNELS=spec`` disables the compiled kernels altogether.

The native Blackwell grouped GEMM (kind ``gemm_sm100``, ``csrc/gemm_abi.h``) also needs the
CUTLASS headers (:mod:`libalign._cutlass`), is built for sm_100a only (about a minute) and
has no spec to fall back on: :func:`load_or_raise` returns it or says why it cannot.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
HEADERS = ("nvfp4_abi.h", "nvfp4_math.h")
SOURCES = {"cpu": "quantize_cpu.cpp", "cuda": "quantize_cuda.cu",
           "gemm_sm100": "gemm_nvfp4_sm100.cu"}
# Headers only one kind includes (they join that kind's cache key).
KIND_HEADERS = {"gemm_sm100": ("gemm_abi.h",)}


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
        ("swizzled", ctypes.c_int32),
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


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_warned: set[str] = set()


def cache_dir() -> Path:
    """Where built kernel libraries are kept."""
    root = os.environ.get("ALIGN_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "libalign" / "kernels"


def _cpu_flags() -> str:
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


def _nvcc_archs(nvcc: str) -> list[str]:
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
    want = os.environ.get("ALIGN_CUDA_ARCHS", "native").strip().lower()
    if want == "native":
        try:
            import torch

            major, minor = torch.cuda.get_device_capability()
            want = f"{major}{minor}" + ("a" if major >= 10 else "")
        except Exception:  # no device visible: build the portable set
            want = "all"
    if want == "all":
        want = "90,100a" if "compute_100" in _nvcc_archs(nvcc) else "90"
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
        from . import _cutlass

        nvcc = os.environ.get("NVCC", "nvcc")
        return [nvcc, "-O3", "-std=c++17", "-fmad=false", "--expt-relaxed-constexpr",
                "-DNDEBUG", "-Xcompiler", "-fPIC", "-shared",
                "-gencode=arch=compute_100a,code=sm_100a", inc, *_cutlass.find().flags(),
                str(src), "-o", str(out)]
    if kind == "cpu":
        cxx = os.environ.get("CXX", "g++")
        march = os.environ.get("ALIGN_CPU_MARCH", "native")
        return [cxx, "-O3", f"-march={march}", "-ffp-contract=off", "-fno-fast-math",
                "-std=c++17", "-fPIC", "-shared", "-pthread", inc, str(src), "-o", str(out)]
    nvcc = os.environ.get("NVCC", "nvcc")
    return [nvcc, "-O3", "-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC", "-shared",
            *cuda_archs(nvcc), inc, str(src), "-o", str(out)]


def _key(kind: str, cmd: list[str]) -> str:
    h = hashlib.sha256()
    for name in (*HEADERS, *KIND_HEADERS.get(kind, ()), SOURCES[kind]):
        h.update((CSRC / name).read_bytes())
    if kind == "gemm_sm100":  # the CUTLASS copy's version, also when it is upgraded in place
        from . import _cutlass

        h.update(_cutlass.find().version_header().read_bytes())
    h.update(" ".join(cmd[1:]).replace(str(CSRC), "CSRC").encode())
    h.update(_compiler_version(cmd[0]).encode())
    if kind == "cpu":
        h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def build(kind: str) -> Path:
    """Build (or find in the cache) the library for ``kind``; raise KernelBuildError."""
    src = CSRC / SOURCES[kind]
    if not src.exists():
        raise KernelBuildError(f"kernel source {src} is missing")
    compiler = build_command(kind, src, Path("x"))[0]
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"compiler {compiler!r} not found on PATH")
    if kind == "cuda" and not os.environ.get("NVCC") and shutil.which("nvcc") is None:
        raise KernelBuildError("nvcc not found on PATH")
    if kind == "gemm_sm100" and "compute_100" not in _nvcc_archs(compiler):
        raise KernelBuildError(f"{compiler} cannot target sm_100a (CUDA 12.8 or newer needed)")
    probe = build_command(kind, src, Path("OUT"))
    target = cache_dir() / f"libnvfp4_{kind}-{_key(kind, probe)}.so"
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


def _declare(lib: ctypes.CDLL, kind: str) -> None:
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
        lib.nvfp4_cpu_force_scalar.argtypes = [i]
        lib.nvfp4_cpu_has_simd.argtypes = []
        for fn in ("nvfp4_quantize_cpu", "nvfp4_amax_cpu", "nvfp4_cpu_has_simd"):
            getattr(lib, fn).restype = i
    else:
        lib.nvfp4_quantize_cuda.argtypes = [p, p, p, p, p, p, p, f, p, vp]
        lib.nvfp4_amax_cuda.argtypes = [p, p, f, p, vp]
        lib.nvfp4_quantize_cuda.restype = i
        lib.nvfp4_amax_cuda.restype = i


def load(kind: str) -> ctypes.CDLL | None:
    """The loaded library for ``kind``, building it on first use; None (warned once) if not."""
    if os.environ.get("ALIGN_KERNELS", "").lower() == "spec":
        return None
    with _lock:
        if kind in _libs:
            return _libs[kind]
        lib = None
        try:
            lib = ctypes.CDLL(str(build(kind)))
            _declare(lib, kind)
        except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            if kind not in _warned:
                _warned.add(kind)
                warnings.warn(f"libalign: the {kind} NVFP4 kernel is unavailable, using the "
                              f"reference spec instead (same bits, slower): {exc}",
                              RuntimeWarning, stacklevel=3)
            lib = None
        _libs[kind] = lib
        return lib


_strict: dict[str, ctypes.CDLL | KernelBuildError] = {}


def load_or_raise(kind: str) -> ctypes.CDLL:
    """The loaded library for ``kind``, built on first use; KernelBuildError (why) if not.

    For kernels that have no spec fallback (the native GEMM): no warning, and a failed
    build is remembered for the process, so a missing compiler costs one attempt.
    """
    if os.environ.get("ALIGN_KERNELS", "").lower() == "spec":
        raise KernelBuildError("compiled kernels are disabled (ALIGN_KERNELS=spec)")
    with _lock:
        got = _strict.get(kind)
        if got is None:
            try:
                got = ctypes.CDLL(str(build(kind)))
                _declare(got, kind)
            except KernelBuildError as exc:
                got = exc
            except (OSError, subprocess.SubprocessError) as exc:
                got = KernelBuildError(f"the {kind} library could not be built or loaded: {exc}")
            _strict[kind] = got
    if isinstance(got, KernelBuildError):
        raise KernelBuildError(str(got))
    return got
