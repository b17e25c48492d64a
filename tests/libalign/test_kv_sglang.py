"""Pins the two SGLang KV presets (``kv_sglang_nvfp4``, ``kv_sglang_fp4_mx_block16``) bit for bit
against independent oracles ported from SGLang's and FlashInfer's sources
(tests/libalign/sglang_kv_oracle.py), their edge cases, properties, and the typed errors
of bad input. SGLang's own block-16 quantizer is run against the spec in
tests/services/test_sglang_kv.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign.errors import NonFiniteError, ShapeError, SpecError
from libalign.kernels import ops
from libalign.spec import PRESETS, dequantize, encode_with_scales, quantize, roundtrip_codes
from libalign.spec.packing import unpack_nibbles
from libalign.spec.presets import KV_PRESETS, SGLANG_KV_DTYPES
from tests.libalign import sglang_kv_oracle as oracle

NV = PRESETS["kv_sglang_nvfp4"]
MX16 = PRESETS["kv_sglang_fp4_mx_block16"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _adversarial(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows rich in exact ties: random magnitudes over many octaves, blocks whose values sit
    on E2M1 midpoints of a power-of-two scale, zero blocks, -0.0, fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-6, 3, n).reshape(-1, 1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0])
    pick = mids[torch.randint(0, len(mids), (n, k), generator=g)]
    sign = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    octave = 2.0 ** torch.randint(-8, 8, (n, 1), generator=g).float()
    tied = pick * sign * octave
    half = n // 2
    x[:half] = tied[:half]
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[2, 3] = -0.0
    x[3, :16] = torch.randn(16, generator=g) * 1e-40 if dtype == torch.float32 else 1e-6
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g", [1.0, 0.0123, 2.0 ** -7, 3.3e-4])
def test_nvfp4_preset_equals_flashinfer_exact_math_oracle(dtype, g):
    """kv_sglang_nvfp4: codes and E4M3 bytes equal FlashInfer's exact-math quantizer fed
    SGLang's 1/global_scale, bit for bit (ties, zero and -0.0 blocks, underflowing blocks);
    the stored outer scale is the given decode scale; reads equal SGLang's (q*s)*g."""
    x = _adversarial(24, 64, dtype, seed=int(g * 1e4))
    gs = torch.full((24,), g)
    q = quantize(x, NV, outer_scale=gs)
    codes, scales = oracle.flashinfer_kv_quantize(x, g)
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    assert torch.equal(q.outer_scale.view(torch.int32), gs.view(torch.int32))
    read = oracle.flashinfer_kv_dequantize(codes, scales, g)
    assert np.array_equal(dequantize(q).numpy().view(np.int32), read.view(np.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block16_preset_equals_sglang_compiled_oracle(dtype):
    """kv_sglang_fp4_mx_block16: codes and exponent bytes equal the fp32 port of SGLang's
    batched_quantize (ties away from zero, 1e-10 floor: a zero block stores byte 94)."""
    x = _adversarial(24, 64, dtype, seed=3)
    q = quantize(x, MX16)
    codes, scales = oracle.sglang_block16_quantize(x)
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    assert int(q.block_scales.view(torch.uint8)[0, 0]) == 94


def test_block16_ties_go_away_from_zero_and_signs():
    """At scale 1 the midpoints 0.25, 1.25, 2.5, 5 round up in magnitude (RNE would not);
    -0.0 codes 0x0 and a tiny negative 0x8."""
    row = torch.tensor([6.0, 0.25, 1.25, 2.5, 5.0, -0.25, -2.5, 0.75, 1.75, 3.5, -0.0, -0.1,
                        0.0, 0.2, 0.3, 1.0])
    q = quantize(row.reshape(1, 16), MX16)
    assert int(q.block_scales.view(torch.uint8)[0, 0]) == 127
    got = unpack_nibbles(q.codes)[0].tolist()
    assert got == [7, 1, 3, 5, 7, 9, 13, 2, 4, 6, 0, 8, 0, 0, 1, 2]


def test_presets_are_kv_formats_with_sglang_names():
    """Both presets are KV presets, each named with the --kv-cache-dtype SGLang takes."""
    assert set(SGLANG_KV_DTYPES) <= set(KV_PRESETS)
    assert SGLANG_KV_DTYPES == {"kv_sglang_nvfp4": "nvfp4",
                                "kv_sglang_fp4_mx_block16": "fp4_mx_block16"}
    assert NV.outer_source == "given" and MX16.block_size == 16 and MX16.is_mx


@pytest.mark.parametrize("spec", [NV, MX16])
def test_kernel_door_serves_them_with_spec_bits(spec):
    """libalign.kernels.quantize routes both to the spec (no compiled kernel has their order):
    the same bits as libalign.spec.quantize."""
    x = _adversarial(8, 32, torch.bfloat16)
    kw = {"outer_scale": torch.full((8,), 0.02)} if spec is NV else {}
    assert ops.backend_for(x, spec) == "spec"
    assert ops.quantize(x, spec, **kw).bitwise_equal(quantize(x, spec, **kw))


@pytest.mark.parametrize("spec", [NV, MX16])
def test_head_size_not_multiple_of_16_is_refused(spec):
    """A head size that is not a multiple of 16 is a ShapeError (SGLang's blocks would cross
    heads), before anything is computed."""
    with pytest.raises(ShapeError, match="multiple of 16"):
        quantize(torch.randn(2, 24), spec, **({"outer_scale": torch.ones(2)} if spec is NV else {}))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, 1e-45])
