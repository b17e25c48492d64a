"""Adversarial inputs for bitwise tests: where NVFP4 implementations disagree.

Mismatches between quantizers concentrate on exact ties (of E2M1 midpoints and of E4M3
rounding), on blocks whose scale underflows, on zero blocks and signed zeros, not in plain
Gaussian data. Every generator is seeded and returns a fresh tensor.
"""

from __future__ import annotations

import torch

_GRID = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(shape, generator=gen(seed)).to(dtype)


def mixed_magnitudes(shape, dtype=torch.bfloat16, seed=1):
    """Rows (and blocks) spanning 10^-6 .. 10^3."""
    g = gen(seed)
    x = torch.randn(shape, generator=g)
    rows = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g) * 9 - 6)
    blocks = 10.0 ** (torch.rand(*shape[:-1], shape[-1] // 16, 1, generator=g) * 4 - 2)
    x = (x.view(*shape[:-1], -1, 16) * blocks).view(shape) * rows
    return x.to(dtype)


def tie_heavy(shape, dtype=torch.bfloat16, seed=2):
    """Values on E2M1 midpoints and grid points times powers of two, bf16 exact.

    Each block's maximum is 6 * 2^e (so its scale is a power of two times 448 / 2^E),
    its other elements sit on the grid and on its midpoints: after scaling they land on
    or one ulp beside the midpoints, where operation order decides the code.
    """
    g = gen(seed)
    nb = shape[-1] // 16
    idx = torch.randint(0, len(_GRID), (*shape[:-1], nb, 16), generator=g)
    sign = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -1.0, 1.0)
    vals = _GRID[idx] * sign
    vals[..., 0] = 6.0
    e = torch.randint(-8, 8, (*shape[:-1], nb, 1), generator=g).float()
    x = (vals * torch.pow(2.0, e)).view(shape)
    # a k/64 grid layer on top, as bf16 data of small integers over 64
    k = torch.randint(-384, 385, shape, generator=g).float() / 64
    mask = torch.rand(shape, generator=g) < 0.3
    x = torch.where(mask, k, x)
    return x.to(dtype)


def e4m3_ties(shape, dtype=torch.float32, seed=3):
    """Block maxima chosen so the fp32 block scale lands near an E4M3 rounding midpoint."""
    g = gen(seed)
    nb = shape[-1] // 16
    # E4M3 midpoints between (8+m) and (9+m) at exponent e: (8.5 + m) * 2^(e-3)
    m = torch.randint(0, 7, (*shape[:-1], nb, 1), generator=g).float()
    e = torch.randint(-6, 8, (*shape[:-1], nb, 1), generator=g).float()
    target = (8.5 + m) * torch.pow(2.0, e - 3)  # the block scale we aim at
    x = torch.rand(*shape[:-1], nb, 16, generator=g) * 0.9 * (target * 6)
    x[..., :1] = target * 6
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    x = x.view(shape)
    # make each row's maximum 2688 so that enc == 1 for per-row specs
    row_max = x.abs().amax(-1, keepdim=True)
    x = torch.cat([x[..., :-16], torch.full_like(x[..., -16:], 0.5) * row_max], dim=-1)
    x[..., -16] = 2688.0
    return x.to(dtype)


def tiny_blocks(shape, dtype=torch.bfloat16, seed=4):
    """Rows whose maximum is ~1e3 with blocks of ~1e-8..1e-5: block scales underflow."""
    g = gen(seed)
    x = torch.randn(shape, generator=g)
    nb = shape[-1] // 16
    scale = 10.0 ** (torch.rand(*shape[:-1], nb, 1, generator=g) * 3 - 8)
    x = (x.view(*shape[:-1], nb, 16) * scale).view(shape)
    x[..., :16] = torch.randn(*shape[:-1], 16, generator=g) * 1e3
    return x.to(dtype)


def zeros_and_signs(shape, dtype=torch.bfloat16, seed=5):
    """Zero blocks, zero rows, -0.0 entries and tiny negatives next to normal data."""
    g = gen(seed)
    x = torch.randn(shape, generator=g)
    nb = shape[-1] // 16
    blk = x.view(*shape[:-1], nb, 16)
    zero_blocks = torch.rand(*shape[:-1], nb, 1, generator=g) < 0.2
    blk.masked_fill_(zero_blocks, 0.0)
    x = blk.view(shape)
    neg0 = torch.rand(shape, generator=g) < 0.1
    x = torch.where(neg0, torch.tensor(-0.0), x)
    tiny = torch.rand(shape, generator=g) < 0.05
    x = torch.where(tiny, torch.tensor(-1e-6), x)
    if shape[-2] > 2:
        x[..., 1, :] = 0.0
    return x.to(dtype)


FAMILIES = {
    "randn": randn,
    "mixed": mixed_magnitudes,
    "ties": tie_heavy,
    "e4m3_ties": e4m3_ties,
    "tiny": tiny_blocks,
    "zeros": zeros_and_signs,
}
