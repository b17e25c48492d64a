"""Pins ``alignd diagnose``: conditions, input validation, the sampler replay, the statistics and the CLI.

Fast tests run a tiny random-weight Qwen3-MoE (``--model tiny-random``) on a handful of prompts;
the run on the trained tiny model is marked slow.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from alignclient.errors import InputError, NonFiniteError, SpecError
from alignd.tools.cli import app
from alignd.tools.diagnose import inputs, localize, sides, stats
from alignd.tools.diagnose.conditions import (
    DEFAULT_CONDITIONS,
    EXTERNAL,
    LIBALIGN_CONDITIONS,
    Condition,
    parse_condition,
    parse_layers,
    resolve_conditions,
)
from alignd.tools.diagnose.run import DiagnoseConfig, run_diagnosis, write_outputs
from typer.testing import CliRunner

from libalign import metrics, models
from libalign.models.teacher_forcing import replay_decode

# One torch thread (the run itself picks one for the tiny models, but not for a --checkpoint
# directory nor for the sides called directly here): the tiny matrices gain nothing from more.
pytestmark = pytest.mark.usefixtures("one_thread")

runner = CliRunner()
SMALL = ["--model", "tiny-random", "--num-prompts", "8", "--batch-size", "4", "--n-boot", "50",
         "--localize-sequences", "4", "--layers", "0,3", "--replay-layers", "3", "--quiet"]


@pytest.fixture(scope="module")
def tiny():
    task = models.SyntheticTask()
    return models.build_model(models.tiny_config(), seed=0), task


@pytest.fixture(scope="module")
def small_report():
    cfg = DiagnoseConfig(model="tiny-random", num_prompts=12, batch_size=4, n_boot=100,
                         localize_sequences=8, layers="0,3", replay_layers="0,3", pairs="libalign")
    return run_diagnosis(cfg)


# --- conditions -------------------------------------------------------------------------------

def test_default_conditions_start_with_the_floor():
    """The defaults are the four miniTE conditions, floor first."""
    conds, floor = resolve_conditions()
    assert [c.name for c in conds] == list(DEFAULT_CONDITIONS)
    assert floor == Condition("bf16", "bf16") and conds[0] == floor


def test_unknown_path_names_the_path_and_condition():
    """An unknown path is a SpecError naming it and where it came from."""
    with pytest.raises(SpecError, match=r"'bf16/fp8'.*unknown execution path 'fp8'"):
        parse_condition("bf16/fp8")
    with pytest.raises(SpecError, match=r"--learner-paths.*'nvfp5'"):
        resolve_conditions(learner_paths="nvfp5")
    with pytest.raises(InputError, match="learner/sampler"):
        parse_condition("bf16")


def test_path_lists_cross_and_floor_is_added():
    """--learner-paths × --sampler-paths, with the floor prepended; external adds L/external."""
    conds, _ = resolve_conditions(learner_paths="nvfp4_minite", sampler_paths="nvfp4_naive,nvfp4_minite")
    assert [c.name for c in conds] == ["bf16/bf16", "nvfp4_minite/nvfp4_naive",
                                       "nvfp4_minite/nvfp4_minite"]
    conds, _ = resolve_conditions("bf16/nvfp4_naive", external=True)
    assert Condition("bf16", EXTERNAL) in conds


def test_layer_lists():
    """all / none / negative indices; out of range names the option."""
    assert parse_layers("all", 4, "--layers") == [0, 1, 2, 3]
    assert parse_layers("none", 4, "--layers") == []
    assert parse_layers("0,-1", 4, "--replay-layers") == [0, 3]
    with pytest.raises(InputError, match="--layers: layer 7"):
        parse_layers("7", 4, "--layers")


# --- inputs -----------------------------------------------------------------------------------

def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_prompt_file_text_and_tokens(tmp_path):
    """Text prompts go through the encoder, token prompts are range-checked."""
    task = models.SyntheticTask()
    text = task.decode(task.prompt_ids(12, 3))
    p = _write(tmp_path, "p.jsonl", [json.dumps({"prompt": text}), '{"tokens": [1, 4, 13, 5, 14]}'])
    got = inputs.load_prompts(p, encode=task.encode, vocab_size=task.vocab_size)
    assert got[0] == task.prompt_ids(12, 3) and got[1] == [1, 4, 13, 5, 14]


@pytest.mark.parametrize(("line", "match"), [
    ('{"prompt": "  "}', r"prompt 1\).*empty"),
    ('{"tokens": []}', r"prompt 1\).*empty"),
    ('{"tokens": [1, 99]}', r"prompt 1\).*token id 99 at position 1"),
    ('{"prompt": "x", "tokens": [1]}', "exactly one"),
])
def test_bad_prompt_names_the_item(tmp_path, line, match):
    """Empty prompts and out-of-vocabulary ids are errors naming the prompt."""
    task = models.SyntheticTask()
    p = _write(tmp_path, "p.jsonl", ['{"tokens": [1, 4]}', line])
    with pytest.raises(InputError, match=match):
        inputs.load_prompts(p, encode=task.encode, vocab_size=task.vocab_size)


@pytest.mark.parametrize(("record", "err", "match"), [
    ({"tokens": [1, 4, 5], "prompt_len": 2, "sampler_logprobs": [-0.1, -0.2]}, InputError,
     r"sequence 1\).*2 sampler log-probs for 1 completion"),
    ({"tokens": [1, 4, 5], "prompt_len": 2, "sampler_logprobs": [float("nan")]}, NonFiniteError,
     r"sequence 1\).*nan"),
    ({"tokens": [1, 4, 5], "prompt_len": 0, "sampler_logprobs": [-0.1]}, InputError,
     r"sequence 1\).*prompt is empty"),
    ({"tokens": [1, 4], "prompt_len": 2, "sampler_logprobs": []}, InputError,
     r"sequence 1\).*no completion tokens"),
    ({"tokens": [1, 4, 5], "prompt_len": 2, "sampler_logprobs": [0.5]}, InputError, "above 0"),
])
def test_bad_sequence_names_the_item(tmp_path, record, err, match):
    """Length mismatches, NaN, empty prompts or completions: typed errors naming the sequence."""
    good = {"tokens": [1, 4, 5, 6], "prompt_len": 2, "sampler_logprobs": [-0.1, -0.3]}
    p = _write(tmp_path, "s.jsonl", [json.dumps(good), json.dumps(record)])
    with pytest.raises(err, match=match):
        inputs.load_sequences(p, vocab_size=15)


def test_sides_must_hold_identical_tokens():
    """Two sides with different tokens or lengths are refused, naming sequence and position."""
    with pytest.raises(InputError, match="sequence 1 differs at position 2"):
        inputs.check_same_tokens("c", [[1, 2], [1, 2, 3]], [[1, 2], [1, 2, 4]], [1, 1], [1, 1])
    with pytest.raises(InputError, match="sequence 0 has 2 tokens on one side and 3"):
        inputs.check_same_tokens("c", [[1, 2]], [[1, 2, 3]], [1], [1])
    with pytest.raises(InputError, match=r"learner log-probs of sequence 1 have shape \(2,\)"):
        inputs.check_side_logprobs("c", "learner", [torch.zeros(1), torch.zeros(2)], [1, 3])
    with pytest.raises(NonFiniteError, match="sampler log-probs of sequence 0"):
        inputs.check_side_logprobs("c", "sampler", [torch.tensor([float("nan")])], [1])


# --- the sides --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["bf16", "nvfp4_naive"])
def test_replay_decode_reproduces_the_generator(tiny, path):
    """Teacher-forcing the generator's own tokens through the decode gives its log-probs bit for bit."""
    model, task = tiny
    prompts = task.prompts(6, seed=3)
    g = sides.sample(model, prompts, path, max_new_tokens=5, temperature=1.0, seed=1, batch_size=3,
                     eos_id=task.eos_id, pad_id=task.pad_id, backend="auto")
    r = replay_decode(model, g.sequences, g.prompt_lens, path, batch_size=3, pad_id=task.pad_id,
                            backend="auto")
    assert all(torch.equal(a, b) for a, b in zip(r, g.logprobs, strict=True))


