"""Pins libalign.metrics: δ and its summary, clip potential, TIS, bootstrap CIs, relative L2, routing."""

import json
import math

import pytest
import torch
from alignclient.errors import DTypeError, InputError, NonFiniteError, ShapeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libalign.metrics import (
    BootstrapCI,
    bootstrap_ci,
    clip_potential_stat,
    delta_stats,
    flatten_tokens,
    from_unweighted,
    mean_stat,
    paired_bootstrap_ci,
    quantile_stat,
    relative_l2,
    routing_agreement,
    routing_agreement_by_layer,
    symmetric_relative_l2,
    tis_weights,
    token_deltas,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F64 = torch.float64


def t64(values):
    return torch.tensor(values, dtype=F64)


# --------------------------------------------------------------------------- token_deltas


def test_token_deltas_padded_with_mask():
    """δ = learner − sampler in float64; masked positions are 0 and are not validated."""
    learner = torch.tensor([[-1.0, -2.0, -0.5], [-0.125, -3.0, float("nan")]])
    sampler = torch.tensor([[-1.5, -2.0, -0.25], [-0.125, 0.5, -9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    d = token_deltas(learner, sampler, mask)
    assert d.dtype == F64
    assert torch.equal(d, t64([[0.5, 0.0, -0.25], [0.0, 0.0, 0.0]]))


def test_token_deltas_list_and_1d():
    """Lists give a list of per-sequence δ; a 1-D tensor is one sequence."""
    d = token_deltas([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                     [torch.tensor([-2.0, -1.0]), torch.tensor([-0.75])])
    assert isinstance(d, list)
    assert torch.equal(d[0], t64([1.0, -1.0]))
    assert torch.equal(d[1], t64([0.25]))
    one = token_deltas(torch.tensor([-1.0, -0.5]), torch.tensor([-1.0, -1.0], dtype=torch.bfloat16))
    assert torch.equal(one, t64([0.0, 0.5]))


def test_token_deltas_accepts_tiny_positive():
    """A log-prob a hair above 0 (≤ 1e-6) is rounding, not an error."""
    d = token_deltas(torch.tensor([5e-7]), torch.tensor([-1.0]))
    assert d.item() == pytest.approx(1.0 + 5e-7, abs=1e-9)


def test_token_deltas_shape_mismatch_names_both_shapes():
    """Unequal shapes are a ShapeError quoting both."""
    with pytest.raises(ShapeError, match=r"\(2, 3\).*\(2, 4\)"):
        token_deltas(torch.zeros(2, 3) - 1, torch.zeros(2, 4) - 1)


def test_token_deltas_list_errors_name_the_sequence():
    """List inputs: count mismatch and per-sequence shape mismatch name what differs."""
    with pytest.raises(ShapeError, match=r"2 sequences.*1"):
        token_deltas([-torch.ones(2), -torch.ones(1)], [-torch.ones(2)])
    with pytest.raises(ShapeError, match=r"learner_logp\[1\]"):
        token_deltas([-torch.ones(2), -torch.ones(3)], [-torch.ones(2), -torch.ones(2)])
    with pytest.raises(ShapeError, match=r"learner_logp\[0\] must be 1-D"):
        token_deltas([-torch.ones(2, 2)], [-torch.ones(2, 2)])
    with pytest.raises(InputError, match="mask"):
        token_deltas([-torch.ones(2)], [-torch.ones(2)], mask=torch.ones(2, dtype=torch.bool))


def test_token_deltas_dtype_errors():
    """Integer log-probs, non-bool masks and mixed tensor/list inputs are DTypeErrors."""
    with pytest.raises(DTypeError, match=r"torch\.int64"):
        token_deltas(torch.zeros(3, dtype=torch.int64), torch.zeros(3))
    with pytest.raises(DTypeError, match="bool"):
        token_deltas(-torch.ones(3), -torch.ones(3), mask=torch.ones(3))
    with pytest.raises(DTypeError, match="two tensors or two lists"):
        token_deltas(-torch.ones(3), [-torch.ones(3)])
    with pytest.raises(ShapeError, match="mask"):
        token_deltas(-torch.ones(2, 3), -torch.ones(2, 3), mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ShapeError, match="1-D"):
        token_deltas(-torch.ones(2, 2, 2), -torch.ones(2, 2, 2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_token_deltas_non_finite_names_sequence_and_position(bad):
    """NaN/±Inf among valid tokens: NonFiniteError with (sequence, position) of the first."""
    sampler = -torch.ones(3, 4)
    sampler[1, 2] = bad
    sampler[2, 0] = bad
    with pytest.raises(NonFiniteError, match=r"sampler_logp.*\(1, 2\)") as err:
        token_deltas(-torch.ones(3, 4), sampler)
    assert err.value.first_indices[0] == (1, 2)
    assert err.value.count == 2


def test_token_deltas_non_finite_in_list_names_position():
    """In a list, the index is (sequence number, position inside it)."""
    with pytest.raises(NonFiniteError, match=r"\(1, 1\)"):
        token_deltas([-torch.ones(2), torch.tensor([-1.0, float("nan")])], [-torch.ones(2), -torch.ones(2)])


def test_token_deltas_positive_logprob_rejected():
    """A log-prob above the tolerance is not a log-probability; the message names where."""
    learner = -torch.ones(2, 3)
    learner[0, 1] = 0.5
    with pytest.raises(InputError, match=r"learner_logp.*0\.5.*sequence 0, position 1"):
        token_deltas(learner, -torch.ones(2, 3))


def test_token_deltas_empty_rejected():
    """No valid tokens (empty tensor, all-false mask, empty list) is an InputError."""
    with pytest.raises(InputError, match="no valid tokens"):
        token_deltas(torch.zeros(0), torch.zeros(0))
    with pytest.raises(InputError, match="no valid tokens"):
        token_deltas(-torch.ones(2, 2), -torch.ones(2, 2), mask=torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(InputError, match="no valid tokens"):
        token_deltas([], [])


def test_flatten_tokens():
    """Valid tokens in sequence-major order with their sequence ids."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, True, True]])
    v, g = flatten_tokens(x, mask)
    assert torch.equal(v, t64([1.0, 3.0, 5.0, 6.0]))
    assert torch.equal(g, torch.tensor([0, 0, 1, 1]))
    v, g = flatten_tokens([torch.tensor([1.0]), torch.tensor([]), torch.tensor([2.0, 3.0])])
    assert torch.equal(g, torch.tensor([0, 2, 2]))


# --------------------------------------------------------------------------- delta_stats


def test_delta_stats_hand_example():
    """Every field on a five-token example computed by hand."""
    d = t64([0.0, 0.25, -0.5, 0.75, -1.0])
    s = delta_stats(d)
    assert s.count == 5
    assert s.mean == pytest.approx(-0.1, abs=1e-15)
    assert s.mean_abs == 0.5
    # |δ| sorted = 0, .25, .5, .75, 1; h = q·4
    assert s.p50_abs == 0.5
    assert s.p90_abs == pytest.approx(0.75 + 0.6 * 0.25, abs=1e-15)
    assert s.p99_abs == pytest.approx(0.75 + 0.96 * 0.25, abs=1e-15)
    assert s.max_abs == 1.0
    # ln 0.8 = -0.223, ln 1.28 = 0.247: below = {-0.5, -1}, above = {0.25, 0.75}
    assert (s.below, s.above, s.clip_potential) == (0.4, 0.4, 0.8)
    k3 = sum(math.expm1(x) - x for x in d.tolist()) / 5
    assert s.k3_kl == pytest.approx(k3, rel=1e-14)


def test_delta_stats_quantiles_exact_on_grid():
    """With 101 dyadic values the quantile ranks are integers: P50/P90/P99 are exact."""
    d = -torch.arange(101, dtype=F64) / 64
    s = delta_stats(d)
    assert (s.p50_abs, s.p90_abs, s.p99_abs, s.max_abs) == (50 / 64, 90 / 64, 99 / 64, 100 / 64)


@SETTINGS
@given(st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=200))
def test_delta_stats_quantiles_match_torch_quantile(ds):
    """P50/P90/P99 of |δ| are torch.quantile's linear interpolation in float64, bit for bit."""
    d = t64(ds)
    s = delta_stats(d)
    ref = torch.quantile(d.abs(), t64([0.5, 0.9, 0.99])).tolist()
    assert [s.p50_abs, s.p90_abs, s.p99_abs] == ref
    assert s.max_abs == d.abs().max().item()
    assert s.k3_kl >= 0.0
    assert s.clip_potential == pytest.approx(s.below + s.above, abs=1e-15)


def test_delta_stats_mask_and_list_agree():
    """Padded+mask and list layouts summarize the same tokens identically."""
    padded = t64([[0.1, -0.3, 9.0], [0.2, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    a = delta_stats(padded, mask)
    b = delta_stats([t64([0.1, -0.3]), t64([0.2])])
    assert a == b
    assert a.count == 3


def test_clip_bounds_are_strict_at_the_boundary():
    """A ratio exactly on a bound is inside the band; one ulp outside counts."""
    lo, hi = math.log(0.8), math.log(1.28)
    assert delta_stats(t64([lo, hi])).clip_potential == 0.0
    out = t64([math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)])
    s = delta_stats(out)
    assert (s.below, s.above, s.clip_potential) == (0.5, 0.5, 1.0)
    inside = t64([math.nextafter(lo, 0.0), math.nextafter(hi, 0.0)])
    assert delta_stats(inside).clip_potential == 0.0


def test_clip_bounds_configurable_and_validated():
    """Custom bounds change the count; nonsensical bounds are InputErrors."""
    d = t64([math.log(0.5), 0.0, math.log(3.0)])
    assert delta_stats(d, clip_bounds=(0.4, 4.0)).clip_potential == 0.0
    assert delta_stats(d, clip_bounds=(0.6, 2.0)).clip_potential == pytest.approx(2 / 3)
    for bad in [(1.2, 0.8), (0.0, 1.2), (0.8, math.inf), (0.8,)]:
        with pytest.raises(InputError, match="clip_bounds"):
            delta_stats(d, clip_bounds=bad)


def test_k3_estimates_kl_sampler_to_learner():
    """Tokens drawn from the sampler: mean k3 ≈ KL(sampler ‖ learner), not the reverse."""
    g = torch.Generator().manual_seed(1)
    p_s = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    p_l = torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=F64)
    tok = torch.multinomial(p_s, 400_000, replacement=True, generator=g)
    d = p_l.log()[tok] - p_s.log()[tok]
    kl_sl = float((p_s * (p_s / p_l).log()).sum())
    kl_ls = float((p_l * (p_l / p_s).log()).sum())
    k3 = delta_stats(d).k3_kl
    assert k3 == pytest.approx(kl_sl, rel=0.02)
    assert abs(k3 - kl_ls) > 0.1 * kl_sl


def test_delta_stats_errors_and_json():
    """NaN δ names its index; to_dict is strict JSON (an infinite k3 becomes None)."""
    with pytest.raises(NonFiniteError, match=r"delta.*\(0, 1\)"):
        delta_stats(t64([0.0, float("nan")]))
    s = delta_stats(t64([800.0, 0.0]))
    assert math.isinf(s.k3_kl)
    out = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert out["k3_kl"] is None
    assert out["count"] == 2 and out["max_abs"] == 800.0


# --------------------------------------------------------------------------- TIS


def test_tis_token_level_hand_example():
    """w = min(exp δ, C) per token; δ = ±1000 gives C and 0 without overflow."""
    d = t64([0.0, math.log(1.5), math.log(3.0), 1000.0, -1000.0])
    r = tis_weights(d)
    assert r.weights.dtype == F64
    assert torch.allclose(r.weights, t64([1.0, 1.5, 2.0, 2.0, 0.0]), rtol=1e-15, atol=0)
    assert (r.truncated, r.total, r.truncated_fraction) == (2, 5, 0.4)
    assert torch.isfinite(r.weights).all()


def test_tis_cap_boundary_and_parameter():
    """δ = ln C is not truncated, one ulp above is; the cap is a parameter."""
    assert tis_weights(t64([math.log(2.0)])).truncated == 0
    assert tis_weights(t64([math.nextafter(math.log(2.0), math.inf)])).truncated == 1
    r = tis_weights(t64([math.log(3.0), math.log(6.0)]), cap=5.0)
    assert torch.allclose(r.weights, t64([3.0, 5.0]), rtol=1e-15, atol=0)
    assert r.truncated_fraction == 0.5
    for bad in [0.0, -1.0, math.inf, math.nan]:
        with pytest.raises(InputError, match="cap"):
            tis_weights(t64([0.0]), cap=bad)
    with pytest.raises(InputError, match="level"):
        tis_weights(t64([0.0]), level="tokens")


def test_tis_sequence_and_geometric_levels():
    """Sequence level uses Σδ over valid tokens, geometric the mean; an empty row weighs 1."""
    d = t64([[0.5, 0.5, 7.0], [-1.0, 0.5, 7.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    seq = tis_weights(d, mask, level="sequence")
    assert torch.allclose(seq.weights, t64([2.0, math.exp(-0.5), 1.0]), rtol=1e-15, atol=0)
    assert (seq.truncated, seq.total) == (1, 3)
    geo = tis_weights(d, mask, level="geometric")
    assert torch.allclose(geo.weights, t64([math.exp(0.5), math.exp(-0.25), 1.0]), rtol=1e-15, atol=0)
    assert geo.truncated == 0
    tok = tis_weights(d, mask)
    assert tok.weights.shape == (3, 3)
    assert tok.weights[0, 2] == 0.0 and tok.total == 4


def test_tis_no_overflow_for_huge_delta():
    """δ = 1000 on every token: every level returns exactly the cap."""
    d = torch.full((2, 5), 1000.0, dtype=F64)
    for level in ("token", "sequence", "geometric"):
        r = tis_weights(d, level=level, cap=2.0)
        assert torch.all(r.weights == 2.0), level
        assert r.truncated_fraction == 1.0
    assert json.dumps(r.to_dict())


def test_tis_list_input_token_level_returns_list():
    """A list of sequences gets a list of per-token weights back."""
    r = tis_weights([t64([0.0, 5.0]), t64([-math.log(2.0)])])
    assert isinstance(r.weights, list)
    assert torch.equal(r.weights[0], t64([1.0, 2.0]))
    assert r.weights[1].item() == pytest.approx(0.5, rel=1e-15)


@SETTINGS
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=40),
       st.floats(1.0, 10.0))
def test_tis_properties(ds, cap):
    """0 ≤ w ≤ cap, and w = exp(δ) wherever δ ≤ ln cap."""
    d = t64(ds)
    w = tis_weights(d, cap=cap).weights
    assert torch.all(w >= 0) and torch.all(w <= cap * (1 + 1e-15))
    keep = d <= math.log(cap)
    assert torch.allclose(w[keep], d[keep].exp(), rtol=1e-15, atol=0)


# --------------------------------------------------------------------------- bootstrap


def test_quantile_stat_matches_expanded_torch_quantile_exactly():
    """Counts form == torch.quantile of the multiset it describes, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, generator=g, dtype=F64)
    counts = torch.randint(0, 4, (9, 60), generator=g, dtype=torch.int32)
    counts[:, 0] += 1
    for q in (0.0, 0.3, 0.5, 0.9, 0.99, 1.0):
        got = quantile_stat(q)(x, counts)
        ref = torch.stack([torch.quantile(x.repeat_interleave(c.long()), q) for c in counts])
        assert torch.equal(got, ref), q


@SETTINGS
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=30),
       st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_quantile_stat_property(xs, q, seed):
    """For any values, counts and q: equal to torch.quantile of the expansion."""
    x = t64(xs)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (3, x.numel()), generator=g, dtype=torch.int32)
    counts[:, -1] += 1
    ref = torch.stack([torch.quantile(x.repeat_interleave(c.long()), q) for c in counts])
    assert torch.equal(quantile_stat(q)(x, counts), ref)


def test_weighted_stats_on_unit_counts_are_plain_statistics():
    """With every count 1 the ready-made statistics equal delta_stats' values."""
    g = torch.Generator().manual_seed(3)
    d = torch.randn(1000, generator=g, dtype=F64) * 0.2
    ones = torch.ones(1, 1000, dtype=torch.int32)
    s = delta_stats(d)
    assert quantile_stat(0.99)(d.abs(), ones).item() == s.p99_abs
    assert clip_potential_stat()(d, ones).item() == s.clip_potential
    assert mean_stat(d.abs(), ones).item() == pytest.approx(s.mean_abs, rel=1e-14)
    assert from_unweighted(torch.mean)(d, ones).item() == pytest.approx(s.mean, rel=1e-12)


def test_bootstrap_two_point_hand_example():
    """Mean of {0, 1} resampled: 0, ½, 1 with probabilities ¼, ½, ¼, so the 95% CI is [0, 1]."""
    ci = bootstrap_ci(mean_stat, t64([0.0, 1.0]), n_boot=2000, seed=5)
    assert (ci.estimate, ci.low, ci.high) == (0.5, 0.0, 1.0)
    assert not ci.excludes_zero
    assert (ci.resampled, ci.units, ci.n_boot, ci.level) == ("tokens", 2, 2000, 0.95)


def test_bootstrap_deterministic_by_seed():
    """The same seed reproduces the interval; another seed gives another one."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, generator=g, dtype=F64).abs()
    b = a * 0.9 + 0.01 * torch.randn(3000, generator=g, dtype=F64)
    one = paired_bootstrap_ci(quantile_stat(0.9), a, b, n_boot=200, seed=7)
    two = paired_bootstrap_ci(quantile_stat(0.9), a, b, n_boot=200, seed=7)
    other = paired_bootstrap_ci(quantile_stat(0.9), a, b, n_boot=200, seed=8)
    assert one == two
    assert (one.low, one.high) != (other.low, other.high)
    assert one.estimate == other.estimate


@pytest.mark.parametrize("stat", [mean_stat, quantile_stat(0.99), clip_potential_stat()])
@pytest.mark.parametrize("clustered", [False, True])
def test_paired_identical_inputs_give_exactly_zero(stat, clustered):
    """stat(a) − stat(a) is 0 in every resample, so the CI is exactly [0, 0]."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(500, generator=g, dtype=F64) * 0.3
    groups = torch.arange(500) // 25 if clustered else None
    ci = paired_bootstrap_ci(stat, a, a.clone(), n_boot=100, groups=groups)
    assert (ci.estimate, ci.low, ci.high) == (0.0, 0.0, 0.0)
    assert not ci.excludes_zero


@pytest.mark.parametrize("stat", [mean_stat, quantile_stat(0.5), quantile_stat(0.99)])
def test_paired_shifted_copy_ci_contains_the_shift(stat):
    """a = b + 0.25: every resample differs by 0.25 (to rounding), so the CI holds 0.25."""
    g = torch.Generator().manual_seed(2)
    b = torch.randn(2000, generator=g, dtype=F64)
    ci = paired_bootstrap_ci(stat, b + 0.25, b, n_boot=200)
    assert ci.low <= 0.25 + 1e-12 and ci.high >= 0.25 - 1e-12
    assert ci.high - ci.low < 1e-12
    assert ci.excludes_zero


def test_paired_noisy_shift_is_covered():
    """Mean difference with independent noise: the CI covers the true shift and excludes 0."""
    g = torch.Generator().manual_seed(11)
    b = torch.randn(5000, generator=g, dtype=F64)
    a = b + 0.1 + 0.5 * torch.randn(5000, generator=g, dtype=F64)
    ci = paired_bootstrap_ci(mean_stat, a, b, n_boot=500, seed=3)
    assert ci.low < 0.1 < ci.high
    assert ci.excludes_zero


def test_cluster_bootstrap_resamples_whole_sequences():
    """With groups, every token of a sequence gets the same count in every resample."""
    lengths = [3, 1, 5, 2, 4]
    groups = torch.repeat_interleave(torch.tensor([10, 20, 30, 40, 50]), torch.tensor(lengths))
    # Shuffle token order: sequence membership, not adjacency, must decide the clusters.
    order = torch.randperm(groups.numel(), generator=torch.Generator().manual_seed(0))
    groups = groups[order]
    seen = []

    def checking_mean(x, counts):
        for gid in groups.unique():
            sub = counts[:, groups == gid]
            assert torch.all(sub == sub[:, :1])
        seen.append(counts.sum(1))
        return mean_stat(x, counts)

    x = torch.arange(groups.numel(), dtype=F64)
    ci = bootstrap_ci(checking_mean, x, n_boot=300, groups=groups)
    assert (ci.resampled, ci.units) == ("sequences", 5)
    totals = torch.cat(seen[1:])
    assert totals.unique().numel() > 1  # resample sizes vary with the sequences drawn


def test_cluster_bootstrap_wider_for_correlated_sequences():
    """Per-sequence offsets make tokens correlated: resampling tokens understates the CI."""
    g = torch.Generator().manual_seed(4)
    groups = torch.arange(40).repeat_interleave(50)
    x = torch.randn(40, generator=g, dtype=F64)[groups] + 0.05 * torch.randn(2000, generator=g, dtype=F64)
    tokens = bootstrap_ci(mean_stat, x, n_boot=400)
    seqs = bootstrap_ci(mean_stat, x, n_boot=400, groups=groups)
    assert (seqs.high - seqs.low) > 3 * (tokens.high - tokens.low)


def test_bootstrap_errors():
    """Bad arguments are typed errors that say what is wrong."""
    a = t64([0.1, 0.2, 0.3])
    with pytest.raises(InputError, match="n_boot"):
        bootstrap_ci(mean_stat, a, n_boot=0)
    with pytest.raises(InputError, match="level"):
        bootstrap_ci(mean_stat, a, level=1.0)
    with pytest.raises(ShapeError, match=r"\(3,\).*\(2,\)"):
        paired_bootstrap_ci(mean_stat, a, t64([0.1, 0.2]))
    with pytest.raises(NonFiniteError, match=r"b.*\(2,\)"):
        paired_bootstrap_ci(mean_stat, a, t64([0.1, 0.2, float("inf")]))
    with pytest.raises(InputError, match="empty"):
        bootstrap_ci(mean_stat, t64([]))
    with pytest.raises(DTypeError, match="groups"):
        bootstrap_ci(mean_stat, a, groups=t64([0.0, 0.0, 1.0]))
    with pytest.raises(InputError, match="at least 2 sequences"):
        bootstrap_ci(mean_stat, a, groups=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ShapeError, match="groups"):
        bootstrap_ci(mean_stat, a, groups=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ShapeError, match="one value per resample"):
        bootstrap_ci(lambda x, c: x.mean(), a)
    with pytest.raises(InputError, match="quantile"):
        quantile_stat(1.5)


def test_bootstrap_ci_to_dict_is_json():
    """The result serializes with its fields."""
    ci = bootstrap_ci(quantile_stat(0.5), t64([1.0, 2.0, 3.0, 4.0]), n_boot=50)
    assert isinstance(ci, BootstrapCI)
    out = json.loads(json.dumps(ci.to_dict(), allow_nan=False))
    assert out["estimate"] == 2.5 and out["n_boot"] == 50 and out["excludes_zero"] is True


# --------------------------------------------------------------------------- relative L2


def test_relative_l2_hand_examples():
    """‖x − ref‖/‖ref‖ and ‖x − y‖/mean(‖x‖, ‖y‖) on a 3-4-5 example."""
    x, ref = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0])
    assert relative_l2(x, ref).item() == 0.75
    assert symmetric_relative_l2(x, ref).item() == pytest.approx(3 / 4.5, rel=1e-15)
    assert relative_l2(x, ref).dtype == F64


def test_relative_l2_zero_denominator_rule():
    """Both zero → 0; reference zero and x non-zero → inf; symmetric is 0 only when both are 0."""
    z = torch.zeros(4)
    assert relative_l2(z, z).item() == 0.0
    assert math.isinf(relative_l2(torch.tensor([0.0, 0.0, 0.0, 1e-30]), z).item())
    assert symmetric_relative_l2(z, z).item() == 0.0
    assert symmetric_relative_l2(torch.ones(4), z).item() == 2.0


def test_relative_l2_per_row():
    """dim gives one value per row, with the zero rule applied row by row."""
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    ref = torch.tensor([[0.0, 4.0], [0.0, 0.0], [0.0, 0.0]])
    r = relative_l2(x, ref, dim=1)
    assert r.shape == (3,)
    assert r[0] == 0.75 and r[1] == 0.0 and math.isinf(r[2])
    s = symmetric_relative_l2(x, ref, dim=-1)
    assert torch.allclose(s, t64([3 / 4.5, 0.0, 2.0]), rtol=1e-15, atol=0)
    assert relative_l2(x.reshape(3, 1, 2), ref.reshape(3, 1, 2), dim=(1, 2)).shape == (3,)


def test_relative_l2_errors():
    """Shape mismatch, NaN (with its index), bool dtype, bad dim, empty: typed errors."""
    with pytest.raises(ShapeError, match=r"\(2,\).*\(3,\)"):
        relative_l2(torch.ones(2), torch.ones(3))
    with pytest.raises(NonFiniteError, match=r"ref.*\(1,\)"):
        relative_l2(torch.ones(2), torch.tensor([1.0, float("nan")]))
    with pytest.raises(DTypeError, match="bool"):
        symmetric_relative_l2(torch.ones(2, dtype=torch.bool), torch.ones(2))
    with pytest.raises(ShapeError, match="dim"):
        relative_l2(torch.ones(2, 2), torch.ones(2, 2), dim=2)
    with pytest.raises(InputError, match="empty"):
        relative_l2(torch.ones(0), torch.ones(0))


_vec = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=16)


@SETTINGS
@given(_vec, _vec, st.floats(1e-3, 1e3))
def test_symmetric_relative_l2_properties(xs, ys, scale):
    """Symmetric in its arguments, within [0, 2], invariant to a common scale."""
    n = min(len(xs), len(ys))
    x, y = t64(xs[:n]), t64(ys[:n])
    v = symmetric_relative_l2(x, y).item()
    assert v == symmetric_relative_l2(y, x).item()
    assert 0.0 <= v <= 2.0 + 1e-12
    assert symmetric_relative_l2(x * scale, y * scale).item() == pytest.approx(v, rel=1e-9, abs=1e-12)
    assert relative_l2(x, x).item() == 0.0


# --------------------------------------------------------------------------- routing


def test_routing_agreement_hand_example():
    """Same set in another order, one shared expert, identical, disjoint."""
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 9], [4, 5], [8, 9]])
    r = routing_agreement(a, b)
    assert (r.tokens, r.k) == (4, 2)
    assert r.set_match == 0.5 and r.disagreement == 0.5
    assert r.mean_overlap == (1 + 0.5 + 1 + 0) / 4
    assert r.mean_jaccard == pytest.approx((1 + 1 / 3 + 1 + 0) / 4, rel=1e-15)
    assert r.top1_agreement == 0.5
    assert json.loads(json.dumps(r.to_dict()))["disagreement"] == 0.5


@SETTINGS
@given(st.integers(1, 20), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_routing_properties(tokens, k, seed):
    """Self-agreement is 1; permuting slots keeps set metrics; the measure is symmetric."""
    g = torch.Generator().manual_seed(seed)
    a = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)])
    b = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)])
    same = routing_agreement(a, a)
    assert (same.set_match, same.mean_jaccard, same.mean_overlap, same.top1_agreement) == (1, 1, 1, 1)
    flipped = routing_agreement(a, a.flip(1))
    assert flipped.set_match == 1.0 and flipped.mean_jaccard == 1.0
    ab, ba = routing_agreement(a, b), routing_agreement(b, a)
    assert ab == ba
    assert 0.0 <= ab.mean_jaccard <= ab.mean_overlap <= 1.0
    assert ab.set_match <= ab.mean_jaccard


