"""The fixed 16-point randomized Hadamard transform (RHT), in a fixed fp32 order.

Some NVFP4 recipes rotate each 16-element block before quantizing it, which spreads an
outlier's energy over the block: ``y = H16 (d * x) / 4`` with ``H16`` the Sylvester
Hadamard matrix (entries +-1, ``H16 @ H16 = 16 I``) and ``d`` a fixed +-1 sign mask. The
transform is orthonormal, so ``x = d * (H16 y) / 4`` undoes it.

A matrix product would leave the fp32 summation order to the BLAS library. Here the
transform is the in-place butterfly (Walsh-Hadamard) with strides 1, 2, 4, 8, each stage
forming ``a + b`` and ``a - b`` once, so every output bit is defined. Multiplying by the
signs and by 1/4 is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libalign.errors import ShapeError
from libalign.spec.constants import HADAMARD_SIGNS, HADAMARD_SIZE


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    y = x.reshape(-1, HADAMARD_SIZE)
    h = 1
    while h < HADAMARD_SIZE:
        v = y.view(-1, HADAMARD_SIZE // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, HADAMARD_SIZE)
        h *= 2
    return y


def _signs(signs: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(signs), dtype=torch.float32, device=like.device)


def rht16(x: torch.Tensor, signs: Sequence[int] = HADAMARD_SIGNS) -> torch.Tensor:
    """Rotate every 16-element block along the last dimension (fp32 in, fp32 out)."""
    if x.shape[-1] % HADAMARD_SIZE:
        raise ShapeError(f"last dimension {x.shape[-1]} is not a multiple of {HADAMARD_SIZE}")
    shape = x.shape
    d = _signs(signs, x)
    y = _butterfly(x.to(torch.float32).reshape(-1, HADAMARD_SIZE) * d) * 0.25
    return y.reshape(shape)


def rht16_inverse(y: torch.Tensor, signs: Sequence[int] = HADAMARD_SIGNS) -> torch.Tensor:
    """Undo :func:`rht16` (exact in real arithmetic, one fp32 butterfly in practice)."""
    if y.shape[-1] % HADAMARD_SIZE:
        raise ShapeError(f"last dimension {y.shape[-1]} is not a multiple of {HADAMARD_SIZE}")
    shape = y.shape
    d = _signs(signs, y)
    x = _butterfly(y.to(torch.float32).reshape(-1, HADAMARD_SIZE)) * 0.25 * d
    return x.reshape(shape)
