"""``alignd diagnose --strict``: the diagnosis with both sides in strict execution.

With ``--strict`` the model runs :mod:`libalign.models.strict` for every stage (the sampler's
KV-cached decode and replay, the learner's teacher-forced scoring, localization, context swap):
the ops whose result depends on a call's shape get one batch-invariant form shared by both
sides. A *strict pair* (the same path on both sides, ``bf16/bf16`` or
``nvfp4_minite/nvfp4_minite``) then has δ = 0 on every token, so its P99 |δ| is 0 and there is
nothing left to localize: its two teacher-forced forwards are the same computation, and the
decode that used to differ from them by the KV cache's shapes now gives the same bits.

Paths whose activation scale depends on the whole call (``nvfp4_naive``: one maximum over every
row) have no strict form and are refused by name. Without ``--conditions`` the strict pairs
:data:`STRICT_CONDITIONS` are diagnosed.

The report's ``strict`` entry states, per condition, the scored tokens, max and P99 |δ| and
whether every δ is exactly 0 (``exact``), and lists the strict pairs that are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from alignclient.errors import SpecError

from alignd.tools.diagnose.conditions import EXTERNAL, Condition
from libalign.models import strict as strict_mode

STRICT_CONDITIONS = ("bf16/bf16", "nvfp4_minite/nvfp4_minite")


def prepare(cfg):
    """``cfg`` with the strict pairs as conditions when ``--strict`` names none."""
    if cfg.strict and cfg.conditions is None and cfg.learner_paths is None \
            and cfg.sampler_paths is None:
        return replace(cfg, conditions=",".join(STRICT_CONDITIONS))
    return cfg


def check(conditions: Sequence[Condition], generate_path: str | None) -> None:
    """SpecError naming the first path of the run that has no strict form."""
    paths = [p for c in conditions for p in (c.learner, c.sampler) if p != EXTERNAL]
    for p in dict.fromkeys([*paths, *([generate_path] if generate_path else [])]):
        try:
            strict_mode.check_path(p)
        except SpecError as e:
            raise SpecError(f"--strict: {e}") from None


def summary(conditions: Sequence[Condition], deltas: dict[str, list[torch.Tensor]]) -> dict:
    """Per condition: tokens, max and P99 |δ|, exact (every δ is 0); the exact strict pairs."""
    rows = {}
    for c in conditions:
        d = torch.cat([x.reshape(-1) for x in deltas[c.name]]).double().abs() \
            if deltas[c.name] else torch.zeros(0, dtype=torch.float64)
        rows[c.name] = {"tokens": int(d.numel()),
                        "max_abs_delta": float(d.max()) if d.numel() else 0.0,
                        "p99_abs_delta": float(torch.quantile(d, 0.99)) if d.numel() else 0.0,
                        "exact": bool((d == 0).all()),
                        "pair": c.learner == c.sampler}
    exact = [n for n, r in rows.items() if r["pair"] and r["exact"]]
    return {"conditions": rows, "exact_pairs": exact,
            "localization": "nothing to localize in an exact pair: its sides run the same "
                            "computation" if exact else None}


def render_lines(report: dict) -> list[str]:
    """One line per strict condition for the console."""
    s = report.get("strict")
    if not s:
        return []
    out = []
    for name, r in s["conditions"].items():
        state = "δ = 0 on every token" if r["exact"] else \
            f"max |δ| {r['max_abs_delta']:.3g}, P99 {r['p99_abs_delta']:.3g}"
        out.append(f"strict {name}: {state} ({r['tokens']} tokens)")
    if s.get("localization"):
        out.append(f"strict: {s['localization']} ({', '.join(s['exact_pairs'])})")
    return out