def test_routing_by_layer():
    """Lists are keyed by position, dicts by key; missing layers and bad layers are named."""
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[0, 1], [3, 4]])
    out = routing_agreement_by_layer([a, a], [a, b])
    assert list(out) == [0, 1]
    assert out[0].set_match == 1.0 and out[1].set_match == 0.5
    keyed = routing_agreement_by_layer({"l8": a, "l47": b}, {"l47": a, "l8": a})
    assert keyed["l47"].mean_overlap == 0.75
    with pytest.raises(InputError, match=r"only in layers_b \[3\]"):
        routing_agreement_by_layer({0: a}, {0: a, 3: a})
    with pytest.raises(InputError, match=r"layer 1: idx_b.*expert 3 twice for token 0"):
        routing_agreement_by_layer([a, a], [a, torch.tensor([[3, 3], [0, 1]])])


def test_routing_errors():
    """Dtype, shape, out-of-range and duplicate experts are typed errors naming the token."""
    a = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(DTypeError, match="float32"):
        routing_agreement(a.float(), a)
    with pytest.raises(ShapeError, match=r"\(2, 2\).*\(2, 3\)"):
        routing_agreement(a, torch.tensor([[0, 1, 2], [2, 3, 4]]))
    with pytest.raises(ShapeError, match=r"\[T, k\]"):
        routing_agreement(torch.tensor([0, 1]), torch.tensor([0, 1]))
    with pytest.raises(InputError, match=r"expert index 4 at \(token 1, slot 1\)"):
        routing_agreement(a, torch.tensor([[0, 1], [2, 4]]), num_experts=4)
    with pytest.raises(InputError, match=r"-1 at \(token 0, slot 0\)"):
        routing_agreement(torch.tensor([[-1, 1], [2, 3]]), a)