def test_nonfinite_or_nonpositive_global_scale_is_refused(bad):
    """A NaN, Inf, zero, negative or subnormal (its reciprocal overflows) global scale is a
    NonFiniteError naming outer_scale."""
    with pytest.raises(NonFiniteError, match="outer_scale"):
        quantize(torch.randn(2, 16), NV, outer_scale=torch.tensor([1.0, bad]))


def test_global_scale_default_and_given_where_not_taken():
    """kv_sglang_nvfp4 without a global scale takes SGLang's default 1.0; another preset given
    one, or a scale of the wrong shape: SpecError / ShapeError."""
    x = torch.randn(2, 16)
    assert quantize(x, NV).bitwise_equal(quantize(x, NV, outer_scale=torch.ones(2)))
    with pytest.raises(SpecError, match="outer_scale must be None"):
        quantize(x, PRESETS["kv_nvfp4"], outer_scale=torch.ones(2))
    with pytest.raises(ShapeError, match="outer_scale has shape"):
        quantize(x, NV, outer_scale=torch.ones(3))


@pytest.mark.parametrize("spec", [NV, MX16])
def test_nan_input_is_refused(spec):
    """NaN/Inf K or V values: NonFiniteError with positions (SGLang's byte would be garbage)."""
    x = torch.randn(2, 16)
    x[1, 5] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize(x, spec, **({"outer_scale": torch.ones(2)} if spec is NV else {}))


_F32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@settings(max_examples=30, deadline=None)
@given(vals=st.lists(_F32, min_size=32, max_size=32),
       g=st.floats(min_value=2.0 ** -20, max_value=8.0, width=32))
def test_properties_oracles_reencode_and_error_bound(vals, g):
    """On any bf16 rows: both presets equal their oracles; re-encoding the read values with the
    stored scales gives the codes back (roundtrip_codes); a block16 read is within one scale
    step 2^(b-127) of its input (half the widest E2M1 gap)."""
    x = torch.tensor(vals, dtype=torch.float32).reshape(2, 16).to(torch.bfloat16)
    gs = torch.full((2,), g)
    for spec, kw in ((NV, {"outer_scale": gs}), (MX16, {})):
        q = quantize(x, spec, **kw)
        assert torch.equal(encode_with_scales(dequantize(q), q), roundtrip_codes(q))
    codes, scales = oracle.flashinfer_kv_quantize(x, g)
    q = quantize(x, NV, outer_scale=gs)
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    codes, scales = oracle.sglang_block16_quantize(x)
    q = quantize(x, MX16)
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    step = 2.0 ** (q.block_scales.view(torch.uint8).to(torch.float64) - 127)
    err = (dequantize(q).double() - x.double()).abs().reshape(2, 1, 16)
    assert bool((err <= step.unsqueeze(-1)).all())
