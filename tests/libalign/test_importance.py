"""Pins libalign.metrics.importance by its properties: bounds hold, padding weighs 0, levels are
constant per sequence, batch normalisation averages 1, ESS lies in [0, 1], k3 and χ² + 1 are
non-negative, the padded and per-sequence layouts agree, and bad input is refused by name.
(The comparisons with slime, Miles and verl are in tests/services/test_importance_peers.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign.errors import DTypeError, InputError, NonFiniteError, ShapeError
from libalign.metrics import importance as imp


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    seed = draw(st.integers(0, 2**16))
    spread = draw(st.sampled_from([0.01, 0.5, 5.0, 50.0]))
    g = torch.Generator().manual_seed(seed)
    T = max(max(lengths), 1)
    s = spread * torch.randn(len(lengths), T, generator=g, dtype=torch.float64)
    mask = torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths).unsqueeze(-1)
    return s, mask


modes = st.sampled_from(imp.MODES)
levels = st.sampled_from(imp.LEVELS)
uppers = st.sampled_from([1.0001, 1.5, 2.0, 10.0])


@settings(max_examples=60, deadline=None)
@given(b=batches(), mode=modes, level=levels, upper=uppers)
def test_bounds_padding_and_levels(b, mode, level, upper):
    """Weights are 0 at padding and never negative; truncate/clip stay within their bounds,
    icepop is r or 0, mask keeps r and clears out-of-bound tokens from the mask; at sequence and
    geometric level every valid token of a sequence has one weight."""
    s, mask = b
    c = imp.importance_weights(s, mask, level=level, mode=mode, upper=upper)
    w, m = c.weights, mask.to(s.dtype)
    assert not w[~mask].any() and (w >= 0).all()
    lower = 1.0 / upper
    if mode in ("truncate", "clip"):
        assert (w <= upper).all()
    if mode == "clip":
        assert (w[mask] >= lower).all()
    if mode == "icepop":
        assert torch.equal(w[mask], torch.where(imp.in_bounds(c.raw, lower, upper), c.raw, 0)[mask])
    if mode == "mask":
        assert torch.equal(w[mask], c.raw[mask])
        assert torch.equal(c.mask, m * imp.in_bounds(c.raw, lower, upper).to(s.dtype))
    else:
        assert torch.equal(c.mask, m)
    if level != "token":
        for row, rm in zip(c.raw, mask, strict=True):
            assert row[rm].unique().numel() <= 1


@settings(max_examples=40, deadline=None)
@given(b=batches(), level=st.sampled_from(["token", "sequence"]))
def test_batch_normalisation_averages_one(b, level):
    """After batch normalisation the weights average 1 (over tokens, or over sequences), in
    both layouts, unless every weight was ~0."""
    s, mask = b
    w = imp.importance_weights(s, mask, level=level).weights
    if not mask.any():
        return
    norm, mean = imp.batch_normalize(w, mask, level)
    m = mask.to(w.dtype)
    def avg(x):
        return (x * m).sum() / m.sum() if level == "token" else \
            ((x * m).sum(-1)[mask.any(-1)] / m.sum(-1)[mask.any(-1)]).mean()

    if avg(w) > 1e-7:  # below 1e-8 the weights are left as they are
        assert avg(norm).item() == pytest.approx(1.0, rel=1e-9)
    rows = [w[i, : int(mask[i].sum())] for i in range(len(w))]
    masks = [torch.ones_like(r) for r in rows]
    _, mean_l = imp.batch_normalize(rows, masks, level)
    if level == "token":
        assert mean_l.item() == pytest.approx(mean.item(), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(b=batches())
def test_diagnostics(b):
    """k3 ≥ 0, r² and (Π r)² are positive (χ² ≥ −1), ESS ∈ [0, 1] with 1 for equal weights."""
    s, mask = b
    sampler = -torch.rand(s.shape, dtype=s.dtype)
    learner = sampler + s
    kl = imp.kl_terms(learner, sampler)
    assert (kl["k3"][mask] >= -1e-12).all() and torch.equal(kl["k1"], sampler - learner)
    chi = imp.chi2_terms(s, mask)
    assert (chi["token"] > 0).all() and (chi["sequence"] > 0).all()
    if mask.any():
        w = imp.importance_weights(s, mask).weights
        ess = imp.effective_sample_size(w, mask.to(s.dtype), 2.0)
        # Cauchy-Schwarz bounds the guarded formula by (1 + 1e-8 / mean w)²: 1 for weights far
        # above the guard, more where the weights themselves are near 1e-8
        mu = float(w.clamp(0.0, 2.0)[mask].mean())
        bound = (1.0 + 1e-8 / mu) ** 2 * (1 + 1e-6) if mu > 0 else 0.0  # + float64 rounding
        assert 0.0 <= ess <= bound, (ess, mu, bound)
        assert imp.effective_sample_size(torch.ones_like(w), mask.to(s.dtype), 2.0) == \
            pytest.approx(1.0, rel=1e-6)


def test_rejection_and_veto():
    """Ratio rejection keeps exactly the in-bound tokens; the veto drops a whole sequence with a
    catastrophic token; divergence keys combine with AND."""
    s = torch.tensor([[0.0, 1.0, -0.1], [0.0, -12.0, 0.1]], dtype=torch.float64)
    mask = torch.ones_like(s, dtype=torch.bool)
    c = imp.importance_weights(s, mask)
    r = imp.ratio_rejection(c, s, mask, level="token", upper=2.0, lower=0.5)
    assert r.mask.tolist() == [[1, 0, 1], [1, 0, 1]]  # exp(1) > 2, exp(-12) < 0.5
    keep, cat = imp.veto_mask(s, mask, 1e-4)
    assert keep.tolist() == [[1, 1, 1], [0, 0, 0]] and cat.sum() == 1
    keep, per = imp.divergence_rejection(s, mask, "token_k2,seq_max_k3", "0.6,0.8")
    assert set(per) == {"token_k2", "seq_max_k3"}
    assert keep.tolist() == [[1, 1, 1], [0, 0, 0]]


def test_all_masked_batch_is_zero_weights_not_an_error():
    """A batch without a valid token gives zero weights and an empty mask."""
    s = torch.randn(2, 3, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in imp.MODES:
        c = imp.importance_weights(s, mask, mode=mode, level="geometric")
        assert not c.weights.any() and not c.mask.any()


def test_bad_input_is_named():
    """NaN/Inf at a valid token, shapes, dtypes, names and bounds are refused with typed errors."""
    s = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    bad = s.clone()
    bad[1, 2] = math.inf
    with pytest.raises(NonFiniteError, match="log_ratio"):
        imp.importance_weights(bad, mask)
    bad[1, 2] = math.nan
    imp.importance_weights(bad, mask & (torch.arange(3) < 2))  # NaN at padding is ignored
    with pytest.raises(ShapeError, match="mask"):
        imp.importance_weights(s, mask[:, :2])
    with pytest.raises(DTypeError, match="floating"):
        imp.importance_weights(s.long(), mask)
    with pytest.raises(InputError, match="mode must be one of"):
        imp.importance_weights(s, mask, mode="trunc")
    with pytest.raises(InputError, match="level must be one of"):
        imp.importance_weights(s, mask, level="seq")
    with pytest.raises(InputError, match="above the upper"):
        imp.importance_weights(s, mask, mode="clip", upper=2.0, lower=3.0)
    with pytest.raises(InputError, match="upper bound"):
        imp.importance_weights(s, mask, upper=float("nan"))
    with pytest.raises(InputError, match="rejection key"):
        imp.parse_rejection("token_k4", 1.0)
    with pytest.raises(InputError, match="one value or one per key"):
        imp.parse_rejection("token_k2,token_k3", "1,2,3")
    with pytest.raises(InputError, match="veto"):
        imp.veto_mask(s, mask, 0.0)
