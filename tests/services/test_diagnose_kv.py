"""Pins the KV share of ``alignd diagnose`` (``--kv-formats``): on the shared tokens, δ of the
aligned pair with the sampler's FP4 K/V against the same run with BF16 K/V (paired intervals),
with KV guidance off and on, in the report's JSON and tables."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from alignclient.errors import SpecError
from alignd.tools.diagnose import render
from alignd.tools.diagnose.kv import GUIDE_OFF, GUIDE_ON, LEARNER_BF16
from alignd.tools.diagnose.run import DiagnoseConfig, run_diagnosis
from rich.console import Console

FORMATS = ("kv_sglang_nvfp4", "kv_sglang_fp4_mx_block16")


@pytest.fixture(scope="module")
def report():
    cfg = DiagnoseConfig(model="tiny-random", num_prompts=8, batch_size=4, n_boot=50,
                         layers="none", replay_layers="none", context_swap=False,
                         on_policy=False, conditions="nvfp4_minite/nvfp4_minite",
                         kv_formats=",".join(FORMATS))
    return run_diagnosis(cfg)


def test_rows_are_paired_against_bf16_kv(report):
    """Each format has the three FP4 rows, each with a paired interval against BF16 K/V; the
    baseline is the diagnosis' own nvfp4_minite/nvfp4_minite δ on the same tokens."""
    kv = report["kv"]
    pair = next(c for c in report["conditions"] if c["name"] == "nvfp4_minite/nvfp4_minite")
    assert kv["bf16_kv"]["delta"] == pair["shared"]["delta"]
    assert list(kv["formats"]) == list(FORMATS)
    for name, f in kv["formats"].items():
        assert [r["name"] for r in f["rows"]] == [LEARNER_BF16, GUIDE_OFF, GUIDE_ON]
        assert f["scales"] == ("default" if name == "kv_sglang_nvfp4" else None)
        assert f["sampler_shift_p99_abs"] > 0 and f["record_bytes_per_token"] > 0
        for r in f["rows"]:
            ci = r["vs_bf16_kv"]["p99_abs_diff"]
            assert ci["low"] <= ci["estimate"] <= ci["high"]
            assert r["vs_bf16_kv"]["widens_tail"] in ("yes", "no", "inconclusive")


def test_guidance_takes_back_the_kv_share(report):
    """Guidance on makes the learner's K/V codes the sampler's nearly everywhere (far fewer
    mismatches than rounding to nearest) and narrows the δ tail against guidance off."""
    for f in report["kv"]["formats"].values():
        rows = {r["name"]: r for r in f["rows"]}
        assert rows[LEARNER_BF16]["kv_code_mismatch"] is None
        assert rows[GUIDE_ON]["kv_code_mismatch"] < rows[GUIDE_OFF]["kv_code_mismatch"] / 10
        on_off = rows[GUIDE_ON]["vs_guidance_off"]["p99_abs_diff"]
        assert on_off["estimate"] < 0
        assert rows[GUIDE_OFF]["shared"]["delta"]["p99_abs"] < \
            rows[LEARNER_BF16]["shared"]["delta"]["p99_abs"]


def test_tables_and_json_show_the_kv_share(report):
    """The console report has the KV table and the guidance on − off line; JSON round-trips."""
    console = Console(record=True, width=220)
    render.render_report(report, console)
    text = console.export_text()
    assert "FP4 KV cache's share of δ" in text and "guidance on − off" in text
    assert json.loads(render.to_json(report))["kv"]["pair"] == "nvfp4_minite/nvfp4_minite"


def test_unknown_kv_format_is_refused_by_name():
    """An unknown --kv-formats entry is a SpecError naming it, before any model is loaded."""
    with pytest.raises(SpecError, match="kv_fp3"):
        run_diagnosis(DiagnoseConfig(model="tiny-random", kv_formats="kv_nvfp4,kv_fp3"))
