"""A weight-store version as a ModelOpt NVFP4 checkpoint: what SGLang's ``modelopt_fp4`` loads,
or, for a row-scaled ``minite`` version, libalign's ``libalign_minite`` method.

The converter quantizes a version once, into the weight store (:mod:`.weight_store`). An SGLang
server cannot read the store's layout, so the version is also written in the layout it loads,
once, by whoever made the version (the converter with ``ALIGN_SAMPLER_LAYOUT=modelopt``; the
SGLang sampler itself only for a version nobody exported). Nothing is quantized again: the
store's codes and scales are re-laid out, so the server multiplies exactly the bits the store
holds, and a sharded version (an expert-parallel learner's parts, no BF16 ever written) exports
like any other.

Layout (``<root>/modelopt/<version_id>/``, root ``<store>/sglang`` by default)
    ``<module>.weight``          uint8 ``[N, K/2]`` packed E2M1 codes
    ``<module>.weight_scale``    float8_e4m3fn ``[N, K/16]`` block scales
    ``<module>.weight_scale_2``  float32 scalar, the decode scale (amax / 2688); for a
                                 ``minite`` version ``[N, 1]``, one per row

    per 2-D NVFP4 tensor (:func:`libalign.checkpoint.to_modelopt`); every raw tensor as stored;
    shards and ``model.safetensors.index.json``; ``hf_quant_config.json`` and ``config.json``
    with its ``quantization_config`` (:mod:`.quant_configs`: ModelOpt's, or for ``minite``
    :func:`~.quant_configs.minite_quantization_config`, the same dict in both files; the 2-D
    raw linear weights are the excluded modules); the model's other files (tokenizer,
    generation config) copied from ``model_dir``, the Hugging Face directory the servers
    started from; and ``manifest.json`` naming the store version it came from.

KV cache scales (:data:`KV_SCALE_NAME`)
    A version whose manifest carries per-layer K/V global scales (``extra["kv"]["scales"]``,
    for SGLang's ``--kv-cache-dtype nvfp4``) also gets, per decoder layer ``i``, fp32 scalars
    ``model.layers.<i>.self_attn.attn.k_scale`` and ``...attn.v_scale``, and its quantization
    config says ``"kv_cache_quant_algo": "NVFP4"``. That is what SGLang 0.5.23 reads: the
    config makes every ``RadixAttention`` (``self_attn.attn``) declare ``k_scale``/``v_scale``
    parameters (``ModelOptFp8KVCacheMethod``, or libalign_minite's ``BaseKVCacheMethod``),
    Qwen3-MoE's ``load_weights`` fills a parameter only from a checkpoint tensor of exactly
    its name (it does not remap ``self_attn.k_scale`` or ModelOpt's ``k_proj.k_scale``; its
    stacked q/k/v mapping would turn the latter into an unknown ``qkv_proj.k_scale``), and
    ``NVFP4KVCacheMethod.load_scales_from_model`` reads ``layer.self_attn.attn.k_scale`` (1.0
    where a layer has none). The server then writes its FP4 K/V with the scales the learner
    uses, instead of its default 1.0. A version without scales gets neither.

Expert stacks
    SGLang loads experts by per-expert names (``experts.<e>.gate_proj.weight``); a 3-D stack
    ``<prefix>.gate_up_proj`` ``[E, 2I, H]`` (transformers 5, gate rows first) becomes
    ``<prefix>.<e>.gate_proj`` and ``<prefix>.<e>.up_proj`` (rows ``[0, I)`` and ``[I, 2I)`` of
    expert ``e``, one outer scale: the expert's; with row scales, the rows' own),
    ``down_proj``/``gate_proj``/``up_proj``/``w1``/``w2``/``w3`` stacks become
    ``<prefix>.<e>.<name>``.

Which method loads an export (:func:`sglang_method`)
    Versions with one outer scale per tensor or expert: SGLang's ``modelopt_fp4``. Versions of
    the ``minite`` spec (one ``weight_scale_2`` per row, which ``modelopt_fp4``, keeping a
    scalar per weight, cannot load): ``libalign_minite`` (:mod:`alignd.sampler.sglang_quant`,
    path ``nvfp4_minite``), which declares the row scales per channel, so fused siblings need
    no shared maximum. Calling an export with a sampler path refuses a version the path's
    method does not load (a ``minite`` version for ``nvfp4_naive``, and the reverse).

What SGLang cannot load, refused by name (:class:`~alignclient.errors.LayoutError`)
    Another row-scaled spec (``te_row``: no method loads it), MXFP4 (E8M0 scales, no ModelOpt
    layout), a version with no NVFP4 tensor at all (a ``bf16`` version), a stack of another
    name, two tensors that would get one name, and tensor-scaled fused siblings
    (``gate_proj``/``up_proj``, ``q/k/v_proj``) whose outer scales differ: SGLang fuses them
    into one GEMM with the first one's scale, which would silently re-scale the other. The
    converter quantizes such siblings with one maximum when it writes for SGLang
    (:func:`alignd.formats.convert.fused_outer_amax`).

Written atomically (:mod:`libalign.atomic_dir`): a server never reads half an export, and two
writers racing end with one export (the loser reuses it). :meth:`ModelOptExport.prune` removes
old exports; the retention pass calls it (:mod:`alignd.infra.retention`).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from alignclient.errors import ConfigError, LayoutError, StoreError
from alignclient.ids import check_version_id

import libalign
from alignd.formats.hf_checkpoint import (
    CONFIG_NAME,
    HF_QUANT_CONFIG,
    INDEX_NAME,
    MANIFEST_NAME,
    write_shards,
)
from alignd.formats.quant_configs import (
    MINITE_METHOD,
    MINITE_SPEC,
    minite_quantization_config,
    modelopt_hf_quant_config,
    modelopt_quantization_config,
)
from alignd.formats.selection import FUSED_SIBLINGS, is_embedding, module_parts, stack_members
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, Item, WeightStore
from libalign import gemm
from libalign.atomic_dir import (
    TMP_PREFIX,
    DestinationExistsError,
    atomic_directory,
    discard_directory,
)
from libalign.checkpoint import to_format, to_modelopt
from libalign.models.kv_cache import KVScales
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor

LAYOUT = "modelopt"
#: SGLang's method for exports with one outer scale per tensor or expert.
MODELOPT_METHOD = "modelopt_fp4"
FORMAT = "libalign-modelopt-export"
#: Files of ``model_dir`` never copied: weights and indexes come from the version.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
NOT_FROM_MODEL_DIR = {INDEX_NAME, "pytorch_model.bin.index.json", HF_QUANT_CONFIG, MANIFEST_NAME,
                      CONFIG_NAME}

#: The checkpoint name SGLang loads layer ``layer``'s K (``site="k"``) or V global scale from.
KV_SCALE_NAME = "{prefix}.{layer}.self_attn.attn.{site}_scale"
#: The ``kv_cache_quant_algo`` that makes SGLang's attention layers declare k_scale/v_scale.
KV_CACHE_QUANT_ALGO = "NVFP4"
_ATTENTION = re.compile(r"^(?P<prefix>.+)\.(?P<layer>\d+)\.self_attn\.")


def kv_scale_tensors(version_id: str, extra: Mapping[str, Any], tensors: Iterable[str]
                     ) -> dict[str, torch.Tensor]:
    """The fp32 scalar ``k_scale``/``v_scale`` of every decoder layer, named as SGLang loads
    them (:data:`KV_SCALE_NAME`), from a version's manifest ``extra["kv"]["scales"]`` (empty
    when it names none). The layers are those whose ``self_attn`` tensors the version holds;
    LayoutError naming the version when the scales cover another number of layers."""
    scales = (extra.get("kv") or {}).get("scales")
    if scales is None:
        return {}
    scales = KVScales.from_dict(scales)
    layers: dict[int, str] = {}
    for name in tensors:
        m = _ATTENTION.match(name)
        if m is not None:
            layers[int(m["layer"])] = m["prefix"]
    if sorted(layers) != list(range(scales.layers)):
        raise LayoutError(f"version {version_id!r}: its K/V scales cover {scales.layers} layers, "
                          f"its attention tensors {len(layers)} (layers {sorted(layers)[:8]})")
    return {KV_SCALE_NAME.format(prefix=prefix, layer=i, site=site):
            torch.tensor(scales.scale(i, site), dtype=torch.float32)
            for i, prefix in sorted(layers.items()) for site in ("k", "v")}


def sglang_method(spec: NumericsSpec, quantized: bool = True) -> str | None:
    """The SGLang quantization method that loads exports of versions quantized under ``spec``:
    ``modelopt_fp4`` (NVFP4, one outer scale per tensor or expert), ``libalign_minite`` (the
    ``minite`` spec, one per row), None for anything else (MXFP4, other row-scaled specs, a
    ``bf16`` version: ``quantized`` False)."""
    if not quantized or spec.is_mx:
        return None
    if spec.outer_domain in ("tensor", "expert"):
        return MODELOPT_METHOD
    return MINITE_METHOD if spec == PRESETS[MINITE_SPEC] else None


def holds(spec: NumericsSpec, quantized: bool = True) -> bool:
    """Whether versions quantized under ``spec`` can be exported for SGLang (a method loads
    them, :func:`sglang_method`); a ``bf16`` version (``quantized`` False) cannot."""
    return sglang_method(spec, quantized) is not None


def path_method(path: str) -> str | None:
    """The SGLang method that serves execution path ``path`` (None: none does)."""
    p = gemm.get_path(path)
    return sglang_method(p.weight_spec, p.quantized) if p.weight_spec is not None else None


def exportable(q: NVFP4Tensor, name: str) -> str:
    """The method that loads tensor ``q`` (:func:`sglang_method`); LayoutError naming ``name``
    when none does."""
    if q.spec.is_mx:
        raise LayoutError(f"tensor {name!r} is MXFP4 (preset {q.spec.name!r}); the ModelOpt layout "
                          "SGLang's modelopt_fp4 loads is NVFP4 with E4M3 block scales")
    method = sglang_method(q.spec)
    if method is None:
        raise LayoutError(
            f"tensor {name!r} keeps one outer scale per {q.spec.outer_domain} (preset "
            f"{q.spec.name!r}); SGLang's modelopt_fp4 loads one scalar weight_scale_2 per weight "
            f"and {MINITE_METHOD} only the {MINITE_SPEC!r} spec: convert the version for "
            "nvfp4_naive, nvfp4_minite or a tensor-scaled preset such as 'modelopt'")
    return method


def per_expert(name: str, q: NVFP4Tensor) -> Iterator[tuple[str, NVFP4Tensor, slice | None]]:
    """``(module weight name, expert tensor, rows)`` of each expert of a 3-D stack
    (:func:`alignd.formats.selection.stack_members`)."""
    for weight, e, rows in stack_members(name, tuple(q.shape)):
        yield weight, q.expert(e), rows


def expert_parts(name: str, q: NVFP4Tensor, fmt: str = LAYOUT
                 ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """``(module weight name, stored tensors)`` of each expert projection of the 3-D stack
    ``name`` in checkpoint format ``fmt`` (:func:`libalign.checkpoint.to_format`): a split
    ``gate_up_proj`` takes its rows of every row-indexed tensor and keeps the expert's scalar
    outer scale; each stored tensor is a copy (none shares memory with ``q``)."""
    for weight, qe, rows in per_expert(name, q):
        stored = to_format(qe, fmt, row_scaled_ok=True)
        n = qe.shape[0]
        yield weight, {k: (v[rows] if rows is not None and v.ndim and v.shape[0] == n else v).clone()
                       for k, v in stored.items()}


def modelopt_parts(name: str, q: NVFP4Tensor
                   ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The ModelOpt tensors of NVFP4 tensor ``name``: ``(module weight name, {"weight",
    "weight_scale", "weight_scale_2"})`` for a 2-D ``<module>.weight``, one per expert
    projection for a 3-D stack (:func:`per_expert`; a split ``gate_up_proj`` keeps the
    expert's scalar outer scale, or its own rows' scales). LayoutError when SGLang has no
    method or no name for it (:func:`exportable`)."""
    rows_scaled = exportable(q, name) == MINITE_METHOD
    if len(q.shape) == 2:
        if not name.endswith(".weight"):
            raise LayoutError(f"tensor {name!r}: a 2-D NVFP4 tensor must be a '<module>.weight'")
        yield name, to_modelopt(q, row_scaled_ok=rows_scaled)
    elif len(q.shape) == 3:
        yield from expert_parts(name, q, LAYOUT)
    else:
        raise LayoutError(f"tensor {name!r} has shape {q.shape}; the ModelOpt layout "
                          "stores 2-D weights and 3-D expert stacks are split")


