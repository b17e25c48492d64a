"""Device strict mode on a GPU: the tensor-core kernels keep every row's bits whatever the batch,
decode equals scoring on the tiny model, and the kernels equal SGLang's batch-invariant ops
(``sglang/srt/batch_invariant_ops/batch_invariant_ops.py`` of SGLang 0.5.23) bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from libalign.models import build_model, generate, score_sequences, strict, tiny_config
from libalign.strict import attention as strict_attention
from libalign.strict import tensorcore

from .sglang_batch_invariant import load as load_sglang

pytestmark = pytest.mark.gpu

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def sglang_ops(cuda):
    mod = load_sglang()
    if mod is None:
        pytest.skip("SGLang's batch_invariant_ops.py or Triton is not here")
    return mod


def _rand(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [[1, *torch.randint(3, 15, (1 + (i * 5) % 11,), generator=g).tolist()] for i in range(n)]


@pytest.mark.parametrize("n,k", [(96, 256), (2048, 2048), (151936 // 8, 512), (200, 72)])
def test_matmul_rows_are_invariant(cuda, n, k):
    """Rows computed in batches of 1, 7, 64, 200 and 513 carry the bits they have alone."""
    w = _rand(n, k, scale=k ** -0.5, seed=1)
    bias = _rand(n, seed=2)
    x = _rand(513, k, seed=3)
    full = tensorcore.matmul(x, w)
    fb = tensorcore.matmul(x, w, bias)
    for m in (1, 7, 64, 200):
        assert torch.equal(tensorcore.matmul(x[:m], w), full[:m])
        assert torch.equal(tensorcore.matmul(x[m:m + 3], w), full[m:m + 3])
        assert torch.equal(tensorcore.matmul(x[:m], w, bias), fb[:m])
    f32 = tensorcore.matmul(x, w, out_dtype=torch.float32)
    assert torch.equal(f32[5:6], tensorcore.matmul(x[5:6], w, out_dtype=torch.float32))
    assert torch.equal(f32.bfloat16(), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tile_shapes_give_a_row_the_same_bits(cuda, dtype):
    """The narrow tiles of small calls (SMALL_CONFIGS, FEW_ROWS_CONFIGS) and other output-tile
    shapes, with the same K step or (on the tensor cores) a multiple of it, give every row the
    bits of the large-call configuration."""
    big = tensorcore.CONFIGS[dtype]
    bk = big[2]
    shapes = [(64, 64, bk, 4, 4), (64, 128, bk, 4, 3), (128, 64, bk, 8, 3), (64, 32, bk, 4, 4),
              (128, 256, bk, 8, 3), tensorcore.SMALL_CONFIGS[dtype],
              tensorcore.WIDE_CONFIGS[dtype], tensorcore.FEW_ROWS_CONFIGS[dtype],
              tensorcore.SKINNY_CONFIGS[dtype]]
    if dtype != torch.float32:  # K steps of 128 and 256; the transposed product of few rows
        shapes += [(64, 128, 2 * bk, 4, 3), (64, 32, 4 * bk, 4, 3), (16, 128, 4 * bk, 4, 3),
                   (32, 64, 4 * bk, 4, 3), (16, 32, bk, 4, 4)]
    for n, k in ((2048, 2048), (1000, 72), (384, 768)):
        w = _rand(n, k, scale=k ** -0.5, seed=30, dtype=dtype)
        x = _rand(200, k, seed=31, dtype=dtype)
        ref = tensorcore.matmul(x, w, config=big)
        for cfg in shapes:
            assert torch.equal(tensorcore.matmul(x, w, config=cfg), ref), cfg
            assert torch.equal(tensorcore.matmul(x[:8], w, config=cfg), ref[:8]), cfg


def test_grouped_matmul_equals_each_experts_matmul(cuda):
    """One grouped launch gives every row the bits of the plain product of its expert alone;
    the NVFP4 epilogue is gemm.epilogue's DEC_PRODUCT order."""
    from libalign import gemm

    e, n, k = 6, 192, 256
    w = _rand(e, n, k, scale=k ** -0.5, seed=4)
    counts = [0, 1, 130, 7, 0, 300]
    a = _rand(sum(counts), k, seed=5)
    a_dec = _rand(sum(counts), seed=6, dtype=torch.float32).abs()
    w_dec = _rand(e, n, seed=7, dtype=torch.float32).abs()
    few = [3, 0, 64, 9]  # a decode step's few rows per expert: the narrow tiles
    small = tensorcore.grouped_matmul(a[:76], w[:4], few, out_dtype=torch.bfloat16)
    assert torch.equal(small[67:76], tensorcore.matmul(a[67:76], w[3], out_dtype=torch.bfloat16))
    assert torch.equal(small[3:67], tensorcore.matmul(a[3:67], w[2]))
    got = tensorcore.grouped_matmul(a, w, counts, out_dtype=torch.bfloat16)
    scaled = tensorcore.grouped_matmul(a, w, counts, out_dtype=torch.bfloat16, a_dec=a_dec,
                                       w_dec=w_dec)
    lo = 0
    for ex, c in enumerate(counts):
        rows = slice(lo, lo + c)
        for r in range(lo, lo + c, 37):
            assert torch.equal(got[r:r + 1], tensorcore.matmul(a[r:r + 1], w[ex]))
        acc = tensorcore.matmul(a[rows], w[ex], out_dtype=torch.float32)
        assert torch.equal(scaled[rows], gemm.epilogue(acc, a_dec[rows], w_dec[ex]))
        lo += c


