"""Confidence intervals for statistics of δ: the paired and the cluster (per-sequence) bootstrap.

Questions such as "did NVFP4 raise P99 |δ| over BF16?" compare two measurements of the *same*
tokens, so the comparison is paired: each bootstrap resample draws one set of token (or
sequence) indices and evaluates the statistic on both conditions with it, which cancels the
token-to-token variation the two conditions share. The interval is the percentile interval of
the resampled differences (the ``(1 − level)/2`` and ``(1 + level)/2`` quantiles, linear
interpolation). Tokens of one sequence are correlated (a drifted hidden state affects every later
token), so resampling tokens independently understates the uncertainty; pass ``groups`` (one
sequence id per token) to resample whole sequences instead: the cluster bootstrap, which should be
the default whenever sequence ids are known.

A resample is represented by *counts* rather than by gathered copies: ``counts[r, i]`` is how
many times token ``i`` appears in resample ``r``. Token resampling draws ``n`` token indices with
replacement; sequence resampling draws as many sequence ids as there are sequences and gives each
token the count of its sequence, so resamples have varying total size and never need padding.
A statistic is therefore a function ``stat_fn(x, counts) -> Tensor[R]`` of the float64 values
``x`` (``[n]``) and an int32 ``counts`` matrix (``[R, n]``, each row totalling less than
``2**31``), returning the statistic of the multiset in which ``x[i]`` appears ``counts[r, i]``
times. :func:`mean_stat`,
:func:`quantile_stat` and :func:`clip_potential_stat` are ready-made; :func:`from_unweighted`
adapts any ``fn(values) -> float`` (slowly, one resample at a time). With all counts equal to one
they give exactly the plain statistic, which is how the point estimate is computed. Resamples are
drawn on the CPU in chunks from one seeded ``torch.Generator``, so a seed reproduces the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from libalign.arg_checks import (
    check_bounds,
    check_finite_tensor,
    check_real_tensor,
    check_same_shape,
    jsonable,
)
from libalign.errors import DTypeError, InputError, ShapeError
from libalign.metrics.deltas import DEFAULT_CLIP_BOUNDS

_CHUNK_ELEMENTS = 1 << 22
"""Bootstrap counts are built ``R × n`` at a time with ``R × n`` about this many elements."""

WeightedStat = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``stat_fn(x [n] float64, counts [R, n] int32) -> [R] float64``: see the module docstring."""


