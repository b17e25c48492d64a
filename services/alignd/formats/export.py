"""Export a Hugging Face safetensors checkpoint as NVFP4: what ``alignd convert`` runs.

Input: a checkpoint directory with ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, a ``config.json`` and any tokenizer or other files.
Output: the same directory with the selected weights replaced by NVFP4 tensors, in
ModelOpt layout (``weight`` uint8, ``weight_scale`` float8_e4m3fn, ``weight_scale_2``
fp32: what SGLang's ``modelopt_fp4`` loads) or compressed-tensors layout
(``weight_packed``, ``weight_scale``, ``weight_global_scale``), the matching
``quantization_config`` in ``config.json`` (and ``hf_quant_config.json`` for ModelOpt;
an MXFP4 preset writes compressed-tensors' ``mxfp4-pack-quantized``: ``weight_packed`` and
uint8 E8M0 ``weight_scale``, no global scale, what vLLM and SGLang load as MXFP4),
a new index, every other file copied byte for byte, and ``manifest.json``. Weight files
outside the conversion (other ``*.safetensors``, ``pytorch_model*.bin``) are not copied;
the manifest lists them under ``files_skipped``. The index must agree with the shards: a
tensor in a shard the index does not map there, or an index entry its shard lacks, is a
:class:`LayoutError`.

Which tensors (:mod:`alignd.formats.selection`)
    By default the routed experts' ``gate_proj``, ``up_proj`` and ``down_proj`` weights
    (Qwen3-MoE naming ``*.mlp.experts.E.<proj>.weight``; Mixtral's ``w1``/``w3``/``w2``
    too). With ``all_linear`` every 2-D floating ``*.weight`` whose K is a multiple of
    16, except embeddings, ``lm_head``, norms and routers (``mlp.gate``,
    ``shared_expert_gate``, ``*router*``). Every other linear-like weight is named in the
    format's exclude/ignore list (:mod:`alignd.formats.quant_configs`). 3-D expert stacks
    (transformers 5's ``...experts.gate_up_proj`` ``[E, 2I, H]``, ``...experts.down_proj``)
    are split into the per-expert weights the formats and the servers name
    (``...experts.<e>.gate_proj`` ...; :func:`alignd.formats.selection.stack_members`), with
    the expert's outer scale (a split ``gate_up_proj`` keeps one scale for gate and up); a
    stack of another name is copied unchanged.

The order of work
    :func:`~alignd.formats.export_plan.plan_export` reads the shard headers and decides
    everything (tensors, fused groups, units, every output header); this module then
    pre-scans straddling groups, streams each shard into its output
    (:class:`~alignd.formats.hf_checkpoint.ShardWriter`), writes the index, the configs and
    the manifest, and copies the other files.

Fused siblings share one outer scale
    Samplers fuse ``gate_proj`` with ``up_proj`` (w1/w3) and ``q/k/v_proj`` into one
    GEMM with one outer scale, so under a tensor- or expert-scaled preset the members of
    such a group are quantized with ``outer_amax = shared_outer_amax(members)``. A group
    whose members lie in different shards has its maximum computed first, by a pre-scan
    that reads those members one tensor at a time. Row-scaled presets need no sharing.

Memory
    Nothing holds a shard. A shard's output file is written streaming: its header is
    known before any tensor is read (stored shapes follow from source shapes), so each
    processing unit (one tensor, or the members of a fused group that share a shard) is
    read, quantized, written at its offset and dropped before the next. Peak memory is
    about one fused group plus its quantization temporaries, whatever the shard size, and
    each output shard is complete before the next source shard is opened.

Row-scaled presets in ModelOpt layout
    ``minite`` has one outer scale per output row. ModelOpt's format has one per weight,
    so ``weight_scale_2`` is stored as an fp32 ``[N, 1]`` column of per-row decode scales
    (ModelOpt's own dequantization broadcasts it correctly). Stock loaders (SGLang
    ``modelopt_fp4``, vLLM, TensorRT-LLM) expect a scalar and cannot load such a
    checkpoint; ``config.json`` and the manifest say so. compressed-tensors cannot express
    it at all, so ``minite`` with that format is refused.

No ``input_scale``
    A ModelOpt W4A4 checkpoint usually carries a calibrated static activation scale per
    linear layer. A weight converter sees no activations, so it writes none rather than
    invent one; an engine running W4A4 must get activation scales elsewhere (libalign's
    sampler quantizes activations itself). The compressed-tensors config is accordingly
    weight-only (``input_activations: null``, like its ``NVFP4A16`` preset).

Failure
    The output directory appears atomically (:func:`atomic_directory`): a NaN weight
    (:class:`NonFiniteError` naming the tensor), a shard missing from the index
    (:class:`MissingShardError`), a wrong dtype (:class:`DTypeError`) or anything else
    leaves nothing at the destination.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from alignclient.errors import AlignError, InputError, LayoutError, NonFiniteError
from safetensors import safe_open

import libalign
from alignd.formats.export_plan import ExportPlan, Unit, plan_export
from alignd.formats.hf_checkpoint import (
    CONFIG_NAME,
    HF_QUANT_CONFIG,
    INDEX_NAME,
    MANIFEST_NAME,
    ST_CODES,
    ST_DTYPES,
    ShardWriter,
    SourceTensor,
    itemsize,
)
from alignd.formats.modelopt_export import expert_parts
from alignd.formats.quant_configs import (
    compressed_tensors_quantization_config,
    libalign_note,
    manifest_notes,
    modelopt_hf_quant_config,
    modelopt_quantization_config,
)
from libalign.atomic_dir import TMP_PREFIX, DestinationExistsError, atomic_directory, sha256_file
from libalign.checkpoint import to_format
from libalign.kernels import ops
from libalign.spec import NumericsSpec, NVFP4Tensor, check_finite, shared_outer_amax

MANIFEST_VERSION = 1

Progress = Callable[[int, int, str], None]


@dataclass
class ExportResult:
    """Where the export went and what its manifest says."""

    dst: Path
    manifest: dict[str, Any]


class _Clock:
    """Seconds spent per stage."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    def __call__(self, stage: str):
        return _Timed(self, stage)


