"""Properties of the spec that must hold for every input (hypothesis)."""

import numpy as np
import torch
from alignclient.errors import UndefinedScaleError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from libalign.spec import PRESETS, dequantize, encode_with_scales, quantize, roundtrip_codes
from libalign.spec.constants import E2M1_MAGNITUDES
from libalign.spec.packing import pack_nibbles, unpack_nibbles
from libalign.spec.rounding import e2m1_code_values, e4m3_bits_to_float, round_e2m1, round_e4m3_bits

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_grid = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 5.0, 6.0])
_tie_values = st.builds(lambda g, e, s: s * g * 2.0**e, _grid, st.integers(-30, 30),
                        st.sampled_from([1.0, -1.0]))
_plain = st.floats(-1e6, 1e6, allow_nan=False, width=32)
_tiny = st.floats(-2.0**-20, 2.0**-20, allow_nan=False, width=32)
_element = st.one_of(_plain, _tie_values, _tiny, st.just(0.0), st.just(-0.0))


@st.composite
def matrices(draw, k_multiple=True):
    m = draw(st.integers(1, 6))
    k = draw(st.sampled_from([16, 32, 48, 64])) if k_multiple else draw(st.integers(1, 70))
    arr = draw(arrays(np.float32, (m, k), elements=_element))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return torch.from_numpy(arr).to(dtype)


def _quantize(x, preset):
    """quantize, treating the torchao/modelopt refusal of an all-zero tensor as expected."""
    try:
        return quantize(x, PRESETS[preset])
    except UndefinedScaleError:
        assert preset in ("torchao", "modelopt") and not bool(x.any())
        assume(False)


def _reencoded_matches(q):
    """Re-encode dequantize(q) with q's scales; compare with spec.roundtrip_codes(q)."""
    again = encode_with_scales(dequantize(q, torch.float32), q)
    return torch.equal(again, roundtrip_codes(q))


def _half_spacing(a: np.ndarray) -> np.ndarray:
    return np.where(a <= 2.0, 0.25, np.where(a <= 4.0, 0.5, 1.0))


@SETTINGS
@given(matrices(), st.sampled_from(["minite", "te", "te_row", "torchao", "modelopt",
                                    "compressed_tensors"]))
def test_error_within_half_a_grid_step_of_its_block(x, preset):
    """|x / (s * dec) - e2m1(code)| <= half the local E2M1 spacing (saturating beyond 6)."""
    q = _quantize(x, preset)
    s = e4m3_bits_to_float(q.block_scales).double().numpy()
    dec = q.outer_dec.double().numpy()
    if q.spec.outer_domain == "row":
        dec = dec[..., None]
    scale = np.repeat(s * dec, 16, axis=-1)[..., : x.shape[-1]]
    vals = e2m1_code_values(unpack_nibbles(q.codes)).double().numpy()[..., : x.shape[-1]]
    xv = x.double().numpy()
    nz = scale > 0
    z = np.where(nz, xv / np.where(nz, scale, 1.0), 0.0)
    a = np.abs(z)
    inside = a <= 6.0
    err = np.abs(z - vals)
    bound = _half_spacing(a) * (1 + 1e-5) + 1e-6
    assert np.all(err[nz & inside] <= bound[nz & inside])
    assert np.all(np.abs(vals[nz & ~inside]) == 6.0)
    assert np.all(np.sign(vals[nz & ~inside]) == np.sign(z[nz & ~inside]))
    # a zero-scale block decodes to zero whatever its codes
    assert np.all(dequantize(q, torch.float32).numpy()[~nz] == 0)


@SETTINGS
@given(matrices(k_multiple=False), st.sampled_from(["minite", "te", "te_row", "modelopt"]))
def test_reencoding_dequantized_values_reproduces_codes(x, preset):
    """encode_with_scales(dequantize(q), q) reproduces q's codes (see _reencoded_matches),
    wherever a block's decode scale (block scale times outer decode scale) is a normal fp32
    number: below 2^-126 the decoded values lose bits, which no re-encoding can recover
    (pinned by :func:`test_a_block_whose_decode_scale_is_subnormal_loses_bits`)."""
    q = _quantize(x, preset)
    assume(not _subnormal_decode(q))
    assert _reencoded_matches(q)


