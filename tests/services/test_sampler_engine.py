"""The embedded sampler engine: verified loads of converted versions, generation, guidance."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

from alignclient.errors import ChecksumMismatchError, SpecError
from alignd.formats.convert import convert_published, path_kv_format, target_spec
from alignd.formats.published import write_published
from alignd.formats.weight_store import WeightStore
from alignd.sampler.engine import TorchSamplerEngine

from libalign import models
from libalign.guidance import GuidanceRecord
from libalign.spec import PRESETS

TASK = models.SyntheticTask()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source():
    """A random tiny model: the learner's weights."""
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=7)


def _convert(store: WeightStore, model, vid: str, target: str):
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    write_published(store.published_root, vid, sd)
    spec, quantize = target_spec(PRESETS["minite"], target)
    convert_published(store.published_path(vid), store, vid, spec, quantize=quantize,
                      kv_format=path_kv_format(target))


def _engine(store, source, path):
    blank = models.build_model(models.tiny_config(num_hidden_layers=2), seed=99)
    return TorchSamplerEngine(blank, store, path, batch_size=8, eos_id=TASK.eos_id,
                              pad_id=TASK.pad_id)


@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_naive", "bf16"])
def test_loaded_version_samples_like_the_source_model(tmp_path, source, path):
    """Stored bits, installed without re-quantizing, give the source model's log-probs exactly."""
    store = WeightStore(tmp_path)
    _convert(store, source, "v1", path)
    eng = _engine(store, source, path)
    info = eng.load("v1")
    # 2 layers x (gate_up, down)
    assert eng.version_id == "v1" and info["quantized"] == (0 if path == "bf16" else 4)
    prompts = TASK.prompts(6, 3)
    got = eng.generate(prompts, max_new_tokens=5, seed=1)
    ref = models.generate(copy.deepcopy(source), prompts, path, max_new_tokens=5, seed=1,
                          batch_size=8, eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    assert got.sequences == ref.sequences
    assert got.logprobs == [t.tolist() for t in ref.logprobs]
    assert got.version_id == "v1"


def test_a_version_for_another_path_is_refused(tmp_path, source):
    """A sampler never multiplies bits made for another recipe."""
    store = WeightStore(tmp_path)
    _convert(store, source, "naive", "nvfp4_naive")
    _convert(store, source, "plain", "bf16")
    eng = _engine(store, source, "nvfp4_minite")
    with pytest.raises(SpecError, match="converted with spec 'te_expert'"):
        eng.load("naive")
    bf = _engine(store, source, "bf16")
    _convert(store, source, "mini", "nvfp4_minite")
    with pytest.raises(SpecError, match="runs bf16"):
        bf.load("mini")
    assert eng.version_id is None and bf.version_id is None


def test_corrupt_version_keeps_the_old_one_serving(tmp_path, source):
    """A checksum mismatch is found before the switch; the served version is unchanged."""
    store = WeightStore(tmp_path)
    _convert(store, source, "good", "nvfp4_minite")
    _convert(store, source, "bad", "nvfp4_minite")
    eng = _engine(store, source, "nvfp4_minite")
    eng.load("good")
    before = eng.generate(TASK.prompts(2, 0), max_new_tokens=3)
    shard = sorted((store.version_path("bad")).glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        eng.load("bad")
    assert eng.version_id == "good"
    assert eng.generate(TASK.prompts(2, 0), max_new_tokens=3).logprobs == before.logprobs


def test_generate_with_guidance_and_score(tmp_path, source):
    """Guidance records come back per prompt; teacher-forced scores reproduce the decode."""
    store = WeightStore(tmp_path)
    _convert(store, source, "v", "nvfp4_minite")
    eng = _engine(store, source, "nvfp4_minite")
    eng.load("v")
    g = eng.generate(TASK.prompts(4, 5), max_new_tokens=4, guidance_bits=1)
    assert sorted(g.guidance) == [0, 1, 2, 3]
    rec = GuidanceRecord.decode(g.guidance[0].encode())
    assert rec.bits == 1 and rec.layers == [0, 1]
    assert eng.score(g.sequences, g.prompt_lens) == g.logprobs


def test_load_waits_for_generation(tmp_path, source):
    """A load issued during a generation switches only after it (pause, load, resume)."""
    import threading

    store = WeightStore(tmp_path)
    _convert(store, source, "a", "nvfp4_minite")
    _convert(store, source, "b", "nvfp4_minite")
    eng = _engine(store, source, "nvfp4_minite")
    eng.load("a")
    seen = []
    eng._lock.acquire()  # a generation in flight
    t = threading.Thread(target=lambda: seen.append(eng.load("b")))
    t.start()
    t.join(0.5)
    assert t.is_alive() and eng.version_id == "a"
    eng._lock.release()
    t.join(10)
    assert eng.version_id == "b" and seen