class _Timed:
    def __init__(self, clock: _Clock, stage: str):
        self.clock, self.stage = clock, stage

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        s = self.clock.stages
        s[self.stage] = s.get(self.stage, 0.0) + time.perf_counter() - self.t0


def _load(f, t: SourceTensor, clock: _Clock) -> torch.Tensor:
    with clock("read"):
        x = f.get_tensor(t.name)
    if x.dtype != ST_DTYPES[t.dtype] or tuple(x.shape) != t.shape:
        raise LayoutError(f"{t.name}: read {tuple(x.shape)} {x.dtype}, header says {t.shape} {t.dtype}")
    return x


def _name_nonfinite(members: list[SourceTensor], xs: list[torch.Tensor], fn):
    """Run ``fn``; a NonFiniteError it raises is raised again naming the offending tensor.

    The spec and the kernels check finiteness anyway (as ``input``); naming the tensor
    costs a second check only on that failure path.
    """
    try:
        return fn()
    except NonFiniteError as e:
        for t, x in zip(members, xs, strict=True):
            check_finite(x, t.name)
        raise NonFiniteError(members[0].name, e.count, e.nan, e.inf, e.first_indices) from e


def _quantize(name: str, x: torch.Tensor, spec: NumericsSpec,
              outer_amax: torch.Tensor | None) -> NVFP4Tensor:
    try:
        return ops.quantize(x, spec, outer_amax=outer_amax)
    except NonFiniteError:
        raise
    except AlignError as e:
        try:
            named = type(e)(f"{name}: {e}")
        except TypeError:
            raise e from None
        raise named from e


def _prescan(plan: ExportPlan, clock: _Clock, device: str, tick) -> dict[str, torch.Tensor]:
    """Shared outer maxima of fused groups whose members lie in different shards."""
    amax: dict[str, torch.Tensor] = {}
    for key in plan.straddling:
        for name in plan.groups[key]:
            t = plan.tensors[name]
            with safe_open(plan.src / t.shard, framework="pt") as f:
                x = _load(f, t, clock).to(device)
            with clock("prescan"):
                a = _name_nonfinite([t], [x], lambda x=x: shared_outer_amax([x], plan.spec))
            del x
            amax[key] = a if key not in amax else torch.maximum(amax[key], a)
            tick(t.nbytes, f"pre-scan {name}")
    return amax


