"""Pins the W4A4 expert GEMM's definition: inner values, epilogue order, grouping, STE, paths.

The reference is checked against an independent float64 computation from the spec's own
dequantization; the CPU backend against the reference (addition order only); grouping
against per-expert 2-D products; padding and empty experts as no-ops; the MoE block's
bf16 path against Hugging Face's eager expert loop.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import DTypeError, NonFiniteError, ShapeError, SpecError
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign import gemm
from libalign.spec import PRESETS, dequantize, quantize


def _w(e, n, k, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=g) * scale).to(torch.bfloat16)


def _a(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x.to(torch.bfloat16)


def test_inner_values_are_exact_in_bf16_and_times_outer_equal_dequantize():
    """q*s survives a bf16 round trip exactly, and (q*s)*dec is the spec's te dequantization."""
    x = _a(40, 96)
    q = quantize(x, PRESETS["minite"])
    inner = gemm.inner_values(q)
    assert torch.equal(inner.to(torch.bfloat16).float(), inner)
    rebuilt = inner * gemm.row_decode_scales(q).unsqueeze(-1)
    assert torch.equal(rebuilt, dequantize(q))


def _field_by_field(q, dtype):
    """Inner values decoded field by field: each code's E2M1 value times its block's E4M3 value."""
    from libalign.spec.packing import unpack_nibbles
    from libalign.spec.rounding import e2m1_code_values, e4m3_bits_to_float

    vals = e2m1_code_values(unpack_nibbles(q.codes))
    s32 = e4m3_bits_to_float(q.block_scales)
    return (vals.unflatten(-1, (-1, 16)) * s32.unsqueeze(-1)).flatten(-2)[..., : q.k].to(dtype)


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_inner_values_table_reproduces_every_scale_and_code_byte(dtype):
    """The gathered inner values equal the field-by-field decode bit for bit (signed zeros
    included) for all 256 x 256 scale and code bytes; the two NaN scale bytes give NaN."""
    from libalign.spec import NVFP4Tensor

    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row s: every code byte
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 32)
    q = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), torch.ones(256), PRESETS["minite"],
                    (256, 512))
    got, want = gemm.inner_values(q, dtype), _field_by_field(q, dtype)
    assert got.dtype == dtype and got.shape == want.shape == (256, 512)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and int(nan.any(-1).sum()) == 2
    ints = _INT_OF[got.element_size()]
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])


@settings(max_examples=25, deadline=None)
@given(e=st.integers(1, 3), n=st.integers(1, 9), k=st.integers(1, 70), seed=st.integers(0, 2**16),
       preset=st.sampled_from(["minite", "te", "torchao", "modelopt"]))
