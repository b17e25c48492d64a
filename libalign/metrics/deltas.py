"""The per-token execution gap δ = log p_learner − log p_sampler and its summary.

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

Truncated importance weights and the other importance-correction modes live in
:mod:`libalign.metrics.importance`, built on :func:`gather_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from libalign.arg_checks import check_bounds, check_float_tensor, check_same_shape, jsonable
from libalign.errors import DTypeError, InputError, NonFiniteError, ShapeError

LOGPROB_TOLERANCE = 1e-6
"""Log-probabilities above this are refused (a probability cannot exceed 1; rounding can
push a certain token's log-probability a hair above 0)."""

DEFAULT_CLIP_BOUNDS = (0.8, 1.28)
"""Clipping band for clip potential: ``[1 − 0.2, 1 + 0.28]``."""

QUANTILES = (0.5, 0.9, 0.99)
"""The quantiles of |δ| in :class:`DeltaStats`."""

TokenInput = torch.Tensor | Sequence[torch.Tensor]
"""A padded ``[B, T]`` / ``[T]`` tensor, or a list of 1-D tensors (one per sequence)."""


@dataclass(frozen=True, eq=False)
class Tokens:
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


def gather_tokens(x: TokenInput, mask: torch.Tensor | None, name: str) -> Tokens:
    """Validate one input in either layout and flatten its valid tokens to float64."""
    if isinstance(x, torch.Tensor):
        check_float_tensor(x, name)
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
            check_same_shape(x, mask, name, "mask")
            seq, pos = mask.reshape(rows, cols).to(x.device).nonzero(as_tuple=True)
            values = x2.detach()[seq, pos].to(torch.float64)
        return Tokens(values, seq, pos, rows, tuple(x.shape), None)
    if isinstance(x, (list, tuple)):
        if mask is not None:
            raise InputError(f"{name} is a list of sequences, which carries its own lengths; "
                             "a mask applies to padded tensors only")
        if len(x) == 0:
            raise InputError(f"{name} holds no valid tokens (empty list of sequences)")
        for i, t in enumerate(x):
            check_float_tensor(t, f"{name}[{i}]")
            if t.dim() != 1:
                raise ShapeError(f"{name}[{i}] must be 1-D, got shape {tuple(t.shape)}")
        device = x[0].device
        lengths = [int(t.numel()) for t in x]
        values = torch.cat([t.detach().to(device=device, dtype=torch.float64) for t in x])
        seq = torch.arange(len(x), device=device).repeat_interleave(
            torch.tensor(lengths, device=device))
        starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
        pos = torch.arange(values.numel(), device=device) - starts[seq]
        return Tokens(values, seq, pos, len(x), None, lengths)
    raise DTypeError(f"{name} must be a tensor or a list of 1-D tensors, got {type(x).__name__}")


def flatten_tokens(x: TokenInput, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens of ``x`` as a flat float64 vector plus each token's sequence id (int64).

    Sequence-major order: sequence 0's valid tokens first. This is the form the bootstrap
    functions take (``groups=`` the returned ids).
    """
    tok = gather_tokens(x, mask, "x")
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
        check_same_shape(learner_logp, sampler_logp, "learner_logp", "sampler_logp")
    lt = gather_tokens(learner_logp, mask, "learner_logp")
    st = gather_tokens(sampler_logp, mask, "sampler_logp")
    if not l_is_t:
        if lt.n_seq != st.n_seq:
            raise ShapeError(f"learner_logp has {lt.n_seq} sequences but sampler_logp has "
                             f"{st.n_seq}; they must match")
        for i, (a, b) in enumerate(zip(learner_logp, sampler_logp, strict=True)):
            check_same_shape(a, b, f"learner_logp[{i}]", f"sampler_logp[{i}]")
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
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def delta_stats(delta: TokenInput, mask: torch.Tensor | None = None, *,
                clip_bounds: tuple[float, float] = DEFAULT_CLIP_BOUNDS) -> DeltaStats:
    """Summarize δ over the valid tokens: mean, |δ| quantiles and max, clip potential, k3 KL.

    ``delta`` is laid out like :func:`token_deltas`'s inputs. Clip potential counts tokens with
    ``δ < ln(low)`` or ``δ > ln(high)`` (strict: a ratio exactly on a bound is inside).
    """
    low, high = check_bounds(clip_bounds)
    tok = gather_tokens(delta, mask, "delta")
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
