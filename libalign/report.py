"""A conversion report: what NVFP4 under each preset does to a stack of expert weights.

For one synthetic MoE layer of expert weights (seeded, BF16, heavy-tailed rows like real
checkpoints) it quantizes under every preset and reports size, quality against the BF16
original, how many codes and scale bytes differ from the ``minite`` preset, and how long
the reference took. The reference is the truth; beside it the report runs the fast path
(:func:`libalign.kernels.quantize`: the compiled kernel where one serves the preset, else the
spec again) on the same tensor, says which backend served it, whether its bits equal the
reference's, and its bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from libalign.kernels import ops
from libalign.spec import PRESETS, NumericsSpec, dequantize, quantize


@dataclass(frozen=True)
class PresetRow:
    """One preset's outcome on the report tensor."""

    preset: str
    bytes_in: int
    bytes_out: int
    rel_l2: float
    max_abs_err: float
    codes_vs_minite: float
    scales_vs_minite: float
    seconds: float
    backend: str = "spec"
    fast_bit_exact: bool = True
    fast_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Effective bandwidth of the reference: (bytes in + bytes out) / time."""
        return (self.bytes_in + self.bytes_out) / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def fast_gbps(self) -> float:
        """Effective bandwidth of the fast path (best of a few calls)."""
        moved = self.bytes_in + self.bytes_out
        return moved / self.fast_seconds / 1e9 if self.fast_seconds else 0.0


def synthetic_experts(experts: int = 8, rows: int = 384, k: int = 512, seed: int = 0):
    """BF16 expert stack with per-row magnitudes spread like trained weights."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, k, generator=g)
    row_scale = torch.exp(torch.randn(experts, rows, 1, generator=g) * 0.5) * 0.02
    outliers = torch.rand(experts, rows, k, generator=g) < 1e-3
    w = torch.where(outliers, w * 20, w) * row_scale
    return w.to(torch.bfloat16)


def conversion_report(w: torch.Tensor, presets: dict[str, NumericsSpec] | None = None):
    """Quantize ``w`` under each preset; return one :class:`PresetRow` per preset."""
    presets = PRESETS if presets is None else presets
    ref = w.float()
    base = quantize(w, PRESETS["minite"])
    rows = []
    for name, spec in presets.items():
        t0 = time.perf_counter()
        q = quantize(w, spec)
        dt = time.perf_counter() - t0
        backend = ops.backend_for(w, spec)
        fast, best = None, float("inf")
        for _ in range(3):
            t1 = time.perf_counter()
            fast = ops.quantize(w, spec)
            best = min(best, time.perf_counter() - t1)
        d = dequantize(q, torch.float32)
        err = d - ref
        rows.append(PresetRow(
            preset=name,
            bytes_in=w.numel() * w.element_size(),
            bytes_out=q.nbytes,
            rel_l2=float(err.norm() / ref.norm()),
            max_abs_err=float(err.abs().max()),
            codes_vs_minite=float((q.codes != base.codes).float().mean()),
            scales_vs_minite=float((q.block_scales.view(torch.uint8)
                                    != base.block_scales.view(torch.uint8)).float().mean()),
            seconds=dt,
            backend=backend,
            fast_bit_exact=fast.bitwise_equal(q),
            fast_seconds=best,
        ))
    return rows
