"""Importance correction of sampler tokens: the weights, the rejections and their diagnostics.

The tokens a learner trains on were drawn by the sampler, whose log-probabilities differ from
the learner's (the execution gap, :mod:`libalign.metrics.deltas`). Per token the log-ratio is::

    s_t = log p_learner(y_t) − log p_sampler(y_t)          (δ in deltas.py)

and ``r_t = exp(s_t)`` is the importance ratio that turns an expectation under the sampler into
one under the learner. Raw ratios have heavy tails, so every trainer bounds them. This module is
the one home for how: the modes slime, Miles and verl offer, under one set of names, each in the
peer's own operation order so that the same tensors give the same bits.

Level: what one weight stands for (:func:`level_log_ratio`)
-----------------------------------------------------------
* ``"token"``: ``s_t`` itself, one weight per token;
* ``"sequence"``: the masked sum ``Σ_t s_t`` of the sequence (the product of its ratios), the
  same for each of its tokens; unbiased, with a variance that grows with length;
* ``"geometric"``: the masked mean ``Σ_t s_t / max(n, 1)`` (the geometric mean of the ratios),
  which neither shrinks nor explodes with length.

The raw weight is ``exp(clamp(s, −20, 20))`` (:data:`SAFETY_BOUND`, the peers' guard against
overflow; ``safety_bound=None`` drops it, as slime's built-in TIS and IcePop functions do).

Mode: how a weight is bounded (:func:`bound_weights`)
-----------------------------------------------------
* ``"truncate"`` (TIS): ``min(r, upper)``; the lower side is left alone;
* ``"clip"`` (CIS): ``clamp(r, lower, upper)``; slime's built-in ``--tis-clip-low``/``--tis-clip``;
* ``"mask"`` (MIS): the weight is kept as it is, and tokens with ``r`` outside
  ``[lower, upper]`` leave the loss mask (they are rejected, not reweighted);
* ``"icepop"``: the weight is ``r`` inside ``[lower, upper]`` and 0 outside (the token stays
  in the mask but contributes nothing).

``lower`` defaults to ``1 / upper``. Every weight is 0 at padding.

Rejection (:func:`ratio_rejection`, :func:`veto_mask`, :func:`divergence_rejection`)
-----------------------------------------------------------------------------------
Rejection changes the *mask*, not the weight:

* by ratio bounds at a level (slime's ``--use-rs``): keep a token when
  ``lower ≤ exp(clamp(s_level)) ≤ upper``;
* by a veto (slime's ``rs_veto_threshold``): a sequence with any valid token whose raw
  ``s_t < log(veto)`` is dropped whole (a catastrophic token: the learner finds it far less
  likely than the sampler did);
* by a divergence estimate (verl's ``rollout_rs``), with the keys of :data:`REJECTION_KEYS`:
  ``token_kX`` per token, ``seq_sum_kX`` / ``seq_mean_kX`` / ``seq_max_kX`` per sequence, of
  the estimators (on ``s`` clamped to ±20)::

      k1 = −s        k2 = s² / 2        k3 = exp(s) − 1 − s

  ``k1`` keys take two ratio bounds ``lower_upper`` (kept when ``log lower ≤ k1 ≤ log upper``);
  ``k2``/``k3`` keys one upper bound. Several keys are combined with AND.

Batch normalisation (:func:`batch_normalize`)
---------------------------------------------
Divides every weight by the batch mean of the weights (over valid tokens at token level, over
sequences at sequence level) so that they average 1; a mean at or below 1e-8 leaves them as they
are. The order of the batch sum follows the layout: a padded tensor is summed in one reduction
(verl's order), a list of sequences sequence by sequence in list order (slime's).

Diagnostics
-----------
``k1``/``k3`` KL estimates (:func:`kl_terms`: ``k1 = log p_sampler − log p_learner`` per token,
whose sampler-mean is ``KL(sampler ‖ learner)``, and ``k3 = exp(s) − s − 1``, its
non-negative lower-variance twin), ``χ²`` (:func:`chi2_terms`: ``E[r²] − 1`` per token and per
sequence, with ``r`` from ``s`` clamped to ±20) and the effective sample size
(:func:`effective_sample_size`: ``1 / mean((w / mean w)²)`` over valid tokens, 1 when all
weights are equal, near 0 when a few dominate).

The learner's own objective (:func:`tis_weights`) is the simplest mode, truncation at token,
sequence or geometric level, computed on the flat valid tokens in log space
(``exp(min(s, ln C))``, so δ = 1000 gives exactly ``C``); a weight counts as truncated when its
log-ratio is strictly above ``ln C``, and a sequence with no valid token has weight 1.

Bad input is refused with typed errors naming what is wrong: an unknown level, mode or key, a
bound that is not a finite positive number or a lower bound above the upper one
(:class:`~libalign.errors.InputError`), tensors of different shapes (:class:`ShapeError`), a
tensor that is not floating point (:class:`DTypeError`), NaN/±Inf at a valid token
(:class:`NonFiniteError`). A batch without any valid token is not an error here: its weights
are all 0 and its mask stays empty; what each trainer logs for it is its adapter's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libalign.errors import DTypeError, InputError, NonFiniteError, ShapeError
from libalign.metrics.deltas import TokenInput, gather_tokens

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ``[−20, 20]`` before ``exp`` (``exp(20) ≈ 4.9e8``)."""

