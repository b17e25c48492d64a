"""Where the execution gap arises: per-layer discrepancy, the 2×2 replay, the context-swap check.

All three run teacher-forced forwards of the shared sequences, batched exactly as the learner
scores them (right padding, attention mask, positions ``0..T−1``), and compare only real tokens
(prompt and completion; padding rows are dropped before any norm is taken).

Per-layer localization (:func:`localize`)
-----------------------------------------
For a condition ``learner/sampler`` both paths run the whole network on the same tokens and every
chosen layer is captured (:func:`libalign.models.capture`). Per layer:

* ``hidden_in``: the layer input, learner vs sampler — how much drift the layer inherits;
* routing agreement of the two paths' top-k expert sets (:func:`libalign.metrics.routing_agreement`);
* FC1 / FC2 outputs under **natural routing**: a row is one (token, expert) pair, and only pairs
  that both paths chose are comparable, so the rows are matched by (token, expert) and
  ``matched rows`` says what fraction of the learner's rows found a partner;
* the **routing-conditioned** variant: the learner path runs again with the layer's expert
  assignments (indices and router weights) forced to the sampler's at that layer only
  (:func:`libalign.models.force_routing`; upstream routing stays free, as in the miniTE
  localization). Every row then has a partner and the FC1/FC2 difference is the residual at
  fixed target-layer assignments;
* the MoE block output.

Learner and sampler are symmetric here (neither is the truth), so the measure is the symmetric
relative L2 ``‖x − y‖ / ((‖x‖ + ‖y‖)/2)``, pooled over all real tokens of all batches (sums of
squares accumulated in float64; the same value :func:`libalign.metrics.symmetric_relative_l2`
gives on the concatenated rows). A condition whose two sides run the same path has identical
teacher-forced forwards and is skipped here; :mod:`alignd.tools.diagnose.decode_localize` measures
it against the sampler's own KV-cached decode.

The 2×2 replay (:func:`localize` with ``replay_layers``)
--------------------------------------------------------
At a replay layer the decoder-layer inputs ``h_L`` (captured on the learner path) and ``h_R``
(on the sampler path) are each fed through the layer under both paths, with the **learner's**
expert assignments held fixed (:func:`libalign.models.replay_layer`): ``F_L(h_L)``,
``F_L(h_R)``, ``F_R(h_L)``, ``F_R(h_R)``. FC1, FC2 and MoE outputs are compared with the
reference-normalized ``R(x, ref) = ‖x − ref‖ / ‖ref‖`` (the learner's output as reference),
per sequence, then averaged over sequences:

* ``input drift``  ``R(h_R, h_L)`` — how far apart the inputs already are;
* ``I``  ``R(F_L(h_R), F_L(h_L))`` — the input swap within the learner path: the part of the
  output difference that is inherited drift carried through the layer's own (learner) numerics;
* ``E``  ``R(F_R(h_R), F_L(h_R))`` — the two paths at a **common** input: the layer's own
  numerics, free of inherited drift (also reported at ``h_L``, and the sampler-path swap);
* ``N``  ``R(F_R(h_R), F_L(h_L))`` — both differ (routing still the learner's).

Since ``F_R(h_R) − F_L(h_L) = [F_R(h_R) − F_L(h_R)] + [F_L(h_R) − F_L(h_L)]``, the triangle
inequality bounds ``‖N‖`` by the two parts, but the norms have different denominators and are
not additive shares: ``E ≫ I`` says the layer's arithmetic dominates, ``I ≫ E`` that the layer
mostly passes on drift it received. FC2's input is FC1's output, so FC2 comparisons include
FC1 and activation differences. Replaying ``h_L`` on the learner path must reproduce the
captured MoE output; the report records whether it did bit for bit.

Context swap (:func:`context_swap_check`)
-----------------------------------------
A target sequence is scored by the learner on each path in batches of one fixed shape
``[B, W]``, target in row 0, beside different companions: rows of pad tokens (the reference),
its original batch-mates, and the lowest- and the highest-amplitude sequences (amplitude: the
largest |MoE input| over all MoE layers and real tokens, bf16 path). With right padding and an
attention mask the target's tokens, positions and attention are the same in every batch, and
so are all GEMM shapes; only the companions' values differ. A per-tensor activation scale
(``nvfp4_naive``) takes its maximum over every token of the grouped call and moves with them;
a per-row scale (``nvfp4_minite``) cannot, so the check passes when the target's log-probs are
bitwise equal in every context. Scoring the target alone (a batch of one) also changes the
matrix shapes, and a CPU or GPU GEMM may pick another kernel (another summation order) for
another shape; that is reported beside the check for every path, bf16 included, as measured.
The quantizer-level :func:`libalign.context.context_swap` on the captured layer-0 MoE inputs is
reported as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
from alignclient.errors import NonFiniteError
from torch import nn

from alignd.tools.diagnose.conditions import Condition
from libalign import metrics, models
from libalign.context import context_swap
from libalign.gemm import get_path

Progress = Callable[[int], None]


# --- pooled relative L2 -----------------------------------------------------------------------

class L2Pool:
    """Sums of squares of ``x − y``, ``x`` and ``y`` over batches (float64), for pooled relative L2."""

    def __init__(self, what: str):
        self.what = what
        self.dd = self.xx = self.yy = 0.0
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x64, y64 = x.detach().double(), y.detach().double()
        for t, side in ((x64, "learner"), (y64, "sampler")):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise NonFiniteError(f"{self.what} ({side} side)", count=int(bad.sum()),
                                     nan=int(torch.isnan(t).sum()), inf=int(torch.isinf(t).sum()),
                                     first_indices=[tuple(bad.nonzero()[0].tolist())])
        self.dd += float(((x64 - y64) ** 2).sum())
        self.xx += float((x64 ** 2).sum())
        self.yy += float((y64 ** 2).sum())
        self.rows += x.shape[0] if x.ndim else 1

    @staticmethod
    def _ratio(num: float, den: float) -> float:
        if den > 0:
            return num / den
        return 0.0 if num == 0 else math.inf

    def symmetric(self) -> float | None:
        """``‖x − y‖ / ((‖x‖ + ‖y‖)/2)``; 0/0 → 0, x/0 → inf; None when nothing was added."""
        if self.rows == 0:
            return None
        return self._ratio(math.sqrt(self.dd), (math.sqrt(self.xx) + math.sqrt(self.yy)) / 2)


# --- batches as the learner builds them -------------------------------------------------------

def padded_batch(seqs: Sequence[Sequence[int]], pad_id: int, device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[B, L]`` of right-padded ``seqs`` on ``device``, as the learner pads."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[r, :len(s)] = 1
    return ids.to(device), mask.to(device)


def forward_capture(model: nn.Module, ids, mask, path: str, layers: list[int], backend: str,
                    routing: dict | None = None) -> dict:
    """One no-grad forward of ``ids`` on ``path`` with ``layers`` captured (routing forced if given)."""
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(models.use_path(model, path, backend=backend))
        cap = stack.enter_context(models.capture(model, layers))
        if routing:
            stack.enter_context(models.force_routing(model, routing))
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return cap


def _rows(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Token-order FC row indices (``t*k + j``) of the given flat token indices, all slots."""
    return (tokens.unsqueeze(1) * k + torch.arange(k, device=tokens.device)).reshape(-1)


