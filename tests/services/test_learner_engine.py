"""The embedded learner engine: GRPO advantages, TIS, scoring parity, guided training."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import InputError
from alignd.learner.engine import TorchLearnerEngine, TrainBatch, grpo_advantages

from libalign import models

TASK = models.SyntheticTask()


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=11):
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=seed)


def _rollouts(model, n=4, group=2, path="bf16"):
    prompts = [p for p in TASK.prompts(n, 1) for _ in range(group)]
    r = models.generate(model, prompts, path, max_new_tokens=5, seed=3, eos_id=TASK.eos_id,
                        pad_id=TASK.pad_id)
    rewards = [float(TASK.verify(s[:p], s[p:])) for s, p in zip(r.sequences, r.prompt_lens,
                                                                strict=True)]
    groups = [i // group for i in range(len(prompts))]
    return r, rewards, groups


def test_grpo_advantages_normalize_within_groups():
    """Each group is centered and scaled by its own spread; equal rewards give zero."""
    adv = grpo_advantages([1, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1])
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(2))


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_scores_equal_the_model_glue(path):
    """The learner's scores are libalign.models.score_sequences' bit for bit."""
    m = _model()
    r, _, _ = _rollouts(m)
    eng = TorchLearnerEngine(m, path, pad_id=TASK.pad_id)
    ref = models.score_sequences(m, r.sequences, r.prompt_lens, path, pad_id=TASK.pad_id)
    assert eng.score(r.sequences, r.prompt_lens) == [t.tolist() for t in ref]


def test_a_step_moves_towards_rewarded_rollouts():
    """Rewarded completions gain log-prob after a step; the others lose it."""
    m = _model()
    r, _, _ = _rollouts(m, n=2, group=2)
    eng = TorchLearnerEngine(m, "bf16", lr=1e-3, pad_id=TASK.pad_id)
    before = eng.score(r.sequences, r.prompt_lens)
    batch = TrainBatch(r.sequences, r.prompt_lens, before, [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    stats = eng.train_step(batch)
    after = eng.score(r.sequences, r.prompt_lens)
    gain = [sum(a) - sum(b) for a, b in zip(after, before, strict=True)]
    assert gain[0] > 0 and gain[3] > 0 and gain[1] < 0 and gain[2] < 0
    assert stats["tis_truncated_fraction"] == 0 and stats["tokens"] == sum(map(len, before))


def test_tis_truncates_large_ratios():
    """Tokens the sampler found far less likely than the learner are capped at C."""
    m = _model()
    r, rewards, groups = _rollouts(m)
    eng = TorchLearnerEngine(m, "bf16", pad_id=TASK.pad_id, tis_cap=2.0)
    low = [[v - 5.0 for v in lp] for lp in eng.score(r.sequences, r.prompt_lens)]
    stats = eng.train_step(TrainBatch(r.sequences, r.prompt_lens, low, rewards, groups))
    assert stats["tis_truncated_fraction"] == 1.0


def test_guided_learner_scores_and_trains():
    """nvfp4_trace with the sampler's records: scores match the sampler's decode more closely."""
    m = _model()
    prompts = TASK.prompts(4, 2)
    with models.capture_guidance(m) as cap:
        r = models.generate(m, prompts, "nvfp4_minite", max_new_tokens=5, seed=3,
                            eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    recs = cap.records(1)
    eng = TorchLearnerEngine(m, "nvfp4_trace", pad_id=TASK.pad_id)
    guided = eng.score(r.sequences, r.prompt_lens, recs)
    plain = eng.score(r.sequences, r.prompt_lens)
    samp = [t.tolist() for t in r.logprobs]
    d = lambda xs: max(abs(a - b) for x, y in zip(xs, samp, strict=True)  # noqa: E731
                       for a, b in zip(x, y, strict=True))
    assert d(guided) <= d(plain)
    stats = eng.train_step(TrainBatch(r.sequences, r.prompt_lens, samp, [1.0, 0.0, 1.0, 0.0],
                                      [0, 0, 1, 1], recs))
    assert stats["grad_norm"] > 0


def test_export_and_bad_batches():
    """Exports are bf16 CPU copies of the state dict; inconsistent batches are refused by name."""
    m = _model()
    eng = TorchLearnerEngine(m, "bf16", pad_id=TASK.pad_id)
    w = eng.export_weights()
    assert set(w) == set(m.state_dict()) and all(t.dtype == torch.bfloat16 for t in w.values())
    with pytest.raises(InputError, match="rewards has 1 entries for 2 sequences"):
        eng.train_step(TrainBatch([[1, 2, 3], [1, 2, 3]], [1, 1], [[0.0, 0.0]] * 2, [1.0], [0, 0]))
    with pytest.raises(InputError, match="rollout 0"):
        eng.train_step(TrainBatch([[1, 2, 3]], [1], [[0.0]], [1.0], [0]))