def exports_for(layout: str, store: WeightStore, model_dir: Path | str | None,
                root: Path | str | None = None, **kw: Any) -> ModelOptExport | None:
    """The exports a writer of versions makes for ``layout`` (a ``sampler_layout`` setting):
    None for ``store`` (the store version is all), :class:`ModelOptExport` for ``modelopt``."""
    if layout == "store":
        return None
    if layout != LAYOUT:
        raise ConfigError(f"sampler layout {layout!r} is not 'store' or {LAYOUT!r}")
    return ModelOptExport(store, model_dir, root, **kw)


class ModelOptExport:
    """Exports of store versions in the ModelOpt layout (see the module doc).

    Calling it with a version id returns the export's directory, writing it first if needed;
    with a sampler ``path`` too, a version that path's SGLang method does not load is refused
    first (:class:`~alignclient.errors.LayoutError` naming both).
    """

    def __init__(self, store: WeightStore, model_dir: Path | str | None,
                 root: Path | str | None = None, *, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.store = store
        self.model_dir = Path(model_dir) if model_dir is not None else None
        if self.model_dir is not None and not (self.model_dir / CONFIG_NAME).is_file():
            raise ConfigError(f"model_dir {self.model_dir} has no config.json; it must be the "
                              "Hugging Face directory the SGLang servers were started from")
        self.root = Path(root) if root is not None else store.exports_root
        self.dir = self.root / LAYOUT
        self.shard_bytes = shard_bytes

    def path(self, version_id: str) -> Path:
        """Where the export of ``version_id`` lives (whether written yet or not)."""
        return self.dir / check_version_id(version_id)

    def exists(self, version_id: str) -> bool:
        """Whether the export of ``version_id`` is complete."""
        return (self.path(version_id) / MANIFEST_NAME).is_file()

    def __call__(self, version_id: str, path: str | None = None) -> Path:
        """The export of ``version_id``, written from the store version if not there yet."""
        if path is not None:
            self.check_method(version_id, path)
        if not self.exists(version_id):
            self.write(version_id)
        return self.path(version_id)

    def check_method(self, version_id: str, path: str) -> str:
        """The method of sampler path ``path``; LayoutError unless it loads ``version_id``."""
        want = path_method(path)
        if self.exists(version_id):
            spec = NumericsSpec.from_dict(
                json.loads((self.path(version_id) / MANIFEST_NAME).read_text())["numerics_spec"])
        else:
            specs = self.store.read_manifest(version_id).specs
            spec = next((NumericsSpec.from_dict(d) for d in specs.values()), None)
        have = sglang_method(spec) if spec is not None else None
        if want is None or have != want:
            raise LayoutError(
                f"version {version_id!r} ({spec.name if spec else 'bf16'}) is loaded by SGLang "
                f"method {have!r}; this sampler's path {path!r} is served by {want!r}: convert "
                f"the version for {path!r} or serve it with a sampler of its path")
        return want

    def write(self, version_id: str) -> dict[str, Any]:
        """Write the export of ``version_id`` (atomically) unless it exists; its manifest."""
        dst = self.path(version_id)
        if self.exists(version_id):
            return json.loads((dst / MANIFEST_NAME).read_text())
        if self.model_dir is None:
            raise ConfigError("a ModelOpt export needs the model directory the SGLang servers "
                              "started from (config.json, tokenizer): set ALIGN_EXPORT_MODEL_DIR")
        t0 = time.perf_counter()
        source = self.store.read_manifest(version_id)  # VersionNotFoundError when absent
        if not any(e.kind == "nvfp4" for e in source.tensors.values()):
            raise LayoutError(f"version {version_id!r} holds no NVFP4 tensor (a bf16 version); "
                              "an SGLang sampler serves ModelOpt NVFP4 versions (nvfp4_naive)")
        kv = kv_scale_tensors(version_id, source.extra, source.tensors)
        facts: dict[str, Any] = {"excluded": [], "converted": 0, "spec": None, "method": None,
                                 "kv_scales": sorted(kv)}
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_directory(dst) as out:
                tensors = chain(self._tensors(self.store.iter_version(version_id), facts),
                                kv.items())
                index = write_shards(out, tensors, shard_bytes=self.shard_bytes,
                                     metadata={"version_id": version_id},
                                     what=f"the export of {version_id!r}")
                manifest = self._files(out, version_id, source, index, facts, t0)
        except DestinationExistsError:
            if not self.exists(version_id):
                raise StoreError(f"{dst} exists but holds no finished export ({MANIFEST_NAME} "
                                 "missing); remove it") from None
            return json.loads((dst / MANIFEST_NAME).read_text())  # another writer won
        return manifest

    def _tensors(self, stored: Iterable[tuple[str, Item]], facts: dict[str, Any]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The export's tensors from the store's, one logical tensor at a time."""
        outer: dict[str, tuple[str, torch.Tensor]] = {}  # fused group -> first member, scale
        for name, value in stored:
            if isinstance(value, torch.Tensor):
                if (value.ndim == 2 and name.endswith(".weight") and value.is_floating_point()
                        and not is_embedding(name)):
                    facts["excluded"].append(name.removesuffix(".weight"))
                yield name, value
                continue
            method = exportable(value, name)
            if facts["method"] not in (None, method):
                raise LayoutError(f"tensor {name!r} ({value.spec.name!r}) needs SGLang method "
                                  f"{method!r}, the version's earlier tensors {facts['method']!r}")
            facts["spec"], facts["method"] = facts["spec"] or value.spec, method
            for weight, stored_as in modelopt_parts(name, value):
                if method != MINITE_METHOD:  # per-row scales need no shared maximum
                    self._same_outer(weight, stored_as["weight_scale_2"], outer)
                facts["converted"] += 1
                module = weight.removesuffix(".weight")
                for key, t in stored_as.items():
                    yield f"{module}.{key}", t

    @staticmethod
    def _same_outer(weight: str, scale: torch.Tensor,
                    seen: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Fused siblings must carry the same outer scale, bit for bit."""
        p = module_parts(weight)
        kind = FUSED_SIBLINGS.get(p[-1])
        if kind is None:
            return
        key = ".".join(p[:-1]) + ":" + kind
        if key not in seen:
            seen[key] = (weight, scale)
            return
        first, other = seen[key]
        if not torch.equal(scale.view(torch.int32), other.view(torch.int32)):
            raise LayoutError(
                f"tensors {first!r} and {weight!r} are fused into one GEMM by SGLang but have "
                f"different outer scales ({other.item():.6g} vs {scale.item():.6g}); convert the "
                "version with shared fused maxima (the converter does with "
                "ALIGN_SAMPLER_LAYOUT=modelopt)")

    def _files(self, out: Path, version_id: str, source: dict[str, Any], index: dict[str, Any],
               facts: dict[str, Any], t0: float) -> dict[str, Any]:
        """Configs, the model's other files and the manifest, beside the written shards."""
        assert self.model_dir is not None
        plan = SimpleNamespace(preset=facts["spec"].name, spec=facts["spec"], row_scaled=False,
                               groups={"fused": ["gate_up", "qkv"]},
                               excluded_modules=sorted(facts["excluded"]))
        config = json.loads((self.model_dir / CONFIG_NAME).read_text())
        if facts["method"] == MINITE_METHOD:
            quant = hf_quant = minite_quantization_config(plan.excluded_modules)
        else:
            quant = modelopt_quantization_config(plan)  # type: ignore[arg-type]
            hf_quant = modelopt_hf_quant_config(plan)  # type: ignore[arg-type]
        if facts["kv_scales"]:  # the attention layers declare k_scale/v_scale to load them
            quant["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO
            hf_quant.get("quantization", hf_quant)["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO
        config["quantization_config"] = quant
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (out / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=4) + "\n")
        copied = []
        for p in sorted(self.model_dir.iterdir()):
            if (p.is_file() and not p.name.startswith(".") and not p.name.endswith(WEIGHT_SUFFIXES)
                    and p.name not in NOT_FROM_MODEL_DIR):
                shutil.copyfile(p, out / p.name)
                copied.append(p.name)
        manifest = {
            "format": FORMAT, "layout": LAYOUT, "version_id": version_id,
            "producer": {"name": "libalign", "version": libalign.__version__},
            "created_unix": time.time(),
            "source": {"store_version": str(self.store.version_path(version_id)),
                       "created_at": source.created_at,
                       "num_parts": len(source.parts or [None])},
            "numerics_spec": facts["spec"].to_dict(),
            "sglang_method": facts["method"],
            "tensors_converted": facts["converted"],
            "excluded_modules": sorted(facts["excluded"]),
            "kv_scales": facts["kv_scales"],
            "weight_map": index.get("weight_map", {}),
            "files_copied": copied,
            "seconds": round(time.perf_counter() - t0, 6),
        }
        (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    def list(self) -> list[str]:
        """Version ids with a complete export, oldest first (by the manifest's time)."""
        if not self.dir.is_dir():
            return []
        done = [d for d in self.dir.iterdir()
                if d.is_dir() and not d.name.startswith((TMP_PREFIX, ".")) and
                (d / MANIFEST_NAME).is_file()]
        return [d.name for d in sorted(done, key=lambda d: (d / MANIFEST_NAME).stat().st_mtime)]

    def prune(self, keep: int, *, protect: Iterable[str] = ()) -> list[str]:
        """Remove all but the ``keep`` newest exports, never one in ``protect`` (served or
        about to be); returns the version ids removed (each renamed away, then deleted)."""
        protect = set(protect)
        done = self.list()
        removed = []
        for v in done[:max(len(done) - max(keep, 0), 0)]:
            if v not in protect and discard_directory(self.dir / v):
                removed.append(v)
        return removed
