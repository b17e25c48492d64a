"""The SGLang sampler as a service builds it: the HTTP engine, its exporter, the rollout store.

The counterpart of :mod:`alignd.sampler.embedded` for running at scale: the model lives in an
SGLang server (started separately, see the README, "Running at scale — SGLang sampler") and this
process is the thin sampler around it, taking rollout requests from Redis, driving the server,
storing rollouts. :func:`build_sglang_sampler` reads the ``sglang_*`` fields of
:class:`~alignd.infra.settings.SamplerSettings`; a keyword argument given overrides its field.
"""

from __future__ import annotations

from pathlib import Path

from alignclient.errors import ConfigError

from alignd.formats.weight_store import WeightStore
from alignd.infra.redis_clients import binary_client
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from alignd.sampler.sglang_engine import SGLangSamplerEngine, SGLangTimeouts
from alignd.sampler.sglang_export import ModelOptExport
from libalign import gemm

DEFAULT_PATH = "nvfp4_naive"


def sglang_path(name: str | None) -> str:
    """The execution path an SGLang sampler stands for: quantized, one outer scale per
    weight or expert (what SGLang's ``modelopt_fp4`` loads); ``nvfp4_naive`` by default."""
    path = gemm.get_path(name or DEFAULT_PATH)
    if not path.quantized or path.weight_spec.outer_domain not in ("tensor", "expert"):
        raise ConfigError(
            f"the SGLang sampler cannot stand for path {path.name!r}: it serves ModelOpt NVFP4 "
            "exports with one outer scale per weight; use ALIGN_SAMPLER_PATH=nvfp4_naive")
    return path.name


def build_sglang_sampler(settings: SamplerSettings, base_url: str | None = None, *,
                         model_dir: Path | str | None = None,
                         export_dir: Path | str | None = None, preset: str | None = None,
                         path: str | None = None, eos_id: int | None = None,
                         load_format: str | None = None, timeouts: SGLangTimeouts | None = None,
                         metrics: Metrics | None = None):
    """``(engine, rollouts, guidance)`` for an SGLang server at ``base_url``.

    ``model_dir`` is the Hugging Face directory the server was started from (``config.json``,
    tokenizer); ``export_dir`` (default ``<store>/sglang``) must be a path the server sees
    under the same name. ``guidance`` is None: SGLang captures no guidance records.
    """
    def pick(value, field: str):
        return getattr(settings, field) if value is None else value

    base_url = pick(base_url, "sglang_url")
    model_dir = pick(model_dir, "sglang_model_dir")
    if not base_url or not model_dir:
        raise ConfigError("the SGLang sampler needs the server's URL and the model directory it "
                          "was started from (sglang_url, sglang_model_dir)")
    store = WeightStore(settings.store_dir)
    exporter = ModelOptExport(store, model_dir,
                              pick(export_dir, "sglang_export_dir") or store.exports_root,
                              preset=pick(preset, "sglang_preset"))
    engine = SGLangSamplerEngine(
        base_url, exporter, path=sglang_path(pick(path, "sampler_path")),
        eos_id=pick(eos_id, "sglang_eos_id"), load_format=pick(load_format, "sglang_load_format"),
        timeouts=timeouts)
    rollouts = RolloutStore(binary_client(settings), settings.key_prefix, metrics=metrics)
    return engine, rollouts, None
