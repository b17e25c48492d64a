"""The executable NVFP4/MXFP4 specification: what every bit is, in the kernels' operation order.

The package is the single source of truth every kernel matches bitwise (codes and scales,
atol=0). Its modules, from the numbers up:

* :mod:`~libalign.spec.constants`: the numbers that define the formats (E2M1 values, E4M3
  limits, block sizes). Numbers only.
* :mod:`~libalign.spec.choices`: the closed choices a spec makes (outer domain, operation
  order, signed zero, outer convention) as string enums.
* :mod:`~libalign.spec.rounding`: fp32 to E2M1 codes and to E4M3 bytes, bit-exact, with the
  signed-zero and guided-rounding variants.
* :mod:`~libalign.spec.scale_math`: the fp32 operation orders that turn maxima into scales, one
  per peer (ModelOpt, TE, torchao, miniTE), with the ``_enc``/``_dec`` conventions.
* :mod:`~libalign.spec.packing`: nibble packing of codes and the two block-scale layouts.
* :mod:`~libalign.spec.hadamard`: the fixed 16-point randomized Hadamard transform.
* :mod:`~libalign.spec.four_over_six`: 4-over-6 block scaling (each block mapped to 4 or to 6,
  whichever reconstructs it better), in TE's and in FlashInfer's error order.
* :mod:`~libalign.spec.presets`: :class:`NumericsSpec` (every choice a bit depends on) and the
  public :data:`PRESETS`.
* :mod:`~libalign.spec.reference`: THE reference :func:`quantize` / :func:`dequantize` and
  :class:`NVFP4Tensor`.

Use it as ``from libalign.spec import PRESETS, quantize, dequantize``. The compiled kernels
(:mod:`libalign.kernels`) serve the same function faster and are pinned to it.
"""

from libalign.spec.reference import (
    CHUNK_BLOCKS,
    INPUT_DTYPES,
    OUTER_CONVENTIONS,
    OUTER_DOMAINS,
    PRESETS,
    NumericsSpec,
    NVFP4Tensor,
    check_finite,
    check_input,
    checked_outer_amax,
    dequantize,
    encode_with_scales,
    normalized_with_scales,
    quantize,
    roundtrip_codes,
    shared_outer_amax,
)

__all__ = [
    "CHUNK_BLOCKS", "INPUT_DTYPES", "OUTER_CONVENTIONS", "OUTER_DOMAINS", "PRESETS",
    "NVFP4Tensor", "NumericsSpec", "check_finite", "check_input", "checked_outer_amax",
    "dequantize", "encode_with_scales", "normalized_with_scales", "quantize", "roundtrip_codes",
    "shared_outer_amax",
]
