"""An independent oracle for TransformerEngine's published NVFP4 reference formulas.

Written in NumPy float32 scalars-by-array arithmetic with ml_dtypes' float8_e4m3fn for
the E4M3 cast and a nearest-value search for E2M1, so it shares no code and no algorithm
with ``libalign.spec.rounding``. The formulas (TE's ``NVFP4QuantizerRef``, 1x16 tiles)::

    S_enc = min(2688 / A, FLT_MAX); S_enc = 1 where S_enc == 0; S_dec = 1 / S_enc
    s     = e4m3(clamp(min(v * (S_enc * (1/6)), FLT_MAX), -448, 448))
    enc   = min(1 / (s * S_dec), FLT_MAX)
    code  = e2m1(clamp(x * enc, -6, 6))   # ranges with ties to even; -0.0 -> 0x0

``floor`` adds miniTE's ``max(A, floor)`` and ``zero_multiplier`` its zero encoding
multiplier for zero-scale blocks (with every zero magnitude stored as 0x0).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def e2m1_nearest(z: np.ndarray, neg_zero_code: bool) -> np.ndarray:
    """Nearest E2M1 magnitude by distance, ties to the even code index."""
    a = np.abs(z)
    dist = np.abs(a[..., None] - MAGS)  # exact in fp32 for these small values
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # among tied candidates prefer an even index (mantissa bit 0)
    idx = np.where(cand[..., ::1] & (np.arange(8) % 2 == 0), np.arange(8), 99).min(-1)
    idx = np.where(idx == 99, cand.argmax(-1), idx)
    neg = z < 0
    if not neg_zero_code:
        neg = neg & (idx != 0)
    return (idx | (neg.astype(np.int64) << 3)).astype(np.uint8)


def quantize(x: np.ndarray, per_row: bool, floor: float | None = None,
             zero_multiplier: bool = False):
    """Return (codes uint8 [M, K] unpacked, scale bytes uint8 [M, K/16], amax fp32)."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // 16, 16)
    v = np.abs(blocks).max(-1).astype(F32)  # [M, nb]
    amax = np.abs(x).max(-1) if per_row else np.array([np.abs(x).max()], dtype=F32)
    amax = amax.astype(F32)
    if floor is not None:
        amax = np.maximum(amax, F32(floor))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = np.minimum(F32(2688.0) / amax, FLT_MAX).astype(F32)
        s_enc = np.where(s_enc == 0, F32(1.0), s_enc).astype(F32)
        s_dec = (F32(1.0) / s_enc).astype(F32)
        if per_row:
            s_enc_b, s_dec_b = s_enc[:, None], s_dec[:, None]
        else:
            s_enc_b, s_dec_b = s_enc[0], s_dec[0]
        mult = (s_enc_b * (F32(1.0) / F32(6.0))).astype(F32)
        pre = np.minimum((v * mult).astype(F32), FLT_MAX)
        pre = np.clip(pre, F32(-448.0), F32(448.0)).astype(F32)
        s8 = pre.astype(ml_dtypes.float8_e4m3fn)
        s = s8.astype(F32)
        enc = np.minimum(F32(1.0) / (s * s_dec_b).astype(F32), FLT_MAX).astype(F32)
        if zero_multiplier:
            enc = np.where(s == 0, F32(0.0), enc).astype(F32)
        scaled = (blocks * enc[..., None]).astype(F32)
    scaled = np.clip(scaled, F32(-6.0), F32(6.0)).reshape(m, k)
    codes = e2m1_nearest(scaled, neg_zero_code=not zero_multiplier)
    if not zero_multiplier:
        # TE: an exact zero (either sign) is 0x0; a negative value rounding to 0 is 0x8
        codes = np.where(scaled == 0, np.uint8(0), codes).astype(np.uint8)
    return codes, s8.view(np.uint8), amax
