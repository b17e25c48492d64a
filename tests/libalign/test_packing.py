"""Pins nibble order and the 128x4 swizzled scale layout (against torchao's)."""

import pytest
import torch
from alignclient.errors import DTypeError, LayoutError, ShapeError

from libalign.spec.packing import (
    pack_nibbles,
    swizzle_scales,
    swizzled_size,
    unpack_nibbles,
    unswizzle_scales,
)


def test_literal_packed_bytes():
    """Even index in the low nibble: [1, 2, 3, 0xF] -> [0x21, 0xF3]."""
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0xF3]]
    assert unpack_nibbles(torch.tensor([[0x21, 0xF3]], dtype=torch.uint8)).tolist() == [[1, 2, 3, 15]]


def test_pack_roundtrip_and_errors():
    """unpack(pack(c)) == c; odd K and non-uint8 inputs are typed errors."""
    c = torch.randint(0, 16, (3, 4, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(c)), c)
    with pytest.raises(ShapeError):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(DTypeError):
        pack_nibbles(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(DTypeError):
        unpack_nibbles(torch.zeros(2, 4))


SHAPES = [(1, 1), (128, 4), (130, 7), (256, 12), (300, 9), (64, 128), (129, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_swizzle_matches_torchao_to_blocked(shape):
    """Our 128x4 layout is byte-identical to torchao's to_blocked, padding included."""
    from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

    s = torch.randint(1, 0x7F, shape, dtype=torch.uint8)
    ours = swizzle_scales(s)
    assert torch.equal(ours, to_blocked(s).view(torch.uint8))
    assert torch.equal(unswizzle_scales(ours, shape), s)
    assert torch.equal(from_blocked(ours.view(torch.uint8), *shape), s)


@pytest.mark.parametrize("shape", SHAPES)
def test_swizzle_offset_formula(shape):
    """Element (m, k) sits at ((m//128)*ceil(K16/4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    rows, cols = shape
    s = (torch.arange(rows * cols) % 251 + 1).to(torch.uint8).reshape(shape)
    flat = swizzle_scales(s)
    assert flat.numel() == swizzled_size(rows, cols)
    ct = -(-cols // 4)
    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    off = ((m // 128) * ct + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    assert torch.equal(flat[off], s)
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    mask[off.reshape(-1)] = False
    assert int(flat[mask].count_nonzero()) == 0  # padding is zero


def test_swizzle_3d_is_per_expert_and_keeps_fp8_dtype():
    """A 3-D stack is swizzled expert by expert; float8 in gives float8 out."""
    s = torch.randint(1, 0x7F, (3, 130, 7), dtype=torch.uint8).view(torch.float8_e4m3fn)
    flat = swizzle_scales(s)
    assert flat.dtype == torch.float8_e4m3fn
    per = swizzled_size(130, 7)
    for e in range(3):
        part = flat.view(torch.uint8)[e * per:(e + 1) * per]
        assert torch.equal(part, swizzle_scales(s[e]).view(torch.uint8))
    assert torch.equal(unswizzle_scales(flat, (3, 130, 7)).view(torch.uint8), s.view(torch.uint8))


def test_unswizzle_refuses_wrong_size():
    """A buffer whose length does not fit the layout is a LayoutError."""
    with pytest.raises(LayoutError):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), (128, 4))
    with pytest.raises(ShapeError):
        swizzle_scales(torch.zeros(4, dtype=torch.uint8))
