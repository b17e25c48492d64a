"""The demo's summary over seeds, its table and its figure.

Every configuration runs with the same seeds (seed ``s`` draws the same prompts and sampling
seeds in each configuration, so configurations are compared on common random numbers). Per
configuration and seed, :func:`alignd.tools.demo.run.run_demo` keeps the steps and a summary;
:func:`aggregate` then gives each summary number as the mean over seeds with its 95 % Student
t interval (:func:`libalign.metrics.mean_interval`: ``mean ± t·s/√n``; with one seed, the
value alone). The reward's gain (last quarter minus first quarter of the steps) is taken per
seed before averaging, so its interval is the paired one; so is the price of the gap,
``reward_vs_bf16``: a configuration's last-quarter reward minus ``bf16``'s with the same seed
(same prompts), when ``bf16`` ran.

The figure shows, per configuration, mean |δ| per step (log scale) and reward per step, each
a centered moving average (:func:`moving_average`, window :func:`smoothing_window`) averaged
over seeds, with the 95 % band of that mean over seeds when there are several.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.table import Table

from libalign import metrics as lm

#: summary numbers given with an interval over seeds
SEED_METRICS = ("reward_first_quarter", "reward_last_quarter", "reward_gain", "mean_abs_delta",
                "p99_abs_delta", "clip_potential", "tis_truncated_fraction",
                "routing_disagreement", "seconds_per_step")
LEVEL = 0.95
#: the configuration the paired reward difference ``reward_vs_bf16`` is taken against
REFERENCE = "bf16"


def moving_average(x: Sequence[float], window: int = 21) -> np.ndarray:
    """Centered moving average with shorter windows at the ends (``window`` odd)."""
    a = np.asarray(x, dtype=np.float64)
    half = window // 2
    return np.array([a[max(0, i - half):i + half + 1].mean() for i in range(len(a))])


def smoothing_window(steps: int) -> int:
    """The figure's moving-average window: 21 steps as in the miniTE paper's training figure,
    narrower for short runs (the odd number nearest a quarter of the steps, at least 1)."""
    quarter = max(1, steps // 4)
    return min(21, quarter if quarter % 2 else quarter - 1 or 1)


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """One entry per configuration (in order of first appearance): its paths, the seeds, and
    each of :data:`SEED_METRICS` as a :class:`~libalign.metrics.MeanInterval` dict over seeds
    (None when no seed has the number)."""
    names = list(dict.fromkeys(r["name"] for r in runs))
    ref = {r["seed"]: r["summary"]["reward_last_quarter"] for r in runs if r["name"] == REFERENCE}
    out = []
    for name in names:
        mine = [r for r in runs if r["name"] == name]
        first = mine[0]
        entry = {"name": name, "sampler_path": first["sampler_path"],
                 "learner_path": first["learner_path"], "tis": first["tis"],
                 "objective": first["objective"], "seeds": [r["seed"] for r in mine],
                 "routing_replay": first.get("routing_replay", "off")}
        for key in SEED_METRICS:
            vals = [r["summary"].get(key) for r in mine]
            vals = [v for v in vals if v is not None]
            entry[key] = lm.mean_interval(vals, LEVEL).to_dict() if vals else None
        paired = [r["summary"]["reward_last_quarter"] - ref[r["seed"]] for r in mine
                  if r["seed"] in ref]
        entry["reward_vs_bf16"] = (lm.mean_interval(paired, LEVEL).to_dict()
                                   if paired and name != REFERENCE else None)
        stages = [r["summary"]["seconds_by_stage"] for r in mine]
        entry["seconds_by_stage"] = {k: float(np.mean([s[k] for s in stages])) for k in stages[0]}
        out.append(entry)
    return out


def _fmt(ci: dict | None, fmt: str, scale: float = 1.0, half_fmt: str | None = None) -> str:
    if ci is None:
        return "–"
    text = format(ci["estimate"] * scale, fmt)
    if ci["high"] is None:
        return text
    return f"{text} ± {format((ci['high'] - ci['estimate']) * scale, half_fmt or fmt)}"


def _fmt_sci(ci: dict | None) -> str:
    """``(m ± h)e-k`` with the estimate's exponent, e.g. ``(3.30 ± 0.33)e-3``."""
    if ci is None:
        return "–"
    m = ci["estimate"]
    exp = math.floor(math.log10(abs(m))) if m else 0
    if ci["high"] is None:
        return f"{m / 10 ** exp:.2f}e{exp}"
    return f"({m / 10 ** exp:.2f} ± {(ci['high'] - m) / 10 ** exp:.2f})e{exp}"


def _routing(c: dict) -> str:
    """The routing disagreement cell: percent over seeds, ``R3`` marked (counted before forcing)."""
    ci = c.get("routing_disagreement")
    if ci is None:
        return "–"
    text = _fmt(ci, ".2f", 100) + "%"
    return f"{text} R3" if c.get("routing_replay") in ("recompute", "record") else text


