"""The closed sets a numerics spec's fields choose from, as string enums.

Every choice an NVFP4 or MXFP4 bit depends on that is not a number (where the outer scale is
taken, whose fp32 operation order turns maxima into scales, what a zero's sign is, what the
outer scale stores) is one member of an enum here. A member *is* its string (``OpOrder.TE ==
"te"``, ``json.dumps`` writes ``"te"``, f-strings and ``repr`` print the value), so manifests,
wire schemas and error messages read as they always have, while code names the member and a
typo is a NameError instead of a spec nobody defined.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A member that prints, formats and compares as its string value."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in declaration order."""
        return tuple(m.value for m in cls)


class OuterDomain(Choice):
    """Where the FP32 outer scale is taken: nowhere (block scales only), over the whole
    tensor, per expert of a stack, or per row."""

    NONE = "none"
    TENSOR = "tensor"
    EXPERT = "expert"
    ROW = "row"


class OuterConvention(Choice):
    """What a stored outer scale holds: the maximum, the encode scale (``_enc``, 2688/amax) or
    the decode scale (``_dec``, amax/2688)."""

    AMAX = "amax"
    ENC = "enc"
    DEC = "dec"


class OpOrder(Choice):
    """Whose fp32 operation order turns maxima into scales (:mod:`libalign.spec.scale_math`):
    five NVFP4 orders (E4M3 block scales and an outer scale), five exponent-only ones (E8M0
    scales: the four MXFP4 rules and SGLang's block-16 KV rule)."""

    TE = "te"
    TORCHAO = "torchao"
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed_tensors"
    FLASHINFER = "flashinfer"
    MX_FLOOR = "mx_floor"
    MX_CEIL = "mx_ceil"
    MX_EVEN = "mx_even"
    MX_TE = "mx_te"
    MX_SGLANG = "mx_sglang"

    @property
    def is_mx(self) -> bool:
        """True for an MXFP4 order (E8M0 block scales, no outer scale)."""
        return self.value.startswith("mx_")


class SignedZero(Choice):
    """The code of a value whose magnitude rounds to zero: always +0, the input's sign, or the
    sign where the input is nonzero (a -0.0 input stays +0)."""

    POSITIVE = "positive"
    SIGN_OF_INPUT = "sign_of_input"
    SIGN_OF_NONZERO = "sign_of_nonzero"


class Ties(Choice):
    """How an E2M1 value exactly between two codes rounds: to the even code (IEEE, every
    hardware converter) or away from zero (SGLang's block-16 KV quantizer compares with
    ``>=`` at every midpoint)."""

    EVEN = "even"
    AWAY = "away"


class OuterSource(Choice):
    """Where an NVFP4 outer scale comes from: computed from the data being quantized (its
    maximum over the outer domain), or given by the caller (a KV cache's per-layer global
    scale, read from a checkpoint, a calibration or a default)."""

    DATA = "data"
    GIVEN = "given"


class FourOverSix(Choice):
    """4-over-6 block scaling: off, or each block encoded twice (its maximum mapped to 6 with the
    usual scale, and to 4 with the scale 1.5x larger) keeping the one that reconstructs the block
    with the smaller error, as TransformerEngine or as FlashInfer computes that error (they sum the
    16 element errors in different orders; :mod:`libalign.spec.four_over_six`)."""

    OFF = "off"
    TE = "te"
    FLASHINFER = "flashinfer"


class ErrorMetric(Choice):
    """The per-block reconstruction error 4-over-6 compares: the sum of absolute errors (TE's and
    FlashInfer's default) or of squared errors."""

    MAE = "mae"
    MSE = "mse"
