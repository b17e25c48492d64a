"""The execution gap of one training batch, under the names slime, verl and libalign log it.

A trainer holds, for the same completion tokens, the log-probabilities its own forward pass
gave them (``learner_logp``: verl's ``old_log_probs``, slime's ``log_probs``) and the ones the
rollout engine reported (``sampler_logp``: both call it ``rollout_log_probs``), padded
``[B, T]`` with a mask of valid tokens, or one 1-D tensor per sequence. :func:`gap_metrics`
turns them into one flat dict of floats, three families side by side:

* **slime** ``train_rollout_logprob_abs_diff``: the mean over sequences of each sequence's
  masked mean of ``|log p_learner − log p_sampler|`` (slime's ``sum_of_sample_mean`` of
  ``(old_log_probs − rollout_log_probs).abs()``, divided by the number of sequences as slime
  reports it; a sequence without valid tokens counts as 0, slime's ``clamp_min(·, 1)``);
* **verl** ``training/rollout_probs_diff_{valid,max,mean,std}`` and
  ``training/rollout_actor_probs_pearson_corr`` (``verl.utils.debug.metrics
  .calculate_debug_metrics``): despite the name, verl compares *probabilities*,
  ``|exp(log p_learner) − exp(log p_sampler)|`` over the valid tokens, with the max, mean and
  Bessel-corrected standard deviation (``torch.std``; NaN for one token) and the Pearson
  correlation of the two probability vectors (:func:`pearson`);
* **libalign** ``libalign/<field>`` for every field of
  :class:`~libalign.metrics.DeltaStats` (mean δ, |δ| quantiles, clip potential, k3 KL) and
  ``libalign/tis_truncated_fraction`` (token-level TIS at ``cap``).

Everything is computed in float64 from the valid tokens in sequence-major order (the order
``torch.masked_select`` takes them), so for float64 inputs the verl values are verl's own
bits (the correlation to float64 rounding: it is written out, not ``torch.corrcoef``), and
for float32 inputs they agree to float32 rounding. Inputs are validated by
:func:`libalign.metrics.token_deltas`: mismatched shapes, NaN/Inf or a log-probability above 0
raise its typed errors (``ShapeError``, ``NonFiniteError``, ``InputError``).

A batch without a valid token (every position masked, every sequence empty) is logged as the
peers log it, not refused: slime's mean |δ| is 0 (each sequence counts 0 over its
``clamp_min(·, 1)`` tokens), verl's ``training/rollout_probs_diff_valid`` is 0 and its other
keys NaN (``calculate_debug_metrics``' "response_mask is all False" answer), and
``libalign/count`` is 0; there are no δ statistics and no TIS weights
(:attr:`BatchGap.stats` and :attr:`BatchGap.tis` are None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from alignclient.errors import ShapeError

from libalign.metrics import (
    DEFAULT_TIS_CAP,
    DeltaStats,
    TISWeights,
    TokenInput,
    delta_stats,
    flatten_tokens,
    tis_weights,
    token_deltas,
)

#: slime's name for the mean |δ| of a step.
SLIME_ABS_DIFF = "train_rollout_logprob_abs_diff"
#: verl's names (``verl/utils/debug/metrics.py``), in the order verl returns them.
VERL_KEYS = ("training/rollout_probs_diff_valid", "training/rollout_probs_diff_max",
             "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
             "training/rollout_actor_probs_pearson_corr")
#: Prefix of libalign's own keys.
LIBALIGN_PREFIX = "libalign/"


@dataclass(frozen=True, eq=False)
class BatchGap:
    """One batch's gap: the logged dict, the summary, the TIS weights and the valid δ."""

    metrics: dict[str, float]
    stats: DeltaStats | None  # None: the batch has no valid token
    tis: TISWeights | None  # token level, over the flat valid tokens
    delta: torch.Tensor  # float64 [n], valid tokens, sequence-major
    seq: torch.Tensor  # int64 [n], sequence of each
    n_seq: int
    learner: torch.Tensor  # float64 [n], the learner's log-probs of the valid tokens
    sampler: torch.Tensor  # float64 [n], the sampler's


