"""Bitwise parity of each preset with the real library it is named after (atol=0).

Every family of adversarial inputs, bf16 and fp32: packed codes, block-scale bytes and
outer-scale bits must all be identical; so must each library's own dequantization of
the bits. TE cannot run on CPU, so ``te``, ``te_row`` and ``minite`` are checked against
an independent NumPy oracle of TE's published reference formulas.
"""

import numpy as np
import pytest
import torch

from libalign.spec import PRESETS, dequantize, quantize
from libalign.spec.packing import unpack_nibbles
from tests.libalign import inputs, peers, te_oracle

DTYPES = [torch.bfloat16, torch.float32]
FAMILIES = sorted(inputs.FAMILIES)
SHAPES_2D = [(64, 256), (37, 2048)]


def _bits(t):
    return t.reshape(-1).view(torch.int32)


def _assert_same(q, packed, scale_bytes, outer):
    n_codes = int((q.codes != packed).sum())
    n_scales = int((q.block_scales.view(torch.uint8) != scale_bytes.reshape(q.block_scales.shape)).sum())
    n_outer = int((_bits(q.outer_scale) != _bits(outer.to(torch.float32))).sum())
    assert (n_codes, n_scales, n_outer) == (0, 0, 0), (
        f"{n_codes} code bytes, {n_scales} scale bytes, {n_outer} outer scales differ"
    )


def _input(family, shape, dtype):
    return inputs.FAMILIES[family](shape, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", ["torchao", "modelopt", "compressed_tensors"])
def test_preset_bit_identical_to_library(preset, family, dtype, shape):
    """quantize(x, PRESETS[preset]) == the library's own quantizer, bit for bit."""
    x = _input(family, shape, dtype)
    packed, scale_bytes, outer = getattr(peers, preset)(x)
    _assert_same(quantize(x, PRESETS[preset]), packed, scale_bytes, outer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_torchao_per_expert_stack(family, dtype):
    """3-D stacks with torchao's per-expert scale, expert sizes not multiples of 128."""
    x = _input(family, (5, 48, 128), dtype)
    packed, scale_bytes, outer = peers.torchao(x)
    _assert_same(quantize(x, PRESETS["torchao"]), packed, scale_bytes, outer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_modelopt_pads_k_like_modelopt(dtype):
    """K = 40: ModelOpt zero-pads to 48 and so does the modelopt preset."""
    x = inputs.randn((12, 40), dtype=dtype)
    packed, scale_bytes, outer = peers.modelopt(x)
    q = quantize(x, PRESETS["modelopt"])
    assert q.codes.shape == packed.shape == (12, 24)
    _assert_same(q, packed, scale_bytes, outer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_dequantize_matches_each_library(family, dtype):
    """Our dequantization of the shared bits equals each library's, bit for bit."""
    x = _input(family, (32, 256), dtype)
    shape = tuple(x.shape)
    for preset, deq in (("torchao", peers.torchao_dequantize),
                        ("modelopt", peers.modelopt_dequantize)):
        q = quantize(x, PRESETS[preset])
        packed, scale_bytes, outer = getattr(peers, preset)(x)
        theirs = deq(packed, scale_bytes, outer, shape, torch.float32)
        assert torch.equal(dequantize(q, torch.float32).view(torch.int32), theirs.view(torch.int32))
    q = quantize(x, PRESETS["compressed_tensors"])
    packed, scale_bytes, outer = peers.compressed_tensors(x)
    theirs = peers.compressed_tensors_dequantize(packed, scale_bytes, outer)
    assert torch.equal(dequantize(q, torch.bfloat16).view(torch.int16), theirs.view(torch.int16))


ORACLE = {
    "te": dict(per_row=False),
    "te_row": dict(per_row=True),
    "minite": dict(per_row=True, floor=1e-12, zero_multiplier=True),
}


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", sorted(ORACLE))
def test_te_order_presets_match_te_reference_formulas(preset, family, dtype, shape):
    """te / te_row / minite equal the independent oracle of TE's reference formulas."""
    x = _input(family, shape, dtype)
    codes, scale_bytes, amax = te_oracle.quantize(x.float().numpy(), **ORACLE[preset])
    q = quantize(x, PRESETS[preset])
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scale_bytes)
    assert np.array_equal(q.outer_amax.reshape(-1).numpy().view(np.int32), amax.view(np.int32))


def test_presets_really_differ_where_peers_differ():
    """Negative control: on tie-heavy bf16 data the peers' orders give different bits."""
    x = inputs.tie_heavy((64, 256))
    codes = {n: quantize(x, PRESETS[n].replace(outer_domain="tensor")).codes
             for n in ("te", "torchao", "modelopt", "compressed_tensors")}
    assert not torch.equal(codes["te"], codes["torchao"])
    assert not torch.equal(codes["torchao"], codes["modelopt"])
    assert not torch.equal(codes["modelopt"], codes["compressed_tensors"])