def _subnormal_decode(q) -> bool:
    """True when some block's fp32 decode scale is nonzero and below 2^-126."""
    s = e4m3_bits_to_float(q.block_scales).double()
    dec = q.outer_dec.double()
    if q.spec.outer_domain == "row":
        dec = dec[..., None]
    scale = s * dec
    return bool(((scale > 0) & (scale < 2.0**-126)).any())


def test_a_block_whose_decode_scale_is_subnormal_loses_bits():
    """x = 2^-126 under ``te`` (no amax floor): the outer decode scale 2^-126/2688 is subnormal,
    the code is 6 (4.0) with block-scale byte 51, and the decoded value re-encodes as code 5:
    decode is an fp32 product, exact only above the normal range."""
    x = torch.tensor([[2.0**-126]], dtype=torch.float32)
    q = quantize(x, PRESETS["te"])
    assert _subnormal_decode(q)
    assert unpack_nibbles(q.codes)[0, 0] == 6 and int(q.block_scales.view(torch.uint8)[0, 0]) == 51
    again = encode_with_scales(dequantize(q, torch.float32), q)
    assert unpack_nibbles(again)[0, 0] == 5 and not _reencoded_matches(q)


@SETTINGS
@given(matrices(), st.sampled_from(["torchao", "compressed_tensors"]))
def test_reencoding_for_presets_that_refuse_padding(x, preset):
    """Same property for the presets whose K must be a multiple of 16."""
    assert _reencoded_matches(_quantize(x, preset))


@SETTINGS
@given(matrices(k_multiple=False), st.sampled_from(["minite", "te_row"]))
def test_row_bits_never_depend_on_other_rows(x, preset):
    """Under row scaling, quantizing a row alone gives the same bits as in the matrix."""
    q = quantize(x, PRESETS[preset])
    for i in range(x.shape[0]):
        alone = quantize(x[i : i + 1], PRESETS[preset])
        assert torch.equal(alone.codes[0], q.codes[i])
        assert torch.equal(alone.block_scales[0].view(torch.uint8), q.block_scales[i].view(torch.uint8))
        assert torch.equal(alone.outer_scale[0].view(torch.int32), q.outer_scale[i].view(torch.int32))


@SETTINGS
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 20).map(lambda n: 2 * n)),
              elements=st.integers(0, 15)))
def test_pack_unpack_roundtrip(codes):
    """Any codes survive packing; the low nibble holds the even element."""
    c = torch.from_numpy(codes)
    p = pack_nibbles(c)
    assert torch.equal(unpack_nibbles(p), c)
    assert torch.equal(p & 0xF, c[:, 0::2])


_E4M3_VALUES = e4m3_bits_to_float(torch.arange(0x7F, dtype=torch.uint8)).double().numpy()


@settings(max_examples=400, deadline=None)
@given(st.floats(0.0, 448.0, width=32))
def test_e4m3_is_nearest_with_ties_to_even(v):
    """The explicit E4M3 rounding picks the nearest value, the even byte on a tie."""
    got = int(round_e4m3_bits(torch.tensor([v], dtype=torch.float32)).item())
    d = np.abs(_E4M3_VALUES - v)
    best = np.flatnonzero(d == d.min())
    want = best[0] if len(best) == 1 else next(b for b in best if b % 2 == 0)
    assert got == want


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.floats(-6.0, 6.0, width=32), _tie_values.filter(lambda v: abs(v) <= 6)))
def test_e2m1_is_nearest_with_ties_to_even(v):
    """The comparison-count E2M1 rounding equals a nearest-value search."""
    got = int(round_e2m1(torch.tensor([v], dtype=torch.float32), "sign_of_input").item())
    mags = np.array(E2M1_MAGNITUDES)
    d = np.abs(mags - abs(v))
    best = np.flatnonzero(d == d.min())
    mag = best[0] if len(best) == 1 else next(b for b in best if b % 2 == 0)
    assert got & 7 == mag
    assert (got >> 3) == int(np.signbit(np.float32(v)))
