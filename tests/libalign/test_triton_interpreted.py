"""Pins the Triton kernels that need no E4M3 conversion against the spec in Triton's interpreter.

Where Triton is installed but no GPU is (a CI runner), each script runs in a subprocess with
``TRITON_INTERPRET=1``, which executes the kernels with NumPy on the CPU: the inner-value
decode (:func:`libalign.gemm.triton_kernels.inner_from_codes`) must give
:func:`libalign.gemm.inner_values`'s bits for every scale and code byte, and the fused guided
pass (:func:`libalign.gemm.triton_kernels.guided_act_qdq`) guided_quantize's values on the rows that
have a record, and the activation pass that gathers rows into a padded layout the bits of
the pass over the padded copy. Rows rounded under their own scales are left to the GPU tests: the
interpreter's E4M3 conversion is not the hardware's. Skipped without Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DECODE = textwrap.dedent("""
    import torch
    from libalign import gemm
    from libalign.gemm import triton_kernels as tk
    from libalign.spec.rounding import e4m3_bits_to_float
    from libalign.spec import NVFP4Tensor, PRESETS, quantize
    e4m3 = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row s: every code byte
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 32)
    q = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), torch.ones(256), PRESETS["minite"],
                    (256, 512))
    got, want = tk.inner_from_codes(q.codes, q.block_scales, e4m3, block=256), \\
        gemm.inner_values(q, torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and int(nan.any(-1).sum()) == 2
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    q = quantize(torch.randn(3, 37, 96).to(torch.bfloat16), PRESETS["minite"])
    got = tk.inner_from_codes(q.codes, q.block_scales, e4m3, block=128)
    assert torch.equal(got.view(torch.int16), gemm.inner_values(q, torch.bfloat16).view(torch.int16))
    print("interpreted decode equal")
""")

GUIDED = textwrap.dedent("""
    import torch
    from libalign import gemm
    from libalign.gemm import triton_kernels as tk
    from libalign.guidance import guided_quantize
    from libalign.spec.rounding import e4m3_bits_to_float, guide_tables
    from tests.libalign.test_guided_fused import SPEC, _case
    e4m3 = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
    for k, bits, rnd, grid in ((64, 1, False, False), (96, 2, True, False), (256, 3, False, False),
                               (256, 4, True, False), (64, 2, True, True), (96, 3, True, True)):
        x, guide = _case(21, k, bits, seed=k + bits, random_bits=rnd, grid=grid)
        q = guided_quantize(x, SPEC, guide)
        up, down = guide_tables(bits, "cpu")
        src = torch.where(guide.present, guide.index, -1).to(torch.int32)
        inner, dec = tk.guided_act_qdq(x, src=src, low=guide.low, block_scales=guide.block_scales,
                                       row_scales=guide.row_scales.float(), bits=bits,
                                       amax_floor=SPEC.amax_floor, e4m3=e4m3, up=up, down=down)
        rows = guide.present
        assert rows.any() and not rows.all()
        assert torch.equal(inner[rows], gemm.inner_values(q, torch.bfloat16)[rows]), (k, bits)
        assert torch.equal(dec[rows], gemm.row_decode_scales(q)[rows]), (k, bits)
    print("interpreted guided rows equal")
""")

GATHER = textwrap.dedent("""
    import torch
    from libalign import gemm
    from libalign.gemm import triton_kernels as tk
    lay = gemm.group_layout([13, 0, 1, 70, 3], 64)
    for k in (96, 256):  # 6 blocks: the chunked kernel; 16: whole-row tiles
        a = (torch.randn(lay.total, k, generator=torch.Generator().manual_seed(k)) * 3).to(
            torch.bfloat16)
        want = tk.act_qdq(lay.pad(a), amax_floor=None, tensor_amax=None)
        got = tk.act_qdq(a, amax_floor=None, tensor_amax=None, src_rows=lay.source_rows())
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)), k
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), k
    from libalign.spec.rounding import e4m3_bits_to_float, guide_tables
    from tests.libalign.test_guided_fused import SPEC, _case
    x, guide = _case(lay.total, 96, 2, seed=5, random_bits=True)
    src = torch.where(guide.present, guide.index, -1).to(torch.int32)
    src = (lay.pad((src + 1).reshape(-1, 1)) - 1).reshape(-1).contiguous()
    up, down = guide_tables(2, "cpu")
    kw = dict(src=src, low=guide.low, block_scales=guide.block_scales.view(torch.uint8),
              row_scales=guide.row_scales.float(), bits=2, amax_floor=SPEC.amax_floor,
              e4m3=e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8)), up=up, down=down)
    want = tk.guided_act_qdq(lay.pad(x), **kw)
    got = tk.guided_act_qdq(x, src_rows=lay.source_rows(), **kw)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    print("interpreted gather equal")
""")


def _interpret(script: str) -> str:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_inner_value_decode_in_the_triton_interpreter():
    """The Triton decode gives inner_values' bits for all 256 x 256 scale and code bytes
    (signed zeros included, NaN for the two NaN scale bytes) and for a quantized stack."""
    assert "interpreted decode equal" in _interpret(DECODE)


def test_guided_rows_in_the_triton_interpreter():
    """The fused guided pass gives guided_quantize's inner values and decode scales on every
    row with a record (sampler, random and tie-grid low bits, 1-4 bits)."""
    assert "interpreted guided rows equal" in _interpret(GUIDED)


def test_gathering_activation_pass_in_the_triton_interpreter():
    """The activation passes that read rows into the padded layout (``src_rows``) give the
    bits of the passes over the zero-padded copy: both unguided kernels and the guided one."""
    assert "interpreted gather equal" in _interpret(GATHER)
