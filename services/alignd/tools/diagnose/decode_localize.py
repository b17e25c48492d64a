"""Localization of a pair whose sampler side is the sampler's own KV-cached decode.

:func:`alignd.tools.diagnose.localize.localize` compares two teacher-forced full forwards, so a
condition whose two sides run the same path compares a forward with itself and is skipped.
The sampler does not run that forward: it prefills the prompt and then decodes one token per
step against its KV cache (:func:`libalign.models.replay_decode`, bit for bit the generator's
decode), with other GEMM shapes (one row per step), other attention (cached K/V, one query)
and other padding. What the aligned pair (the same path on both sides) leaves over is that
difference, and this module measures it.

Per sequence (a batch of one, so neither side pads):

* learner side: one forward of the whole sequence on the learner path, every chosen layer
  captured (:func:`libalign.models.capture`);
* sampler side: the sampler path's decode replayed on the same tokens under the same capture
  with ``keep_all``: the prefill's records, then one record per decode step, concatenated in
  token order. The decode feeds the prompt and every completion token but the last, so both
  sides are compared on the first ``len − 1`` tokens.

Per condition and layer the rows give, over all compared tokens of all sequences, the
symmetric relative L2 (:class:`~alignd.tools.diagnose.localize.L2Pool`) of the layer input,
FC1 and FC2 outputs under natural routing (rows matched by (token, expert); ``matched rows``
says what fraction found a partner) and the MoE output, and whether each site was bitwise
equal on every token: a residual of exactly 0 means the decode reproduced the forward's bits
there, anything else is the aligned pair's own execution gap at that site.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.markup import escape
from rich.table import Table
from torch import nn

from alignd.tools.diagnose.conditions import Condition
from alignd.tools.diagnose.localize import LayerAcc, add_natural, forward_capture
from libalign import models
from libalign.models.teacher_forcing import replay_batch

SITES = ("hidden_in", "fc1_out", "fc2_out", "moe_out")


def _cut(rec: dict, n: int | None, k: int) -> dict:
    """One forward's records of a batch-of-one, first ``n`` tokens (all: None), token-major."""
    h = rec["hidden_in"]
    rows = None if n is None else n * k
    return {"hidden_in": h.reshape(-1, h.shape[-1])[:n], "routing": rec["routing"].reshape(-1, k)[:n],
            "fc1_out": rec["fc1_out"][:rows], "fc2_out": rec["fc2_out"][:rows],
            "moe_out": rec["moe_out"].reshape(-1, rec["moe_out"].shape[-1])[:n]}


def decode_capture(model: nn.Module, seq: Sequence[int], prompt_len: int, path: str,
                   layers: Sequence[int], *, pad_id: int, backend: str) -> dict[int, dict]:
    """Per layer, the sampler decode's records of ``seq`` concatenated over prefill and steps."""
    k = int(model.config.num_experts_per_tok)
    with models.use_path(model, path, backend=backend), \
            models.capture(model, list(layers), keep_all=True) as cap:
        replay_batch(model, [list(map(int, seq))], [prompt_len], pad_id, [0])
    out = {}
    for x in layers:
        calls = [_cut({s: cap[x][s][i] for s in (*SITES, "routing")}, None, k)
                 for i in range(len(cap[x]["moe_out"]))]
        out[x] = {s: torch.cat([c[s] for c in calls]) for s in (*SITES, "routing")}
    return out


def localize_decode(model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                    conditions: Sequence[Condition], *, layers: Sequence[int], pad_id: int,
                    backend: str) -> list[dict]:
    """One row per condition and MoE layer: learner forward vs the sampler's KV-cached decode.

    Same-path conditions are measured like any other (module docstring).
    """
    moe = set(models.moe_layer_indices(model))
    layers = [x for x in layers if x in moe]
    if not layers or not conditions:
        return []
    k = int(model.config.num_experts_per_tok)
    dev = next(model.parameters()).device
    accs = {(c.name, x): LayerAcc(c.name, x) for c in conditions for x in layers}
    equal = {key: dict.fromkeys(SITES, True) for key in accs}
    for seq, p in zip(sequences, prompt_lens, strict=True):
        n = len(seq) - 1
        ids = torch.tensor([list(map(int, seq))], dtype=torch.long, device=dev)
        mask = torch.ones_like(ids)
        fwd = {path: forward_capture(model, ids, mask, path, layers, backend)
               for path in dict.fromkeys(c.learner for c in conditions)}
        dec = {path: decode_capture(model, seq, p, path, layers, pad_id=pad_id, backend=backend)
               for path in dict.fromkeys(c.sampler for c in conditions)}
        tok = torch.arange(n, device=dev)
        for c in conditions:
            for x in layers:
                cl, cs = _cut(fwd[c.learner][x], n, k), dec[c.sampler][x]
                add_natural(accs[(c.name, x)], cl, cs, tok, k)
                for s in SITES:
                    equal[(c.name, x)][s] &= bool(torch.equal(cl[s], cs[s]))
    rows = []
    for (cname, x), a in accs.items():
        rows.append({"condition": cname, "layer": x, "sequences": len(sequences),
                     "sampler_side": "kv_cached_decode",
                     "hidden_in_rel_l2": a.h_in.symmetric(),
                     "matched_rows": a.matched / a.rows if a.rows else None,
                     "fc1_rel_l2": a.fc1.symmetric(), "fc2_rel_l2": a.fc2.symmetric(),
                     "moe_out_rel_l2": a.moe.symmetric(),
                     "bitwise": equal[(cname, x)]})
    return rows


def _f(v) -> str:
    return "-" if v is None else ("0" if v == 0 else f"{v:.4g}")


def decode_table(report: dict) -> Table | None:
    """Learner forward vs the sampler's decode per condition and layer (a rich ``Table``)."""
    rows = (report.get("decode_localization") or {}).get("rows") or []
    if not rows:
        return None
    t = Table(title=escape(f"localization against the sampler's KV-cached decode "
                           f"({rows[0]['sequences']} sequences; symmetric rel. L2, 0 = bitwise "
                           f"equal on every token)"), title_justify="left")
    for col in ("condition", "layer", "hidden_in", "matched rows", "fc1", "fc2", "moe_out"):
        t.add_column(col, justify="left" if col == "condition" else "right")
    for r in rows:
        t.add_row(escape(r["condition"]), str(r["layer"]), _f(r["hidden_in_rel_l2"]),
                  _f(r["matched_rows"]), _f(r["fc1_rel_l2"]), _f(r["fc2_rel_l2"]),
                  _f(r["moe_out_rel_l2"]))
    return t
