"""A weight version as a checkpoint an SGLang server loads: ModelOpt NVFP4, on a shared path.

An SGLang server loads weights from a Hugging Face checkpoint directory (``config.json``,
safetensors shards, an index), either when it starts (``--model-path``) or when told to by
``POST /update_weights_from_disk`` with a ``model_path``. The weight store keeps a version in
its own checksummed layout, which SGLang does not read, so the SGLang sampler first makes an
export of the version: the learner's published BF16 weights
(``<store>/published/<version_id>/``, Hugging Face names and shards) run through
:func:`alignd.formats.export.convert_checkpoint`, the same converter as
``alignd convert``, into the ModelOpt NVFP4 layout SGLang's ``modelopt_fp4`` quantization
reads:

``<layer>.weight``          uint8 ``[N, K/2]`` packed E2M1 codes
``<layer>.weight_scale``    float8_e4m3fn ``[N, K/16]`` block scales
``<layer>.weight_scale_2``  float32 scalar, the per-weight decode scale (amax / 2688)

plus ``hf_quant_config.json`` (``quant_algo: NVFP4``, ``group_size: 16``, the excluded
modules) and ``config.json`` with its ``quantization_config``. The model's non-weight files
(``config.json``, tokenizer files, generation config) come from ``model_dir``, the Hugging
Face directory the server was started from; the weights only from the published version.

What SGLang needs, and what this module therefore refuses
    SGLang keeps one outer scale per weight (``weight_scale_2`` a scalar;
    ``ModelOptFp4LinearMethod.process_weights_after_loading`` takes its ``max()``) and one
    per fused ``w13`` pair of an expert (it warns and takes the first when ``gate_proj`` and
    ``up_proj`` disagree). So only tensor- or expert-scaled presets export (``modelopt``, the
    default, ``te``, ``torchao``, ``compressed_tensors``); the converter shares one outer
    scale across fused siblings for them. The row-scaled ``minite`` preset keeps a scale per
    output row, which stock SGLang cannot load: :class:`ModelOptExport` refuses it when it
    is built (:class:`~alignclient.errors.ConfigError`), before any server is touched.

    The export carries no ``input_scale`` (a weight converter sees no activations). SGLang
    builds that include sgl-project/sglang#33115 default a missing ``input_scale`` to 1.0,
    and with ``SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1`` (#28354) the MoE experts
    compute a per-token activation scale at run time, so no calibrated value is needed;
    dense layers have no per-token path, which is why the default export converts the
    routed experts only (``all_linear=False``) and leaves attention in BF16. See the
    README, "Running at scale — SGLang sampler".

Where and when
    The export of version ``v`` with preset ``p`` is ``<export_root>/<p>/<v>/``, written
    atomically (a hidden temporary sibling renamed into place), so a server never reads a
    half-written export and samplers sharing ``export_root`` (a shared filesystem the SGLang
    servers see under the same path) export each version once: a finished export (its
    ``manifest.json`` present) is reused, and a sampler that loses a race reuses the
    winner's. :meth:`ModelOptExport.prune` removes old exports.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from alignclient.errors import ConfigError, StoreError

from alignd.formats.export import convert_checkpoint
from alignd.formats.export_plan import CHECKPOINT_PRESETS
from alignd.formats.hf_checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, INDEX_NAME, MANIFEST_NAME
from alignd.formats.weight_store import WeightStore
from libalign.atomic_dir import TMP_PREFIX, DestinationExistsError, discard_directory
from libalign.spec import PRESETS

log = logging.getLogger("alignd.sampler.sglang")

#: Files of ``model_dir`` never taken into an export: weights come from the published version.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
NOT_FROM_MODEL_DIR = {INDEX_NAME, "pytorch_model.bin.index.json", HF_QUANT_CONFIG, MANIFEST_NAME}
STAGING_PREFIX = ".staging-"


class ModelOptExport:
    """Export store versions as ModelOpt NVFP4 checkpoints that SGLang loads (see module doc).

    Calling it with a version id returns the export's directory, making it first if needed.
    """

    def __init__(self, store: WeightStore, model_dir: Path | str, export_root: Path | str, *,
                 preset: str = "modelopt", all_linear: bool = False, device: str = "cpu"):
        if preset not in CHECKPOINT_PRESETS:
            raise ConfigError(f"preset {preset!r} is not a checkpoint preset; choose one of "
                              f"{CHECKPOINT_PRESETS}")
        if PRESETS[preset].outer_domain not in ("tensor", "expert"):
            raise ConfigError(f"preset {preset!r} keeps one outer scale per "
                              f"{PRESETS[preset].outer_domain}; SGLang's modelopt_fp4 loads one "
                              "per weight (a scalar weight_scale_2): choose a tensor- or "
                              "expert-scaled preset such as 'modelopt'")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / CONFIG_NAME).is_file():
            raise ConfigError(f"model_dir {self.model_dir} has no config.json; it must be the "
                              "Hugging Face directory the SGLang server was started from")
        self.store = store
        self.export_root = Path(export_root)
        self.preset = preset
        self.all_linear = all_linear
        self.device = device

    def path(self, version_id: str) -> Path:
        """Where the export of ``version_id`` lives (whether made yet or not)."""
        self.store.published_path(version_id)  # checks the id is a safe directory name
        return self.export_root / self.preset / version_id

    def exists(self, version_id: str) -> bool:
        """Whether the export of ``version_id`` is complete."""
        return (self.path(version_id) / MANIFEST_NAME).is_file()

    def __call__(self, version_id: str) -> Path:
        """The export of ``version_id``, made from its published BF16 weights if not there yet."""
        dst = self.path(version_id)
        if self.exists(version_id):
            return dst
        src = self.store.published_path(version_id)
        if not src.is_dir():
            raise StoreError(f"version {version_id!r} has no published weights at {src}; the "
                             "SGLang export is made from them")
        staging = self.export_root / f"{STAGING_PREFIX}{version_id}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            self._stage(src, staging)
            try:
                convert_checkpoint(staging, dst, preset=self.preset, fmt="modelopt",
                                   all_linear=self.all_linear, device=self.device)
            except DestinationExistsError:
                if not self.exists(version_id):  # not a finished export: a real conflict
                    raise StoreError(f"{dst} exists but holds no finished export "
                                     f"({MANIFEST_NAME} missing); remove it") from None
                log.info("export of %s was made by another sampler; reusing it", version_id)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dst

    def _stage(self, published: Path, staging: Path) -> None:
        """Link the published weights and the model's other files into one source directory."""
        for p in sorted(published.iterdir()):
            if p.is_file():
                os.symlink(p.resolve(), staging / p.name)
        for p in sorted(self.model_dir.iterdir()):
            name = p.name
            if (not p.is_file() or name.startswith(".") or name.endswith(WEIGHT_SUFFIXES)
                    or name in NOT_FROM_MODEL_DIR or (staging / name).exists()):
                continue
            if name == CONFIG_NAME:
                config = json.loads(p.read_text())
                config.pop("quantization_config", None)  # the export writes its own
                (staging / name).write_text(json.dumps(config, indent=2) + "\n")
            else:
                os.symlink(p.resolve(), staging / name)

    def prune(self, keep: int, *, protect: tuple[str, ...] = ()) -> list[str]:
        """Remove all but the ``keep`` newest exports of this preset (and never ``protect``);
        returns the version ids removed. Old exports are only read by a server during its
        ``update_weights_from_disk``, so a version that is served no longer needs them."""
        root = self.export_root / self.preset
        if not root.is_dir():
            return []
        done = [d for d in root.iterdir()
                if d.is_dir() and not d.name.startswith(TMP_PREFIX) and (d / MANIFEST_NAME).is_file()]
        done.sort(key=lambda d: (d / MANIFEST_NAME).stat().st_mtime, reverse=True)
        removed = []
        for d in done[max(keep, 0):]:
            if d.name in protect:
                continue
            if discard_directory(d):  # out of sight first, as the weight store deletes
                removed.append(d.name)
        return removed
