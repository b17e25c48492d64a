"""Pins the KV format a weight version carries end to end: the converter service writes the
sampler path's KV format and the configured global scales into the manifest, the embedded
sampler writes its FP4 cache with those scales, and a sampler whose KV format the version was
not made for (embedded or SGLang) refuses it with ``field="kv.format"``, loading nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from alignclient.errors import ConfigError, SpecError
from alignd.converter.main import run_converter
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import ConverterSettings
from alignd.sampler.engine import TorchSamplerEngine
from alignd.sampler.sglang_sampler import ExportOrWrite
from alignd.sync.bf16 import publish_version

from libalign import models
from libalign.models.kv_cache import KVScales, kv_state
from tests.services.test_sampler_engine import _convert

SGL_NVFP4 = "nvfp4_minite_kv_sglang_nvfp4"
SGL_BLOCK16 = "nvfp4_minite_kv_sglang_fp4_mx_block16"
SCALES = KVScales((0.015625, 0.03125), (0.5, 0.25), "calibration")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int):
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=seed)


@pytest.fixture(scope="module")
def source():
    return _model(7)


def test_converter_writes_the_paths_kv_format_and_scales(redis_url, tmp_path, source):
    """A version published for an SGLang KV path names its format, --kv-cache-dtype and (for
    kv_sglang_nvfp4) the scales of kv_scales_file; other paths name no scales, or no KV."""
    scales_file = tmp_path / "kv_scales.json"
    scales_file.write_text(json.dumps(SCALES.to_dict()))
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                                 consumer_name="conv-kv", block_ms=50,
                                 kv_scales_file=scales_file)
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    bus.ensure_group(settings.published_stream, settings.converter_group)
    sd = {k: v.detach() for k, v in source.state_dict().items()}
    for vid, target in (("a", SGL_NVFP4), ("b", SGL_BLOCK16), ("c", "nvfp4_minite")):
        publish_version(store.published_root, reg, bus, settings.published_stream, vid, sd,
                        target_path=target)
    assert run_converter(settings, max_messages=3) == 3
    kv = {vid: store.read_manifest(vid).extra.get("kv") for vid in "abc"}
    assert kv["a"] == {"format": "kv_sglang_nvfp4", "sglang_kv_cache_dtype": "nvfp4",
                       "scales": SCALES.to_dict()}
    assert kv["b"] == {"format": "kv_sglang_fp4_mx_block16",
                       "sglang_kv_cache_dtype": "fp4_mx_block16", "scales": None}
    assert kv["c"] is None
    # the embedded sampler of the path writes its cache with the version's scales
    eng = TorchSamplerEngine(_model(99), store, SGL_NVFP4, batch_size=4)
    eng.load("a")
    assert kv_state(eng.model).scales == SCALES


def test_converter_refuses_an_unreadable_scales_file(redis_url, tmp_path):
    """A kv_scales_file that is not scales (here a NaN) stops the converter at start."""
    from alignd.converter.worker import ConverterWorker

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"source": "calibration", "k": [1.0], "v": ["nan"]}))
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "s",
                                 consumer_name="c", kv_scales_file=bad)
    with pytest.raises(ConfigError, match=r"kv_scales_file.*layer 0 v_scale"):
        ConverterWorker(settings, None, None, WeightStore(tmp_path / "s"), None)


def test_embedded_sampler_refuses_another_kv_format(tmp_path, source):
    """A version made for one KV format (or none) is refused by a sampler running another,
    with field kv.format, and the version served before stays served."""
    store = WeightStore(tmp_path)
    _convert(store, source, "plain", "nvfp4_minite")
    _convert(store, source, "kv", "nvfp4_minite_kv_nvfp4")
    kv_eng = TorchSamplerEngine(_model(99), store, "nvfp4_minite_kv_nvfp4", batch_size=4)
    plain_eng = TorchSamplerEngine(_model(99), store, "nvfp4_minite", batch_size=4)
    kv_eng.load("kv")
    plain_eng.load("plain")
    for eng, vid, served in ((kv_eng, "plain", "kv"), (plain_eng, "kv", "plain")):
        with pytest.raises(SpecError, match=r"field kv\.format") as err:
            eng.load(vid)
        assert err.value.field == "kv.format" and eng.version_id == served
    block16 = TorchSamplerEngine(_model(99), store, SGL_BLOCK16, batch_size=4)
    with pytest.raises(SpecError, match=r"kv_nvfp4.*kv_sglang_fp4_mx_block16"):
        block16.load("kv")
    assert block16.version_id is None


def test_sglang_exporter_refuses_another_kv_format(tmp_path, source):
    """The SGLang sampler's exporter checks the version's KV format before writing or handing
    out an export: no export is written for a version of another KV format."""
    store = WeightStore(tmp_path / "store")
    _convert(store, source, "plain", "nvfp4_minite")
    (tmp_path / "model").mkdir()
    source.config.to_json_file(tmp_path / "model" / "config.json")
    exports = ModelOptExport(store, tmp_path / "model", tmp_path / "exports")
    with pytest.raises(SpecError, match=r"field kv\.format") as err:
        ExportOrWrite(exports)("plain", SGL_NVFP4)
    assert err.value.field == "kv.format" and not exports.exists("plain")