LEVELS = ("token", "sequence", "geometric")
"""What one weight stands for (module doc)."""

MODES = ("truncate", "clip", "mask", "icepop")
"""How a weight is bounded (module doc)."""

REJECTION_KEYS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                  "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""Divergence rejection keys (verl's ``rollout_rs`` options)."""

DEFAULT_TIS_CAP = 2.0
"""Truncation level ``C`` of the learner's TIS weights."""

TIS_LEVELS = LEVELS


# --------------------------------------------------------------------------- checks


def check_choice(value: str, allowed: Sequence[str], name: str) -> str:
    """``value`` when it is one of ``allowed``, else :class:`InputError` naming both."""
    if value not in allowed:
        raise InputError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_bounds_pair(upper: float, lower: float | None, name: str = "bounds"
                      ) -> tuple[float, float]:
    """``(upper, lower)`` as floats, ``lower`` defaulting to ``1 / upper``; both finite, > 0 and
    ``lower ≤ upper``, else :class:`InputError` naming ``name``."""
    up = float(upper)
    if not (math.isfinite(up) and up > 0.0):
        raise InputError(f"{name}: the upper bound must be a finite number > 0, got {upper!r}")
    lo = 1.0 / up if lower is None else float(lower)
    if not (math.isfinite(lo) and lo > 0.0):
        raise InputError(f"{name}: the lower bound must be a finite number > 0, got {lower!r}")
    if lo > up:
        raise InputError(f"{name}: the lower bound {lo!r} is above the upper bound {up!r}")
    return up, lo


def check_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, name: str = "log_ratio") -> None:
    """A floating tensor of ``mask``'s shape, finite wherever ``mask`` is set (typed errors)."""
    for t, n in ((log_ratio, name), (mask, "mask")):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    if not log_ratio.dtype.is_floating_point:
        raise DTypeError(f"{name} must be a floating tensor, got {log_ratio.dtype}")
    if log_ratio.shape != mask.shape:
        raise ShapeError(f"{name} has shape {tuple(log_ratio.shape)} but mask has "
                         f"{tuple(mask.shape)}; they must match")
    bad = ~torch.isfinite(log_ratio) & mask.bool()
    if bool(bad.any()):
        first = [tuple(i) for i in bad.nonzero()[:3].tolist()]
        raise NonFiniteError(f"{name} at valid tokens", count=int(bad.sum()),
                             nan=int((torch.isnan(log_ratio) & mask.bool()).sum()),
                             inf=int((torch.isinf(log_ratio) & mask.bool()).sum()),
                             first_indices=first)


