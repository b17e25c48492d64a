"""The 2×2 replay at the MoE entry: is an FC1/FC2 difference the layer's arithmetic or its input?

Where the inputs come from
--------------------------
At every replay layer the input of the **MoE module** is captured: the post-attention-norm
hidden states the router and FC1 see, *before* routing. ``h_L`` comes from the learner path's
teacher-forced forward, batched as the learner scores, together with the learner's expert
assignment (``top_k_index`` and router coefficients). ``h_R`` comes from the sampler side, in
one of two ways (``sampler_side``):

* ``decode`` (the default): the sampler path's own KV-cached decode of the sequence
  (:func:`libalign.models.teacher_forcing.replay_batch`, a batch of one: the prompt's prefill,
  then one token a step), the records concatenated in token order. The decode feeds every
  token but the last, so both sides keep the first ``len − 1`` tokens. A pair that runs the
  same path on both sides is measured too: its ``h_R`` differs from ``h_L`` by what decoding
  (other GEMM shapes, cached attention) does to the residual stream;
* ``forward``: the sampler path's teacher-forced forward, batched like the learner's. A
  same-path pair then has identical inputs (every quantity 0) and is listed as skipped.

A TRACE condition (learner ``nvfp4_trace``) replays with its sampler's guidance records: the
learner's capture and every learner cell run under :func:`libalign.models.use_guidance` with the
tokens named by sequence and position (:func:`libalign.guidance.row_keys`), so ``F_L`` rounds
each row the way the sampler recorded it. Without records for it the condition is skipped.

Everything is split per prompt (one shared sequence, its real tokens only).

The four cells
--------------
Per prompt, the MoE module of the layer runs alone (:func:`libalign.models.replay_moe`) on each
input under each path's expert numerics and weights, with the **learner's** assignment forced
(:func:`libalign.models.force_routing`), so all four cells route every token to the same
experts: ``F_L(h_L)``, ``F_L(h_R)``, ``F_R(h_L)``, ``F_R(h_R)``. The per-expert FC1 and FC2
outputs come from hooks on that replayed module (:func:`libalign.models.capture`), one row per
(token, expert) pair, and are concatenated in expert-index order (a stable sort of the rows by
expert; the norms below do not depend on the order, the layout is kept for inspection).

What is reported
----------------
With ``R(a, b) = ‖a − b‖₂ / ‖b‖₂`` (sums of squares in FP32; a zero denominator gives 0 when
the numerator is 0 too, ∞ otherwise) and ``F^j`` the concatenated FCj outputs:

* ``input_discrepancy``  ``R(h_L, h_R)`` — how far apart the MoE inputs already are;
* ``I``  ``R(F_L^j(h_R), F_L^j(h_L))`` — the input swap within the learner path: the part of the
  output difference that is inherited drift carried through the learner's own numerics;
* ``E``  ``R(F_R^j(h_R), F_L^j(h_R))`` — the two paths at a common input ``h_R``: the layer's own
  arithmetic, free of inherited drift;
* also ``E_at_h_L`` (the paths at ``h_L``), ``I_sampler`` (the input swap within the sampler
  path) and ``N``  ``R(F_R^j(h_R), F_L^j(h_L))`` (both differ, routing still the learner's).

Each is computed per prompt and averaged over prompts (arithmetic mean; one infinite prompt
makes the mean infinite). The columns have different denominators and are not additive
shares: ``E ≫ I`` says the layer's arithmetic dominates, ``I ≫ E`` that the layer mostly passes
on drift it received. FC2's input is FC1's output after the activation, so FC2 comparisons
include FC1 differences. Each row also says whether every cell ran the learner's experts
(``assignments_fixed``) and whether ``F_L(h_L)`` replayed per prompt reproduces the FC outputs
captured in the batched forward bit for bit (a per-tensor activation scale, taken over the
whole batch, does not).

The decoder-layer replay that also re-runs attention is
:func:`alignd.tools.diagnose.localize.localize` (the report's ``replay`` section).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack

import torch
from alignclient.errors import InputError, NonFiniteError, ShapeError
from torch import nn

from alignd.tools.diagnose.conditions import GUIDED, Condition
from alignd.tools.diagnose.localize import padded_batch
from libalign import models
from libalign.guidance import GuidanceTable, row_keys
from libalign.models.paths import set_row_keys
from libalign.models.scoring import right_padded_batch
from libalign.models.teacher_forcing import replay_batch

Progress = Callable[[int], None]
SITES = ("fc1", "fc2")
CELLS = {"LL": ("learner", "h_L"), "LR": ("learner", "h_R"),
         "RL": ("sampler", "h_L"), "RR": ("sampler", "h_R")}
"""Cell ``XY``: path X (L learner, R sampler) applied to input h_Y."""
QUANTITIES = {"I": ("LR", "LL"), "E": ("RR", "LR"), "E_at_h_L": ("RL", "LL"),
              "I_sampler": ("RR", "RL"), "N": ("RR", "LL")}
"""Each quantity is ``R(cell a, cell b)``, b the reference."""


def relative_l2_fp32(x: torch.Tensor, ref: torch.Tensor, what: str = "replay") -> float:
    """``R(x, ref) = ‖x − ref‖₂ / ‖ref‖₂`` with FP32 sums of squares; 0/0 → 0, x/0 → ∞.

    Both tensors must have the same number of elements (:class:`ShapeError`) and be finite
    (:class:`NonFiniteError` naming ``what`` and the side).
    """
    if x.numel() != ref.numel():
        raise ShapeError(f"{what}: {tuple(x.shape)} and {tuple(ref.shape)} hold different numbers "
                         "of values")
    x32, r32 = x.detach().float().reshape(-1), ref.detach().float().reshape(-1)
    for t, side in ((x32, "x"), (r32, "ref")):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise NonFiniteError(f"{what} ({side})", count=int(bad.sum()),
                                 nan=int(torch.isnan(t).sum()), inf=int(torch.isinf(t).sum()),
                                 first_indices=[tuple(bad.nonzero()[0].tolist())])
    num = float(((x32 - r32) ** 2).sum().sqrt())
    den = float((r32 ** 2).sum().sqrt())
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def expert_index_order(routing: torch.Tensor) -> torch.Tensor:
    """Permutation of token-order rows (row ``t*k + j``: token t, slot j) into expert-index
    order: rows sorted by ``routing[t, j]``, ties kept in token order (a stable sort)."""
    return torch.sort(routing.reshape(-1), stable=True).indices


def prompt_quantities(h_l: torch.Tensor, h_r: torch.Tensor, cells: dict[str, dict[str, torch.Tensor]],
                      what: str = "replay") -> dict:
    """One prompt's ``input_discrepancy`` and, per FC site, every :data:`QUANTITIES` entry.

    ``cells`` maps ``LL``/``LR``/``RL``/``RR`` to ``{"fc1": rows, "fc2": rows}``, rows of the same
    (token, expert) pairs in the same order in every cell.
    """
    out: dict = {"input_discrepancy": relative_l2_fp32(h_l, h_r, f"{what} input")}
    for site in SITES:
        out[site] = {q: relative_l2_fp32(cells[a][site], cells[b][site], f"{what} {site} {q}")
                     for q, (a, b) in QUANTITIES.items()}
    return out


def mean_over_prompts(rows: Sequence[dict]) -> dict:
    """Arithmetic mean of :func:`prompt_quantities` results (an infinite value stays infinite)."""
    n = len(rows)
    out: dict = {"input_discrepancy": sum(r["input_discrepancy"] for r in rows) / n}
    for site in SITES:
        out[site] = {q: sum(r[site][q] for r in rows) / n for q in QUANTITIES}
    return out


# --- capture at the MoE entry -----------------------------------------------------------------

def _guided(stack: ExitStack, model: nn.Module, table: GuidanceTable | None,
            keys: torch.Tensor) -> None:
    """Inside ``stack``: ``table``'s records rounding the experts' activations, the rows named
    by ``keys`` (nothing without a table)."""
    if table is None:
        return
    stack.enter_context(models.use_guidance(model, table))
    set_row_keys(model, keys)
    stack.callback(set_row_keys, model, None)


def capture_moe_entry(model: nn.Module, sequences: Sequence[Sequence[int]], path: str,
                      layers: Sequence[int], *, batch_size: int, pad_id: int, backend: str,
                      table: GuidanceTable | None = None) -> dict[int, list[dict]]:
    """Per layer, per sequence: the MoE module's input rows ``moe_in`` ``[n, H]`` (real tokens
    only), the assignment ``routing`` / ``router_weights`` ``[n, k]`` and the FC outputs
    ``fc1_out`` / ``fc2_out`` ``[n*k, ·]`` in token order, from a teacher-forced forward on
    ``path`` (right padding, attention mask, as the learner scores); with ``table`` guided by
    its records (sequence ``i`` of ``sequences`` is sequence id ``i``)."""
    dev = next(model.parameters()).device
    k = int(model.config.num_experts_per_tok)
    out: dict[int, list[dict]] = {x: [] for x in layers}
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, mask = padded_batch(chunk, pad_id, dev)
        width = ids.shape[1]
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(models.use_path(model, path, backend=backend))
            keys = right_padded_batch(chunk, range(start, start + len(chunk)), pad_id, dev)[2] \
                if table is not None else None
            _guided(stack, model, table, keys)
            cap = stack.enter_context(models.capture(model, list(layers)))
            model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False)
        for x in layers:
            c = cap[x]
            for r, s in enumerate(chunk):
                tok = torch.arange(r * width, r * width + len(s), device=c["moe_in"].device)
                rows = (tok.unsqueeze(1) * k + torch.arange(k, device=tok.device)).reshape(-1)
                out[x].append({"moe_in": c["moe_in"][tok], "routing": c["routing"][tok],
                               "router_weights": c["router_weights"][tok],
                               "fc1_out": c["fc1_out"][rows], "fc2_out": c["fc2_out"][rows]})
    return out


def capture_moe_entry_decode(model: nn.Module, sequences: Sequence[Sequence[int]],
                             prompt_lens: Sequence[int], path: str, layers: Sequence[int], *,
                             pad_id: int, backend: str) -> dict[int, list[dict]]:
    """As :func:`capture_moe_entry`, from the sampler path's KV-cached decode of each sequence
    alone (prefill, then one token a step; records concatenated in token order): the first
    ``len − 1`` tokens, the ones the decode feeds."""
    k = int(model.config.num_experts_per_tok)
    out: dict[int, list[dict]] = {x: [] for x in layers}
    for seq, plen in zip(sequences, prompt_lens, strict=True):
        with models.use_path(model, path, backend=backend), \
                models.capture(model, list(layers), keep_all=True) as cap:
            replay_batch(model, [list(map(int, seq))], [plen], pad_id, [0])
        n = len(seq) - 1
        for x in layers:
            def cat(name: str, rows: int, x=x) -> torch.Tensor:
                return torch.cat([t.reshape(-1, t.shape[-1]) for t in cap[x][name]])[:rows]
            out[x].append({"moe_in": cat("moe_in", n), "routing": cat("routing", n),
                           "router_weights": cat("router_weights", n),
                           "fc1_out": cat("fc1_out", n * k), "fc2_out": cat("fc2_out", n * k)})
    return out


def _first_tokens(rec: dict, n: int, k: int) -> dict:
    return {"moe_in": rec["moe_in"][:n], "routing": rec["routing"][:n],
            "router_weights": rec["router_weights"][:n], "fc1_out": rec["fc1_out"][:n * k],
            "fc2_out": rec["fc2_out"][:n * k]}


def replay_cell(model: nn.Module, layer: int, moe_in: torch.Tensor, path: str,
                routing: tuple[torch.Tensor, torch.Tensor], backend: str, *,
                table: GuidanceTable | None = None, seq_id: int = 0) -> dict:
    """The MoE module of ``layer`` alone on ``moe_in`` under ``path`` with ``routing`` forced;
    FC1/FC2 outputs (token order) and the assignment, from hooks on the replayed module. With
    ``table``, the rows are the tokens ``0..n-1`` of sequence ``seq_id``, rounded by its records."""
    with ExitStack() as stack:
        keys = row_keys(seq_id, torch.arange(moe_in.shape[0], device=moe_in.device)).unsqueeze(0)
        _guided(stack, model, table, keys)
        cap = stack.enter_context(models.capture(model, [layer]))
        models.replay_moe(model, layer, moe_in, path, routing=routing, backend=backend)
    c = cap[layer]
    return {"fc1": c["fc1_out"], "fc2": c["fc2_out"], "routing": c["routing"]}


SAMPLER_SIDES = ("decode", "forward")


def moe_replay(model: nn.Module, sequences: Sequence[Sequence[int]], conditions: Sequence[Condition], *,
               layers: Sequence[int], batch_size: int, pad_id: int, backend: str,
               prompt_lens: Sequence[int] | None = None, sampler_side: str = "forward",
               guidance: Mapping[str, GuidanceTable] | None = None,
               progress: Progress | None = None) -> tuple[list[dict], list[str]]:
    """Replay rows (one per condition and MoE layer) and the conditions skipped.

    ``sampler_side`` ``decode`` (needs ``prompt_lens``) captures ``h_R`` from the sampler's
    KV-cached decode and skips nothing; ``forward`` from its teacher-forced forward, skipping
    same-path pairs. ``guidance`` maps a TRACE condition's name to its sampler's records on
    ``sequences`` (sequence ``i`` is id ``i``); a TRACE condition without them is skipped. See
    the module docstring for every column.
    """
    guidance = dict(guidance or {})
    if sampler_side not in SAMPLER_SIDES:
        raise InputError(f"sampler side {sampler_side!r}: choose one of {', '.join(SAMPLER_SIDES)}")
    if sampler_side == "decode" and prompt_lens is None:
        raise InputError("the decode sampler side needs the sequences' prompt lengths")
    moe = set(models.moe_layer_indices(model))
    layers = [x for x in layers if x in moe]
    decode = sampler_side == "decode"
    todo = [c for c in conditions if (decode or c.learner != c.sampler)
            and (c.learner != GUIDED or c.name in guidance)]
    skipped = [c.name for c in conditions if c not in todo]
    if not todo or not layers:
        return [], skipped
    k = int(model.config.num_experts_per_tok)

    def learner_key(c: Condition) -> tuple[str, str | None]:
        return (c.learner, c.name if c.learner == GUIDED else None)

    wanted = [learner_key(c) for c in todo]
    if not decode:
        wanted += [(c.sampler, None) for c in todo]
    caps = {key: capture_moe_entry(model, sequences, key[0], layers, batch_size=batch_size,
                                   pad_id=pad_id, backend=backend,
                                   table=guidance.get(key[1]) if key[1] else None)
            for key in dict.fromkeys(wanted)}
    if decode:
        caps = {p: {x: [_first_tokens(r, len(s) - 1, k) for r, s in zip(v, sequences, strict=True)]
                    for x, v in per.items()} for p, per in caps.items()}
        sampler_caps = {(p, None): capture_moe_entry_decode(model, sequences, prompt_lens, p,
                                                            layers, pad_id=pad_id, backend=backend)
                        for p in dict.fromkeys(c.sampler for c in todo)}
    else:
        sampler_caps = caps
    rows = []
    for c in todo:
        table = guidance.get(c.name) if c.learner == GUIDED else None
        for x in layers:
            per_prompt, fixed, reproduces = [], True, True
            for i, (cl, cs) in enumerate(zip(caps[learner_key(c)][x],
                                             sampler_caps[(c.sampler, None)][x], strict=True)):
                routing = (cl["routing"], cl["router_weights"])
                h = {"h_L": cl["moe_in"], "h_R": cs["moe_in"]}
                order = expert_index_order(cl["routing"])
                cells = {}
                for key, (side, inp) in CELLS.items():
                    path = c.learner if side == "learner" else c.sampler
                    got = replay_cell(model, x, h[inp], path, routing, backend,
                                      table=table if side == "learner" else None, seq_id=i)
                    fixed = fixed and torch.equal(got["routing"], cl["routing"])
                    cells[key] = {site: got[site][order] for site in SITES}
                    if key == "LL":
                        reproduces = reproduces and torch.equal(got["fc1"], cl["fc1_out"]) \
                            and torch.equal(got["fc2"], cl["fc2_out"])
                per_prompt.append(prompt_quantities(h["h_L"], h["h_R"], cells,
                                                    f"{c.name} layer {x} prompt {i}"))
            rows.append({"condition": c.name, "layer": x, "sampler_side": sampler_side,
                         "prompts": len(per_prompt),
                         **mean_over_prompts(per_prompt), "assignments_fixed": fixed,
                         "replay_reproduces_capture": reproduces})
            if progress:
                progress(1)
    return rows, skipped


def moe_replay_table(report: dict):
    """The report's ``moe_replay`` rows as a rich table (None when there are none)."""
    from rich.markup import escape
    from rich.table import Table

    sec = report.get("moe_replay") or {}
    rows = sec.get("rows") or []
    if not rows:
        return None
    t = Table(title=f"2×2 replay at the MoE entry (R(a,b) = ‖a−b‖/‖b‖, FP32, mean over "
              f"{sec.get('prompts')} prompts; learner's expert assignments fixed; h_R from the "
              f"sampler's {sec.get('sampler_side', 'forward')})", title_justify="left")
    for c in ("condition", "layer", "site", "R(h_L,h_R)", "I: F_L(h_R)|F_L(h_L)", "E: F_R(h_R)|F_L(h_R)",
              "F_R(h_L)|F_L(h_L)", "F_R(h_R)|F_R(h_L)", "N: F_R(h_R)|F_L(h_L)", "fixed"):
        t.add_column(c, justify="left" if c in ("condition", "site") else "right",
                     min_width=min(max(len(r["condition"]) for r in rows), 32) if c == "condition"
                     else None)
    for r in rows:
        for site in SITES:
            s = r[site]
            t.add_row(escape(r["condition"]), str(r["layer"]), site, _fmt(r["input_discrepancy"]),
                      *(_fmt(s[q]) for q in ("I", "E", "E_at_h_L", "I_sampler", "N")),
                      "yes" if r["assignments_fixed"] else "NO")
    return t


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    return "inf" if math.isinf(v) else f"{v:.4g}"
