"""Pins the typed errors for bad input and the error tree itself."""

import pytest
import torch
from alignclient.errors import (
    AlignError,
    DTypeError,
    InputError,
    NonFiniteError,
    ShapeError,
    SpecError,
)

from libalign.spec import PRESETS, dequantize, encode_with_scales, quantize


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8, torch.bool])
def test_wrong_dtype(dtype):
    """Integer, bool and float64 inputs are DTypeErrors naming the dtype."""
    with pytest.raises(DTypeError, match=str(dtype)):
        quantize(torch.zeros(4, 16, dtype=dtype))


@pytest.mark.parametrize("shape", [(16,), (2, 2, 2, 16), ()])
def test_wrong_rank(shape):
    """Only 2-D matrices and 3-D expert stacks are accepted."""
    with pytest.raises(ShapeError, match="2-D"):
        quantize(torch.zeros(shape))


def test_not_a_tensor():
    """A list is a DTypeError, not an AttributeError from deep inside."""
    with pytest.raises(DTypeError, match="list"):
        quantize([[1.0] * 16])


@pytest.mark.parametrize("preset", list(PRESETS))
def test_nan_refused_by_every_preset(preset):
    """Every preset refuses NaN with a NonFiniteError (none of them saturates)."""
    x = torch.ones(2, 32)
    x[0, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"1 non-finite element\(s\) \(1 NaN, 0 Inf\)"):
        quantize(x, PRESETS[preset])


def test_inf_in_bf16_and_3d_positions():
    """Positions are full multi-indices into the caller's tensor."""
    x = torch.ones(2, 3, 32, dtype=torch.bfloat16)
    x[1, 2, 31] = float("-inf")
    with pytest.raises(NonFiniteError) as err:
        quantize(x)
    assert err.value.first_indices == [(1, 2, 31)] and err.value.inf == 1


def test_encode_with_scales_checks_shape_and_finiteness():
    """Re-encoding needs the shape the scales belong to, and finite values."""
    q = quantize(torch.randn(4, 32))
    with pytest.raises(ShapeError):
        encode_with_scales(torch.randn(4, 48), q)
    bad = torch.randn(4, 32)
    bad[0, 0] = float("inf")
    with pytest.raises(NonFiniteError):
        encode_with_scales(bad, q)


def test_error_tree():
    """Input errors are AlignErrors and the builtin they refine; codes are stable."""
    assert issubclass(DTypeError, TypeError) and issubclass(DTypeError, ValueError)
    assert issubclass(ShapeError, ValueError) and issubclass(SpecError, InputError)
    assert issubclass(NonFiniteError, AlignError)
    e = NonFiniteError("w", 2, 1, 1, [(0, 1), (2, 3)])
    assert e.to_dict() == {"code": "non_finite", "type": "NonFiniteError", "message": str(e)}
    assert not hasattr(e, "http_status")  # the HTTP status is the API's (alignd.api.errors)


def test_dequantize_dtypes():
    """dequantize returns the requested float dtype."""
    q = quantize(torch.randn(4, 32))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert dequantize(q, dt).dtype == dt
