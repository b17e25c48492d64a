"""Execution paths: what a learner or a sampler multiplies its experts with, by name.

A path fixes one :class:`~libalign.spec.NumericsSpec` per GEMM operand (or none: bf16), whether
activations round as the sampler's guidance records say (``guided``, TRACE) and the KV cache's
format. :data:`PATHS` holds the built-in ones:

* ``bf16``: no quantization;
* ``nvfp4_naive``: one outer scale per activation tensor and per expert weight (the common
  recipe);
* ``nvfp4_minite``: row-scaled activations and weights (the miniTE spec);
* ``nvfp4_trace`` (:data:`GUIDED`): ``nvfp4_minite``'s numerics, rounded as guided;
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