def _n_sequences(x: TokenInput) -> int:
    if isinstance(x, torch.Tensor):
        return 1 if x.dim() == 1 else int(x.shape[0])
    return len(x)


def slime_abs_diff(delta: torch.Tensor, seq: torch.Tensor, n_seq: int) -> float:
    """Mean over ``n_seq`` sequences of each one's mean |δ| (0 for a sequence without tokens)."""
    sums = torch.zeros(n_seq, dtype=torch.float64, device=delta.device)
    sums.index_add_(0, seq, delta.abs())
    counts = torch.bincount(seq, minlength=n_seq).to(torch.float64).clamp(min=1.0)
    return float((sums / counts).sum() / n_seq)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two vectors, clamped to [-1, 1] as ``torch.corrcoef`` does (NaN
    for fewer than two values or a constant vector). Written out rather than through
    ``torch.corrcoef``, whose matrix product can take milliseconds on a loaded CPU."""
    if x.numel() < 2:
        return math.nan
    xc, yc = x - x.mean(), y - y.mean()
    den = torch.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float(((xc * yc).sum() / den).clamp(-1.0, 1.0)) if float(den) > 0 else math.nan


def verl_probs_diff(learner: torch.Tensor, sampler: torch.Tensor) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` values from the valid tokens' log-probs (flat)."""
    p_l, p_s = torch.exp(learner), torch.exp(sampler)
    diff = torch.abs(p_l - p_s)
    std = float(torch.std(diff)) if diff.numel() > 1 else math.nan
    corr = pearson(p_l, p_s)
    return dict(zip(VERL_KEYS, (1.0, float(torch.max(diff)), float(torch.mean(diff)), std, corr),
                    strict=True))


def gap_metrics(learner_logp: TokenInput, sampler_logp: TokenInput,
                mask: torch.Tensor | None = None, *, cap: float = DEFAULT_TIS_CAP) -> BatchGap:
    """The batch's gap under slime's, verl's and libalign's names (see the module doc)."""
    learner, seq = flatten_tokens(learner_logp, mask)
    if learner.numel() == 0:  # nothing valid: the shapes are still checked, then logged as 0
        _check_same_layout(learner_logp, sampler_logp)
        sampler, _ = flatten_tokens(sampler_logp, mask)
        out = {SLIME_ABS_DIFF: 0.0, VERL_KEYS[0]: 0.0, **dict.fromkeys(VERL_KEYS[1:], math.nan),
               f"{LIBALIGN_PREFIX}count": 0.0}
        return BatchGap(out, None, None, learner, seq, _n_sequences(learner_logp), learner,
                        sampler)
    token_deltas(learner_logp, sampler_logp, mask)  # the typed checks of both inputs
    sampler, _ = flatten_tokens(sampler_logp, mask)
    delta = learner - sampler  # token_deltas' own float64 subtraction, on the flat tokens
    n_seq = _n_sequences(learner_logp)
    stats = delta_stats(delta)
    tis = tis_weights(delta, cap=cap, level="token")
    out = {SLIME_ABS_DIFF: slime_abs_diff(delta, seq, n_seq)}
    out.update(verl_probs_diff(learner, sampler))
    out.update({f"{LIBALIGN_PREFIX}{k}": float(v) for k, v in stats.to_dict().items()
                if v is not None})
    out[f"{LIBALIGN_PREFIX}tis_truncated_fraction"] = tis.truncated_fraction
    return BatchGap(out, stats, tis, delta, seq, n_seq, learner, sampler)


def _check_same_layout(a: TokenInput, b: TokenInput) -> None:
    """ShapeError unless ``a`` and ``b`` are laid out alike (what :func:`token_deltas` checks
    of inputs that have valid tokens)."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        raise ShapeError("learner and sampler log-probs must both be tensors or both be lists")
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            raise ShapeError(f"learner log-probs have shape {tuple(a.shape)} but sampler "
                             f"log-probs have {tuple(b.shape)}")
        return
    if len(a) != len(b) or any(x.numel() != y.numel() for x, y in zip(a, b, strict=False)):
        raise ShapeError("learner and sampler log-probs have different sequence lengths")
