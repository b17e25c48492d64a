"""MXFP4 presets: bit for bit against torchao's ``to_mx`` and TransformerEngine's E8M0 rule.

torchao (``torchao.prototype.mx_formats.mx_tensor.to_mx`` / ``to_dtype``) is called as its
own flow calls it, on CPU, for each scale mode a preset implements: packed codes and
scale bytes must be equal (atol 0), and so must the dequantized values. TE's formulas are
a second oracle written here in NumPy (see :func:`te_oracle`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.utils import to_blocked

from libalign import sync
from libalign.errors import NonFiniteError, ShapeError, SpecError
from libalign.kernels import ops
from libalign.spec import PRESETS, dequantize, encode_with_scales, quantize, roundtrip_codes
from libalign.spec.packing import swizzle_scales
from libalign.spec.presets import MX_PRESETS, NumericsSpec

from .inputs import FAMILIES, gen
from .te_oracle import e2m1_nearest

MODES = {
    "mxfp4": ScaleCalculationMode.FLOOR,
    "mxfp4_ceil": ScaleCalculationMode.CEIL,
    "mxfp4_even": ScaleCalculationMode.EVEN,
    "mxfp4_te": ScaleCalculationMode.RCEIL,
}
FP4 = torch.float4_e2m1fn_x2


def torchao_mx(x: torch.Tensor, preset: str):
    scale, data = to_mx(x.contiguous(), FP4, 32, MODES[preset])
    return data.view(torch.uint8), scale.view(torch.uint8)


def log2_rounded_blocks(x: torch.Tensor) -> torch.Tensor:
    """Blocks whose descale ``d = amax / 6`` lies above 2^k but whose fp32 ``log2`` rounds down
    to the integer k (>= -127, the smallest byte): where torchao's eager RCEIL stores one
    byte less than TE's round-up."""
    amax = x.float().reshape(*x.shape[:-1], -1, 32).abs().amax(-1)
    d = amax / 6.0
    lg = torch.log2(d)
    return (lg == torch.ceil(lg)) & (lg >= -127) & (d.double() > torch.exp2(lg.double()))


def assert_same_bits(x: torch.Tensor, preset: str) -> None:
    """Codes and scale bytes equal torchao's; for mxfp4_te on fp32 input, equal but for
    the blocks of :func:`log2_rounded_blocks` (whose byte is then torchao's + 1)."""
    q = quantize(x, PRESETS[preset])
    codes, scales = torchao_mx(x, preset)
    assert q.block_scales.dtype == torch.float8_e8m0fnu and q.outer_scale is None
    ours = q.block_scales.view(torch.uint8)
    if preset == "mxfp4_te" and x.dtype == torch.float32:
        rounded = log2_rounded_blocks(x)
        assert torch.equal(ours, scales + rounded.to(torch.uint8)), preset
        keep = (~rounded).repeat_interleave(16, dim=-1)
        assert torch.equal(q.codes[keep], codes[keep]), preset
        return
    assert torch.equal(ours, scales), preset
    assert torch.equal(q.codes, codes), preset


def e8m0_edges(shape, dtype=torch.float32, seed=7):
    """Blocks whose maximum sits on or one ulp beside the points where a scale mode turns:
    2^k, 1.75 * 2^k (EVEN), 6 * 2^k (the descale of RCEIL/TE), plus subnormal and huge
    maxima; the other elements sit on E2M1 midpoints of that scale and at random."""
    g = gen(seed)
    nb = shape[-1] // 32
    k = torch.randint(-140, 126, (*shape[:-1], nb, 1), generator=g).to(torch.float64)
    base = torch.tensor([1.0, 1.75, 6.0, 1.5, 3.0])[
        torch.randint(0, 5, k.shape, generator=g)].to(torch.float64)
    peak = (base * torch.exp2(k)).clamp(max=3.0e38).to(torch.float32)
    step = torch.randint(-1, 2, k.shape, generator=g).to(torch.int32)
    peak = (peak.view(torch.int32) + step).view(torch.float32).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 1.0])
    rel = mids[torch.randint(0, len(mids), (*shape[:-1], nb, 32), generator=g)]
    rel = torch.where(torch.rand(rel.shape, generator=g) < 0.5, rel / 6,
                      torch.rand(rel.shape, generator=g) * 2 - 1)
    x = rel * peak
    x[..., 0] = peak[..., 0] * torch.where(torch.rand(k.shape[:-1], generator=g) < 0.5, -1, 1)
    return x.reshape(shape).to(dtype)


ALL_FAMILIES = {**FAMILIES, "e8m0_edges": e8m0_edges}


@pytest.mark.parametrize("preset", MX_PRESETS)
@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 256), (3, 8, 96)])
def test_codes_and_scales_equal_torchao(preset, family, dtype, shape):
    x = ALL_FAMILIES[family](shape, dtype=dtype)
    assert_same_bits(x, preset)


