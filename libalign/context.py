"""Context independence: do a row's NVFP4 bits depend on the rows quantized beside it?

In a grouped expert GEMM the rows of one expert's input come from whatever tokens the
router sent there, so a token's quantized activations should not change when its
companions change. With a per-tensor outer scale they do: the shared amax moves with the
companions, and with it every block scale and code. A per-row outer scale removes that
dependence by construction.

:func:`context_swap` tests it the way the miniTE paper does: fix the target rows and
their positions, swap every other row for (1) the original companions, (2) the
lowest-amplitude and (3) the highest-amplitude rows of a pool, (4) zero padding, and
compare the target rows' codes, block scales, outer scales and dequantized values bit
for bit against the original context.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libalign.errors import ShapeError
from libalign.spec import NumericsSpec, NVFP4Tensor, quantize

CONTEXTS = ("original", "low_amplitude", "high_amplitude", "zero_padding")


@dataclass(frozen=True)
class ContextCase:
    """Outcome for one companion context, relative to the original context."""

    context: str
    codes_equal: bool
    scales_equal: bool
    outer_equal: bool
    values_equal: bool
    payload_sha256: str

    @property
    def identical(self) -> bool:
        """All four comparisons bitwise equal."""
        return self.codes_equal and self.scales_equal and self.outer_equal and self.values_equal


@dataclass(frozen=True)
class ContextReport:
    """Per-context outcomes for one spec."""

    spec_name: str
    target_rows: tuple[int, ...]
    cases: tuple[ContextCase, ...]

    @property
    def independent(self) -> bool:
        """True when the targets are bitwise identical in every context."""
        return all(c.identical for c in self.cases)

    def changed(self) -> list[str]:
        """Names of the contexts that changed the targets."""
        return [c.context for c in self.cases if not c.identical]


def _target_view(q: NVFP4Tensor, rows: torch.Tensor):
    codes = q.codes[rows]
    scales = q.block_scales.view(torch.uint8)[rows]
    if q.outer_scale is None:
        outer = torch.zeros(0, dtype=torch.int32)
    elif q.outer_scale.ndim == 0:
        outer = q.outer_scale.reshape(1).view(torch.int32)
    else:
        outer = q.outer_scale[rows].view(torch.int32)
    values = q.dequantize(torch.float32)[rows].view(torch.int32)
    return codes, scales, outer, values


def amplitude_companions(pool: torch.Tensor, n: int, highest: bool) -> torch.Tensor:
    """``n`` rows of ``pool``: its lowest- (or highest-) amplitude rows by max |x|, cycled."""
    order = torch.argsort(pool.float().abs().amax(-1), descending=highest, stable=True)
    idx = order[torch.arange(n) % max(len(order), 1)]
    return pool[idx]


def context_swap(
    x: torch.Tensor,
    target_rows: Sequence[int],
    spec: NumericsSpec,
    pool: torch.Tensor | None = None,
) -> ContextReport:
    """Quantize ``x`` [M, K] in four companion contexts and compare the target rows.

    ``pool`` supplies the low/high-amplitude companions (default: the non-target rows of
    ``x`` itself). Target positions, shape and spec stay fixed across contexts.
    """
    if x.ndim != 2:
        raise ShapeError(f"context_swap takes a 2-D activation matrix, got shape {tuple(x.shape)}")
    m = x.shape[0]
    rows = torch.tensor(sorted(set(int(r) for r in target_rows)), dtype=torch.long)
    if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= m:
        raise ShapeError(f"target rows must be a non-empty subset of 0..{m - 1}")
    others = torch.ones(m, dtype=torch.bool)
    others[rows] = False
    n_comp = int(others.sum())
    pool = x[others] if pool is None else pool
    if pool.ndim != 2 or pool.shape[1] != x.shape[1] or (pool.shape[0] == 0 and n_comp):
        raise ShapeError(f"pool must be [P, {x.shape[1]}] with P > 0, got {tuple(pool.shape)}")

    variants = {
        "original": x[others],
        "low_amplitude": amplitude_companions(pool, n_comp, highest=False),
        "high_amplitude": amplitude_companions(pool, n_comp, highest=True),
        "zero_padding": torch.zeros((n_comp, x.shape[1]), dtype=x.dtype),
    }
    base = None
    cases = []
    for name in CONTEXTS:
        xc = x.clone()
        xc[others] = variants[name].to(x.dtype)
        view = _target_view(quantize(xc, spec), rows)
        if base is None:
            base = view
        eq = [torch.equal(a, b) for a, b in zip(view, base, strict=True)]
        sha = hashlib.sha256(view[0].contiguous().numpy().tobytes()).hexdigest()
        cases.append(ContextCase(name, *eq, payload_sha256=sha))
    return ContextReport(spec.name, tuple(rows.tolist()), tuple(cases))
