"""Pins the fused GPU W4A4 path against the spec and the float64 reference (CUDA only).

The activation pass must reproduce the spec's inner values and decode scales bit for bit;
the grouped GEMM differs from the reference only by its fp32 addition order, which the
stated tolerance bounds: every output within one bf16 ulp, and almost all identical.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import NonFiniteError

from libalign import gemm
from libalign.gemm import triton_grouped
from libalign.spec import PRESETS, quantize

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def _need_triton():
    if not torch.cuda.is_available() or not triton_grouped.triton_gemm_available(CUDA):
        pytest.skip("needs a CUDA device of sm_90+ with Triton")


def _acts(m, k, seed, ties=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)
    if ties:  # values on E2M1 midpoints once scaled: integers and halves of a power of two
        a = torch.randint(-12, 13, (m, k), generator=g).float() * 0.25
        a[:, ::16] = 6.0  # each block max 6 (scale lands on a power of two)
    a[: max(1, m // 17), :] = 0.0  # all-zero rows
    return a.to(torch.bfloat16).to(CUDA)


@pytest.mark.parametrize("preset", ["minite", "te"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [64, 768, 2048, 80])
def test_activation_pass_bits_equal_spec(preset, ties, k):
    """Triton inner values and row decode scales equal the spec's, bit for bit."""
    _need_triton()
    from libalign.gemm import triton_kernels as tk

    spec = PRESETS[preset]
    a = _acts(333, k, seed=k + ties, ties=ties)
    amax = a.abs().amax().float().reshape(1) if spec.outer_domain == "tensor" else None
    inner, dec = tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=amax)
    q = quantize(a.cpu(), spec)
    want_inner = gemm.inner_values(q, torch.float32).to(torch.bfloat16)
    want_dec = gemm.row_decode_scales(q)
    # the sign of a zero does not reach a product, so values (not bits) are compared
    assert torch.equal(inner.cpu(), want_inner) and torch.isfinite(inner).all()
    assert torch.equal(dec.cpu().view(torch.int32), want_dec.view(torch.int32))


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 values at |x| (the smallest normal's spacing below it)."""
    ax = x.float().abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(ax)) - 7)


@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_naive"])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768), (200, 96), (64, 80)])
def test_grouped_gemm_matches_reference_within_one_ulp(path, n, k):
    """Uneven and empty experts: every output within 1 bf16 ulp of the reference, >= 97% equal."""
    _need_triton()
    torch.manual_seed(n + k)
    counts = [130, 0, 1, 257, 64, 0, 511, 3]
    w = (torch.randn(len(counts), n, k) * 0.02).to(torch.bfloat16)
    a = _acts(sum(counts), k, seed=n)
    ew_cpu = gemm.prepare_weights(w, path)
    ref = gemm.grouped_linear(a.cpu(), ew_cpu, counts, backend="reference")
    ew = gemm.prepare_weights(w.to(CUDA), path)
    assert ew.q.bitwise_equal(ew_cpu.q.to(CUDA))
    out = gemm.grouped_linear(a, ew, counts, backend="triton").cpu()
    assert out.shape == ref.shape and torch.isfinite(out.float()).all()
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= _bf16_ulp(ref)).all()), float((diff / _bf16_ulp(ref)).max())
    assert (out == ref).float().mean() >= 0.97


