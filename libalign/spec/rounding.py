"""Bit-exact rounding of fp32 values to E2M1 codes and to E4M3 bytes.

Everything here is explicit integer-and-comparison arithmetic on float32 tensors; nothing
relies on ``tensor.to(torch.float8_e4m3fn)``, whose saturation behaviour changed across
PyTorch releases. Callers clamp before calling: E2M1 inputs to [-6, 6] (values beyond
saturate anyway), E4M3 inputs to [0, 448].

E2M1 round-to-nearest-even
    The eight magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7). The magnitude code
    of ``a = |z|`` is the number of midpoints ``a`` has passed, where passing a midpoint
    whose upper neighbour is odd needs a strict ``>`` and one whose upper neighbour is even
    needs ``>=``: ``(a>0.25)+(a>=0.75)+(a>1.25)+(a>=1.75)+(a>2.5)+(a>=3.5)+(a>5)``. Each
    midpoint is exactly representable, so ties go to the even code with no rounding error.

E2M1 round-half-away (SGLang's block-16 KV quantizer)
    The same magnitudes with ``>=`` at every midpoint, so an exact midpoint goes to the code
    of larger magnitude: 0.25->0.5, 1.25->1.5, 2.5->3, 5->6 (0.75, 1.75 and 3.5 round as RNE
    does). :func:`round_e2m1` takes the rule as ``ties``.

E4M3 round-to-nearest-even (bias 7, 3 mantissa bits, max 448, no Inf)
    A value ``v >= 2^-6`` is normal: with ``2^E <= v < 2^(E+1)`` its quantum is
    ``2^(E-3)``, ``k = rne(v / 2^(E-3))`` lies in [8, 16] (16 carries into the exponent) and
    the byte is ``(E+7) << 3 | (k-8)``. A smaller value is subnormal with quantum 2^-9:
    the byte is ``rne(v * 2^9)``, and 8 lands exactly on the smallest normal, 0x08.
    Scaling by a power of two is exact, and ``torch.round`` rounds half to even.

E8M0 (MXFP4's block scale, bias 127, no mantissa, no sign)
    A byte ``b`` is exactly ``2^(b - 127)``: 0x00 is the fp32 subnormal 2^-127 and 0xFF
    is NaN. :func:`e8m0_bits_to_float` builds the fp32 bit pattern directly; the rules
    that pick ``b`` from a block maximum live in :mod:`libalign.spec.scale_math` (one per scale
    mode). :func:`block_scale_values` decodes either scale format by the tensor's dtype.

Guided rounding (TRACE, E2M1 only)
    The learner re-quantizes an activation the sampler already quantized, from slightly
    different bf16 values. Where plain rounding would flip a code across a midpoint (2.51 ->
    3 on one side, 2.49 -> 2 on the other: one codeword, about 24 after de-scaling at a
    block scale of 24), guided rounding keeps the sampler's choice. Number the signed grid
    by *levels* -7..7 (level = magnitude code with the value's sign, both zeros are level
    0). The learner's normalized value ``z`` lies in a bracket ``[L-, L+]`` of adjacent
    levels (``L- = L+`` when ``z`` is a grid point). The sampler's record keeps only the
    ``b`` low bits of its code: ``b = 1`` is the mantissa bit, ``b = 2`` adds the low
    exponent bit, ``b = 3`` is the magnitude code, ``b = 4`` the whole code. Adjacent
    levels always differ in those bits, so at most one bracket end matches the record.

    * A bracket end whose low bits match is the sampler's codeword (reconstructed exactly):
      it is chosen.
    * Otherwise the sampler's codeword lay outside the bracket; the nearest level (by
      value, from ``z``) with matching bits above the bracket and the one below stand in
      for it, and the bracket end on the nearer side is chosen. Equal distances (or no
      matching level on either side) fall back to round-to-nearest-even.
    * Rows without a record round to nearest-even.

    Consequences the tests pin: with identical inputs (``z`` equal on both sides) the
    sampler's code is the RNE code, which lies in the bracket, so guided rounding returns
    RNE bit for bit for every ``b``; the chosen code is always a bracket end, so its error
    is never more than one grid step; with any ``b`` the learner reproduces every sampler
    code that lies in its bracket. A zero level gets its sign bit from the spec's
    signed-zero policy applied to ``z``, exactly as RNE does.

Stochastic rounding (E2M1 only)
    With ``lo <= a <= hi`` the bracketing magnitudes, ``a`` rounds up when ``u < (a-lo)/(hi-lo)``
    for ``u`` uniform in [0, 1) drawn from an explicit ``torch.Generator``, in the element
    order of the tensor, so a seed reproduces the codes.
"""