def test_inner_values_of_quantized_stacks_match_the_field_decode(e, n, k, seed, preset):
    """Stacks of any K (padded blocks sliced off) and any preset: the same bits as the
    field-by-field decode, in fp32 and bf16."""
    spec = PRESETS[preset]
    k = k if spec.k_remainder == "pad" else 16 * (k // 16 + 1)
    w = _w(e, n, k, seed=seed, scale=2.0 ** (seed % 41 - 20))
    q = quantize(w, spec)
    for dtype in (torch.float32, torch.bfloat16):
        got = gemm.inner_values(q, dtype)
        assert got.shape == (e, n, k)
        assert torch.equal(got.view(_INT_OF[got.element_size()]),
                           _field_by_field(q, dtype).view(_INT_OF[got.element_size()]))


def test_inner_values_refuse_mxfp4():
    """E8M0 scales per 32 values are not the NVFP4 inner values' input: DTypeError."""
    q = quantize(_a(4, 64), PRESETS["mxfp4"])
    with pytest.raises(DTypeError, match="E4M3"):
        gemm.inner_values(q)


def test_reference_follows_the_documented_epilogue_order():
    """out = bf16(fl(acc * fl(a_dec * w_dec))) with acc the float64 sum rounded once to fp32."""
    a, w = _a(9, 64), _w(1, 7, 64)[0]
    qa, qw = quantize(a, PRESETS["minite"]), quantize(w, PRESETS["minite"])
    acc = (gemm.inner_values(qa).double() @ gemm.inner_values(qw).double().T).float()
    alpha = gemm.row_decode_scales(qa)[:, None] * gemm.row_decode_scales(qw)[None, :]
    want = (acc * alpha).to(torch.bfloat16)
    assert torch.equal(gemm.w4a4_reference(qa, qw), want)


def test_per_tensor_and_per_expert_scales_broadcast():
    """Decode scales of tensor- and expert-domain operands broadcast to every row."""
    w = _w(3, 8, 32)
    q = quantize(w, PRESETS["te"].replace(outer_domain="expert"))
    dec = gemm.row_decode_scales(q)
    assert dec.shape == (3, 8) and torch.equal(dec[:, 0], q.outer_dec)
    qt = quantize(w[0], PRESETS["te"])
    assert torch.equal(gemm.row_decode_scales(qt), qt.outer_dec.expand(8))


@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_naive"])
def test_grouped_reference_equals_per_expert_products(path):
    """The grouped reference is the 2-D reference of each expert's rows; empty experts are fine."""
    counts = [3, 0, 11, 1, 0]
    w, a = _w(5, 24, 48), _a(sum(counts), 48)
    ew = gemm.prepare_weights(w, path)
    out = gemm.grouped_linear(a, ew, counts, backend="reference")
    spec = gemm.get_path(path).act_spec
    qa = quantize(a, spec)
    lo = 0
    for e, c in enumerate(counts):
        if c:  # a tensor-domain scale covers all rows; row scales are each row's own
            qa_e = _rows(qa, lo, lo + c) if spec.outer_domain == "tensor" else quantize(a[lo:lo + c], spec)
            assert torch.equal(out[lo:lo + c], gemm.w4a4_reference(qa_e, ew.q.expert(e)))
        lo += c


def _rows(q, lo, hi):
    """Rows lo:hi of a tensor-domain quantized matrix (same outer scale)."""
    from libalign.spec import NVFP4Tensor

    return NVFP4Tensor(q.codes[lo:hi], q.block_scales[lo:hi], q.outer_scale, q.spec,
                       (hi - lo, q.shape[1]), q.outer_amax)


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_cpu_backend_within_one_bf16_ulp_of_reference(counts, seed):
    """fp32-matmul accumulation differs from the float64 reference by at most one bf16 ulp."""
    k, n = 64, 16
    w, a = _w(len(counts), n, k, seed), _a(sum(counts), k, seed + 1)
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    ref = gemm.grouped_linear(a, ew, counts, backend="reference")
    got = gemm.grouped_linear(a, ew, counts, backend="torch")
    ax = ref.float().abs().clamp(min=2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(ax)) - 7)
    assert bool(((got.float() - ref.float()).abs() <= ulp).all())


