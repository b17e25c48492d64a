"""Pins the numerics of guided E2M1 rounding (TRACE): identity with RNE on identical inputs,
bracket ends only, reproduction of in-bracket sampler codes, the outside rule and its tie,
the paper's worked example, and the argument checks."""

from fractions import Fraction

import pytest
import torch
from alignclient.errors import SpecError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libalign.guidance import RowGuide, guided_quantize
from libalign.spec import PRESETS, dequantize, normalized_with_scales, quantize
from libalign.spec.constants import E2M1_MAGNITUDES, E2M1_MIDPOINTS, E2M1_VALUES
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import (
    SIGNED_ZERO_POLICIES,
    bracket_levels,
    e2m1_code_values,
    e2m1_levels,
    e4m3_bits_to_float,
    low_bits,
    round_e2m1,
    round_e2m1_guided,
    round_e4m3_bits,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = (1, 2, 3, 4)
MINITE = PRESETS["minite"]

_LEVEL_VALUES = torch.tensor([-m for m in E2M1_MAGNITUDES[:0:-1]] + list(E2M1_MAGNITUDES),
                             dtype=torch.float64)  # index = level + 7


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _level_value(levels: torch.Tensor) -> torch.Tensor:
    return _LEVEL_VALUES[levels.long() + 7]


def _special_values() -> torch.Tensor:
    """Grid points, midpoints, one ulp either side of each midpoint, zeros, both signs."""
    mids = _f32(E2M1_MIDPOINTS)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 10.0))
    grid = _f32(E2M1_MAGNITUDES)
    grid_below = torch.nextafter(grid, torch.full_like(grid, -10.0))[1:]
    grid_above = torch.nextafter(grid, torch.full_like(grid, 10.0))[:-1]
    tiny = _f32([1e-30, 1e-7, 0.1, 2.0**-149])
    pos = torch.cat([grid, mids, below, above, grid_below, grid_above, tiny])
    return torch.cat([pos, -pos, _f32([0.0, -0.0, 6.0, -6.0])])


def _test_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    uniform = torch.rand(20_000, generator=g) * 12 - 6
    near_zero = (torch.rand(2_000, generator=g) - 0.5) * 1.2
    return torch.cat([_special_values(), uniform, near_zero])


def _dense_values() -> torch.Tensor:
    """Every 1/64 in [-6, 6] (midpoints and grid points included) plus the special values."""
    return torch.cat([torch.linspace(-6, 6, 769, dtype=torch.float32), _special_values()])


# --- identical inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("policy", SIGNED_ZERO_POLICIES)
def test_identical_inputs_reproduce_rne_bit_for_bit(policy, bits):
    """With the learner's z equal to the sampler's, guided rounding returns RNE exactly."""
    z = _test_values()
    rne = round_e2m1(z, policy)
    got = round_e2m1_guided(z, low_bits(rne, bits), bits, signed_zero=policy)
    assert got.dtype == torch.uint8
    assert torch.equal(got, rne)


@SETTINGS
@given(st.lists(st.floats(-6.0, 6.0, width=32), min_size=1, max_size=32),
       st.sampled_from(BITS), st.sampled_from(SIGNED_ZERO_POLICIES))
def test_identical_inputs_property(vals, bits, policy):
    """Same property over arbitrary fp32 values in [-6, 6]."""
    z = _f32(vals)
    rne = round_e2m1(z, policy)
    assert torch.equal(round_e2m1_guided(z, low_bits(rne, bits), bits, signed_zero=policy), rne)


# --- bracket ends only ----------------------------------------------------------------------------

@st.composite
def _values_and_guide(draw):
    bits = draw(st.sampled_from(BITS))
    n = draw(st.integers(1, 32))
    z = draw(st.lists(st.one_of(st.floats(-6.0, 6.0, width=32),
                                st.sampled_from(list(E2M1_VALUES) + list(E2M1_MIDPOINTS)
                                                + [-m for m in E2M1_MIDPOINTS])),
                      min_size=n, max_size=n))
    guide = draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n))
    policy = draw(st.sampled_from(SIGNED_ZERO_POLICIES))
    return _f32(z), torch.tensor(guide, dtype=torch.uint8), bits, policy


@SETTINGS
@given(_values_and_guide())
def test_chosen_code_is_a_bracket_end(case):
    """Whatever the guide bits, the chosen level is L- or L+ of z's bracket."""
    z, guide, bits, policy = case
    lv = e2m1_levels(round_e2m1_guided(z, guide, bits, signed_zero=policy))
    lower, upper = bracket_levels(z)
    assert bool(((lv == lower) | (lv == upper)).all())


