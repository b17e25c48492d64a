"""Pins conversion to and from ModelOpt and compressed-tensors NVFP4 weight dicts."""

import pytest
import torch
from alignclient.errors import DTypeError, LayoutError, NonFiniteError, ShapeError

from libalign.checkpoint import (
    from_compressed_tensors,
    from_modelopt,
    to_compressed_tensors,
    to_modelopt,
)
from libalign.spec import PRESETS, dequantize, quantize
from tests.libalign import inputs, peers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modelopt_roundtrip_through_modelopt_itself(dtype):
    """ModelOpt's own output reads back to the same bits; ModelOpt dequantizes ours identically."""
    x = inputs.mixed_magnitudes((48, 256), dtype=dtype)
    packed, scale_bytes, wsf2 = peers.modelopt(x)
    q = from_modelopt({"weight": packed, "weight_scale": scale_bytes.view(torch.float8_e4m3fn),
                       "weight_scale_2": wsf2.reshape(())})
    assert q.bitwise_equal(quantize(x, PRESETS["modelopt"]))
    d = to_modelopt(quantize(x, PRESETS["modelopt"]))
    assert set(d) == {"weight", "weight_scale", "weight_scale_2"}
    assert d["weight"].dtype == torch.uint8 and d["weight_scale"].dtype == torch.float8_e4m3fn
    assert d["weight_scale_2"].shape == () and d["weight_scale_2"].dtype == torch.float32
    theirs = peers.modelopt_dequantize(d["weight"], d["weight_scale"].view(torch.uint8),
                                       d["weight_scale_2"], tuple(x.shape))
    assert torch.equal(theirs.view(torch.int32), dequantize(q).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compressed_tensors_roundtrip_through_ct_itself(dtype):
    """compressed-tensors' output reads back to the same bits; its decompress matches ours."""
    x = inputs.tie_heavy((48, 256), dtype=dtype)
    packed, scale_bytes, gs = peers.compressed_tensors(x)
    q = from_compressed_tensors({"weight_packed": packed,
                                 "weight_scale": scale_bytes.view(torch.float8_e4m3fn),
                                 "weight_global_scale": gs})
    assert q.bitwise_equal(quantize(x, PRESETS["compressed_tensors"]))
    d = to_compressed_tensors(q)
    assert d["weight_global_scale"].shape == (1,)
    theirs = peers.compressed_tensors_dequantize(d["weight_packed"],
                                                 d["weight_scale"].view(torch.uint8),
                                                 d["weight_global_scale"])
    assert torch.equal(theirs.view(torch.int16), dequantize(q, torch.bfloat16).view(torch.int16))


def test_te_order_tensor_exports_its_decode_scale():
    """A te-order per-tensor weight exports weight_scale_2 = 1 / S_enc and CT gs = S_enc."""
    q = quantize(inputs.randn((16, 64)), PRESETS["te"])
    assert to_modelopt(q)["weight_scale_2"].item() == q.outer_dec.item()
    assert to_compressed_tensors(q)["weight_global_scale"].item() == q.outer_enc.item()


def test_refuses_row_scaled_and_stacks():
    """Row-scaled tensors and 3-D stacks have no faithful single-scale representation."""
    with pytest.raises(LayoutError, match="row"):
        to_modelopt(quantize(inputs.randn((16, 64)), PRESETS["minite"]))
    stack = quantize(inputs.randn((2, 16, 64)), PRESETS["torchao"])
    with pytest.raises(ShapeError, match="expert"):
        to_compressed_tensors(stack)
    assert set(to_modelopt(stack.expert(1))) == {"weight", "weight_scale", "weight_scale_2"}


def _good():
    return to_modelopt(quantize(inputs.randn((16, 64)), PRESETS["modelopt"]))


@pytest.mark.parametrize("mutate,error,match", [
    (lambda d: d.pop("weight_scale_2"), LayoutError, "lacks"),
    (lambda d: d.__setitem__("weight", d["weight"].to(torch.int8)), DTypeError, "uint8"),
    (lambda d: d.__setitem__("weight_scale", d["weight_scale"].float()), DTypeError, "float8"),
    (lambda d: d.__setitem__("weight_scale_2", d["weight_scale_2"].double()), DTypeError, "float32"),
    (lambda d: d.__setitem__("weight_scale", d["weight_scale"][:, :2]), ShapeError, "does not match"),
    (lambda d: d.__setitem__("weight_scale_2", torch.ones(2)), ShapeError, "one value"),
    (lambda d: d.__setitem__("weight_scale_2", torch.tensor(float("nan"))), NonFiniteError, "NaN"),
    (lambda d: d.__setitem__("weight_scale_2", torch.tensor(-1.0)), LayoutError, "positive"),
    (lambda d: d["weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x7F), LayoutError, "NaN"),
])
def test_reader_names_what_is_wrong(mutate, error, match):
    """Malformed checkpoint dicts raise typed errors naming the key and the problem."""
    d = _good()
    mutate(d)
    with pytest.raises(error, match=match):
        from_modelopt(d)
