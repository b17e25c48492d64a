"""Pins libalign.metrics.intervals: the Student t quantile and the mean-over-seeds interval."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign.errors import InputError
from libalign.metrics import mean_interval, t_quantile, t_two_sided_probability


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99])
def test_closed_forms_for_one_and_two_degrees_of_freedom(level):
    """df 1 is Cauchy (t = tan(π·level/2)); df 2 has t = level·√(2 / (1 − level²))."""
    assert t_quantile(level, 1) == pytest.approx(math.tan(math.pi * level / 2), rel=1e-12)
    assert t_quantile(level, 2) == pytest.approx(level * math.sqrt(2 / (1 - level**2)), rel=1e-12)


def test_quantiles_equal_scipy():
    """Two-sided quantiles equal scipy.stats.t.ppf((1 + level) / 2) for df 1..80."""
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 81):
        for level in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999):
            assert t_quantile(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df),
                                                         rel=1e-11), (df, level)
            t = 0.37 * df**0.5
            assert t_two_sided_probability(t, df) == pytest.approx(
                1 - 2 * stats.t.sf(t, df), rel=1e-12, abs=1e-15), (df, t)


def test_textbook_values():
    """95 %: 12.706 (df 1), 4.303 (df 2), 2.776 (df 4), tending to 1.960."""
    assert round(t_quantile(0.95, 1), 3) == 12.706
    assert round(t_quantile(0.95, 2), 3) == 4.303
    assert round(t_quantile(0.95, 4), 3) == 2.776
    assert abs(t_quantile(0.95, 10_000) - 1.95996) < 1e-3


def test_mean_interval_of_three_values():
    """[1, 2, 3]: mean 2, s 1, half-width 4.3027·1/√3."""
    ci = mean_interval([1.0, 2.0, 3.0])
    half = t_quantile(0.95, 2) / math.sqrt(3)
    assert (ci.estimate, ci.std, ci.n, ci.level) == (2.0, 1.0, 3, 0.95)
    assert ci.low == pytest.approx(2 - half, rel=1e-15) and ci.high == pytest.approx(2 + half,
                                                                                     rel=1e-15)
    assert ci.to_dict()["high"] == ci.high


def test_one_value_has_no_interval():
    """One seed: the mean, no bounds, no standard deviation."""
    ci = mean_interval([0.25])
    assert (ci.estimate, ci.low, ci.high, ci.std, ci.n) == (0.25, None, None, None, 1)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_refuses_empty_and_non_finite(bad):
    """Empty or non-finite values: InputError."""
    with pytest.raises(InputError):
        mean_interval(bad)


@pytest.mark.parametrize("level,df", [(0.0, 3), (1.0, 3), (0.95, 0), (0.95, 2.5), (0.95, True)])
def test_refuses_bad_level_and_df(level, df):
    """level outside (0, 1) and df that is not a positive int: InputError."""
    with pytest.raises(InputError):
        t_quantile(level, df)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=12),
       st.floats(0.5, 0.999))
def test_interval_brackets_the_mean_and_widens_with_level(values, level):
    """low ≤ mean ≤ high, symmetric; a higher level never gives a narrower interval."""
    ci = mean_interval(values, level)
    assert ci.low <= ci.estimate <= ci.high
    assert (ci.high - ci.estimate) == pytest.approx(ci.estimate - ci.low, rel=1e-9, abs=1e-6)
    wider = mean_interval(values, min(0.9999, level + 0.0005))
    assert wider.high - wider.low >= ci.high - ci.low - 1e-9 * (1 + abs(ci.high))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 400), st.floats(0.01, 0.999))
def test_probability_inverts_quantile(df, level):
    """P(|T| ≤ t_quantile(level, df)) = level."""
    assert t_two_sided_probability(t_quantile(level, df), df) == pytest.approx(level, abs=1e-12)
