"""Statistics of the learner–sampler execution gap: Δ log p, clip potential, TIS, CIs, L2, routing.

The per-token discrepancy
-------------------------
In RL the sampler (an inference engine, here running NVFP4) generates tokens and records the
log-probability it assigned to each one; the learner (the training stack) later scores the same
tokens. With the weight version, token ids and context held fixed, every difference between the
two numbers comes from execution (formats, kernels, reduction order). Per token::

    δ = log p_learner − log p_sampler          (nats; float64 here)

``δ = 0`` is perfect agreement. The ratio ``r = exp(δ) = p_learner / p_sampler`` is the
learner-to-sampler likelihood ratio that off-policy corrections use.

Inputs come in one of two layouts, and every function here accepts both:

* padded ``[B, T]`` tensors (or a single ``[T]`` sequence) with an optional boolean ``mask``
  marking the valid tokens (padding and prompt tokens are False);
* a list of 1-D tensors, one per sequence, whose lengths say which tokens exist.

:func:`token_deltas` returns δ in the layout it was given (float64, masked positions 0.0);
:func:`flatten_tokens` turns either layout into a flat vector of valid tokens plus the sequence
id of each, which is what the bootstrap functions take.

What the summary reports (:func:`delta_stats`)
----------------------------------------------
Means hide the tail that hurts RL, so besides mean δ and mean |δ| the summary gives the P50, P90,
P99 and maximum of |δ|. Quantiles use linear interpolation between order statistics in float64
(NumPy's default "linear", Hyndman–Fan type 7, the same as ``torch.quantile``): with the n
values sorted ascending as ``x_(0) ≤ … ≤ x_(n−1)`` and ``h = q (n − 1)``, the q-quantile is
``x_(⌊h⌋) + (h − ⌊h⌋)(x_(⌈h⌉) − x_(⌊h⌋))``. No sample-size correction is applied.

*Clip potential* is the fraction of tokens whose ratio ``exp(δ)`` already lies outside a
policy-gradient clipping band before any optimizer step. The default band ``[0.8, 1.28]`` is
the asymmetric ("clip-higher") range ``[1 − 0.2, 1 + 0.28]``. A token counts when
``exp(δ) < low`` or ``exp(δ) > high``, strictly: a ratio exactly on a bound is inside the band,
just as PPO's ``clip(r, low, high)`` leaves it unchanged. The test is done in log space,
``δ < ln(low)`` or ``δ > ln(high)`` with ``ln`` evaluated in float64, so no exponential can
overflow and the boundary is one well-defined float. The fractions below and above are reported
separately because they mean different things (the learner finds the token less or more likely
than the sampler did).

KL estimate (k3). The tokens were drawn from the sampler, so sample averages are expectations
under ``p_sampler``. With ``r = exp(δ) = p_learner / p_sampler`` we have ``E_sampler[r] = 1``
and ``E_sampler[−log r] = KL(sampler ‖ learner)``. Adding the zero-mean control variate
``r − 1`` to ``−log r`` gives the per-token estimator ``k3 = (r − 1) − log r = expm1(δ) − δ``,
which is non-negative for every token and unbiased for ``KL(sampler ‖ learner)`` at the chosen
token's conditional distribution. Two caveats: it sees only the sampled token, not the whole
vocabulary, and when the tokens were *not* drawn from the sampler (teacher-forced scoring of
fixed text) it is a discrepancy index rather than an unbiased KL.

Truncated importance sampling (:func:`tis_weights`)
---------------------------------------------------
Policy-gradient terms computed by the learner on sampler tokens are reweighted by the ratio
``exp(δ)``, truncated from above at ``C`` (default 2.0) so that a few tokens cannot dominate the
gradient: ``w_t = min(exp(δ_t), C)``. The sequence-level variant uses the product of ratios over
the sequence's valid tokens, ``w = min(exp(Σ_t δ_t), C)``; the geometric-mean variant uses
``min(exp(mean_t δ_t), C)``, which does not shrink or explode with length. Everything is done in
log space (``exp(min(s, ln C))``), so δ = 1000 gives exactly ``C`` instead of ``inf``. A weight
counts as truncated when its log-ratio is strictly above ``ln C``. A sequence with no valid
tokens has log-ratio 0 (the empty product) and weight 1.

Confidence intervals (:func:`paired_bootstrap_ci`, :func:`bootstrap_ci`)
-----------------------------------------------------------------------
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

Relative L2 (:func:`relative_l2`, :func:`symmetric_relative_l2`)
---------------------------------------------------------------
Two ways to size the difference between two activation tensors, computed in float64:

* reference-normalized ``‖x − ref‖ / ‖ref‖``: the error of ``x`` measured against a chosen truth;
* symmetric ``‖x − y‖ / ((‖x‖ + ‖y‖) / 2)``: neither side is the truth (learner vs sampler);
  it is symmetric in its arguments and never exceeds 2.

The two do not agree and must not be mixed in one table. A zero denominator gives 0 when the
numerator is also zero (identical all-zero tensors agree perfectly) and ``inf`` otherwise. With
``dim`` the norms are taken along those dimensions only, giving one value per row (per prompt,
per expert).

Routing agreement (:func:`routing_agreement`)
---------------------------------------------
In an MoE layer each token picks its top-k experts. Two paths (learner and sampler, or BF16 and
NVFP4) can pick different experts for the same token, after which their outputs differ by far
more than rounding. For top-k index tensors ``[T, k]`` from the two paths at one layer:

* set match: the fraction of tokens whose two top-k *sets* are identical (order ignored);
  its complement is the routing disagreement;
* mean overlap ``|A ∩ B| / k`` and mean Jaccard ``|A ∩ B| / |A ∪ B|`` per token;
* top-1 agreement: the first column is the highest-scoring expert (``torch.topk`` order), and
  this is the fraction of tokens whose first choices agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from .errors import DTypeError, InputError, NonFiniteError, ShapeError

LOGPROB_TOLERANCE = 1e-6
"""Log-probabilities above this are refused (a probability cannot exceed 1; rounding can
push a certain token's log-probability a hair above 0)."""

DEFAULT_CLIP_BOUNDS = (0.8, 1.28)
"""Clipping band for clip potential: ``[1 − 0.2, 1 + 0.28]``."""

DEFAULT_TIS_CAP = 2.0
"""Truncation level ``C`` of TIS weights."""

QUANTILES = (0.5, 0.9, 0.99)
"""The quantiles of |δ| in :class:`DeltaStats`."""

TIS_LEVELS = ("token", "sequence", "geometric")

_CHUNK_ELEMENTS = 1 << 22
"""Bootstrap counts are built ``R × n`` at a time with ``R × n`` about this many elements."""

TokenInput = torch.Tensor | Sequence[torch.Tensor]
"""A padded ``[B, T]`` / ``[T]`` tensor, or a list of 1-D tensors (one per sequence)."""

WeightedStat = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``stat_fn(x [n] float64, counts [R, n] int32) -> [R] float64``: see the module docstring."""


# --------------------------------------------------------------------------- validation helpers


def _jsonable(value):
    """Python scalars for JSON: non-finite floats become None (JSON has no inf or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _check_float_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_real_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.dtype.is_complex:
        raise DTypeError(f"{name} must be a real-valued tensor, got {x.dtype}")


def _check_same_shape(x: torch.Tensor, y: torch.Tensor, xname: str, yname: str) -> None:
    if x.shape != y.shape:
        raise ShapeError(f"{xname} has shape {tuple(x.shape)} but {yname} has shape "
                         f"{tuple(y.shape)}; they must match")


def _check_finite_tensor(x: torch.Tensor, name: str) -> None:
    """NonFiniteError naming the first offending multi-indices of ``x``."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = bad.nonzero()
        raise NonFiniteError(name, count=int(bad.sum()), nan=int(torch.isnan(x).sum()),
                             inf=int(torch.isinf(x).sum()),
                             first_indices=[tuple(ix.tolist()) for ix in where[:3]])


@dataclass(frozen=True, eq=False)
class _Tokens:
    """The valid tokens of one input, flattened, with where each came from."""

    values: torch.Tensor  # float64 [n], sequence-major order
    seq: torch.Tensor  # int64 [n], sequence index of each value
    pos: torch.Tensor  # int64 [n], position of each value inside its sequence
    n_seq: int
    shape: tuple[int, ...] | None  # original tensor shape, None for a list input
    lengths: list[int] | None  # per-sequence lengths of a list input

    def where(self, i: int) -> tuple[int, int]:
        return int(self.seq[i]), int(self.pos[i])

    def unflatten(self, v: torch.Tensor, fill: float = 0.0) -> torch.Tensor | list[torch.Tensor]:
        """Put per-token values back into the input's layout (``fill`` at masked positions)."""
        if self.lengths is not None:
            return list(torch.split(v, self.lengths))
        assert self.shape is not None
        cols = self.shape[-1]
        out = torch.full((self.n_seq, cols), fill, dtype=v.dtype, device=v.device)
        out[self.seq, self.pos] = v
        return out.reshape(self.shape)

    def check_nonempty(self, name: str) -> None:
        if self.values.numel() == 0:
            raise InputError(f"{name} holds no valid tokens (empty input or all-false mask)")

    def check_finite(self, name: str) -> None:
        bad = ~torch.isfinite(self.values)
        if bool(bad.any()):
            first = bad.nonzero().flatten()[:3].tolist()
            raise NonFiniteError(f"{name} (indices are (sequence, position))",
                                 count=int(bad.sum()), nan=int(torch.isnan(self.values).sum()),
                                 inf=int(torch.isinf(self.values).sum()),
                                 first_indices=[self.where(i) for i in first])


def _gather_tokens(x: TokenInput, mask: torch.Tensor | None, name: str) -> _Tokens:
    """Validate one input in either layout and flatten its valid tokens to float64."""
    if isinstance(x, torch.Tensor):
        _check_float_tensor(x, name)
        if x.dim() not in (1, 2):
            raise ShapeError(f"{name} must be 1-D [T] or 2-D [B, T], got shape {tuple(x.shape)}")
        x2 = x.reshape(1, -1) if x.dim() == 1 else x
        rows, cols = x2.shape
        if mask is None:
            seq = torch.arange(rows, device=x.device).repeat_interleave(cols)
            pos = torch.arange(cols, device=x.device).repeat(rows)
            values = x2.detach().reshape(-1).to(torch.float64)
        else:
            if not isinstance(mask, torch.Tensor):
                raise DTypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
            if mask.dtype != torch.bool:
                raise DTypeError(f"mask must be a bool tensor, got {mask.dtype}")
            _check_same_shape(x, mask, name, "mask")
            seq, pos = mask.reshape(rows, cols).to(x.device).nonzero(as_tuple=True)
            values = x2.detach()[seq, pos].to(torch.float64)
        return _Tokens(values, seq, pos, rows, tuple(x.shape), None)
    if isinstance(x, (list, tuple)):
        if mask is not None:
            raise InputError(f"{name} is a list of sequences, which carries its own lengths; "
                             "a mask applies to padded tensors only")
        if len(x) == 0:
            raise InputError(f"{name} holds no valid tokens (empty list of sequences)")
        for i, t in enumerate(x):
            _check_float_tensor(t, f"{name}[{i}]")
            if t.dim() != 1:
                raise ShapeError(f"{name}[{i}] must be 1-D, got shape {tuple(t.shape)}")
        device = x[0].device
        lengths = [int(t.numel()) for t in x]
        values = torch.cat([t.detach().to(device=device, dtype=torch.float64) for t in x])
        seq = torch.arange(len(x), device=device).repeat_interleave(
            torch.tensor(lengths, device=device))
        starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
        pos = torch.arange(values.numel(), device=device) - starts[seq]
        return _Tokens(values, seq, pos, len(x), None, lengths)
    raise DTypeError(f"{name} must be a tensor or a list of 1-D tensors, got {type(x).__name__}")


def flatten_tokens(x: TokenInput, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens of ``x`` as a flat float64 vector plus each token's sequence id (int64).

    Sequence-major order: sequence 0's valid tokens first. This is the form the bootstrap
    functions take (``groups=`` the returned ids).
    """
    tok = _gather_tokens(x, mask, "x")
    return tok.values, tok.seq


# --------------------------------------------------------------------------- δ and its summary


def token_deltas(learner_logp: TokenInput, sampler_logp: TokenInput,
                 mask: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
    """δ = log p_learner − log p_sampler per token, float64, in the layout given.

    Both inputs are per-token log-probabilities of the same tokens: two tensors of one shape
    (``[T]`` or ``[B, T]``, with an optional bool ``mask`` of valid tokens), or two lists of 1-D
    tensors of matching lengths. Masked positions of the result are 0.0. Only valid tokens are
    checked: NaN/±Inf raise :class:`NonFiniteError` naming ``(sequence, position)``, a value above
    ``LOGPROB_TOLERANCE`` raises :class:`InputError` (not a log-probability), and an input with
    no valid token raises :class:`InputError`.
    """
    l_is_t = isinstance(learner_logp, torch.Tensor)
    s_is_t = isinstance(sampler_logp, torch.Tensor)
    if l_is_t != s_is_t:
        raise DTypeError(f"learner_logp is a {type(learner_logp).__name__} but sampler_logp is a "
                         f"{type(sampler_logp).__name__}; pass two tensors or two lists")
    if l_is_t:
        _check_same_shape(learner_logp, sampler_logp, "learner_logp", "sampler_logp")
    lt = _gather_tokens(learner_logp, mask, "learner_logp")
    st = _gather_tokens(sampler_logp, mask, "sampler_logp")
    if not l_is_t:
        if lt.n_seq != st.n_seq:
            raise ShapeError(f"learner_logp has {lt.n_seq} sequences but sampler_logp has "
                             f"{st.n_seq}; they must match")
        for i, (a, b) in enumerate(zip(learner_logp, sampler_logp, strict=True)):
            _check_same_shape(a, b, f"learner_logp[{i}]", f"sampler_logp[{i}]")
    for tok, name in ((lt, "learner_logp"), (st, "sampler_logp")):
        tok.check_nonempty(name)
        tok.check_finite(name)
        above = tok.values > LOGPROB_TOLERANCE
        if bool(above.any()):
            i = int(above.nonzero()[0, 0])
            s, p = tok.where(i)
            raise InputError(
                f"{name} holds {int(above.sum())} value(s) above 0 (tolerance {LOGPROB_TOLERANCE:g}), "
                f"the first {float(tok.values[i])!r} at (sequence {s}, position {p}): "
                "log-probabilities are at most 0")
    return lt.unflatten(lt.values - st.values, fill=0.0)


def _check_bounds(bounds) -> tuple[float, float]:
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError) as exc:
        raise InputError(f"clip_bounds must be a pair (low, high), got {bounds!r}") from exc
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
        raise InputError(f"clip_bounds must satisfy 0 < low < high (finite), got ({low!r}, {high!r})")
    return low, high


def _sorted_quantiles(xs: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Linear-interpolation quantiles of an ascending 1-D float64 tensor (torch.quantile's rule)."""
    q = torch.tensor(list(qs), dtype=torch.float64, device=xs.device)
    h = q * (xs.numel() - 1)
    lo, hi = h.floor().long(), h.ceil().long()
    return torch.lerp(xs[lo], xs[hi], h - lo.to(torch.float64)).tolist()


@dataclass(frozen=True)
class DeltaStats:
    """Summary of δ over the valid tokens (all values in nats except counts and fractions)."""

    count: int
    mean: float
    mean_abs: float
    p50_abs: float
    p90_abs: float
    p99_abs: float
    max_abs: float
    clip_low: float
    clip_high: float
    below: float  # fraction of tokens with exp(δ) < clip_low
    above: float  # fraction of tokens with exp(δ) > clip_high
    clip_potential: float  # below + above
    k3_kl: float  # mean of expm1(δ) − δ: estimates KL(sampler ‖ learner)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (non-finite floats become None)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}


def delta_stats(delta: TokenInput, mask: torch.Tensor | None = None, *,
                clip_bounds: tuple[float, float] = DEFAULT_CLIP_BOUNDS) -> DeltaStats:
    """Summarize δ over the valid tokens: mean, |δ| quantiles and max, clip potential, k3 KL.

    ``delta`` is laid out like :func:`token_deltas`'s inputs. Clip potential counts tokens with
    ``δ < ln(low)`` or ``δ > ln(high)`` (strict: a ratio exactly on a bound is inside).
    """
    low, high = _check_bounds(clip_bounds)
    tok = _gather_tokens(delta, mask, "delta")
    tok.check_nonempty("delta")
    tok.check_finite("delta")
    d = tok.values
    n = d.numel()
    a = d.abs()
    p50, p90, p99 = _sorted_quantiles(a.sort().values, QUANTILES)
    n_below = int((d < math.log(low)).sum())
    n_above = int((d > math.log(high)).sum())
    return DeltaStats(
        count=n, mean=float(d.mean()), mean_abs=float(a.mean()),
        p50_abs=p50, p90_abs=p90, p99_abs=p99, max_abs=float(a.max()),
        clip_low=low, clip_high=high, below=n_below / n, above=n_above / n,
        clip_potential=(n_below + n_above) / n,
        k3_kl=float((torch.expm1(d) - d).mean()),
    )


# --------------------------------------------------------------------------- TIS


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
    tok = _gather_tokens(delta, mask, "delta")
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


# --------------------------------------------------------------------------- bootstrap statistics


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
    lo, hi = _check_bounds((low, high))
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
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}


def _bootstrap_values(x, name: str) -> torch.Tensor:
    _check_real_tensor(x, name)
    if x.numel() == 0:
        raise InputError(f"{name} is empty")
    _check_finite_tensor(x, name)
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
        _check_real_tensor(b, "b")
        _check_same_shape(a, b, "a", "b")
        xb = _bootstrap_values(b, "b")
    n = xa.numel()
    cluster = None
    if groups is not None:
        if not isinstance(groups, torch.Tensor):
            raise DTypeError(f"groups must be a torch.Tensor, got {type(groups).__name__}")
        if groups.dtype == torch.bool or groups.dtype.is_floating_point or groups.dtype.is_complex:
            raise DTypeError(f"groups must be an integer tensor of sequence ids, got {groups.dtype}")
        _check_same_shape(a, groups, "a", "groups")
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


# --------------------------------------------------------------------------- relative L2


def _norm_dims(dim, ndim: int):
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
            raise ShapeError(f"dim {d!r} is out of range for a {ndim}-D tensor")
    return dims


def _l2_inputs(x, y, xname: str, yname: str, dim):
    _check_real_tensor(x, xname)
    _check_real_tensor(y, yname)
    _check_same_shape(x, y, xname, yname)
    if x.numel() == 0:
        raise InputError(f"{xname} and {yname} are empty")
    _check_finite_tensor(x, xname)
    _check_finite_tensor(y, yname)
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


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class RoutingAgreement:
    """How two paths' top-k expert choices agree at one layer (fractions over tokens)."""

    tokens: int
    k: int
    set_match: float
    mean_overlap: float
    mean_jaccard: float
    top1_agreement: float

    @property
    def disagreement(self) -> float:
        """Fraction of tokens whose top-k sets differ: ``1 − set_match``."""
        return 1.0 - self.set_match

    def to_dict(self) -> dict:
        """Plain JSON-ready dict, with the disagreement."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["disagreement"] = self.disagreement
        return out


def _check_topk(idx, name: str, num_experts: int | None) -> None:
    if not isinstance(idx, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise DTypeError(f"{name} must be an integer tensor of expert indices, got {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ShapeError(f"{name} must be [T, k] with T ≥ 1 and k ≥ 1, got shape {tuple(idx.shape)}")
    invalid = idx < 0
    if num_experts is not None:
        invalid |= idx >= num_experts
    if bool(invalid.any()):
        t, j = invalid.nonzero()[0].tolist()
        limit = f"[0, {num_experts})" if num_experts is not None else "≥ 0"
        raise InputError(f"{name} has expert index {int(idx[t, j])} at (token {t}, slot {j}); "
                         f"indices must be {limit}")
    s = idx.sort(dim=1).values
    dup = s[:, 1:] == s[:, :-1]
    if bool(dup.any()):
        t, j = dup.nonzero()[0].tolist()
        raise InputError(f"{name} picks expert {int(s[t, j])} twice for token {t}; top-k indices "
                         "must be distinct")


def routing_agreement(idx_a: torch.Tensor, idx_b: torch.Tensor, *,
                      num_experts: int | None = None, where: str = "") -> RoutingAgreement:
    """Agreement of two ``[T, k]`` top-k expert index tensors (columns in descending score order).

    Indices must be distinct per token and non-negative (below ``num_experts`` when given).
    ``where`` prefixes error messages (the per-layer helper passes the layer).
    """
    prefix = f"{where}: " if where else ""
    _check_topk(idx_a, f"{prefix}idx_a", num_experts)
    _check_topk(idx_b, f"{prefix}idx_b", num_experts)
    _check_same_shape(idx_a, idx_b, f"{prefix}idx_a", f"{prefix}idx_b")
    a = idx_a.detach().to(torch.int64)
    b = idx_b.detach().to(device=a.device, dtype=torch.int64)
    t, k = a.shape
    inter = (a.unsqueeze(2) == b.unsqueeze(1)).sum((1, 2)).to(torch.float64)
    return RoutingAgreement(
        tokens=t, k=k,
        set_match=float((inter == k).to(torch.float64).mean()),
        mean_overlap=float((inter / k).mean()),
        mean_jaccard=float((inter / (2 * k - inter)).mean()),
        top1_agreement=float((a[:, 0] == b[:, 0]).to(torch.float64).mean()),
    )


def routing_agreement_by_layer(
    layers_a: Mapping[Hashable, torch.Tensor] | Sequence[torch.Tensor],
    layers_b: Mapping[Hashable, torch.Tensor] | Sequence[torch.Tensor],
    *, num_experts: int | None = None,
) -> dict[Hashable, RoutingAgreement]:
    """:func:`routing_agreement` for every layer; lists are keyed by position, dicts by key.

    Both sides must name the same layers; a layer present on one side only is an InputError.
    """
    da = dict(layers_a) if isinstance(layers_a, Mapping) else dict(enumerate(layers_a))
    db = dict(layers_b) if isinstance(layers_b, Mapping) else dict(enumerate(layers_b))
    only_a = [k for k in da if k not in db]
    only_b = [k for k in db if k not in da]
    if only_a or only_b:
        raise InputError(f"layers differ: only in layers_a {only_a}, only in layers_b {only_b}")
    if not da:
        raise InputError("no layers given")
    return {key: routing_agreement(da[key], db[key], num_experts=num_experts, where=f"layer {key}")
            for key in da}