def test_row_kernels_are_invariant(cuda):
    """mean_last and log_softmax: a row alone equals the row in a batch of 300."""
    x = _rand(300, 2048, seed=8, dtype=torch.float32)
    v = _rand(300, 151936 // 4, scale=3.0, seed=9, dtype=torch.float32)
    m, ls = tensorcore.mean_last(x), tensorcore.log_softmax(v)
    for r in (0, 17, 299):
        assert torch.equal(tensorcore.mean_last(x[r:r + 1]), m[r:r + 1])
        assert torch.equal(tensorcore.log_softmax(v[r:r + 1]), ls[r:r + 1])
    # a batch of at most SPLIT_ROWS rows runs the split kernels: the same bits
    small = tensorcore.SPLIT_ROWS
    assert torch.equal(tensorcore.log_softmax(v[:small]), ls[:small])
    ref = torch.log_softmax(v.double(), -1)
    assert float((ls.double() - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16),
                                             (torch.float32, torch.bfloat16)])
def test_rms_norm_equals_its_steps(cuda, x_dtype, w_dtype):
    """The three-launch RMSNorm gives the bits of its steps as separate PyTorch ops (squares,
    the strict mean, + eps, rsqrt, scale, rounding, weight), for a layer's rows and for
    per-head rows of 128, with the output dtype PyTorch's promotion gives."""
    for shape, seed in (((300, 2048), 40), ((4, 7, 32, 128), 41)):
        x = _rand(*shape, scale=2.0, seed=seed, dtype=x_dtype)
        x[0, :5] = 0
        w = (1 + _rand(shape[-1], scale=0.1, seed=seed + 1)).to(w_dtype)
        xf = x.float()
        want = w * (xf * torch.rsqrt(tensorcore.mean_last(xf * xf) + 1e-6)).to(x_dtype)
        got = tensorcore.rms_norm(x, w, 1e-6)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_rms_norm_in_one_launch_equals_its_three(cuda):
    """Rows 16-aligned in width and address take the one-launch RMSNorm; its bits are the
    three launches' (the squares summed in _mean_kernel's order), for a layer's rows, per-head
    rows, a width past one chunk, fp16 and fp32 inputs; an unaligned view takes the three."""
    def three(t):
        return tensorcore.mean_last(t)

    for shape, dtype, seed in (((300, 2048), torch.bfloat16, 60), ((4, 7, 32, 128), torch.bfloat16, 61),
                               ((33, 1040), torch.float16, 62), ((9, 2048), torch.float32, 63)):
        x = _rand(*shape, scale=2.0, seed=seed, dtype=dtype)
        w = 1 + _rand(shape[-1], scale=0.1, seed=seed + 1)
        assert torch.equal(tensorcore.rms_norm(x, w, 1e-6), tensorcore.rms_norm(x, w, 1e-6, three))
    x = _rand(8, 2049, seed=64)[:, 1:]  # 2-byte offset: the three launches
    w = 1 + _rand(2048, scale=0.1, seed=65)
    assert torch.equal(tensorcore.rms_norm(x, w, 1e-6), tensorcore.rms_norm(x, w, 1e-6, three))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequential_sum_equals_the_portable_sum(cuda, dtype):
    """The one-launch left-to-right sum gives the portable sum's bits over the last dimension
    (a router's top-k) and a middle one, -0.0 included."""
    from libalign.strict import ops as portable

    for shape, dim in (((2048, 8), -1), ((40, 8, 300), 1)):
        x = _rand(*shape, scale=2.0, seed=50, dtype=dtype)
        x.view(-1)[:3] = -0.0
        got, want = tensorcore.sequential_sum(x, dim), portable.sequential_sum(x, dim)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_rows_equals_the_portable_combine(cuda, dtype):
    """The MoE output kernel gives the bits of the portable weighted sum (products rounded to
    the rows' dtype, fp32 sum in slot order from 0, one rounding), -0.0 included, for the
    hidden dtype and fp32 outputs."""
    from libalign.strict import ops as portable

    t, k, h = 300, 8, 2048 + 48
    y = _rand(t * k, h, scale=3.0, seed=30, dtype=dtype)
    y[:k, :4] = -0.0
    order = torch.randperm(t * k, generator=torch.Generator().manual_seed(31)).cuda()
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(t * k, device="cuda")
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(32)).cuda()
    for out_dtype in (dtype, torch.float32):
        got = tensorcore.combine_rows(y, slot_of, w, out_dtype)
        want = portable.combine_experts(y, slot_of, w, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("shape", [(2, 1, 40, 40), (1, 3, 7, 150), (3, 1, 1, 1030),
                                   (4, 1, 512, 512), (2, 2, 9, 1)])
@pytest.mark.parametrize("tile", [(2048, 4), (64, 1), (8192, 8)])
def test_visible_range_is_exact(cuda, shape, tile, monkeypatch):
    """Each mask row's first visible key, end and count, and the mask packed 64 keys a word
    with one zero word after, are exact whatever the rows a program takes (VISIBLE_TILE), for
    a dense mask and for views read through their strides (sliced keys, broadcast sequences
    and queries)."""
    monkeypatch.setattr(strict_attention, "VISIBLE_TILE", tile)
    b, hm, tq, tk = shape
    g = torch.Generator().manual_seed(sum(shape))
    allowed = (torch.rand(b, hm, tq, tk, generator=g) > 0.4).cuda()
    allowed[0, 0, 0] = False  # a row that sees nothing
    for view in (allowed[..., :max(1, tk - 3)], allowed[:1].expand(b, hm, tq, tk),
                 allowed[:, :, :1].expand(b, hm, tq, tk)):  # read through strides, not copied
        _check_visible(view)
    _check_visible(allowed)


def _check_visible(allowed):
    first, hi, count, bits = strict_attention.visible_range(allowed)
    tk = allowed.shape[-1]
    rows = allowed.reshape(-1, tk).cpu()
    idx = torch.arange(tk)
    assert torch.equal(first.flatten().cpu(), torch.where(rows, idx, tk).amin(1).int())
    assert torch.equal(hi.flatten().cpu(), torch.where(rows, idx + 1, 0).amax(1).int())
    assert torch.equal(count.flatten().cpu(), rows.sum(1).int())
    assert bits.shape == (rows.shape[0], (tk + 63) // 64 + 1)
    unpacked = ((bits.cpu()[:, :, None] >> torch.arange(64)) & 1).reshape(rows.shape[0], -1)
    assert torch.equal(unpacked[:, :tk].bool(), rows) and not bool(unpacked[:, tk:].any())


@pytest.mark.parametrize("t,lens", [(150, [150, 97, 1]), (600, [600, 300, 257]),
                                    (512, [512, 320, 64])])
def test_attention_decode_equals_prefill(cuda, t, lens):
    """A prompt left-padded in a cache, attended one query at a time, gives the bits of the same
    tokens right-padded in a causal batch (blocks counted from the first visible key; rows
    past the key chunk combine their chunks in order; a prefill of whole query tiles launches
    its tiles in another order)."""
    b, hq, hkv, d = 3, 8, 2, 128
    q, k, v = _rand(b, hq, t, d, seed=10), _rand(b, hkv, t, d, seed=11), _rand(b, hkv, t, d, seed=12)
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    allowed = torch.zeros(b, 1, t, t, dtype=torch.bool, device="cuda")
    for i, n in enumerate(lens):
        allowed[i, 0, :n, :n] = causal[:n, :n]
    full = strict_attention.attention(q, k, v, allowed, d ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
        attn_mask=allowed)
    for i, n in enumerate(lens):
        assert float((full[i, :, :n].float() - ref[i, :, :n]).abs().max()) < 2e-2
        pad = t - n  # left-padded cache of the same tokens
        kc = torch.zeros(1, hkv, t, d, dtype=k.dtype, device="cuda")
        vc = torch.zeros_like(kc)
        kc[0, :, pad:], vc[0, :, pad:] = k[i, :, :n], v[i, :, :n]
        for pos in sorted({0, n // 2, n - 1, 255, 256} & set(range(n))):
            seen = torch.zeros(1, 1, 1, t, dtype=torch.bool, device="cuda")
            seen[..., pad:pad + pos + 1] = True
            one = strict_attention.attention(q[i:i + 1, :, pos:pos + 1], kc, vc, seen, d ** -0.5)
            assert torch.equal(one[0, :, 0], full[i, :, pos])
    per_head = allowed.expand(b, hq, t, t).clone()
    per_head[:, 5] = False  # a mask per query head: head 5 sees nothing
    heads = strict_attention.attention(q, k, v, per_head, d ** -0.5)
    assert bool((heads[:, 5] == 0).all())
    assert torch.equal(heads[:, :5], full[:, :5]) and torch.equal(heads[:, 6:], full[:, 6:])
    holed = allowed.clone()
    holed[0, 0, :, 20:40] = False  # rows past key 40 see two intervals: the mask is read
    got = strict_attention.attention(q, k, v, holed, d ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
        attn_mask=holed)
    assert float((got[0, :, :150].float() - want[0, :, :150]).abs().max()) < 2e-2
    assert torch.equal(got[1:], full[1:])
    empty = k[:, :, :0]  # no keys at all: every query gets zeros
    none = strict_attention.attention(q, empty, empty, allowed[..., :0], d ** -0.5)
    assert none.shape == q.shape and bool((none == 0).all())


def test_kernels_run_in_a_cuda_graph(cuda):
    """The dense strict ops capture into a CUDA graph and replay to the eager bits."""
    x, w = _rand(8, 512, seed=13), _rand(1024, 512, scale=0.05, seed=14)
    q, k = _rand(2, 4, 1, 64, seed=15), _rand(2, 4, 40, 64, seed=16)
    seen = torch.ones(2, 1, 1, 40, dtype=torch.bool, device="cuda")

    def step():
        h = tensorcore.matmul(x, w)
        return tensorcore.log_softmax(h.float()), strict_attention.attention(q, k, k, seen, 0.125)

    want = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm: compile outside the capture
        with torch.cuda.graph(graph, stream=stream):
            got = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_expert_layer_reads_nothing_back_and_runs_in_a_cuda_graph(cuda):
    """Device mode's MoE experts keep the routing on the GPU: the grouped product takes the
    counts as a tensor (its tile table built on the device), so the layer runs with
    synchronising calls forbidden, captures into a CUDA graph, and gives the bits of the
    grouped product with the counts given as a list."""
    from libalign import gemm
    from libalign.strict.device import op_set

    e, hid, inter, t, k = 8, 256, 128, 40, 2
    w1 = _rand(e, 2 * inter, hid, scale=hid ** -0.5, seed=20)
    w2 = _rand(e, hid, inter, scale=inter ** -0.5, seed=21)
    gu, dn = gemm.prepare_weights(w1, "bf16"), gemm.prepare_weights(w2, "bf16")
    h = _rand(t, hid, seed=22)
    idx = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(23)).cuda()
    idx[:, 1] = (idx[:, 0] + 1) % e
    wt = torch.rand(t, k, generator=torch.Generator().manual_seed(24)).cuda()
    ops = op_set("device")

    def layer():
        return strict.experts_forward(h, idx, wt, gu, dn, ops=ops)

    want = layer()
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    a = _rand(int(counts.sum()), hid, seed=25)
    listed = tensorcore.grouped_matmul(a, w1, counts.tolist(), out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = layer()
        on_device = tensorcore.grouped_matmul(a, w1, counts, out_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, want) and torch.equal(on_device, listed)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer()
        with torch.cuda.graph(graph, stream=stream):
            got = layer()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_device_strict_decode_equals_scoring(cuda, path):
    """Device mode on the tiny model: every decode-time log-prob equals the teacher-forced one
    bitwise, for batch sizes 1, 3 and 8 and prompts of different lengths."""
    dev = build_model(tiny_config(), seed=7).to(cuda)
    with strict.use_strict(dev, mode="device"):
        for b in (1, 3, 8):
            r = generate(dev, _prompts(b), path, max_new_tokens=6, seed=b, batch_size=b,
                         eos_id=EOS, pad_id=PAD)
            lp = score_sequences(dev, r.sequences, r.prompt_lens, path, batch_size=8, pad_id=PAD)
            for x, y in zip(lp, r.logprobs, strict=True):
                assert torch.equal(x, y)


def test_kernels_equal_sglangs(sglang_ops):
    """libalign's matmul, mean and log_softmax give the bits of SGLang's matmul_persistent,
    mean_dim and log_softmax (its Triton kernels, DeepGEMM off)."""
    for (m, n, k), seed in zip([(1, 96, 64), (37, 256, 64), (512, 2048, 2048), (8, 19000, 2048),
                                (300, 200, 72)], range(20, 30), strict=False):
        a, w = _rand(m, k, seed=seed), _rand(n, k, scale=k ** -0.5, seed=seed + 100)
        bias = _rand(n, seed=seed + 200)
        assert torch.equal(tensorcore.matmul(a, w), sglang_ops.matmul_persistent(a, w.t()))
        assert torch.equal(tensorcore.matmul(a, w, bias),
                           sglang_ops.matmul_persistent(a, w.t(), bias=bias))
        assert torch.equal(tensorcore.matmul(a, w, out_dtype=torch.float32),
                           sglang_ops.matmul_persistent(a, w.t(), out_dtype=torch.float32))
    for width in (128, 1000, 2048, 151936):
        for rows in (1, 33, tensorcore.SPLIT_ROWS + 7):  # the split kernels and the row kernel
            x = _rand(rows, width, scale=3.0, seed=width, dtype=torch.float32)
            assert torch.equal(tensorcore.mean_last(x * x), sglang_ops.mean_dim(x * x, -1, True))
            assert torch.equal(tensorcore.log_softmax(x), sglang_ops.log_softmax(x, -1))


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_sglang_sampler_equals_libalign_learner(sglang_ops, path):
    """A sampler decoding on SGLang's batch-invariant ops (alignd.integrations.sglang_strict)
    and libalign's device-strict learner scoring on its own kernels give equal log-probs on
    every token of the tiny model (atol = 0)."""
    from alignd.integrations.sglang_strict import SGLangKernels

    sampler = build_model(tiny_config(), seed=7).to("cuda")
    learner = build_model(tiny_config(), seed=7).to("cuda")
    with strict.use_strict(sampler, kernels=SGLangKernels(sglang_ops)), strict.use_strict(learner):
        for b in (1, 5):
            r = generate(sampler, _prompts(b), path, max_new_tokens=8, seed=b, batch_size=b,
                         eos_id=EOS, pad_id=PAD)
            lp = score_sequences(learner, r.sequences, r.prompt_lens, path, batch_size=8,
                                 pad_id=PAD)
            for x, y in zip(lp, r.logprobs, strict=True):
                assert torch.equal(x, y)
