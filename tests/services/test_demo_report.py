"""Pins the demo's summary over seeds (alignd.tools.demo.report): each number is the mean over
seeds with its Student t interval, the gain is paired per seed, the table prints mean ± half-width
and the figure draws one band per configuration."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from alignd.tools.demo.report import (
    SEED_METRICS,
    aggregate,
    moving_average,
    plot_demo,
    smoothing_window,
    summary_table,
)
from rich.console import Console

from libalign.metrics import mean_interval, t_quantile

STAGES = {"publish": 0.01, "convert": 0.02, "load": 0.05, "rollout": 0.3, "score": 0.1,
          "train": 0.2}


def _run(name: str, seed: int, first: float, last: float, delta: float, steps: int = 8) -> dict:
    rewards = [first + (last - first) * i / (steps - 1) for i in range(steps)]
    summary = {"reward_first_quarter": first, "reward_last_quarter": last,
               "reward_gain": last - first, "mean_abs_delta": delta, "p99_abs_delta": 10 * delta,
               "clip_potential": 0.001 * seed, "tis_truncated_fraction": None if name == "bf16"
               else 0.0, "seconds_per_step": 0.7, "seconds_by_stage": STAGES, "tokens": 100}
    return {"name": name, "sampler_path": name, "learner_path": name, "tis": name != "bf16",
            "seed": seed, "objective": {"tis_cap": 2.0},
            "steps": [{"step": i, "reward": r, "mean_abs_delta": delta * (1 + 0.1 * i)}
                      for i, r in enumerate(rewards)],
            "summary": summary}


def _report(runs, seeds) -> dict:
    return {"configs": runs, "summary": aggregate(runs),
            "options": {"steps": len(runs[0]["steps"]), "seeds": seeds, "prompts_per_step": 8,
                        "samples_per_prompt": 8, "tis_cap": 2.0, "ppo_clip_eps": None,
                        "ppo_epochs": 1, "max_version_diff": None}}


def test_aggregate_gives_each_number_over_seeds_with_its_t_interval():
    """Three seeds: the mean and mean ± t(0.95, 2)·s/√3 of each summary number, per
    configuration in order of first appearance; a number no seed has is None; the last-quarter
    reward against bf16 is paired by seed."""
    runs = [_run("bf16", s, 0.4 + 0.05 * s, 0.6 + 0.1 * s, 1e-3) for s in range(3)]
    runs += [_run("nvfp4_naive", s, 0.4, 0.5 + 0.02 * s, 5e-3 * (s + 1)) for s in range(3)]
    (bf16, naive) = aggregate(runs)
    assert [bf16["name"], naive["name"]] == ["bf16", "nvfp4_naive"]
    assert bf16["seeds"] == [0, 1, 2] and set(SEED_METRICS) <= set(bf16)
    last = [0.6, 0.7, 0.8]
    want = mean_interval(last)
    assert bf16["reward_last_quarter"] == want.to_dict()
    half = t_quantile(0.95, 2) * 0.1 / math.sqrt(3)
    assert bf16["reward_last_quarter"]["high"] == pytest.approx(0.7 + half, rel=1e-12)
    assert bf16["tis_truncated_fraction"] is None and naive["tis_truncated_fraction"]["n"] == 3
    gain = naive["reward_gain"]
    assert gain["estimate"] == pytest.approx(0.12) and gain["low"] < gain["estimate"] < gain["high"]
    assert naive["seconds_by_stage"]["train"] == pytest.approx(0.2)
    price = naive["reward_vs_bf16"]  # paired per seed: [0.5 - 0.6, 0.52 - 0.7, 0.54 - 0.8]
    assert price == mean_interval([0.5 - 0.6, 0.52 - 0.7, 0.54 - 0.8]).to_dict()
    assert bf16["reward_vs_bf16"] is None


def test_one_seed_has_no_interval():
    """One seed: the value, no bounds; the table prints the value alone."""
    runs = [_run("bf16", 0, 0.4, 0.6, 1e-3)]
    (c,) = aggregate(runs)
    assert c["reward_last_quarter"]["estimate"] == 0.6 and c["reward_last_quarter"]["low"] is None
    text = _table_text(_report(runs, 1))
    assert "one seed, no interval" in text and "±" not in text and "0.600" in text


def _table_text(report) -> str:
    console = Console(width=220, record=True)
    console.print(summary_table(report))
    return " ".join(console.export_text().split())


def test_table_prints_mean_plus_minus_half_width():
    """Several seeds: 'mean ± half-width' cells, the seed count and the interval named in the
    caption, TIS as cap (truncated share), 'no' without TIS."""
    runs = [_run("bf16", s, 0.4, 0.6 + 0.1 * s, 1e-3) for s in range(3)]
    runs += [_run("nvfp4_naive_notis", s, 0.4, 0.5, 4e-3) for s in range(3)]
    runs[-1]["tis"] = False
    runs[-2]["tis"] = runs[-3]["tis"] = False
    report = _report(runs, 3)
    text = _table_text(report)
    half = report["summary"][0]["reward_last_quarter"]["high"] - 0.7
    assert f"0.700 ± {half:.3f}" in text
    assert "95 % Student t interval over 3 seeds" in text
    assert "nvfp4_naive_notis" in text and text.count(" no ") >= 2


def test_smoothing_window_is_odd_and_at_most_21():
    """A quarter of the steps rounded down to odd, between 1 and 21 (the paper's window)."""
    assert [smoothing_window(n) for n in (1, 2, 4, 8, 12, 30, 84, 120, 1000)] == \
        [1, 1, 1, 1, 3, 7, 21, 21, 21]
    assert moving_average([0, 3, 6], 3).tolist() == [1.5, 3.0, 4.5]


def test_figure_draws_mean_curves_with_bands(tmp_path):
    """Two configurations over two seeds: a PNG with a band per configuration and panel."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = [_run(n, s, 0.3 + 0.1 * s, 0.7, 1e-3 * (s + 1)) for n in ("bf16", "nvfp4_naive")
            for s in range(2)]
    made = []
    real = plt.Axes.fill_between

    def spy(ax, *a, **k):
        made.append(ax)
        return real(ax, *a, **k)

    plt.Axes.fill_between = spy
    try:
        path = plot_demo(_report(runs, 2), tmp_path / "demo.png")
    finally:
        plt.Axes.fill_between = real
    assert path.stat().st_size > 1000 and len(made) == 4


@pytest.mark.parametrize("flags,profile", [([], "default"), (["--full"], "full"),
                                           (["--full", "--steps", "3", "--seeds", "2",
                                             "--configs", "bf16"], "explicit")])
def test_cli_default_and_full_profiles(monkeypatch, tmp_path, flags, profile):
    """alignd demo runs DEFAULT_CONFIGS with DEFAULT_RUN's steps and seeds; --full every
    configuration with FULL_RUN's; explicit --steps/--seeds/--configs win over either; both
    sample DemoConfig's 16 prompts x 4 rollouts a step; the table and the wall time are
    printed."""
    from alignd.tools import cli
    from alignd.tools.demo import run as demo_run
    from typer.testing import CliRunner

    seen = {}

    def fake_run_demo(cfg, *, on_step=None, metrics=None):
        seen["cfg"] = cfg
        runs = [_run(n, s, 0.5, 0.6, 1e-3) for n in cfg.configs for s in range(cfg.seeds)]
        report = _report(runs, cfg.seeds)
        report["outputs"] = {"report": "r.json", "figure": "f.png"}
        return report

    monkeypatch.setattr(demo_run, "run_demo", fake_run_demo)
    res = CliRunner().invoke(cli.app, ["demo", "--no-api", "--out", str(tmp_path), *flags],
                             terminal_width=200)
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    want = {"default": (demo_run.DEFAULT_CONFIGS, demo_run.DEFAULT_RUN),
            "full": (tuple(demo_run.CONFIGS), demo_run.FULL_RUN),
            "explicit": (("bf16",), {"steps": 3, "seeds": 2})}[profile]
    assert (cfg.configs, {"steps": cfg.steps, "seeds": cfg.seeds}) == want
    assert (cfg.prompts_per_step, cfg.samples_per_prompt) == (16, 4)  # DemoConfig's
    assert "wall time" in res.output and "reward last 1/4" in res.output
    assert set(demo_run.DEFAULT_CONFIGS) <= set(demo_run.CONFIGS)
    assert "nvfp4_naive_notis" in demo_run.DEFAULT_CONFIGS