def _process_unit(f, unit: Unit, plan: ExportPlan, clock: _Clock, device: str,
                  amax: dict[str, torch.Tensor]) -> list[tuple[SourceTensor, dict[str, torch.Tensor], bool]]:
    """Read one unit and return, per member, the tensors to store and whether it converted."""
    xs = [_load(f, t, clock) for t in unit.members]
    if not unit.convert:
        return [(t, {t.name: x}, False) for t, x in zip(unit.members, xs, strict=True)]
    xs = [x.to(device) for x in xs]
    with clock("quantize"):
        if unit.group is None:
            shared = None
        elif unit.group in amax:
            shared = amax[unit.group]
        else:
            shared = _name_nonfinite(unit.members, xs, lambda: shared_outer_amax(xs, plan.spec))
        out = []
        for t, x in zip(unit.members, xs, strict=True):
            q = _name_nonfinite([t], [x], lambda t=t, x=x: _quantize(t.name, x, plan.spec, shared))
            if len(t.shape) == 3:  # an expert stack, split per expert projection
                parts = list(expert_parts(t.name, q, plan.fmt))
            else:
                parts = [(t.name, to_format(q, plan.fmt, row_scaled_ok=True))]
            stored = {f"{weight.removesuffix('.weight')}.{k}": v.cpu()
                      for weight, tensors in parts for k, v in tensors.items()}
            out.append((t, stored, True))
    return out


def _emit_unit(f, unit: Unit, plan: ExportPlan, clock: _Clock, device: str,
               amax: dict[str, torch.Tensor], writer: ShardWriter, roles: dict[str, str],
               records: list[dict], converted: list[dict]) -> None:
    """Read, convert and write one unit, appending its manifest records."""
    for t, stored, was_converted in _process_unit(f, unit, plan, clock, device, amax):
        with clock("write"):
            for name, tensor in stored.items():
                records.append({
                    "name": name, "shape": list(tensor.shape), "dtype": ST_CODES[tensor.dtype],
                    "shard": writer.path.name, "sha256": writer.write(name, tensor),
                    "role": roles[name], "source": t.name,
                    "preset": plan.preset if was_converted else None,
                })
        if was_converted:
            converted.append({
                "source": t.name, "shape": list(t.shape), "dtype": t.dtype, "outputs": list(stored),
                "outer_shared_with": [m for m in plan.groups.get(unit.group or "", []) if m != t.name],
            })


def _write_shard(plan: ExportPlan, shard: str, out: Path, clock: _Clock, device: str,
                 amax: dict[str, torch.Tensor], tick) -> tuple[list[dict], list[dict]]:
    """Stream one source shard into its output shard; return tensor and conversion records."""
    roles: dict[str, str] = {}
    entries = []
    for unit in plan.units[shard]:
        for t in unit.members:
            for name, shape, dtype, role in plan.outputs(t):
                entries.append((name, shape, dtype))
                roles[name] = role
    records: list[dict] = []
    converted: list[dict] = []
    (out / shard).parent.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out / shard, entries, {**plan.shard_metadata[shard], "format": "pt"})
    try:
        with safe_open(plan.src / shard, framework="pt") as f:
            for unit in plan.units[shard]:
                # a call per unit: its tensors die with the call's frame, before the next read
                _emit_unit(f, unit, plan, clock, device, amax, writer, roles, records, converted)
                tick(sum(t.nbytes for t in unit.members), unit.members[-1].name)
        with clock("write"):
            writer.close()
    except BaseException:
        writer.abort()
        raise
    with safe_open(out / shard, framework="pt") as check:
        if set(check.keys()) != {e[0] for e in entries}:
            raise LayoutError(f"{shard}: the written header does not list the planned tensors")
    return records, converted


def _copy_other_files(src: Path, out: Path, skip: set[str]) -> tuple[list[dict], list[str]]:
    """Copy every non-weight file of ``src`` (recursively); return copied and skipped."""
    copied, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = Path(dirpath).relative_to(src)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(TMP_PREFIX))
        for fname in sorted(filenames):
            rel = (rel_dir / fname).as_posix()
            if rel in skip or fname.endswith(".safetensors") or fname.startswith(TMP_PREFIX) \
                    or (fname.startswith("pytorch_model") and ".bin" in fname):
                skipped.append(rel)
                continue
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(dirpath) / fname, target)
            copied.append({"path": rel, "bytes": target.stat().st_size,
                           "sha256": sha256_file(target)})
    return copied, skipped


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise InputError(f"destination {dst} must lie outside the source {src} (and not contain it)")


