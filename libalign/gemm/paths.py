"""Execution paths: what a learner or a sampler multiplies its experts with, by name.

A path fixes one :class:`~libalign.spec.NumericsSpec` per GEMM operand (or none: bf16), whether
activations round as the sampler's guidance records say (``guided``, TRACE) and the KV cache's
format. :data:`PATHS` holds the built-in ones:

* ``bf16``: no quantization;
* ``nvfp4_naive``: one outer scale per activation tensor and per expert weight (the common
  recipe);
* ``nvfp4_minite``: row-scaled activations and weights (the miniTE spec);
* ``nvfp4_trace`` (:data:`GUIDED`): ``nvfp4_minite``'s numerics, rounded as guided;
* the production recipes (:func:`te_recipe_path` builds TE's from its switches):
  ``nvfp4_modelopt_pertoken`` (SGLang serving ModelOpt weights, one ``weight_scale_2`` per
  expert, with FlashInfer's per-token activations), ``nvfp4_te`` (TE's NVFP4 recipe, per-tensor
  activations, RHT on), ``nvfp4_te_rowact`` (TE with row-scaled activations as Miles runs it:
  RHT, 2-D weight tiles and stochastic rounding off), ``nvfp4_te_rowact_4over6`` (the same with
  4-over-6 on weights and activations, bound 256) and ``nvfp4_sglang_pertoken_4over6`` (its
  sampler: the TE 4-over-6 weights as Miles exports them, ``weight_scale_2`` the decode scale,
  with FlashInfer's per-token 4-over-6 activations);
* ``nvfp4_minite_kv_*`` / ``nvfp4_trace_kv_*``: the same with an FP4 KV cache, one pair per KV
  preset (``kv_nvfp4``, ``kv_mxfp4``, and SGLang's ``kv_sglang_nvfp4``,
  ``kv_sglang_fp4_mx_block16``).

Everything else asks :func:`get_path` for a name once and reads the fields, never the name.
"""

from __future__ import annotations

from dataclasses import dataclass

from libalign.errors import SpecError
from libalign.spec import PRESETS, NumericsSpec
from libalign.spec.choices import Choice
from libalign.spec.presets import KV_PRESETS


class Epilogue(Choice):
    """How the fp32 accumulator of a W4A4 product becomes the output (step 3 of the product).

    * ``dec_product`` (libalign, SGLang/FlashInfer MoE): ``fl(acc * fl(a_dec[m] * w_dec[n]))``,
      the product of the two decode scales (FlashInfer's CuTe DSL MoE forms ``alpha[e] *
      per_token_scale[m]`` and multiplies once);
    * ``te_alpha`` (TE, per-tensor operands): ``fl(acc * alpha)`` with ``alpha =
      fl(fl(A_w * A_a) * fl(1 / (36 E_w E_a)))`` from the stored maxima ``A`` and each
      operand's E4M3 bound ``E`` (``nvte_nvfp4_compute_per_tensor_scale``);
    * ``te_row`` (TE with row-scaled activations): the per-tensor GEMM with both maxima set
      to 1, then ``fl(fl(acc * fl(1 / (36 E_w E_a))) * fl(A_a[m] * A_w))`` on the fp32 output
      (``cpp_extensions/gemm.py``, ``_nvfp4_row_scaled_gemm_inputs``).
    """

    DEC_PRODUCT = "dec_product"
    TE_ALPHA = "te_alpha"
    TE_ROW = "te_row"


class Backend(Choice):
    """Which grouped-GEMM backend serves a call (:mod:`libalign.gemm.backends`)."""

    AUTO = "auto"
    REFERENCE = "reference"
    TORCH = "torch"
    TRITON = "triton"
    NATIVE = "native"

#: The guided path's name: ``nvfp4_minite``'s numerics, rounded as the sampler's records say.
GUIDED = "nvfp4_trace"