# --- localization and replay ------------------------------------------------------------------

class LayerAcc:
    """Pooled sums of one condition's layer: input, FC1/FC2/MoE outputs, routing, matched rows."""

    def __init__(self, cond: str, layer: int):
        w = f"{cond} layer {layer}"
        self.h_in = L2Pool(f"{w} hidden_in")
        self.fc1, self.fc2, self.moe = L2Pool(f"{w} fc1"), L2Pool(f"{w} fc2"), L2Pool(f"{w} moe_out")
        self.c_fc1, self.c_fc2 = L2Pool(f"{w} fc1 | routing"), L2Pool(f"{w} fc2 | routing")
        self.c_moe = L2Pool(f"{w} moe_out | routing")
        self.r_l: list[torch.Tensor] = []
        self.r_s: list[torch.Tensor] = []
        self.c_r: list[torch.Tensor] = []
        self.matched = 0
        self.rows = 0


_REPLAY_KEYS = {
    "input_swap_learner": ("LR", "LL"),
    "input_swap_sampler": ("RR", "RL"),
    "path_at_sampler_input": ("RR", "LR"),
    "path_at_learner_input": ("RL", "LL"),
    "total": ("RR", "LL"),
}


class _ReplayAcc:
    def __init__(self):
        self.drift: list[float] = []
        self.values = {site: {k: [] for k in _REPLAY_KEYS} for site in ("fc1", "fc2", "moe_out")}
        self.reproduces = True