def test_l2_pool_matches_metrics():
    """Pooled sums over batches give metrics.symmetric_relative_l2 of the concatenation."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 8, generator=g) for _ in range(3)]
    ys = [x + 0.1 * torch.randn(5, 8, generator=g) for x in xs]
    pool = localize.L2Pool("t")
    for x, y in zip(xs, ys, strict=True):
        pool.add(x, y)
    want = float(metrics.symmetric_relative_l2(torch.cat(xs), torch.cat(ys)))
    assert math.isclose(pool.symmetric(), want, rel_tol=1e-12)
    zero = localize.L2Pool("z")
    zero.add(torch.zeros(2, 2), torch.zeros(2, 2))
    assert zero.symmetric() == 0.0


def test_per_sequence_relative_l2_matches_metrics():
    """The vectorized per-sequence R(x, ref) equals metrics.relative_l2 on each sequence's rows."""
    g = torch.Generator().manual_seed(2)
    x, ref = torch.randn(10, 4, generator=g), torch.randn(10, 4, generator=g)
    ref[7:9] = 0.0
    x[7:9] = 0.0
    seq = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 4])
    got = localize.per_sequence_relative_l2(x, ref, seq, 5)
    want = [float(metrics.relative_l2(x[seq == i], ref[seq == i])) for i in (0, 2, 3, 4)]
    assert got == pytest.approx(want, rel=1e-12) and got[2] == 0.0


