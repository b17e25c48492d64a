"""Pins the fused FP4 K/V read-back (triton_grouped.triton_qdq_rows, through
kv_cache.fused_kv_read and megatron_kv.quantize_heads) to the unfused path's bits.

The unfused path quantizes each head row (``ops.quantize``, or ``guided_quantize`` with the
sampler's records) and reads it back with ``dequantize_kv``; on a CUDA GPU with Triton the
fused pass must give the same values bit for bit (atol=0, compared as integers, so a -0.0
for +0.0 fails too) for kv_nvfp4: plain and guided (every, some or no row with a record,
1, 2 and 4 bits, the sampler's or random low bits), bf16 and fp32, head sizes 64 and 128
(and 80, 144: padded and chunked tiles), a row of zeros; a NaN/Inf raises the same
NonFiniteError; quantize_heads' straight-through gradient is unchanged. Where the pass
cannot serve (CPU, kv_mxfp4, a head size not a multiple of 16, fused guidance or
triton_grouped.fused_kv off, a capture), the unfused path serves. Without a GPU only the CPU
cases run (Triton's interpreter rounds its casts differently from the hardware, so the bit
tests need the GPU).
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import NonFiniteError

from libalign.gemm import triton_grouped
from libalign.guidance import GuidanceCapture, GuidanceTable, RowGuide, guided_quantize
from libalign.kernels import ops
from libalign.models import kv_cache, megatron_kv
from libalign.spec import PRESETS, quantize
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import low_bits

SPEC = PRESETS["kv_nvfp4"]


def _need_triton():
    if not torch.cuda.is_available() or not triton_grouped.triton_gemm_available("cuda"):
        pytest.skip("needs a CUDA device of sm_90+ with Triton")


def _rows(m, d, dtype, seed, device):
    """Head rows over many magnitudes with the special cases: a row of zeros, a zero block,
    a block whose scale underflows next to a large value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)
    x[1] = 0.0
    x[2, :16] = 0.0
    x[3, 5], x[3, 6] = 1e-30, 100.0
    return x.to(dtype).to(device)


def _guide(x, bits, share, seed, random_bits=False):
    """Records of a perturbed copy of ``x``: a ``share`` of rows present (1.0: all, 0.0:
    none), some pointing at another row's record, the sampler's or random low bits."""
    g = torch.Generator().manual_seed(seed)
    m, d = x.shape
    n = max(1, m - 3)
    xc = x.float().cpu()
    noisy = xc[:n] + 0.05 * torch.randn(n, d, generator=g) * xc[:n].abs().mean()
    sampler = quantize(noisy.to(torch.bfloat16), SPEC)
    codes = unpack_nibbles(sampler.codes)
    low = torch.randint(0, 1 << bits, codes.shape, generator=g, dtype=torch.uint8) \
        if random_bits else low_bits(codes, bits)
    present = torch.rand(m, generator=g) < share
    if share == 1.0:
        present[:] = True
    index = torch.randint(0, n, (m,), generator=g)
    index[:n] = torch.arange(n)
    parts = (present, index, low, sampler.block_scales.view(torch.uint8), sampler.outer_scale)
    return RowGuide(bits, *(t.to(x.device) for t in parts))


def _unfused(x, guide):
    """Today's path: quantize (guided where recorded), then dequantize_kv."""
    q = guided_quantize(x, SPEC, guide) if guide is not None else ops.quantize(x, SPEC)
    return kv_cache.dequantize_kv(q, x.dtype)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(_bits(got), _bits(want))  # signed zeros too


def test_fused_read_is_not_used_on_the_cpu():
    """On the CPU fused_kv_read answers None (the unfused path serves) and the gap says why;
    fused_kv(False) holds inside its block only and is named first."""
    x = _rows(8, 64, torch.bfloat16, 0, "cpu")
    assert kv_cache.fused_kv_read(x, SPEC, None) is None
    assert "device" in triton_grouped.triton_qdq_gap(SPEC, None, x)
    with triton_grouped.fused_kv(False):
        assert "off" in triton_grouped.triton_qdq_gap(SPEC, None, x)
    assert "device" in triton_grouped.triton_qdq_gap(SPEC, None, x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 80, 144])