@pytest.mark.parametrize("preset", MX_PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_torchao(preset, dtype):
    x = torch.cat([e8m0_edges((16, 128), dtype), FAMILIES["zeros"]((16, 128), dtype)])
    q = quantize(x, PRESETS[preset])
    # torchao's dequantization of our bits (equal to its own bits but where the RCEIL test
    # below says), so the two decoders are compared on the same input
    want = to_dtype(q.codes, q.block_scales, FP4, 32, dtype)
    got = dequantize(q, dtype)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("preset", MX_PRESETS)
def test_every_bf16_block_maximum_gives_torchaos_scale(preset):
    """All 32639 positive finite bf16 values as a block maximum: the scale byte (and so the
    codes of the block) equal torchao's in every mode, RCEIL included."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(amax.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    x[:, 2] = amax * 0.29
    assert_same_bits(x, preset)


def te_e8m0(d: np.ndarray) -> np.ndarray:
    """TE's ``float_to_e8m0`` (transformer_engine/common/utils.cuh, the path without
    ``cvt.rp.satfinite.ue8m0x2.f32``): the biased exponent of the fp32 value, plus one when a
    mantissa bit is set (round toward +inf), where a subnormal at most 2^-127 keeps 0, 0xFE
    saturates, 0 -> 0x00, Inf -> 0xFE, NaN -> 0xFF."""
    u = d.astype(np.float32).view(np.uint32)
    exp = ((u >> 23) & 0xFF).astype(np.int64)
    man = (u & 0x7FFFFF).astype(np.int64)
    up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    out = exp + up
    out = np.where(d == 0, 0, out)
    out = np.where(np.isinf(d), 0xFE, out)
    return np.where(np.isnan(d), 0xFF, out).astype(np.uint8)


def te_oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TE's MX block rule with FP4 limits, in NumPy float32.

    From TransformerEngine's MXFP8 cast kernels and ``utils.cuh``: per 32-element block
    ``b = float_to_e8m0(amax * Quantized_Limits::max_norm_rcp)`` (``max_norm_rcp`` is the fp32
    ``1 / max_norm``, here ``max_norm = 6`` for E2M1), and each element is cast from
    ``x * exp2f_rcp(b)`` where ``exp2f_rcp(b) = b == 0 ? 1 : 2^(127 - b)``. The E2M1 cast is
    round-to-nearest-even with saturation (``cvt.rn.satfinite.e2m1x2.f32``), the sign bit
    taken from the value (so -0.0 -> 0x8). Returns (packed codes, scale bytes).
    """
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    scales = te_e8m0(amax * np.float32(1.0 / 6.0))
    rcp = np.where(scales == 0, 1.0, np.exp2(127.0 - scales.astype(np.float64))).astype(np.float32)
    z = np.clip(blocks * rcp[..., None], np.float32(-6), np.float32(6)).reshape(m, k)
    codes = e2m1_nearest(z, neg_zero_code=True) | (np.signbit(z).astype(np.uint8) << 3)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_te_equals_te_formulas(family, dtype):
    x = ALL_FAMILIES[family]((32, 256), dtype=dtype)
    q = quantize(x, PRESETS["mxfp4_te"])
    codes, scales = te_oracle(x.float().numpy())
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    assert np.array_equal(q.codes.numpy(), codes)


def test_torchao_rceil_eager_diverges_from_te_only_where_its_fp32_log2_rounds():
    """torchao's eager RCEIL takes ceil(log2(amax / 6)) in fp32: just above 6 * 2^k the
    logarithm rounds to the integer k and the byte comes out one less than TE's (and the
    hardware's) round-up. mxfp4_te follows TE; this pins that the two differ there only."""
    k = torch.arange(-120, 120, dtype=torch.float64)
    base = (6.0 * torch.exp2(k)).to(torch.float32).view(torch.int32)
    amax = torch.cat([(base + j).view(torch.float32) for j in range(-3, 8)])
    x = torch.zeros(amax.numel(), 32)
    x[:, 0] = amax
    q = quantize(x, PRESETS["mxfp4_te"])
    ours = q.block_scales.view(torch.uint8).to(torch.int32).reshape(-1)
    _, te_scales = te_oracle(x.numpy())
    assert np.array_equal(ours.numpy().astype(np.uint8), te_scales.reshape(-1))
    _, theirs = torchao_mx(x, "mxfp4_te")
    theirs = theirs.to(torch.int32).reshape(-1)
    differ = ours != theirs
    assert bool(differ.any())
    assert torch.equal(differ, log2_rounded_blocks(x).reshape(-1))
    assert torch.equal(theirs[differ] + 1, ours[differ])