def add_natural(acc: LayerAcc, cl: dict, cs: dict, tok: torch.Tensor, k: int) -> None:
    """Add one batch under natural routing: FC rows matched by (token, expert) across the sides."""
    h = cl["hidden_in"].shape[-1]
    acc.h_in.add(cl["hidden_in"].reshape(-1, h)[tok], cs["hidden_in"].reshape(-1, h)[tok])
    rl, rs = cl["routing"][tok], cs["routing"][tok]
    acc.r_l.append(rl.cpu())
    acc.r_s.append(rs.cpu())
    t, j, j2 = (rl.unsqueeze(2) == rs.unsqueeze(1)).nonzero(as_tuple=True)
    row_l, row_s = tok[t] * k + j, tok[t] * k + j2
    acc.matched += int(t.numel())
    acc.rows += int(tok.numel()) * k
    if t.numel():
        acc.fc1.add(cl["fc1_out"][row_l], cs["fc1_out"][row_s])
        acc.fc2.add(cl["fc2_out"][row_l], cs["fc2_out"][row_s])
    acc.moe.add(cl["moe_out"][tok], cs["moe_out"][tok])


def _conditioned(acc: LayerAcc, cc: dict, cs: dict, tok: torch.Tensor, k: int) -> None:
    rows = _rows(tok, k)
    acc.c_r.append((cc["routing"][tok].sort(-1).values == cs["routing"][tok].sort(-1).values)
                   .all(-1).cpu())
    acc.c_fc1.add(cc["fc1_out"][rows], cs["fc1_out"][rows])
    acc.c_fc2.add(cc["fc2_out"][rows], cs["fc2_out"][rows])
    acc.c_moe.add(cc["moe_out"][tok], cs["moe_out"][tok])


def _replay(model, acc: _ReplayAcc, layer: int, cond: Condition, cl: dict, cs: dict, mask, backend: str,
            k: int) -> None:
    h_l, h_r = cl["hidden_in"], cs["hidden_in"]
    routing = (cl["routing"], cl["router_weights"])
    outs = {}
    for key, path, h in (("LL", cond.learner, h_l), ("LR", cond.learner, h_r),
                         ("RL", cond.sampler, h_l), ("RR", cond.sampler, h_r)):
        with models.capture(model, [layer]) as cap:
            models.replay_layer(model, layer, h, path, attention_mask=mask, routing=routing,
                                backend=backend)
        outs[key] = cap[layer]
    if not torch.equal(outs["LL"]["moe_out"], cl["moe_out"]):
        acc.reproduces = False
    b, t = mask.shape
    hdim = h_l.shape[-1]
    tok = mask.reshape(-1).nonzero().flatten()
    seq_of_tok = tok // t
    rows = _rows(tok, k)
    seq_of_row = seq_of_tok.repeat_interleave(k)
    acc.drift.extend(per_sequence_relative_l2(h_r.reshape(-1, hdim)[tok], h_l.reshape(-1, hdim)[tok],
                                              seq_of_tok, b))
    for site, sel, seq in (("fc1", rows, seq_of_row), ("fc2", rows, seq_of_row),
                           ("moe_out", tok, seq_of_tok)):
        name = site if site == "moe_out" else f"{site}_out"
        for key, (x, ref) in _REPLAY_KEYS.items():
            acc.values[site][key].extend(
                per_sequence_relative_l2(outs[x][name][sel], outs[ref][name][sel], seq, b))