@SETTINGS
@given(_values_and_guide())
def test_error_at_most_one_grid_step(case):
    """|value(guided) - z| <= width of z's bracket (0 when z is a grid point)."""
    z, guide, bits, policy = case
    got = e2m1_code_values(round_e2m1_guided(z, guide, bits, signed_zero=policy)).double()
    lower, upper = bracket_levels(z)
    width = _level_value(upper) - _level_value(lower)
    assert bool(((got - z.double()).abs() <= width).all())


@pytest.mark.parametrize("bits", BITS)
def test_every_guide_value_on_a_dense_grid_stays_in_the_bracket(bits):
    """Exhaustive over guide values 0..2^b-1 and a 1/64 grid of z: bracket end, error <= width."""
    z = _dense_values()
    lower, upper = bracket_levels(z)
    width = _level_value(upper) - _level_value(lower)
    for g in range(1 << bits):
        got = round_e2m1_guided(z, torch.full(z.shape, g, dtype=torch.uint8), bits)
        lv = e2m1_levels(got)
        assert bool(((lv == lower) | (lv == upper)).all()), g
        assert bool(((e2m1_code_values(got).double() - z.double()).abs() <= width).all()), g


def test_bracket_levels_literal():
    """Brackets of a few values: grid points are degenerate, negatives mirror."""
    lower, upper = bracket_levels(_f32([2.2, -2.2, 3.0, -0.0, 0.1, -0.1, 6.0, -5.5]))
    assert lower.tolist() == [4, -5, 5, 0, 0, -1, 7, -7]
    assert upper.tolist() == [5, -4, 5, 0, 1, 0, 7, -6]


# --- sampler codes in the bracket are reproduced ---------------------------------------------------

def _assert_in_bracket_reproduced(z, sampler, bits, policy):
    lower, upper = bracket_levels(z)
    s_lv = e2m1_levels(sampler)
    inside = (s_lv >= lower) & (s_lv <= upper)
    got = e2m1_levels(round_e2m1_guided(z, low_bits(sampler, bits), bits, signed_zero=policy))
    bad = inside & (got != s_lv)
    assert not bool(bad.any()), (z[bad][:5].tolist(), sampler[bad][:5].tolist(), got[bad][:5].tolist())
    return int(inside.sum())


@SETTINGS
@given(st.lists(st.tuples(st.floats(-6.0, 6.0, width=32), st.floats(-0.75, 0.75, width=32)),
                min_size=1, max_size=32),
       st.sampled_from(BITS), st.sampled_from(SIGNED_ZERO_POLICIES))
def test_sampler_code_in_bracket_is_reproduced(pairs, bits, policy):
    """The sampler's RNE code of a nearby z_s is chosen whenever its level is in z's bracket."""
    z = _f32([p[0] for p in pairs])
    z_s = (z + _f32([p[1] for p in pairs])).clamp(-6, 6)
    _assert_in_bracket_reproduced(z, round_e2m1(z_s, policy), bits, policy)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("policy", SIGNED_ZERO_POLICIES)
def test_sampler_code_in_bracket_is_reproduced_exhaustively(policy, bits):
    """Every sampler code 0x0..0xF (0x8, the negative zero, included) against a dense z grid."""
    z = _dense_values()
    hits = 0
    for c in range(16):
        hits += _assert_in_bracket_reproduced(z, torch.full(z.shape, c, dtype=torch.uint8), bits,
                                              policy)
    assert hits > 0


@pytest.mark.parametrize("policy,z,expect", [
    ("sign_of_input", 0.3, 0x0), ("sign_of_input", -0.3, 0x8), ("sign_of_input", -0.26, 0x8),
    ("sign_of_nonzero", 0.3, 0x0), ("sign_of_nonzero", -0.3, 0x8),
])
def test_negative_zero_sampler_code_is_level_zero_at_four_bits(policy, z, expect):
    """A sampler's 0x8 (-0.1 under a sign-aware policy) is level 0: a learner whose bracket
    holds 0 takes it (sign from its own z under the policy), not its RNE of +-0.5."""
    sampler = round_e2m1(_f32([-0.1]), policy)
    assert sampler.item() == 0x8
    got = round_e2m1_guided(_f32([z]), low_bits(sampler, 4), 4, signed_zero=policy)
    assert got.item() == expect


# --- rows without a record -------------------------------------------------------------------------

