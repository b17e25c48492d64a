"""Pins the compiled NVFP4 kernels (CPU and CUDA) to the spec, bit for bit (atol=0).

Every comparison checks the packed codes, the block-scale bytes (linear and 128x4
swizzled), the outer-scale bits and the floored outer maxima against
:func:`libalign.spec.quantize` on the same input, over the adversarial input families,
the kernel-served presets and spec variants, and every shape class the converter sees.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import ConfigError, NonFiniteError, SpecError, UndefinedScaleError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libalign.kernels import native, ops
from libalign.spec import PRESETS, quantize, shared_outer_amax
from libalign.spec.packing import swizzle_scales
from tests.libalign import inputs

KERNEL_PRESETS = ["minite", "te", "te_row", "torchao", "modelopt", "flashinfer_pertoken"]

DEVICES = [
    pytest.param("cpu-avx512", id="cpu-avx512"),
    pytest.param("cpu-avx2", id="cpu-avx2"),
    pytest.param("cpu-scalar", id="cpu-scalar"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def device(request):
    """A device string for tensors; 'cpu-<path>' runs the CPU kernel forced to that
    instruction-set path (skipped where this CPU lacks it; scalar runs everywhere)."""
    kind = request.param
    if kind.startswith("cpu"):
        if native.load("cpu") is None:
            pytest.fail("the CPU kernel did not build (g++ is part of the test set-up)")
        path = kind.removeprefix("cpu-")
        if path not in ops.cpu_kernel_paths():
            pytest.skip(f"this CPU cannot run the {path} path (it runs "
                        f"{', '.join(ops.cpu_kernel_paths())})")
        ops.set_cpu_kernel_path(path)
        try:
            yield "cpu"
        finally:
            ops.set_cpu_kernel_path(None)
    else:
        if native.load("cuda") is None:
            pytest.fail("the CUDA kernel did not build on a machine with a CUDA device")
        yield "cuda"


def assert_bitwise(q, ref):
    """Codes, scale bytes, outer-scale bits and outer maxima identical."""
    assert q.shape == ref.shape
    assert torch.equal(q.codes.cpu(), ref.codes.cpu()), "codes differ"
    assert torch.equal(q.block_scales.view(torch.uint8).cpu(),
                       ref.block_scales.view(torch.uint8).cpu()), "block scales differ"
    assert (q.outer_scale is None) == (ref.outer_scale is None)
    if ref.outer_scale is not None:
        assert q.outer_scale.shape == ref.outer_scale.shape
        assert torch.equal(q.outer_scale.cpu().view(torch.int32),
                           ref.outer_scale.cpu().view(torch.int32)), "outer scales differ"
        assert torch.equal(q.outer_amax.cpu().view(torch.int32),
                           ref.outer_amax.cpu().view(torch.int32)), "outer maxima differ"


def run_both(x, spec, device, **kw):
    q = ops.quantize(x.to(device), spec, backend="kernel", **kw)
    ref = quantize(x, spec, **kw)
    assert_bitwise(q, ref)
    return q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("family", sorted(inputs.FAMILIES))
@pytest.mark.parametrize("preset", KERNEL_PRESETS)
def test_families_match_spec(device, preset, family, dtype):
    """Each adversarial family, 3-D stack, K=768, 200 rows (not a multiple of 128)."""
    x = inputs.FAMILIES[family]((3, 200, 768), dtype=torch.float32)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    run_both(x.to(dtype), PRESETS[preset], device)


@pytest.mark.parametrize("shape", [(1, 2048), (5, 7168), (130, 2048), (2, 9, 7168),
                                   (128, 3, 2048), (4, 0, 768), (3, 1, 16), (2, 64, 8208)])
@pytest.mark.parametrize("preset", KERNEL_PRESETS)
def test_shape_classes_match_spec(device, preset, shape):
    """Matrices and stacks: K in {16, 768, 2048, 7168, 8208}, 1..128 experts, empty experts."""
    x = inputs.tie_heavy(shape, dtype=torch.float32)
    run_both(x.to(torch.bfloat16), PRESETS[preset], device)


@pytest.mark.parametrize("preset", ["minite", "te", "te_row"])
def test_zero_rows_and_zero_experts(device, preset):
    """All-zero rows and an all-zero expert: the row floor / zero-scale policies hold."""
    x = inputs.randn((4, 40, 768))
    x[1] = 0
    x[2, 7] = 0
    x[3, :, :32] = -0.0
    run_both(x, PRESETS[preset], device)


@pytest.mark.parametrize("shape", [(3, 200, 2048), (2, 256, 512)])  # padded / unpadded
@pytest.mark.parametrize("preset", KERNEL_PRESETS)
def test_swizzled_scales_equal_swizzled_spec(device, preset, shape):
    """The kernel's in-place 128x4 layout equals swizzling the spec's linear scales."""
    x = inputs.mixed_magnitudes(shape)
    g = ops.quantize(x.to(device), PRESETS[preset], scale_layout="swizzled", backend="kernel")
    ref = quantize(x, PRESETS[preset])
    assert torch.equal(g.block_scales.view(torch.uint8).cpu(),
                       swizzle_scales(ref.block_scales).view(torch.uint8))
    assert_bitwise(g.linear(), ref)


@pytest.mark.parametrize("preset", ["te", "torchao", "modelopt"])
def test_shared_outer_amax_for_gate_and_up(device, preset):
    """Gate and up quantized with one shared outer maximum agree with the spec."""
    spec = PRESETS[preset]
    gate, up = inputs.randn((4, 96, 256), seed=11), inputs.randn((4, 96, 256), seed=12) * 3
    shared = shared_outer_amax([gate, up], spec)
    qg = run_both(gate, spec, device, outer_amax=shared)
    qu = run_both(up, spec, device, outer_amax=shared)
    assert torch.equal(qg.outer_scale.cpu(), qu.outer_scale.cpu())


def test_nonfinite_raises_like_spec(device):
    """NaN/Inf: the kernel path raises the spec's NonFiniteError with the same positions."""
    x = inputs.randn((2, 64, 768))
    x[1, 5, 17] = float("nan")
    x[0, 3, 700] = float("inf")
    for preset in KERNEL_PRESETS:
        with pytest.raises(NonFiniteError) as got:
            ops.quantize(x.to(device), PRESETS[preset])
        with pytest.raises(NonFiniteError) as want:
            quantize(x, PRESETS[preset])
        assert str(got.value) == str(want.value)


