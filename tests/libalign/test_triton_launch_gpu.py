"""Launches through :mod:`libalign.kernels.triton_launch` run the compiled kernel Triton's own
``kernel[grid]`` would run: with ``CHECK`` on, every fast launch asks Triton for its choice
(aligned and misaligned operands, a single row, every strict kernel), and the outputs equal
those of Triton's path."""

from __future__ import annotations

import pytest
import torch

from libalign.kernels import triton_launch

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_launch, "CHECK", True)
    return torch.device("cuda")


def _rand(*shape, seed=0, dtype=torch.bfloat16, offset=0):
    """A CUDA tensor whose data starts ``offset`` elements into its buffer."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + offset, generator=g).to("cuda", dtype)
    return flat[offset:].view(*shape)


def _calls():
    from libalign.strict import attention, tensorcore

    w = _rand(256, 512, seed=1) * 0.05
    ex = _rand(4, 128, 512, seed=2) * 0.05
    counts = torch.tensor([3, 0, 5, 1], device="cuda")
    q, k, v = _rand(2, 8, 1, 64, seed=3), _rand(2, 2, 300, 64, seed=4), _rand(2, 2, 300, 64, seed=5)
    seen = torch.ones(2, 1, 1, 300, dtype=torch.bool, device="cuda")
    seen[0, ..., :7] = False
    return [
        ("matmul", lambda off: tensorcore.matmul(_rand(8, 512, seed=6, offset=off), w)),
        ("matmul one row", lambda off: tensorcore.matmul(_rand(1, 512, seed=7, offset=off), w)),
        ("grouped", lambda off: tensorcore.grouped_matmul(_rand(9, 512, seed=8, offset=off), ex,
                                                          counts, out_dtype=torch.bfloat16)),
        ("rms_norm", lambda off: tensorcore.rms_norm(_rand(5, 512, seed=9, offset=off),
                                                     _rand(512, seed=10), 1e-6)),
        ("log_softmax", lambda off: tensorcore.log_softmax(
            _rand(3, 5000, seed=11, dtype=torch.float32, offset=off))),
        ("combine", lambda off: tensorcore.combine_rows(
            _rand(12, 256, seed=12, offset=off), torch.randperm(12, device="cuda"),
            torch.rand(4, 3, device="cuda"), torch.bfloat16)),
        ("attention", lambda off: attention.attention(q, k, v, seen, 0.125)),
    ]


@pytest.mark.parametrize("offset", [0, 1, 8])
def test_fast_launches_run_tritons_choice(cuda, offset):
    """Each strict call twice (the second launches from the cache) on operands that start at
    ``offset`` elements (misaligned for 1): Triton agrees with every cached launch, and the two
    calls give the same bits."""
    for name, call in _calls():
        torch.manual_seed(0)
        first = call(offset)
        torch.manual_seed(0)
        again = call(offset)
        assert torch.equal(first, again), name


def test_the_cache_is_used(cuda):
    """After two equal calls the matmul kernel keeps a specialization (the second call took
    the fast path)."""
    from libalign.strict import tensorcore

    w = _rand(256, 512, seed=1)
    for _ in range(2):
        tensorcore.matmul(_rand(8, 512, seed=6), w)
    assert len(triton_launch.launched(tensorcore._matmul_kernel)) >= 1