@SETTINGS
@given(_values_and_guide())
def test_absent_rows_round_to_nearest_even(case):
    """present=False gives round_e2m1 bit for bit, whatever the guide says."""
    z, guide, bits, policy = case
    absent = torch.zeros(z.shape, dtype=torch.bool)
    got = round_e2m1_guided(z, guide, bits, present=absent, signed_zero=policy)
    assert torch.equal(got, round_e2m1(z, policy))


@pytest.mark.parametrize("policy", SIGNED_ZERO_POLICIES)
def test_present_broadcasts_per_row(policy):
    """A [T, 1] mask: absent rows are RNE, present rows follow the guide."""
    z = _f32([[2.49, -2.49, 0.2, -0.2], [2.49, -2.49, 0.2, -0.2]])
    sampler = round_e2m1(_f32([[2.51, -2.51, 0.3, -0.3]] * 2), policy)
    present = torch.tensor([[True], [False]])
    got = round_e2m1_guided(z, low_bits(sampler, 1), 1, present=present, signed_zero=policy)
    assert torch.equal(got[0], sampler[0])
    assert torch.equal(got[1], round_e2m1(z[1], policy))


# --- the paper's worked example --------------------------------------------------------------------

def test_paper_example_normalized():
    """2.51 and 2.49 round to 3 and 2 (24 apart at block scale 24); guided 2.49 -> 3."""
    s = 24.0
    z = _f32([60.24, 59.76]) * _f32([1.0 / s])
    assert torch.allclose(z, _f32([2.51, 2.49]), atol=1e-5)
    rne = round_e2m1(z)
    assert rne.tolist() == [0x5, 0x4]
    assert (e2m1_code_values(rne) * s).tolist() == [72.0, 48.0]
    for bits in BITS:
        guided = round_e2m1_guided(z[1:], low_bits(rne[:1], bits), bits)
        assert guided.item() == 0x5, bits
        back = round_e2m1_guided(z[:1], low_bits(rne[1:], bits), bits)  # and the other way
        assert back.item() == 0x4, bits


def _paper_row(v: float) -> torch.Tensor:
    """A 2-block fp32 row: block 0 holds 2688 (row amax -> decode scale 1), block 1 has max 144
    (block scale 144/6 = 24) and ``v`` at index 20."""
    x = torch.zeros(1, 32, dtype=torch.float32)
    x[0, 0] = 2688.0
    x[0, 3] = -1000.0
    x[0, 16] = 144.0
    x[0, 17] = -100.0
    x[0, 20] = v
    return x


def test_paper_example_end_to_end_through_the_spec():
    """60.24 (sampler) and 59.76 (learner) under minite: same scales (24, outer 1), codes 3 and 2,
    48 vs 72 after de-scaling; the learner's guided quantization picks 3 (72) for every b."""
    xs, xl = _paper_row(60.24), _paper_row(59.76)
    qs, ql = quantize(xs, MINITE), quantize(xl, MINITE)
    byte24 = round_e4m3_bits(_f32([24.0])).item()
    assert e4m3_bits_to_float(torch.tensor([byte24], dtype=torch.uint8)).item() == 24.0
    for q in (qs, ql):
        assert q.block_scales.view(torch.uint8)[0, 1].item() == byte24
        assert q.outer_scale.tolist() == [1.0]
    bs, rs = qs.block_scales.view(torch.uint8), qs.outer_scale
    zs = normalized_with_scales(xs, bs, rs, MINITE).flatten(-2)
    zl = normalized_with_scales(xl, bs, rs, MINITE).flatten(-2)
    assert abs(zs[0, 20].item() - 2.51) < 1e-5 and abs(zl[0, 20].item() - 2.49) < 1e-5
    cs, cl = unpack_nibbles(qs.codes), unpack_nibbles(ql.codes)
    assert cs[0, 20].item() == 0x5 and cl[0, 20].item() == 0x4
    assert torch.equal(cs, round_e2m1(zs)) and torch.equal(cl, round_e2m1(zl))
    assert dequantize(qs)[0, 20].item() == 72.0 and dequantize(ql)[0, 20].item() == 48.0
    for bits in BITS:
        guide = RowGuide(bits, torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                         low_bits(cs, bits), bs, rs)
        g = guided_quantize(xl, MINITE, guide)
        assert unpack_nibbles(g.codes)[0, 20].item() == 0x5, bits
        assert dequantize(g)[0, 20].item() == 72.0
        assert g.bitwise_equal(qs), bits  # every other value agreed already


# --- the outside rule and its tie ------------------------------------------------------------------

