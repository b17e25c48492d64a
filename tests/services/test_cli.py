"""Pins the alignd command line: the demo main job, the self-check and the preset table."""

import json

from typer.testing import CliRunner

from libalign.selfcheck import run_selfcheck
from services.cli import app

runner = CliRunner()


def test_selfcheck_all_pass():
    """Every self-check passes on this build."""
    results = run_selfcheck()
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]


def test_demo_runs_and_reports_every_preset():
    """alignd demo exits 0 and prints the self-check and one report row per preset."""
    res = runner.invoke(app, ["demo", "--experts", "2", "--rows", "64", "--k", "128"])
    assert res.exit_code == 0, res.output
    assert "self-check" in res.output and "conversion report" in res.output
    for name in ("minite", "torchao", "modelopt", "te_row"):
        assert name in res.output


def test_presets_json_lists_every_field():
    """alignd presets --json gives each preset's full spec."""
    res = runner.invoke(app, ["presets", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["minite"]["outer_domain"] == "row"
    assert data["compressed_tensors"]["scale_math_dtype"] == "input"
