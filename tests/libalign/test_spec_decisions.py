"""Each special case of the spec is a written decision; these tests pin them per preset."""

import pytest
import torch
from alignclient.errors import NonFiniteError, ShapeError, SpecError, UndefinedScaleError

from libalign.spec import PRESETS, NumericsSpec, dequantize, quantize
from libalign.spec.hadamard import rht16, rht16_inverse
from libalign.spec.packing import unpack_nibbles


def _codes(q):
    return unpack_nibbles(q.codes)


def _scale_bytes(q):
    return q.block_scales.view(torch.uint8)


def _row(*vals, k=32):
    x = torch.zeros(1, k)
    x[0, : len(vals)] = torch.tensor(vals)
    return x


@pytest.mark.parametrize("preset,neg_zero,tiny_neg", [
    ("minite", 0x0, 0x0), ("te", 0x0, 0x8), ("te_row", 0x0, 0x8), ("torchao", 0x8, 0x8),
    ("modelopt", 0x0, 0x8), ("compressed_tensors", 0x0, 0x8),
])
def test_negative_zero_and_tiny_negatives(preset, neg_zero, tiny_neg):
    """-0.0 and a negative that rounds to zero: which code each preset stores."""
    x = _row(6.0, -0.0, -0.01)
    c = _codes(quantize(x, PRESETS[preset]))[0]
    assert c[0].item() == 0x7
    assert (c[1].item(), c[2].item()) == (neg_zero, tiny_neg)


@pytest.mark.parametrize("preset,byte", [
    ("minite", 0x00), ("te", 0x00), ("te_row", 0x00), ("torchao", 0x08), ("modelopt", 0x38),
    ("compressed_tensors", 0x20),
])
def test_all_zero_block_scale_byte(preset, byte):
    """An all-zero block next to a non-zero one stores the preset's zero-block byte."""
    x = _row(1.0, 2.0, 3.0)  # block 0 non-zero, block 1 all zero
    q = quantize(x, PRESETS[preset])
    assert _scale_bytes(q)[0, 1].item() == byte
    assert (_codes(q)[0, 16:] == 0).all()
    assert (dequantize(q)[0, 16:] == 0).all()


def _underflow_input():
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0  # block 0 sets the outer scale
    x[0, 16], x[0, 17], x[0, 18] = 1e-6, -1e-6, 0.0  # block 1's scale underflows to 0
    return x


def test_underflow_block_minite_zero_codes():
    """minite: a block whose E4M3 scale is zero gets a zero multiplier: codes and values 0."""
    q = quantize(_underflow_input(), PRESETS["minite"])
    assert _scale_bytes(q)[0, 1].item() == 0
    assert (_codes(q)[0, 16:] == 0).all()
    assert (dequantize(q)[0, 16:] == 0).all()


def test_underflow_block_te_saturates():
    """te: multiplier FLT_MAX, so non-zero elements saturate to +-6 with scale 0."""
    q = quantize(_underflow_input(), PRESETS["te"])
    c = _codes(q)[0]
    assert _scale_bytes(q)[0, 1].item() == 0
    assert (c[16].item(), c[17].item(), c[18].item()) == (0x7, 0xF, 0x0)
    assert (dequantize(q)[0, 16:] == 0).all()  # scale 0 decodes to zero anyway


@pytest.mark.parametrize("preset,byte", [("torchao", 0x08), ("modelopt", 0x01),
                                         ("compressed_tensors", 0x20)])
def test_underflow_block_floors(preset, byte):
    """Presets with a scale floor or zero substitution never store a zero scale there."""
    q = quantize(_underflow_input(), PRESETS[preset])
    assert _scale_bytes(q)[0, 1].item() == byte


def test_zero_row_minite_floor():
    """An all-zero row: amax floored to 1e-12, codes and scales zero, dequantizes to zero."""
    x = torch.randn(4, 64)
    x[2] = 0
    q = quantize(x, PRESETS["minite"])
    assert q.outer_amax[2].item() == torch.tensor(1e-12, dtype=torch.float32).item()
    assert (q.codes[2] == 0).all() and (_scale_bytes(q)[2] == 0).all()
    assert (dequantize(q)[2] == 0).all()
    assert torch.isfinite(q.outer_scale).all()