def test_plain_read_back_equals_the_unfused_bits(dtype, d):
    """Round-to-nearest rows: the fused read-back equals ops.quantize + dequantize_kv bitwise."""
    _need_triton()
    x = _rows(300, d, dtype, seed=d, device="cuda")
    got = kv_cache.fused_kv_read(x, SPEC, None)
    assert got is not None
    _assert_same(got, _unfused(x, None))
    assert not bool(got[1].any())  # the row of zeros reads back as zeros


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("share", [1.0, 0.6, 0.0])
def test_guided_read_back_equals_the_unfused_bits(dtype, d, bits, share):
    """Rows with a record rounded by it, the others to nearest, all rows present, some, none;
    the sampler's and random low bits: equal to guided_quantize + dequantize_kv bitwise."""
    _need_triton()
    x = _rows(300, d, dtype, seed=d + bits, device="cuda")
    for random_bits in (False, True):
        guide = _guide(x, bits, share, seed=d * bits, random_bits=random_bits)
        present = int(guide.present.sum())
        assert present == {1.0: 300, 0.0: 0}.get(share, present) and (share != 0.6 or
                                                                     0 < present < 300)
        got = kv_cache.fused_kv_read(x, SPEC, guide)
        assert got is not None
        _assert_same(got, _unfused(x, guide))


@pytest.mark.gpu
@pytest.mark.parametrize("guided", [False, True])
def test_nan_raises_the_unfused_error(guided):
    """NaN/Inf rows raise the NonFiniteError ops.quantize / guided_quantize raise, same text."""
    _need_triton()
    x = _rows(40, 64, torch.bfloat16, seed=3, device="cuda")
    guide = _guide(x, 2, 0.6, seed=4) if guided else None  # records of the finite rows
    x[17, 5], x[20, 1] = float("nan"), float("inf")
    with pytest.raises(NonFiniteError) as want:
        _unfused(x, guide)
    with pytest.raises(NonFiniteError) as got:
        triton_grouped.triton_qdq_rows(x, SPEC, guide)
    assert str(got.value) == str(want.value) and "(17, 5)" in str(got.value)


@pytest.mark.gpu
def test_the_unfused_path_serves_where_the_pass_cannot():
    """kv_mxfp4, a head size of 72, fused guidance off: fused_kv_read answers None and
    triton_qdq_gap names the reason; a capture makes quantize_heads keep the codes."""
    _need_triton()
    x = _rows(16, 64, torch.bfloat16, seed=1, device="cuda")
    assert kv_cache.fused_kv_read(x, PRESETS["kv_mxfp4"], None) is None
    assert "op_order" in triton_grouped.triton_qdq_gap(PRESETS["kv_mxfp4"], None, x)
    assert "K=72" in triton_grouped.triton_qdq_gap(SPEC, None, _rows(16, 72, torch.bfloat16, 1,
                                                                  "cuda"))
    assert "zero" in triton_grouped.triton_qdq_gap(PRESETS["te_row"], None, x)
    guide = _guide(x, 2, 0.6, seed=2)
    with triton_grouped.fused_guidance(False):
        assert kv_cache.fused_kv_read(x, SPEC, guide) is None
        assert "fused guidance" in triton_grouped.triton_qdq_gap(SPEC, guide, x)
    with triton_grouped.fused_kv(False):
        assert kv_cache.fused_kv_read(x, SPEC, None) is None
    assert kv_cache.fused_kv_read(x, SPEC, guide) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_heads_fused_equals_unfused_with_its_gradient(dtype):
    """Megatron's K/V hook on [s, b, heads, head_dim]: plain and guided by a table (one token
    without a key), the fused values equal the unfused path's bitwise, a capture (the
    unfused path) records the same values, and the straight-through gradient is the
    identity either way."""
    _need_triton()
    s, b, h, d = 33, 2, 4, 128
    x = (torch.randn(s, b, h, d, device="cuda") * 3).to(dtype).requires_grad_(True)
    toks = torch.arange(s * b, dtype=torch.int64, device="cuda") << 16
    toks[3] = -1
    cap = GuidanceCapture(PRESETS["minite"])
    noisy = (x.detach().float() * (1 + 0.01 * torch.randn_like(x.detach().float()))).to(dtype)
    megatron_kv.quantize_heads(noisy, SPEC, 0, "k", None, toks, cap)
    table = GuidanceTable(cap.records(2), "cuda")
    weights = torch.randn(s, b, h, d, device="cuda")
    for tbl in (None, table):
        got = megatron_kv.quantize_heads(x, SPEC, 0, "k", tbl, toks)
        rows = x.detach().reshape(-1, d)
        guide = None if tbl is None else tbl.lookup(0, "k", megatron_kv.head_row_keys(toks, x))
        assert guide is None or (bool(guide.present.any()) and not bool(guide.present.all()))
        _assert_same(got, _unfused(rows, guide).reshape(x.shape))
        kept = GuidanceCapture(PRESETS["minite"])
        _assert_same(megatron_kv.quantize_heads(x, SPEC, 0, "k", tbl, toks, kept), got)
        (grad,) = torch.autograd.grad((got.float() * weights).sum(), x)
        assert torch.equal(grad, weights.to(dtype))