def per_sequence_relative_l2(x: torch.Tensor, ref: torch.Tensor, seq: torch.Tensor, n: int) -> list[float]:
    """``‖x − ref‖ / ‖ref‖`` over the rows of each sequence (``seq``: sequence id per row, < ``n``).

    The same value as :func:`libalign.metrics.relative_l2` on each sequence's rows (float64, 0/0 →
    0, x/0 → inf), computed for all sequences at once; sequences without rows are left out.
    """
    x64, r64 = x.detach().double().reshape(x.shape[0], -1), ref.detach().double().reshape(x.shape[0], -1)
    for tensor, side in ((x64, "x"), (r64, "ref")):
        if not bool(torch.isfinite(tensor).all()):
            bad = ~torch.isfinite(tensor)
            raise NonFiniteError(f"replay rows ({side})", count=int(bad.sum()),
                                 nan=int(torch.isnan(tensor).sum()), inf=int(torch.isinf(tensor).sum()),
                                 first_indices=[tuple(bad.nonzero()[0].tolist())])
    num = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, seq, ((x64 - r64) ** 2).sum(1))
    den = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, seq, (r64 ** 2).sum(1))
    present = torch.zeros(n, dtype=torch.bool, device=x.device)
    present[seq] = True
    out = []
    for a, d, p in zip(num.sqrt().tolist(), den.sqrt().tolist(), present.tolist(), strict=True):
        if p:
            out.append(L2Pool._ratio(a, d))
    return out


def localize(model: nn.Module, sequences: Sequence[Sequence[int]], conditions: Sequence[Condition], *,
             layers: Sequence[int], replay_layers: Sequence[int], batch_size: int, pad_id: int,
             backend: str, conditioned: bool = True,
             progress: Progress | None = None) -> tuple[list[dict], list[dict], list[str]]:
    """Per-layer rows, 2×2 replay rows and the conditions skipped (same path on both sides).

    ``layers``/``replay_layers`` must be MoE layers. See the module docstring for every column.
    """
    moe = set(models.moe_layer_indices(model))
    layers = [x for x in layers if x in moe]
    replay_layers = [x for x in replay_layers if x in moe]
    todo = [c for c in conditions if c.learner != c.sampler]
    skipped = [c.name for c in conditions if c.learner == c.sampler]
    if not todo or not (layers or replay_layers):
        return [], [], skipped
    k = int(model.config.num_experts_per_tok)
    n_exp = int(model.config.num_experts)
    needed = sorted(set(layers) | set(replay_layers))
    paths = list(dict.fromkeys([p for c in todo for p in (c.learner, c.sampler)]))
    accs = {(c.name, x): LayerAcc(c.name, x) for c in todo for x in layers}
    reps = {(c.name, x): _ReplayAcc() for c in todo for x in replay_layers}
    dev = next(model.parameters()).device
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, mask = padded_batch(chunk, pad_id, dev)
        tok = mask.reshape(-1).nonzero().flatten()
        caps = {p: forward_capture(model, ids, mask, p, needed, backend) for p in paths}
        for c in todo:
            cl, cs = caps[c.learner], caps[c.sampler]
            for x in layers:
                acc = accs[(c.name, x)]
                add_natural(acc, cl[x], cs[x], tok, k)
                if conditioned:
                    forced = {x: (cs[x]["routing"], cs[x]["router_weights"])}
                    cc = forward_capture(model, ids, mask, c.learner, [x], backend, routing=forced)
                    _conditioned(acc, cc[x], cs[x], tok, k)
            for x in replay_layers:
                _replay(model, reps[(c.name, x)], x, c, cl[x], cs[x], mask, backend, k)
        if progress:
            progress(len(chunk))
    layer_rows = []
    for (cname, x), a in accs.items():
        ra = metrics.routing_agreement(torch.cat(a.r_l), torch.cat(a.r_s), num_experts=n_exp,
                                       where=f"{cname} layer {x}")
        row = {"condition": cname, "layer": x,
               "natural": {"hidden_in_rel_l2": a.h_in.symmetric(), "routing": ra.to_dict(),
                           "matched_rows": a.matched / a.rows if a.rows else None,
                           "fc1_rel_l2": a.fc1.symmetric(), "fc2_rel_l2": a.fc2.symmetric(),
                           "moe_out_rel_l2": a.moe.symmetric()}}
        if conditioned:
            row["conditioned"] = {"set_match": float(torch.cat(a.c_r).double().mean()),
                                  "fc1_rel_l2": a.c_fc1.symmetric(), "fc2_rel_l2": a.c_fc2.symmetric(),
                                  "moe_out_rel_l2": a.c_moe.symmetric()}
        layer_rows.append(row)
    replay_rows = []
    for (cname, x), a in reps.items():
        row = {"condition": cname, "layer": x, "sequences": len(a.drift),
               "input_drift": sum(a.drift) / len(a.drift), "replay_reproduces_capture": a.reproduces}
        for site, vals in a.values.items():
            row[site] = {key: _mean_finite(v) for key, v in vals.items()}
        replay_rows.append(row)
    return layer_rows, replay_rows, skipped


