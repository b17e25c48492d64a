"""4-over-6 block scaling: each block encoded with its maximum mapped to 6 or to 4, the better kept.

Plain NVFP4 maps a block's maximum to the largest E2M1 value, 6, where the grid is coarsest
(4 and 6 are two apart). 4-over-6 (Four Over Six, arXiv 2512.02010) also encodes the block with
a block scale 1.5x larger, so its maximum lands on 4, and keeps whichever candidate reconstructs
the block with the smaller error. TransformerEngine (``NVTE_NVFP4_4OVER6``) and FlashInfer
(``FLASHINFER_NVFP4_4OVER6``) compute it in the same fp32 steps but sum the error differently.

Both, per block of 16 values ``x`` with fp32 maximum ``v``, outer encode scale ``S``, its
decode scale ``D = fl(1 / S)`` and the outer maximum ``A`` (of the tensor or of the row; the
outer scales use the E4M3 bound ``E`` of the spec, 448 or 256, ``S = fl(6E / A)``)::

    base  = fl(fl(v / 6) * S)                      # map-to-6 block scale before the cast
    s6    = E4M3_RNE(min(base, 448))               s4 = E4M3_RNE(min(fl(base * 1.5), 448))
    m_c   = min(fl(1 / fl(s_c * D)), FLT_MAX)      # the TE encode multiplier of each candidate
    q_c   = E2M1_RNE(clamp(fl(x * m_c), -6, 6))
    e_c,i = fl(fl(fl(fl(q_c,i * s_c) * A) / fl(6E)) - x_i)   # reconstruction error
    err_c = sum of |e_c,i| (MAE) or fl(e_c,i * e_c,i) (MSE), in fp32
    keep map-to-4 iff err_4 < err_6                # a tie keeps map-to-6

TE (``transformer_engine/common/cast/nvfp4/quantize_4over6_nvfp4.cuh`` and its Python reference
``pytorch/custom_recipes/reference_nvfp4.py`` ``_quantize_blockwise_4over6_reference``, commit
``d0067d0da6cb``) adds the 16 errors one after another from 0. FlashInfer
(``csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh`` ``cvt_warp_fp16_to_fp4`` with
``DISABLE_FP4_QUANT_FAST_MATH`` and a row maximum, commit ``fb28d7242b35``) gives each of two
threads 8 values, adds each half from 0, then adds the two halves; a block whose maximum is 0
stores scale 0 and codes 0x0 (even for -0.0). Near an exact tie of the two errors the two sums
can pick different candidates, so the spec names whose order it follows
(:class:`~libalign.spec.choices.FourOverSix`).
"""

from __future__ import annotations

import torch

from libalign.spec.choices import ErrorMetric, FourOverSix
from libalign.spec.constants import E2M1_MAX, E4M3_MAX, FLT_MAX
from libalign.spec.rounding import e2m1_code_values, e4m3_bits_to_float, round_e2m1, round_e4m3_bits

#: the map-to-4 expansion of the block scale (6 / 4).
MAP4_EXPANSION = 1.5


def stored_outer(stored: torch.Tensor, amax: torch.Tensor, rule: str,
                 convention: str) -> torch.Tensor:
    """The stored outer scale under ``rule``: FlashInfer stores a decode scale of 0 for an
    all-zero domain (its ``amax == 0``), where the formula gives ``fl(1 / FLT_MAX)``."""
    if rule == FourOverSix.FLASHINFER and convention == "dec":
        return torch.where(amax == 0, torch.zeros_like(stored), stored)
    return stored


def _candidate(x: torch.Tensor, pre: torch.Tensor, dec: torch.Tensor, signed_zero: str):
    """E4M3 bits, their fp32 value and unpacked codes of one candidate (``pre`` ``[n, 1]``)."""
    bits = round_e4m3_bits(pre.clamp(max=E4M3_MAX))
    s = e4m3_bits_to_float(bits)
    mult = torch.minimum(torch.reciprocal(s * dec), x.new_tensor(FLT_MAX))
    codes = round_e2m1((x * mult).clamp_(-E2M1_MAX, E2M1_MAX), signed_zero)
    return bits, s, codes


def _error(x, codes, s, amax, denom, metric: str, rule: str) -> torch.Tensor:
    """The candidate's summed fp32 reconstruction error per block ``[n]``, in the rule's order."""
    val = torch.div((e2m1_code_values(codes) * s) * amax, denom)
    diff = val - x
    term = diff * diff if metric == ErrorMetric.MSE else diff.abs()
    if rule == FourOverSix.TE:
        err = torch.zeros_like(term[:, 0])
        for i in range(term.shape[1]):
            err = err + term[:, i]
        return err
    half = term.shape[1] // 2
    lo = torch.zeros_like(term[:, 0])
    hi = torch.zeros_like(term[:, 0])
    for i in range(half):
        lo = lo + term[:, i]
        hi = hi + term[:, half + i]
    return lo + hi


def encode_4over6(x: torch.Tensor, vmax: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor,
                  amax: torch.Tensor, *, e4m3_max: float, rule: str, metric: str,
                  signed_zero: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scale bytes ``[n]`` and unpacked codes ``[n, 16]`` of fp32 blocks ``x`` ``[n, 16]``.

    ``vmax`` ``[n]`` are the block maxima, ``enc``/``dec``/``amax`` the outer encode scale,
    decode scale and maximum of each block's domain (``[n, 1]`` or scalars).
    """
    denom = x.new_tensor(E2M1_MAX * e4m3_max)
    base = torch.div(vmax, x.new_tensor(E2M1_MAX)).unsqueeze(-1) * enc
    b6, s6, c6 = _candidate(x, base, dec, signed_zero)
    b4, s4, c4 = _candidate(x, base * MAP4_EXPANSION, dec, signed_zero)
    pick4 = _error(x, c4, s4, amax, denom, metric, rule) < _error(x, c6, s6, amax, denom, metric,
                                                                  rule)
    bits = torch.where(pick4, b4.squeeze(-1), b6.squeeze(-1))
    codes = torch.where(pick4.unsqueeze(-1), c4, c6)
    if rule == FourOverSix.FLASHINFER:  # an all-zero block returns before any conversion
        codes = torch.where((vmax == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    return bits, codes