from __future__ import annotations

import torch

from libalign.errors import DTypeError, SpecError
from libalign.spec.choices import SignedZero
from libalign.spec.constants import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E4M3_EXPONENT_BIAS,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_NAN_BITS,
    E8M0_EXPONENT_BIAS,
    E8M0_NAN_BITS,
)

SIGNED_ZERO_POLICIES = SignedZero.values()

_STRICT_MIDPOINTS = (0.25, 1.25, 2.5, 5.0)  # upper neighbour odd: pass only when >
_INCLUSIVE_MIDPOINTS = (0.75, 1.75, 3.5)  # upper neighbour even: pass when >=


def e2m1_magnitude_codes(a: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round non-negative fp32 magnitudes to E2M1 magnitude codes 0..7, ties to even (or
    ``ties="away"``: away from zero)."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    if ties not in ("even", "away"):
        raise SpecError(f"ties must be 'even' or 'away', got {ties!r}")
    for m in _STRICT_MIDPOINTS:
        code += (a >= m) if ties == "away" else (a > m)
    for m in _INCLUSIVE_MIDPOINTS:
        code += a >= m
    return code


def _apply_sign(z: torch.Tensor, mag: torch.Tensor, signed_zero: str) -> torch.Tensor:
    """Attach the sign bit to magnitude codes under a signed-zero policy.

    ``sign_of_input`` copies the IEEE sign bit of ``z`` (so -0.0 -> 0x8, as hardware
    converters and torchao do); ``sign_of_nonzero`` sets it for negative values only
    (-0.0 -> 0x0, -0.1 -> 0x8, as TE's reference, ModelOpt and compressed-tensors do);
    ``positive`` never marks a zero magnitude negative (any zero is 0x0): the sign follows
    the magnitude code, so -0.25 is 0x0 ties to even and 0x9 ties away.
    """
    if signed_zero == "sign_of_input":
        neg = torch.signbit(z)
    elif signed_zero == "sign_of_nonzero":
        neg = z < 0
    elif signed_zero == "positive":
        neg = (z < 0) & (mag != 0)
    else:
        raise SpecError(f"signed_zero must be one of {SIGNED_ZERO_POLICIES}, got {signed_zero!r}")
    return mag | (neg.to(torch.uint8) << 3)


def round_e2m1(z: torch.Tensor, signed_zero: str = "positive", ties: str = "even") -> torch.Tensor:
    """fp32 values (already clamped to [-6, 6]) -> E2M1 codes 0x0..0xF (uint8), round to
    nearest, ties to even (``ties="away"``: away from zero)."""
    return _apply_sign(z, e2m1_magnitude_codes(z.abs(), ties), signed_zero)


def round_e2m1_stochastic(
    z: torch.Tensor, generator: torch.Generator, signed_zero: str = "positive"
) -> torch.Tensor:
    """fp32 values in [-6, 6] -> E2M1 codes with stochastic rounding (see module doc)."""
    a = z.abs().clamp_(max=E2M1_MAX)
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=z.device)
    # index of the largest magnitude <= a (0..7)
    lo_idx = (torch.bucketize(a, grid, right=True) - 1).clamp_(0, 7)
    hi_idx = (lo_idx + 1).clamp_(max=7)
    lo, hi = grid[lo_idx], grid[hi_idx]
    width = hi - lo
    frac = torch.where(width > 0, (a - lo) / torch.where(width > 0, width, 1.0), 0.0)
    u = torch.rand(z.shape, generator=generator, dtype=torch.float32, device=z.device)
    mag = torch.where(u < frac, hi_idx, lo_idx).to(torch.uint8)
    return _apply_sign(z, mag, signed_zero)


GUIDE_BITS = (1, 2, 3, 4)


