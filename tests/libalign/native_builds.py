"""The nvcc builds of the build tests, run as background jobs (tests/background.py).

``test_gemm_sm100_build`` and ``test_native_build`` compile three CUDA libraries with nvcc: the
CUTLASS grouped GEMM for sm_100a, the same source for sm_90, and the quantize kernels for sm_90
and sm_100a, 30 to 100 s of one CPU core each (most of it cicc and ptxas). As jobs they overlap
the rest of the run; each writes into its own folder (never the user's kernel cache): the two
library builds through ``native.build`` with ``ALIGN_KERNEL_CACHE`` pointing there, the sm_90
variant with ``native.build_command``'s command for another ``-gencode``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from libalign.kernels import native
from tests import background


def nvcc_gap() -> str | None:
    """Why no nvcc build can run here, or None."""
    return None if shutil.which("nvcc") else "nvcc not installed"


def nvcc_sm100_gap() -> str | None:
    """Why no sm_100a build can run here (no nvcc, or one without compute_100), or None."""
    gap = nvcc_gap()
    if gap is None and "compute_100" not in native.nvcc_archs(shutil.which("nvcc")):
        gap = "this nvcc cannot target sm_100a"
    return gap


def cutlass_gap() -> str | None:
    """Why the CUTLASS headers cannot be used here, or None."""
    try:
        native.find_cutlass()
    except native.KernelBuildError as exc:
        return f"CUTLASS headers absent: {exc}"
    return None


def sm100_gap() -> str | None:
    """Why the CUTLASS GEMM builds cannot run here, or None."""
    return nvcc_sm100_gap() or cutlass_gap()


def cuda_archs() -> str:
    """``ALIGN_CUDA_ARCHS`` of the quantize build: sm_90, and sm_100a where nvcc knows it."""
    return "90,100a" if "compute_100" in native.nvcc_archs(shutil.which("nvcc")) else "90"


def variant_command(out: Path, arch_flag: str, *extra: str) -> list[str]:
    """gemm_nvfp4_sm100.cu's build command (``native.build_command``) with another
    ``-gencode`` and extra flags (``-D...``), writing ``out``."""
    src = native.CSRC / native.SOURCES["gemm_sm100"]
    cmd = [arch_flag if a.startswith("-gencode") else a
           for a in native.build_command("gemm_sm100", src, out)]
    cmd[1:1] = list(extra)
    return cmd


def built_library(done: background.Finished) -> Path:
    """The library a ``native.build`` job printed (its last line)."""
    return Path(done.stdout.strip().splitlines()[-1])


def _build(kind: str, folder: Path, **env: str) -> tuple[list[str], dict[str, str]]:
    code = f"from libalign.kernels import native; print(native.build({kind!r}))"
    return [sys.executable, "-c", code], {**os.environ, "ALIGN_KERNEL_CACHE": str(folder), **env}


background.register("gemm_sm100", background.Job(
    ("test_gemm_sm100_build.py::test_sm100a_library_compiles",), sm100_gap,
    lambda folder: _build("gemm_sm100", folder)))
background.register("gemm_sm100_for_sm90", background.Job(
    ("test_gemm_sm100_build.py::test_other_arch_build",), sm100_gap,
    lambda folder: (variant_command(folder / "libvariant.so",
                                    "-gencode=arch=compute_90,code=sm_90"), dict(os.environ))))
background.register("cuda", background.Job(
    ("test_native_build.py::test_cuda_source_compiles",), nvcc_gap,
    lambda folder: _build("cuda", folder, ALIGN_CUDA_ARCHS=cuda_archs())))