@dataclass(frozen=True)
class ExecutionPath:
    """How one side multiplies by its experts: one numerics spec per operand, or none (bf16).

    ``act_spec.outer_domain`` is ``row`` (one scale per token row) or ``tensor`` (one scale
    over all rows of the grouped call); ``weight_spec.outer_domain`` is ``row`` (per output
    row of each expert), ``expert``, ``tensor`` or ``none``.
    """

    name: str
    weight_spec: NumericsSpec | None = None
    act_spec: NumericsSpec | None = None
    description: str = ""
    kv_spec: NumericsSpec | None = None
    """The KV cache's format (a KV preset: ``kv_nvfp4``, ``kv_sglang_nvfp4``, ...), None: K and
    V stay in the model's dtype; :mod:`libalign.models.kv_cache` quantizes them on write."""
    guided: bool = False
    """True when the path rounds as the sampler's guidance records say (TRACE): the learner
    needs the rollout's records, the sampler records them. The spec is its unguided twin's."""
    backend: Backend = Backend.AUTO
    """The grouped-GEMM backend a call on this path uses unless it names one (``auto``: the
    fastest that serves the call on its device)."""
    epilogue: Epilogue = Epilogue.DEC_PRODUCT
    """How the accumulator is scaled into the output (:class:`Epilogue`)."""
    rht: bool = False
    """TE's random Hadamard transform is on. TE applies it only to the wgrad operands (Xᵀ and
    dYᵀ, column-wise), never to weights nor to the forward's row-wise activations, so the
    forward bits are those of the same path without it; libalign's backward is the bf16
    straight-through product, which quantizes nothing, so here it is a recorded fact. TE
    refuses it with row-scaled activations and with 4-over-6, and so does this class."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "backend", Backend(self.backend))
        except ValueError:
            raise SpecError(f"path {self.name!r}: backend must be one of {Backend.values()}, "
                            f"got {self.backend!r}") from None
        if (self.weight_spec is None) != (self.act_spec is None):
            raise SpecError(f"path {self.name!r}: quantize both operands or neither")
        for what, spec in (("weight", self.weight_spec), ("activation", self.act_spec)):
            if spec is not None and spec.hadamard:
                raise SpecError(f"path {self.name!r}: the W4A4 GEMM takes {what} specs "
                                "without the Hadamard rotation")
            if spec is not None and spec.stochastic_rounding:
                raise SpecError(f"path {self.name!r}: stochastic rounding is not a GEMM path")
        if self.guided and self.act_spec is None:
            raise SpecError(f"path {self.name!r}: only a quantized path can be guided")
        object.__setattr__(self, "epilogue", Epilogue(self.epilogue))
        if self.epilogue != Epilogue.DEC_PRODUCT:
            for spec in (self.weight_spec, self.act_spec):
                if spec is None or spec.outer_convention != "amax":
                    raise SpecError(f"path {self.name!r}: TE's epilogue {self.epilogue!r} reads "
                                    "stored maxima: both specs need outer convention 'amax'")
        if self.rht and self.act_spec is not None:
            if self.act_spec.outer_domain == "row":
                raise SpecError(f"path {self.name!r}: TE refuses row-scaled NVFP4 activations "
                                "with RHT ('Row-scaled NVFP4 quantization does not support RHT')")
            if self.act_spec.four_over_six != "off":
                raise SpecError(f"path {self.name!r}: TE refuses 4-over-6 activations with RHT "
                                "('NVFP4 4over6 quantization does not support RHT')")
        if self.act_spec is not None and self.act_spec.outer_domain not in ("row", "tensor", "none"):
            raise SpecError(f"path {self.name!r}: activation outer domain must be row, tensor "
                            f"or none, got {self.act_spec.outer_domain!r}")

    @property
    def quantized(self) -> bool:
        """True when the path multiplies NVFP4 operands."""
        return self.weight_spec is not None


_TE_EXPERT = PRESETS["te"].replace(name="te_expert", outer_domain="expert")

PATHS: dict[str, ExecutionPath] = {
    "bf16": ExecutionPath("bf16", description="bf16 operands, fp32 accumulation"),
    "nvfp4_naive": ExecutionPath(
        "nvfp4_naive", _TE_EXPERT, PRESETS["te"],
        "NVFP4, one outer scale per activation tensor and per expert weight (common recipe)"),
    "nvfp4_minite": ExecutionPath(
        "nvfp4_minite", PRESETS["minite"], PRESETS["minite"],
        "NVFP4, row-scaled activations and weights (the miniTE spec)"),
    GUIDED: ExecutionPath(
        GUIDED, PRESETS["minite"], PRESETS["minite"],
        "NVFP4 as nvfp4_minite, activations rounded as the sampler's guidance records say "
        "(TRACE; round-to-nearest where no record is attached)", guided=True),
}
for _kv in KV_PRESETS:  # FP4 KV cache: the path's name says its KV format
    PATHS[f"nvfp4_minite_{_kv}"] = ExecutionPath(
        f"nvfp4_minite_{_kv}", PRESETS["minite"], PRESETS["minite"],
        f"nvfp4_minite with K and V stored as {_kv} (quantized on write)", PRESETS[_kv])
    PATHS[f"{GUIDED}_{_kv}"] = ExecutionPath(
        f"{GUIDED}_{_kv}", PRESETS["minite"], PRESETS["minite"],
        f"{GUIDED} with K and V quantized as {_kv}, rounded as the sampler's KV guidance "
        "records say", PRESETS[_kv], guided=True)


_MODELOPT_EXPERT = PRESETS["modelopt"].replace(name="modelopt_expert", outer_domain="expert")
_TE_4OVER6_EXPERT = PRESETS["te_4over6"].replace(name="te_4over6_expert", outer_domain="expert")


def te_recipe_path(*, row_scaled_activation: bool = False, rht: bool = True,
                   four_over_six: bool = False, e4m3_use_256: bool = True,
                   error: str = "mae") -> ExecutionPath:
    """TE's NVFP4 recipe forward as its switches set it, with 1-D 16-value weight blocks.

    ``row_scaled_activation`` is ``NVTE_NVFP4_ROW_SCALED_ACTIVATION``, ``rht`` the inverse of
    ``NVTE_NVFP4_DISABLE_RHT``, ``four_over_six`` ``NVTE_NVFP4_4OVER6=all`` with
    ``NVTE_NVFP4_4OVER6_E4M3_USE_256`` and ``..._ERR_MODE``. TE refuses row-scaled activations
    and 4-over-6 activations with RHT, and so does this (:class:`SpecError`); with RHT on and
    per-tensor activations the forward bits are the same as with it off (it rotates only the
    wgrad operands). Weights are per expert (each expert one TE linear layer).
    """
    act = PRESETS["te_row" if row_scaled_activation else "te"]
    weight = _TE_EXPERT
    if four_over_six:
        changes = dict(four_over_six="te", e4m3_max=256 if e4m3_use_256 else 448,
                       four_over_six_error=error)
        act = act.replace(name=f"{act.name}_4over6", **changes)
        weight = weight.replace(name="te_4over6_expert", **changes)
    name = "nvfp4_te" + ("_rowact" if row_scaled_activation else "") + \
        ("_4over6" if four_over_six else "") + ("_rht" if rht and row_scaled_activation else "")
    return ExecutionPath(
        name, weight, act, "TE NVFP4 recipe forward: " + ", ".join(
            ["row-scaled activations" if row_scaled_activation else "per-tensor activations",
             "RHT on the wgrad operands" if rht else "RHT off",
             "4-over-6" if four_over_six else "standard blocks"]),
        epilogue=Epilogue.TE_ROW if row_scaled_activation else Epilogue.TE_ALPHA, rht=rht)


PATHS["nvfp4_modelopt_pertoken"] = ExecutionPath(
    "nvfp4_modelopt_pertoken", _MODELOPT_EXPERT, PRESETS["flashinfer_pertoken"],
    "SGLang: ModelOpt NVFP4 weights (weight_scale_2 per expert), FlashInfer per-token activations")
PATHS["nvfp4_te"] = te_recipe_path()
PATHS["nvfp4_te_rowact"] = te_recipe_path(row_scaled_activation=True, rht=False)
PATHS["nvfp4_te_rowact_4over6"] = te_recipe_path(row_scaled_activation=True, rht=False,
                                                 four_over_six=True)
PATHS["nvfp4_sglang_pertoken_4over6"] = ExecutionPath(
    "nvfp4_sglang_pertoken_4over6",
    _TE_4OVER6_EXPERT.replace(name="te_4over6_expert_dec", outer_convention="dec"),
    PRESETS["flashinfer_pertoken_4over6"],
    "SGLang serving Miles' TE 4-over-6 weights with FlashInfer per-token 4-over-6 activations")
#: The production recipes' paths (learner and sampler of Miles/SGLang, the paper's pair).
RECIPE_PATHS = ("nvfp4_modelopt_pertoken", "nvfp4_te", "nvfp4_te_rowact",
                "nvfp4_te_rowact_4over6", "nvfp4_sglang_pertoken_4over6")


def register_path(path: ExecutionPath) -> None:
    """Add a named path (e.g. a guided-rounding path) that :func:`get_path` will find."""
    PATHS[path.name] = path


def guided_paths() -> frozenset[str]:
    """The names of the paths that round as guidance records say (:attr:`ExecutionPath.guided`)."""
    return frozenset(name for name, p in PATHS.items() if p.guided)


def get_path(path: str | ExecutionPath) -> ExecutionPath:
    """The path of that name; :class:`~libalign.errors.SpecError` names the known ones."""
    if isinstance(path, ExecutionPath):
        return path
    try:
        return PATHS[path]
    except KeyError:
        raise SpecError(f"unknown execution path {path!r}; known: {sorted(PATHS)}") from None
