"""Guidance records on MXFP4 (TRACE's format robustness row): E8M0 scales per 32 values.

The same record format carries MXFP4 rows (one scale byte per 32 values, row scale 1.0);
guided rounding under an MXFP4 spec reproduces the sampler's bits from its own input and,
from a perturbed input, every sampler code that lies within one grid step of the
learner's value, as it does for NVFP4.
"""

from __future__ import annotations

import pytest
import torch

from libalign.errors import GuidanceRecordError
from libalign.guidance import (
    GuidanceCapture,
    GuidanceRecord,
    GuidanceTable,
    RowGuide,
    guided_quantize,
    row_keys,
)
from libalign.spec import PRESETS, normalized_with_scales, quantize
from libalign.spec.packing import unpack_nibbles
from libalign.spec.presets import MX_PRESETS
from libalign.spec.rounding import bracket_levels, e2m1_levels, low_bits

BITS = (1, 2, 3, 4)


def _x(t=16, k=96, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 3, t).unsqueeze(-1)
    return x.to(dtype)


def _own_guide(q, bits, present=None) -> RowGuide:
    t = q.codes.shape[0]
    present = torch.ones(t, dtype=torch.bool) if present is None else present
    return RowGuide(bits, present, torch.arange(t), low_bits(unpack_nibbles(q.codes), bits),
                    q.block_scales.view(torch.uint8), torch.ones(t))


@pytest.mark.parametrize("preset", MX_PRESETS)
@pytest.mark.parametrize("bits", BITS)
def test_sampler_input_reproduces_its_own_bits(preset, bits):
    spec = PRESETS[preset]
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(seed=bits, dtype=dtype)
        q = quantize(x, spec)
        g = guided_quantize(x, spec, _own_guide(q, bits))
        assert g.bitwise_equal(q)
        assert g.block_scales.dtype == torch.float8_e8m0fnu and g.outer_scale is None


@pytest.mark.parametrize("preset", ["mxfp4", "mxfp4_te"])
@pytest.mark.parametrize("bits", BITS)
def test_perturbed_learner_follows_the_sampler_within_one_step(preset, bits):
    spec = PRESETS[preset]
    xs = _x(t=32, seed=11)
    g = torch.Generator().manual_seed(12)
    xl = xs * (1 + 0.02 * torch.randn(xs.shape, generator=g))
    qs = quantize(xs, spec)
    cs = unpack_nibbles(qs.codes)
    rtn = unpack_nibbles(quantize(xl, spec).codes)
    guided = guided_quantize(xl, spec, _own_guide(qs, bits))
    cg = unpack_nibbles(guided.codes)
    assert int((rtn == cs).sum()) < cs.numel()  # the noise does flip codes
    assert int((cg == cs).sum()) > int((rtn == cs).sum())
    assert torch.equal(guided.block_scales.view(torch.uint8), qs.block_scales.view(torch.uint8))
    z = normalized_with_scales(xl, qs.block_scales, None, spec).flatten(-2)
    lower, upper = bracket_levels(z)
    s_lv = e2m1_levels(cs)
    inside = (s_lv >= lower) & (s_lv <= upper)  # the sampler's code is within one grid step
    assert bool(inside.float().mean() > 0.95)
    assert torch.equal(e2m1_levels(cg)[inside], s_lv[inside])
    assert bool(((e2m1_levels(cg) == lower) | (e2m1_levels(cg) == upper)).all())


@pytest.mark.parametrize("bits", BITS)
def test_capture_encode_decode_and_table_on_mxfp4(bits):
    spec = PRESETS["mxfp4"]
    x = _x(t=6, k=64, seed=21)
    keys = row_keys(torch.tensor([3, 3, 8, 8, 3, 0]), torch.tensor([5, 2, 7, 0, 9, 0]))
    keys[5] = -1
    cap = GuidanceCapture(spec)
    q = quantize(x, spec)
    cap.add(2, "fc1", q, keys)
    recs = cap.records(bits)
    assert sorted(recs) == [3, 8] and recs[3].spec == "mxfp4"
    rows = recs[3].sites[(2, "fc1")]
    assert tuple(rows.block_scales.shape) == (3, 2)  # one E8M0 byte per 32 values
    assert bool((rows.row_scales == 1.0).all())
    decoded = {sid: GuidanceRecord.decode(r.encode("zlib")) for sid, r in recs.items()}
    for sid, rec in recs.items():
        got = decoded[sid].sites[(2, "fc1")]
        want = rec.sites[(2, "fc1")]
        assert torch.equal(got.block_scales, want.block_scales)
        assert torch.equal(got.codes, want.codes)
    guide = GuidanceTable(decoded).lookup(2, "fc1", keys)
    assert guided_quantize(x, spec, guide).bitwise_equal(q)


def test_records_of_the_other_block_size_are_refused():
    x = _x(t=4, k=64)
    nv = quantize(x, PRESETS["minite"])
    guide = RowGuide(2, torch.ones(4, dtype=torch.bool), torch.arange(4),
                     low_bits(unpack_nibbles(nv.codes), 2), nv.block_scales.view(torch.uint8),
                     nv.outer_scale)
    with pytest.raises(GuidanceRecordError, match="one per 32"):
        guided_quantize(x, PRESETS["mxfp4"], guide)
    mx = quantize(x, PRESETS["mxfp4"])
    with pytest.raises(GuidanceRecordError, match="one per 16"):
        guided_quantize(x, PRESETS["minite"], _own_guide(mx, 2))
