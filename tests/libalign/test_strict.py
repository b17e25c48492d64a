"""Strict execution: sampler decode and learner scoring agree bit for bit; the strict ops are
batch-invariant, accurate, and leave the stock model as it was."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from alignclient.errors import ConfigError, DTypeError, ShapeError, SpecError

from libalign.models import build_model, generate, score_sequences, strict, tiny_config, use_path
from libalign.models.scoring import completion_logprobs, right_padded_batch
from libalign.models.teacher_forcing import replay_decode
from libalign.strict import ops as strict_ops

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(), seed=5)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of different lengths (2..13 tokens; ids 3..14, bos first)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 2 + (i * 5 + seed) % 12
        out.append([1, *torch.randint(3, 15, (length - 1,), generator=g).tolist()])
    return out


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_decode_equals_scoring_on_every_token_for_batch_sizes_1_to_8(model, path):
    """Strict mode: the KV-cached decode (left-padded prompts of different lengths, batch sizes
    1..8) reports the same fp32 bits for every token as the learner's teacher-forced scoring in
    batches of 8 (right-padded) and of 3; the normal mode does not on the same tokens."""
    with strict.use_strict(model):
        for b in range(1, 9):
            prompts = _prompts(b, seed=b)
            assert len({len(p) for p in prompts}) == min(b, 12)
            r = generate(model, prompts, path, max_new_tokens=6, temperature=1.0, seed=b,
                         batch_size=b, eos_id=EOS, pad_id=PAD)
            for learner_batch in (8, 3):
                lp = score_sequences(model, r.sequences, r.prompt_lens, path,
                                     batch_size=learner_batch, pad_id=PAD)
                for i, (x, y) in enumerate(zip(lp, r.logprobs, strict=True)):
                    assert x.numel() == y.numel() > 0
                    assert torch.equal(x, y), (b, learner_batch, i, (x - y).abs().max())
            # the sampler's own teacher-forced replay, in other batches, gives them too
            replay = replay_decode(model, r.sequences, r.prompt_lens, path, batch_size=5,
                                   pad_id=PAD, backend="auto")
            assert all(torch.equal(x, y) for x, y in zip(replay, r.logprobs, strict=True))
    prompts = _prompts(8, seed=8)
    r = generate(model, prompts, path, max_new_tokens=6, temperature=1.0, seed=8, batch_size=8,
                 eos_id=EOS, pad_id=PAD)
    lp = score_sequences(model, r.sequences, r.prompt_lens, path, batch_size=8, pad_id=PAD)
    assert not all(torch.equal(x, y) for x, y in zip(lp, r.logprobs, strict=True))


def test_disable_restores_the_stock_model(model):
    """After use_strict the model's forwards, attention implementation and experts are the
    stock ones again: the same logits bits as before, and nothing strict left on it."""
    ids = torch.tensor([_prompts(3, 1)[2][:8]])
    before = model(input_ids=ids).logits
    impl = model.config._attn_implementation
    with strict.use_strict(model):
        assert strict.is_strict(model)
        assert model.config._attn_implementation == strict.STRICT_ATTENTION
        during = model(input_ids=ids).logits
    assert not strict.is_strict(model)
    assert model.config._attn_implementation == impl
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, before)
    assert (during.float() - before.float()).abs().max() < 0.05


def test_strict_refuses_batch_dependent_scales_and_other_activations(model):
    """nvfp4_naive's per-tensor activation scale has no strict form (SpecError when it runs);
    a model whose activation is not SiLU is refused at enable (ConfigError)."""
    with pytest.raises(SpecError, match="per tensor"):
        strict.check_path("nvfp4_naive")
    with strict.use_strict(model), use_path(model, "nvfp4_naive"), \
            pytest.raises(SpecError, match="batch-invariant"):
        model(input_ids=torch.tensor([[1, 3, 4]]))
    other = build_model(tiny_config(num_hidden_layers=1, hidden_act="gelu"), seed=0)
    with pytest.raises(ConfigError, match="SiLU"):
        strict.enable(other)


def test_learner_gradient_flows_from_the_strict_forward(model):
    """Training on strict log-probs: the loss is the strict forward's (its values equal the
    no-grad scores bitwise) and the gradient (stock backward) points where the normal mode's
    does (cosine over all parameters; per tensor within a loose bound, since a near-tied
    router may pick another expert for a token in one mode)."""
    seqs = [[*p, 5, 6, EOS] for p in _prompts(4, seed=2)]
    plens = [len(s) - 3 for s in seqs]

    def grads(strict_mode: bool):
        model.zero_grad()
        with strict.use_strict(model, strict_mode), use_path(model, "bf16"):
            lp = score_sequences(model, seqs, plens, None, pad_id=PAD)
            ids, mask, _ = right_padded_batch(seqs, range(4), PAD, torch.device("cpu"))
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            lps = completion_logprobs(logits, ids, [len(s) for s in seqs], plens,
                                      strict.log_softmax_for(model))
            torch.stack([x.sum() for x in lps]).sum().backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return lp, [x.detach() for x in lps], g

    lp_s, train_s, g_s = grads(True)
    _, _, g_n = grads(False)
    assert all(torch.equal(a, b) for a, b in zip(lp_s, train_s, strict=True))
    assert set(g_s) == set(g_n) and len(g_s) > 10
    flat_s = torch.cat([g.float().flatten() for g in g_s.values()])
    flat_n = torch.cat([g_n[n].float().flatten() for n in g_s])
    assert torch.isfinite(flat_s).all()
    assert torch.nn.functional.cosine_similarity(flat_s, flat_n, 0) > 0.99
    for name, g in g_s.items():
        ref = g_n[name].float()
        assert (g.float() - ref).norm() <= 0.3 * ref.norm() + 1e-6, name


# --- the ops ----------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.sampled_from([1, 7, 16, 64]), n=st.integers(1, 24),
       seed=st.integers(0, 2**16))
def test_linear_rows_do_not_depend_on_the_other_rows(m, k, n, seed):
    """strict_ops.linear: any row of an [M, K] call equals the same row computed alone and in
    a call with other companions, bit for bit (bf16 in, bf16 out); within a bf16 ulp of fp64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    full = strict_ops.linear(x, w)
    r = seed % m
    assert torch.equal(full[r:r + 1], strict_ops.linear(x[r:r + 1], w))
    other = torch.cat([torch.randn(3, k, generator=g).bfloat16(), x[r:r + 1]])
    assert torch.equal(full[r], strict_ops.linear(other, w)[3])
    ref = (x.double() @ w.double().T)
    assert ((full.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-30).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), shift=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_exp_and_log_are_position_independent_and_accurate(n, shift, seed):
    """exp and log give an element the same bits at any offset and length of the call (the
    vector-lane/scalar-tail split of library versions does not), within 2 ulp of float64."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n + shift, generator=g) * 180 - 100).float()
    e = strict_ops.exp(x)
    assert torch.equal(e[shift:], strict_ops.exp(x[shift:].clone()))
    ref = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps * ref.abs().clamp_min(2.0**-126)
    assert ((e.double() - ref).abs() <= 2 * ulp + 2.0**-149).all()
    pos = x.abs() + 1e-30
    lg = strict_ops.log(pos)
    assert torch.equal(lg[shift:], strict_ops.log(pos[shift:].clone()))
    ref = torch.log(pos.double())
    assert ((lg.double() - ref).abs() <= 2 * torch.finfo(torch.float32).eps * ref.abs()
            + 2e-7).all()


def test_exp_log_special_values():
    """exp: -inf -> 0, +inf and overflow -> inf, NaN -> NaN, subnormal range kept; log: 0 ->
    -inf, negative -> NaN, inf -> inf, subnormals right."""
    x = torch.tensor([-math.inf, math.inf, 89.0, math.nan, -100.0, 0.0])
    e = strict_ops.exp(x)
    assert e[0] == 0 and e[1] == math.inf and e[2] == math.inf and math.isnan(e[3])
    assert e[4] > 0 and abs(float(e[4]) - math.exp(-100)) <= 2.0**-149 and e[5] == 1
    y = torch.tensor([0.0, -1.0, math.inf, 1e-40, 1.0])
    lg = strict_ops.log(y)
    assert lg[0] == -math.inf and math.isnan(lg[1]) and lg[2] == math.inf and lg[4] == 0
    assert abs(float(lg[3]) - math.log(1e-40)) < 1e-4


def test_tree_sum_ignores_trailing_zero_padding_and_topk_breaks_ties_low():
    """tree_sum of x and of x followed by zeros are the same bits; top-k of equal scores picks
    the lower indices first."""
    x = torch.randn(5, 13)
    padded = torch.cat([x, torch.zeros(5, 20)], -1)
    assert torch.equal(strict_ops.tree_sum(x), strict_ops.tree_sum(padded))
    s = torch.tensor([[0.1, 0.5, 0.2, 0.5, 0.5]])
    assert strict_ops.topk_indices(s, 3).tolist() == [[1, 3, 4]]


@pytest.mark.parametrize("scale", [0.0, -0.125, math.inf, math.nan, "0.125"])
def test_device_attention_refuses_a_scale_it_cannot_fold(scale):
    """The device kernel keeps scores in base-2 units with the scale folded into one fused
    multiply-add, which needs a positive finite scale: anything else is refused by name before
    any device is asked for."""
    from alignclient.errors import InputError

    from libalign.strict import attention as strict_attention

    q = torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 3, 16, dtype=torch.bfloat16)
    seen = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    with pytest.raises(InputError, match="softmax scale"):
        strict_attention.attention(q, k, k, seen, scale)


def test_attention_left_and_right_padding_agree():
    """A query's strict attention output is the same bits whether its keys sit right-padded at
    slots 0..t or left-padded behind masked slots (the cache layout)."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 32).bfloat16()
    k = torch.randn(1, 2, 6, 32).bfloat16()
    v = torch.randn(1, 2, 6, 32).bfloat16()
    right = strict_ops.attention(q, k, v, torch.ones(1, 1, 1, 6, dtype=torch.bool), 32**-0.5)
    pad = torch.randn(1, 2, 3, 32).bfloat16()
    kl, vl = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
    allowed = torch.tensor([[[[False] * 3 + [True] * 6]]])
    left = strict_ops.attention(q, kl, vl, allowed, 32**-0.5)
    assert torch.equal(left, right)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1))
    assert (left.float() - ref).abs().max() < 0.02


