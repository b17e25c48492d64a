"""Statistics of one diagnosis: δ summaries with bootstrap CIs and paired comparisons to the floor.

Everything here is computed from per-sequence log-probability lists by :mod:`libalign.metrics`;
this module only decides *which* statistics a report carries and how the comparisons are
framed:

* per condition: mean/P50/P90/P99/max |δ|, clip potential (split below/above), k3, TIS weights at
  token, sequence and geometric-mean level with their truncated fractions;
* a 95 % percentile **cluster** bootstrap interval (whole sequences resampled, because the
  tokens of one sequence share a drifted context) for P99 |δ| and for the clip potential;
* for every condition measured on the *same tokens* as the floor, the paired cluster bootstrap
  of ``stat(condition) − stat(floor)`` (one draw of sequences applied to both), with a verdict:
  ``yes`` when the interval lies above zero (the condition widens the tail beyond the floor),
  ``no`` when it lies below zero, ``inconclusive`` when it contains zero. No correction for
  multiple comparisons is applied; the intervals are per comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from alignclient.errors import ShapeError

from libalign import metrics

YES, NO, INCONCLUSIVE = "yes", "no", "inconclusive"


@dataclass(frozen=True)
class StatOptions:
    """Clip band, TIS cap and bootstrap settings shared by every statistic of a run."""

    clip_low: float = metrics.DEFAULT_CLIP_BOUNDS[0]
    clip_high: float = metrics.DEFAULT_CLIP_BOUNDS[1]
    tis_cap: float = metrics.DEFAULT_TIS_CAP
    n_boot: int = 1000
    level: float = 0.95
    seed: int = 0

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.clip_low, self.clip_high)


def deltas(learner: Sequence[torch.Tensor], sampler: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """δ = learner − sampler per sequence (float64), validated by :func:`metrics.token_deltas`."""
    return list(metrics.token_deltas([t.double() for t in learner], [t.double() for t in sampler]))


def _tis_summary(delta: list[torch.Tensor], cap: float, level: str) -> dict:
    w = metrics.tis_weights(delta, cap=cap, level=level)
    flat = torch.cat(w.weights) if isinstance(w.weights, list) else w.weights
    out = w.to_dict()
    out["mean_weight"] = float(flat.double().mean())
    out["min_weight"] = float(flat.double().min())
    return out


def verdict(ci: metrics.BootstrapCI) -> str:
    """``yes`` (interval above 0), ``no`` (below 0) or ``inconclusive`` (contains 0)."""
    if ci.low > 0.0:
        return YES
    if ci.high < 0.0:
        return NO
    return INCONCLUSIVE


def summarize(delta: list[torch.Tensor], opts: StatOptions) -> dict:
    """δ summary, TIS weights and cluster-bootstrap CIs of P99 |δ| and clip potential."""
    ds = metrics.delta_stats(delta, clip_bounds=opts.bounds)
    values, groups = metrics.flatten_tokens(delta)
    out = {"sequences": len(delta), "delta": ds.to_dict(),
           "tis": {lvl: _tis_summary(delta, opts.tis_cap, lvl) for lvl in metrics.TIS_LEVELS}}
    ci = {}
    if len(delta) >= 2:
        ci["p99_abs"] = metrics.bootstrap_ci(metrics.quantile_stat(0.99), values.abs(),
                                             n_boot=opts.n_boot, level=opts.level, seed=opts.seed,
                                             groups=groups).to_dict()
        ci["clip_potential"] = metrics.bootstrap_ci(
            metrics.clip_potential_stat(*opts.bounds), values, n_boot=opts.n_boot,
            level=opts.level, seed=opts.seed, groups=groups).to_dict()
    out["ci"] = ci
    return out


def compare(delta: list[torch.Tensor], floor: list[torch.Tensor], opts: StatOptions) -> dict:
    """Paired cluster-bootstrap CIs of P99 |δ| and clip potential: condition − floor.

    Both δ lists must be over identical tokens (same sequences, same lengths): that is what
    makes one resample of sequences meaningful for both.
    """
    a, groups = metrics.flatten_tokens(delta)
    b, groups_b = metrics.flatten_tokens(floor)
    if not torch.equal(groups, groups_b):
        raise ShapeError("paired comparison needs δ on identical tokens; the sequence "
                                 "layouts of the condition and the floor differ")
    p99 = metrics.paired_bootstrap_ci(metrics.quantile_stat(0.99), a.abs(), b.abs(),
                                      n_boot=opts.n_boot, level=opts.level, seed=opts.seed,
                                      groups=groups)
    clip = metrics.paired_bootstrap_ci(metrics.clip_potential_stat(*opts.bounds), a, b,
                                       n_boot=opts.n_boot, level=opts.level, seed=opts.seed,
                                       groups=groups)
    return {"p99_abs_diff": p99.to_dict(), "clip_potential_diff": clip.to_dict(),
            "widens_tail": verdict(p99), "raises_clip_potential": verdict(clip)}


def abs_delta_ccdf(delta: list[torch.Tensor], points: int = 200) -> dict:
    """The empirical CCDF ``P(|δ| > x)`` on a grid, for the tail plot (JSON-friendly lists)."""
    a = torch.cat([d.abs() for d in delta]).double().sort().values
    n = a.numel()
    hi = float(a[-1]) if n else 0.0
    xs = torch.linspace(0.0, max(hi, 1e-12), points, dtype=torch.float64)
    # fraction strictly greater than x
    greater = n - torch.searchsorted(a, xs, right=True)
    return {"x": xs.tolist(), "ccdf": (greater.double() / max(n, 1)).tolist(), "n": n}
