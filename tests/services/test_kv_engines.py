"""The embedded engines with an FP4 KV cache: the sampler's path names its KV
format and its records carry K/V sections with the version and model they were made for; the
learner's KV-guided path scores closer to the sampler, trains, and refuses records without K/V
guidance by name."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from alignclient.errors import GuidanceMismatchError
from alignd.learner.engine import TorchLearnerEngine, TrainBatch
from alignd.sampler.engine import TorchSamplerEngine

from libalign import gemm, models
from libalign.guidance import GuidanceRecord
from tests.services.test_sampler_engine import _convert

TASK = models.SyntheticTask()

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed):
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=seed)


@pytest.fixture(scope="module")
def source():
    """A random tiny model: the learner's weights."""
    return _model(7)


def test_kv_paths_name_their_format():
    """nvfp4_minite_kv_* / nvfp4_trace_kv_* carry the KV preset their name says; the trace ones
    are guided learner paths."""
    for kv in ("kv_nvfp4", "kv_mxfp4"):
        assert gemm.get_path(f"nvfp4_minite_{kv}").kv_spec.name == kv
        assert gemm.get_path(f"nvfp4_trace_{kv}").kv_spec.name == kv
        assert f"nvfp4_trace_{kv}" in gemm.guided_paths()
    assert gemm.get_path("nvfp4_minite").kv_spec is None


def test_sampler_records_kv_and_scores_like_it_decodes(tmp_path, source):
    """An nvfp4_minite_kv_nvfp4 sampler decodes through the FP4 cache (other log-probs than
    nvfp4_minite), records K/V with their format, version and model, and its scores reproduce
    its decode."""
    from alignd.formats.weight_store import WeightStore

    store = WeightStore(tmp_path)
    _convert(store, source, "v", "nvfp4_minite_kv_nvfp4")
    _convert(store, source, "p", "nvfp4_minite")
    kw = dict(batch_size=8, eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    eng = TorchSamplerEngine(_model(99), store, "nvfp4_minite_kv_nvfp4", **kw)
    plain = TorchSamplerEngine(_model(99), store, "nvfp4_minite", **kw)
    eng.load("v")
    plain.load("p")
    prompts = TASK.prompts(4, 5)
    g = eng.generate(prompts, max_new_tokens=4, guidance_bits=1)
    rec = GuidanceRecord.decode(g.guidance[0].encode())
    assert rec.kv_spec == "kv_nvfp4" and rec.meta == {"version": "v", "layers": 2, "kv_heads": 2}
    assert {s for _, s in rec.sites} == {"fc1", "fc2", "k", "v"}
    assert eng.score(g.sequences, g.prompt_lens) == g.logprobs
    assert plain.score(g.sequences, g.prompt_lens) != g.logprobs


def test_kv_guided_learner_scores_closer_and_trains():
    """nvfp4_trace_kv_nvfp4 with the sampler's records scores the sampler's rollouts at least as
    closely as without them (K/V rounded to nearest), and a training step runs through the
    straight-through K/V quantization."""
    m = _model(11)
    prompts = TASK.prompts(4, 2)
    cap_path = "nvfp4_minite"
    with models.use_kv_format(m, "kv_nvfp4"), models.capture_guidance(m) as cap, \
            models.capture_kv(m, cap):
        r = models.generate(m, prompts, cap_path, max_new_tokens=5, seed=3, eos_id=TASK.eos_id,
                            pad_id=TASK.pad_id)
    recs = cap.records(1)
    eng = TorchLearnerEngine(m, "nvfp4_trace_kv_nvfp4", pad_id=TASK.pad_id)
    samp = [t.tolist() for t in r.logprobs]

    def gap(xs):
        return sum(abs(a - b) for x, y in zip(xs, samp, strict=True)
                   for a, b in zip(x, y, strict=True))

    guided = eng.score(r.sequences, r.prompt_lens, recs)
    plain = eng.score(r.sequences, r.prompt_lens)
    assert gap(guided) < gap(plain)
    assert models.kv_format(m) is None  # the engine's KV format is per forward
    stats = eng.train_step(TrainBatch(r.sequences, r.prompt_lens, samp, [1.0, 0.0, 1.0, 0.0],
                                      [0, 0, 1, 1], recs))
    assert stats["grad_norm"] > 0


def test_records_without_kv_guidance_are_refused():
    """Records of a sampler without an FP4 KV cache given to a KV-guided learner: the
    GuidanceMismatchError names the format."""
    m = _model(11)
    with models.capture_guidance(m) as cap:
        r = models.generate(m, TASK.prompts(2, 2), "nvfp4_minite", max_new_tokens=3,
                            eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    eng = TorchLearnerEngine(m, "nvfp4_trace_kv_nvfp4", pad_id=TASK.pad_id)
    with pytest.raises(GuidanceMismatchError, match="format") as e:
        eng.score(r.sequences, r.prompt_lens, cap.records(1))
    assert e.value.field == "format"


def test_guidance_size_counts_kv_by_format():
    """alignd guidance-size --kv counts K/V at the format's block size (kv_mxfp4: half the
    scale bytes of kv_nvfp4) and refuses an unknown format with exit 2."""
    from alignd.tools.cli import app
    from typer.testing import CliRunner

    from libalign.guidance.sizes import size_for_config

    runner = CliRunner()
    cfg = models.qwen3_30b_a3b_shaped_config(48)
    for kv in ("kv_nvfp4", "kv_mxfp4"):
        res = runner.invoke(app, ["guidance-size", "--kv", "--kv-format", kv], terminal_width=200)
        assert res.exit_code == 0, res.output
        want = size_for_config(cfg, bits=1, kv=True, kv_spec=kv)["kv"]
        assert f"{want:.0f}" in res.output and kv in res.output
    assert size_for_config(cfg, bits=1, kv=True, kv_spec="kv_nvfp4")["kv"] - \
        size_for_config(cfg, bits=1, kv=True, kv_spec="kv_mxfp4")["kv"] == 48 * 1024 * (1 / 32)
    res = runner.invoke(app, ["guidance-size", "--kv", "--kv-format", "kv_fp3"])
    assert res.exit_code == 2 and "kv_fp3" in res.output


def test_megatron_learner_refuses_kv_paths():
    """The Megatron-core learner keeps K and V in bf16: a KV path is refused by name (ConfigError),
    never trained without its KV quantization."""
    pytest.importorskip("megatron.core")
    import torch
    from alignclient.errors import ConfigError
    from alignd.learner.megatron_engine import MegatronLearnerEngine

    with pytest.raises(ConfigError, match="nvfp4_trace_kv_nvfp4"):
        MegatronLearnerEngine(torch.nn.Linear(2, 2), None, "nvfp4_trace_kv_nvfp4")


def test_sglang_sampler_refuses_kv_paths():
    """The SGLang sampler serves no FP4 KV cache of libalign's (nor its records): its builder
    refuses the KV paths by name (they are row-scaled, which its exports are not)."""
    from alignclient.errors import ConfigError
    from alignd.sampler.sglang_sampler import sglang_path

    for kv in ("kv_nvfp4", "kv_mxfp4"):
        with pytest.raises(ConfigError, match=f"nvfp4_minite_{kv}"):
            sglang_path(f"nvfp4_minite_{kv}")