def test_strict_bits_do_not_depend_on_the_thread_count(model):
    """A sampler decoding with 2 CPU threads and a learner scoring with 1 (separate processes
    may differ so) report the same bits: every strict op is element-wise or an exact max."""
    from libalign.models import cpu_threads

    prompts = _prompts(6, seed=4)
    with strict.use_strict(model):
        with cpu_threads(2):
            r = generate(model, prompts, "nvfp4_minite", max_new_tokens=5, seed=4, batch_size=6,
                         eos_id=EOS, pad_id=PAD)
        with cpu_threads(1):
            lp = score_sequences(model, r.sequences, r.prompt_lens, "nvfp4_minite", batch_size=4,
                                 pad_id=PAD)
    assert all(torch.equal(x, y) for x, y in zip(lp, r.logprobs, strict=True))


def test_modes_refuse_what_they_cannot_keep_invariant(model):
    """Unknown modes, kernels given to the portable mode, the tensor-core kernels asked of a CPU
    tensor and a second enable in another mode are typed errors naming what is wrong."""
    from libalign.strict import tensorcore
    from libalign.strict.device import TensorCoreKernels, op_set

    with pytest.raises(ConfigError, match="fast"):
        op_set("fast")
    with pytest.raises(ConfigError, match="portable"):
        op_set("portable", kernels=TensorCoreKernels())
    with pytest.raises(ConfigError, match=r"strict matmul.*CUDA"):
        tensorcore.matmul(torch.zeros(2, 16, dtype=torch.bfloat16),
                          torch.zeros(4, 16, dtype=torch.bfloat16))
    strict.enable(model, "portable")
    try:
        assert strict.ops_of(model).mode == "portable"
        with pytest.raises(ConfigError, match="portable mode already"):
            strict.enable(model, "device")
        assert strict.enable(model, "portable") is model
    finally:
        strict.disable(model)
    with pytest.raises(ConfigError, match="not in strict mode"):
        strict.ops_of(model)


