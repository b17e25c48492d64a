"""Where the CUTLASS C++ headers come from (used by :mod:`libalign._native` only).

CUTLASS is header-only, so building the native Blackwell GEMM (``csrc/gemm_nvfp4_sm100.cu``)
needs nothing but two include folders: ``include`` (``cute/`` and ``cutlass/``) and
``tools/util/include`` (``cutlass/util/``). They are found, in this order:

1. ``$ALIGN_CUTLASS_DIR``: the root of a CUTLASS source tree (a git checkout, or the
   ``source`` folder of the wheel) holding both folders. When it is set it must be right:
   a wrong path is an error, not a silent fallback to another copy.
2. The installed ``nvidia-cutlass`` PyPI package (the ``gpu`` / ``cutlass`` extras), whose
   ``cutlass_library`` package carries the headers under ``cutlass_library/source``. It is
   located without being imported.

Anything else raises :class:`~libalign._native.KernelBuildError` saying how to get them.
The version is read from ``cutlass/version.h``; the kernel is written against the 4.x
block-scaled grouped API and is tested to compile with :data:`MIN_VERSION`.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ._native import KernelBuildError

ENV_VAR = "ALIGN_CUTLASS_DIR"
MIN_VERSION = (4, 2)


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


def _package_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "source"


def find() -> CutlassHeaders:
    """The CUTLASS headers to build with; raise KernelBuildError when there are none."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        root = Path(env).expanduser()
        found = _at(root)
        if isinstance(found, str) and (root / "source").is_dir():
            found = _at(root / "source")  # the cutlass_library package folder itself
        if isinstance(found, str):
            raise KernelBuildError(f"{ENV_VAR}={env} holds no CUTLASS headers: {found}")
    else:
        root = _package_root()
        if root is None:
            raise KernelBuildError(
                "the CUTLASS headers were not found: install the PyPI package nvidia-cutlass "
                f"(pip install 'libalign[cutlass]') or set {ENV_VAR} to a CUTLASS source tree")
        found = _at(root)
        if isinstance(found, str):
            raise KernelBuildError(f"the installed nvidia-cutlass package ({root}) lacks its "
                                   f"C++ headers: {found}")
    if found.version[:2] < MIN_VERSION:
        have = ".".join(map(str, found.version))
        need = ".".join(map(str, MIN_VERSION))
        raise KernelBuildError(f"CUTLASS {have} at {found.root} is too old: the sm_100a "
                               f"grouped NVFP4 GEMM needs {need} or newer")
    return found
