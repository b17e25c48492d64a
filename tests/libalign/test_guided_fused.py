"""Pins guided rounding fused into the GEMM's activation pass to guided_quantize's bits.

On a CUDA device with Triton, ``grouped_linear(a, w, counts, act_guide=guide)`` under
:func:`libalign.gemm.triton_grouped.fused_guidance` must give the bits of ``act_q =
guided_quantize(a, spec, guide)``; elsewhere ``act_guide`` is refused (callers quantize
first, as the Megatron experts do). Without a GPU, ``test_triton_interpreted`` checks the
fused kernel's guided rows in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import NonFiniteError, SpecError

from libalign import gemm
from libalign.gemm import triton_grouped
from libalign.guidance import RowGuide, guided_quantize
from libalign.spec import PRESETS, quantize
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import low_bits

SPEC = PRESETS["minite"]


def _case(m, k, bits, seed, device="cpu", present_share=0.7, random_bits=False, grid=False):
    """Activations, and records of a perturbed copy (some rows absent, some pointing at
    another row's record, or carrying random low bits). ``grid``: values on quarter steps
    in [-6, 6] under records of unit scales (E2M1 midpoints and equidistant matching levels,
    the tie rules' cases)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2))
    x[1] = 0.0
    x = x.to(torch.bfloat16)
    n = max(1, m - 3)
    noisy = x[:n].float() + 0.05 * torch.randn(n, k, generator=g) * x[:n].float().abs().mean()
    sampler = quantize(noisy.to(torch.bfloat16), SPEC)
    codes = unpack_nibbles(sampler.codes)
    low = torch.randint(0, 1 << bits, codes.shape, generator=g, dtype=torch.uint8) if random_bits \
        else low_bits(codes, bits)
    present = torch.rand(m, generator=g) < present_share
    index = torch.randint(0, n, (m,), generator=g)
    index[:n] = torch.arange(n)
    scales, rows = sampler.block_scales.view(torch.uint8), sampler.outer_scale
    if grid:
        x = (torch.randint(-24, 25, (m, k), generator=g).float() / 4).to(torch.bfloat16)
        scales, rows = torch.full_like(scales, 0x38), torch.ones_like(rows)  # E4M3 0x38 is 1.0
        low = torch.randint(0, 1 << bits, codes.shape, generator=g, dtype=torch.uint8)
    guide = RowGuide(bits, present, index, low, scales, rows)
    if device != "cpu":
        guide = RowGuide(bits, *(t.to(device) for t in (guide.present, guide.index, guide.low,
                                                        guide.block_scales, guide.row_scales)))
    return x.to(device), guide


def test_act_guide_is_refused_where_the_pass_does_not_fuse():
    """act_guide needs the fused Triton pass: on the CPU (or with act_q, or on bf16)
    fuses_guidance is False and grouped_linear raises SpecError; callers quantize first."""
    x, guide = _case(6, 32, 2, seed=0)
    w = (torch.randn(2, 8, 32) * 0.05).to(torch.bfloat16)
    ew = gemm.prepare_weights(w, "nvfp4_trace")
    with triton_grouped.fused_guidance(True):
        assert not gemm.fuses_guidance(x, ew, guide)
        assert not gemm.fuses_guidance(x, gemm.prepare_weights(w, "bf16"), guide)
        for kwargs in ({}, {"act_q": quantize(x, SPEC)}):
            with pytest.raises(SpecError, match="act_guide"):
                gemm.grouped_linear(x, ew, [3, 3], act_guide=guide, **kwargs)


def test_fused_guidance_switch_restores_itself():
    """fused_guidance(on) holds inside its block only, and the gap names records of another width."""
    before = triton_grouped.fused_guidance_enabled()
    with triton_grouped.fused_guidance(not before):
        assert triton_grouped.fused_guidance_enabled() is (not before)
    assert triton_grouped.fused_guidance_enabled() is before
    _, guide = _case(6, 32, 2, seed=0)
    assert triton_grouped.triton_guided_gap(SPEC, guide, 32) is None
    assert "width" in triton_grouped.triton_guided_gap(SPEC, guide, 48)
    assert triton_grouped.triton_guided_gap(PRESETS["torchao"], guide, 32) is not None


def _need_triton():
    if not torch.cuda.is_available() or not triton_grouped.triton_gemm_available("cuda"):
        pytest.skip("needs a CUDA device of sm_90+ with Triton")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048)])
def test_fused_guided_pass_gives_the_unfused_bits(bits, k, n):
    """Triton: the fused guided pass multiplies to the bits of guided_quantize then the GEMM,
    with uneven and empty experts, absent rows and random low bits; its inner values and
    decode scales equal the spec's."""
    _need_triton()
    from libalign.gemm import triton_kernels as tk
    from libalign.spec.rounding import e4m3_bits_to_float, guide_tables

    counts = [130, 0, 1, 257, 64, 3]
    w = (torch.randn(len(counts), n, k, device="cuda") * 0.02).to(torch.bfloat16)
    ew = gemm.prepare_weights(w, "nvfp4_trace")
    for random_bits, grid in ((False, False), (True, False), (True, True)):
        x, guide = _case(sum(counts), k, bits, seed=k + bits, device="cuda",
                         random_bits=random_bits, grid=grid)
        want = gemm.grouped_linear(x, ew, counts, backend="triton",
                                   act_q=guided_quantize(x, SPEC, guide))
        with triton_grouped.fused_guidance(True):
            got = gemm.grouped_linear(x, ew, counts, backend="triton", act_guide=guide)
        assert torch.equal(got, want)
        src = torch.where(guide.present, guide.index, -1).to(torch.int32)
        up, down = guide_tables(bits, "cuda")
        inner, dec = tk.guided_act_qdq(
            x, src=src, low=guide.low, block_scales=guide.block_scales,
            row_scales=guide.row_scales.float(), bits=bits, amax_floor=SPEC.amax_floor,
            e4m3=e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8, device="cuda")),
            up=up, down=down)
        q = guided_quantize(x.cpu(), SPEC, RowGuide(bits, *(t.cpu() for t in (
            guide.present, guide.index, guide.low, guide.block_scales, guide.row_scales))))
        assert torch.equal(inner.cpu(), gemm.inner_values(q, torch.bfloat16))
        assert torch.equal(dec.cpu().view(torch.int32), gemm.row_decode_scales(q).view(torch.int32))


@pytest.mark.gpu
def test_fused_guided_pass_raises_on_nan():
    """A NaN activation under fused guidance is the NonFiniteError naming its row."""
    _need_triton()
    x, guide = _case(40, 64, 2, seed=3, device="cuda")
    x[17, 5] = float("nan")
    ew = gemm.prepare_weights(torch.randn(2, 64, 64, dtype=torch.bfloat16, device="cuda"),
                              "nvfp4_trace")
    with triton_grouped.fused_guidance(True), pytest.raises(NonFiniteError, match="17"):
        gemm.grouped_linear(x, ew, [20, 20], backend="triton", act_guide=guide)