def test_tile_config_picks_narrow_tiles_where_the_grid_would_be_thin():
    """The tile shape by call size (every shape gives a row the same bits; the GPU tests check
    that): up to 16 rows take 16 x 64 tiles stepping K by 256, against any weight; up to 64
    rows 64 x 64 tiles stepping K by 256, or 64 x 256 against a very wide weight; a call whose
    128 x 128 grid has fewer than two programs per multiprocessor takes 64-row tiles; a large
    call the 128 x 128 tiles; other dtypes are refused by name."""
    from libalign.strict import tensorcore as tc

    bf = torch.bfloat16
    assert tc.tile_config(bf, 8, n=2048, sms=132) == tc.SKINNY_CONFIGS[bf] == (16, 64, 256, 4, 3)
    assert tc.tile_config(bf, 17, n=2048, sms=132) == tc.FEW_ROWS_CONFIGS[bf] == (64, 64, 256, 4, 3)
    assert tc.tile_config(bf, 64, n=151936, sms=132) == tc.WIDE_CONFIGS[bf]
    assert tc.tile_config(bf, 16, n=151936, sms=132) == tc.SKINNY_CONFIGS[bf]
    assert tc.tile_config(bf, 512, n=2048, sms=132) == tc.SMALL_CONFIGS[bf]     # 64 tiles
    assert tc.tile_config(bf, 512, n=151936, sms=132) == tc.CONFIGS[bf]         # 4,748 tiles
    assert tc.tile_config(bf, 4096, n=2048, sms=132) == tc.CONFIGS[bf]          # 512 tiles
    assert tc.tile_config(bf, 300, n=2048, row_tiles=200, sms=132) == tc.CONFIGS[bf]
    for table in (tc.SMALL_CONFIGS, tc.WIDE_CONFIGS, tc.FEW_ROWS_CONFIGS, tc.SKINNY_CONFIGS):
        # K stepped by a multiple of the large tiles' step (the same additions in the same
        # order on the tensor cores); fp32's IEEE products keep the one step
        assert all(table[d][2] % tc.CONFIGS[d][2] == 0 for d in tc.CONFIGS)
        assert table[torch.float32][2] == tc.CONFIGS[torch.float32][2]
    with pytest.raises(DTypeError, match=r"strict matmul.*int8"):
        tc.tile_config(torch.int8, 8)


