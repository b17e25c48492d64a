"""How far apart two activation tensors are: relative L2, reference-normalized or symmetric.

Two ways to size the difference between two activation tensors, computed in float64:

* reference-normalized ``‖x − ref‖ / ‖ref‖``: the error of ``x`` measured against a chosen truth;
* symmetric ``‖x − y‖ / ((‖x‖ + ‖y‖) / 2)``: neither side is the truth (learner vs sampler);
  it is symmetric in its arguments and never exceeds 2.

The two do not agree and must not be mixed in one table. A zero denominator gives 0 when the
numerator is also zero (identical all-zero tensors agree perfectly) and ``inf`` otherwise. With
``dim`` the norms are taken along those dimensions only, giving one value per row (per prompt,
per expert).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from libalign.arg_checks import check_finite_tensor, check_real_tensor, check_same_shape
from libalign.errors import InputError, ShapeError


def _norm_dims(dim, ndim: int):
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
            raise ShapeError(f"dim {d!r} is out of range for a {ndim}-D tensor")
    return dims


def _l2_inputs(x, y, xname: str, yname: str, dim):
    check_real_tensor(x, xname)
    check_real_tensor(y, yname)
    check_same_shape(x, y, xname, yname)
    if x.numel() == 0:
        raise InputError(f"{xname} and {yname} are empty")
    check_finite_tensor(x, xname)
    check_finite_tensor(y, yname)
    dims = _norm_dims(dim, x.dim())
    return x.detach().to(torch.float64), y.detach().to(torch.float64), dims


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, with 0/0 → 0 and x/0 → inf for x > 0."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    zero_den = torch.where(num == 0, torch.zeros_like(num), torch.full_like(num, math.inf))
    return torch.where(den > 0, num / safe, zero_den)


def relative_l2(x: torch.Tensor, ref: torch.Tensor, *, dim: int | Sequence[int] | None = None
                ) -> torch.Tensor:
    """Reference-normalized ``‖x − ref‖ / ‖ref‖`` in float64 (0-d, or one value per row with ``dim``).

    ``‖ref‖ = 0`` gives 0 if ``x`` equals ``ref`` there and ``inf`` otherwise.
    """
    x64, r64, dims = _l2_inputs(x, ref, "x", "ref", dim)
    num = torch.linalg.vector_norm(x64 - r64, dim=dims)
    den = torch.linalg.vector_norm(r64, dim=dims)
    return _ratio(num, den)


def symmetric_relative_l2(x: torch.Tensor, y: torch.Tensor, *,
                          dim: int | Sequence[int] | None = None) -> torch.Tensor:
    """Symmetric ``‖x − y‖ / ((‖x‖ + ‖y‖) / 2)`` in float64, in [0, 2]; both zero gives 0."""
    x64, y64, dims = _l2_inputs(x, y, "x", "y", dim)
    num = torch.linalg.vector_norm(x64 - y64, dim=dims)
    den = (torch.linalg.vector_norm(x64, dim=dims) + torch.linalg.vector_norm(y64, dim=dims)) / 2
    return _ratio(num, den)
