"""Pins the KV format a weight version carries end to end: the converter service writes the
sampler path's KV format and the configured global scales into the manifest, the embedded
sampler writes its FP4 cache with those scales, the learner writes its K/V with the same
scales (from the same setting) and refuses a version whose scales differ with
``field="kv.scales"``, and a sampler whose KV format the version was not made for (embedded
or SGLang) refuses it with ``field="kv.format"``, loading nothing."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import ConfigError, SpecError
from alignd.converter.main import run_converter
from alignd.formats.convert import check_kv_scales, convert_published, path_kv_format, target_spec
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.published import write_published
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import ConverterSettings, LearnerSettings
from alignd.learner.engine import TorchLearnerEngine
from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
from alignd.learner.service import engine_options
from alignd.sampler.engine import TorchSamplerEngine
from alignd.sampler.sglang_sampler import ExportOrWrite
from alignd.sync.bf16 import publish_version

from libalign import models
from libalign.models.kv_cache import KVScales, kv_state
from libalign.spec import PRESETS
from tests.services.test_sampler_engine import _convert

SGL_NVFP4 = "nvfp4_minite_kv_sglang_nvfp4"
SGL_BLOCK16 = "nvfp4_minite_kv_sglang_fp4_mx_block16"
SCALES = KVScales((0.015625, 0.03125), (0.5, 0.25), "calibration")
#: not powers of two: dividing by a power of two only shifts the E4M3 block scales' exponents,
#: so only scales like these give other K/V values than SGLang's default 1.0
ODD_SCALES = KVScales((0.0123, 0.0371), (0.3, 0.17), "calibration")
TASK = models.SyntheticTask()

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


def _convert_with_scales(store: WeightStore, model, vid: str, path: str, scales: KVScales):
    """``model`` converted for sampler ``path``, the manifest naming ``scales`` (as the
    converter service writes it with kv_scales_file)."""
    write_published(store.published_root, vid, {k: v.detach() for k, v in
                                                 model.state_dict().items()})
    spec, quantize = target_spec(PRESETS["minite"], path)
    convert_published(store.published_path(vid), store, vid, spec, quantize=quantize,
                      kv_format=path_kv_format(path), kv_scales=scales)


def test_learner_writes_kv_with_the_versions_scales(redis_url, tmp_path, source):
    """With scales other than 1.0 in the version (and in kv_scales_file), the embedded learner
    on the sampler's KV path scores the embedded sampler's rollouts exactly as the sampler
    decoded them; with SGLang's default 1.0 it does not. The loop refuses a version whose
    scales are not the learner's with field kv.scales, naming the layer and site, and a
    learner given scales for another layer count is refused at construction."""
    store = WeightStore(tmp_path / "store")
    _convert_with_scales(store, source, "v", SGL_NVFP4, ODD_SCALES)
    eng = TorchSamplerEngine(_model(99), store, SGL_NVFP4, batch_size=4, eos_id=TASK.eos_id,
                             pad_id=TASK.pad_id)
    eng.load("v")
    g = eng.generate(TASK.prompts(4, 5), max_new_tokens=4)
    scales_file = tmp_path / "kv_scales.json"
    scales_file.write_text(json.dumps(ODD_SCALES.to_dict()))
    settings = LearnerSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                               learner_path=SGL_NVFP4, sampler_path=SGL_NVFP4,
                               kv_scales_file=scales_file)
    opts = engine_options(settings)
    assert opts["kv_scales"] == ODD_SCALES
    learner = TorchLearnerEngine(_model(7), SGL_NVFP4, pad_id=TASK.pad_id, **opts)
    default = TorchLearnerEngine(_model(7), SGL_NVFP4, pad_id=TASK.pad_id)
    assert learner.kv_scales == ODD_SCALES and default.kv_scales == KVScales.default(2)
    assert learner.score(g.sequences, g.prompt_lens) == g.logprobs
    assert default.score(g.sequences, g.prompt_lens) != g.logprobs
    plan = RolloutPlan(prompts=lambda n: [[1]] * n, reward=lambda p, c: 0.0,
                       sampler_path=SGL_NVFP4, run_id="kv")
    parts = LoopParts.build(settings, stores=False)
    assert parts.kv_scales == ODD_SCALES
    LearnerLoop(settings, learner, parts, plan).check_kv("v")
    with pytest.raises(SpecError, match=r"field kv\.scales: layer 0 k_scale is 0\.0123") as err:
        LearnerLoop(settings, default, parts, plan).check_kv("v")
    assert err.value.field == "kv.scales"
    with pytest.raises(SpecError, match="cover 2 layers, the learner's 1"):
        check_kv_scales(store.read_manifest("v").extra, "kv_sglang_nvfp4", KVScales.default(1))
    check_kv_scales(store.read_manifest("v").extra, "kv_nvfp4", KVScales.default(1))  # not its
    with pytest.raises(ConfigError, match=r"kv_scales.*layer 1 k_scale/v_scale"):
        TorchLearnerEngine(_model(7), SGL_NVFP4, kv_scales=KVScales.default(1))


#: SGLang 0.5.23's sources, installed beside the venv for the SGLang tests
SGLANG_SRT = Path(os.environ.get("ALIGN_SGLANG_CPU", Path(sys.prefix) / "sglang-cpu")) / \
    "sglang" / "srt"


def test_modelopt_export_writes_the_versions_kv_scales_where_sglang_reads_them(tmp_path, source):
    """The ModelOpt export of a version with K/V scales holds one fp32 scalar per layer and
    site under model.layers.<i>.self_attn.attn.{k,v}_scale with the version's values, and its
    quantization config sets kv_cache_quant_algo; a version without scales gets neither. The
    names are pinned against SGLang's sources (not by running its loader): Qwen3-MoE's
    attention is self_attn.attn, a RadixAttention whose KV method declares k_scale/v_scale,
    its load_weights fills a parameter of exactly the checkpoint's name, and
    NVFP4KVCacheMethod.load_scales_from_model reads layer.self_attn.attn.k_scale."""
    from safetensors.torch import load_file

    store = WeightStore(tmp_path / "store")
    _convert_with_scales(store, source, "v", SGL_NVFP4, ODD_SCALES)
    _convert(store, source, "p", "nvfp4_minite")
    (tmp_path / "model").mkdir()
    source.config.to_json_file(tmp_path / "model" / "config.json")
    exports = ModelOptExport(store, tmp_path / "model", tmp_path / "exports")
    got = {}
    for vid in ("v", "p"):
        exports.write(vid)
        got[vid] = {}
        for f in sorted(exports.path(vid).glob("*.safetensors")):
            got[vid].update({k: t for k, t in load_file(f).items() if ".attn." in k})
    want = {f"model.layers.{i}.self_attn.attn.{s}_scale":  # fp32, as both sides compute
            float(torch.tensor(ODD_SCALES.scale(i, s), dtype=torch.float32))
            for i in range(2) for s in ("k", "v")}
    assert {k: (t.dtype, t.shape, float(t)) for k, t in got["v"].items()} == \
        {k: (torch.float32, torch.Size([]), g) for k, g in want.items()}
    assert not got["p"]
    config = json.loads((exports.path("v") / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "libalign_minite" and config["kv_cache_quant_algo"] == "NVFP4"
    assert "kv_cache_quant_algo" not in json.loads(
        (exports.path("p") / "config.json").read_text())["quantization_config"]
    assert json.loads((exports.path("v") / "manifest.json").read_text())["kv_scales"] == \
        sorted(want)
    if not SGLANG_SRT.is_dir():
        pytest.skip(f"no SGLang sources at {SGLANG_SRT}")
    src = {name: (SGLANG_SRT / name).read_text() for name in (
        "models/qwen3_moe.py", "layers/quantization/kv_cache.py",
        "layers/quantization/fp4_kv_cache_quant_method.py")}
    assert "self.self_attn = Qwen3MoeAttention(" in src["models/qwen3_moe.py"]
    assert "self.attn = RadixAttention(" in src["models/qwen3_moe.py"]
    assert "maybe_remap_kv_scale_name" not in src["models/qwen3_moe.py"]
    assert "layer.k_scale = torch.nn.Parameter" in src["layers/quantization/kv_cache.py"]
    fp4 = src["layers/quantization/fp4_kv_cache_quant_method.py"]
    assert "attention_layers.append(layer.self_attn.attn)" in fp4
    assert "float(layer.k_scale)" in fp4 and "float(layer.v_scale)" in fp4
