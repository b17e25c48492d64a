"""A weight-store version as a ModelOpt NVFP4 checkpoint: what SGLang's ``modelopt_fp4`` loads.

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
    ``<module>.weight_scale_2``  float32 scalar, the decode scale (amax / 2688)

    per 2-D NVFP4 tensor (:func:`libalign.checkpoint.to_modelopt`); every raw tensor as stored;
    shards and ``model.safetensors.index.json``; ``hf_quant_config.json`` and ``config.json``
    with its ``quantization_config`` (:mod:`.quant_configs`; the 2-D raw linear weights are the
    excluded modules); the model's other files (tokenizer, generation config) copied from
    ``model_dir``, the Hugging Face directory the servers started from; and ``manifest.json``
    naming the store version it came from.

Expert stacks
    SGLang loads experts by per-expert names (``experts.<e>.gate_proj.weight``); a 3-D stack
    ``<prefix>.gate_up_proj`` ``[E, 2I, H]`` (transformers 5, gate rows first) becomes
    ``<prefix>.<e>.gate_proj`` and ``<prefix>.<e>.up_proj`` (rows ``[0, I)`` and ``[I, 2I)`` of
    expert ``e``, one outer scale: the expert's), ``down_proj``/``gate_proj``/``up_proj``/
    ``w1``/``w2``/``w3`` stacks become ``<prefix>.<e>.<name>``.

What SGLang cannot load, refused by name (:class:`~alignclient.errors.LayoutError`)
    A row-scaled tensor (``minite``: one ``weight_scale_2`` per row; SGLang keeps a scalar per
    weight), MXFP4 (E8M0 scales, no ModelOpt layout), a version with no NVFP4 tensor at all
    (a ``bf16`` version), a stack of another name, two tensors that would get one name, and
    fused siblings (``gate_proj``/``up_proj``, ``q/k/v_proj``) whose outer scales differ: SGLang
    fuses them into one GEMM with the first one's scale, which would silently re-scale the
    other. The converter quantizes such siblings with one maximum when it writes for SGLang
    (:func:`alignd.formats.convert.fused_outer_amax`).

Written atomically (:mod:`libalign.atomic_dir`): a server never reads half an export, and two
writers racing end with one export (the loser reuses it). :meth:`ModelOptExport.prune` removes
old exports; the retention pass calls it (:mod:`alignd.infra.retention`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable, Iterator
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
from alignd.formats.quant_configs import modelopt_hf_quant_config, modelopt_quantization_config
from alignd.formats.selection import FUSED_SIBLINGS, is_embedding, module_parts
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, Item, WeightStore
from libalign.atomic_dir import TMP_PREFIX, DestinationExistsError, atomic_directory, discard_directory
from libalign.checkpoint import to_modelopt
from libalign.spec import NumericsSpec, NVFP4Tensor

LAYOUT = "modelopt"
FORMAT = "libalign-modelopt-export"
#: Files of ``model_dir`` never copied: weights and indexes come from the version.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
NOT_FROM_MODEL_DIR = {INDEX_NAME, "pytorch_model.bin.index.json", HF_QUANT_CONFIG, MANIFEST_NAME,
                      CONFIG_NAME}
#: Names of per-expert projections a 3-D stack may carry (gate_up_proj is split in two).
STACK_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def holds(spec: NumericsSpec, quantized: bool = True) -> bool:
    """Whether versions quantized under ``spec`` can be exported for SGLang (NVFP4 with one
    outer scale per tensor or expert); a ``bf16`` version (``quantized`` False) cannot."""
    return quantized and not spec.is_mx and spec.outer_domain in ("tensor", "expert")


def exportable(q: NVFP4Tensor, name: str) -> None:
    """Refuse (LayoutError naming ``name``) a tensor SGLang's ``modelopt_fp4`` cannot load."""
    if q.spec.is_mx:
        raise LayoutError(f"tensor {name!r} is MXFP4 (preset {q.spec.name!r}); the ModelOpt layout "
                          "SGLang's modelopt_fp4 loads is NVFP4 with E4M3 block scales")
    if q.spec.outer_domain not in ("tensor", "expert"):
        raise LayoutError(
            f"tensor {name!r} keeps one outer scale per {q.spec.outer_domain} (preset "
            f"{q.spec.name!r}); SGLang's modelopt_fp4 loads one scalar weight_scale_2 per weight: "
            "convert the version for the SGLang sampler's path (nvfp4_naive) or a tensor-scaled "
            "preset such as 'modelopt'")


def per_expert(name: str, q: NVFP4Tensor) -> Iterator[tuple[str, NVFP4Tensor, slice | None]]:
    """``(module weight name, expert tensor, rows)`` of each expert of a 3-D stack."""
    prefix, _, last = name.rpartition(".")
    if last not in (*STACK_NAMES, "gate_up_proj") or not prefix:
        raise LayoutError(f"tensor {name!r} is a 3-D stack SGLang has no per-expert name for "
                          f"(known: gate_up_proj, {', '.join(STACK_NAMES)})")
    for e in range(q.shape[0]):
        qe = q.expert(e)
        if last == "gate_up_proj":
            half = qe.shape[0] // 2
            yield f"{prefix}.{e}.gate_proj.weight", qe, slice(0, half)
            yield f"{prefix}.{e}.up_proj.weight", qe, slice(half, qe.shape[0])
        else:
            yield f"{prefix}.{e}.{last}.weight", qe, None


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

    Calling it with a version id returns the export's directory, writing it first if needed.
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

    def __call__(self, version_id: str) -> Path:
        """The export of ``version_id``, written from the store version if not there yet."""
        if not self.exists(version_id):
            self.write(version_id)
        return self.path(version_id)

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
        if not any(e["kind"] == "nvfp4" for e in source["tensors"].values()):
            raise LayoutError(f"version {version_id!r} holds no NVFP4 tensor (a bf16 version); "
                              "an SGLang sampler serves ModelOpt NVFP4 versions (nvfp4_naive)")
        facts: dict[str, Any] = {"excluded": [], "converted": 0, "spec": None}
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_directory(dst) as out:
                tensors = self._tensors(self.store.iter_version(version_id), facts)
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
            exportable(value, name)
            facts["spec"] = facts["spec"] or value.spec
            if len(value.shape) == 2:
                if not name.endswith(".weight"):
                    raise LayoutError(f"tensor {name!r}: a 2-D NVFP4 tensor must be a "
                                      "'<module>.weight'")
                parts: Iterable[tuple[str, NVFP4Tensor, slice | None]] = [(name, value, None)]
            elif len(value.shape) == 3:
                parts = per_expert(name, value)
            else:
                raise LayoutError(f"tensor {name!r} has shape {value.shape}; the ModelOpt layout "
                                  "stores 2-D weights and 3-D expert stacks are split")
            for weight, q, rows in parts:
                stored_as = to_modelopt(q)
                if rows is not None:
                    stored_as = {k: (v.clone() if k == "weight_scale_2" else v[rows].clone())
                                 for k, v in stored_as.items()}
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
        config["quantization_config"] = modelopt_quantization_config(plan)  # type: ignore[arg-type]
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (out / HF_QUANT_CONFIG).write_text(
            json.dumps(modelopt_hf_quant_config(plan), indent=4) + "\n")  # type: ignore[arg-type]
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
                       "created_at": source.get("created_at"),
                       "num_parts": len(source.get("parts") or [None])},
            "numerics_spec": facts["spec"].to_dict(),
            "tensors_converted": facts["converted"],
            "excluded_modules": sorted(facts["excluded"]),
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