# --- statistics -------------------------------------------------------------------------------

def test_verdicts_follow_the_paired_interval():
    """A uniformly wider δ widens the tail; identical δ is inconclusive; narrower is no."""
    g = torch.Generator().manual_seed(1)
    floor = [0.01 * torch.randn(20, generator=g, dtype=torch.float64) for _ in range(30)]
    wide = [3 * d for d in floor]
    opts = stats.StatOptions(n_boot=200)
    assert stats.compare(wide, floor, opts)["widens_tail"] == "yes"
    assert stats.compare(floor, floor, opts)["widens_tail"] == "inconclusive"
    assert stats.compare(floor, wide, opts)["widens_tail"] == "no"


# --- the whole run ----------------------------------------------------------------------------

def test_report_structure(small_report):
    """Every condition has statistics with CIs; non-floor ones a paired comparison to the floor."""
    r = small_report
    names = [c["name"] for c in r["conditions"]]
    assert names == list(LIBALIGN_CONDITIONS) and r["floor"] == "bf16/bf16"
    for c in r["conditions"]:
        s = c["shared"]
        assert s["delta"]["count"] == r["sequences"]["completion_tokens"]
        assert set(s["ci"]) == {"p99_abs", "clip_potential"}
        assert ("vs_floor" in s) == (c["name"] != "bf16/bf16")
        assert c["on_policy"]["delta"]["count"] > 0
    assert r["sequences"]["replay_consistency"]["bitwise"]
    assert {row["condition"] for row in r["layers"]} == {"bf16/nvfp4_naive", "bf16/nvfp4_minite"}
    for row in r["layers"]:
        assert row["conditioned"]["set_match"] == 1.0
        assert 0 < row["natural"]["fc1_rel_l2"] < 2
    assert all(row["replay_reproduces_capture"] for row in r["replay"])
    layer0 = next(row for row in r["replay"] if row["layer"] == 0)
    assert layer0["input_drift"] == 0.0 and layer0["fc1"]["input_swap_learner"] == 0.0
    assert r["timings_seconds"]["total"] > 0


def test_trace_condition_reports_guidance(small_report):
    """nvfp4_trace/nvfp4_minite: records of the minite replay, sizes, and code agreement per site."""
    r = small_report
    g = r["guidance"]
    assert g["bits"] == 1 and g["layers"] == [0, 1, 2, 3]
    s = g["by_sampler"]["nvfp4_minite"]
    assert s["records"] == r["sequences"]["count"]
    assert 0 < s["bytes_per_token"] < s["bytes_per_token_full_codes"]
    sites = {(row["layer"], row["site"]) for row in s["agreement"]}
    assert sites == {(layer, site) for layer in range(4) for site in ("fc1", "fc2")}
    for row in s["agreement"]:
        assert row["mismatch_after"] <= row["mismatch_before"]
        assert 0 < row["rows_with_record"] <= 1
    trace = next(c for c in r["conditions"] if c["name"] == "nvfp4_trace/nvfp4_minite")
    aligned = next(c for c in r["conditions"] if c["name"] == "nvfp4_minite/nvfp4_minite")
    assert trace["shared"]["delta"]["mean_abs"] < aligned["shared"]["delta"]["mean_abs"]
    assert r["localization"]["skipped_guided"] == ["nvfp4_trace/nvfp4_minite"]