_element = st.one_of(
    st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32),
    st.floats(-2.0**-120, 2.0**-120, allow_nan=False, width=32),
    st.builds(lambda g, e, s: s * g * 2.0**e,
              st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0]),
              st.integers(-130, 120), st.sampled_from([1.0, -1.0])),
    st.just(0.0), st.just(-0.0),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=st.integers(1, 4).flatmap(
    lambda m: st.sampled_from([32, 64, 96]).flatmap(
        lambda k: arrays(np.float32, (m, k), elements=_element))),
    bf16=st.booleans())
def test_property_every_mode_equals_torchao(arr, bf16):
    x = torch.from_numpy(arr)
    x = x.to(torch.bfloat16) if bf16 else x
    for preset in MX_PRESETS:
        assert_same_bits(x, preset)
    q = quantize(x, PRESETS["mxfp4_te"])
    codes, scales = te_oracle(x.float().numpy())
    assert np.array_equal(q.codes.numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)


@pytest.mark.parametrize("preset", MX_PRESETS)
def test_reencoding_the_dequantized_values_gives_roundtrip_codes(preset):
    x = torch.cat([e8m0_edges((32, 128)), FAMILIES["ties"]((32, 128), torch.float32)])
    q = quantize(x, PRESETS[preset])
    assert bool((q.block_scales.view(torch.uint8) == 0).any())  # the 2^-127 scale is covered
    assert torch.equal(encode_with_scales(dequantize(q), q), roundtrip_codes(q))


@pytest.mark.parametrize("preset", MX_PRESETS)
@pytest.mark.parametrize("k", [16, 48, 33, 100])
def test_k_not_a_multiple_of_32_is_a_shape_error_naming_32(preset, k):
    with pytest.raises(ShapeError, match=r"not a multiple of 32"):
        quantize(torch.randn(4, k), PRESETS[preset])
    with pytest.raises(ShapeError, match=r"not a multiple of 32"):
        ops.quantize(torch.randn(4, k), PRESETS[preset])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused(bad):
    x = torch.randn(4, 64)
    x[2, 40] = bad
    with pytest.raises(NonFiniteError):
        quantize(x, PRESETS["mxfp4"])


def test_ops_serves_mxfp4_with_the_kernel_and_torchaos_swizzle():
    """libalign.kernels serves MXFP4 with the compiled CPU kernel; its bits, and its in-place
    swizzled scales, equal torchao's (tests/libalign/test_ops_mxfp4.py pins every path)."""
    x = FAMILIES["mixed"]((200, 256), torch.bfloat16)
    spec = PRESETS["mxfp4"]
    assert ops.backend_for(x, spec) == "cpu"
    assert ops.kernel_gap(x, spec, None) is None
    q = ops.quantize(x, spec, backend="kernel")
    codes, scales = torchao_mx(x, "mxfp4")
    assert torch.equal(q.codes, codes) and torch.equal(q.block_scales.view(torch.uint8), scales)
    assert q.bitwise_equal(quantize(x, spec))
    swz = ops.quantize(x, spec, scale_layout="swizzled")
    theirs = to_blocked(torchao_mx(x, "mxfp4")[1]).flatten()
    assert torch.equal(swz.block_scales.view(torch.uint8), theirs)
    assert torch.equal(swizzle_scales(q.block_scales).view(torch.uint8), theirs)
    many = ops.quantize_many([x, x[:64]], spec)
    assert many[1].bitwise_equal(quantize(x[:64], spec))
    assert swz.linear().bitwise_equal(q)


def test_weight_sync_writes_mxfp4_into_its_destinations():
    spec = PRESETS["mxfp4_te"]
    xs = [FAMILIES["ties"]((2, 64, 128), torch.bfloat16), FAMILIES["randn"]((96, 64))]
    dests = [sync.empty_destination(x, spec) for x in xs]
    assert dests[0].block_scales.dtype == torch.float8_e8m0fnu
    assert tuple(dests[0].block_scales.shape) == (2, 64, 4) and dests[0].outer_scale is None
    sync.quantize_into(xs, dests, spec)
    for x, d in zip(xs, dests, strict=True):
        assert d.bitwise_equal(quantize(x, spec))


def test_mx_spec_validation_and_wire_form():
    spec = PRESETS["mxfp4"]
    assert spec.is_mx and spec.scale_format == "e8m0" and spec.block_size == 32
    assert PRESETS["te"].scale_format == "e4m3" and not PRESETS["te"].is_mx
    assert NumericsSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="32"):
        spec.replace(block_size=16)
    with pytest.raises(SpecError, match="outer"):
        spec.replace(outer_domain="row")
    with pytest.raises(SpecError, match="hadamard"):
        spec.replace(hadamard=True)
    with pytest.raises(SpecError, match="16"):
        PRESETS["te"].replace(block_size=32)