def _mean_finite(v: list[float]) -> float | None:
    if not v:
        return None
    return sum(v) / len(v)


# --- context swap -----------------------------------------------------------------------------

def sequence_amplitudes(model: nn.Module, sequences: Sequence[Sequence[int]], *, batch_size: int,
                        pad_id: int, backend: str, keep_layer0: bool = True
                        ) -> tuple[list[float], list[torch.Tensor]]:
    """Largest |MoE input| over MoE layers and real tokens per sequence (bf16 path); and, per
    sequence, its layer-0 (first MoE layer) MoE-input rows for the quantizer-level check."""
    moe = models.moe_layer_indices(model)
    dev = next(model.parameters()).device
    amps: list[float] = []
    rows0: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, mask = padded_batch(chunk, pad_id, dev)
        cap = forward_capture(model, ids, mask, "bf16", moe, backend)
        b, t = mask.shape
        per = torch.zeros(b, dtype=torch.float64)
        for x in moe:
            m = cap[x]["moe_in"].reshape(b, t, -1).abs().amax(-1).double().cpu()
            per = torch.maximum(per, torch.where(mask.cpu().bool(), m, torch.zeros_like(m)).amax(-1))
        amps.extend(per.tolist())
        if keep_layer0:
            h0 = cap[moe[0]]["moe_in"].reshape(b, t, -1)
            rows0.extend(h0[r][mask[r].bool()].cpu() for r in range(b))
    return amps, rows0


def _score_fixed(model: nn.Module, seqs: Sequence[Sequence[int]], prompt_len: int, width: int,
                 pad_id: int) -> torch.Tensor:
    """Learner-side log-probs of ``seqs[0]``'s completion in a batch padded to ``width``.

    The same computation as :func:`libalign.models.score_sequences` (right padding, attention
    mask, fp32 ``log_softmax`` of the logits at positions ``prompt_len−1 .. len−2``), with the
    batch width fixed by the caller so that every context has one shape.
    """
    dev = next(model.parameters()).device
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[r, :len(s)] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    n = len(seqs[0])
    logp = torch.log_softmax(logits[0, prompt_len - 1:n - 1].float(), dim=-1)
    return logp.gather(-1, ids[0, prompt_len:n].unsqueeze(-1)).squeeze(-1).cpu()