def convert_checkpoint(src: Path | str, dst: Path | str, *, preset: str = "minite",
                       fmt: str = "modelopt", all_linear: bool = False, overwrite: bool = False,
                       device: str = "cpu", progress: Progress | None = None) -> ExportResult:
    """Convert checkpoint ``src`` to an NVFP4 checkpoint at ``dst`` (atomically); see module doc."""
    t_start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst)
    if dst.exists() and not overwrite:
        raise DestinationExistsError(f"{dst} already exists (pass --overwrite to replace it)")
    clock = _Clock()
    with clock("plan"):
        plan = plan_export(src, preset, fmt, all_linear)
        config_path = src / CONFIG_NAME
        if not config_path.is_file():
            raise LayoutError(f"{src} has no config.json")
        config = json.loads(config_path.read_text())
        if "quantization_config" in config:
            raise LayoutError(f"{config_path} already has a quantization_config "
                              f"({config['quantization_config'].get('quant_method', '?')}); "
                              f"convert an unquantized checkpoint")

    total = sum(t.nbytes for t in plan.tensors.values())
    total += sum(plan.tensors[n].nbytes for k in plan.straddling for n in plan.groups[k])
    done = 0

    def tick(nbytes: int, what: str) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total, what)

    if progress is not None:
        progress(0, total, "planning done")
    records: list[dict[str, Any]] = []
    converted_records: list[dict[str, Any]] = []
    with atomic_directory(dst, overwrite=overwrite) as out:
        amax = _prescan(plan, clock, device, tick)
        for shard in plan.shards:
            recs, conv = _write_shard(plan, shard, out, clock, device, amax, tick)
            records += recs
            converted_records += conv
        shard_bytes_out = sum((out / s).stat().st_size for s in plan.shards)
        weight_map = {r["name"]: r["shard"] for r in records}

        with clock("files"):
            bytes_out = sum(_record_bytes(r) for r in records)
            index = {"metadata": {"total_size": bytes_out},
                     "weight_map": dict(sorted(weight_map.items()))}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            if fmt == "modelopt":
                config["quantization_config"] = modelopt_quantization_config(plan)
                (out / HF_QUANT_CONFIG).write_text(
                    json.dumps(modelopt_hf_quant_config(plan), indent=4) + "\n")
            else:
                config["quantization_config"] = compressed_tensors_quantization_config(plan)
            (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
            skip = {INDEX_NAME, CONFIG_NAME, HF_QUANT_CONFIG, MANIFEST_NAME, *plan.shards}
            copied, skipped = _copy_other_files(src, out, skip)

        bytes_in = sum(t.nbytes for t in plan.tensors.values())
        elapsed = time.perf_counter() - t_start
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "producer": {"name": "libalign", "version": libalign.__version__},
            "created_unix": time.time(),
            "source": {"path": str(src.resolve()), "shards": plan.shards,
                       "indexed": plan.indexed},
            "format": fmt,
            "preset": preset,
            "numerics_spec": plan.spec.to_dict(),
            "all_linear": all_linear,
            "outer_scale": libalign_note(plan)["outer_scale"],
            "notes": manifest_notes(plan),
            "fused_groups": {k: v for k, v in sorted(plan.groups.items())},
            "excluded_modules": plan.excluded_modules,
            "converted": converted_records,
            "tensors": records,
            "files_copied": copied,
            "files_skipped": skipped,
            "totals": {
                "bytes_in": bytes_in,
                "bytes_out": bytes_out,
                "shard_file_bytes_in": sum((src / s).stat().st_size for s in plan.shards),
                "shard_file_bytes_out": shard_bytes_out,
                "tensors_in": len(plan.tensors),
                "tensors_out": len(records),
                "tensors_converted": len(converted_records),
                "tensors_copied": len(plan.tensors) - len(converted_records),
                "bytes_in_per_second": bytes_in / elapsed if elapsed > 0 else None,
            },
            "timings_seconds": {**{k: round(v, 6) for k, v in clock.stages.items()},
                                "total": round(elapsed, 6)},
        }
        (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return ExportResult(dst, manifest)


def _record_bytes(record: dict[str, Any]) -> int:
    """Data bytes of one manifest tensor record."""
    return math.prod(record["shape"]) * itemsize(record["dtype"])


