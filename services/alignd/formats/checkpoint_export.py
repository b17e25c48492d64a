"""Export a Hugging Face safetensors checkpoint as NVFP4: what ``alignd convert`` runs.

Input: a checkpoint directory with ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, a ``config.json`` and any tokenizer or other files.
Output: the same directory with the selected weights replaced by NVFP4 tensors, in
ModelOpt layout (``weight`` uint8, ``weight_scale`` float8_e4m3fn, ``weight_scale_2``
fp32: what SGLang's ``modelopt_fp4`` loads) or compressed-tensors layout
(``weight_packed``, ``weight_scale``, ``weight_global_scale``), the matching
``quantization_config`` in ``config.json`` (and ``hf_quant_config.json`` for ModelOpt),
a new index, every other file copied byte for byte, and ``manifest.json``. Weight files
outside the conversion (other ``*.safetensors``, ``pytorch_model*.bin``) are not copied;
the manifest lists them under ``files_skipped``. The index must agree with the shards: a
tensor in a shard the index does not map there, or an index entry its shard lacks, is a
:class:`LayoutError`.

Which tensors
    By default the routed experts' ``gate_proj``, ``up_proj`` and ``down_proj`` weights
    (Qwen3-MoE naming ``*.mlp.experts.E.<proj>.weight``; Mixtral's ``w1``/``w3``/``w2``
    too). With ``all_linear`` every 2-D floating ``*.weight`` whose K is a multiple of
    16, except embeddings, ``lm_head``, norms and routers (``mlp.gate``,
    ``shared_expert_gate``, ``*router*``). Every other linear-like weight is named in the
    format's exclude/ignore list. 3-D expert stacks are not converted (copied unchanged).

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

import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from alignclient.errors import (
    AlignError,
    DTypeError,
    InputError,
    LayoutError,
    MissingShardError,
    NonFiniteError,
    ShapeError,
    SpecError,
)
from safetensors import safe_open

import libalign
from alignd.formats.atomic_dir import DestinationExistsError, atomic_directory, sha256_file
from libalign import ops
from libalign.checkpoint import FORMATS, stored_layout, to_format
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor, check_finite, shared_outer_amax

#: Presets that make sense for a stored checkpoint (``te_row`` is an activation variant).
CHECKPOINT_PRESETS = ("minite", "modelopt", "compressed_tensors", "torchao", "te")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = "manifest.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
MANIFEST_VERSION = 1

#: safetensors dtype codes and the torch dtypes they hold.
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_CODES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
QUANTIZABLE = ("BF16", "F16", "F32")

#: Sibling projections a sampler fuses into one GEMM with one outer scale.
FUSED_SIBLINGS: dict[str, str] = {
    "gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up",
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
}
#: Per-expert projections: Qwen3-MoE names, and Mixtral's w1 (gate), w3 (up), w2 (down).
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
ROUTER_NAMES = ("gate", "shared_expert_gate")

Progress = Callable[[int, int, str], None]


# --- what the source holds ---------------------------------------------------------------

@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint, as its shard header describes it."""

    name: str
    shard: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(code: str) -> int:
    if code not in ST_DTYPES:
        raise DTypeError(f"safetensors dtype {code!r} is not supported by the converter")
    return torch.empty((), dtype=ST_DTYPES[code]).element_size()


