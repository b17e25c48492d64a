"""The SGLang sampler as a service builds it: the HTTP engine, its exports, the rollout store.

The counterpart of :mod:`alignd.sampler.embedded` for running at scale: the model lives in SGLang
servers (started separately, see docs/engines/sglang.md) and this
process is the thin sampler around them, taking rollout requests from Redis, driving the
servers, storing rollouts. :func:`build_sglang_sampler` reads the ``sglang_*`` fields of
:class:`~alignd.infra.settings.SamplerSettings`; a keyword argument given overrides its field.

Exports
    The servers load a version from its ModelOpt NVFP4 export
    (:class:`~alignd.formats.modelopt_export.ModelOptExport` under ``sglang_export_dir``), which
    the converter writes once per version (``ALIGN_SAMPLER_LAYOUT=modelopt``). A version that
    arrives without one (a converter in the ``store`` layout, an expert-parallel learner that
    wrote its own parts) is exported here, from the store version, with a warning: a re-layout
    of the store's bits, never a second quantization.

Paths
    ``nvfp4_naive`` (the default): servers started with ``--quantization modelopt_fp4``;
    ``nvfp4_minite``: row-scaled ``minite`` versions, servers started with ``--quantization
    libalign_minite`` (:mod:`alignd.sampler.sglang_quant`). The servers' reported quantization
    is checked against the path at each load, and a version of the other method is refused
    before any server is touched. ``nvfp4_minite_kv_sglang_nvfp4`` and
    ``nvfp4_minite_kv_sglang_fp4_mx_block16``: the same minite servers started with
    ``--kv-cache-dtype nvfp4`` or ``fp4_mx_block16`` (SGLang's FP4 KV caches, which libalign's
    learner reproduces bit for bit: :data:`libalign.spec.presets.SGLANG_KV_DTYPES`); each server's
    reported ``kv_cache_dtype`` is checked against the path's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alignclient.errors import ConfigError

from alignd.formats.convert import check_kv_manifest, path_kv_format
from alignd.formats.modelopt_export import ModelOptExport, path_method
from alignd.formats.quant_configs import MINITE_PATH
from alignd.formats.weight_store import WeightStore
from alignd.infra.redis_clients import binary_client
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from alignd.sampler.sglang_engine import SGLangSamplerEngine, SGLangTimeouts
from alignd.sampler.sglang_routing import SGLangRouting
from libalign import gemm
from libalign.spec.presets import SGLANG_KV_DTYPES

log = logging.getLogger("alignd.sampler.sglang")

DEFAULT_PATH = "nvfp4_naive"


def sglang_path(name: str | None) -> str:
    """The execution path an SGLang sampler stands for: quantized, one outer scale per
    weight or expert (what SGLang's ``modelopt_fp4`` loads; ``nvfp4_naive``, the default), or
    ``nvfp4_minite`` (libalign's ``libalign_minite`` method), optionally with one of SGLang's
    own FP4 KV caches (``nvfp4_minite_kv_sglang_*``); no guided path, no KV format SGLang
    cannot write."""
    path = gemm.get_path(name or DEFAULT_PATH)
    method = path_method(path.name)
    kv = path.kv_spec
    ok = method is not None and not path.guided and (
        (kv is None and (path.weight_spec.outer_domain != "row" or path.name == MINITE_PATH))
        or (kv is not None and kv.name in SGLANG_KV_DTYPES
            and path.name == f"{MINITE_PATH}_{kv.name}"))
    if not ok:
        raise ConfigError(
            f"the SGLang sampler cannot stand for path {path.name!r}: it serves ModelOpt NVFP4 "
            "exports with one outer scale per weight (SGLang's modelopt_fp4) or row-scaled "
            f"minite ones (libalign_minite, without guided rounding), with K and V in the model's "
            f"dtype or in SGLang's own FP4 KV formats ({', '.join(SGLANG_KV_DTYPES)}); use "
            f"ALIGN_SAMPLER_PATH=nvfp4_naive, {MINITE_PATH} or {MINITE_PATH}_kv_sglang_nvfp4")
    return path.name


def kv_cache_dtype(path: str) -> str | None:
    """The ``--kv-cache-dtype`` the servers of sampler path ``path`` must run (None: no FP4 KV
    cache, any unquantized one)."""
    kv = gemm.get_path(path).kv_spec
    return None if kv is None else SGLANG_KV_DTYPES[kv.name]


class ExportOrWrite:
    """The engine's exporter: a version's export, written from the store if nobody did."""

    def __init__(self, exports: ModelOptExport):
        self.exports = exports

    def __call__(self, version_id: str, path: str | None = None) -> Path:
        """The export's directory, after checking the version was made for sampler path
        ``path``: its SGLang method (LayoutError) and its KV format (SpecError with
        ``field="kv.format"``: :func:`~alignd.formats.convert.check_kv_manifest`)."""
        if path is not None:
            self.exports.check_method(version_id, path)
            check_kv_manifest(self.exports.store.read_manifest(version_id).extra,
                              path_kv_format(path))
        if not self.exports.exists(version_id):
            log.warning("version %s has no ModelOpt export at %s (the converter writes one with "
                        "ALIGN_SAMPLER_LAYOUT=modelopt); writing it from the store version",
                        version_id, self.exports.path(version_id))
            self.exports.write(version_id)
        return self.exports.path(version_id)

    def path(self, version_id: str) -> Path:
        """Where the export of ``version_id`` lives."""
        return self.exports.path(version_id)


def build_sglang_sampler(settings: SamplerSettings, base_url: str | list[str] | None = None, *,
                         model_dir: Path | str | None = None,
                         export_dir: Path | str | None = None, router_url: str | None = None,
                         api_key: str | None = None, path: str | None = None,
                         eos_id: int | None = None, load_format: str | None = None,
                         timeouts: SGLangTimeouts | None = None,
                         metrics: Metrics | None = None):
    """``(engine, rollouts, guidance)`` for SGLang servers at ``base_url`` (one URL, a list, or
    several separated by commas) or behind the sglang-router at ``router_url``.

    ``model_dir`` is the Hugging Face directory the servers were started from (``config.json``,
    tokenizer); ``export_dir`` (default ``<store>/sglang``) must be a path the servers see
    under the same name. ``guidance`` is None: SGLang captures no guidance records. An MoE
    ``config.json`` gives the engine its routing geometry, so rollout requests that ask for
    routing records (R3) are served from SGLang's routed experts (the servers need
    ``--enable-return-routed-experts``).
    """
    def pick(value, field: str):
        return getattr(settings, field) if value is None else value

    base_url = pick(base_url, "sglang_url")
    router_url = pick(router_url, "sglang_router_url")
    model_dir = pick(model_dir, "sglang_model_dir")
    urls = ([u.strip() for u in base_url.split(",") if u.strip()]
            if isinstance(base_url, str) else list(base_url or []))
    if not (urls or router_url) or not model_dir:
        raise ConfigError("the SGLang sampler needs the servers' URLs (sglang_url) or an "
                          "sglang-router's (sglang_router_url), and the model directory they "
                          "were started from (sglang_model_dir)")
    store = WeightStore(settings.store_dir)
    exports = ModelOptExport(store, model_dir, pick(export_dir, "sglang_export_dir"))
    engine = SGLangSamplerEngine(
        urls or None, ExportOrWrite(exports), router=router_url,
        path=sglang_path(pick(path, "sampler_path")),
        eos_id=pick(eos_id, "sglang_eos_id"), load_format=pick(load_format, "sglang_load_format"),
        timeouts=timeouts, api_key=pick(api_key, "sglang_api_key"),
        admin_api_key=settings.sglang_admin_api_key,
        original_logprobs=settings.sglang_original_logprobs,
        model_paths=(str(Path(model_dir)), str(exports.dir)), deterministic=settings.strict,
        routing=SGLangRouting.from_config(model_dir)
        if (Path(model_dir) / "config.json").is_file() else None)
    rollouts = RolloutStore(binary_client(settings), settings.key_prefix, metrics=metrics)
    return engine, rollouts, None
