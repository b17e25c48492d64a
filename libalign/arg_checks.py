"""Input checks shared by the metrics modules (their errors name the offending argument)."""

from __future__ import annotations

import math

import torch

from libalign.errors import DTypeError, InputError, NonFiniteError, ShapeError


def jsonable(value):
    """Python scalars for JSON: non-finite floats become None (JSON has no inf or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def check_float_tensor(x, name: str) -> None:
    """DTypeError unless ``x`` is a floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_real_tensor(x, name: str) -> None:
    """DTypeError unless ``x`` is a real-valued tensor (not bool, not complex)."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.dtype.is_complex:
        raise DTypeError(f"{name} must be a real-valued tensor, got {x.dtype}")


def check_same_shape(x: torch.Tensor, y: torch.Tensor, xname: str, yname: str) -> None:
    """ShapeError naming both inputs unless their shapes match."""
    if x.shape != y.shape:
        raise ShapeError(f"{xname} has shape {tuple(x.shape)} but {yname} has shape "
                         f"{tuple(y.shape)}; they must match")


def check_finite_tensor(x: torch.Tensor, name: str) -> None:
    """NonFiniteError naming the first offending multi-indices of ``x``."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = bad.nonzero()
        raise NonFiniteError(name, count=int(bad.sum()), nan=int(torch.isnan(x).sum()),
                             inf=int(torch.isinf(x).sum()),
                             first_indices=[tuple(ix.tolist()) for ix in where[:3]])


def check_bounds(bounds) -> tuple[float, float]:
    """A clipping band as ``(low, high)`` floats with ``0 < low < high``; InputError otherwise."""
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError) as exc:
        raise InputError(f"clip_bounds must be a pair (low, high), got {bounds!r}") from exc
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
        raise InputError(f"clip_bounds must satisfy 0 < low < high (finite), got ({low!r}, {high!r})")
    return low, high