def test_all_zero_tensor():
    """te, minite, CT handle an all-zero tensor; torchao/ModelOpt's 0/0 is refused."""
    x = torch.zeros(3, 32)
    for name in ("minite", "te", "te_row", "compressed_tensors"):
        assert (dequantize(quantize(x, PRESETS[name])) == 0).all()
    assert quantize(x, PRESETS["te"]).outer_enc.item() == 3.4028234663852886e38
    for name in ("torchao", "modelopt"):
        with pytest.raises(UndefinedScaleError, match="NaN block scale"):
            quantize(x, PRESETS[name])


def test_peers_really_emit_nan_scales_on_zero_tensor():
    """The quirk behind the refusal above, pinned against the installed libraries."""
    from tests.libalign import peers

    x = torch.zeros(2, 32)
    for peer in (peers.torchao, peers.modelopt):
        _, scale_bytes, _ = peer(x)
        assert ((scale_bytes & 0x7F) == 0x7F).all()


def test_k_not_multiple_of_16_pads_or_refuses():
    """minite/te/modelopt zero-pad K; torchao and compressed-tensors refuse."""
    x = torch.randn(3, 40)
    q = quantize(x, PRESETS["minite"])
    assert q.codes.shape == (3, 24) and q.block_scales.shape == (3, 3) and q.shape == (3, 40)
    assert (_codes(q)[:, 40:] == 0).all()
    assert dequantize(q).shape == (3, 40)
    padded = quantize(torch.nn.functional.pad(x, (0, 8)), PRESETS["minite"])
    assert torch.equal(padded.codes, q.codes)
    for name in ("torchao", "compressed_tensors"):
        with pytest.raises(ShapeError, match="not a multiple of 16"):
            quantize(x, PRESETS[name])
    with pytest.raises(ShapeError):
        quantize(x, PRESETS["minite"].replace(k_remainder="refuse"))


def test_nonfinite_raise_names_count_and_positions():
    """NaN/Inf: a NonFiniteError with counts and the first indices."""
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 0] = float("-inf")
    with pytest.raises(NonFiniteError) as err:
        quantize(x)
    e = err.value
    assert (e.count, e.nan, e.inf) == (3, 1, 2)
    assert e.first_indices == [(1, 3), (2, 5), (3, 0)]
    assert "3 non-finite" in str(e) and "(1, 3)" in str(e)


def test_nonfinite_saturate_policy():
    """saturate: NaN -> 0 and +-Inf -> the dtype's largest finite value, then quantize."""
    spec = PRESETS["minite"].replace(nonfinite="saturate")
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    x[0, 0] = float("nan")
    x[1, 0] = float("inf")
    q = quantize(x, spec)
    d = dequantize(q)
    assert d[0, 0] == 0 and d[1, 0] > 1e38 and torch.isfinite(d).all()


def test_outer_conventions_stored():
    """te stores amax, minite/torchao/modelopt the decode scale, CT the encode scale."""
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    amax = x.float().abs().max()
    assert quantize(x, PRESETS["te"]).outer_scale.item() == amax.item()
    te = quantize(x, PRESETS["te"])
    assert te.outer_enc.item() == torch.div(torch.tensor(2688.0), amax).item()
    assert te.outer_dec.item() == torch.div(torch.tensor(1.0), te.outer_enc).item()
    mo = quantize(x, PRESETS["modelopt"])
    assert mo.outer_scale.item() == torch.div(amax, torch.tensor(2688.0)).item()
    ct = quantize(x, PRESETS["compressed_tensors"])
    assert ct.spec.outer_convention == "enc" and ct.outer_scale.item() == ct.outer_enc.item()
    mi = quantize(x, PRESETS["minite"])
    assert mi.outer_scale.shape == (8,)
    rows = x.float().abs().amax(-1)
    assert torch.equal(mi.outer_amax, rows)


def test_expert_domain_and_slicing():
    """Expert-scaled 3-D stacks have one outer scale per expert; expert(e) equals quantizing it alone."""
    x = torch.randn(3, 20, 48) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1)
    for name in ("torchao", "minite"):
        q = quantize(x, PRESETS[name])
        for e in range(3):
            alone = quantize(x[e], q.expert(e).spec)
            assert alone.bitwise_equal(q.expert(e))
    assert quantize(x, PRESETS["torchao"]).outer_scale.shape == (3,)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 32), (4, 0), (2, 3, 0)])