def test_trace_needs_a_row_scaled_sampler():
    """A guided learner against the per-tensor sampler is refused before the model loads."""
    with pytest.raises(SpecError, match="nvfp4_trace needs a sampler that records row-scaled"):
        run_diagnosis(DiagnoseConfig(model="tiny-random", conditions="nvfp4_trace/nvfp4_naive"))


def test_context_swap_minite_passes_naive_fails(small_report):
    """Row-scaled NVFP4 gives the target the same bits in every batch; per-tensor does not."""
    cs = small_report["context_swap"]["paths"]
    assert cs["nvfp4_minite"]["pass"] and not cs["nvfp4_naive"]["pass"]
    q = small_report["context_swap"]["quantizer_level"]
    assert q["nvfp4_minite"]["independent"] and not q["nvfp4_naive"]["independent"]


def test_outputs_written(small_report, tmp_path):
    """report.json parses back and the three PNGs exist."""
    made = write_outputs(dict(small_report), tmp_path / "out")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["conditions"][1]["shared"]["vs_floor"]["widens_tail"] in ("yes", "no", "inconclusive")
    for name in ("tail", "layers", "replay"):
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 1000, made


# --- the command line -------------------------------------------------------------------------

def test_cli_json(tmp_path):
    """alignd diagnose --json prints the report JSON only."""
    res = runner.invoke(app, ["diagnose", *SMALL, "--no-on-policy", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["config"]["num_prompts"] == 8 and not data["config"]["on_policy"]


def test_cli_tables_and_out(tmp_path):
    """Without --json the tables are printed and --out receives the report."""
    res = runner.invoke(app, ["diagnose", *SMALL, "--conditions", "bf16/nvfp4_minite",
                              "--no-context-swap", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "bf16/nvfp4_minite" in res.stdout and "widens the tail" in res.stdout
    assert (tmp_path / "o" / "report.json").is_file()


@pytest.mark.parametrize(("args", "match"), [
    (["--conditions", "bf16/nvfp9"], "SpecError: condition 'bf16/nvfp9' (sampler): unknown execution "
     "path 'nvfp9'"),
    (["--layers", "9"], "--layers: layer 9 is out of range"),
    (["--model", "gpt"], "unknown --model 'gpt'"),
    (["--trace-bits", "5"], "--trace-bits must be one of (1, 2, 3, 4), got 5"),
    (["--trace-layers", "0"], "--trace-layers must be at least 1, got 0"),
])
def test_cli_bad_options_exit_2(args, match):
    """Bad options exit 2 with one line naming the item, no traceback."""
    res = runner.invoke(app, ["diagnose", *SMALL, *args])
    assert res.exit_code == 2
    assert match in res.stderr and "Traceback" not in res.output
    assert len(res.stderr.strip().splitlines()) == 1


def test_cli_bad_sequences_exit_2(tmp_path):
    """A NaN sampler log-prob in a sequences file: exit 2, the message names the sequence."""
    lines = [json.dumps({"tokens": [1, 4, 13, 5, 14, 9, 2], "prompt_len": 5,
                         "sampler_logprobs": [-0.1, -0.2]}),
             '{"tokens": [1, 4, 13, 5, 14, 9, 2], "prompt_len": 5, "sampler_logprobs": [-0.1, NaN]}']
    p = _write(tmp_path, "s.jsonl", lines)
    res = runner.invoke(app, ["diagnose", *SMALL, "--sequences", str(p)])
    assert res.exit_code == 2
    assert "sequence 1" in res.stderr and "NonFiniteError" in res.stderr


def test_cli_sequences_file_with_external_sampler(tmp_path):
    """A sequences file with sampler log-probs adds learner/external conditions."""
    task = models.SyntheticTask()
    lines = []
    for p in task.prompts(6, seed=5):
        ans = task.answer_ids(p)
        lines.append(json.dumps({"tokens": p + ans, "prompt_len": len(p),
                                 "sampler_logprobs": [-0.5] * len(ans)}))
    path = _write(tmp_path, "s.jsonl", lines)
    res = runner.invoke(app, ["diagnose", *SMALL, "--sequences", str(path), "--conditions",
                              "bf16/nvfp4_minite", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [c["name"] for c in data["conditions"]] == ["bf16/bf16", "bf16/nvfp4_minite", "bf16/external"]
    assert data["sequences"]["count"] == 6


def test_cli_checkpoint_dir(tiny, tmp_path):
    """--checkpoint loads a Hugging Face directory; without a tokenizer prompts are random ids."""
    model, _ = tiny
    model.save_pretrained(tmp_path / "ckpt")
    res = runner.invoke(app, ["diagnose", *SMALL, "--checkpoint", str(tmp_path / "ckpt"), "--prompt-len",
                              "6", "--max-new-tokens", "3", "--conditions", "bf16/nvfp4_naive", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["model"]["source"] == str(tmp_path / "ckpt")
    assert data["sequences"]["prompt_source"].startswith("random token ids")
    res = runner.invoke(app, ["diagnose", *SMALL, "--checkpoint", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no config.json" in res.stderr


@pytest.mark.slow
def test_trained_tiny_model_default_run(tmp_path):
    """The default diagnosis on the trained tiny model (trains once, cached): minite passes the
    context swap, naive fails, and every NVFP4 condition gets a verdict."""
    cfg = DiagnoseConfig(num_prompts=128, n_boot=200, localize_sequences=32, pairs="libalign")
    r = run_diagnosis(cfg)
    cs = r["context_swap"]["paths"]
    assert cs["nvfp4_minite"]["pass"] and not cs["nvfp4_naive"]["pass"]
    for c in r["conditions"][1:]:
        assert c["shared"]["vs_floor"]["widens_tail"] in ("yes", "no", "inconclusive")


def test_routing_disagreement_with_and_without_replay(small_report):
    """Every non-guided condition reports its routing disagreement without replay and under R3
    (before forcing), over the same decisions; an NVFP4 sampler moves the bf16 learner's
    routing more than the cross-stack floor does (which is not zero on this random model:
    near-tied router scores), and where learner and sampler run the same path R3 narrows mean
    |δ| (against an NVFP4 sampler a bf16 learner's gap is its arithmetic, which R3 leaves)."""
    from alignd.tools.diagnose.routing import routing_table
    from rich.console import Console

    r = small_report
    section = r["routing_replay"]
    rows = {row["name"]: row for row in section["rows"]}
    assert set(rows) | set(section["skipped"]) == {c["name"] for c in r["conditions"]}
    for row in rows.values():
        assert row["without"]["decisions"] == row["r3"]["decisions"] > 0
    floor = rows["bf16/bf16"]["without"]["disagreement"]
    for name in ("bf16/nvfp4_naive", "bf16/nvfp4_minite"):
        assert rows[name]["without"]["disagreement"] > floor  # NVFP4 moves routing
    for name in ("bf16/bf16", "nvfp4_minite/nvfp4_minite"):  # same arithmetic on both sides:
        row = rows[name]  # the routing flips are the cross-stack floor's, and R3 removes them
        assert row["without"]["disagreement"] > 0
        assert row["r3"]["mean_abs"] < row["without"]["mean_abs"]
    console = Console(width=200, record=True)
    console.print(routing_table(r))
    assert "routing replay (R3)" in console.export_text()


def test_report_localizes_same_path_pairs_against_the_decode(small_report):
    """The same-path pairs the forward localization skips are measured against the decode, and
    the FC1 context swap keeps row-scaled targets bitwise while the per-tensor path moves."""
    dec = {r["condition"] for r in small_report["decode_localization"]["rows"]}
    assert set(small_report["localization"]["skipped_same_path"]) <= dec
    fc1 = small_report["fc1_context_swap"]
    assert fc1["independent"]["nvfp4_minite"] and not fc1["independent"]["nvfp4_naive"]
    assert fc1["input_shape"] == [128, 128] and len(fc1["cases"]) == 3