def test_padding_is_invisible():
    """Rows padded to 64 or 128 per expert give the same outputs as the unpadded call."""
    _need_triton()
    counts = [5, 0, 77, 200]
    w = torch.randn(4, 256, 128, dtype=torch.bfloat16, device=CUDA)
    a = _acts(sum(counts), 128, seed=3)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    outs = [gemm.grouped_linear(a, ew, gemm.group_layout(counts, p), backend="triton")
            for p in (1, 64, 128)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_nan_activation_raises_naming_the_row():
    """A NaN in the activations is a NonFiniteError naming its row, not NaN outputs."""
    _need_triton()
    w = torch.randn(2, 64, 64, dtype=torch.bfloat16, device=CUDA)
    a = _acts(40, 64, seed=1)
    a[17, 5] = float("nan")
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    with pytest.raises(NonFiniteError, match="17"):
        gemm.grouped_linear(a, ew, [20, 20], backend="triton")


def test_unchecked_call_gives_nan_rows_and_the_same_bits_elsewhere():
    """check_finite=False: the NaN row's outputs are NaN, no error, every other row as checked."""
    _need_triton()
    w = torch.randn(2, 64, 64, dtype=torch.bfloat16, device=CUDA)
    a = _acts(40, 64, seed=1)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    clean = gemm.grouped_linear(a, ew, [20, 20], backend="triton")
    a[17, 5] = float("nan")
    out = gemm.grouped_linear(a, ew, [20, 20], backend="triton", check_finite=False)
    assert torch.isnan(out[17]).all()
    keep = torch.arange(40, device=CUDA) != 17
    assert torch.equal(out[keep], clean[keep])


@pytest.mark.parametrize("guided", [False, True])
def test_deferred_check_raises_at_the_block_end_naming_the_call_and_row(guided):
    """Inside deferred_finite_checks a NaN row raises no error at its GEMM (the output row is
    NaN, the others are the checked call's bits) but at the block's end, naming the call and
    the row; finite calls in the block pass and give the same bits as immediate checks."""
    _need_triton()
    from libalign.gemm.finite_checks import deferred_finite_checks
    from libalign.guidance import RowGuide

    w = torch.randn(2, 64, 64, dtype=torch.bfloat16, device=CUDA)
    a = _acts(40, 64, seed=1)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    guide = None
    if guided:  # no row present: every row rounds to nearest through the guided pass
        kp, nb = 64, 4
        guide = RowGuide(present=torch.zeros(40, dtype=torch.bool, device=CUDA),
                         index=torch.zeros(40, dtype=torch.int64, device=CUDA),
                         low=torch.zeros(1, kp, dtype=torch.uint8, device=CUDA),
                         block_scales=torch.zeros(1, nb, dtype=torch.uint8, device=CUDA),
                         row_scales=torch.ones(1, dtype=torch.float32, device=CUDA), bits=1)
    clean = gemm.grouped_linear(a, ew, [20, 20], backend="triton", act_guide=guide)
    bad = a.clone()
    bad[23, 5] = float("nan")
    raises = pytest.raises(NonFiniteError, match=r"call 2 of 3.*\(23, 5\)")
    with raises, deferred_finite_checks() as checks:
        first = gemm.grouped_linear(a, ew, [20, 20], backend="triton", act_guide=guide)
        out = gemm.grouped_linear(bad, ew, [20, 20], backend="triton", act_guide=guide)
        gemm.grouped_linear(a, ew, [20, 20], backend="triton", act_guide=guide)
        assert checks.count == 3  # queued, not yet read
        assert torch.equal(first, clean) and torch.isnan(out[23]).all()
        keep = torch.arange(40, device=CUDA) != 23
        assert torch.equal(out[keep], clean[keep])
    with deferred_finite_checks() as checks:
        again = gemm.grouped_linear(a, ew, [20, 20], backend="triton", act_guide=guide)
    assert checks.count == 0 and torch.equal(again, clean)


def test_backward_is_the_bf16_straight_through_product():
    """Gradients of the fused path equal those of the bf16 product of the unquantized operands."""
    _need_triton()
    counts = [64, 0, 100]
    w = torch.randn(3, 128, 64, dtype=torch.bfloat16, device=CUDA, requires_grad=True)
    a = torch.randn(164, 64, dtype=torch.bfloat16, device=CUDA, requires_grad=True)
    g = torch.randn(164, 128, dtype=torch.bfloat16, device=CUDA)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    gemm.grouped_linear(a, ew, counts, backend="triton").backward(g)
    ga, gw = a.grad.clone(), w.grad.clone()
    a.grad = w.grad = None
    gemm.grouped_linear(a, gemm.prepare_weights(w, "bf16"), counts).backward(g)
    assert torch.allclose(ga.float(), a.grad.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(gw.float(), w.grad.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("k", [768, 2048, 1040])
def test_chunked_and_whole_row_activation_passes_agree(k):
    """Walking a row in chunks (two reads) gives the same bits as one whole-row tile."""
    _need_triton()
    from libalign.gemm import triton_kernels as tk

    a = _acts(300, k, seed=k)
    whole = tk.act_qdq(a, amax_floor=1e-12, tensor_amax=None, chunk=0)
    for chunk in (8, 16, 32):
        part = tk.act_qdq(a, amax_floor=1e-12, tensor_amax=None, chunk=chunk)
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1])


@pytest.mark.parametrize("k", [768, 2048])
def test_gathering_pass_equals_the_pass_over_a_padded_copy(k):
    """Reading rows into the padded layout inside the activation pass (``src_rows``) gives the
    bits of the pass over the zero-padded copy, padding rows included, in both kernels."""
    _need_triton()
    from libalign.gemm import triton_kernels as tk

    lay = gemm.group_layout([130, 0, 1, 257, 64, 3], 128)
    a = _acts(lay.total, k, seed=k + 1)
    for chunk in (0, None):
        want = tk.act_qdq(lay.pad(a), amax_floor=None, tensor_amax=None, chunk=chunk)
        got = tk.act_qdq(a, amax_floor=None, tensor_amax=None, chunk=chunk,
                         src_rows=lay.source_rows(a.device))
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def test_pipelined_chunks_give_the_same_bits():
    """Overlapping the activation pass with the GEMM over row chunks changes no output bit."""
    _need_triton()
    counts = [300, 0, 1000, 57, 700]
    w = (torch.randn(5, 512, 256) * 0.02).to(torch.bfloat16).to(CUDA)
    a = _acts(sum(counts), 256, seed=11)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    lay = gemm.group_layout(counts, 128)
    one = triton_grouped.w4a4_grouped_triton(a, ew.path.act_spec, ew.inner, ew.dec, lay, chunks=1)
    for chunks in (2, 3, 7):
        many = triton_grouped.w4a4_grouped_triton(a, ew.path.act_spec, ew.inner, ew.dec, lay, chunks=chunks)
        assert torch.equal(one, many)


def test_prequantized_activations_give_the_fused_bits():
    """Activations quantized outside (the guided path's door) multiply to the fused path's bits."""
    _need_triton()
    counts = [130, 0, 1, 257, 64, 3]
    w = (torch.randn(len(counts), 1536, 2048, device=CUDA) * 0.02).to(torch.bfloat16)
    a = _acts(sum(counts), 2048, seed=11)
    ew = gemm.prepare_weights(w, "nvfp4_trace")
    fused = gemm.grouped_linear(a, ew, counts, backend="triton")
    q = quantize(a, PRESETS["minite"])
    pre = gemm.grouped_linear(a, ew, counts, backend="triton", act_q=q)
    assert torch.equal(fused, pre)


def test_guided_rounding_and_records_on_the_device():
    """Guided quantization and record encode/decode on CUDA give the CPU's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from libalign.guidance import GuidanceRecord, RowGuide, SiteRows, guided_quantize
    from libalign.spec.packing import unpack_nibbles
    from libalign.spec.rounding import low_bits

    x = _acts(300, 2048, seed=5)
    spec = PRESETS["minite"]
    sampler = quantize(x + 0.01 * torch.randn_like(x), spec)
    codes = unpack_nibbles(sampler.codes)
    for bits in (1, 2, 4):
        guide = RowGuide(bits, torch.ones(300, dtype=torch.bool, device=CUDA),
                         torch.arange(300, device=CUDA), low_bits(codes, bits),
                         sampler.block_scales.view(torch.uint8), sampler.outer_scale)
        g_gpu = guided_quantize(x, spec, guide)
        cpu_guide = RowGuide(bits, *(t.cpu() for t in (guide.present, guide.index, guide.low,
                                                        guide.block_scales, guide.row_scales)))
        g_cpu = guided_quantize(x.cpu(), spec, cpu_guide)
        assert g_gpu.to("cpu").bitwise_equal(g_cpu)
        rows = SiteRows(torch.arange(300, dtype=torch.int32, device=CUDA),
                        torch.full((300,), -1, dtype=torch.int16, device=CUDA), codes,
                        sampler.block_scales.view(torch.uint8), sampler.outer_scale, 2048)
        rec = GuidanceRecord(bits, "minite", {(0, "fc1"): rows})
        blob = rec.encode()
        assert blob == GuidanceRecord(bits, "minite", {(0, "fc1"): rows.to("cpu")}).encode()
        back = GuidanceRecord.decode(blob, CUDA).sites[(0, "fc1")]
        assert torch.equal(back.codes, low_bits(codes, bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inner_values_on_the_device_equal_the_cpu_bits(dtype):
    """On CUDA (bf16: the Triton decode, which must build and serve without a warning;
    fp32: the table gather) inner values are the CPU's bit for bit, for every scale and
    code byte and for a stack with padded K; prepared weights carry those values."""
    import warnings

    from libalign.spec import NVFP4Tensor

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = (torch.randn(3, 130, 200) * torch.exp(torch.randn(3, 130, 1) * 4)).to(torch.bfloat16)
    q = quantize(w, PRESETS["minite"])
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 32)
    every = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), torch.ones(256), PRESETS["minite"],
                        (256, 512))
    ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
    from libalign.gemm.triton_grouped import triton_decode

    with warnings.catch_warnings(), triton_decode():
        warnings.simplefilter("error", RuntimeWarning)
        for t in (q, every):
            got = gemm.inner_values(t.to(CUDA), dtype).cpu()
            want = gemm.inner_values(t, dtype)
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan)
            assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])
    ew = gemm.prepare_weights(w.to(CUDA), "nvfp4_minite")
    assert torch.equal(ew.inner.cpu().view(torch.int16),
                       gemm.inner_values(q, torch.bfloat16).view(torch.int16))
