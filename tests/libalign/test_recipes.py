"""The production recipes' presets, bit for bit against oracles written from the peers' sources.

``flashinfer_pertoken`` against a port of FlashInfer's per-token kernel, the 4-over-6 presets
against a port of TE's 4-over-6 reference and of FlashInfer's (each adds its error in its own
order), on every adversarial family, hypothesis inputs and the edge cases (subnormal blocks,
all-zero rows, exact ties, NaN/Inf, K not a multiple of 16). Quality against BF16 is checked
separately at the end.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign.errors import NonFiniteError, ShapeError, SpecError
from libalign.spec import PRESETS, quantize
from libalign.spec.packing import unpack_nibbles
from tests.libalign import inputs, te_oracle

FAMILIES = sorted(inputs.FAMILIES)
FOUR_OVER_SIX = {
    "te_4over6": dict(per_row=False, e4m3_max=256.0, order="te"),
    "te_4over6_448": dict(per_row=False, e4m3_max=448.0, order="te"),
    "te_row_4over6": dict(per_row=True, e4m3_max=256.0, order="te"),
    "flashinfer_pertoken_4over6": dict(per_row=True, e4m3_max=256.0, order="flashinfer"),
}


def _check_4over6(x, preset, metric="mae"):
    spec = PRESETS[preset].replace(four_over_six_error=metric)
    kw = FOUR_OVER_SIX[preset]
    codes, scales, amax = te_oracle.quantize_4over6(x.float().numpy(), metric=metric, **kw)
    q = quantize(x, spec)
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    if kw["order"] == "te":  # TE stores the amax, FlashInfer the per-token decode scale
        assert np.array_equal(q.outer_scale.reshape(-1).numpy().view(np.int32),
                              amax[: q.outer_scale.numel()].view(np.int32))
    return q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", sorted(FOUR_OVER_SIX))
def test_4over6_matches_the_peer_oracle(preset, family, dtype):
    """Codes, scale bytes and stored amax of each 4-over-6 preset equal the port of its peer."""
    _check_4over6(inputs.FAMILIES[family]((12, 64), dtype=dtype), preset)


@pytest.mark.parametrize("preset", ["te_row_4over6", "flashinfer_pertoken_4over6"])
def test_4over6_mse_matches_the_peer_oracle(preset):
    """The MSE error metric (Miles' example setting) as its peer computes it."""
    _check_4over6(inputs.tie_heavy((12, 64)), preset, "mse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_flashinfer_pertoken_matches_the_kernel_port(family, dtype):
    """Per-token activations equal FlashInfer's per-token kernel: codes, scales, decode scale."""
    x = inputs.FAMILIES[family]((24, 128), dtype=dtype)
    codes, scales, dec = te_oracle.flashinfer_pertoken(x.float().numpy())
    q = quantize(x, PRESETS["flashinfer_pertoken"])
    assert np.array_equal(unpack_nibbles(q.codes).numpy(), codes)
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy(), scales)
    assert np.array_equal(q.outer_scale.numpy().view(np.int32), dec.view(np.int32))


def test_flashinfer_pertoken_is_te_row_but_for_sign_and_convention():
    """FlashInfer's per-token global 1/(1/2688) is 2688 exactly: the bits are te_row's, the
    stored outer scale TE's decode scale, and -0.0 keeps its sign (hardware conversion)."""
    x = inputs.mixed_magnitudes((16, 64))
    fi, te = quantize(x, PRESETS["flashinfer_pertoken"]), quantize(x, PRESETS["te_row"])
    assert torch.equal(fi.block_scales.view(torch.uint8), te.block_scales.view(torch.uint8))
    assert torch.equal(fi.outer_scale, te.outer_dec)
    z = torch.full((2, 16), -0.0)
    assert int(unpack_nibbles(quantize(z, PRESETS["flashinfer_pertoken"]).codes)[0, 0]) == 0x8


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1),
       st.sampled_from(sorted(FOUR_OVER_SIX)), st.floats(-12, 12))
def test_4over6_hypothesis(rows, blocks, seed, preset, log2_scale):
    """Random shapes and magnitudes (bf16 data) match the oracle."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 16 * blocks, generator=g) * 2.0 ** log2_scale).to(torch.bfloat16)
    _check_4over6(x, preset)


@pytest.mark.parametrize("preset", sorted(FOUR_OVER_SIX))
def test_4over6_edge_cases(preset):
    """Subnormal-scale blocks, an all-zero row and block, signed zeros, exact ties."""
    x = inputs.tie_heavy((8, 64))
    x[0] = 0.0
    x[1, :16] = 0.0
    x[2, 16:32] = -0.0
    x[3, :16] = 2.0 ** -130  # fp32 subnormal block under a large row maximum
    x[3, 16] = 1e4
    _check_4over6(x.float(), preset)


@pytest.mark.parametrize("preset", ["flashinfer_pertoken", "te_row_4over6",
                                    "flashinfer_pertoken_4over6"])
def test_row_recipes_refuse_k_not_multiple_of_16_and_nonfinite(preset):
    """K % 16 != 0 and NaN/Inf are refused with the typed errors, as the peers refuse them."""
    with pytest.raises(ShapeError):
        quantize(torch.randn(4, 40), PRESETS[preset])
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize(bad, PRESETS[preset])


def test_te_4over6_pads_k_as_te_reference():
    """Per-tensor TE 4-over-6 zero-pads K like TE's reference."""
    x = inputs.randn((4, 40))
    padded = torch.nn.functional.pad(x, (0, 8))
    assert torch.equal(quantize(x, PRESETS["te_4over6"]).codes,
                       quantize(padded, PRESETS["te_4over6"]).codes)


