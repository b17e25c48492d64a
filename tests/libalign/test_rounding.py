"""Pins the E2M1 and E4M3 rounding tables: every code, every tie, saturation."""

import ml_dtypes
import numpy as np
import pytest
import torch

from libalign.spec.constants import E2M1_VALUES
from libalign.spec.rounding import (
    canonical_zero,
    e2m1_code_values,
    e4m3_bits_to_float,
    round_e2m1,
    round_e2m1_stochastic,
    round_e4m3_bits,
    saturate_e4m3,
)


def test_e2m1_code_table_literal():
    """Codes 0x0..0xF decode to the published E2M1 values, 0x8 is -0.0."""
    vals = e2m1_code_values(torch.arange(16, dtype=torch.uint8))
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert list(E2M1_VALUES) == vals.tolist()
    assert torch.signbit(vals[8]) and not torch.signbit(vals[0])


@pytest.mark.parametrize("value,code", [
    (0.0, 0x0), (0.25, 0x0), (0.75, 0x2), (1.25, 0x2), (1.75, 0x4), (2.5, 0x4), (3.5, 0x6),
    (5.0, 0x6), (-0.25, 0x0), (-0.75, 0xA), (-1.25, 0xA), (-1.75, 0xC), (-2.5, 0xC),
    (-3.5, 0xE), (-5.0, 0xE),
])
def test_e2m1_every_tie_goes_to_even(value, code):
    """Each midpoint rounds to the neighbour whose mantissa bit is 0."""
    assert round_e2m1(torch.tensor([value])).item() == code


@pytest.mark.parametrize("mid,lo,hi", [(0.25, 0, 1), (0.75, 1, 2), (1.25, 2, 3), (1.75, 3, 4),
                                       (2.5, 4, 5), (3.5, 5, 6), (5.0, 6, 7)])
def test_e2m1_one_ulp_beside_each_tie(mid, lo, hi):
    """One fp32 ulp below a midpoint rounds down, one above rounds up."""
    m = torch.tensor([mid], dtype=torch.float32)
    below = torch.nextafter(m, torch.tensor([0.0]))
    above = torch.nextafter(m, torch.tensor([10.0]))
    assert round_e2m1(below).item() == lo
    assert round_e2m1(above).item() == hi


def test_e2m1_each_code_value_encodes_to_itself():
    """Exact grid values map to their own code under the sign-of-input policy."""
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(round_e2m1(e2m1_code_values(codes), "sign_of_input"), codes)


def test_e2m1_saturates_at_six():
    """Values at or beyond 6 (after the caller's clamp, also before) give 0x7 / 0xF."""
    z = torch.tensor([5.0001, 6.0, 7.0, 1e30, -6.0, -100.0])
    assert round_e2m1(z).tolist() == [7, 7, 7, 7, 15, 15]


@pytest.mark.parametrize("policy,expect", [
    ("positive", [0x0, 0x0, 0x0]),
    ("sign_of_input", [0x0, 0x8, 0x8]),
    ("sign_of_nonzero", [0x0, 0x0, 0x8]),
])
def test_signed_zero_policies(policy, expect):
    """+0.0, -0.0 and -0.1 (rounds to zero) under each signed-zero policy."""
    assert round_e2m1(torch.tensor([0.0, -0.0, -0.1]), policy).tolist() == expect


def test_canonical_zero_maps_only_negative_zero():
    """0x8 becomes 0x0; every other code is kept."""
    c = torch.arange(16, dtype=torch.uint8)
    out = canonical_zero(c)
    assert out[8] == 0 and torch.equal(out[torch.arange(16) != 8], c[torch.arange(16) != 8])


def _all_bf16_in(lo, hi):
    v = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[torch.isfinite(v) & (v >= lo) & (v <= hi) & ~torch.signbit(v)]


def test_e4m3_exhaustive_on_bf16_values_against_two_casts():
    """Every non-negative bf16 value in [0, 448] rounds like torch's and ml_dtypes' casts."""
    v = _all_bf16_in(0.0, 448.0)
    ours = round_e4m3_bits(v)
    torch_bits = v.to(torch.float8_e4m3fn).view(torch.uint8)
    ml_bits = torch.from_numpy(v.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert torch.equal(ours, torch_bits)
    assert torch.equal(ours, ml_bits)


def test_e4m3_midpoints_tie_to_even_byte():
    """Midway between two neighbouring E4M3 values goes to the even byte, subnormals too."""
    bits = torch.arange(0x7F, dtype=torch.uint8)
    vals = e4m3_bits_to_float(bits)
    mids = (vals[:-1] + vals[1:]) / 2
    even = torch.where(bits[:-1] % 2 == 0, bits[:-1], bits[1:])
    assert torch.equal(round_e4m3_bits(mids), even)


@pytest.mark.parametrize("value,byte", [
    (2.0**-10, 0x00), (3 * 2.0**-10, 0x02), (5 * 2.0**-10, 0x02), (2.0**-9, 0x01), (2.0**-6, 0x08),
    (1.0, 0x38), (0.125, 0x20), (448.0, 0x7E), (464.0, 0x7E), (1e9, 0x7E), (2.0**-40, 0x00),
])
def test_e4m3_literal_bytes_and_saturation(value, byte):
    """Literal bytes, subnormal ties, and saturation at 448 after the clamp."""
    t = saturate_e4m3(torch.tensor([value], dtype=torch.float32))
    assert round_e4m3_bits(t).item() == byte


def test_e4m3_decode_matches_torch_for_all_bytes():
    """The explicit 256-entry decode table equals torch's float8 -> float32 conversion."""
    b = torch.arange(256, dtype=torch.uint8)
    ours, ref = e4m3_bits_to_float(b), b.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    fin = ~torch.isnan(ref)
    assert torch.equal(ours[fin].view(torch.int32), ref[fin].view(torch.int32))


def test_stochastic_rounding_is_seeded_bracketed_and_unbiased():
    """Same seed -> same codes; codes are one of the two brackets; mean error ~ 0."""
    z = torch.full((200_000,), 2.7)
    a = round_e2m1_stochastic(z, torch.Generator().manual_seed(7))
    b = round_e2m1_stochastic(z, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) == {0x4, 0x5}  # 2.0 or 3.0
    mean = e2m1_code_values(a).mean().item()
    assert abs(mean - 2.7) < 0.01
    exact = torch.tensor([0.0, 0.5, -1.5, 6.0, -6.0])
    got = round_e2m1_stochastic(exact, torch.Generator().manual_seed(1), "sign_of_input")
    assert torch.equal(e2m1_code_values(got), exact)
