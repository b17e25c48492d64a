"""The plan of a checkpoint export: everything decided before a tensor is read.

From the shard headers alone (:meth:`~alignd.formats.hf_checkpoint.HFCheckpoint.headers`) the
plan fixes which tensors convert (:func:`~alignd.formats.selection.select_for_export`),
which fused groups share one outer scale, which of those groups straddle shards (their
shared maximum is pre-scanned), the processing units of each shard (one tensor, or the
members of a fused group that share a shard) and the name, shape and dtype of every stored
tensor. So every output shard's header is known before its first tensor is read, and two
stored tensors that would collide are refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from alignclient.errors import LayoutError, SpecError

from alignd.formats.hf_checkpoint import ST_DTYPES, HFCheckpoint, SourceTensor
from alignd.formats.selection import fused_groups, select_for_export, stack_members
from libalign.checkpoint import FORMATS, stored_layout
from libalign.spec import PRESETS, NumericsSpec
from libalign.spec.presets import MX_PRESETS

#: Presets that make sense for a stored checkpoint (``te_row`` and the per-token presets are
#: activation variants); TE's 4-over-6 weights (``te_4over6``: E4M3 bound 256,
#: ``te_4over6_448``) store like ``te``; the MXFP4 ones store in compressed-tensors'
#: ``mxfp4-pack-quantized`` layout only.
CHECKPOINT_PRESETS = ("minite", "modelopt", "compressed_tensors", "torchao", "te", "te_4over6",
                      "te_4over6_448", *MX_PRESETS)


@dataclass
class Unit:
    """Tensors read, converted and written together (one tensor, or a same-shard group)."""

    members: list[SourceTensor]
    convert: bool
    group: str | None = None


@dataclass
class ExportPlan:
    """Everything decided before reading tensor data."""

    src: Path
    preset: str
    spec: NumericsSpec
    fmt: str
    all_linear: bool
    shards: list[str]
    tensors: dict[str, SourceTensor]
    shard_metadata: dict[str, dict[str, str]]
    converted: list[str]
    excluded_modules: list[str]
    groups: dict[str, list[str]]
    group_of: dict[str, str]
    straddling: list[str]
    indexed: bool = True
    units: dict[str, list[Unit]] = field(default_factory=dict)
    converted_set: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.converted_set = set(self.converted)

    @property
    def row_scaled(self) -> bool:
        """The preset keeps one outer scale per output row."""
        return self.spec.outer_domain == "row"

    def outputs(self, t: SourceTensor) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """Name, shape, dtype and role of each stored tensor that ``t`` becomes."""
        if t.name not in self.converted_set:
            return [(t.name, t.shape, ST_DTYPES[t.dtype], "copied")]
        roles = ("nvfp4_codes", "nvfp4_block_scales", "nvfp4_outer_scale")
        if self.spec.is_mx:
            roles = ("mxfp4_codes", "mxfp4_block_scales")
        if len(t.shape) == 3:  # an expert stack: one weight per expert projection
            weights = [(w, (rows.stop - rows.start if rows is not None else t.shape[1],
                            t.shape[2])) for w, _, rows in stack_members(t.name, t.shape)]
        else:
            weights = [(t.name, t.shape)]
        out = []
        for weight, shape2d in weights:
            module = weight.removesuffix(".weight")
            layout = stored_layout(self.fmt, shape2d, self.row_scaled, mx=self.spec.is_mx)
            out += [(f"{module}.{key}", shape, dtype, role)
                    for (key, (shape, dtype)), role in zip(layout.items(), roles, strict=True)]
        return out


def check_preset(preset: str, fmt: str) -> NumericsSpec:
    """The spec of a checkpoint preset, refused where the format cannot store it."""
    if preset not in CHECKPOINT_PRESETS:
        raise SpecError(f"preset {preset!r} is not for checkpoints; choose one of {CHECKPOINT_PRESETS}")
    if fmt not in FORMATS:
        raise SpecError(f"format {fmt!r} is unknown; choose one of {FORMATS}")
    spec = PRESETS[preset]
    if spec.is_mx and fmt != "compressed-tensors":
        raise SpecError(f"preset {preset!r} is MXFP4, which peers load from compressed-tensors' "
                        f"mxfp4-pack-quantized layout; use --format compressed-tensors")
    if fmt == "compressed-tensors" and spec.outer_domain == "row":
        raise SpecError(f"preset {preset!r} keeps one outer scale per row and compressed-tensors "
                        f"stores one global scale per weight; use --format modelopt (per-row "
                        f"weight_scale_2) or a tensor-scaled preset (modelopt, "
                        f"compressed_tensors, torchao, te)")
    return spec


def plan_export(src: Path, preset: str = "minite", fmt: str = "modelopt",
                all_linear: bool = False) -> ExportPlan:
    """Read the headers, choose tensors and fused groups, and lay out every output shard."""
    spec = check_preset(preset, fmt)
    src = Path(src)
    checkpoint = HFCheckpoint(src)
    shards, tensors, metadata = checkpoint.headers()
    converted, excluded = select_for_export(tensors, all_linear, spec.block_size)
    if not converted:
        raise LayoutError(f"{src} has no tensor to convert (no routed-expert weights"
                          f"{'' if all_linear else '; try --all-linear'})")
    groups = fused_groups(converted) if spec.outer_domain in ("tensor", "expert") else {}
    group_of = {n: k for k, members in groups.items() for n in members}
    straddling = sorted(k for k, m in groups.items() if len({tensors[n].shard for n in m}) > 1)
    plan = ExportPlan(src, preset, spec, fmt, all_linear, shards, tensors, metadata, converted,
                      sorted(excluded), groups, group_of, straddling, checkpoint.indexed)
    conv = set(converted)
    seen_out: dict[str, str] = {}
    for shard in shards:
        units: list[Unit] = []
        done: set[str] = set()
        for name in sorted(n for n, t in tensors.items() if t.shard == shard):
            if name in done:
                continue
            key = group_of.get(name)
            if key is not None and key not in straddling:
                members = [tensors[m] for m in groups[key]]
                units.append(Unit(members, True, key))
                done.update(groups[key])
            else:
                units.append(Unit([tensors[name]], name in conv, key))
                done.add(name)
            for t in units[-1].members:
                for out, *_ in plan.outputs(t):
                    if out in seen_out:
                        raise LayoutError(f"output tensor {out!r} (from {t.name!r}) collides "
                                          f"with one from {seen_out[out]!r}")
                    seen_out[out] = t.name
        plan.units[shard] = units
    return plan
