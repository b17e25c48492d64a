"""Confidence intervals for a mean over independent repetitions (seeds): Student's t.

A training run gives one number per seed (the reward of its last quarter, its mean |δ|); the
question "what reward does this configuration reach?" is answered by the mean over seeds and
an interval for it. Seeds are few (two to ten), and for so few values the percentile bootstrap
of :mod:`~libalign.metrics.bootstrap` is the wrong tool: its interval never leaves the range of
the values, so with three seeds it covers the true mean far less often than it claims. The
classical interval does not have that flaw: with ``n`` values of mean ``m`` and sample
standard deviation ``s`` (divisor ``n − 1``),

    m ± t(level, n − 1) · s / √n

where ``t(level, ν)`` is the two-sided quantile of Student's t distribution with ``ν`` degrees
of freedom (``P(|T| ≤ t) = level``). It assumes the per-seed values are independent draws of
one roughly normal distribution; it is exact for normal values and robust to mild skew. With
one value there is no interval (``low`` and ``high`` are None).

The quantile
------------
For integer ``ν`` the two-sided probability has a closed form in ``θ = atan(t / √ν)``
(Abramowitz & Stegun 26.7.3–4): with ``c = cos θ``,

* ``ν`` odd: ``A = (2/π)·(θ + sin θ·(c + (2/3)c³ + (2·4)/(3·5)c⁵ + … up to c^(ν−2)))`` (just
  ``2θ/π`` for ``ν = 1``);
* ``ν`` even: ``A = sin θ·(1 + (1/2)c² + (1·3)/(2·4)c⁴ + … up to c^(ν−2))``.

``A`` rises monotonically from 0 to 1 as ``θ`` goes from 0 to π/2, so :func:`t_quantile`
finds ``A(θ) = level`` by bisection on ``θ`` to float64 resolution and returns ``√ν·tan θ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from libalign.arg_checks import jsonable
from libalign.errors import InputError

_BISECTIONS = 200
"""Bisection steps on θ ∈ (0, π/2): far more than float64 needs (≈ 60)."""


def t_two_sided_probability(t: float, df: int) -> float:
    """``P(|T| ≤ t)`` for Student's t with ``df`` (a positive integer) degrees of freedom."""
    df = _check_df(df)
    if t < 0:
        raise InputError(f"t must be at least 0, got {t}")
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    return _two_sided(theta, df)


def _check_df(df) -> int:
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise InputError(f"degrees of freedom must be a positive int, got {df!r}")
    return df


def _two_sided(theta: float, df: int) -> float:
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, df - 1, 2):  # coefficients (2·4···(k−1)) / (3·5···k)
            term *= (k - 1) / k * c * c
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # coefficients (1·3···(k−1)) / (2·4···k)
        term *= (k - 1) / k * c * c
        total += term
    return s * total


def t_quantile(level: float, df: int) -> float:
    """The two-sided Student t quantile: ``t`` with ``P(|T| ≤ t) = level`` (e.g. 12.706 for
    ``level=0.95, df=1``; 1.96 as ``df`` grows)."""
    df = _check_df(df)
    level = float(level)
    if not 0.0 < level < 1.0:
        raise InputError(f"level must be in (0, 1), got {level!r}")
    lo, hi = 0.0, math.pi / 2
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _two_sided(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan(0.5 * (lo + hi))


@dataclass(frozen=True)
class MeanInterval:
    """The mean of per-seed values with its Student t interval (None bounds for one value)."""

    estimate: float
    low: float | None
    high: float | None
    level: float
    n: int
    std: float | None
    """sample standard deviation (divisor n − 1); None for one value"""

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (non-finite floats become None)."""
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def mean_interval(values: Sequence[float], level: float = 0.95) -> MeanInterval:
    """Mean of ``values`` (one per independent repetition) with its ``level`` t interval."""
    xs = [float(v) for v in values]
    if not xs:
        raise InputError("values is empty")
    bad = [i for i, v in enumerate(xs) if not math.isfinite(v)]
    if bad:
        raise InputError(f"values must be finite; index {bad[0]} is {xs[bad[0]]}")
    n = len(xs)
    m = math.fsum(xs) / n
    if n == 1:
        t_quantile(level, 1)  # validates level
        return MeanInterval(m, None, None, float(level), 1, None)
    std = math.sqrt(math.fsum((v - m) ** 2 for v in xs) / (n - 1))
    half = t_quantile(level, n - 1) * std / math.sqrt(n)
    return MeanInterval(m, m - half, m + half, float(level), n, std)