def test_4over6_refuses_what_te_refuses():
    """4-over-6 with RHT or stochastic rounding, or outside TE's order, is a SpecError."""
    for change in (dict(hadamard=True), dict(stochastic_rounding=True),
                   dict(op_order="modelopt")):
        with pytest.raises(SpecError):
            PRESETS["te_4over6"].replace(**change)


def _rel_err(x, preset):
    d = quantize(x, PRESETS[preset]).dequantize()
    return float((d - x.float()).abs().sum() / x.float().abs().sum())


def test_quality_against_bf16():
    """Against BF16 (separate from bit parity): every recipe stays within 12 % relative L1 on
    Gaussian rows, and 4-over-6 (MAE) reconstructs better than plain NVFP4 at the same bound."""
    x = inputs.randn((256, 512))
    errs = {p: _rel_err(x, p) for p in ["te", "te_row", "flashinfer_pertoken", *FOUR_OVER_SIX]}
    assert all(e < 0.12 for e in errs.values()), errs
    assert errs["te_4over6_448"] < errs["te"]
    assert errs["te_row_4over6"] < errs["te_row"]


# --- the recipes' execution paths: operands and GEMM epilogue ---------------------------------

def _epilogue_oracle(path, aq, wq, acc):
    """The peers' epilogues in NumPy float32 from the stored scales (one rounding per step)."""
    a_s = aq.outer_scale.numpy().astype(np.float32)
    w_s = np.float32(wq.outer_scale.reshape(-1)[0])
    a_s = np.broadcast_to(a_s.reshape(-1, 1), (*acc.shape[:1], 1)).astype(np.float32)
    if path.epilogue == "dec_product":  # FlashInfer CuTe DSL MoE: alpha[e] * per_token_scale[m]
        return acc * (w_s * a_s).astype(np.float32)
    factor = np.float32(1.0) / np.float32(np.float32(36.0) * np.float32(path.weight_spec.e4m3_max)
                                          * np.float32(path.act_spec.e4m3_max))
    if path.epilogue == "te_alpha":  # nvte_nvfp4_compute_per_tensor_scale: 1 * A_w * A_a * f
        return acc * np.float32(np.float32(w_s * a_s) * factor)
    return (acc * factor).astype(np.float32) * (a_s * w_s).astype(np.float32)  # row-scaled


@pytest.mark.parametrize("name", ["nvfp4_modelopt_pertoken", "nvfp4_te", "nvfp4_te_rowact",
                                  "nvfp4_te_rowact_4over6", "nvfp4_sglang_pertoken_4over6"])
def test_recipe_path_gemm_matches_the_peer_epilogue(name):
    """One expert's product through grouped_linear (reference and torch backends) equals the
    exact accumulation scaled as the path's peer scales it."""
    from libalign.gemm import get_path, grouped_linear, prepare_weights
    from libalign.gemm.inner import inner_values

    path = get_path(name)
    a = inputs.mixed_magnitudes((24, 64)).to(torch.bfloat16)
    w = inputs.randn((1, 32, 64), seed=7)
    weights = prepare_weights(w, path)
    aq = quantize(a, path.act_spec)
    wq = weights.q.expert(0)
    acc = (inner_values(aq, torch.float64) @ inner_values(wq, torch.float64).T).float().numpy()
    want = torch.from_numpy(np.ascontiguousarray(_epilogue_oracle(path, aq, wq, acc)))
    for backend in ("reference", "torch"):
        got = grouped_linear(a, weights, [24], backend=backend).float()
        if backend == "reference":
            assert torch.equal(got, want.to(torch.bfloat16).float())
        else:  # fp32 accumulation order: within the fp32 sum's rounding
            assert torch.allclose(got, want.to(torch.bfloat16).float(), rtol=2e-2, atol=1e-3)


def test_te_recipe_path_refuses_what_te_refuses():
    """RHT with row-scaled activations (or with 4-over-6) is refused; RHT on per-tensor
    activations leaves the forward bits unchanged."""
    from libalign.gemm.paths import te_recipe_path

    with pytest.raises(SpecError):
        te_recipe_path(row_scaled_activation=True, rht=True)
    with pytest.raises(SpecError):
        te_recipe_path(four_over_six=True, rht=True)
    on, off = te_recipe_path(rht=True), te_recipe_path(rht=False)
    assert on.act_spec == off.act_spec and on.weight_spec == off.weight_spec and on.rht


def test_te_epilogue_paths_refuse_the_fused_backends():
    """Triton and native GEMMs scale by the decode-scale product; TE's epilogue is refused there."""
    from libalign.gemm.backends import resolve_backend
    from libalign.gemm.paths import get_path

    with pytest.raises(SpecError):
        resolve_backend("triton", torch.device("cpu"), get_path("nvfp4_te_rowact"), 64)
    assert resolve_backend("auto", torch.device("cpu"), get_path("nvfp4_te"), 64) == "torch"