def mean_stat(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of each resample: ``Σ counts·x / Σ counts``."""
    c = counts.to(torch.float64)
    return (c @ x) / c.sum(1)


def quantile_stat(q: float) -> WeightedStat:
    """The q-quantile of each resample, linear interpolation (as :func:`torch.quantile`).

    Equal to ``torch.quantile`` of the expanded multiset, without expanding it: sort ``x`` once,
    accumulate the counts in that order, and find the order statistics by binary search.
    """
    q = float(q)
    if not 0.0 <= q <= 1.0:
        raise InputError(f"quantile must be in [0, 1], got {q!r}")

    # The bootstrap calls the statistic once per chunk with the same x (alternating a and b):
    # keep the last two sorts, keyed by identity and in-place version counter.
    cache: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}

    def sorted_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == x._version:
            return hit[2], hit[3]
        xs, perm = x.sort()
        if len(cache) >= 2:
            cache.clear()
        cache[id(x)] = (x, x._version, xs, perm)
        return xs, perm

    def stat(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        xs, perm = sorted_x(x)
        ordered = counts.index_select(1, perm)
        # int32 running counts are several times faster than int64 (totals < 2**31 by contract).
        cum = ordered.cumsum(1, dtype=torch.int32)
        n = cum[:, -1:]
        h = (n - 1).to(torch.float64) * q
        lo, hi = h.floor(), h.ceil()
        # Ascending rank j (0-based) lives at the first sorted position whose running count > j.
        at_lo = torch.searchsorted(cum, lo.to(cum.dtype), right=True)
        at_hi = torch.searchsorted(cum, hi.to(cum.dtype), right=True)
        return torch.lerp(xs[at_lo], xs[at_hi], h - lo).squeeze(1)

    stat.__name__ = f"quantile_stat({q:g})"
    return stat


def clip_potential_stat(low: float = DEFAULT_CLIP_BOUNDS[0],
                        high: float = DEFAULT_CLIP_BOUNDS[1]) -> WeightedStat:
    """Fraction of each resample's δ values with ``exp(δ)`` outside ``[low, high]`` (strict)."""
    lo, hi = check_bounds((low, high))
    log_lo, log_hi = math.log(lo), math.log(hi)

    def stat(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outside = ((x < log_lo) | (x > log_hi)).nonzero().flatten()
        hits = counts.index_select(1, outside).sum(1, dtype=torch.int64)
        return hits.to(torch.float64) / counts.sum(1, dtype=torch.int64).to(torch.float64)

    stat.__name__ = f"clip_potential_stat({lo:g}, {hi:g})"
    return stat


def from_unweighted(fn: Callable[[torch.Tensor], float | torch.Tensor]) -> WeightedStat:
    """Adapt ``fn(values) -> scalar`` to the counts form by expanding each resample (slow)."""

    def stat(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = [torch.as_tensor(fn(x.repeat_interleave(c.long())), dtype=torch.float64).reshape(())
               for c in counts]
        return torch.stack(out)

    stat.__name__ = f"from_unweighted({getattr(fn, '__name__', 'fn')})"
    return stat


@dataclass(frozen=True)
class BootstrapCI:
    """A point estimate with a percentile bootstrap interval."""

    estimate: float
    low: float
    high: float
    level: float
    n_boot: int
    resampled: str  # "tokens" or "sequences"
    units: int  # how many tokens or sequences were resampled
    excludes_zero: bool

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (non-finite floats become None)."""
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def _bootstrap_values(x, name: str) -> torch.Tensor:
    check_real_tensor(x, name)
    if x.numel() == 0:
        raise InputError(f"{name} is empty")
    check_finite_tensor(x, name)
    return x.detach().to(device="cpu", dtype=torch.float64, copy=True).reshape(-1).contiguous()


def _apply(stat_fn: WeightedStat, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = stat_fn(x, counts)
    if not isinstance(out, torch.Tensor) or out.shape != (counts.shape[0],):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShapeError(f"stat_fn must return a tensor of shape ({counts.shape[0]},), one value "
                         f"per resample, got {got}")
    return out.to(torch.float64)


def _bootstrap(stat_fn: WeightedStat, a, b, *, n_boot: int, level: float, seed: int,
               groups) -> BootstrapCI:
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise InputError(f"n_boot must be a positive int, got {n_boot!r}")
    level = float(level)
    if not 0.0 < level < 1.0:
        raise InputError(f"level must be in (0, 1), got {level!r}")
    if not callable(stat_fn):
        raise InputError(f"stat_fn must be callable, got {type(stat_fn).__name__}")
    xa = _bootstrap_values(a, "a")
    xb = None
    if b is not None:
        check_real_tensor(b, "b")
        check_same_shape(a, b, "a", "b")
        xb = _bootstrap_values(b, "b")
    n = xa.numel()
    cluster = None
    if groups is not None:
        if not isinstance(groups, torch.Tensor):
            raise DTypeError(f"groups must be a torch.Tensor, got {type(groups).__name__}")
        if groups.dtype == torch.bool or groups.dtype.is_floating_point or groups.dtype.is_complex:
            raise DTypeError(f"groups must be an integer tensor of sequence ids, got {groups.dtype}")
        check_same_shape(a, groups, "a", "groups")
        _, cluster = torch.unique(groups.detach().cpu().reshape(-1), return_inverse=True)
        n_units = int(cluster.max()) + 1
        sizes = torch.bincount(cluster, minlength=n_units)
        if n_units < 2:
            raise InputError("groups holds a single sequence id; a cluster bootstrap needs at "
                             "least 2 sequences")
    else:
        n_units = n
        sizes = None
        if n >= 2**31:
            raise InputError(f"{n} tokens is more than the int32 counts of a resample can hold")

    def diff(counts: torch.Tensor) -> torch.Tensor:
        va = _apply(stat_fn, xa, counts)
        return va if xb is None else va - _apply(stat_fn, xb, counts)

    estimate = float(diff(torch.ones(1, n, dtype=torch.int32))[0])
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    chunk = max(1, _CHUNK_ELEMENTS // n)
    diffs = []
    for start in range(0, n_boot, chunk):
        r = min(chunk, n_boot - start)
        draws = torch.randint(0, n_units, (r, n_units), generator=gen)
        unit_counts = torch.zeros(r, n_units, dtype=torch.int32)
        unit_counts.scatter_add_(1, draws, torch.ones((), dtype=torch.int32).expand(r, n_units))
        counts = unit_counts if cluster is None else unit_counts.index_select(1, cluster)
        if sizes is not None and int((unit_counts.to(torch.int64) @ sizes).max()) >= 2**31:
            raise InputError("a sequence resample holds 2**31 tokens or more; counts are int32")
        diffs.append(diff(counts))
    boot = torch.cat(diffs)
    bad = ~torch.isfinite(boot)
    if bool(bad.any()):
        raise InputError(f"stat_fn returned a non-finite value for {int(bad.sum())} of {n_boot} "
                         "resamples")
    alpha = (1.0 - level) / 2.0
    low, high = torch.quantile(boot, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)).tolist()
    return BootstrapCI(estimate=estimate, low=low, high=high, level=level, n_boot=n_boot,
                       resampled="tokens" if cluster is None else "sequences", units=n_units,
                       excludes_zero=low > 0.0 or high < 0.0)


def paired_bootstrap_ci(stat_fn: WeightedStat, a: torch.Tensor, b: torch.Tensor, *,
                        n_boot: int = 1000, level: float = 0.95, seed: int = 0,
                        groups: torch.Tensor | None = None) -> BootstrapCI:
    """Percentile CI for ``stat(a) − stat(b)`` where ``a[i]`` and ``b[i]`` measure the same token.

    Each resample applies one set of counts to both ``a`` and ``b``. With ``groups`` (a sequence
    id per token, same shape as ``a``) whole sequences are resampled; otherwise tokens are.
    ``stat_fn`` takes ``(x, counts)``, see :func:`quantile_stat` and the module docstring.
    """
    return _bootstrap(stat_fn, a, b, n_boot=n_boot, level=level, seed=seed, groups=groups)


def bootstrap_ci(stat_fn: WeightedStat, a: torch.Tensor, *, n_boot: int = 1000,
                 level: float = 0.95, seed: int = 0,
                 groups: torch.Tensor | None = None) -> BootstrapCI:
    """Percentile CI for ``stat(a)``: :func:`paired_bootstrap_ci` with a single condition."""
    return _bootstrap(stat_fn, a, None, n_boot=n_boot, level=level, seed=seed, groups=groups)