def test_matmul_refuses_a_tile_config_it_cannot_run_by_name(monkeypatch):
    """A tile configuration is checked before any launch: a dtype no tile serves is a
    DTypeError, a K step that is not a multiple of the kernels' (fp32: not the step itself) a
    ShapeError naming the step."""
    from libalign.strict import tensorcore as tc

    monkeypatch.setattr(tc, "require", lambda op, x: None)
    a = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(DTypeError, match=r"strict matmul.*int8"):
        tc.matmul(a, a, config=(64, 64, 64, 4, 3))
    b = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match="steps K by 32; the kernels' step is 64"):
        tc.matmul(b, b, config=(64, 64, 32, 4, 3))
    f = torch.zeros(4, 64)
    with pytest.raises(ShapeError, match=r"steps K by 64; the kernels' step is 32$"):
        tc.matmul(f, f, config=(64, 64, 64, 4, 3))


def test_grouped_product_tiles_by_rows_per_expert(monkeypatch):
    """A grouped call's tiles follow its rows per expert (as if spread evenly): a decode
    step's few rows take the few-row tiles, up to 256 rows an expert the 64-row tiles, more
    the large-call choice."""
    from libalign.strict import tensorcore as tc

    seen = []
    monkeypatch.setattr(tc, "require", lambda op, x: None)
    monkeypatch.setattr(tc, "_sms", lambda device: 132)
    monkeypatch.setattr(tc, "_launch_matmul", lambda *a, config, **k: seen.append(config))
    bf = torch.bfloat16
    w = torch.zeros(128, 1536, 64, dtype=bf)
    for rows_per_expert in (4, 64, 65, 256, 4096):
        m = 128 * rows_per_expert
        tc.grouped_matmul(torch.zeros(m, 64, dtype=bf), w, [rows_per_expert] * 128,
                          out_dtype=bf)
    assert seen == [tc.SKINNY_CONFIGS[bf], tc.FEW_ROWS_CONFIGS[bf], tc.SMALL_CONFIGS[bf],
                    tc.SMALL_CONFIGS[bf], tc.CONFIGS[bf]]


def test_device_mode_on_a_cpu_is_the_portable_ops():
    """On CPU tensors device mode runs the portable ops: the same bits op for op."""
    from libalign.strict.device import DeviceOps, PortableOps

    dev, port = DeviceOps(), PortableOps()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(24, 64, generator=g).bfloat16()
    q, k = torch.randn(2, 4, 3, 16, generator=g).bfloat16(), torch.randn(2, 2, 3, 16, generator=g)
    seen = torch.ones(2, 1, 3, 3, dtype=torch.bool).tril()
    pairs = [(lambda o: o.linear(x, w)), (lambda o: o.rms_norm(x, w[0], 1e-6)),
             (lambda o: o.softmax(x)), (lambda o: o.log_softmax(x)), (lambda o: o.silu(x)),
             (lambda o: o.topk_indices(x.float(), 3)),
             (lambda o: o.attention(q, k.bfloat16(), k.bfloat16(), seen, 0.25))]
    for fn in pairs:
        assert torch.equal(fn(dev), fn(port))


@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_te_rowact", "nvfp4_te_rowact_4over6"])
def test_strict_experts_scale_by_the_paths_own_epilogue(path):
    """Strict experts on a row-scaled path give the path's own products: TE's row epilogue reads
    the stored maxima and its factor, not the decode-scale product (a mix-up is off by ~1e10)."""
    from libalign import gemm

    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(4, 64, 64, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(4, 64, 32, generator=g) * 0.1).bfloat16()
    h = torch.randn(10, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    wt = torch.full((10, 2), 0.5)
    gu, dn = gemm.prepare_weights(w1, path), gemm.prepare_weights(w2, path)
    ref = gemm.moe_experts_forward(h, idx, wt, gu, dn).float()
    got = strict.experts_forward(h, idx, wt, gu, dn).float()
    assert float((got - ref).norm() / ref.norm()) < 1e-2