def read_source(src: Path) -> tuple[list[str], dict[str, SourceTensor], dict[str, dict[str, str]]]:
    """Shard file names, tensors and per-shard metadata of a checkpoint (headers only)."""
    src = Path(src)
    if not src.is_dir():
        raise LayoutError(f"source {src} is not a directory")
    index_path = src / INDEX_NAME
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise LayoutError(f"{index_path} is not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise LayoutError(f"{index_path} has an empty or malformed weight_map")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            parts = Path(str(shard)).parts
            if not isinstance(shard, str) or not parts or Path(shard).is_absolute() or ".." in parts:
                raise LayoutError(f"{index_path} names shard {shard!r}, which is not a relative "
                                  f"path inside the checkpoint")
            if not (src / shard).is_file():
                raise MissingShardError(shard, sorted(n for n, s in weight_map.items() if s == shard),
                                        str(src))
    elif (src / SINGLE_NAME).is_file():
        weight_map, shards = None, [SINGLE_NAME]
    else:
        raise LayoutError(f"{src} has neither {SINGLE_NAME} nor {INDEX_NAME}")

    tensors: dict[str, SourceTensor] = {}
    metadata: dict[str, dict[str, str]] = {}
    for shard in shards:
        with safe_open(src / shard, framework="pt") as f:
            metadata[shard] = dict(f.metadata() or {})
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if weight_map is not None and weight_map.get(name) != shard:
                    raise LayoutError(f"tensor {name!r} is in shard {shard!r} but the index "
                                      f"puts it in {weight_map.get(name)!r}")
                sl = f.get_slice(name)
                tensors[name] = SourceTensor(name, shard, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise LayoutError(f"{len(absent)} tensor(s) named in the index are not in their "
                              f"shard, first {absent[0]!r} (index says {weight_map[absent[0]]!r})")
    for t in tensors.values():
        _itemsize(t.dtype)
    return shards, tensors, metadata


# --- which tensors convert ---------------------------------------------------------------

def _module_parts(name: str) -> list[str]:
    return name[: -len(".weight")].split(".")


def is_expert_weight(name: str) -> bool:
    """``*.experts.<int>.{gate,up,down}_proj.weight`` (Qwen3-MoE routed experts)."""
    if not name.endswith(".weight"):
        return False
    p = _module_parts(name)
    return len(p) >= 3 and p[-1] in EXPERT_PROJS and p[-2].isdigit() and p[-3] == "experts"


def is_never_quantized(name: str) -> bool:
    """Embeddings, lm_head, norms and routers: left in their source dtype."""
    p = _module_parts(name) if name.endswith(".weight") else name.split(".")
    if any("embed" in c or c in ("wte", "wpe") for c in p):
        return True
    if "lm_head" in p or any("norm" in c for c in p):
        return True
    return p[-1] in ROUTER_NAMES or any("router" in c for c in p)


def _is_embedding(name: str) -> bool:
    return any("embed" in c or c in ("wte", "wpe") for c in _module_parts(name))


def select(tensors: dict[str, SourceTensor], all_linear: bool) -> tuple[list[str], list[str]]:
    """Tensors to convert, and the modules to name as excluded (not quantized)."""
    convert, excluded = [], []
    for name, t in sorted(tensors.items()):
        if not name.endswith(".weight"):
            continue
        if is_expert_weight(name):
            if len(t.shape) != 2:
                raise ShapeError(f"{name}: expert weights are 2-D, got shape {t.shape}")
            if t.dtype not in QUANTIZABLE:
                raise DTypeError(f"{name}: expert weights must be bf16, fp16 or fp32 to "
                                 f"convert, got {t.dtype}")
            if t.shape[1] % 16:
                raise ShapeError(f"{name}: K={t.shape[1]} is not a multiple of 16")
            convert.append(name)
            continue
        linear_like = len(t.shape) == 2 and t.dtype in QUANTIZABLE
        if not linear_like or _is_embedding(name):
            continue
        if all_linear and not is_never_quantized(name) and t.shape[1] % 16 == 0:
            convert.append(name)
        else:
            excluded.append(name[: -len(".weight")])
    return convert, excluded


def fused_groups(names: list[str]) -> dict[str, list[str]]:
    """Groups (of two or more converted weights) that a sampler fuses: key -> members."""
    groups: dict[str, list[str]] = {}
    for name in names:
        p = _module_parts(name)
        kind = FUSED_SIBLINGS.get(p[-1])
        if kind is not None:
            groups.setdefault(".".join(p[:-1]) + ":" + kind, []).append(name)
    return {k: sorted(v) for k, v in groups.items() if len(v) > 1}


# --- the plan ----------------------------------------------------------------------------

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
        module = t.name[: -len(".weight")]
        roles = ("nvfp4_codes", "nvfp4_block_scales", "nvfp4_outer_scale")
        layout = stored_layout(self.fmt, t.shape, self.row_scaled)
        return [(f"{module}.{key}", shape, dtype, role)
                for (key, (shape, dtype)), role in zip(layout.items(), roles, strict=True)]


def plan_export(src: Path, preset: str = "minite", fmt: str = "modelopt",
                all_linear: bool = False) -> ExportPlan:
    """Read the headers, choose tensors and fused groups, and lay out every output shard."""
    if preset not in CHECKPOINT_PRESETS:
        raise SpecError(f"preset {preset!r} is not for checkpoints; choose one of {CHECKPOINT_PRESETS}")
    if fmt not in FORMATS:
        raise SpecError(f"format {fmt!r} is unknown; choose one of {FORMATS}")
    spec = PRESETS[preset]
    if fmt == "compressed-tensors" and spec.outer_domain == "row":
        raise SpecError(f"preset {preset!r} keeps one outer scale per row and compressed-tensors "
                        f"stores one global scale per weight; use --format modelopt (per-row "
                        f"weight_scale_2) or a tensor-scaled preset (modelopt, "
                        f"compressed_tensors, torchao, te)")
    src = Path(src)
    shards, tensors, metadata = read_source(src)
    converted, excluded = select(tensors, all_linear)
    if not converted:
        raise LayoutError(f"{src} has no tensor to convert (no routed-expert weights"
                          f"{'' if all_linear else '; try --all-linear'})")
    groups = fused_groups(converted) if spec.outer_domain in ("tensor", "expert") else {}
    group_of = {n: k for k, members in groups.items() for n in members}
    straddling = sorted(k for k, m in groups.items() if len({tensors[n].shard for n in m}) > 1)
    plan = ExportPlan(src, preset, spec, fmt, all_linear, shards, tensors, metadata, converted,
                      sorted(excluded), groups, group_of, straddling)
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


# --- configs -----------------------------------------------------------------------------

def _libalign_note(plan: ExportPlan) -> dict[str, Any]:
    note = {
        "producer": f"libalign {libalign.__version__}",
        "preset": plan.preset,
        "numerics_spec": plan.spec.to_dict(),
        "outer_scale": "per_row" if plan.row_scaled else "per_tensor",
        "input_scale": "not written: activation scales need calibration data",
        "fused_groups_share_outer_scale": bool(plan.groups),
    }
    if plan.row_scaled:
        note["weight_scale_2_layout"] = (
            "fp32 [N, 1]: one decode scale (row amax / 2688) per output row. Stock loaders "
            "(SGLang modelopt_fp4, vLLM, TensorRT-LLM) expect a scalar per weight and cannot "
            "load this checkpoint; use libalign's sampler adapter.")
    return note


def modelopt_hf_quant_config(plan: ExportPlan) -> dict[str, Any]:
    """``hf_quant_config.json`` for a ModelOpt NVFP4 export."""
    return {
        "producer": {"name": "libalign", "version": libalign.__version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": list(plan.excluded_modules),
        },
    }


def modelopt_quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ModelOpt (ModelOpt's own converted form)."""
    hf = modelopt_hf_quant_config(plan)
    return {
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"],
        }},
        "ignore": list(plan.excluded_modules),
        "quant_algo": "NVFP4",
        "producer": hf["producer"],
        "quant_method": "modelopt",
        "libalign": _libalign_note(plan),
    }


def compressed_tensors_quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """``quantization_config`` for compressed-tensors ``nvfp4-pack-quantized``, weight-only."""
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                        "strategy": "tensor_group", "dynamic": False,
                        "scale_dtype": "torch.float8_e4m3fn"},
            "input_activations": None,
            "output_activations": None,
        }},
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": list(plan.excluded_modules),
        "libalign": _libalign_note(plan),
    }