def test_nonfinite_saturate_matches_spec(device):
    """nonfinite='saturate': NaN -> 0, +-Inf -> the dtype's largest value, in every path."""
    x = inputs.randn((2, 64, 768))
    x[1, 5, 17] = float("nan")
    x[0, 3, 700] = float("-inf")
    for preset in ("minite", "te", "torchao"):
        run_both(x, PRESETS[preset].replace(nonfinite="saturate"), device)


def test_undefined_scale_raises_like_spec(device):
    """torchao/modelopt on an all-zero expert raise UndefinedScaleError, as the spec does."""
    x = inputs.randn((3, 32, 256))
    x[1] = 0
    with pytest.raises(UndefinedScaleError):
        ops.quantize(x.to(device), PRESETS["torchao"])
    with pytest.raises(UndefinedScaleError):
        ops.quantize(torch.zeros(8, 64).to(device), PRESETS["modelopt"])


def test_backend_kernel_refuses_uncovered_specs():
    """backend='kernel' names why it cannot serve compressed-tensors / Hadamard / odd K."""
    x = inputs.randn((8, 64))
    with pytest.raises(SpecError, match="op_order"):
        ops.quantize(x, PRESETS["compressed_tensors"], backend="kernel")
    with pytest.raises(SpecError, match="Hadamard"):
        ops.quantize(x, PRESETS["minite"].replace(hadamard=True), backend="kernel")
    with pytest.raises(SpecError, match="multiple of 16"):
        ops.quantize(inputs.randn((8, 40)), PRESETS["minite"], backend="kernel")
    # auto falls back to the spec and still gives its bits
    q = ops.quantize(inputs.randn((8, 40)), PRESETS["minite"])
    assert q.bitwise_equal(quantize(inputs.randn((8, 40)), PRESETS["minite"]))


