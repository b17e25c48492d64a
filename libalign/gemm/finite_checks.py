"""NaN/Inf checks of GPU activations, now or deferred to one synchronisation per step.

Why
---
An NVFP4 row scale computed from a NaN or Inf is not a number, so a quantized GEMM must not
multiply such a row silently: :mod:`libalign.gemm`'s fused paths raise
:class:`~libalign.errors.NonFiniteError` instead. On a GPU the kernel that quantizes the
activations already produces the evidence, one fp32 decode scale per row, which is non-finite
exactly when the row holds a NaN or Inf. Reading it on the host, though, is a device
synchronisation: the host waits for every kernel queued so far and, meanwhile, queues nothing.
A Megatron-style forward runs hundreds of small kernels between two expert GEMMs; with one
sync per GEMM the device idles while the host catches up (``python -m tests.bench megatron``
prints a step with a sync per GEMM against one without, at Qwen3-30B-A3B layer shapes).

So the check has two modes:

* **now** (the default, outside any block): :func:`check_rows` reads the flag at once and
  raises at the offending call, with counts and positions;
* **deferred**: inside ``with deferred_finite_checks():`` each call only queues a one-element
  device reduction (no sync). Leaving the block reads all of them with one synchronisation
  and raises the same error for the first offending call, naming it. A training step wraps
  its forward and backward in the block, so a NaN still stops the step *before* the optimizer
  touches a weight: nothing is half-applied; only the point where the error surfaces moves.

The error's detail (how many NaN and Inf, where) needs the activations themselves. The block
keeps a weak reference to each, never the tensor: autograd usually still holds the input of
a GEMM it will differentiate, and then the error is as detailed as an immediate check's; if
the tensor is gone, the error counts the non-finite rows instead.
"""

from __future__ import annotations

import contextvars
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from libalign.errors import NonFiniteError
from libalign.spec import check_finite


@dataclass
class DeferredChecks:
    """The checks queued in one :func:`deferred_finite_checks` block."""

    oks: list[torch.Tensor] = field(default_factory=list)
    """One 0-d device tensor per call: its largest row decode scale (finite iff every row
    is)."""
    evidence: list[tuple[str, torch.Tensor, weakref.ref, Callable | None]] = field(
        default_factory=list)
    """Per call: its name, its row decode scales, a weak reference to its activations and the
    map from the scales' rows to the activations' (None: the same rows)."""

    @property
    def count(self) -> int:
        """How many calls were queued."""
        return len(self.oks)

    def verify(self) -> None:
        """Read every queued flag with one synchronisation per device; raise
        :class:`~libalign.errors.NonFiniteError` for the first call whose rows were not
        finite, then forget them all."""
        oks, evidence = self.oks, self.evidence
        self.oks, self.evidence = [], []
        if not oks:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, ok in enumerate(oks):
            by_device.setdefault(ok.device, []).append(i)
        bad: list[int] = []
        for idx in by_device.values():
            flags = torch.isfinite(torch.stack([oks[i] for i in idx])).tolist()
            bad += [i for i, f in zip(idx, flags, strict=True) if not f]
        if not bad:
            return
        first = min(bad)
        what, dec, ref, rows_of = evidence[first]
        label = f"{what} (call {first + 1} of {len(oks)} in a deferred check)"
        x = ref()
        if x is not None:
            check_finite(x, label)  # raises with element counts and positions
        if rows_of is not None:
            dec = rows_of(dec)
        rows = torch.nonzero(~torch.isfinite(dec)).reshape(-1)
        nan = int(torch.isnan(dec).sum())
        raise NonFiniteError(f"{label}, rows (the activations are no longer held)",
                             int(rows.numel()), nan, int(rows.numel()) - nan,
                             [(int(r),) for r in rows[:5].tolist()])


_ACTIVE: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar(
    "libalign_deferred_finite_checks", default=None)


@contextmanager
def deferred_finite_checks() -> Iterator[DeferredChecks]:
    """Defer :func:`check_rows` inside the block; verify them all when it ends normally.

    Blocks nest: an inner block verifies its own calls when it ends. If the block raises,
    its queued checks are dropped and the original exception propagates.
    """
    checks = DeferredChecks()
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)
    checks.verify()


def check_rows(dec: torch.Tensor, x: torch.Tensor, what: str = "activations",
               rows_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Check that ``x`` ``[rows, K]`` is finite, given the row decode scales ``dec`` that its
    quantization produced (``>= 0``, and NaN or Inf exactly where a row holds NaN/Inf, as the
    Triton activation pass writes them; ``rows_of`` maps them to ``x``'s rows when ``dec`` is
    over a padded layout).

    The evidence is one reduction, ``dec.amax()``: it propagates NaN and keeps Inf, so it is
    finite iff every row is (one kernel per call, where ``isfinite(dec).all()`` takes five).

    Outside a :func:`deferred_finite_checks` block this synchronises and raises
    :class:`~libalign.errors.NonFiniteError` now; inside it queues the check.
    """
    if dec.numel() == 0:
        return
    checks = _ACTIVE.get()
    if checks is None:
        if not math.isfinite(float(dec.amax())):
            check_finite(x, what)
        return
    checks.oks.append(dec.amax())
    checks.evidence.append((what, dec, weakref.ref(x), rows_of))
