"""Pins the compiled MXFP4 kernels (CPU paths and CUDA) to the spec, bit for bit (atol=0).

``libalign.kernels.quantize`` / ``quantize_many`` serve the MXFP4 presets (``mxfp4``,
``mxfp4_ceil``, ``mxfp4_even``, ``mxfp4_te``, ``kv_mxfp4``) with the kernels; every test
here compares packed codes and E8M0 scale bytes (linear and 128x4 swizzled) with
:func:`libalign.spec.quantize` on the same input, on each CPU instruction-set path this
CPU has (forced like ``ALIGN_CPU_KERNEL`` does) and on CUDA (marked gpu). The spec is
pinned to torchao's ``to_mx`` and TE's formulas in tests/libalign/test_mxfp4.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from libalign import sync
from libalign.errors import NonFiniteError, ShapeError, SpecError
from libalign.kernels import native, ops
from libalign.spec import PRESETS, quantize
from libalign.spec.packing import swizzle_scales
from libalign.spec.presets import MX_PRESETS
from tests.libalign import inputs, test_ops_kernels
from tests.libalign.test_mxfp4 import e8m0_edges

#: the CPU paths and CUDA, as the NVFP4 kernel tests run them
device = test_ops_kernels.device
assert_bitwise = test_ops_kernels.assert_bitwise

PRESETS_SERVED = [*MX_PRESETS, "kv_mxfp4"]
FAMILIES = {**inputs.FAMILIES, "e8m0_edges": e8m0_edges}


_SPEC_RESULTS: dict = {}


def spec_quantize(x, spec):
    """``quantize(x, spec)``, computed once per input content and spec: the spec is pure, and
    the parametrized tests give the same seeded input to every device."""
    raw = x.detach().contiguous().flatten().view(torch.uint8).numpy()
    key = (spec, x.dtype, tuple(x.shape), hashlib.blake2b(raw.tobytes()).digest())
    if key not in _SPEC_RESULTS:
        _SPEC_RESULTS[key] = quantize(x, spec)
    return _SPEC_RESULTS[key]


def run_both(x, spec, device, **kw):
    """The kernel's result (backend='kernel': never the spec standing in) equals the spec's."""
    q = ops.quantize(x.to(device), spec, backend="kernel", **kw)
    ref = spec_quantize(x, spec)
    assert q.block_scales.dtype == torch.float8_e8m0fnu and q.outer_scale is None
    assert_bitwise(q, ref)
    return q


def subnormals(shape, dtype=torch.float32, seed=9):
    """fp32 blocks of subnormal and near-subnormal values (maxima 2^-149 .. 2^-120), so the
    scale bytes reach 0 and the scaled elements round from subnormal products."""
    g = inputs.gen(seed)
    nb = shape[-1] // 32
    e = torch.randint(-149, -119, (*shape[:-1], nb, 1), generator=g).to(torch.float64)
    mant = torch.rand((*shape[:-1], nb, 32), generator=g, dtype=torch.float64) * 2 - 1
    x = (mant * torch.exp2(e)).to(torch.float32).reshape(shape)
    return x.to(dtype)


def test_mxfp4_presets_are_served_by_the_kernels():
    """backend_for names the device's kernel for every MXFP4 preset: no gap."""
    x = inputs.randn((64, 256))
    for name in PRESETS_SERVED:
        assert ops.kernel_gap(x, PRESETS[name], None) is None
        assert ops.backend_for(x, PRESETS[name]) == "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("preset", MX_PRESETS)
def test_families_match_spec(device, preset, family, dtype):
    """Each adversarial family (E8M0 turning points, E2M1 ties, zeros and signs, tiny and
    mixed magnitudes), 3-D stack, K=256, 40 rows."""
    x = FAMILIES[family]((3, 40, 256), dtype=torch.float32)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    run_both(x.to(dtype), PRESETS[preset], device)


@pytest.mark.parametrize("shape", [(1, 32), (5, 7168), (130, 2048), (2, 9, 7168),
                                   (4, 0, 768), (3, 1, 32), (2, 64, 8224), (300, 128)])
@pytest.mark.parametrize("preset", PRESETS_SERVED)
def test_shape_classes_match_spec(device, preset, shape):
    """Matrices and stacks: K in {32, 128, 768, 2048, 7168, 8224}, empty experts, a KV-cache
    row shape (head size 128)."""
    x = inputs.tie_heavy(shape, dtype=torch.float32)
    run_both(x.to(torch.bfloat16), PRESETS[preset], device)


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 64), (3, 0, 96)])
def test_empty_shapes(device, shape):
    """K = 0, no rows, no experts: empty codes and scales of the spec's shapes."""
    run_both(torch.zeros(shape, dtype=torch.bfloat16), PRESETS["mxfp4"], device)