def e2m1_levels(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> signed levels -7..7 (int8); both zeros are level 0."""
    c = codes.to(torch.int16)
    mag = c & 0x7
    return torch.where((c & E2M1_SIGN_BIT) != 0, -mag, mag).to(torch.int8)


def low_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits`` low bits of E2M1 codes (uint8); what a guidance record keeps per value."""
    if bits not in GUIDE_BITS:
        raise SpecError(f"guidance keeps 1, 2, 3 or 4 bits per value, got {bits!r}")
    return codes & ((1 << bits) - 1)


def _level_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """The low bits a code at each signed level would carry (int16; -0 for level 0)."""
    lv = levels.to(torch.int16)
    if bits == 4:
        return torch.where(lv < 0, (-lv) | E2M1_SIGN_BIT, lv)
    return lv.abs() & ((1 << bits) - 1)


def _nearest_matching_tables(bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[15, 2^bits]`` fp32 tables: value of the nearest level >= L (resp. <= L) whose low bits
    are c, indexed by ``L + 7`` and ``c``; +inf (resp. -inf) where none exists."""
    mags = E2M1_MAGNITUDES
    vals = [-mags[-lv] if lv < 0 else mags[lv] for lv in range(-7, 8)]
    up = torch.full((15, 1 << bits), float("inf"))
    down = torch.full((15, 1 << bits), float("-inf"))
    lvl_bits = _level_bits(torch.arange(-7, 8), bits).tolist()
    for i in range(15):
        for j in range(i, 15):
            if up[i, lvl_bits[j]] == float("inf"):
                up[i, lvl_bits[j]] = vals[j]
        for j in range(i, -1, -1):
            if down[i, lvl_bits[j]] == float("-inf"):
                down[i, lvl_bits[j]] = vals[j]
    return up.to(device), down.to(device)


_GUIDE_TABLES: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def guide_tables(bits: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[15, 2^bits]`` nearest-matching-level tables :func:`round_e2m1_guided` reads
    (up, then down; cached per device), for kernels that apply the same rule."""
    key = (bits, str(device))
    if key not in _GUIDE_TABLES:
        _GUIDE_TABLES[key] = _nearest_matching_tables(bits, device)
    return _GUIDE_TABLES[key]


def bracket_levels(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed levels ``(L-, L+)`` (int8) of the grid points bracketing fp32 ``z`` in [-6, 6]."""
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=z.device)
    a = z.abs()
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp_(0, 7)  # largest magnitude <= a
    hi = torch.where(grid[lo] == a, lo, (lo + 1).clamp(max=7))
    neg = z < 0
    lower = torch.where(neg, -hi, lo).to(torch.int8)
    upper = torch.where(neg, -lo, hi).to(torch.int8)
    return lower, upper


def round_e2m1_guided(z: torch.Tensor, guide: torch.Tensor, bits: int,
                      present: torch.Tensor | None = None,
                      signed_zero: str = "positive", ties: str = "even") -> torch.Tensor:
    """fp32 ``z`` (clamped to [-6, 6]) -> E2M1 codes steered by the sampler's low code bits.

    ``guide`` holds, per element, the ``bits`` low bits of the sampler's code (uint8, as
    :func:`low_bits` gives them); ``present`` (broadcastable to ``z``) marks the elements a
    record covers, the rest round to nearest-even. See the module doc for the rule.
    """
    if bits not in GUIDE_BITS:
        raise SpecError(f"guidance keeps 1, 2, 3 or 4 bits per value, got {bits!r}")
    if guide.shape != z.shape:
        raise SpecError(f"guide bits have shape {tuple(guide.shape)}, values {tuple(z.shape)}")
    up_tab, down_tab = guide_tables(bits, z.device)
    rne = e2m1_magnitude_codes(z.abs(), ties)  # the spec's own round-to-nearest
    rne_level = torch.where(z < 0, -rne.to(torch.int8), rne.to(torch.int8))
    lower, upper = bracket_levels(z)
    g = guide.to(torch.int16)
    if bits == 4:  # the sampler's negative zero 0x8 is level 0, like 0x0
        g = torch.where(g == E2M1_SIGN_BIT, 0, g)
    lower_hit = _level_bits(lower, bits) == g
    upper_hit = _level_bits(upper, bits) == g
    # nearer side, exactly: up - z < z - down  <=>  up + down < 2z (grid sums and 2z are exact
    # in fp32; fp32 distances are not, near zero); -inf + inf is NaN: neither side, RNE
    ends = up_tab[upper.long() + 7, g.long()] + down_tab[lower.long() + 7, g.long()]
    two_z = 2 * z
    outside = torch.where(ends < two_z, upper, torch.where(two_z < ends, lower, rne_level))
    level = torch.where(lower_hit, lower, torch.where(upper_hit, upper, outside))
    if present is not None:
        level = torch.where(present, level, rne_level)
    neg = level < 0
    if signed_zero != "positive":  # a zero level takes the sign RNE would give it
        zero_code = _apply_sign(z, torch.zeros(z.shape, dtype=torch.uint8, device=z.device),
                                signed_zero)
        neg = neg | ((level == 0) & (zero_code != 0))
    return level.abs().to(torch.uint8) | (neg.to(torch.uint8) << 3)


def canonical_zero(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes with negative zero (0x8) replaced by positive zero (0x0)."""
    return torch.where(codes == E2M1_SIGN_BIT, torch.zeros_like(codes), codes)


def e2m1_code_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0x0..0xF (uint8) -> their fp32 values (0x8 -> -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    val = mags[c & 0x7]
    return torch.where((c & E2M1_SIGN_BIT) != 0, -val, val)


def round_e4m3_bits(v: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values (already clamped to [0, 448]) -> E4M3 bytes (uint8), RNE."""
    v = v.to(torch.float32)
    normal = v >= E4M3_MIN_NORMAL
    _, e = torch.frexp(v)  # v = f * 2^e, f in [0.5, 1)
    big_e = (e - 1).clamp_(min=-6)  # 2^E <= v < 2^(E+1) for normal values
    k_normal = torch.round(torch.ldexp(v, 3 - big_e))  # in [8, 16]
    carry = k_normal >= 16
    big_e = big_e + carry.to(big_e.dtype)
    k_normal = torch.where(carry, 8.0, k_normal)
    normal_bits = ((big_e + E4M3_EXPONENT_BIAS) << 3) | (k_normal.to(torch.int32) - 8)
    sub_bits = torch.round(v * 2.0**9).to(torch.int32)  # exact: a power-of-two scaling
    bits = torch.where(normal, normal_bits.to(torch.int32), sub_bits)
    return bits.to(torch.uint8)


def _e4m3_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 value of each of the 256 E4M3 bytes, decoded field by field."""
    b = torch.arange(256, dtype=torch.int64)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float64)
    sub = man * 2.0**-9
    nor = (8.0 + man) * torch.pow(2.0, (exp - 10).to(torch.float64))
    val = torch.where(exp == 0, sub, nor) * sign
    val = torch.where((b & 0x7F) == E4M3_NAN_BITS, float("nan"), val)
    return val.to(torch.float32).to(device)


_TABLES: dict[str, torch.Tensor] = {}


def e4m3_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 value of each E4M3 byte ``[256]`` on ``device``, decoded once per device (the
    one table every E4M3 decode, the GPU kernels' included, reads)."""
    key = str(device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = _e4m3_table(device)
    return table


def e4m3_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> exact fp32 values."""
    if bits.dtype == torch.float8_e8m0fnu:
        raise DTypeError("E8M0 (MXFP4) block scales are not E4M3; decode them with "
                         "e8m0_bits_to_float or block_scale_values")
    if bits.dtype == torch.float8_e4m3fn:
        bits = bits.view(torch.uint8)
    return e4m3_table(bits.device)[bits.to(torch.int64)]


def e8m0_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> exact fp32 values 2^(b - 127); 0xFF is NaN.

    Every byte but 0xFF is a power of two fp32 holds exactly (0x00 is the subnormal
    2^-127), so the bit pattern is built directly: no ``pow`` whose rounding could vary.
    """
    b = bits.view(torch.uint8).to(torch.int32)
    normal = (b << 23).view(torch.float32)  # 2^(b-127) for b >= 1
    sub = torch.tensor(2.0 ** -E8M0_EXPONENT_BIAS, dtype=torch.float32, device=b.device)
    out = torch.where(b == 0, sub, normal)
    return torch.where(b == E8M0_NAN_BITS, torch.full_like(out, float("nan")), out)


def block_scale_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of block scales by their dtype: float8_e8m0fnu (MXFP4) or E4M3 (NVFP4;
    float8_e4m3fn, or uint8 holding E4M3 bytes)."""
    if scales.dtype == torch.float8_e8m0fnu:
        return e8m0_bits_to_float(scales)
    return e4m3_bits_to_float(scales)


def saturate_e4m3(v: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """Clamp to the E4M3 range [floor or 0, 448] before the cast (NaN passes through)."""
    return v.clamp(min=0.0 if floor is None else floor, max=E4M3_MAX)