def test_outside_rule_takes_the_end_towards_the_sampler():
    """b=4, sampler code 6.0 (0x7), learner z=2.2 in [2, 3]: the upper end 3.0 (0x5)."""
    g = low_bits(round_e2m1(_f32([6.0])), 4)
    assert round_e2m1_guided(_f32([2.2]), g, 4).item() == 0x5
    g = low_bits(round_e2m1(_f32([-6.0])), 4)  # and mirrored: -6 pulls -2.2 to -3
    assert round_e2m1_guided(_f32([-2.2]), g, 4).item() == 0xD
    g = low_bits(round_e2m1(_f32([0.5])), 4)  # sampler 0.5 below [2, 3] pulls 2.8 down to 2
    assert round_e2m1_guided(_f32([2.8]), g, 4).item() == 0x4


def test_outside_tie_falls_back_to_rne():
    """b=2, guide 2 (levels 2 -> 1.0 and 6 -> 4.0): 2.5 is equidistant (RNE -> 2.0), just above
    goes to 3.0, just below to 2.0."""
    mid = _f32([2.5])
    above = torch.nextafter(mid, _f32([10.0]))
    below = torch.nextafter(mid, _f32([0.0]))
    g = torch.tensor([2], dtype=torch.uint8)
    assert round_e2m1_guided(mid, g, 2).item() == 0x4
    assert round_e2m1_guided(above, g, 2).item() == 0x5
    assert round_e2m1_guided(below, g, 2).item() == 0x4
    assert round_e2m1_guided(_f32([2.75]), g, 2).item() == 0x5
    assert round_e2m1_guided(_f32([2.1]), g, 2).item() == 0x4


def test_no_matching_level_on_either_side_is_rne():
    """b=4 guide 0xF (-6) for z in [4, 6]: nothing above matches, below is nearer -> 4.0."""
    g = torch.tensor([0xF], dtype=torch.uint8)
    assert round_e2m1_guided(_f32([5.5]), g, 4).item() == 0x6


def _reference_level(z: Fraction, lower: int, upper: int, g: int, bits: int, rne: int) -> int:
    """The module doc's rule, in exact rational arithmetic over the 15 levels."""
    def lbits(lv):
        return ((-lv) | 8 if lv < 0 else lv) if bits == 4 else abs(lv) % (1 << bits)

    for end in (lower, upper):
        if lbits(end) == g:
            return end
    val = {lv: Fraction(_LEVEL_VALUES[lv + 7].item()) for lv in range(-7, 8)}
    ups = [val[lv] - z for lv in range(upper, 8) if lbits(lv) == g]
    downs = [z - val[lv] for lv in range(lower, -8, -1) if lbits(lv) == g]
    d_up, d_down = (min(d) if d else None for d in (ups, downs))
    if d_up is not None and (d_down is None or d_up < d_down):
        return upper
    if d_down is not None and (d_up is None or d_down < d_up):
        return lower
    return rne


def test_matches_an_exact_nearest_level_search():
    """The outside rule against a direct exact search over the 15 levels (b = 1..4, every guide
    value, dense z incl. values within 1e-30 of zero, where fp32 distances would tie)."""
    z = _dense_values()
    zs = [Fraction(v) for v in z.tolist()]
    lower, upper = (t.tolist() for t in bracket_levels(z))
    rne = e2m1_levels(round_e2m1(z)).tolist()
    for bits in BITS:
        for code in range(1 << bits):
            got = e2m1_levels(round_e2m1_guided(z, torch.full(z.shape, code, dtype=torch.uint8),
                                                bits)).tolist()
            g = 0 if bits == 4 and code == 0x8 else code  # 0x8 is level 0, like 0x0
            want = [_reference_level(zs[i], lower[i], upper[i], g, bits, rne[i])
                    for i in range(len(zs))]
            assert got == want, (bits, code)


# --- argument checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [0, 5, -1, 8])
def test_bad_bits_are_refused(bits):
    """Guidance keeps 1..4 bits: other counts raise SpecError (rounding and low_bits)."""
    z = _f32([1.0, 2.0])
    with pytest.raises(SpecError):
        round_e2m1_guided(z, torch.zeros(2, dtype=torch.uint8), bits)
    with pytest.raises(SpecError):
        low_bits(torch.zeros(2, dtype=torch.uint8), bits)


def test_guide_shape_mismatch_is_refused():
    """The guide must have z's shape exactly."""
    with pytest.raises(SpecError):
        round_e2m1_guided(_f32([1.0, 2.0]), torch.zeros(3, dtype=torch.uint8), 2)
    with pytest.raises(SpecError):
        round_e2m1_guided(torch.zeros(2, 4), torch.zeros(4, 2, dtype=torch.uint8), 2)
