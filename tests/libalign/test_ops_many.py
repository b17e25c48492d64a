"""Pins ``ops.quantize_many``'s batched path (one output allocation for all tensors,
``calls.launch_many``) to the spec, bit for bit, and to the per-tensor errors.

The batch serves row-domain and MXFP4 calls whose tensors the kernels all serve on one
device; everything else goes one tensor at a time. Both must return the spec's bits and
raise the spec's typed error for the first failing tensor, with nothing returned.
"""

from __future__ import annotations

import functools

import pytest
import torch
from alignclient.errors import DTypeError, NonFiniteError, ShapeError, UndefinedScaleError

from libalign.kernels import calls, ops
from libalign.spec import PRESETS, quantize
from tests.libalign import inputs, test_ops_kernels
from tests.libalign.test_ops_kernels import assert_bitwise

device = test_ops_kernels.device  # each CPU path, and CUDA

ROW_AND_MX = ["minite", "te_row", "kv_nvfp4", "mxfp4", "mxfp4_te"]
# 2-D and 3-D, rows not a multiple of 128, scale columns not a multiple of 4 (swizzle
# padding), an empty stack, one row.
SHAPES = [(2, 200, 768), (130, 2048), (3, 128, 512), (4, 0, 768), (1, 64), (2, 64, 8192)]


def mixed(dtype=torch.bfloat16):
    return [inputs.FAMILIES[f](s, dtype=torch.float32).to(dtype)
            for f, s in zip(sorted(inputs.FAMILIES), SHAPES, strict=False)]