def test_empty_tensors(shape):
    """Empty tensors quantize and dequantize to empty tensors of the right shape."""
    for name in PRESETS:
        q = quantize(torch.zeros(shape), PRESETS[name])
        assert q.shape == shape
        assert dequantize(q).shape == shape


def test_hadamard_transform_is_orthonormal_and_inverts():
    """The fixed RHT preserves norms, inverts, and dequantize undoes it."""
    x = torch.randn(6, 64)
    y = rht16(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(rht16_inverse(y), x, atol=1e-6)
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    d = torch.tensor(PRESETS["minite"].hadamard_signs, dtype=torch.float32)
    assert torch.allclose(rht16(x[:, :16]), (x[:, :16] * d) @ h / 4, atol=1e-6)
    spec = PRESETS["minite"].replace(hadamard=True)
    q = quantize(x, spec)
    err_rot = (dequantize(q) - x).norm() / x.norm()
    assert err_rot < 0.15
    assert torch.equal(dequantize(q, rotated=True), dequantize(quantize(y, PRESETS["minite"])))


def test_stochastic_rounding_needs_a_generator_and_is_reproducible():
    """SR refuses to run without an explicit generator; a seed reproduces the codes."""
    spec = PRESETS["minite"].replace(stochastic_rounding=True)
    x = torch.randn(16, 64)
    with pytest.raises(SpecError, match="Generator"):
        quantize(x, spec)
    a = quantize(x, spec, generator=torch.Generator().manual_seed(3))
    b = quantize(x, spec, generator=torch.Generator().manual_seed(3))
    c = quantize(x, spec, generator=torch.Generator().manual_seed(4))
    assert a.bitwise_equal(b) and not torch.equal(a.codes, c.codes)
    assert torch.equal(a.block_scales.view(torch.uint8), c.block_scales.view(torch.uint8))


def test_spec_validation_and_serialization():
    """Unknown choices are SpecErrors; to_dict/from_dict round-trips every preset."""
    for bad in ({"outer_domain": "column"}, {"op_order": "fast"}, {"signed_zero": "neg"},
                {"amax_floor": -1.0}, {"zero_scale_to": 0.3}, {"block_size": 32},
                {"hadamard_signs": (1,) * 15}):
        with pytest.raises(SpecError):
            NumericsSpec(**bad)
    for spec in PRESETS.values():
        assert NumericsSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="unknown"):
        NumericsSpec.from_dict({"colour": "red"})
    with pytest.raises(AttributeError):
        PRESETS["minite"].outer_domain = "tensor"


def test_spec_choices_are_enums_that_read_as_their_strings():
    """A spec's closed choices are enum members (OuterDomain, OpOrder, SignedZero,
    OuterConvention) that equal, print, format and serialize as their strings: a spec made from
    strings equals one made from members, its dict is the same JSON as before, and a value
    outside the set is a SpecError listing the choices."""
    import json

    from libalign.spec.choices import OpOrder, OuterConvention, OuterDomain, SignedZero

    s = PRESETS["modelopt"]
    assert s.outer_domain is OuterDomain.TENSOR and s.op_order is OpOrder.MODELOPT
    assert s.signed_zero is SignedZero.SIGN_OF_NONZERO and s.outer_convention in OuterConvention
    assert s.outer_domain == "tensor" and f"{s.op_order}" == "modelopt" and repr(s.op_order) == "'modelopt'"
    same = s.replace(outer_domain="tensor", op_order="modelopt")
    assert same == s and json.dumps(same.to_dict()) == json.dumps(s.to_dict())
    assert json.loads(json.dumps(s.to_dict()))["outer_domain"] == "tensor"
    assert OpOrder("mx_te").is_mx and not OpOrder.TE.is_mx
    with pytest.raises(SpecError, match=r"outer_domain must be one of \('none', 'tensor', "
                       r"'expert', 'row'\), got 'block'"):
        s.replace(outer_domain="block")
