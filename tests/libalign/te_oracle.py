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


def quantize_4over6(x: np.ndarray, per_row: bool, *, e4m3_max: float = 256.0,
                    metric: str = "mae", order: str = "te"):
    """TE's ``_quantize_blockwise_4over6_reference`` (1x16 tiles) and FlashInfer's exact-math
    ``cvt_warp_fp16_to_fp4`` 4-over-6, one block at a time in NumPy float32 scalars.

    Returns (codes uint8 [M, K] unpacked, scale bytes uint8 [M, K/16], amax fp32). ``order``
    ``te`` adds the 16 errors in a row; ``flashinfer`` adds each half of 8, then the halves,
    and codes an all-zero block 0x0 (its codes otherwise keep the input's sign, as the
    hardware conversion does; TE's reference codes -0.0 as 0x0).
    """
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    amax = np.abs(x).max(-1) if per_row else np.full(m, np.abs(x).max(), dtype=F32)
    amax = amax.astype(F32)
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, k // 16), dtype=np.uint8)
    denom = F32(6.0) * F32(e4m3_max)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for r in range(m):
            a = amax[r]
            s_enc = F32(min(F32(F32(e4m3_max) * F32(6.0)) / a, FLT_MAX))
            s_enc = F32(1.0) if s_enc == 0 else s_enc
            s_dec = F32(F32(1.0) / s_enc)
            for b in range(k // 16):
                blk = x[r, 16 * b:16 * b + 16]
                v = F32(np.abs(blk).max())
                base = F32(F32(v / F32(6.0)) * s_enc)
                cands = []
                for pre in (F32(base * F32(1.5)), base):
                    s8 = np.array([min(pre, F32(448.0))], dtype=F32).astype(ml_dtypes.float8_e4m3fn)
                    s = F32(s8.astype(F32)[0])
                    enc = F32(min(F32(F32(1.0) / F32(s * s_dec)), FLT_MAX))
                    scaled = np.clip((blk * enc).astype(F32), F32(-6.0), F32(6.0))
                    c = e2m1_nearest(scaled, neg_zero_code=True)
                    if order == "te":
                        c = np.where(scaled == 0, np.uint8(0), c).astype(np.uint8)
                    else:
                        c = c | (np.signbit(scaled).astype(np.uint8) << 3)
                    vals = np.where(c & 8, -MAGS[c & 7], MAGS[c & 7]).astype(F32)
                    terms = []
                    for i in range(16):
                        val = F32(F32(F32(vals[i] * s) * a) / denom)
                        d = F32(val - blk[i])
                        terms.append(F32(d * d) if metric == "mse" else F32(abs(d)))
                    if order == "te":
                        err = F32(0.0)
                        for t in terms:
                            err = F32(err + t)
                    else:
                        lo = hi = F32(0.0)
                        for i in range(8):
                            lo = F32(lo + terms[i])
                            hi = F32(hi + terms[8 + i])
                        err = F32(lo + hi)
                    cands.append((err, s8.view(np.uint8)[0], c))
                (e4, b4, c4), (e6, b6, c6) = cands
                byte, c = (b4, c4) if e4 < e6 else (b6, c6)
                if order == "flashinfer" and v == 0:
                    c = np.zeros(16, dtype=np.uint8)
                scales[r, b] = byte
                codes[r, 16 * b:16 * b + 16] = c
    return codes, scales, amax


def flashinfer_pertoken(x: np.ndarray, global_scale_inv: float = 1.0 / 2688.0):
    """FlashInfer's ``nvfp4QuantAndPerTokenScaleKernel`` without 4-over-6, exact math
    (``quantization.cuh``): ``G = 1/globalScaleInv``, per row ``S = min(G / rowAmax, FLT_MAX)``
    (``FLT_MAX`` for a zero row, 1 if 0), stored per-token scale ``1 / S``; each block as
    ``cvt_warp_fp16_to_fp4`` (codes keep the input's sign). Returns (codes, scale bytes, dec)."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    g = F32(F32(1.0) / F32(global_scale_inv))
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, k // 16), dtype=np.uint8)
    dec = np.zeros(m, dtype=F32)
    inv6 = F32(F32(1.0) / F32(6.0))
    with np.errstate(divide="ignore", over="ignore"):
        for r in range(m):
            a = F32(np.abs(x[r]).max())
            s = F32(min(F32(g / a), FLT_MAX)) if a != 0 else FLT_MAX
            s = F32(1.0) if s == 0 else s
            dec[r] = F32(F32(1.0) / s)
            for b in range(k // 16):
                blk = x[r, 16 * b:16 * b + 16]
                v = F32(np.abs(blk).max())
                sf = F32(v * F32(s * inv6)) if v != 0 else F32(0.0)
                s8 = np.array([min(sf, F32(448.0))], dtype=F32).astype(ml_dtypes.float8_e4m3fn)
                sfv = F32(s8.astype(F32)[0])
                out = F32(min(F32(F32(1.0) / F32(sfv * F32(F32(1.0) / s))), FLT_MAX)) \
                    if v != 0 else F32(0.0)
                scaled = np.clip((blk * out).astype(F32), F32(-6.0), F32(6.0))
                codes[r, 16 * b:16 * b + 16] = e2m1_nearest(scaled, neg_zero_code=True) | (
                    np.signbit(scaled).astype(np.uint8) << 3)
                scales[r, b] = s8.view(np.uint8)[0]
    return codes, scales, dec