@pytest.mark.parametrize("pad", [64, 128])
def test_padding_and_layout_round_trip(pad):
    """pad() puts rows at 64/128-aligned expert starts with zero padding; unpad() inverts it."""
    counts = [5, 0, 130, 1]
    lay = gemm.group_layout(counts, pad)
    assert all(c % pad == 0 for c in lay.padded_counts)
    assert lay.padded_counts[1] == 0
    x = torch.arange(sum(counts) * 2, dtype=torch.float32).reshape(-1, 2) + 1
    p = lay.pad(x)
    assert p.shape[0] == lay.padded_total and int((p == 0).all(1).sum()) == lay.padded_total - 136
    assert torch.equal(lay.unpad(p), x)
    tiles = lay.tile_expert(pad)
    assert tiles.tolist() == [e for e, c in enumerate(lay.padded_counts) for _ in range(c // pad)]


def test_row_map_is_the_documented_example():
    """counts (3, 0, 130) padded to 128: rows 0-2 stay, rows 3-132 move to 128-257."""
    lay = gemm.group_layout([3, 0, 130], 128)
    assert lay.row_map().tolist() == [0, 1, 2, *range(128, 258)]
    assert lay.tile_expert(128).tolist() == [0, 2, 2]
    assert gemm.group_layout([0, 4, 2], 1).row_map().tolist() == list(range(6))


def test_source_rows_invert_the_row_map():
    """Each padded row names the row it holds, -1 for padding: gathering by it is ``pad``."""
    lay = gemm.group_layout([3, 0, 130], 128)
    src = lay.source_rows()
    assert src.dtype == torch.int32 and src.shape == (lay.padded_total,)
    assert src.tolist() == [0, 1, 2, *[-1] * 125, *range(3, 133), *[-1] * 126]
    a = _a(lay.total, 32)
    gathered = torch.where((src >= 0)[:, None], a[src.clamp(min=0).long()], 0)
    assert torch.equal(gathered, lay.pad(a))


def test_zero_rows_do_not_change_a_result():
    """Zero padding rows leave per-tensor and per-row results unchanged (max of |x| is unmoved)."""
    counts = [4, 6]
    w, a = _w(2, 16, 32), _a(10, 32)
    lay = gemm.group_layout(counts, 64)
    for path in ("nvfp4_minite", "nvfp4_naive"):
        ew = gemm.prepare_weights(w, path)
        plain = gemm.grouped_linear(a, ew, counts, backend="reference")
        padded = gemm.grouped_linear(lay.pad(a), ew, lay.padded_counts, backend="reference")
        assert torch.equal(lay.unpad(padded), plain)


def test_backward_is_straight_through_bf16():
    """Gradients equal the bf16 product's of the unquantized operands, for every path."""
    counts = [3, 0, 5]
    grads = []
    for path in ("bf16", "nvfp4_minite", "nvfp4_naive"):
        w = _w(3, 16, 32).requires_grad_(True)
        a = _a(8, 32).requires_grad_(True)
        out = gemm.grouped_linear(a, gemm.prepare_weights(w, path), counts)
        out.backward(torch.ones_like(out))
        grads.append((a.grad.clone(), w.grad.clone()))
    w0, a0 = _w(3, 16, 32), _a(8, 32)
    want_a = torch.cat([torch.ones(3, 16, dtype=torch.bfloat16) @ w0[0],
                        torch.ones(5, 16, dtype=torch.bfloat16) @ w0[2]])
    for ga, gw in grads:
        assert torch.equal(ga, want_a)
        assert torch.equal(gw[1], torch.zeros_like(gw[1]))
        assert torch.equal(gw[0], (torch.ones(3, 16, dtype=torch.bfloat16).T @ a0[:3]))


def test_quantized_forward_differs_from_bf16_but_stays_close():
    """NVFP4 paths really quantize (outputs differ) yet stay within a few percent of bf16."""
    counts = [32, 32]
    w, a = _w(2, 64, 256), _a(64, 256)
    base = gemm.grouped_linear(a, gemm.prepare_weights(w, "bf16"), counts).float()
    for path in ("nvfp4_minite", "nvfp4_naive"):
        out = gemm.grouped_linear(a, gemm.prepare_weights(w, path), counts).float()
        rel = float((out - base).norm() / base.norm())
        assert 0.01 < rel < 0.3, (path, rel)


def test_bad_input_is_named():
    """Unknown paths, wrong shapes and dtypes, NaN activations and weights: typed errors."""
    w, a = _w(2, 8, 32), _a(5, 32)
    with pytest.raises(SpecError, match="nvfp4_bogus"):
        gemm.get_path("nvfp4_bogus")
    with pytest.raises(ShapeError, match="3-D"):
        gemm.prepare_weights(w[0], "nvfp4_minite")
    with pytest.raises(DTypeError):
        gemm.prepare_weights(w.to(torch.int32), "bf16")
    ew = gemm.prepare_weights(w, "nvfp4_minite")
    with pytest.raises(ShapeError, match="sum to 4"):
        gemm.grouped_linear(a, ew, [2, 2])
    with pytest.raises(ShapeError, match="K=16"):
        gemm.grouped_linear(a[:, :16], ew, [2, 3])
    with pytest.raises(ShapeError, match="3 experts"):
        gemm.grouped_linear(a, ew, [2, 3, 0])
    bad = a.clone()
    bad[2, 7] = float("nan")
    with pytest.raises(NonFiniteError):
        gemm.grouped_linear(bad, ew, [2, 3])
    wbad = w.clone()
    wbad[1, 3, 3] = float("inf")
    with pytest.raises(NonFiniteError):
        gemm.prepare_weights(wbad, "nvfp4_naive")
    with pytest.raises(SpecError, match="pad_to"):
        gemm.group_layout([1, 2], 32)
    with pytest.raises(SpecError, match="backend"):
        gemm.grouped_linear(a, ew, [2, 3], backend="cuda-magic")
    with pytest.raises(SpecError, match="triton"):
        gemm.grouped_linear(a, ew, [2, 3], backend="triton")


def test_cpu_backends_raise_on_nan_even_unchecked():
    """check_finite=False concerns the Triton backend only: torch and reference still raise."""
    a = _a(8, 32)
    a[3, 1] = float("nan")
    ew = gemm.prepare_weights(_w(2, 16, 32), "nvfp4_minite")
    for backend in ("torch", "reference"):
        with pytest.raises(NonFiniteError):
            gemm.grouped_linear(a, ew, [4, 4], backend=backend, check_finite=False)


def test_paths_reject_what_the_gemm_cannot_do():
    """Hadamard or stochastic specs, half-quantized paths and expert-domain activations."""
    m = PRESETS["minite"]
    with pytest.raises(SpecError, match="Hadamard"):
        gemm.ExecutionPath("x", m.replace(hadamard=True), m)
    with pytest.raises(SpecError, match="both operands"):
        gemm.ExecutionPath("x", m, None)
    with pytest.raises(SpecError, match="activation outer domain"):
        gemm.ExecutionPath("x", m, m.replace(outer_domain="expert"))
    gemm.register_path(gemm.ExecutionPath("nvfp4_test_only", m, m))
    try:
        assert gemm.get_path("nvfp4_test_only").quantized
    finally:
        gemm.PATHS.pop("nvfp4_test_only")


def test_moe_block_bf16_path_matches_transformers_eager():
    """The bf16 path of moe_experts_forward equals Hugging Face's Qwen3-MoE expert loop."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    h = torch.randn(1, 37, 64, dtype=torch.bfloat16)
    want = block(h).reshape(37, 64)
    _, weights, idx = block.gate(h.reshape(37, 64))
    ex = block.experts
    got = gemm.moe_experts_forward(h.reshape(37, 64), idx, weights,
                                   gemm.prepare_weights(ex.gate_up_proj, "bf16"),
                                   gemm.prepare_weights(ex.down_proj, "bf16"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    seen = {}
    gemm.moe_experts_forward(h.reshape(37, 64), idx, weights,
                             gemm.prepare_weights(ex.gate_up_proj, "nvfp4_minite"),
                             gemm.prepare_weights(ex.down_proj, "nvfp4_minite"),
                             observer=lambda name, t: seen.setdefault(name, t))
    assert set(seen) == {"routing", "order", "fc1_in", "fc1_out", "fc2_in", "fc2_out"}
    assert seen["fc1_out"].shape == (74, 64) and seen["fc2_out"].shape == (74, 64)


def test_native_backend_is_refused_without_blackwell():
    """backend='native' names why it cannot run (no CUDA / no compute capability 10.x here)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("a Blackwell device is present")
    w, a = _w(2, 16, 32), _a(4, 32)
    with pytest.raises(SpecError, match="native Blackwell"):
        gemm.grouped_linear(a, gemm.prepare_weights(w, "nvfp4_minite"), [2, 2], backend="native")


def test_a_path_names_its_backend_and_its_guidance_as_fields():
    """ExecutionPath carries ``guided`` and ``backend`` as fields: the built-in guided paths are
    exactly those with ``guided`` (nvfp4_trace and its KV twins, libalign's and SGLang's KV
    formats), a path whose backend is
    ``reference`` multiplies with the float64 reference (its bits equal w4a4_reference) unless
    a call names another backend, and an unknown backend is a SpecError naming the path."""
    assert gemm.guided_paths() == {"nvfp4_trace", "nvfp4_trace_kv_nvfp4", "nvfp4_trace_kv_mxfp4",
                                   "nvfp4_trace_kv_sglang_nvfp4",
                                   "nvfp4_trace_kv_sglang_fp4_mx_block16"}
    assert gemm.get_path(gemm.GUIDED).guided and not gemm.get_path("nvfp4_minite").guided
    minite = gemm.get_path("nvfp4_minite")
    ref = gemm.ExecutionPath("minite_reference", minite.weight_spec, minite.act_spec,
                             backend="reference")
    assert ref.backend is gemm.Backend.REFERENCE and f"{ref.backend}" == "reference"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    a = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got = gemm.grouped_linear(a, gemm.prepare_weights(w, ref), [2, 3])
    qa = quantize(a, PRESETS["minite"])
    qw = quantize(w, PRESETS["minite"])
    want = torch.cat([
        gemm.w4a4_reference(gemm.take_rows(qa, torch.arange(0, 2)),
                            gemm.take_rows(_expert(qw, 0), torch.arange(32))),
        gemm.w4a4_reference(gemm.take_rows(qa, torch.arange(2, 5)),
                            gemm.take_rows(_expert(qw, 1), torch.arange(32)))])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(SpecError, match="path 'bad': backend must be one of"):
        gemm.ExecutionPath("bad", backend="cublas")


def _expert(q, e: int):
    """Expert ``e`` of an NVFP4 stack ``[E, N, K]`` as a 2-D NVFP4 tensor ``[N, K]``."""
    from libalign.spec import NVFP4Tensor

    outer = q.outer_scale[e] if q.outer_scale is not None and q.outer_scale.ndim else q.outer_scale
    return NVFP4Tensor(q.codes[e], q.block_scales[e], outer, q.spec, (q.shape[1], q.k))
