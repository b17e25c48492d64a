"""Host-side launch-grid arithmetic in plain Python.

A kernel's grid and block sizes come from two integer operations: ceiling division (programs
to cover ``n`` items ``block`` at a time) and the next power of two (a block that covers a row).
Triton exports both as ``triton.cdiv`` and ``triton.next_power_of_2``, but as functions that
can also run inside a kernel: called from the host, each call goes through Triton's
compile-time dispatch and costs a few microseconds. A decode-sized launch spends tens of
microseconds on the host in all, so the host side uses these instead (same results for every
non-negative integer).
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for ``n >= 0``, ``d > 0``."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
