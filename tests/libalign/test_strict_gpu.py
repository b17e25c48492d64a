"""Strict execution on a CUDA device: decode equals scoring bit for bit there, the strict ops
(IEEE element-wise operations, and the Triton K-ordered product of :mod:`libalign.strict.triton_matmul`)
give the CPU's bits, and so does the tiny model's strict scoring. Run on the H200.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from libalign.models import build_model, generate, score_sequences, strict, tiny_config
from libalign.strict import ops as strict_ops
from libalign.strict.triton_matmul import kordered_matmul

pytestmark = pytest.mark.gpu

PAD, EOS = 0, 2


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [[1, *torch.randint(3, 15, (1 + (i * 5) % 11,), generator=g).tolist()] for i in range(n)]


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_strict_decode_equals_scoring_on_cuda_and_matches_the_cpu(path):
    """On CUDA, batch sizes 1..8 with prompts of different lengths: every decode-time log-prob
    equals the learner's teacher-forced one bitwise, and equals the CPU strict model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu = build_model(tiny_config(), seed=7)
    dev = build_model(tiny_config(), seed=7).to("cuda")
    with strict.use_strict(cpu, mode="portable"), strict.use_strict(dev, mode="portable"):
        for b in (1, 3, 8):
            r = generate(dev, _prompts(b), path, max_new_tokens=6, seed=b, batch_size=b,
                         eos_id=EOS, pad_id=PAD)
            lp = score_sequences(dev, r.sequences, r.prompt_lens, path, batch_size=8, pad_id=PAD)
            on_cpu = score_sequences(cpu, r.sequences, r.prompt_lens, path, batch_size=3,
                                     pad_id=PAD)
            for x, y, z in zip(lp, r.logprobs, on_cpu, strict=True):
                assert torch.equal(x, y)
                assert torch.equal(x, z)


def test_strict_ops_agree_between_cuda_and_cpu():
    """exp, log, log_softmax, linear and rms_norm give the CPU's bits on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g).bfloat16()
    w = torch.randn(96, 256, generator=g).bfloat16()
    v = torch.randn(5, 1000, generator=g) * 4

    def cases(dev):
        xd, wd, vd = x.to(dev), w.to(dev), v.to(dev)
        return [strict_ops.exp(vd), strict_ops.log(vd.abs() + 1e-3), strict_ops.log_softmax(vd),
                strict_ops.linear(xd, wd), strict_ops.rms_norm(xd, wd[0, :], 1e-6)]

    for a, b in zip(cases("cpu"), cases("cuda"), strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kordered_kernel_gives_the_cpu_loop_bits(dtype):
    """The Triton K-ordered product equals matmul_f32's torch loop on the CPU bit for bit
    (fp32 operands too, whose products are inexact: no fused multiply-add), for every M from 1
    (a decode row) to 70 and odd N and K; a row alone equals the same row inside the batch; the
    +0 start of a slot-ordered sum keeps the sign of an all-zero result."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    for m, n, k in ((1, 33, 17), (7, 130, 256), (70, 1, 5), (70, 96, 1), (33, 200, 768)):
        a = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        want = strict_ops.matmul_f32(a, w)                   # the CPU's torch loop
        got = kordered_matmul(a.cuda(), w.cuda()).cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (m, n, k)
        alone = kordered_matmul(a[-1:].cuda(), w.cuda()).cpu()
        assert torch.equal(alone.view(torch.int32), got[-1:].view(torch.int32))
    e = torch.zeros(2, 3, 4)
    v = -torch.rand(2, 5, 4)                                 # every product is -0
    sums = kordered_matmul(e.cuda(), v.cuda(), zero_init=True).cpu()
    assert torch.equal(sums.view(torch.int32), torch.zeros(2, 3, 5).view(torch.int32))


def test_strict_attention_on_cuda_gives_the_cpu_bits():
    """Slot-ordered attention (the Triton slot sums on CUDA, the torch loop on the CPU) gives the
    same bits for grouped queries, a causal mask and a query that sees no key."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 6, 32, generator=g).bfloat16()
    k = torch.randn(2, 2, 9, 32, generator=g).bfloat16()
    v = torch.randn(2, 2, 9, 32, generator=g).bfloat16()
    allowed = torch.ones(2, 1, 6, 9, dtype=torch.bool).tril(3)
    allowed[1, :, 0] = False
    want = strict_ops.attention(q, k, v, allowed, 0.125)
    got = strict_ops.attention(q.cuda(), k.cuda(), v.cuda(), allowed.cuda(), 0.125).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
