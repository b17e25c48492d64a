"""Conditions of a diagnosis: which execution path the learner runs and which the sampler runs.

A condition is written ``learner/sampler`` (``bf16/nvfp4_minite``: the learner scores with bf16
experts, the sampler decoded with NVFP4 row-scaled experts). Two named sets exist; ``papers``
(the default, :data:`PAPER_CONDITIONS`) holds the pairs the miniTE and TRACE papers measure:

* ``bf16/bf16`` — the **cross-path floor**: the same weights and bf16 on both sides, but
  different execution (a batched full-sequence forward against an incremental KV-cached decode).
  Whatever δ remains here is not NVFP4's doing, and every other condition is compared to it.
* ``nvfp4_te/nvfp4_modelopt_pertoken`` — **standard NVFP4**, what production runs: a learner on
  Transformer Engine's NVFP4 recipe (per-tensor activation scale, RHT on the wgrad operands only)
  against a sampler serving ModelOpt NVFP4 weights with per-token activation scaling
  (SGLang's FlashInfer path);
* ``nvfp4_minite/nvfp4_minite`` — **miniTE**, the aligned pair: both sides run the same
  row-scaled NVFP4 spec;
* ``nvfp4_trace/nvfp4_minite`` — **TRACE**: the aligned pair with the learner rounding its
  activations as the sampler's guidance records say (:mod:`alignd.tools.diagnose.guided`).

``libalign`` (:data:`LIBALIGN_CONDITIONS`) is the earlier set built from libalign's own paths:
the floor, ``bf16/nvfp4_naive`` (a bf16 learner against a per-tensor-scaled NVFP4 sampler),
``bf16/nvfp4_minite``, the miniTE pair and the TRACE pair.

Path names are checked against :data:`libalign.gemm.PATHS`; an unknown one is a
:class:`~alignclient.errors.SpecError` naming it and the condition it came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from alignclient.errors import InputError, SpecError

from libalign.gemm import GUIDED, PATHS

PAPER_CONDITIONS = ("bf16/bf16", "nvfp4_te/nvfp4_modelopt_pertoken", "nvfp4_minite/nvfp4_minite",
                    "nvfp4_trace/nvfp4_minite")
LIBALIGN_CONDITIONS = ("bf16/bf16", "bf16/nvfp4_naive", "bf16/nvfp4_minite",
                       "nvfp4_minite/nvfp4_minite", "nvfp4_trace/nvfp4_minite")
PAIR_SETS = {"papers": PAPER_CONDITIONS, "libalign": LIBALIGN_CONDITIONS}
"""The named default sets (``--pairs``); ``papers`` is the default."""
DEFAULT_CONDITIONS = PAPER_CONDITIONS
FLOOR = "bf16/bf16"
EXTERNAL = "external"
"""Sampler name of log-probs supplied in a sequences file (no path re-runs them)."""


@dataclass(frozen=True)
class Condition:
    """One learner path against one sampler path."""

    learner: str
    sampler: str

    @property
    def name(self) -> str:
        """``learner/sampler``."""
        return f"{self.learner}/{self.sampler}"

    def __str__(self) -> str:
        return self.name


def check_path(name: str, where: str, *, allow_external: bool = False) -> str:
    """``name`` if it is a known execution path; SpecError naming it and ``where`` otherwise."""
    if name in PATHS or (allow_external and name == EXTERNAL):
        return name
    raise SpecError(f"{where}: unknown execution path {name!r}; known paths: "
                    f"{', '.join(sorted(PATHS))}")


def parse_condition(text: str, *, allow_external: bool = False) -> Condition:
    """``"learner/sampler"`` → :class:`Condition`, both path names checked."""
    parts = [p.strip() for p in text.split("/")]
    if len(parts) != 2 or not all(parts):
        raise InputError(f"condition {text!r} must be written learner/sampler, e.g. bf16/nvfp4_minite")
    learner = check_path(parts[0], f"condition {text!r} (learner)")
    sampler = check_path(parts[1], f"condition {text!r} (sampler)", allow_external=allow_external)
    return Condition(learner, sampler)


def split_list(text: str | None) -> list[str]:
    """Comma-separated items, stripped, empty ones dropped."""
    if text is None:
        return []
    return [s.strip() for s in text.split(",") if s.strip()]


def resolve_conditions(conditions: str | None = None, learner_paths: str | None = None,
                       sampler_paths: str | None = None, *, floor: str = FLOOR,
                       external: bool = False, pairs: str = "papers"
                       ) -> tuple[list[Condition], Condition]:
    """The conditions to run, and the floor every other condition is compared to.

    ``conditions`` (``"a/b,c/d"``); or ``learner_paths`` × ``sampler_paths`` (comma-separated
    lists, a missing one meaning ``bf16``); or, when none is given, the named set ``pairs``
    (:data:`PAIR_SETS`: ``papers``, the default, or ``libalign``).
    The floor always comes first. With ``external`` (a sequences file that
    carries sampler log-probs), each learner path is also paired with the external sampler.
    """
    floor_c = parse_condition(floor)
    if conditions:
        if learner_paths or sampler_paths:
            raise InputError("give either --conditions or --learner-paths/--sampler-paths, not both")
        chosen = [parse_condition(c, allow_external=external) for c in split_list(conditions)]
        if not chosen:
            raise InputError(f"--conditions {conditions!r} names no condition")
    elif learner_paths or sampler_paths:
        ls = [check_path(p, "--learner-paths") for p in split_list(learner_paths)] or ["bf16"]
        ss = [check_path(p, "--sampler-paths") for p in split_list(sampler_paths)] or ["bf16"]
        chosen = [Condition(a, b) for a in ls for b in ss]
    else:
        if pairs not in PAIR_SETS:
            raise InputError(f"--pairs {pairs!r} is not a pair set; choose one of "
                             f"{', '.join(PAIR_SETS)}")
        chosen = [parse_condition(c) for c in PAIR_SETS[pairs]]
    if external:
        for learner in dict.fromkeys(c.learner for c in chosen):
            if learner != GUIDED:  # external log-probs come without guidance records
                chosen.append(Condition(learner, EXTERNAL))
    out = [floor_c]
    for c in chosen:
        if c not in out:
            out.append(c)
    return out, floor_c


def paths_of(conditions: Iterable[Condition], side: str) -> list[str]:
    """Distinct paths one side runs, in first-seen order (the external sampler excluded)."""
    names = (c.learner if side == "learner" else c.sampler for c in conditions)
    return [n for n in dict.fromkeys(names) if n != EXTERNAL]


def parse_layers(text: str | None, num_layers: int, option: str) -> list[int]:
    """``all`` / ``none`` / ``"0,3"`` / ``"-1"`` → sorted layer indices in ``[0, num_layers)``."""
    if text is None or text.strip().lower() in ("", "none"):
        return []
    if text.strip().lower() == "all":
        return list(range(num_layers))
    out = []
    for item in split_list(text):
        try:
            v = int(item)
        except ValueError:
            raise InputError(f"{option}: {item!r} is not a layer index") from None
        if v < 0:
            v += num_layers
        if not 0 <= v < num_layers:
            raise InputError(f"{option}: layer {item} is out of range; the model has "
                             f"{num_layers} layers (0..{num_layers - 1})")
        out.append(v)
    return sorted(set(out))


def ensure_unique(names: Sequence[str], what: str) -> None:
    """InputError if a name repeats."""
    seen = set()
    for n in names:
        if n in seen:
            raise InputError(f"{what} {n!r} is given twice")
        seen.add(n)