def context_swap_check(model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                       paths: Sequence[str], *, batch_size: int, pad_id: int, backend: str) -> dict:
    """Score one target sequence beside different companions on each path (module docstring).

    Every context is a batch of the same shape ``[B, W]`` with the target in row 0: companions
    made of pad tokens (the reference), the target's original batch-mates, the lowest- and the
    highest-amplitude sequences. Only the companions' content changes, so a per-row path must
    give the target identical bits. Scoring the target alone (a batch of one, width its own
    length) changes the GEMM shapes as well; it is reported beside the check, not part of it.
    """
    n = len(sequences)
    amps, rows0 = sequence_amplitudes(model, sequences, batch_size=batch_size, pad_id=pad_id,
                                      backend=backend)
    order = sorted(range(n), key=lambda i: (amps[i], i))
    target = order[n // 2]
    others = [i for i in order if i != target]
    size = max(2, min(batch_size, n))
    orig_start = (target // size) * size
    original = [target, *[i for i in range(orig_start, min(n, orig_start + size)) if i != target]]
    contexts = {
        "original": original,
        "low_amplitude": [target, *others[:size - 1]],
        "high_amplitude": [target, *others[::-1][:size - 1]],
    }
    width = max(len(sequences[i]) for idx in contexts.values() for i in idx)
    pad_row = [pad_id] * width
    batches = {"pad_companions": [sequences[target]] + [pad_row] * (size - 1)}
    for name, idx in contexts.items():
        rows = [sequences[i] for i in idx]
        batches[name] = rows + [pad_row] * (size - len(rows))
    report = {"target": target, "target_tokens": len(sequences[target]) - prompt_lens[target],
              "target_amplitude": amps[target], "reference": "pad_companions",
              "contexts": list(batches), "batch_shape": [size, width],
              "companion_amplitude": {name: max(amps[i] for i in idx if i != target)
                                      for name, idx in contexts.items()},
              "paths": {}}
    p_len = prompt_lens[target]
    for path in paths:
        with models.use_path(model, path, backend=backend):
            got = {name: _score_fixed(model, rows, p_len, width, pad_id) for name, rows in batches.items()}
            alone = _score_fixed(model, [sequences[target]], p_len, len(sequences[target]), pad_id)
        ref = got["pad_companions"]
        diffs = {name: float((v.double() - ref.double()).abs().max()) for name, v in got.items()}
        bitwise = {name: bool(torch.equal(v, ref)) for name, v in got.items()}
        report["paths"][path] = {
            "max_abs_diff": diffs, "bitwise": bitwise, "all_bitwise": all(bitwise.values()),
            "pass": all(bitwise.values()),
            "alone_batch_of_one": {"max_abs_diff": float((alone.double() - ref.double()).abs().max()),
                                   "bitwise": bool(torch.equal(alone, ref))}}
    report["quantizer_level"] = _quantizer_level(rows0, target, original, paths)
    return report


def _quantizer_level(rows0: list[torch.Tensor], target: int, original: list[int],
                     paths: Sequence[str]) -> dict:
    """:func:`libalign.context.context_swap` on layer-0 MoE inputs: target rows among companions."""
    x = torch.cat([rows0[target], *[rows0[i] for i in original if i != target]])
    n_t = rows0[target].shape[0]
    pool = torch.cat([r for i, r in enumerate(rows0) if i != target])
    out = {}
    for name in paths:
        p = get_path(name)
        if not p.quantized:
            continue
        rep = context_swap(x, range(n_t), p.act_spec, pool=pool)
        out[name] = {"spec": rep.spec_name, "target_rows": n_t, "rows": int(x.shape[0]),
                     "independent": rep.independent, "changed": rep.changed()}
    return out
