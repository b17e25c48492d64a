"""Pins the Triton kernels against the spec and each other in Triton's interpreter.

Where Triton is installed but no GPU is (a CI runner), each script runs in a subprocess with
``TRITON_INTERPRET=1``, which executes the kernels with NumPy on the CPU: the inner-value
decode (:func:`libalign.gemm.triton_kernels.inner_from_codes`) must give
:func:`libalign.gemm.inner_values`'s bits for every scale and code byte, and the fused guided
pass (:func:`libalign.gemm.triton_kernels.guided_act_qdq`) guided_quantize's values on the rows that
have a record. The two-phase GEMM's kernels are pinned to the one-phase ones: the codes the
activation passes write (:func:`~libalign.gemm.triton_kernels.act_codes`, the guided pass's
``codes``) decode to the inner values the one-phase passes write, and the GEMM that decodes
them in its loads (:func:`~libalign.gemm.triton_kernels.grouped_gemm_codes`) gives the
one-phase GEMM's bits. The interpreter's E4M3 conversion is not the hardware's, so rows
rounded under their own scales are compared with the spec only where the two casts agree;
the rest is left to the GPU tests. Its bf16 dot is not the hardware's either, so the GEMMs are
compared on fp16 operands (the inner values are exact in both). Skipped without Triton.
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


CODES = textwrap.dedent("""
    import torch
    from libalign.gemm import triton_kernels as tk
    from libalign.spec import PRESETS, quantize
    from libalign.spec.rounding import e4m3_bits_to_float
    e4m3 = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
    g = torch.Generator().manual_seed(7)
    agree = total = 0
    for k, chunk in ((64, None), (768, None), (768, 8), (2048, None), (80, 0), (80, None)):
        for ties in (False, True):
            a = torch.randn(19, k, generator=g) * torch.exp(torch.randn(19, 1, generator=g) * 2)
            if ties:  # E2M1 midpoints once scaled
                a = torch.randint(-12, 13, (19, k), generator=g).float() * 0.25
                a[:, ::16] = 6.0
            a[0] = 0.0
            a[1, :9] = -0.0
            a[2] *= 1e-30
            a[3, 5] = float("nan")
            a[4, 6] = float("inf")
            x = a.to(torch.bfloat16)
            for spec, tensor in ((PRESETS["minite"], False), (PRESETS["te"], True)):
                amax = x.float().abs().nan_to_num(0, 0, 0).amax().reshape(1) if tensor else None
                inner, dec = tk.act_qdq(x, amax_floor=spec.amax_floor, tensor_amax=amax, chunk=chunk)
                codes, scales, dec2 = tk.act_codes(x, amax_floor=spec.amax_floor, tensor_amax=amax,
                                                   chunk=chunk)
                assert codes.stride(0) % 16 == 0 and codes.shape == (19, k // 2)
                assert torch.equal(dec2.view(torch.int32), dec.view(torch.int32)), k
                fin = ~torch.isnan(dec)
                assert int(fin.sum()) == 17
                back = tk.inner_from_codes(codes.contiguous(), scales, e4m3)
                assert torch.equal(back[fin].view(torch.int16), inner[fin].view(torch.int16)), (k, chunk)
                if spec.signed_zero == "positive":  # the spec's codes where the E4M3 casts agree
                    q = quantize(x[fin], spec)
                    same = (q.block_scales.view(torch.uint8) == scales[fin]).all(-1)
                    agree += int(same.sum())
                    total += int(same.numel())
                    assert torch.equal(codes[fin][same], q.codes[same]), (k, chunk)
                    assert torch.equal(dec[fin][same].view(torch.int32),
                                       q.outer_dec.reshape(-1)[same].view(torch.int32))
    assert agree >= total // 4, (agree, total)
    print("interpreted codes equal", agree, total)
""")

GUIDED_CODES = textwrap.dedent("""
    import torch
    from libalign.gemm import triton_kernels as tk
    from libalign.guidance import guided_quantize
    from libalign.spec.rounding import e4m3_bits_to_float, guide_tables
    from tests.libalign.test_guided_fused import SPEC, _case
    e4m3 = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
    for k, bits, rnd, grid in ((64, 1, False, False), (96, 2, True, False), (768, 4, False, False),
                               (256, 4, True, False), (96, 3, True, True)):
        x, guide = _case(21, k, bits, seed=k + bits, random_bits=rnd, grid=grid)
        x[2, 3] = float("nan")
        up, down = guide_tables(bits, "cpu")
        src = torch.where(guide.present, guide.index, -1).to(torch.int32)
        kw = dict(src=src, low=guide.low, block_scales=guide.block_scales,
                  row_scales=guide.row_scales.float(), bits=bits, amax_floor=SPEC.amax_floor,
                  e4m3=e4m3, up=up, down=down)
        inner, dec = tk.guided_act_qdq(x, **kw)
        codes, scales, dec2 = tk.guided_act_qdq(x, codes=True, **kw)
        assert torch.equal(dec2.view(torch.int32), dec.view(torch.int32))
        eight = tk.guided_act_qdq(x, codes=True, rows=8, **kw)  # the GEMM path's tile
        assert torch.equal(eight[0], codes) and torch.equal(eight[1], scales)
        fin = ~torch.isnan(dec)
        assert int(fin.sum()) == 20
        back = tk.inner_from_codes(codes.contiguous(), scales, e4m3)
        assert torch.equal(back[fin].view(torch.int16), inner[fin].view(torch.int16)), (k, bits)
        x[2] = 0.0
        q = guided_quantize(x, SPEC, guide)
        rows = guide.present & fin
        assert rows.any() and not rows.all()
        assert torch.equal(codes[rows], q.codes[rows]), (k, bits)
        assert torch.equal(scales[rows], q.block_scales.view(torch.uint8)[rows]), (k, bits)
    print("interpreted guided codes equal")
""")

CODES_GEMM = textwrap.dedent("""
    import torch
    from libalign import gemm
    from libalign.gemm import triton_kernels as tk
    from libalign.spec import NVFP4Tensor, PRESETS
    from libalign.spec.rounding import e4m3_bits_to_float
    e4m3 = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
    g = torch.Generator().manual_seed(3)
    # the decode: every code byte under every finite scale byte, read out through identity weights
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 32)
    scales[torch.isnan(e4m3)] = 0
    codes, sc = tk.code_buffers(256, 512, "cpu")
    codes.copy_(torch.arange(256, dtype=torch.uint8).repeat(256, 1))
    sc.copy_(scales)
    eye = torch.eye(512, dtype=torch.float16).reshape(1, 512, 512)
    ones = torch.ones(1, 512)
    tiles = torch.zeros(4, dtype=torch.int32)
    out = tk.grouped_gemm_codes(codes, sc, torch.ones(256), eye, ones, tiles, 64, torch.float32,
                                config=tk.CONFIGS[10], sms=5)
    q = NVFP4Tensor(codes.contiguous(), sc.view(torch.float8_e4m3fn), torch.ones(256),
                    PRESETS["minite"], (256, 512))
    want = gemm.inner_values(q, torch.float32)
    assert torch.equal(out, want) and int((out != 0).sum()) > 100000
    # the GEMM: codes decoded in the loads give the one-phase kernel's bits (fp16 operands: the
    # interpreter's bf16 dot is not the hardware's)
    for k, n, counts, pad, ci in ((96, 128, [64, 0, 128], 64, 11), (128, 256, [128, 64], 64, 6),
                                  (80, 128, [64, 64], 64, 10), (256, 128, [128], 128, 2)):
        mp = sum(counts)
        c, s = tk.code_buffers(mp, k, "cpu")
        c.copy_(torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8))
        s.copy_(torch.randint(0, 0x7F, s.shape, generator=g, dtype=torch.uint8))
        dec = torch.rand(mp, generator=g) * 1e-3
        w = (torch.randint(-6, 7, (len(counts), n, k), generator=g).float() * 0.5).to(torch.float16)
        wdec = torch.rand(len(counts), n, generator=g)
        tiles = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32),
                                        torch.tensor(counts) // pad)
        inner = tk.inner_from_codes(c.contiguous(), s, e4m3)
        rows = tiles.repeat_interleave(pad).long()
        acc = torch.einsum("mk,mnk->mn", inner.double(), w.double()[rows])
        for od, ints in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
            one = tk.grouped_gemm(inner.to(torch.float16), dec, w, wdec, tiles, pad, od,
                                  config=tk.CONFIGS[ci], sms=3)
            two = tk.grouped_gemm_codes(c, s, dec, w, wdec, tiles, pad, od, config=tk.CONFIGS[ci],
                                        sms=3)
            assert torch.equal(one.view(ints), two.view(ints)), (k, n, od)
            ref = (acc.float() * (dec[:, None] * wdec[rows])).to(od)
            assert torch.allclose(two.float(), ref.float(), rtol=1e-2, atol=0), (k, n, od)
    print("interpreted codes GEMM equal")
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


def test_activation_codes_in_the_triton_interpreter():
    """act_codes' codes and scale bytes decode to act_qdq's inner values bit for bit (whole-row
    and chunked walks, K=80 and 768 not a power of two blocks, amax floor and tensor amax,
    zero, -0.0, tiny, tie and NaN/Inf rows, the latter NaN decode scales in both), zeros as
    code 0x0; and equal the spec's codes and decode scales on the rows whose E4M3 casts agree
    with the spec's."""
    assert "interpreted codes equal" in _interpret(CODES)


def test_guided_codes_in_the_triton_interpreter():
    """The guided pass's codes decode to its inner values bit for bit; on the rows with a
    record they are guided_quantize's codes and the record's scale bytes."""
    assert "interpreted guided codes equal" in _interpret(GUIDED_CODES)


def test_codes_gemm_in_the_triton_interpreter():
    """The GEMM that decodes codes in its loads reads every code byte under every finite scale
    byte as inner_values does, and gives the one-phase GEMM's output bits (fp32 and bf16) for
    uneven and empty experts, K not a multiple of the tile (80, 96) and persistent tiles."""
    assert "interpreted codes GEMM equal" in _interpret(CODES_GEMM)
