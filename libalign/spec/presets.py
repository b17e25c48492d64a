"""The choices an NVFP4 or MXFP4 bit depends on (:class:`NumericsSpec`) and the public presets.

"Matching an FP4 encoding" leaves many bits open: where the outer scale's maximum is taken
(tensor, expert, row), in which fp32 operation order the scales and the element encoding
are computed, what a zero-scale block encodes to, how a negative zero is coded, whether NaN
is refused. A :class:`NumericsSpec` names every such choice; :func:`libalign.spec.quantize`
executes them (its module docstring gives the order of the steps).

Kernels (CUDA, CPU) are tested against :mod:`libalign.spec` bit for bit; quality against BF16 is
a separate question. The presets reproduce public quantizers exactly on finite inputs:

``minite`` (default)
    Row-scaled outer scale (one per activation row / weight output row), TE's fp32
    order, row maximum floored as ``max(a, 1e-12)``, and a block whose decoded E4M3 scale
    is zero gets a zero encoding multiplier, so its codes are zero. No scale floor, so
    tiny blocks keep their own scale. Any zero magnitude is stored as code 0x0.
``te``
    TransformerEngine's NVFP4 reference (bit-exact to its kernels): per-tensor amax,
    no floors, a zero-scale block is encoded with multiplier FLT_MAX (its non-zero
    elements saturate to +-6), -0.0 -> 0x0 but tiny negatives -> 0x8. Stores the amax.
    ``te_row`` is TE's ``row_scaled_nvfp4`` activation variant.
``torchao``
    ``torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize`` with
    ``per_tensor_scale = amax / 2688`` (per expert for 3-D): block scales floored at
    2^-6 (an all-zero block stores 0x08), encode ``x * ((1/g) / s)``, sign bit copied
    from the input (-0.0 -> 0x8). PyTorch on CPU divides ``v / 6`` exactly; on CUDA it
    multiplies by a rounded reciprocal, so torchao's own bits differ across devices:
    this preset follows its CPU bits.
``modelopt``
    ``NVFP4QTensor.quantize`` (per-tensor ``weight_scale_2 = amax / 2688``): a zero fp32
    block scale becomes 1.0 (0x38), floor 2^-9, encode ``x / (s * g)``, zero-padded K.
``compressed_tensors``
    compressed-tensors' NVFP4 (``generate_gparam``, ``calculate_qparams``,
    ``quantize_and_pack_fp4``): global scale and ``v / 6`` in the model dtype, a block
    scale that rounds to zero becomes 0.125 (0x20), encode ``x / (s / gs)``, K must be
    a multiple of 16. Stores the encode-convention global scale.

Production recipes (the bits Miles trains with TE and SGLang serves with FlashInfer):

``flashinfer_pertoken``
    SGLang's per-token activations (``SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1``):
    FlashInfer's ``nvfp4_quant_and_per_token_scale`` with exact math
    (``FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1``) and ``globalScaleInv = 1/(448*6)``. Its
    steps are TE's row formulas (``fl(1/fl(1/2688))`` is 2688 exactly, so ``enc = fl(2688/A)``
    per row, ``FLT_MAX`` for an all-zero row); it stores the per-token *decode* scale
    ``fl(1/enc)`` and the hardware conversion keeps the input's sign in a zero code. This is
    ``te_row`` with ``sign_of_input`` and outer convention ``dec``; K must be a multiple of 16
    (FlashInfer's and TE's row-scaled quantizers refuse others).
``te_4over6``, ``te_row_4over6``, ``te_4over6_448``
    TE's 4-over-6 (``NVTE_NVFP4_4OVER6``, default error MAE, default E4M3 bound 256; the
    ``_448`` one is ``NVTE_NVFP4_4OVER6_E4M3_USE_256=none``), per tensor and row-scaled
    (:mod:`libalign.spec.four_over_six`).
``flashinfer_pertoken_4over6``
    ``flashinfer_pertoken`` with FlashInfer's 4-over-6 (``FLASHINFER_NVFP4_4OVER6=1``, bound
    256, ``globalScaleInv = 1/(256*6)``): FlashInfer's error order, an all-zero row stores
    decode scale 0 and an all-zero block codes 0x0.

Any of them takes ``four_over_six_error="mse"`` through :meth:`NumericsSpec.replace`.

MXFP4 presets (E8M0 power-of-two scale per 32 values, no outer scale; ``op_order`` is an
MX order of :mod:`libalign.spec.scale_math` and ``block_size`` 32). Every one copies the input's
sign bit into a zero code (-0.0 -> 0x8, as torchao), refuses NaN/Inf and a K that is not
a multiple of 32 (:class:`~libalign.errors.ShapeError`, as NVFP4 refuses 16):

``mxfp4`` (default MXFP4)
    ``torchao.prototype.mx_formats`` ``to_mx`` in its default ``FLOOR`` mode, which is the
    OCP rule ``2^(floor(log2 amax) - 2)``: an all-zero block stores 0x00 (2^-127).
``mxfp4_ceil``, ``mxfp4_even``
    torchao's ``CEIL`` and ``EVEN`` scale modes.
``mxfp4_te``
    TransformerEngine's E8M0 rule (``float_to_e8m0(amax * max_norm_rcp)``: the descale
    rounded up to a power of two, as ``cvt.rp.satfinite.ue8m0x2.f32`` does) with FP4's
    ``max_norm`` 6. torchao's ``RCEIL`` mode is this rule; its eager CPU fallback takes
    ``ceil(log2(amax / 6))`` in fp32, which loses a descale a few ulps above a power of two
    (an fp32 block maximum just above 6 * 2^k) and then stores one byte less. On every
    bf16 block maximum the two agree (tests/libalign/test_mxfp4.py checks all of them).

KV-cache presets (TRACE's FP4 KV rollout; a row is one token's keys or values of one head).
libalign's own two:

``kv_nvfp4``
    ``minite``'s bits under its own name: row-scaled NVFP4, one outer scale per head row,
    so a row's codes never depend on other tokens and the cache can quantize on write.
``kv_mxfp4``
    ``mxfp4``'s bits (E8M0 per 32 values, no outer scale); the head size must be a multiple
    of 32. :func:`libalign.kernels.quantize` serves every MXFP4 preset with the compiled CPU
    and CUDA kernels (the same bits as :func:`libalign.spec.quantize`).

and the two SGLang writes with ``--kv-cache-dtype`` (the head size must be a multiple of 16;
:func:`libalign.kernels.quantize` serves both from the spec):

``kv_sglang_nvfp4`` (``--kv-cache-dtype nvfp4``)
    SGLang's ``NVFP4KVCacheMethod``: E4M3 per 16 values under one FP32 *global* decode scale
    per layer for K and one for V (``outer_source`` ``given``: never computed from the data;
    the checkpoint's ``k_scale``/``v_scale``, a calibration, or SGLang's default 1.0; see
    :class:`libalign.models.kv_cache.KVScales`). Codes and scales are those of FlashInfer's
    exact-math quantizer (``op_order`` ``flashinfer``; ``cvt.rn.satfinite`` keeps the input's
    sign in a zero code, a block whose scale underflows saturates). The tensor stores the
    layer's scale once per row (outer domain ``row``), so rows stay independent, as the cache
    writes them.
``kv_sglang_fp4_mx_block16`` (``--kv-cache-dtype fp4_mx_block16``)
    SGLang's ``FP4MXBlock16KVQuantizeUtil``: an exponent-only byte per **16** values (not
    MXFP4's 32; ``op_order`` ``mx_sglang``), no outer scale, E2M1 ties rounded away from zero
    (``e2m1_ties`` ``away``), a negative value whose magnitude rounds to zero keeps its sign.

The ``torchao`` and ``modelopt`` presets raise :class:`~libalign.errors.UndefinedScaleError` on an
all-zero tensor, where both libraries compute 0/0 and emit NaN block scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from libalign.errors import SpecError
from libalign.spec import scale_math
from libalign.spec.choices import (
    ErrorMetric,
    FourOverSix,
    OpOrder,
    OuterConvention,
    OuterDomain,
    OuterSource,
    SignedZero,
    Ties,
)
from libalign.spec.constants import (
    BLOCK_SIZE,
    FLT_MAX,
    HADAMARD_SIGNS,
    MINITE_AMAX_FLOOR,
    MX_BLOCK_SIZE,
)
from libalign.spec.rounding import (
    SIGNED_ZERO_POLICIES,
    e4m3_bits_to_float,
    round_e4m3_bits,
    saturate_e4m3,
)

OUTER_DOMAINS = OuterDomain.values()
OUTER_CONVENTIONS = OuterConvention.values()


@dataclass(frozen=True)
class NumericsSpec:
    """Every choice an NVFP4 bit depends on. Frozen; derive variants with :meth:`replace`.

    Attributes:
        name: preset name (informational; equality compares every field).
        outer_domain: ``none`` (block scales only), ``tensor``, ``expert`` (one per
            leading index of a 3-D stack; a 2-D tensor is one expert) or ``row``.
        op_order: fp32 operation order of outer scale, block scale and element encode
            (``te``, ``torchao``, ``modelopt``, ``compressed_tensors``), or for MXFP4 the
            E8M0 scale rule (``mx_floor``, ``mx_ceil``, ``mx_even``, ``mx_te``); see
            scale_math. An MX order makes the spec MXFP4 (:attr:`scale_format` ``e8m0``).
        amax_floor: the outer maximum is replaced by ``max(A, amax_floor)`` (in fp32).
        block_scale_floor: lower clamp of the fp32 block scale before the E4M3 cast.
        zero_prescale_to: value substituted for an fp32 block scale that is exactly zero,
            before the clamp (ModelOpt: 1.0).
        zero_scale_to: value substituted for an E4M3 block scale that rounded to zero,
            after the cast (compressed-tensors: 0.125). Must be E4M3-representable.
        zero_scale_encode: multiplier of a block whose final scale is still zero:
            ``zero`` (codes become zero) or ``saturate`` (FLT_MAX: non-zero elements go
            to +-6, TE's behaviour).
        signed_zero: code of values whose magnitude rounds to zero: ``positive`` (0x0
            always), ``sign_of_input`` (IEEE sign bit, -0.0 -> 0x8) or
            ``sign_of_nonzero`` (-0.0 -> 0x0, -0.1 -> 0x8).
        nonfinite: ``raise`` a :class:`NonFiniteError`, or ``saturate`` (NaN -> 0,
            +-Inf -> the input dtype's largest finite value) before quantizing.
        k_remainder: K not a multiple of 16: ``pad`` with zeros or ``refuse``.
        hadamard: rotate each block with the fixed 16-point Hadamard transform first.
        hadamard_signs: its fixed sign mask.
        stochastic_rounding: E2M1 rounding draws from an explicit generator.
        outer_convention: what ``NVFP4Tensor.outer_scale`` stores: ``amax``, ``enc``
            (2688 / amax) or ``dec`` (amax / 2688), as this order computes them.
        scale_math_dtype: ``float32``, or ``input`` for the steps compressed-tensors
            computes in the model dtype.
        block_size: elements per block scale: 16 for NVFP4, 32 for MXFP4 (16 for
            SGLang's ``mx_sglang`` rule).
        e2m1_ties: an E2M1 midpoint rounds to the ``even`` code or ``away`` from zero.
        outer_source: the outer scale is computed from the ``data``, or ``given`` by the
            caller in the stored convention (:func:`libalign.spec.quantize`'s
            ``outer_scale``), as a KV cache's per-layer global scale is.
        e4m3_max: the E4M3 bound the outer scale maps the maximum to: 448 (standard,
            ``enc = 2688 / A``) or 256 (TE's and FlashInfer's 4-over-6 default,
            ``enc = 1536 / A``, so a map-to-4 block scale, 1.5x larger, stays below 448).
        four_over_six: ``off``, or 4-over-6 block scaling as ``te`` or ``flashinfer`` sums
            its error (:mod:`libalign.spec.four_over_six`).
        four_over_six_error: the error 4-over-6 compares: ``mae`` or ``mse``.
    """

    name: str = "custom"
    outer_domain: OuterDomain = OuterDomain.ROW
    op_order: OpOrder = OpOrder.TE
    amax_floor: float | None = MINITE_AMAX_FLOOR
    block_scale_floor: float | None = None
    zero_prescale_to: float | None = None
    zero_scale_to: float | None = None
    zero_scale_encode: str = "zero"
    signed_zero: SignedZero = SignedZero.POSITIVE
    nonfinite: str = "raise"
    k_remainder: str = "pad"
    hadamard: bool = False
    hadamard_signs: tuple[int, ...] = HADAMARD_SIGNS
    stochastic_rounding: bool = False
    outer_convention: OuterConvention = OuterConvention.DEC
    scale_math_dtype: str = "float32"
    block_size: int = field(default=BLOCK_SIZE)
    e2m1_ties: Ties = Ties.EVEN
    outer_source: OuterSource = OuterSource.DATA
    e4m3_max: float = 448.0
    four_over_six: FourOverSix = FourOverSix.OFF
    four_over_six_error: ErrorMetric = ErrorMetric.MAE

    def __post_init__(self) -> None:
        choices = {
            "outer_domain": OUTER_DOMAINS,
            "op_order": scale_math.OP_ORDERS,
            "zero_scale_encode": ("zero", "saturate"),
            "signed_zero": SIGNED_ZERO_POLICIES,
            "nonfinite": ("raise", "saturate"),
            "k_remainder": ("pad", "refuse"),
            "outer_convention": OUTER_CONVENTIONS,
            "scale_math_dtype": ("float32", "input"),
            "e2m1_ties": Ties.values(),
            "outer_source": OuterSource.values(),
            "e4m3_max": (448.0, 256.0),
            "four_over_six": FourOverSix.values(),
            "four_over_six_error": ErrorMetric.values(),
        }
        for attr, allowed in choices.items():
            if getattr(self, attr) not in allowed:
                raise SpecError(f"{attr} must be one of {allowed}, got {getattr(self, attr)!r}")
        for attr, kind in (("outer_domain", OuterDomain), ("op_order", OpOrder),
                           ("signed_zero", SignedZero), ("outer_convention", OuterConvention),
                           ("e2m1_ties", Ties), ("outer_source", OuterSource),
                           ("four_over_six", FourOverSix), ("four_over_six_error", ErrorMetric)):
            object.__setattr__(self, attr, kind(getattr(self, attr)))  # the member of the string
        if self.is_mx:
            self._check_mx()
        elif self.block_size != BLOCK_SIZE:
            raise SpecError(f"NVFP4 blocks have {BLOCK_SIZE} elements, got {self.block_size}")
        if len(self.hadamard_signs) != 16 or any(s not in (1, -1) for s in self.hadamard_signs):
            raise SpecError("hadamard_signs must be 16 values of +1 or -1")
        for attr in ("amax_floor", "block_scale_floor", "zero_prescale_to", "zero_scale_to"):
            v = getattr(self, attr)
            if v is not None and not (v > 0 and v < FLT_MAX):
                raise SpecError(f"{attr} must be a positive finite number or None, got {v!r}")
        if self.zero_scale_to is not None:
            t = torch.tensor([self.zero_scale_to], dtype=torch.float32)
            if e4m3_bits_to_float(round_e4m3_bits(saturate_e4m3(t))).item() != self.zero_scale_to:
                raise SpecError(f"zero_scale_to={self.zero_scale_to} is not an E4M3 value")
        if self.outer_domain == "none" and self.outer_convention != "dec":
            raise SpecError("outer_domain 'none' stores no outer scale; use outer_convention 'dec'")
        if self.outer_source == "given" and (self.outer_domain == "none" or self.is_mx):
            raise SpecError("outer_source 'given' needs an outer scale (an NVFP4 outer domain)")
        object.__setattr__(self, "e4m3_max", float(self.e4m3_max))
        self._check_four_over_six()
        if self.e2m1_ties == "away" and self.stochastic_rounding:
            raise SpecError("e2m1_ties 'away' is a round-to-nearest rule; stochastic rounding "
                            "has no ties")

    def _check_four_over_six(self) -> None:
        """4-over-6 and the 256 bound exist in TE's order, on scales computed from the data."""
        if (self.e4m3_max != 448.0 or self.four_over_six != "off") and self.op_order != "te":
            raise SpecError(f"e4m3_max 256 and 4-over-6 are defined in the 'te' op_order, got "
                            f"{self.op_order!r}")
        if self.four_over_six == "off":
            return
        bad = {"hadamard": self.hadamard, "stochastic_rounding": self.stochastic_rounding,
               "outer_source 'given'": self.outer_source != "data",
               "outer_domain 'none'": self.outer_domain == "none",
               "zero_scale_encode 'zero'": self.zero_scale_encode != "saturate",
               "a block-scale floor or substitute": (self.block_scale_floor, self.zero_prescale_to,
                                                     self.zero_scale_to) != (None, None, None)}
        for what, on in bad.items():
            if on:
                raise SpecError(f"4-over-6 block scaling does not combine with {what} (TE and "
                                "FlashInfer refuse RHT and stochastic rounding with it)")

    @property
    def is_mx(self) -> bool:
        """True for an MXFP4 spec (E8M0 block scales, no outer scale)."""
        return self.op_order in scale_math.MX_ORDERS

    @property
    def scale_format(self) -> str:
        """Block-scale format: ``e4m3`` (NVFP4) or ``e8m0`` (MXFP4); implied by ``op_order``."""
        return "e8m0" if self.is_mx else "e4m3"

    @property
    def scale_dtype(self) -> torch.dtype:
        """The torch dtype block scales are viewed as: ``float8_e8m0fnu`` (MXFP4) or
        ``float8_e4m3fn`` (NVFP4)."""
        return torch.float8_e8m0fnu if self.is_mx else torch.float8_e4m3fn

    def _check_mx(self) -> None:
        """MXFP4 has one scale format, no outer scale and none of NVFP4's scale policies."""
        want = BLOCK_SIZE if self.op_order == "mx_sglang" else MX_BLOCK_SIZE
        if self.block_size != want:
            raise SpecError(f"op_order {self.op_order!r} has blocks of {want} elements, got "
                            f"{self.block_size}")
        if self.outer_domain != "none":
            raise SpecError(f"MXFP4 has no outer scale: op_order {self.op_order!r} needs "
                            f"outer_domain 'none', got {self.outer_domain!r}")
        unused = {"amax_floor": None, "block_scale_floor": None, "zero_prescale_to": None,
                  "zero_scale_to": None, "hadamard": False, "scale_math_dtype": "float32"}
        for attr, want in unused.items():
            if getattr(self, attr) != want:
                raise SpecError(f"{attr} does not apply to MXFP4 (op_order {self.op_order!r}); "
                                f"leave it {want!r}")

    def replace(self, **changes: Any) -> NumericsSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for manifests and the wire). The choices added to the spec
        later (:data:`LATER_FIELDS`) are written only where they differ from their defaults,
        so a spec that makes none of them has the dict, and the hash, it always had."""
        d = dataclasses.asdict(self)
        d["hadamard_signs"] = list(self.hadamard_signs)
        for key, default in LATER_FIELDS.items():
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NumericsSpec:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise SpecError(f"unknown numerics spec field(s): {sorted(unknown)}")
        d = dict(d)
        if "hadamard_signs" in d:
            d["hadamard_signs"] = tuple(d["hadamard_signs"])
        return cls(**d)


#: Fields added after the first manifests were written, with their defaults: omitted from
#: :meth:`NumericsSpec.to_dict` at the default (older readers and stored hashes stay valid).
LATER_FIELDS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(NumericsSpec)
    if f.name in ("e2m1_ties", "outer_source", "e4m3_max", "four_over_six",
                  "four_over_six_error")}

PRESETS: dict[str, NumericsSpec] = {
    "minite": NumericsSpec(name="minite"),
    "te": NumericsSpec(
        name="te", outer_domain="tensor", amax_floor=None, zero_scale_encode="saturate",
        signed_zero="sign_of_nonzero", outer_convention="amax",
    ),
    "te_row": NumericsSpec(
        name="te_row", outer_domain="row", amax_floor=None, zero_scale_encode="saturate",
        signed_zero="sign_of_nonzero", outer_convention="amax",
    ),
    "torchao": NumericsSpec(
        name="torchao", outer_domain="expert", op_order="torchao", amax_floor=None,
        block_scale_floor=2.0**-6, signed_zero="sign_of_input", k_remainder="refuse",
        outer_convention="dec",
    ),
    "modelopt": NumericsSpec(
        name="modelopt", outer_domain="tensor", op_order="modelopt", amax_floor=None,
        block_scale_floor=2.0**-9, zero_prescale_to=1.0, signed_zero="sign_of_nonzero",
        outer_convention="dec",
    ),
    "compressed_tensors": NumericsSpec(
        name="compressed_tensors", outer_domain="tensor", op_order="compressed_tensors",
        amax_floor=None, zero_scale_to=0.125, signed_zero="sign_of_nonzero",
        k_remainder="refuse", outer_convention="enc", scale_math_dtype="input",
    ),
}

# The production recipes (Miles with TE and SGLang with FlashInfer): per-token activations,
# 4-over-6 block scaling and its E4M3 bound of 256.
PRESETS["flashinfer_pertoken"] = PRESETS["te_row"].replace(
    name="flashinfer_pertoken", signed_zero="sign_of_input", outer_convention="dec",
    k_remainder="refuse")
PRESETS["te_4over6"] = PRESETS["te"].replace(name="te_4over6", four_over_six="te", e4m3_max=256)
PRESETS["te_4over6_448"] = PRESETS["te_4over6"].replace(name="te_4over6_448", e4m3_max=448)
PRESETS["te_row_4over6"] = PRESETS["te_row"].replace(name="te_row_4over6", four_over_six="te",
                                                     e4m3_max=256, k_remainder="refuse")
PRESETS["flashinfer_pertoken_4over6"] = PRESETS["flashinfer_pertoken"].replace(
    name="flashinfer_pertoken_4over6", four_over_six="flashinfer", e4m3_max=256)
#: The presets of the production recipes (activation presets: the ``row`` ones).
RECIPE_PRESETS = ("flashinfer_pertoken", "te_4over6", "te_4over6_448", "te_row_4over6",
                  "flashinfer_pertoken_4over6")

_MX_COMMON = dict(outer_domain="none", amax_floor=None, signed_zero="sign_of_input",
                  k_remainder="refuse", outer_convention="dec", block_size=MX_BLOCK_SIZE)
PRESETS.update({
    name: NumericsSpec(name=name, op_order=order, **_MX_COMMON)
    for name, order in (("mxfp4", "mx_floor"), ("mxfp4_ceil", "mx_ceil"),
                        ("mxfp4_even", "mx_even"), ("mxfp4_te", "mx_te"))
})
#: The MXFP4 presets (E8M0 scales per 32 values); the others are NVFP4.
MX_PRESETS = ("mxfp4", "mxfp4_ceil", "mxfp4_even", "mxfp4_te")

# KV-cache formats (:mod:`libalign.models.kv_cache`): a row is one token's K (or V) of one head.
PRESETS["kv_nvfp4"] = PRESETS["minite"].replace(name="kv_nvfp4")
PRESETS["kv_mxfp4"] = PRESETS["mxfp4"].replace(name="kv_mxfp4")
# SGLang's two FP4 KV caches (``--kv-cache-dtype nvfp4`` and ``fp4_mx_block16``).
PRESETS["kv_sglang_nvfp4"] = NumericsSpec(
    name="kv_sglang_nvfp4", outer_domain="row", op_order="flashinfer", amax_floor=None,
    zero_scale_encode="saturate", signed_zero="sign_of_input", k_remainder="refuse",
    outer_convention="dec", outer_source="given",
)
PRESETS["kv_sglang_fp4_mx_block16"] = NumericsSpec(
    name="kv_sglang_fp4_mx_block16", op_order="mx_sglang", outer_domain="none", amax_floor=None,
    signed_zero="sign_of_nonzero", k_remainder="refuse", outer_convention="dec",
    block_size=BLOCK_SIZE, e2m1_ties="away",
)
#: The presets a KV cache can store K and V in.
KV_PRESETS = ("kv_nvfp4", "kv_mxfp4", "kv_sglang_nvfp4", "kv_sglang_fp4_mx_block16")
#: SGLang's ``--kv-cache-dtype`` value of each KV preset it writes (the others it cannot).
SGLANG_KV_DTYPES = {"kv_sglang_nvfp4": "nvfp4", "kv_sglang_fp4_mx_block16": "fp4_mx_block16"}