def summary_table(report: dict) -> Table:
    """The table ``alignd demo`` prints: per configuration, each number as mean ± the half-width
    of its 95 % interval over seeds."""
    opts = report["options"]
    seeds = opts.get("seeds", 1)
    eps = "off" if opts["ppo_clip_eps"] is None else f"{opts['ppo_clip_eps']:g}"
    bound = "none" if opts["max_version_diff"] is None else str(opts["max_version_diff"])
    over = (f"mean ± half-width of the 95 % Student t interval over {seeds} seeds"
            if seeds > 1 else "one seed, no interval")
    t = Table(title=f"alignd demo: {opts['steps']} GRPO steps per configuration and seed, "
              f"{seeds} seed(s), {opts['prompts_per_step']} prompts x "
              f"{opts['samples_per_prompt']} samples",
              caption=f"TIS cap {opts['tis_cap']:g} (token level), PPO clip ε {eps} over "
              f"{opts['ppo_epochs']} step(s) a batch, max_version_diff {bound}; TIS: cap (share "
              f"of TIS weights truncated); {over}; gain: last quarter − first quarter, per seed; "
              "vs bf16: last quarter − bf16's with the same seed (same prompts); "
              "routing: share of token×layer routing decisions where the learner's own top-k "
              "differs from the sampler's (R3: before forcing)")
    for c in ("configuration", "sampler / learner", "TIS", "reward 1st 1/4", "reward last 1/4",
              "gain", "vs bf16", "mean |δ|", "P99 |δ|", "clip potential", "routing", "s/step"):
        left = c in ("configuration", "sampler / learner")
        t.add_column(c, justify="left" if left else "right", no_wrap=True)
    for c in report["summary"]:
        cut = c["tis_truncated_fraction"]
        tis = f"{c['objective']['tis_cap']:g} ({100 * (cut['estimate'] if cut else 0):.2f}%)"
        t.add_row(c["name"], f"{c['sampler_path']} / {c['learner_path']}",
                  tis if c["tis"] else "no",
                  _fmt(c["reward_first_quarter"], ".3f"), _fmt(c["reward_last_quarter"], ".3f"),
                  _fmt(c["reward_gain"], "+.3f", half_fmt=".3f"),
                  _fmt(c.get("reward_vs_bf16"), "+.3f", half_fmt=".3f"),
                  _fmt_sci(c["mean_abs_delta"]),
                  _fmt_sci(c["p99_abs_delta"]), _fmt(c["clip_potential"], ".2f", 100) + "%",
                  _routing(c),
                  _fmt(c["seconds_per_step"], ".2f").split(" ±")[0])
    return t


#: matplotlib's pyplot and its text parser keep process-wide state: one figure at a time, so
#: two runs in one process (threads) can both draw
_PLOT_LOCK = threading.Lock()


def plot_demo(report: dict, path: Path) -> Path:
    """Mean |δ| and reward per step per configuration: moving averages, mean over seeds, 95 %
    band over seeds (see the module docstring)."""
    with _PLOT_LOCK:
        return _plot_demo(report, path)


def _plot_demo(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_r) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = list(dict.fromkeys(r["name"] for r in report["configs"]))
    window = 1
    floor = np.inf  # smallest mean |δ| drawn: the log axis stops below it, not at a band's 0
    for i, name in enumerate(names):
        runs = [r for r in report["configs"] if r["name"] == name]
        steps = np.array([s["step"] for s in runs[0]["steps"]])
        window = smoothing_window(len(steps))
        for ax, key in ((ax_d, "mean_abs_delta"), (ax_r, "reward")):
            curves = np.array([moving_average(np.nan_to_num(
                [np.nan if s[key] is None else s[key] for s in r["steps"]]), window) for r in runs])
            mean = curves.mean(0)
            ax.plot(steps, mean, color=f"C{i}", lw=2, label=name)
            if key == "mean_abs_delta" and (mean > 0).any():
                floor = min(floor, float(mean[mean > 0].min()))
            if len(runs) > 1:
                band = [lm.mean_interval(col, LEVEL) for col in curves.T]
                low = np.array([b.low for b in band])
                ax.fill_between(steps, np.maximum(low, 1e-12) if key == "mean_abs_delta" else low,
                                [b.high for b in band], color=f"C{i}", alpha=0.18, lw=0)
    seeds = report["options"].get("seeds", 1)
    band = f", 95 % band over {seeds} seeds" if seeds > 1 else ""
    ax_d.set_yscale("log")
    if np.isfinite(floor):
        ax_d.set_ylim(bottom=floor / 3)
    ax_d.set_xlabel("step")
    ax_d.set_ylabel("mean |log p_learner − log p_sampler| (nats)")
    ax_d.set_title(f"train–rollout log-prob discrepancy ({window}-step mean{band})", fontsize=10)
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("reward (sampled, T = 1)")
    ax_r.set_title(f"reward ({window}-step centered mean{band})", fontsize=10)
    for ax in (ax_d, ax_r):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