def log_ratio_of(learner_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
    """``learner_logp − sampler_logp`` after checking both inputs against ``mask``."""
    for t, n in ((learner_logp, "learner_logp"), (sampler_logp, "sampler_logp")):
        check_log_ratio(t, mask, n)
    return learner_logp - sampler_logp


# --------------------------------------------------------------------------- row reductions
# Every function below works on one sequence ``[T]`` or a padded batch ``[B, T]``: reductions
# run over the last dimension and keep it, so results broadcast back onto the tokens.


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 values of ``like``'s dtype."""
    return mask.to(like.dtype)


def row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum over the last dimension, kept: ``(where(mask, x, 0) · mask).sum(-1)`` (a NaN at
    padding cannot leak in)."""
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(dim=-1, keepdim=True)


def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over the last dimension, kept; an empty row divides by 1 and gives 0."""
    return row_sum(x, mask) / torch.clamp_min(mask.sum(dim=-1, keepdim=True), 1)


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio each token's weight is made from at ``level`` (module doc), token-shaped."""
    check_choice(level, LEVELS, "level")
    if level == "token":
        return log_ratio
    m = as_float_mask(mask, log_ratio)
    s = row_sum(log_ratio, m) if level == "sequence" else row_mean(log_ratio, m)
    return s.expand_as(log_ratio)


def raw_weights(level_ratio: torch.Tensor, safety_bound: float | None = SAFETY_BOUND
                ) -> torch.Tensor:
    """``exp(clamp(s, −bound, bound))``, or ``exp(s)`` without a bound."""
    if safety_bound is None:
        return torch.exp(level_ratio)
    return torch.exp(torch.clamp(level_ratio, min=-safety_bound, max=safety_bound))


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True, eq=False)
class Correction:
    """Weights and mask of one batch (or sequence) after bounding and rejection.

    ``weights`` are 0 at padding (and, for ``icepop``, outside the bounds); ``mask`` is the
    input mask with rejected tokens cleared (``mask`` mode, ratio rejection, veto), in the
    log-ratio's dtype; ``raw`` the unbounded weights ``exp(clamp(s_level))`` (not masked);
    ``level_ratio`` the level's log-ratio per token.
    """

    weights: torch.Tensor
    mask: torch.Tensor
    raw: torch.Tensor
    level_ratio: torch.Tensor


