"""TRACE on a Hugging Face Qwen3-MoE model: sampler capture, learner guidance, nvfp4_trace."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import SpecError

from libalign import gemm
from libalign.guidance import GuidanceRecord, GuidanceTable
from libalign.models import (
    CodeAgreement,
    SyntheticTask,
    build_model,
    capture_guidance,
    generate,
    score_sequences,
    tiny_config,
    use_guidance,
    use_path,
)
from libalign.models.scoring import KVDecode

TASK = SyntheticTask()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(num_hidden_layers=2), seed=5)


@pytest.fixture(scope="module")
def rollout(model):
    return generate(model, TASK.prompts(6, 1), "nvfp4_minite", max_new_tokens=6, batch_size=3)


def _replay(model, seqs, plens, batch=3):
    """The sampler's teacher-forced KV decode of given tokens (what diagnose replays)."""
    out = []
    for a in range(0, len(seqs), batch):
        chunk = seqs[a:a + batch]
        pl = plens[a:a + batch]
        comps = [s[p:] for s, p in zip(chunk, pl, strict=True)]
        dec = KVDecode(model, [s[:p] for s, p in zip(chunk, pl, strict=True)], 0, range(a, a + len(chunk)))
        got = [[] for _ in chunk]
        for step in range(max(map(len, comps))):
            lp = torch.log_softmax(dec.logits.float(), -1)
            for r, c in enumerate(comps):
                if step < len(c):
                    got[r].append(lp[r, c[step]].item())
            if step == max(map(len, comps)) - 1:
                break
            dec.step([c[step] if step < len(c) - 1 else 0 for c in comps],
                     active=[step < len(c) - 1 for c in comps])
        out += [torch.tensor(g) for g in got]
    return out


def test_trace_path_is_registered_and_equals_minite_without_records(model, rollout):
    """nvfp4_trace without guidance attached is the row-scaled minite path, bit for bit."""
    assert gemm.get_path("nvfp4_trace").act_spec == gemm.PATHS["nvfp4_minite"].act_spec
    a = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_minite")
    b = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_trace")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_guidance_from_the_same_forward_reproduces_it(model, rollout, bits):
    """Records captured on a forward and consumed by the identical forward change no bit."""
    with capture_guidance(model) as cap:
        ref = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_minite")
    recs = {k: GuidanceRecord.decode(r.encode()) for k, r in cap.records(bits).items()}
    agreement = CodeAgreement()
    with use_guidance(model, GuidanceTable(recs), reference=GuidanceTable(cap.records(4)),
                      agreement=agreement):
        got = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_trace")
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))
    assert agreement.values and all(v == 0 for v in agreement.mismatched.values())


def test_sampler_records_align_the_learner(model, rollout):
    """Decode-time records pull the learner's codes onto the sampler's: fewer mismatches, smaller δ."""
    with use_path(model, "nvfp4_minite"), capture_guidance(model) as cap:
        sampler = _replay(model, rollout.sequences, rollout.prompt_lens)
    # the teacher-forced replay is the generator's own decode
    assert all(torch.equal(a, b) for a, b in zip(sampler, rollout.logprobs, strict=True))
    full = GuidanceTable(cap.records(4))
    before, after = CodeAgreement(), CodeAgreement()
    with use_guidance(model, None, reference=full, agreement=before):
        plain = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_trace")
    with use_guidance(model, GuidanceTable(cap.records(1)), reference=full, agreement=after):
        guided = score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_trace")
    d_plain = torch.cat([a - b for a, b in zip(plain, sampler, strict=True)]).abs()
    d_guided = torch.cat([a - b for a, b in zip(guided, sampler, strict=True)]).abs()
    assert sum(before.mismatched.values()) > 0
    assert sum(after.mismatched.values()) < sum(before.mismatched.values())
    assert d_guided.max() < d_plain.max()
    for row in after.table():  # every real row but each sequence's last has a record
        assert 0.5 < row["rows_with_record"] < 1


def test_generate_captures_one_record_per_rollout(model):
    """Records made while sampling are keyed by the rollouts' ids and cover the fed positions."""
    prompts = TASK.prompts(4, 2)
    with capture_guidance(model, layers=[1]) as cap:
        r = generate(model, prompts, "nvfp4_minite", max_new_tokens=4, batch_size=4,
                     seq_ids=[10, 11, 12, 13])
    recs = cap.records(1)
    assert sorted(recs) == [10, 11, 12, 13]
    for sid, seq in zip([10, 11, 12, 13], r.sequences, strict=True):
        rows = recs[sid].sites[(1, "fc1")]
        assert rows.positions.tolist() == list(range(len(seq) - 1))
        assert recs[sid].layers == [1]


def test_capture_needs_row_keys(model):
    """A bare model call carries no sequence ids, so capture refuses it."""
    ids = torch.tensor([TASK.prompts(1, 0)[0]])
    with use_path(model, "nvfp4_minite"), capture_guidance(model), \
            pytest.raises(SpecError, match="row keys"):
        model(input_ids=ids)


def test_guided_learner_trains(model, rollout):
    """The straight-through backward runs through guided experts and reaches the expert weights."""
    with capture_guidance(model) as cap:
        score_sequences(model, rollout.sequences, rollout.prompt_lens, "nvfp4_minite")
    table = GuidanceTable(cap.records(1))
    ids = torch.tensor([rollout.sequences[0]])
    from libalign.guidance import row_keys
    from libalign.models.paths import set_row_keys
    model.zero_grad()
    with use_path(model, "nvfp4_trace"), use_guidance(model, table):
        set_row_keys(model, row_keys(0, torch.arange(ids.shape[1])).unsqueeze(0))
        try:
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        finally:
            set_row_keys(model, None)
        loss.backward()
    g = model.model.layers[0].mlp.experts.gate_up_proj.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    model.zero_grad()