@functools.cache
def mixed_reference(preset: str) -> tuple:
    """The spec's result for each tensor of ``mixed()`` under ``preset``: computed once and
    shared by every device and layout (the spec is pure; the inputs are seeded)."""
    return tuple(quantize(x, PRESETS[preset]) for x in mixed())


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("preset", ROW_AND_MX)
def test_batch_equals_spec_per_tensor(device, preset, layout):
    """Mixed shapes in one call (swizzle-padded next to unpadded): each result is the spec's."""
    spec = PRESETS[preset]
    xs = mixed()
    got = ops.quantize_many([x.to(device) for x in xs], spec, scale_layout=layout)
    assert len(got) == len(xs)
    for g, ref in zip(got, mixed_reference(preset), strict=True):
        assert_bitwise(g.linear() if layout == "swizzled" else g, ref)
        if layout == "swizzled":
            assert torch.equal(g.block_scales.view(torch.uint8).cpu(),
                               ref.swizzled_block_scales().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_mixed_dtypes(device, dtype):
    """fp32/fp16 beside bf16 in one batch (each tensor its own parameter block)."""
    xs = [inputs.randn((3, 40, 256), seed=1).to(dtype), inputs.randn((64, 512), seed=2)]
    got = ops.quantize_many([x.to(device) for x in xs], PRESETS["minite"])
    for g, x in zip(got, xs, strict=True):
        assert_bitwise(g, quantize(x, PRESETS["minite"]))


def test_batch_outputs_share_one_aligned_buffer(device):
    """The batched results view one allocation, each output ALIGN-aligned in it (as aligned
    as the allocation itself); a second call writes new memory, so the first call's results
    keep their bits."""
    xs = [inputs.randn((2, 200, 768), seed=3), inputs.randn((130, 2048), seed=4)]
    first = ops.quantize_many([x.to(device) for x in xs], PRESETS["minite"])
    tensors = [t for q in first for t in (q.codes, q.block_scales, q.outer_scale, q.outer_amax)]
    base = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(base) == 1
    assert all((t.data_ptr() - min(base)) % calls.ALIGN == 0 for t in tensors)
    ops.quantize_many([inputs.randn(tuple(x.shape), seed=9).to(device) for x in xs],
                      PRESETS["minite"])
    for q, x in zip(first, xs, strict=True):
        assert_bitwise(q, quantize(x, PRESETS["minite"]))


@pytest.mark.parametrize("preset", ["minite", "mxfp4"])
def test_first_flagged_tensor_raises_its_spec_error(device, preset):
    """NaN in tensors 1 and 2: tensor 1's NonFiniteError (its positions); then a clean call
    on the same device returns the spec's bits (no flag left over from the failed one)."""
    spec = PRESETS[preset]
    good = inputs.randn((2, 64, 256), seed=5)
    bad1, bad2 = inputs.randn((2, 64, 256), seed=6), inputs.randn((64, 256), seed=7)
    bad1[1, 3, 5] = float("nan")
    bad2[7, 9] = float("inf")
    with pytest.raises(NonFiniteError) as err:
        ops.quantize_many([good.to(device), bad1.to(device), bad2.to(device)], spec)
    assert "(1, 3, 5)" in str(err.value)
    with pytest.raises(NonFiniteError) as err:
        ops.quantize_many([good.to(device), bad2.to(device)], spec)
    assert "(7, 9)" in str(err.value)
    for _ in range(2):
        got = ops.quantize_many([good.to(device), good[0].to(device)], spec)
        assert_bitwise(got[0], quantize(good, spec))
        assert_bitwise(got[1], quantize(good[0], spec))


@pytest.mark.parametrize("order", ["torchao", "modelopt"])
def test_undefined_scale_raises_in_the_batch(device, order):
    """An all-zero row under an order that divides 0 by 0 (row domain, so batched): the
    spec's UndefinedScaleError, after a clean tensor in the same call."""
    spec = PRESETS[order].replace(outer_domain="row")
    x = inputs.randn((4, 64))
    x[2] = 0
    assert calls.batchable(spec) and ops.kernel_gap(x, spec, None) is None
    with pytest.raises(UndefinedScaleError):
        quantize(x, spec)
    with pytest.raises(UndefinedScaleError):
        ops.quantize_many([inputs.randn((8, 32)).to(device), x.to(device)], spec)


def test_check_errors_come_first_in_order(device):
    """A shape or dtype error of tensor 1 is raised before any kernel flag is read, as the
    per-tensor loop raised it (NaN in tensor 0 does not hide it)."""
    nan = inputs.randn((8, 64))
    nan[0, 0] = float("nan")
    with pytest.raises(ShapeError):
        ops.quantize_many([nan.to(device), inputs.randn((2, 3, 4, 64)).to(device)],
                          PRESETS["minite"])
    with pytest.raises(DTypeError):
        ops.quantize_many([nan.to(device), torch.zeros(8, 64, dtype=torch.int32).to(device)],
                          PRESETS["minite"])
    with pytest.raises(ShapeError):
        ops.quantize_many([inputs.randn((8, 64)).to(device), inputs.randn((8, 40)).to(device)],
                          PRESETS["mxfp4"])


def test_unbatched_calls_are_unchanged(device):
    """A tensor the spec serves (K=40) or the tensor domain sends the call one tensor at a
    time; bits and layouts as before."""
    xs = [inputs.randn((2, 64, 256), seed=8), inputs.randn((8, 40))]
    got = ops.quantize_many([x.to(device) for x in xs], PRESETS["minite"])
    for g, x in zip(got, xs, strict=True):
        assert_bitwise(g, quantize(x, PRESETS["minite"]))
    got = ops.quantize_many([xs[0].to(device)], PRESETS["te"])
    assert_bitwise(got[0], quantize(xs[0], PRESETS["te"]))
    assert ops.quantize_many([], PRESETS["minite"]) == []


def test_flag_pool_reuses_only_clean_buffers():
    """take_flags hands out zeroed int32 buffers of at least n slots; read_flags puts a
    buffer that came back all zero into the pool (the next take gets it, still zero) and
    drops one a kernel flagged (the next take gets a fresh zeroed one)."""
    dev = torch.device("cpu")
    a = calls.take_flags(dev, 3)
    assert a.dtype == torch.int32 and a.numel() >= max(3, calls.FLAG_SLOTS)
    assert not a.any()
    assert calls.read_flags(a) == [0] * a.numel()
    b = calls.take_flags(dev, 2)
    assert b is a
    b[1] = calls.FLAG_NONFINITE
    assert calls.read_flags(b)[1] == calls.FLAG_NONFINITE
    c = calls.take_flags(dev, 2)
    assert c is not b and not c.any()
    big = calls.take_flags(dev, 5 * calls.FLAG_SLOTS)
    assert big.numel() >= 5 * calls.FLAG_SLOTS and not big.any()


@pytest.mark.gpu
def test_side_stream_and_its_raw_handle():
    """On a side stream: current_stream_handle is that stream's handle, quantize_many's
    kernels and flag read run on it (the spec's bits, a NaN raises), and the default
    stream's handle comes back after the block."""
    dev = torch.device("cuda", torch.cuda.current_device())
    assert calls.current_stream_handle(dev) == torch.cuda.current_stream(dev).cuda_stream
    xs = [inputs.randn((2, 200, 768), seed=10), inputs.randn((130, 2048), seed=11)]
    bad = xs[1].clone()
    bad[5, 7] = float("nan")
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert calls.current_stream_handle(dev) == side.cuda_stream
        ys = [x.to(dev) for x in xs]
        for _ in range(2):
            got = ops.quantize_many(ys, PRESETS["minite"])
            for g, x in zip(got, xs, strict=True):
                assert_bitwise(g, quantize(x, PRESETS["minite"]))
        with pytest.raises(NonFiniteError):
            ops.quantize_many([ys[0], bad.to(dev)], PRESETS["minite"])
        assert_bitwise(ops.quantize(ys[1], PRESETS["minite"]), quantize(xs[1], PRESETS["minite"]))
    assert calls.current_stream_handle(dev) == torch.cuda.current_stream(dev).cuda_stream