def test_cpu_kernel_runs_the_best_path_this_cpu_has():
    """The library picks its path at run time from the CPU's features: AVX-512 where
    /proc/cpuinfo lists AVX512F/BW/VL/DQ, else AVX2 where it lists AVX2 and F16C, else
    scalar; a forced path serves until restored."""
    flags = set(native.cpu_flags().split())
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = ["scalar"]
    if {"avx2", "f16c"} <= flags:
        want.insert(0, "avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            want.insert(0, "avx512")
    assert ops.cpu_kernel_paths() == tuple(want)
    assert ops.cpu_kernel_path() == want[0]
    assert ops.set_cpu_kernel_path("scalar") == "scalar" == ops.cpu_kernel_path()
    assert ops.set_cpu_kernel_path(None) == want[0] == ops.cpu_kernel_path()


def test_cpu_kernel_path_refuses_what_the_cpu_lacks():
    """Forcing an unknown path, or one this CPU cannot run, is a ConfigError naming it, and
    the path serving calls stays what it was."""
    best = ops.cpu_kernel_path()
    with pytest.raises(ConfigError, match="unknown CPU kernel path 'sse4'"):
        ops.set_cpu_kernel_path("sse4")
    lacking = [p for p in native.CPU_PATHS if p not in ops.cpu_kernel_paths()]
    for path in lacking:
        with pytest.raises(ConfigError, match=f"'{path}' needs instructions this CPU lacks"):
            ops.set_cpu_kernel_path(path)
    assert ops.cpu_kernel_path() == best


spec_variants = st.builds(
    lambda order, domain, floor, bsf, zpre, zenc, sz, conv, sat: PRESETS["minite"].replace(
        name="variant", op_order=order, outer_domain=domain, amax_floor=floor,
        block_scale_floor=bsf, zero_prescale_to=zpre, zero_scale_encode=zenc,
        signed_zero=sz, outer_convention=conv if domain != "none" else "dec",
        nonfinite="saturate" if sat else "raise"),
    st.sampled_from(["te", "torchao", "modelopt"]),
    st.sampled_from(["row", "tensor", "expert", "none"]),
    st.sampled_from([None, 1e-12, 1e-3]),
    st.sampled_from([None, 2.0**-9, 2.0**-6]),
    st.sampled_from([None, 1.0]),
    st.sampled_from(["zero", "saturate"]),
    st.sampled_from(["positive", "sign_of_input", "sign_of_nonzero"]),
    st.sampled_from(["amax", "enc", "dec"]),
    st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=spec_variants, family=st.sampled_from(sorted(inputs.FAMILIES)),
       experts=st.integers(1, 4), rows=st.integers(1, 40), nb=st.integers(1, 20),
       seed=st.integers(0, 2**16), three_d=st.booleans())
def test_property_any_kernel_spec_matches(device, spec, family, experts, rows, nb, seed, three_d):
    """Any spec the kernels cover, any small shape: kernel bits == spec bits (or same error)."""
    shape = (experts, rows, nb * 16) if three_d else (rows, nb * 16)
    x = inputs.FAMILIES[family](shape, dtype=torch.float32, seed=seed).to(torch.bfloat16)
    try:
        ref = quantize(x, spec)
    except UndefinedScaleError:
        with pytest.raises(UndefinedScaleError):
            ops.quantize(x.to(device), spec, backend="kernel")
        return
    assert_bitwise(ops.quantize(x.to(device), spec, backend="kernel"), ref)


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("preset", ["minite", "te", "torchao", "compressed_tensors"])
def test_out_buffers_are_reused_with_spec_bits(device, preset, layout):
    """out=: a second input quantized into the first call's buffers gives the spec's bits."""
    spec = PRESETS[preset]
    a = inputs.randn((2, 64, 256), seed=1).to(device)
    b = inputs.tie_heavy((2, 64, 256)).to(device)
    if preset == "compressed_tensors":
        a, b = a[0], b[0]
    first = ops.quantize(a, spec, scale_layout=layout)
    second = ops.quantize(b, spec, scale_layout=layout, out=first)
    assert second.codes.data_ptr() == first.codes.data_ptr()
    got = second if layout == "linear" else second.linear()
    assert_bitwise(got, quantize(b.cpu(), spec))
    with pytest.raises(SpecError, match="out has shape"):
        ops.quantize(b[..., :128], spec, scale_layout=layout, out=first)


@pytest.mark.parametrize("preset", ["minite", "torchao"])
def test_rows_longer_than_shared_memory_match_spec(device, preset):
    """fp32 rows of 96 KiB and more (the CUDA kernel re-reads them instead of staging)."""
    x = inputs.mixed_magnitudes((2, 3, 24592), dtype=torch.float32)
    run_both(x, PRESETS[preset], device)


def test_quantize_many_matches_spec_and_raises_like_quantize(device):
    """quantize_many: one sync for all; each result is the spec's; the first bad tensor raises."""
    from libalign.kernels import quantize_many

    xs = [inputs.randn((2, 64, 256), seed=s) for s in range(3)] + [inputs.randn((8, 40))]
    for preset in ("minite", "torchao"):
        spec = PRESETS[preset]
        got = quantize_many([x.to(device) for x in xs[:3]], spec)
        for g, x in zip(got, xs[:3], strict=True):
            assert_bitwise(g, quantize(x, spec))
    got = quantize_many([x.to(device) for x in xs], PRESETS["minite"], scale_layout="swizzled")
    assert_bitwise(got[3].linear(), quantize(xs[3], PRESETS["minite"]))  # K=40: the spec serves
    bad = inputs.randn((2, 64, 256))
    bad[1, 3, 5] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        quantize_many([xs[0].to(device), bad.to(device)], PRESETS["te"])
    assert "(1, 3, 5)" in str(err.value)


# --- 4-over-6 block scaling and the E4M3 bound 256 (TE's and FlashInfer's recipes) -----------

#: The 4-over-6 presets and the bound 256 alone (TE's order, plain block scaling).
FOUR_OVER_SIX_SPECS = {name: PRESETS[name] for name in
                       ("te_4over6", "te_4over6_448", "te_row_4over6", "flashinfer_pertoken_4over6")}
FOUR_OVER_SIX_SPECS["te_256"] = PRESETS["te"].replace(name="te_256", e4m3_max=256)


def four_over_six_spec(name: str, metric: str):
    spec = FOUR_OVER_SIX_SPECS[name]
    return spec.replace(four_over_six_error=metric) if spec.four_over_six != "off" else spec


def four_over_six_ties(shape, dtype=torch.float32, seed=6):
    """Blocks whose map-to-4 and map-to-6 candidates tie at error 0 (the spec keeps map-to-6).

    Every block holds +-6 * 2^e (e shared by the tensor, so it is also the row's and the
    tensor's maximum) and otherwise values of {0, +-1.5, +-3, +-6} * 2^e, which both grids
    hold: 6 * 2^e * {0, 0.25, 0.5, 1} on the map-to-6 grid and 4 * 2^e * {0, 0.375, 0.75, 1.5}
    on the map-to-4 one, so both reconstruct exactly, under different scale bytes.
    """
    g = inputs.gen(seed)
    vals = torch.tensor([0.0, 1.5, 3.0, 6.0, -0.0, -1.5, -3.0, -6.0])
    x = vals[torch.randint(0, 8, shape, generator=g)]
    blk = x.view(*shape[:-1], shape[-1] // 16, 16)
    blk[..., 0] = torch.where(torch.rand(blk.shape[:-1], generator=g) < 0.5, -6.0, 6.0)
    return (x * 2.0 ** int(torch.randint(-20, 20, (), generator=g))).to(dtype)


#: Rows of a seeded bf16 draw (``randn((200000, 16))``, seed 7) whose 4-over-6 choice under a
#: row maximum of 256 depends on the order the 16 errors are added: one after another (TE),
#: two halves of 8 (FlashInfer) or two interleaved halves; found by a search, MAE or MSE.
ORDER_SENSITIVE_ROWS = [8966, 23747, 26066, 26671, 40078, 50838, 63934, 86523, 103076, 116090,
                        122735, 124032, 143652, 147790, 152804, 157405, 160580, 193621, 197424]


def four_over_six_order_sensitive():
    """The blocks of :data:`ORDER_SENSITIVE_ROWS`, one per row, bf16."""
    x = torch.randn((200000, 16), generator=inputs.gen(7)).to(torch.bfloat16)
    return x[ORDER_SENSITIVE_ROWS]


@pytest.mark.parametrize("metric", ["mae", "mse"])
@pytest.mark.parametrize("name", ["te_row_4over6", "flashinfer_pertoken_4over6"])
def test_4over6_error_order_decides_like_spec(device, name, metric):
    """Blocks whose two errors are so close that the order of the 16 additions decides the
    candidate: the kernel adds in the spec's order (TE's, or FlashInfer's halves)."""
    x = four_over_six_order_sensitive()
    spec = four_over_six_spec(name, metric)
    run_both(x, spec, device)
    te = quantize(x, four_over_six_spec("te_row_4over6", metric)).block_scales.view(torch.uint8)
    fi = quantize(x, four_over_six_spec("flashinfer_pertoken_4over6", metric))
    assert not torch.equal(te, fi.block_scales.view(torch.uint8))  # the data tells them apart


@pytest.mark.parametrize("metric", ["mae", "mse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(FOUR_OVER_SIX_SPECS))
def test_4over6_families_match_spec(device, name, dtype, metric):
    """Every adversarial family and the candidates' ties in one 3-D stack (one family per
    expert), and the ties as a 2-D matrix: codes, scale bytes, outer scales."""
    if metric == "mse" and FOUR_OVER_SIX_SPECS[name].four_over_six == "off":
        pytest.skip("no error metric without 4-over-6")
    spec = four_over_six_spec(name, metric)
    x = torch.stack([inputs.FAMILIES[f]((16, 128), dtype=torch.float32)
                     for f in sorted(inputs.FAMILIES)] + [four_over_six_ties((16, 128))])
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    run_both(x, spec, device)
    run_both(x[-1], spec, device)


@pytest.mark.parametrize("name", sorted(FOUR_OVER_SIX_SPECS))
def test_4over6_edge_cases_match_spec(device, name):
    """All-zero rows, blocks and an expert, -0.0, fp32 subnormals under a large maximum,
    bf16 subnormals, exact ties; a shared outer maximum larger than the data's (tensor
    domain); the swizzled layout; quantize_many."""
    from libalign.kernels import quantize_many

    spec = four_over_six_spec(name, "mae")
    x = four_over_six_ties((3, 8, 64))
    x[0, 0] = 0.0  # an all-zero row
    x[0, 1, :16] = 0.0  # an all-zero block
    x[0, 2, 16:32] = -0.0  # a -0.0 block
    x[0, 3, 5] = -0.0
    x[1, 3, :16] = 2.0 ** -130  # fp32 subnormal block under a large row maximum
    x[1, 3, 16] = 1e4
    x[1, 4, :] = -(2.0 ** -140)  # a row of subnormals only
    x[2] = 0.0  # an all-zero expert
    run_both(x, spec, device)
    run_both(x[1:2], spec, device)
    run_both(torch.zeros(4, 32), spec, device)
    run_both(torch.full((2, 32), -0.0), spec, device)
    sub = torch.full((2, 64), 2.0 ** -133).to(torch.bfloat16)  # bf16 subnormals
    sub[1, ::3] *= -1
    run_both(sub, spec, device)
    if spec.outer_domain == "tensor":
        run_both(x, spec, device, outer_amax=torch.tensor(float(x.abs().max()) * 3.0))
        run_both(x, spec, device, outer_amax=torch.tensor(0.0))  # enc saturates to FLT_MAX
    g = ops.quantize(x.to(device), spec, scale_layout="swizzled", backend="kernel")
    ref = quantize(x, spec)
    assert torch.equal(g.block_scales.view(torch.uint8).cpu(),
                       swizzle_scales(ref.block_scales).view(torch.uint8))
    many = quantize_many([x[0].to(device), x[1].to(device)], spec)
    assert_bitwise(many[0], quantize(x[0], spec))
    assert_bitwise(many[1], quantize(x[1], spec))


def test_4over6_nonfinite_raises_like_spec(device):
    """NaN/Inf under 4-over-6 and the bound 256: the spec's NonFiniteError, same positions;
    nonfinite='saturate' gives the spec's bits."""
    x = inputs.randn((2, 16, 64))
    x[1, 5, 17] = float("nan")
    x[0, 3, 60] = float("-inf")
    for spec in FOUR_OVER_SIX_SPECS.values():
        assert ops.backend_for(x.to(device), spec) == device
        with pytest.raises(NonFiniteError) as got:
            ops.quantize(x.to(device), spec)
        with pytest.raises(NonFiniteError) as want:
            quantize(x, spec)
        assert str(got.value) == str(want.value)
        run_both(x, spec.replace(nonfinite="saturate"), device)  # NaN -> 0, Inf -> the max


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(FOUR_OVER_SIX_SPECS)), metric=st.sampled_from(["mae", "mse"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       experts=st.integers(1, 3), rows=st.integers(1, 12), nb=st.integers(1, 6),
       seed=st.integers(0, 2**16), log2_scale=st.floats(-14, 14), three_d=st.booleans(),
       family=st.sampled_from([*sorted(inputs.FAMILIES), "4over6_ties"]))
def test_4over6_property_matches_spec(device, name, metric, dtype, experts, rows, nb, seed,
                                      log2_scale, three_d, family):
    """Any small shape, magnitude and dtype under a 4-over-6 preset: kernel bits == spec bits."""
    shape = (experts, rows, nb * 16) if three_d else (rows, nb * 16)
    make = four_over_six_ties if family == "4over6_ties" else inputs.FAMILIES[family]
    x = make(shape, dtype=torch.float32, seed=seed) * 2.0 ** log2_scale
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    run_both(x.to(dtype), four_over_six_spec(name, metric), device)
