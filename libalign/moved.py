"""Module names libalign used before its concept packages, kept importable with a warning.

``libalign.ops`` became :mod:`libalign.kernels`, ``libalign.numerics``
:mod:`libalign.spec.presets`, and so on (:data:`MOVED`). A program that imports an old name
(``from libalign import ops``, ``import libalign.weight_sync``, ``from libalign.rounding import
round_e``) gets the module at its new home, the same object, and one :class:`DeprecationWarning`
saying where it lives now. Nothing in libalign or the daemon imports an old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module name -> the module that holds its contents now
MOVED = {
    "libalign.ops": "libalign.kernels",
    "libalign.kernel_calls": "libalign.kernels.calls",
    "libalign._native": "libalign.kernels.native",
    "libalign.numerics": "libalign.spec.presets",
    "libalign.constants": "libalign.spec.constants",
    "libalign.scale_math": "libalign.spec.scale_math",
    "libalign.rounding": "libalign.spec.rounding",
    "libalign.packing": "libalign.spec.packing",
    "libalign.hadamard": "libalign.spec.hadamard",
    "libalign.gemm_triton": "libalign.gemm.triton_grouped",
    "libalign._triton_w4a4": "libalign.gemm.triton_kernels",
    "libalign.gemm_cutlass": "libalign.gemm.cutlass_grouped",
    "libalign.gemm_layout": "libalign.gemm.row_groups",
    "libalign.finite_checks": "libalign.gemm.finite_checks",
    "libalign.routing_records": "libalign.routing.records",
    "libalign.metrics.routing": "libalign.routing.agreement",
    "libalign.strict_ops": "libalign.strict.ops",
    "libalign.strict_triton": "libalign.strict.triton_matmul",
    "libalign.guidance_sizes": "libalign.guidance.sizes",
    "libalign.weight_sync": "libalign.sync",
    "libalign.models.replay": "libalign.models.teacher_forcing",
}


def moved_module(old: str) -> ModuleType:
    """The module ``old`` names now (imported), with a DeprecationWarning naming its new home."""
    new = MOVED[old]
    warnings.warn(f"{old} is now {new}; import it from there", DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class _Alias(importlib.abc.Loader):
    def create_module(self, spec):
        return moved_module(spec.name)

    def exec_module(self, module) -> None:
        """The aliased module ran at its own import."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module name and answers with its new module (see :data:`MOVED`)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias())
        return None


def install() -> None:
    """Put :class:`MovedFinder` first on ``sys.meta_path``, once (an old name must never reach
    a finder that could find a stale file of that name)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