@pytest.mark.parametrize("preset", MX_PRESETS)
def test_every_bf16_block_maximum(device, preset):
    """All 32639 positive finite bf16 values as a block maximum: every scale byte a bf16
    input can produce, and the codes of its block."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(amax.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    x[:, 2] = amax * 0.29
    x[:, 3] = -amax * 0.0417
    run_both(x, PRESETS[preset], device)


@pytest.mark.parametrize("preset", MX_PRESETS)
def test_fp32_extremes_and_subnormals(device, preset):
    """fp32 blocks at FLT_MAX, at 2^k and one ulp beside it over the whole exponent range,
    subnormal blocks (byte 0, subnormal products), and single tiny values in zero blocks."""
    k = torch.arange(-149, 128, dtype=torch.float64)
    base = torch.exp2(k).to(torch.float32).view(torch.int32)
    peaks = torch.cat([(base + j).view(torch.float32) for j in (-1, 0, 1)])
    peaks = peaks[torch.isfinite(peaks) & (peaks > 0)]
    x = torch.zeros(peaks.numel() + 3, 32)
    x[:peaks.numel(), 0] = peaks
    x[:peaks.numel(), 1] = -peaks * 0.75
    x[:peaks.numel(), 5] = peaks / 12
    x[-3] = torch.finfo(torch.float32).max
    x[-2, ::2] = -torch.finfo(torch.float32).max
    x[-1, 7] = torch.finfo(torch.float32).tiny * 2.0**-23  # the smallest subnormal
    run_both(x, PRESETS[preset], device)
    run_both(subnormals((64, 256)), PRESETS[preset], device)


@pytest.mark.parametrize("policy", ["positive", "sign_of_input", "sign_of_nonzero"])
def test_signed_zero_policies(device, policy):
    """-0.0, tiny negatives and all-zero blocks under each signed-zero policy."""
    x = inputs.zeros_and_signs((4, 32, 256), dtype=torch.float32)
    x[0, :, :32] = -0.0
    x[1, 3] = 0.0
    for preset in ("mxfp4", "mxfp4_te"):
        run_both(x, PRESETS[preset].replace(signed_zero=policy), device)


@pytest.mark.parametrize("shape", [(3, 200, 2048), (2, 256, 512), (5, 96)])
@pytest.mark.parametrize("preset", ["mxfp4", "mxfp4_te"])
def test_swizzled_scales_equal_swizzled_spec(device, preset, shape):
    """The kernel's in-place 128x4 layout (k/32 columns) equals swizzling the spec's linear
    scales, padding bytes zero; .linear() gives the spec's bits back."""
    x = inputs.mixed_magnitudes(shape)
    g = ops.quantize(x.to(device), PRESETS[preset], scale_layout="swizzled", backend="kernel")
    ref = spec_quantize(x, PRESETS[preset])
    assert g.block_scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(g.block_scales.view(torch.uint8).cpu(),
                       swizzle_scales(ref.block_scales).view(torch.uint8))
    assert_bitwise(g.linear(), ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises_like_spec(device, bad):
    """NaN/Inf: the kernel path raises the spec's NonFiniteError, message and positions."""
    x = inputs.randn((2, 64, 256))
    x[1, 5, 17] = bad
    x[0, 3, 200] = bad
    for preset in PRESETS_SERVED:
        with pytest.raises(NonFiniteError) as got:
            ops.quantize(x.to(device), PRESETS[preset])
        with pytest.raises(NonFiniteError) as want:
            quantize(x, PRESETS[preset])
        assert str(got.value) == str(want.value)
        with pytest.raises(NonFiniteError) as many:
            ops.quantize_many([inputs.randn((8, 64)).to(device), x.to(device)], PRESETS[preset])
        assert str(many.value) == str(want.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_saturate_matches_spec(device, dtype):
    """nonfinite='saturate' on an MX spec: NaN -> 0, +-Inf -> the dtype's largest value."""
    x = inputs.randn((2, 64, 256), dtype=dtype)
    x[1, 5, 17] = float("nan")
    x[0, 3, 200] = float("-inf")
    x[0, 9, 40:72] = float("inf")
    for preset in ("mxfp4", "mxfp4_even", "mxfp4_te"):
        run_both(x, PRESETS[preset].replace(nonfinite="saturate"), device)


@pytest.mark.parametrize("k", [16, 48, 33, 100])
@pytest.mark.parametrize("preset", PRESETS_SERVED)
def test_k_not_a_multiple_of_32_is_the_specs_shape_error(device, preset, k):
    """The presets refuse K % 32 != 0 with the spec's ShapeError on every path; a spec that
    pads is served by the spec (the kernels' gap says why; backend='kernel' refuses)."""
    x = torch.randn(4, k)
    with pytest.raises(ShapeError) as want:
        quantize(x, PRESETS[preset])
    for call in (lambda: ops.quantize(x.to(device), PRESETS[preset]),
                 lambda: ops.quantize_many([x.to(device)], PRESETS[preset])):
        with pytest.raises(ShapeError) as got:
            call()
        assert str(got.value) == str(want.value)
    padded = PRESETS[preset].replace(k_remainder="pad")
    assert "multiple of 32" in ops.kernel_gap(x, padded, None)
    assert ops.quantize(x.to(device), padded).bitwise_equal(quantize(x, padded).to(device))
    with pytest.raises(SpecError, match="multiple of 32"):
        ops.quantize(x.to(device), padded, backend="kernel")


def test_quantize_many_and_out_buffers(device):
    """quantize_many over mixed shapes and dtypes, and quantize(out=) reusing an earlier
    result's buffers, give the spec's bits."""
    spec = PRESETS["mxfp4"]
    xs = [inputs.randn((3, 40, 256)), inputs.mixed_magnitudes((96, 512), dtype=torch.float32),
          e8m0_edges((7, 64), dtype=torch.float16).clamp(-60000, 60000)]
    for q, x in zip(ops.quantize_many([x.to(device) for x in xs], spec), xs, strict=True):
        assert_bitwise(q, quantize(x, spec))
    first = ops.quantize(xs[0].to(device), spec)
    again = ops.quantize(inputs.tie_heavy((3, 40, 256)).to(device), spec, out=first)
    assert again.codes.data_ptr() == first.codes.data_ptr()
    assert_bitwise(again, quantize(inputs.tie_heavy((3, 40, 256)), spec))
    dest = sync.empty_destination(xs[1].to(device), PRESETS["mxfp4_te"])
    sync.quantize_into([xs[1].to(device)], [dest], PRESETS["mxfp4_te"])
    assert_bitwise(dest, quantize(xs[1], PRESETS["mxfp4_te"]))


_element = st.one_of(
    st.floats(-(2.0**127), 2.0**127, allow_nan=False, allow_infinity=False, width=32),
    st.floats(-(2.0**-120), 2.0**-120, allow_nan=False, width=32),
    st.builds(lambda g, e, s: s * g * 2.0**e,
              st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0, 1.5]),
              st.integers(-140, 120), st.sampled_from([1.0, -1.0])),
    st.just(0.0), st.just(-0.0),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=st.integers(1, 5).flatmap(
    lambda m: st.sampled_from([32, 64, 160]).flatmap(
        lambda k: arrays(np.float32, (m, k), elements=_element))),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_property_every_path_and_preset_equals_spec(arr, dtype):
    """Any finite input (huge, subnormal, E2M1 midpoints times powers of two, signed zeros):
    every CPU path's codes and scale bytes equal the spec's, for every MXFP4 preset."""
    x = torch.from_numpy(arr)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    refs = {name: quantize(x, PRESETS[name]) for name in MX_PRESETS}
    try:
        for path in ops.cpu_kernel_paths():
            ops.set_cpu_kernel_path(path)
            for name, ref in refs.items():
                assert_bitwise(ops.quantize(x, PRESETS[name], backend="kernel"), ref)
    finally:
        ops.set_cpu_kernel_path(None)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_align_cpu_kernel_env_forces_the_path(path):
    """A process started with ALIGN_CPU_KERNEL=<path> serves MXFP4 on that path, with the
    spec's bits for every preset (E2M1 ties scaled over the exponent range, bf16 and fp32)."""
    if native.load("cpu") is None or path not in ops.cpu_kernel_paths():
        pytest.skip(f"this CPU cannot run the {path} path")
    probe = textwrap.dedent(f"""
        import torch
        from libalign.kernels import ops
        from libalign.spec.presets import MX_PRESETS
        from libalign.spec import PRESETS, quantize
        from tests.libalign import inputs
        assert ops.cpu_kernel_path() == {path!r}, ops.cpu_kernel_path()
        for dtype in (torch.bfloat16, torch.float32):
            x = inputs.tie_heavy((64, 256), torch.float32) * torch.exp2(
                torch.randint(-140, 120, (64, 8), generator=inputs.gen(3)).float()
            ).repeat_interleave(32, dim=-1)
            x = x.to(dtype)
            for name in MX_PRESETS:
                q = ops.quantize(x, PRESETS[name], backend="kernel")
                assert q.bitwise_equal(quantize(x, PRESETS[name])), (name, dtype)
        print("ok")
    """)
    env = {**os.environ, "ALIGN_CPU_KERNEL": path}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=300, cwd=native.CSRC.parent)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
