"""Pins the alignd command line: the demo main job, the self-check and the preset table."""

import json
import signal

import pytest
from alignd.infra.work import sampling_seed
from alignd.tools.cli import app
from typer.testing import CliRunner

from libalign.selfcheck import run_selfcheck

runner = CliRunner()


def test_selfcheck_all_pass():
    """Every self-check passes on this build."""
    results = run_selfcheck()
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]


def test_selfcheck_says_which_kernel_serves_each_device():
    """alignd selfcheck names the backend of each device; a spec fallback shows with its reason."""
    res = runner.invoke(app, ["selfcheck"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "quantize kernels" in res.output and "compiled C++ kernel" in res.output
    res = runner.invoke(app, ["selfcheck"], env={"ALIGN_KERNELS": "spec"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "spec (fallback)" in res.output and "ALIGN_KERNELS=spec" in res.output


def test_demo_runs_every_configuration_through_the_services(tmp_path):
    """alignd demo: self-check, then RL steps per configuration, a summary table and a figure."""
    res = runner.invoke(app, ["demo", "--steps", "2", "--seeds", "1",
                              "--configs", "bf16,nvfp4_trace",
                              "--prompts-per-step", "2", "--samples-per-prompt", "2", "--no-api",
                              "--out", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    assert "self-check" in res.output and "alignd demo" in res.output
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert [c["name"] for c in report["configs"]] == ["bf16", "nvfp4_trace"]
    for c in report["configs"]:
        assert len(c["steps"]) == 2 and c["summary"]["tokens"] > 0
    assert (tmp_path / "demo" / "demo.png").stat().st_size > 1000
    assert "wall time" in res.output


def test_demo_seeds_give_intervals_and_notis_runs_without_tis(tmp_path):
    """--seeds 2: each configuration runs with seeds 0 and 1 (the same prompts and sampling
    seeds in both configurations, other ones per seed), the summary gives every number as a
    mean with its t interval over the two seeds and the table prints mean ± half-width;
    nvfp4_naive_notis is the naive NVFP4 paths with every TIS weight 1 (none truncated)."""
    res = runner.invoke(app, ["demo", "--steps", "2", "--seeds", "2",
                              "--configs", "nvfp4_naive,nvfp4_naive_notis",
                              "--prompts-per-step", "2", "--samples-per-prompt", "2", "--no-api",
                              "--out", str(tmp_path / "demo")], terminal_width=200)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert [(c["name"], c["seed"]) for c in report["configs"]] == [
        ("nvfp4_naive", 0), ("nvfp4_naive", 1), ("nvfp4_naive_notis", 0),
        ("nvfp4_naive_notis", 1)]
    naive, notis = report["summary"]
    assert (naive["tis"], notis["tis"]) == (True, False) and notis["objective"]["tis"] is False
    assert notis["sampler_path"] == notis["learner_path"] == "nvfp4_naive"
    assert all(s["train"]["tis_truncated_fraction"] == 0 for c in report["configs"][2:]
               for s in c["steps"])
    for c in report["summary"]:
        ci = c["reward_last_quarter"]
        assert ci["n"] == 2 and ci["low"] <= ci["estimate"] <= ci["high"]
        values = [r["summary"]["reward_last_quarter"] for r in report["configs"]
                  if r["name"] == c["name"]]
        assert ci["estimate"] == sum(values) / 2
    assert "±" in res.output and "over 2 seeds" in " ".join(res.output.split())
    assert report["options"]["seeds"] == 2
    # seed s samples step t with sampling_seed(s, t) in every configuration: seeds differ in
    # sampling as well as in prompts (they once all sampled with the step number)
    for c in report["configs"]:
        assert [s["sampling_seed"] for s in c["steps"]] == [sampling_seed(c["seed"], t)
                                                           for t in range(2)]
    assert len({s["sampling_seed"] for c in report["configs"] for s in c["steps"]}) == 4


def test_demo_refuses_unknown_configuration(tmp_path):
    """An unknown configuration exits 2 naming it."""
    res = runner.invoke(app, ["demo", "--configs", "fp8", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "fp8" in res.output


def test_presets_json_lists_every_field():
    """alignd presets --json gives each preset's full spec."""
    res = runner.invoke(app, ["presets", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["minite"]["outer_domain"] == "row"
    assert data["compressed_tensors"]["scale_math_dtype"] == "input"


def test_guidance_size_default_and_config(tmp_path):
    """alignd guidance-size prints bytes per token at 1, 2 and 4 bits and TRACE's accounting."""
    from alignd.tools.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    res = runner.invoke(app, ["guidance-size"])
    assert res.exit_code == 0, res.output
    assert "77952" in res.output and "225408" in res.output  # Qwen3-30B-A3B, 48 layers, fc1+fc2
    assert "50.6 KiB per token" in res.output
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 4, "hidden_size": 64, "moe_intermediate_size": 32, '
                   '"num_experts_per_tok": 2, "mlp_only_layers": [0]}')
    res = runner.invoke(app, ["guidance-size", "--config", str(cfg), "--last-layers", "2",
                              "--sites", "fc1"])
    assert res.exit_code == 0, res.output
    # 2 layers x (64 values x 1 bit / 8 + 64 / 16 scales + 4 row scale + 4 index) = 40 B
    assert " 40 " in res.output
    # TRACE's accounting for the given config too: 3 MoE layers x (64 + 0 KV values) x 4.5 bits
    flat = " ".join(res.output.split())  # rich wraps long lines
    assert "TRACE's accounting for the paper's 35B MoE (D1 2048, D2 256, 40 MoE" in flat
    assert "(D1 64, D2 0, 3 MoE layers, 4.5 bits a value): 0.1 KiB activations" in flat
    res = runner.invoke(app, ["guidance-size", "--config", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "FileNotFoundError" in res.output


def test_guidance_size_counts_routing_records_of_every_moe_layer(tmp_path):
    """--routing adds R3's record of every MoE layer whatever --last-layers says (ids: one
    byte each up to 256 experts, two above; weights: two more bytes an id), into the total;
    an unknown mode exits 2 naming it."""
    from alignd.tools.cli import app
    from typer.testing import CliRunner

    from libalign.guidance.sizes import size_for_config

    runner = CliRunner()
    res = runner.invoke(app, ["guidance-size", "--routing", "weights"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "1152" in res.output and "79104" in res.output  # 48 x 8 x (1 + 2) B; 77952 + 1152
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "moe_intermediate_size": 32,
           "num_experts_per_tok": 2, "mlp_only_layers": [0], "num_experts": 300}
    base = size_for_config(cfg, bits=1, last_layers=1)
    ids = size_for_config(cfg, bits=1, last_layers=1, routing="ids")
    weights = size_for_config(cfg, bits=1, last_layers=1, routing="weights")
    assert base["routing"] == 0
    assert ids["routing"] == 3 * 2 * 2 and weights["routing"] == 3 * 2 * 4   # 3 MoE layers
    assert ids["total"] - base["total"] == ids["routing"]
    res = runner.invoke(app, ["guidance-size", "--routing", "experts"])
    assert res.exit_code == 2 and "experts" in res.output


def test_status_reads_a_running_api(tmp_path):
    """alignd status renders /v1/status of a live API; an unreachable one exits 2."""
    from alignd.infra.settings import ApiSettings
    from alignd.tools.in_process import ApiThread

    settings = ApiSettings(store_dir=tmp_path / "store", dev_mode=True, api_port=0)
    with ApiThread(settings) as url:
        assert url
        res = runner.invoke(app, ["status", "--url", url])
        assert res.exit_code == 0, res.output
        assert "services" in res.output and "api" in res.output
        res = runner.invoke(app, ["status", "--url", url, "--json"])
        assert res.exit_code == 0 and json.loads(res.output)["versions_by_state"] is not None
    res = runner.invoke(app, ["status", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "error" in res.output


def test_serve_refuses_unknown_service():
    """alignd serve names the services it knows."""
    res = runner.invoke(app, ["serve", "gateway"])
    assert res.exit_code == 2 and "api, converter, sampler, learner" in res.output


@pytest.mark.parametrize("service, variable, bad", [
    ("converter", "ALIGN_CONVERTER_DEVICE", "gpu"),
    ("sampler", "ALIGN_SAMPLER_ENGINE", "vllm"),
    ("learner", "ALIGN_GUIDANCE_BITS", "9"),
])
def test_serve_runs_the_service_and_refuses_bad_settings(service, variable, bad, monkeypatch,
                                                          caplog):
    """alignd serve <service> starts that service's main, which reads its own settings and
    exits 2 on a bad one, naming it, before anything starts."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setenv(variable, bad)
    try:
        res = runner.invoke(app, ["serve", service])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert res.exit_code == 2, res.output
    assert "bad settings" in caplog.text
    assert variable.removeprefix("ALIGN_").lower() in caplog.text


def test_up_runs_every_service_in_one_process(tmp_path):
    """alignd up on the embedded default: API answers, one learner step goes through, SIGTERM stops."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.services.conftest import free_port

    port = free_port()
    env = dict(os.environ, ALIGN_API_PORT=str(port), ALIGN_STORE_DIR=str(tmp_path / "store"),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ALIGN_REDIS_URL", None)
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "alignd.tools.cli", "up", "--learner-steps", "1"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while "step 0" not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            assert "step 0" in log.read_text(), log.read_text()[-3000:]
            status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()
            assert status["versions_by_state"]["serving"] >= 1
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-3000:]
