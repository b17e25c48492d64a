"""Strict execution through the tools and services: ``alignd demo --configs strict_bf16,
strict_minite`` shows δ = 0 exactly on every step without TIS, ``alignd diagnose --strict``
reports P99 |δ| = 0 and nothing to localize, the embedded engines score as their strict sampler
decodes, and paths without a strict form are refused."""

from __future__ import annotations

import json

import pytest
from alignclient.errors import SpecError
from alignd.learner.engine import TorchLearnerEngine, TrainBatch
from alignd.tools.cli import app
from alignd.tools.demo.run import CONFIGS, STRICT_CONFIGS, DemoConfig
from typer.testing import CliRunner

from libalign import models
from libalign.models import strict

runner = CliRunner()
SMALL = ["--model", "tiny-random", "--num-prompts", "8", "--batch-size", "4", "--n-boot", "50",
         "--localize-sequences", "4", "--layers", "0,3", "--replay-layers", "3", "--quiet"]


def test_demo_strict_configurations_have_zero_delta_on_every_step(tmp_path):
    """alignd demo --configs strict_bf16,strict_minite: every step's max |δ| is 0.0 exactly,
    TIS is off, and a step's gradient is nonzero exactly when some group's rewards differ
    (which tokens were sampled, and so the rewards, depends on the CPU's kernels: a step of
    uniform groups has advantage 0 and gradient 0.0); the strict configurations are not in the
    default set. That a strict learner trains on signal is pinned without sampling in
    :func:`test_strict_learner_trains_exactly_when_a_group_has_signal`."""
    assert not set(STRICT_CONFIGS) & set(DemoConfig().configs)
    assert not set(STRICT_CONFIGS) & set(CONFIGS)
    res = runner.invoke(app, ["demo", "--steps", "2", "--seeds", "1",
                              "--configs", "strict_bf16,strict_minite",
                              "--prompts-per-step", "2", "--samples-per-prompt", "4", "--no-api",
                              "--out", str(tmp_path / "demo")], terminal_width=200)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert [c["name"] for c in report["configs"]] == ["strict_bf16", "strict_minite"]
    for c in report["configs"]:
        assert not c["tis"] and not c["objective"]["tis"]
        for s in c["steps"]:
            assert s["tokens"] > 0 and s["max_abs_delta"] == 0.0, (c["name"], s)
            assert (s["train"]["grad_norm"] > 0) == (s["train"]["signal_rollouts"] > 0), s
        assert c["summary"]["p99_abs_delta"] == 0.0


def test_diagnose_strict_reports_exact_pairs_and_nothing_to_localize():
    """alignd diagnose --strict: the default strict pairs have every δ = 0 (P99 0, exact), the
    sampler replay reproduces the generator bitwise, the pairs are not localized (identical
    sides) and the context swap passes on both paths, even scoring a sequence alone."""
    res = runner.invoke(app, ["diagnose", *SMALL, "--strict", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    s = data["strict"]
    assert set(s["conditions"]) == {"bf16/bf16", "nvfp4_minite/nvfp4_minite"}
    assert sorted(s["exact_pairs"]) == sorted(s["conditions"]) and s["localization"]
    for name, row in s["conditions"].items():
        assert row["exact"] and row["tokens"] > 0 and row["p99_abs_delta"] == 0.0, name
    for row in data["conditions"]:
        assert row["shared"]["delta"]["p99_abs"] == 0.0 == row["on_policy"]["delta"]["p99_abs"]
    assert data["sequences"]["replay_consistency"]["bitwise"]
    assert data["layers"] == [] and sorted(data["localization"]["skipped_same_path"]) == sorted(
        s["conditions"])
    for p in data["context_swap"]["paths"].values():
        assert p["pass"] and p["alone_batch_of_one"]["bitwise"]


def test_diagnose_strict_refuses_a_path_without_a_strict_form():
    """--strict with nvfp4_naive: exit 2, one line naming the path (its per-tensor activation
    scale depends on the whole call); without --strict the same condition runs."""
    res = runner.invoke(app, ["diagnose", *SMALL, "--strict", "--conditions", "bf16/nvfp4_naive"])
    assert res.exit_code == 2
    assert "--strict: path 'nvfp4_naive' scales activations per tensor" in res.stderr


def test_learner_engine_in_strict_mode_refuses_nvfp4_naive_and_scores_like_its_sampler():
    """TorchLearnerEngine(strict=True): nvfp4_naive is refused (SpecError); on nvfp4_minite its
    scores equal a strict sampler's decode-time log-probs on every token."""
    task = models.SyntheticTask()
    with pytest.raises(SpecError, match="no batch-invariant"):
        TorchLearnerEngine(models.build_model(models.tiny_config(), seed=1), "nvfp4_naive",
                           strict=True)
    model = models.build_model(models.tiny_config(), seed=1)
    engine = TorchLearnerEngine(model, "nvfp4_minite", strict=True, pad_id=task.pad_id,
                                batch_size=5)
    assert strict.is_strict(model)
    sampler = models.build_model(models.tiny_config(), seed=1)
    with strict.use_strict(sampler):
        r = models.generate(sampler, task.prompts(6, seed=3), "nvfp4_minite", max_new_tokens=5,
                            batch_size=4, eos_id=task.eos_id, pad_id=task.pad_id, seed=2)
    got = engine.score(r.sequences, r.prompt_lens)
    assert got == [t.tolist() for t in r.logprobs]


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_strict_learner_trains_exactly_when_a_group_has_signal(path):
    """A strict learner's step on fixed rollouts (no sampling): a group whose rewards differ
    gives a nonzero gradient and changes the weights; groups of equal rewards give advantage
    0, a gradient norm of exactly 0.0 and ``signal_rollouts`` 0."""
    task = models.SyntheticTask()
    prompts = task.prompts(4, seed=5)
    seqs = [[*p, *task.encode(str(i)), task.eos_id] for i, p in enumerate(prompts)]
    plens = [len(p) for p in prompts]
    samp = [[-1.0, -1.0]] * 4

    def step(rewards):
        engine = TorchLearnerEngine(models.build_model(models.tiny_config(), seed=1), path,
                                    strict=True, use_tis=False, pad_id=task.pad_id, lr=1e-3)
        before = {k: v.clone() for k, v in engine.export_weights().items()}
        got = engine.train_step(TrainBatch(seqs, plens, samp, rewards, [0, 0, 1, 1]))
        after = engine.export_weights()
        changed = sum(not bool((before[k] == after[k]).all()) for k in before)
        return got, changed

    got, changed = step([1.0, 0.0, 1.0, 1.0])
    assert got["signal_rollouts"] == 2 and got["grad_norm"] > 0 and changed > 0
    got, changed = step([1.0, 1.0, 0.0, 0.0])
    assert got["signal_rollouts"] == 0 and got["grad_norm"] == 0.0


def test_sglang_kernels_need_sglangs_module():
    """SGLangKernels without an importable sglang.srt.batch_invariant_ops is a ConfigError
    naming the module (here: no Triton on a CPU build of torch)."""
    import importlib.util

    from alignclient.errors import ConfigError
    from alignd.integrations.sglang_strict import SGLANG_MODULE, SGLangKernels

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is here: SGLang's module may import")
    with pytest.raises(ConfigError, match=SGLANG_MODULE):
        SGLangKernels()
