"""The spec's self-check: the facts every NVFP4 bit rests on, verified at run time.

Each check returns a :class:`Check` with what it verified and a one-line detail, so the
``alignd demo`` main job (and anyone debugging a new build) can see that the format
tables, the rounding rules, the layouts and the row-scaling guarantee hold on this
machine, with this PyTorch, before trusting any converted weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from libalign.context import context_swap
from libalign.spec import PRESETS, dequantize, encode_with_scales, quantize, roundtrip_codes
from libalign.spec.constants import E2M1_MIDPOINTS, E2M1_VALUES, E4M3_MAX
from libalign.spec.packing import pack_nibbles, swizzle_scales, unpack_nibbles, unswizzle_scales
from libalign.spec.rounding import e2m1_code_values, e4m3_bits_to_float, round_e2m1, round_e4m3_bits


@dataclass(frozen=True)
class Check:
    """One verified fact."""

    name: str
    passed: bool
    detail: str


def _e2m1_table() -> Check:
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_code_values(codes)
    ok = vals.tolist() == list(E2M1_VALUES) and bool(torch.signbit(vals[8]))
    back = round_e2m1(vals.clone(), "sign_of_input")
    ok = ok and torch.equal(back, codes)
    return Check("E2M1 code table", ok, "16 codes decode to 0..6 and -0..-6 and encode back")


def _e2m1_ties() -> Check:
    mids = torch.tensor(E2M1_MIDPOINTS)
    got = e2m1_code_values(round_e2m1(mids)).tolist()
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    return Check("E2M1 ties to even", got == want, f"midpoints {list(E2M1_MIDPOINTS)} -> {got}")


def _e4m3_roundtrip() -> Check:
    bits = torch.arange(0x7F, dtype=torch.uint8)  # every finite non-negative byte
    vals = e4m3_bits_to_float(bits)
    ok = torch.equal(round_e4m3_bits(vals), bits)
    mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32
    tie = round_e4m3_bits(mids)
    even = torch.where(bits[:-1] % 2 == 0, bits[:-1], bits[1:])
    ok = ok and torch.equal(tie, even)
    sat = round_e4m3_bits(torch.tensor([E4M3_MAX])).item() == 0x7E
    return Check("E4M3 RNE", ok and sat,
                 "127 finite bytes round-trip, 126 midpoints tie to even, 448 -> 0x7E")


def _layouts() -> Check:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 38), generator=g, dtype=torch.uint8)
    ok = torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    ok = ok and pack_nibbles(torch.tensor([[0x1, 0xF]], dtype=torch.uint8)).item() == 0xF1
    s = torch.randint(0, 0x7F, (3, 130, 7), generator=g, dtype=torch.uint8)
    ok = ok and torch.equal(unswizzle_scales(swizzle_scales(s), tuple(s.shape)), s)
    return Check("packing and 128x4 swizzle", ok,
                 "low nibble = even index; swizzle inverts on padded 3x130x7")


def _presets_roundtrip() -> Check:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 32, 96, generator=g) * 3).to(torch.bfloat16)
    bad = []
    for name, spec in PRESETS.items():
        q = quantize(x, spec)
        again = encode_with_scales(dequantize(q, torch.float32), q)
        if not torch.equal(again, roundtrip_codes(q)):
            bad.append(name)
    return Check("re-encoding dequantized values", not bad,
                 f"{len(PRESETS)} presets reproduce their codes with their scales"
                 + (f", failing: {bad}" if bad else ""))


def _context() -> Check:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    x[::7] *= 40  # outlier rows among the companions
    targets = range(60, 68)
    pool = torch.randn(64, 256, generator=g).to(torch.bfloat16) * 100
    row = context_swap(x, targets, PRESETS["minite"], pool=pool)
    tensor = context_swap(x, targets, PRESETS["te"], pool=pool)
    ok = row.independent and not tensor.independent
    return Check("context independence", ok,
                 f"minite identical in {len(row.cases)} contexts; per-tensor te changed in "
                 f"{tensor.changed()}")


CHECKS: tuple[Callable[[], Check], ...] = (
    _e2m1_table, _e2m1_ties, _e4m3_roundtrip, _layouts, _presets_roundtrip, _context,
)


def run_selfcheck() -> list[Check]:
    """Run every check; a check that raises is reported as failed, not propagated."""
    out = []
    for fn in CHECKS:
        try:
            out.append(fn())
        except Exception as exc:  # a broken build must still produce a report
            out.append(Check(fn.__name__.strip("_"), False, f"raised {exc!r}"))
    return out
