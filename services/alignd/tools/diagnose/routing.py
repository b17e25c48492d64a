"""Routing disagreement with and without routing replay (R3), per condition.

While the sampler paths replay the shared tokens (the teacher-forced KV decode), their routers
are recorded (:func:`libalign.models.routing_replay.capture_routing`: the top-k expert ids of
every fed token at every MoE layer, what a sampler keeps for R3). Each condition's learner
path then scores the same tokens twice against its sampler's records
(:func:`libalign.models.routing_replay.replay_routing`):

* **without replay**: the learner routes by itself; the disagreement is the share of
  token×layer decisions whose top-k set differs from the sampler's;
* **with R3**: every token goes to the sampler's experts (gate weights from the learner's
  own router logits); the disagreement is still counted *before forcing*, layer by layer,
  so it shows how often the learner alone would have left the sampler's routing even with
  the upstream layers routed as the sampler did. δ under R3 is summarized next to δ without.

Guided learners (``nvfp4_trace``) and external sampler log-probs have no records here and are
left out (named in the report).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.table import Table
from torch import nn

from alignd.tools.diagnose import sides, stats
from libalign.models.routing_replay import (
    RoutingCapture,
    RoutingStats,
    RoutingTable,
    replay_routing,
)


def _abs_stats(lp_l: list[torch.Tensor], lp_s: list[torch.Tensor]) -> dict:
    d = torch.cat(stats.deltas(lp_l, lp_s)).abs().double()
    if d.numel() == 0:
        return {"mean_abs": None, "p99_abs": None}
    return {"mean_abs": float(d.mean()), "p99_abs": float(torch.quantile(d, 0.99))}


def routing_rows(model: nn.Module, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 conds, captures: dict[str, RoutingCapture],
                 sampler_lp: dict[str, list[torch.Tensor]], *, batch_size: int, pad_id: int,
                 backend: str, progress=None) -> list[dict]:
    """One row per condition whose sampler's routing was captured (module docstring)."""
    rows = []
    tables = {p: RoutingTable(cap.records()) for p, cap in captures.items()}
    for c in conds:
        table = tables.get(c.sampler)
        if table is None:
            continue
        row = {"name": c.name, "learner": c.learner, "sampler": c.sampler}
        for key, mode in (("without", "off"), ("r3", "recompute")):
            st = RoutingStats()
            with replay_routing(model, table, weights=mode, stats=st):
                lp = sides.score(model, tokens, prompt_lens, c.learner, batch_size=batch_size,
                                 pad_id=pad_id, backend=backend, progress=progress)
            row[key] = {**st.to_dict(), **_abs_stats(lp, sampler_lp[c.sampler])}
        rows.append(row)
    return rows


def routing_table(report: dict) -> Table | None:
    """Routing disagreement and |δ| without and with routing replay, per condition."""
    section = report.get("routing_replay") or {}
    rows = section.get("rows") or []
    if not rows:
        return None
    t = Table(title="routing replay (R3): share of token×layer routing decisions whose learner "
              "top-k differs from the sampler's (with R3: before forcing), and |δ|")
    for col in ("condition", "decisions", "disagree", "disagree | R3", "mean |δ|",
                "mean |δ| R3", "P99 |δ|", "P99 |δ| R3"):
        t.add_column(col, justify="left" if col == "condition" else "right", no_wrap=True)

    def pct(v):
        return "–" if v is None else f"{100 * v:.3f}%"

    def sci(v):
        return "–" if v is None else f"{v:.3e}"

    for r in rows:
        w, x = r["without"], r["r3"]
        t.add_row(r["name"], str(w["decisions"]), pct(w["disagreement"]), pct(x["disagreement"]),
                  sci(w["mean_abs"]), sci(x["mean_abs"]), sci(w["p99_abs"]), sci(x["p99_abs"]))
    return t