def in_bounds(w: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """``lower ≤ w ≤ upper`` (bool)."""
    return (w >= lower) & (w <= upper)


def bound_weights(raw: torch.Tensor, mask: torch.Tensor, mode: str, upper: float,
                  lower: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, mask)`` of ``mode`` applied to the raw weights (module doc)."""
    check_choice(mode, MODES, "mode")
    upper, lower = check_bounds_pair(upper, lower, f"{mode} bounds")
    m = as_float_mask(mask, raw)
    if mode == "truncate":
        return raw.clamp(0, upper) * m, m
    if mode == "clip":
        return raw.clamp(lower, upper) * m, m
    if mode == "mask":
        return raw * m, m * in_bounds(raw, lower, upper).to(raw.dtype)
    return torch.where(in_bounds(raw, lower, upper), raw, torch.zeros_like(raw)) * m, m


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, *, level: str = "token",
                       mode: str = "truncate", upper: float = DEFAULT_TIS_CAP,
                       lower: float | None = None,
                       safety_bound: float | None = SAFETY_BOUND) -> Correction:
    """Bounded importance weights of ``log_ratio`` at ``level`` under ``mode`` (module doc).

    ``log_ratio`` is ``[T]`` or ``[B, T]`` (learner minus sampler log-probs), ``mask`` the valid
    tokens (bool or 0/1 numbers) of the same shape. Weights are detached.
    """
    check_log_ratio(log_ratio, mask)
    with torch.no_grad():
        s = level_log_ratio(log_ratio, mask, level)
        raw = raw_weights(s, safety_bound)
        w, m = bound_weights(raw, mask, mode, upper, lower)
    return Correction(w, m, raw, s)


def ratio_rejection(correction: Correction, log_ratio: torch.Tensor, mask: torch.Tensor, *,
                    level: str, upper: float, lower: float | None = None,
                    safety_bound: float | None = SAFETY_BOUND) -> Correction:
    """``correction`` with tokens whose ratio at ``level`` lies outside ``[lower, upper]``
    removed from its mask (the weights are unchanged)."""
    upper, lower = check_bounds_pair(upper, lower, "rejection bounds")
    with torch.no_grad():
        s = level_log_ratio(log_ratio, mask, level)
        keep = in_bounds(raw_weights(s, safety_bound), lower, upper)
        new_mask = correction.mask * keep.to(correction.mask.dtype)
    return Correction(correction.weights, new_mask, correction.raw, correction.level_ratio)


def veto_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, catastrophic)``: ``keep`` is 0 for every token of a sequence holding a valid
    token with ``log_ratio < log(threshold)`` and 1 elsewhere (log-ratio dtype);
    ``catastrophic`` marks those tokens (bool)."""
    thr = float(threshold)
    if not (math.isfinite(thr) and thr > 0.0):
        raise InputError(f"veto threshold must be a finite number > 0, got {threshold!r}")
    log_thr = torch.log(torch.tensor(thr, device=log_ratio.device))
    catastrophic = (log_ratio < log_thr) & mask.bool()
    has = catastrophic.any(dim=-1, keepdim=True)
    return (~has).to(log_ratio.dtype).expand_as(log_ratio), catastrophic


def batch_normalize(weights: torch.Tensor | Sequence[torch.Tensor],
                    mask: torch.Tensor | Sequence[torch.Tensor], level: str = "token"
                    ) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """``(weights / mean, mean)`` with the batch mean of the weights (module doc).

    ``level="token"``: mean over valid tokens; ``"sequence"``: mean over sequences of each
    sequence's mean weight. A padded ``[B, T]`` batch is reduced in one sum (its mean divides
    by ``count + 1e-8`` at token level, by ``max(sequences, 1e-8)`` at sequence level); a list
    of 1-D sequences is reduced sequence by sequence (dividing by ``max(count, 1)``). A mean at
    or below 1e-8 leaves the weights unchanged and is reported as 1.
    """
    check_choice(level, ("token", "sequence"), "batch normalisation level")
    with torch.no_grad():
        if isinstance(weights, torch.Tensor):
            if not isinstance(mask, torch.Tensor) or mask.shape != weights.shape:
                raise ShapeError("batch_normalize: a padded weights tensor needs a mask of its shape")
            m = mask  # as given: an integer mask's count + 1e-8 is fp32, as in verl
            if level == "token":
                mean = (torch.where(m.bool(), weights, 0.0) * m).sum() / (m.sum() + 1e-8)
            else:
                seq = (row_sum(weights, m) / (m.sum(dim=-1, keepdim=True) + 1e-8)).squeeze(-1)
                seq_mask = (m.sum(dim=-1) > 0).to(weights.dtype)
                mean = (seq * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
            return (weights / mean if mean > 1e-8 else weights), (mean if mean > 1e-8 else
                                                                 torch.ones_like(mean))
        ws, ms = list(weights), [as_float_mask(m, w) for m, w in zip(mask, weights, strict=True)]
        if level == "token":
            total = sum((w * m).sum() for w, m in zip(ws, ms, strict=True))
            mean = total / torch.clamp_min(sum(m.sum() for m in ms), 1)
        else:
            mean = sum(row_mean(w, m).squeeze(-1) for w, m in zip(ws, ms, strict=True)) / len(ws)
        if mean > 1e-8:
            return [w / mean for w in ws], mean
        return ws, torch.ones_like(mean)


# --------------------------------------------------------------------------- divergence rejection


def parse_rejection(keys: str | Sequence[str], thresholds: str | float | Sequence
                    ) -> dict[str, tuple[float | None, float]]:
    """``{key: (lower_log or None, upper)}`` from verl-style keys and thresholds.

    ``keys``: one key, a comma-separated string or a list of :data:`REJECTION_KEYS`.
    ``thresholds``: one value shared by all keys or one per key; a ``k1`` key takes
    ``"lower_upper"`` ratio bounds (or one upper bound, the lower then ``1 / upper``) and keeps
    ``log(lower) ≤ k1 ≤ log(upper)``; other keys one upper bound on the statistic.
    """
    names = [k.strip() for k in (keys.split(",") if isinstance(keys, str) else keys) if k.strip()]
    if not names:
        raise InputError("rejection keys: give at least one of " + ", ".join(REJECTION_KEYS))
    for k in names:
        check_choice(k, REJECTION_KEYS, "rejection key")
    names = list(dict.fromkeys(names))
    if isinstance(thresholds, (int, float)) and not isinstance(thresholds, bool):
        specs = [str(thresholds)]
    elif isinstance(thresholds, str):
        specs = [p.strip() for p in thresholds.split(",") if p.strip()]
    elif isinstance(thresholds, Sequence):
        specs = [str(t) for t in thresholds]
    else:
        raise InputError(f"rejection thresholds must be numbers or strings, got {thresholds!r}")
    if len(specs) not in (1, len(names)):
        raise InputError(f"rejection thresholds: give one value or one per key ({len(names)} "
                         f"keys), got {len(specs)}")
    specs = specs * len(names) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for k, spec in zip(names, specs, strict=True):
        try:
            parts = [float(p) for p in spec.split("_", 1)]
        except ValueError as e:
            raise InputError(f"rejection threshold {spec!r} of {k} is not a number") from e
        if k.endswith("k1"):
            up, lo = check_bounds_pair(parts[-1], parts[0] if len(parts) == 2 else None,
                                       f"rejection bounds of {k}")
            out[k] = (math.log(lo), math.log(up))
        else:
            if len(parts) != 1:
                raise InputError(f"rejection threshold of {k} is one upper bound, got {spec!r}")
            up = parts[0]
            if not (math.isfinite(up) and up > 0.0):
                raise InputError(f"rejection bound of {k} must be a finite number > 0, got {spec!r}")
            out[k] = (None, up)
    return out


def divergence_terms(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token ``k1``, ``k2``, ``k3`` of the log-ratio clamped to ±20 (module doc)."""
    s = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {"k1": -s, "k2": 0.5 * s ** 2, "k3": torch.exp(s) - 1.0 - s}


def rejection_statistic(key: str, terms: dict[str, torch.Tensor], mask: torch.Tensor
                        ) -> torch.Tensor:
    """The statistic ``key`` compares, per token (``token_*``) or per sequence (``[B]``)."""
    check_choice(key, REJECTION_KEYS, "rejection key")
    x = terms[key[-2:]]
    if key.startswith("token"):
        return x
    m = mask
    if key.startswith("seq_sum"):
        return (torch.where(m.bool(), x, 0.0) * m).sum(dim=-1)
    if key.startswith("seq_mean"):
        return (torch.where(m.bool(), x, 0.0) * m).sum(dim=-1) / (m.sum(dim=-1) + 1e-8)
    filled = x.masked_fill(~m.bool(), float("-inf")).max(dim=-1).values
    return torch.where(filled == float("-inf"), torch.zeros_like(filled), filled)


def divergence_rejection(log_ratio: torch.Tensor, mask: torch.Tensor,
                         keys: str | Sequence[str], thresholds: str | float | Sequence
                         ) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """``(keep, per_key)``: the token mask (0/1, log-ratio dtype) that passes every key, and
    for each key its ``statistic`` and boolean token ``keep``. ``log_ratio`` is ``[B, T]``."""
    check_log_ratio(log_ratio, mask)
    if log_ratio.dim() != 2:
        raise ShapeError(f"divergence rejection takes a padded [B, T] batch, got shape "
                         f"{tuple(log_ratio.shape)}")
    parsed = parse_rejection(keys, thresholds)
    terms = divergence_terms(log_ratio)
    keep = torch.ones_like(mask, dtype=log_ratio.dtype)
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    for key, (lower_log, upper) in parsed.items():
        stat = rejection_statistic(key, terms, mask)
        ok = stat <= upper if lower_log is None else (stat >= lower_log) & (stat <= upper)
        tok = ok if key.startswith("token") else ok.unsqueeze(-1).expand_as(mask.bool())
        keep = keep * tok.to(log_ratio.dtype)
        per_key[key] = {"statistic": stat, "keep": tok, "lower": lower_log, "upper": upper}
    return keep, per_key


# --------------------------------------------------------------------------- diagnostics


def kl_terms(learner_logp: torch.Tensor, sampler_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token ``k1 = log p_sampler − log p_learner`` and ``k3 = exp(s) − s − 1`` (unclamped
    ``s = log p_learner − log p_sampler``): both estimate ``KL(sampler ‖ learner)``."""
    s = learner_logp - sampler_logp
    return {"k1": sampler_logp - learner_logp, "k3": torch.exp(s) - s - 1}


def chi2_terms(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``r²`` per token and ``(Π r)²`` per sequence (``[..., 1]``), from ``s`` clamped to ±20:
    their means minus 1 are the token- and sequence-level χ² of learner against sampler."""
    m = as_float_mask(mask, log_ratio)
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    seq = torch.clamp(row_sum(log_ratio, m), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {"token": rho.square(), "sequence": torch.exp(2.0 * seq)}


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor, cap: float) -> float:
    """``1 / mean((w / (mean w + 1e-8))²)`` over valid tokens, with ``w`` clamped to
    ``[0, cap]``: 1 for equal weights, near 0 when a few dominate (a fraction of the tokens);
    0 when every weight is 0 (verl divides by zero there)."""
    m = mask  # the mask's own dtype sets the count's, as in verl (an integer count + 1e-8 is fp32)
    w = weights.clamp(min=0.0, max=cap)
    mean = (torch.where(m.bool(), w, 0.0) * m).sum() / (m.sum() + 1e-8)
    norm = w / (mean + 1e-8)
    sq = (torch.where(m.bool(), norm.square(), 0.0) * m).sum() / (m.sum() + 1e-8)
    return 1.0 / sq.item() if sq.item() > 0.0 else 0.0  # every weight 0 (IcePop): no sample


# --------------------------------------------------------------------------- the learner's TIS


@dataclass(frozen=True, eq=False)
class TISWeights:
    """Truncated importance weights and how many were truncated.

    ``weights`` has the input's layout for ``level="token"`` (0.0 at masked positions) and
    shape ``[B]`` (one per sequence) for the sequence levels.
    """

    weights: torch.Tensor | list[torch.Tensor]
    level: str
    cap: float
    truncated: int
    total: int

    @property
    def truncated_fraction(self) -> float:
        """Fraction of weights (tokens or sequences) that hit the cap."""
        return self.truncated / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        """The summary without the weights themselves."""
        return {"level": self.level, "cap": self.cap, "truncated": self.truncated,
                "total": self.total, "truncated_fraction": self.truncated_fraction}


def tis_weights(delta: TokenInput, mask: torch.Tensor | None = None, *,
                cap: float = DEFAULT_TIS_CAP, level: str = "token") -> TISWeights:
    """Truncated importance-sampling weights ``min(exp(·), cap)`` computed in log space.

    ``level="token"``: one weight per valid token from its δ. ``"sequence"``: one per sequence
    from the sum of its δ (the product of ratios). ``"geometric"``: one per sequence from the
    mean of its δ. A weight is truncated when its log-ratio is strictly above ``ln(cap)``.
    """
    if level not in TIS_LEVELS:
        raise InputError(f"level must be one of {TIS_LEVELS}, got {level!r}")
    cap = float(cap)
    if not (math.isfinite(cap) and cap > 0.0):
        raise InputError(f"cap must be a finite number > 0, got {cap!r}")
    tok = gather_tokens(delta, mask, "delta")
    tok.check_nonempty("delta")
    tok.check_finite("delta")
    log_cap = math.log(cap)
    if level == "token":
        s = tok.values
    else:
        s = torch.zeros(tok.n_seq, dtype=torch.float64, device=tok.values.device)
        s.index_add_(0, tok.seq, tok.values)
        if level == "geometric":
            n = torch.bincount(tok.seq, minlength=tok.n_seq).to(torch.float64)
            s = torch.where(n > 0, s / n.clamp(min=1.0), torch.zeros_like(s))
    w = torch.exp(s.clamp(max=log_cap))
    truncated = int((s > log_cap).sum())
    weights = tok.unflatten(w, fill=0.0) if level == "token" else w
    return TISWeights(weights=weights, level=level, cap=cap, truncated=truncated, total=s.numel())