# --- the Hugging Face side: a teacher-forced pass's cache keeps values ---------------------------

def test_value_cache_reads_what_the_bits_cache_reads():
    """FP4KVCache(keep_bits=False) (full_sequence_kwargs') returns, over two writes, the bits
    cache's values bitwise with the same straight-through gradient, and holds values."""
    pytest.importorskip("transformers")
    from libalign import models

    model = models.build_model(models.tiny_config(num_hidden_layers=1), seed=0)
    g = torch.Generator().manual_seed(7)
    writes = [(torch.randn(2, 2, t, 32, generator=g) * 4).requires_grad_(True) for t in (5, 1)]
    with kv_cache.use_kv_format(model, "kv_nvfp4"):
        caches = (kv_cache.FP4KVCache(model), kv_cache.FP4KVCache(model, keep_bits=False))
        assert kv_cache.full_sequence_kwargs(model)["use_cache"]
        for x in writes:
            (bk, bv), (vk, vv) = (c.update(x, x * 2, 0) for c in caches)
            _assert_same(vk, bk)
            _assert_same(vv, bv)
            w = torch.randn(bk.shape, generator=g)
            grads = [torch.autograd.grad((k * w + v).sum(), x) for k, v in ((bk, bv), (vk, vv))]
            assert torch.equal(grads[0][0], grads[1][0])
    held = caches[1].layers[0]
    assert held.bits == {"k": None, "v": None} and caches[1].nbytes() == 2 * 2 * 2 * 6 * 32 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("guided", [False, True])
def test_teacher_forced_scores_fused_equal_unfused(guided, monkeypatch):
    """A tiny Qwen3-MoE on the GPU: score_sequences' log-probs with the fused K/V read-back
    (used on every layer's k and v) equal those of the unfused path bitwise, rounding to
    nearest and guided by the sampler's 2-bit K/V records."""
    _need_triton()
    pytest.importorskip("transformers")
    from libalign import models

    task = models.SyntheticTask()
    model = models.build_model(models.tiny_config(num_hidden_layers=2), seed=5, device="cuda")
    cap = GuidanceCapture(PRESETS["minite"])
    with kv_cache.use_kv_format(model, "kv_nvfp4"), kv_cache.capture_kv(model, cap):
        r = models.generate(model, task.prompts(6, 2), "bf16", max_new_tokens=6,
                            eos_id=task.eos_id, pad_id=task.pad_id)
    recs = cap.records(2) if guided else None
    served = []
    fused = kv_cache.fused_kv_read

    def counting(rows, spec, guide):
        out = fused(rows, spec, guide)
        served.append(out is not None and (guide is None or bool(guide.present.any())))
        return out

    scores = {}
    for mode in ("fused", "unfused"):
        monkeypatch.setattr(kv_cache, "fused_kv_read",
                            counting if mode == "fused" else lambda rows, spec, guide: None)
        with kv_cache.use_kv_format(model, "kv_nvfp4"), models.use_kv_guidance(model, recs):
            scores[mode] = models.score_sequences(model, r.sequences, r.prompt_lens, "bf16",
                                                  pad_id=task.pad_id)
    assert served and all(served)
    for got, want in zip(scores["fused"], scores["unfused"], strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