# --- writing safetensors as a stream -----------------------------------------------------

class ShardWriter:
    """One safetensors file whose header is fixed up front; tensors are written at their offsets.

    Tensors are laid out by decreasing element size (as safetensors does), so every
    tensor starts aligned to its dtype. Each :meth:`write` hashes what it writes.
    """

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str]):
        if sys.byteorder != "little":
            raise LayoutError("safetensors files are little-endian; this host is not")
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        self._slots: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        order = sorted(entries, key=lambda e: -torch.empty((), dtype=e[2]).element_size())
        for name, shape, dtype in order:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            self._slots[name] = (offset, n, tuple(shape), dtype)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_bytes = offset
        self._start = 8 + len(raw)
        self._sha: dict[str, str] = {}
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> str:
        """Write tensor ``name`` (shape and dtype as declared); return its SHA-256."""
        offset, _, shape, dtype = self._slots[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise LayoutError(f"{name}: produced {tuple(t.shape)} {t.dtype}, the shard header "
                              f"declares {shape} {dtype}")
        if name in self._sha:
            raise LayoutError(f"{name} written twice to {self.path.name}")
        buf = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.seek(self._start + offset)
        self._f.write(buf)
        self._sha[name] = hashlib.sha256(buf).hexdigest()
        return self._sha[name]

    def close(self) -> None:
        """Check every declared tensor was written, then close the file."""
        missing = sorted(set(self._slots) - set(self._sha))
        self._f.close()
        if missing:
            raise LayoutError(f"{self.path.name}: {len(missing)} tensor(s) never written, "
                              f"first {missing[0]!r}")
        if self.path.stat().st_size != self._start + self.data_bytes:
            raise LayoutError(f"{self.path.name} has {self.path.stat().st_size} bytes, expected "
                              f"{self._start + self.data_bytes}")

    def abort(self) -> None:
        """Close without checks (the directory is being discarded)."""
        self._f.close()


# --- the conversion ----------------------------------------------------------------------

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
            module = t.name[: -len(".weight")]
            stored = {f"{module}.{k}": v.cpu()
                      for k, v in to_format(q, plan.fmt, row_scaled_ok=True).items()}
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
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".tmp-"))
        for fname in sorted(filenames):
            rel = (rel_dir / fname).as_posix()
            if rel in skip or fname.endswith(".safetensors") or fname.startswith(".tmp-") \
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
        config_path = src / "config.json"
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
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            skip = {INDEX_NAME, "config.json", HF_QUANT_CONFIG, MANIFEST_NAME, *plan.shards}
            copied, skipped = _copy_other_files(src, out, skip)

        bytes_in = sum(t.nbytes for t in plan.tensors.values())
        elapsed = time.perf_counter() - t_start
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "producer": {"name": "libalign", "version": libalign.__version__},
            "created_unix": time.time(),
            "source": {"path": str(src.resolve()), "shards": plan.shards,
                       "indexed": (src / INDEX_NAME).exists()},
            "format": fmt,
            "preset": preset,
            "numerics_spec": plan.spec.to_dict(),
            "all_linear": all_linear,
            "outer_scale": _libalign_note(plan)["outer_scale"],
            "notes": _manifest_notes(plan),
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
    return math.prod(record["shape"]) * _itemsize(record["dtype"])


def _manifest_notes(plan: ExportPlan) -> list[str]:
    notes = ["input_scale is not written: activation scales need calibration data, which a "
             "weight converter does not see"]
    if plan.row_scaled:
        notes.append(_libalign_note(plan)["weight_scale_2_layout"])
    if plan.groups:
        notes.append("members of each fused group (gate/up, q/k/v) share one outer scale")
    return notes
