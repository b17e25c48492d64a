"""Statistics of the learner–sampler execution gap: Δ log p, clip potential, TIS, CIs, L2, routing.

One door, six rooms; every name is importable from ``libalign.metrics``:

* :mod:`~libalign.metrics.deltas` – the per-token gap ``δ = log p_learner − log p_sampler``
  (:func:`token_deltas`), its summary (:func:`delta_stats`: mean, |δ| quantiles, clip
  potential, the k3 KL estimate), on padded-and-masked or per-sequence inputs;
* :mod:`~libalign.metrics.importance` – importance correction: the learner's truncated weights
  (:func:`tis_weights`) and the modes slime, Miles and verl offer (truncate, clip, mask,
  IcePop at token, sequence or geometric level; ratio, veto and divergence rejection; batch
  normalisation; ESS, χ², k1/k3), each in the peer's operation order;
* :mod:`~libalign.metrics.bootstrap` – percentile confidence intervals, paired across two
  conditions on the same tokens and clustered by sequence (:func:`paired_bootstrap_ci`,
  :func:`bootstrap_ci`) over statistics in the resample-counts form (:func:`quantile_stat`);
* :mod:`~libalign.metrics.intervals` – the mean over independent repetitions (training seeds)
  with its Student t interval (:func:`mean_interval`, :func:`t_quantile`), where a percentile
  bootstrap over a handful of values would claim more than it knows;
* :mod:`~libalign.metrics.distance` – how far apart two activation tensors are
  (:func:`relative_l2`, :func:`symmetric_relative_l2`);
* :mod:`~libalign.routing.agreement` – how two paths' top-k expert choices agree
  (:func:`routing_agreement`).

Each module's docstring states its definitions (quantile rule, clipping band, estimators),
so a number on a dashboard can be traced to one formula. Inputs are validated and refused
with typed errors (:mod:`libalign.errors`) naming the argument and, for NaN/Inf, where.
"""

from libalign.metrics.bootstrap import (
    BootstrapCI,
    WeightedStat,
    bootstrap_ci,
    clip_potential_stat,
    from_unweighted,
    mean_stat,
    paired_bootstrap_ci,
    quantile_stat,
)
from libalign.metrics.deltas import (
    DEFAULT_CLIP_BOUNDS,
    LOGPROB_TOLERANCE,
    QUANTILES,
    DeltaStats,
    TokenInput,
    delta_stats,
    flatten_tokens,
    token_deltas,
)
from libalign.metrics.distance import relative_l2, symmetric_relative_l2
from libalign.metrics.importance import (
    DEFAULT_TIS_CAP,
    TIS_LEVELS,
    Correction,
    TISWeights,
    importance_weights,
    tis_weights,
)
from libalign.metrics.intervals import (
    MeanInterval,
    mean_interval,
    t_quantile,
    t_two_sided_probability,
)
from libalign.routing.agreement import (
    RoutingAgreement,
    routing_agreement,
    routing_agreement_by_layer,
)

__all__ = [
    "DEFAULT_CLIP_BOUNDS", "DEFAULT_TIS_CAP", "LOGPROB_TOLERANCE", "QUANTILES", "TIS_LEVELS",
    "BootstrapCI", "Correction", "DeltaStats", "MeanInterval", "RoutingAgreement", "TISWeights",
    "TokenInput", "WeightedStat", "bootstrap_ci", "clip_potential_stat", "delta_stats",
    "flatten_tokens", "from_unweighted", "importance_weights", "mean_interval", "mean_stat",
    "paired_bootstrap_ci", "quantile_stat", "relative_l2", "routing_agreement",
    "routing_agreement_by_layer", "symmetric_relative_l2", "t_quantile",
    "t_two_sided_probability", "tis_weights", "token_deltas",
]
