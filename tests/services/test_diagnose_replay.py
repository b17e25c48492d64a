"""Pins the 2×2 replay at the MoE entry (``alignd.tools.diagnose.replay``) and diagnose's default pairs.

R, I_j, E_j on hand-checkable tensors (0/0 → 0, x/0 → ∞, the mean over prompts); the captured
MoE-entry rows equal the MoE module's own input bit for bit; every replayed cell runs the
learner's experts; the JSON of a default run lists the papers' pairs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from alignclient.errors import InputError, NonFiniteError, ShapeError
from alignd.tools.cli import app
from alignd.tools.diagnose import replay
from alignd.tools.diagnose.conditions import (
    LIBALIGN_CONDITIONS,
    PAPER_CONDITIONS,
    Condition,
    resolve_conditions,
)
from typer.testing import CliRunner

from libalign import models


@pytest.fixture(scope="module")
def tiny():
    task = models.SyntheticTask()
    model = models.build_model(models.tiny_config(), seed=0)
    seqs = [p + [3, 4, 5][:1 + i % 3] for i, p in enumerate(task.prompts(3, 0))]
    return model, task, seqs


def test_relative_l2_by_hand():
    """R(x, ref) = ‖x − ref‖/‖ref‖: 0/0 → 0, x/0 → inf; shape and NaN refused by type."""
    assert replay.relative_l2_fp32(torch.tensor([4.0, 3.0]), torch.tensor([0.0, 3.0])) == 4 / 3
    assert replay.relative_l2_fp32(torch.zeros(3), torch.zeros(3)) == 0.0
    assert replay.relative_l2_fp32(torch.tensor([0.0, 1.0]), torch.zeros(2)) == math.inf
    with pytest.raises(ShapeError):
        replay.relative_l2_fp32(torch.zeros(2), torch.zeros(3))
    with pytest.raises(NonFiniteError, match="ref"):
        replay.relative_l2_fp32(torch.zeros(2), torch.tensor([0.0, float("nan")]))


def test_prompt_quantities_and_mean_by_hand():
    """I = R(F_L(h_R), F_L(h_L)), E = R(F_R(h_R), F_L(h_R)), R(h_L, h_R); means over prompts."""
    one = torch.ones(4)
    cells = {"LL": {"fc1": one, "fc2": torch.zeros(4)},
             "LR": {"fc1": 2 * one, "fc2": torch.zeros(4)},
             "RL": {"fc1": one, "fc2": torch.zeros(4)},
             "RR": {"fc1": 3 * one, "fc2": torch.ones(4)}}
    q = replay.prompt_quantities(torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 4.0]]), cells)
    assert q["input_discrepancy"] == 5 / 4
    assert q["fc1"] == {"I": 1.0, "E": 0.5, "E_at_h_L": 0.0, "I_sampler": 2.0, "N": 2.0}
    assert q["fc2"]["I"] == 0.0  # 0/0 → 0
    assert q["fc2"]["E"] == math.inf  # x/0 → inf
    m = replay.mean_over_prompts([q, {**q, "input_discrepancy": 0.75}])
    assert m["input_discrepancy"] == 1.0 and m["fc1"]["I_sampler"] == 2.0
    assert m["fc2"]["E"] == math.inf


def test_expert_index_order_is_stable():
    """Rows sorted by expert, ties in token order."""
    r = torch.tensor([[2, 0], [0, 1]])  # rows: 0→e2, 1→e0, 2→e0, 3→e1
    assert replay.expert_index_order(r).tolist() == [1, 2, 3, 0]


def test_capture_is_the_moe_module_input_bitwise(tiny):
    """capture_moe_entry's moe_in rows are the MoE module's forward input (real tokens) bit for bit."""
    model, task, seqs = tiny
    layer = models.moe_layer_indices(model)[-1]
    seen = []
    hook = models.decoder_layers(model)[layer].mlp.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        caps = replay.capture_moe_entry(model, seqs, "nvfp4_minite", [layer], batch_size=8,
                                        pad_id=task.pad_id, backend="auto")
    finally:
        hook.remove()
    (h,) = seen
    for r, s in enumerate(seqs):
        got = caps[layer][r]["moe_in"]
        assert got.shape[0] == len(s)
        assert torch.equal(got, h[r, :len(s)])


def test_replay_runs_the_learners_experts(tiny):
    """A forced assignment is what the replayed module runs; every moe_replay cell is fixed."""
    model, task, seqs = tiny
    layer = models.moe_layer_indices(model)[0]
    cap = replay.capture_moe_entry(model, seqs[:1], "bf16", [layer], batch_size=4,
                                   pad_id=task.pad_id, backend="auto")[layer][0]
    forced = (cap["routing"].flip(-1).roll(1, 0), cap["router_weights"])
    got = replay.replay_cell(model, layer, cap["moe_in"], "nvfp4_naive", forced, "auto")
    assert torch.equal(got["routing"], forced[0])
    rows, skipped = replay.moe_replay(
        model, seqs, [Condition("bf16", "bf16"), Condition("nvfp4_te", "nvfp4_modelopt_pertoken")],
        layers=[layer], batch_size=4, pad_id=task.pad_id, backend="auto")
    assert skipped == ["bf16/bf16"]
    (row,) = rows
    assert row["assignments_fixed"] and row["prompts"] == len(seqs)
    assert row["input_discrepancy"] == 0.0 and row["fc1"]["I"] == 0.0  # layer 0: same embeddings
    assert row["fc1"]["E"] > 0 and row["fc2"]["E"] > 0


def test_trace_replays_with_its_samplers_records(tiny):
    """A TRACE condition replays with the sampler's records: recorded on the sampler's own
    forward, the guided learner at h_R rounds every row as the sampler did, so FC1 and FC2
    equal the sampler's bit for bit (E = 0) while the unguided minite learner's differ; without
    records the condition is skipped."""
    from alignd.tools.diagnose import guided

    model, task, seqs = tiny
    layer = models.moe_layer_indices(model)[-1]
    plens = [len(s) - 1 for s in seqs]
    with models.capture_guidance(model, [layer], guided.capture_spec("nvfp4_minite")) as cap:
        models.score_sequences(model, seqs, plens, "nvfp4_minite", batch_size=4,
                               pad_id=task.pad_id)
    table = guided.Guidance(cap, 4, [layer], torch.device("cpu")).table
    trace = Condition("nvfp4_trace", "nvfp4_minite")
    common = dict(layers=[layer], batch_size=4, pad_id=task.pad_id, backend="auto")
    rows, skipped = replay.moe_replay(model, seqs, [trace], **common)
    assert rows == [] and skipped == [trace.name]
    rows, skipped = replay.moe_replay(model, seqs, [trace, Condition("nvfp4_te", "nvfp4_minite")],
                                      guidance={trace.name: table}, **common)
    assert skipped == []
    got = {r["condition"]: r for r in rows}
    assert got[trace.name]["fc1"]["E"] == 0.0 and got[trace.name]["fc2"]["E"] == 0.0
    assert got[trace.name]["replay_reproduces_capture"]
    assert got["nvfp4_te/nvfp4_minite"]["fc1"]["E"] > 0


def test_default_pairs_are_the_papers_and_old_set_by_flag():
    """papers by default; --pairs libalign gives the earlier set; an unknown set is an InputError."""
    assert [c.name for c in resolve_conditions()[0]] == list(PAPER_CONDITIONS)
    assert [c.name for c in resolve_conditions(pairs="libalign")[0]] == list(LIBALIGN_CONDITIONS)
    res = CliRunner().invoke(app, ["diagnose", "--model", "tiny-random", "--pairs", "nope", "--quiet"])
    assert res.exit_code == 2 and "--pairs 'nope'" in res.stderr


def test_cli_json_lists_default_pairs_and_moe_replay():
    """A default run's JSON names the papers' pairs and holds the MoE-entry replay rows."""
    res = CliRunner().invoke(app, [
        "diagnose", "--model", "tiny-random", "--num-prompts", "4", "--batch-size", "4",
        "--n-boot", "20", "--localize-sequences", "2", "--moe-replay-prompts", "2", "--layers",
        "none", "--replay-layers", "3", "--no-on-policy", "--no-context-swap", "--max-new-tokens",
        "3", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["pairs"] == {"set": "papers", "defaults": list(PAPER_CONDITIONS), "from_defaults": True}
    assert [c["name"] for c in r["conditions"]] == list(PAPER_CONDITIONS)
    mr = r["moe_replay"]
    assert mr["sampler_side"] == "decode" and mr["skipped_same_path"] == []
    assert [row["condition"] for row in mr["rows"]] == list(PAPER_CONDITIONS)  # TRACE included
    assert mr["prompts"] == 2 and all(row["assignments_fixed"] for row in mr["rows"])


def test_decode_sampler_side_measures_same_path_pairs(tiny):
    """h_R from the sampler's KV-cached decode: the MoE input rows of its prefill and steps, the
    first len − 1 tokens; a same-path pair is measured, not skipped; an unknown side is refused."""
    model, task, seqs = tiny
    layer = models.moe_layer_indices(model)[-1]
    plens = [len(s) - 1 - i % 3 for i, s in enumerate(seqs)]
    dec = replay.capture_moe_entry_decode(model, seqs, plens, "nvfp4_minite", [layer],
                                          pad_id=task.pad_id, backend="auto")[layer]
    k = int(model.config.num_experts_per_tok)
    assert [d["moe_in"].shape[0] for d in dec] == [len(s) - 1 for s in seqs]
    assert [d["fc1_out"].shape[0] for d in dec] == [k * (len(s) - 1) for s in seqs]
    rows, skipped = replay.moe_replay(model, seqs, [Condition("nvfp4_minite", "nvfp4_minite")],
                                      layers=[layer], batch_size=4, pad_id=task.pad_id,
                                      backend="auto", prompt_lens=plens, sampler_side="decode")
    assert skipped == [] and rows[0]["sampler_side"] == "decode" and rows[0]["assignments_fixed"]
    with pytest.raises(InputError, match="sampler side"):
        replay.moe_replay(model, seqs, [], layers=[layer], batch_size=4, pad_id=task.pad_id,
                          backend="auto", sampler_side="prefill")
