"""PNG figures of a diagnosis report (matplotlib, Agg backend: no display needed).

* ``tail.png`` — the |δ| tail per condition: the empirical CCDF ``P(|δ| > x)`` on a log y
  axis, shared tokens, with the P99 of each condition marked. A condition whose curve lies to
  the right of the floor's has a wider tail.
* ``layers.png`` — per-layer FC1 and FC2 discrepancy (symmetric relative L2, learner vs sampler)
  per condition, natural routing on top, routing-conditioned (expert assignments fixed at the
  observed layer) below.
* ``replay.png`` — the 2×2 replay at each replay layer: input drift and, for FC1, FC2 and the
  MoE output, the within-path input swap against the between-path difference at a common input.

Each function takes the report dict (see :mod:`alignd.tools.diagnose.run`) and a directory, writes
one file and returns its path, or ``None`` when the report holds nothing to draw.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tail(report: dict, out_dir: Path) -> Path | None:
    """CCDF of |δ| per condition on log y."""
    tails = report.get("tails") or {}
    if not tails:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    p99 = {c["name"]: c["shared"]["delta"]["p99_abs"] for c in report["conditions"] if c.get("shared")}
    for name, t in tails.items():
        xs, ys = t["x"], t["ccdf"]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
        if not pts:
            continue
        style = "--" if name == report.get("floor") else "-"
        line, = ax.step([p[0] for p in pts], [p[1] for p in pts], style, where="post",
                        label=f"{name} (P99 {p99.get(name, float('nan')):.3g})")
        if name in p99:
            ax.axvline(p99[name], color=line.get_color(), lw=0.6, alpha=0.6)
    ax.axhline(0.01, color="grey", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("|δ| = |log p_learner − log p_sampler| (nats)")
    ax.set_ylabel("P(|δ| > x)")
    seq = report.get("sequences", {})
    ax.set_title(f"|δ| tail, {seq.get('count', '?')} sequences, "
                 f"{seq.get('completion_tokens', '?')} tokens (shared)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir / "tail.png")


def plot_layers(report: dict, out_dir: Path) -> Path | None:
    """Grouped bars: FC1 / FC2 discrepancy per layer and condition, plain and conditioned."""
    rows = report.get("layers") or []
    if not rows:
        return None
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    layers = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True, squeeze=False)
    width = 0.8 / max(len(conds), 1)
    for col, fc in enumerate(("fc1", "fc2")):
        for row, variant in enumerate(("natural", "conditioned")):
            ax = axes[row][col]
            for j, c in enumerate(conds):
                vals = []
                for layer in layers:
                    r = next((r for r in rows if r["condition"] == c and r["layer"] == layer), None)
                    v = None if r is None else (r.get(variant) or {}).get(f"{fc}_rel_l2")
                    vals.append(float("nan") if v is None else v)
                xs = [i + (j - (len(conds) - 1) / 2) * width for i in range(len(layers))]
                ax.bar(xs, vals, width, label=c, hatch="//" if variant == "conditioned" else None)
            ax.set_xticks(range(len(layers)), [str(x) for x in layers])
            what = ("natural routing (matched expert rows)" if variant == "natural"
                    else "routing-conditioned (sampler assignments at the layer)")
            ax.set_title(f"{fc.upper()}: {what}", fontsize=9)
            ax.set_ylabel("symmetric rel. L2")
            if row == 1:
                ax.set_xlabel("layer")
    axes[0][0].legend(fontsize=7)
    return _save(fig, out_dir / "layers.png")


_REPLAY_BARS = (("input_swap_learner", "I: F_L(h_R) vs F_L(h_L)"),
                ("path_at_sampler_input", "E: F_R(h_R) vs F_L(h_R)"),
                ("path_at_learner_input", "F_R(h_L) vs F_L(h_L)"),
                ("total", "N: F_R(h_R) vs F_L(h_L)"))


def plot_replay(report: dict, out_dir: Path) -> Path | None:
    """One panel per (condition, layer) of the 2×2 replay."""
    rows = report.get("replay") or []
    if not rows:
        return None
    n = len(rows)
    ncols = min(n, 4)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(4.5 * ncols, 6), 4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.axis("off")
    for ax, r in zip(flat, rows, strict=False):
        groups = ("fc1", "fc2", "moe_out")
        width = 0.8 / len(_REPLAY_BARS)
        for j, (key, label) in enumerate(_REPLAY_BARS):
            vals = [r[g].get(key, float("nan")) if r.get(g) else float("nan") for g in groups]
            xs = [i + (j - (len(_REPLAY_BARS) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, vals, width, label=label)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_title(f"{r['condition']} layer {r['layer']}\ninput drift R(h_R, h_L) = "
                     f"{r['input_drift']:.3g}", fontsize=9)
        ax.set_ylabel("reference-normalized rel. L2")
    axes[0][0].legend(fontsize=7)
    return _save(fig, out_dir / "replay.png")


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """Every figure the report has data for."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [plot_tail(report, out_dir), plot_layers(report, out_dir), plot_replay(report, out_dir)]
    return [p for p in made if p is not None]
