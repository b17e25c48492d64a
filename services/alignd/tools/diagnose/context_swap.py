"""The context-swap test at one expert's FC1 GEMM, as the miniTE paper runs it.

The paper holds eight target activation rows fixed in a 128-row FC1 input of one expert at
one layer (Qwen3-30B-A3B: a 128×2048 input against the 1536×2048 fused gate/up weight) and
swaps everything around them. Here, on whatever model is diagnosed:

1. every shared sequence runs once on the ``bf16`` path (the paper captures BF16 sampler
   activations); the MoE-module inputs of layer ``layer`` (default: the first MoE layer) are
   kept per sequence, and the expert is the one routed the most rows there;
2. ``cases`` sequences are the cases (the shortest, the median and the longest, as the paper
   takes prompts of three lengths); each case's rows are that sequence's MoE inputs, its
   targets the middle eight by max |x|, its companion pool every other sequence's rows;
3. :func:`gemm_context_swap` builds the four contexts (original companions,
   zero-padded to 128 rows when the sequence is short; the lowest- and highest-amplitude pool
   rows; all companions zero) and multiplies each by the expert's FC1 weight ``[2I, H]`` on
   every quantized path and on :data:`PER_TENSOR_RHT`, the negative case: TE's per-tensor
   recipe with the 16-point random Hadamard transform on both operands (the defining product
   of the rotated operands, float64 accumulation), whose shared amax moves with the companions.

Per case, path and context the report holds the target rows' payload and block-scale hashes,
their row factors (the outer scale each target row decodes with: one per row on a row-scaled
path, the shared one on a per-tensor path), the hash of the bf16 target outputs, and whether
each equals the original context bit for bit. A row-scaled path must keep all of them; a
per-tensor one changes whenever the companions move the shared amax (and not when they
don't: the paper's high-amplitude 1,024-token case is such a negative control).

The whole-model batch check (:func:`alignd.tools.diagnose.localize.context_swap_check`:
target sequence scored beside other sequences, log-probs compared) answers a different
question (the whole network's batch invariance) and is reported under its own name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.markup import escape
from rich.table import Table
from torch import nn

from alignd.tools.diagnose.localize import padded_batch
from libalign import models
from libalign.context import amplitude_companions
from libalign.errors import ShapeError
from libalign.gemm import ExecutionPath, get_path, grouped_linear, prepare_weights
from libalign.gemm.inner import w4a4_reference
from libalign.spec import PRESETS, NVFP4Tensor, quantize

# --- through the GEMM, as the miniTE paper runs it --------------------------------------------

#: The negative reference: per-tensor NVFP4 (TE's recipe) with the Hadamard rotation on.
PER_TENSOR_RHT = "per_tensor_rht"
GEMM_CONTEXTS = ("original", "low_amplitude", "high_amplitude", "padded")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class GemmSwapCase:
    """One context on one path: hashes of the target rows and whether each equals the original."""

    context: str
    companions: int
    padding: int
    payload_sha256: str
    block_scale_sha256: str
    row_factors: tuple[float, ...]
    output_sha256: str
    payload_equal: bool
    scales_equal: bool
    factors_equal: bool
    output_equal: bool

    @property
    def identical(self) -> bool:
        """Payload, block scales, row factors and GEMM outputs all bitwise equal."""
        return self.payload_equal and self.scales_equal and self.factors_equal and self.output_equal


@dataclass(frozen=True)
class GemmSwapReport:
    """Every context of one case on one path."""

    path: str
    target_positions: tuple[int, ...]
    shape: tuple[int, int]
    weight_shape: tuple[int, int]
    cases: tuple[GemmSwapCase, ...]

    @property
    def independent(self) -> bool:
        """True when the target rows are bitwise identical in every context."""
        return all(c.identical for c in self.cases)

    def to_dict(self) -> dict:
        """Plain data for a JSON report."""
        return {"path": self.path, "target_positions": list(self.target_positions),
                "shape": list(self.shape), "weight_shape": list(self.weight_shape),
                "independent": self.independent,
                "cases": [dict(c.__dict__, row_factors=list(c.row_factors), identical=c.identical)
                          for c in self.cases]}


def swap_matrices(prompt_rows: torch.Tensor, pool: torch.Tensor, *, m: int = 128,
                  n_targets: int = 8) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """The ``[m, K]`` FC1 inputs of the four contexts, the target positions, and counts.

    Targets: the middle ``n_targets`` of the prompt's rows sorted by max |x| (stable), placed
    at the middle positions of the matrix. Companions fill the other positions in order, then
    zero rows up to ``m``. ``pool`` must not hold the prompt's rows (the caller excludes them).
    """
    if prompt_rows.ndim != 2 or pool.ndim != 2 or pool.shape[1] != prompt_rows.shape[1]:
        raise ShapeError(f"prompt rows and pool must be [n, K] and [P, K], got "
                         f"{tuple(prompt_rows.shape)} and {tuple(pool.shape)}")
    n = prompt_rows.shape[0]
    if n < n_targets or m < n_targets or n_targets < 1:
        raise ShapeError(f"need 1 <= n_targets ({n_targets}) <= prompt rows ({n}) and <= m ({m})")
    order = torch.argsort(prompt_rows.float().abs().amax(-1), stable=True)
    lo = (n - n_targets) // 2
    tgt = order[lo:lo + n_targets]
    rest = torch.ones(n, dtype=torch.bool)
    rest[tgt] = False
    own = prompt_rows[rest][:m - n_targets]
    n_comp = own.shape[0]
    if n_comp and pool.shape[0] == 0:
        raise ShapeError("the companion pool is empty")
    start = (m - n_targets) // 2
    pos = torch.arange(start, start + n_targets)
    comp_pos = torch.cat([torch.arange(0, start), torch.arange(start + n_targets, m)])[:n_comp]
    zeros = torch.zeros((0, prompt_rows.shape[1]), dtype=prompt_rows.dtype)
    companions = {"original": own,
                  "low_amplitude": amplitude_companions(pool, n_comp, highest=False) if n_comp else zeros,
                  "high_amplitude": amplitude_companions(pool, n_comp, highest=True) if n_comp else zeros,
                  "padded": None}
    out = {}
    for name in GEMM_CONTEXTS:
        x = torch.zeros((m, prompt_rows.shape[1]), dtype=prompt_rows.dtype)
        x[pos] = prompt_rows[tgt]
        if companions[name] is not None:
            x[comp_pos] = companions[name].to(x.dtype)
        out[name] = x
    counts = {"original": n_comp, "low_amplitude": n_comp, "high_amplitude": n_comp, "padded": 0}
    return out, pos, counts


def _runner(path: str | ExecutionPath, weight: torch.Tensor, backend: str):
    """``x -> (activation NVFP4 of x, bf16 x @ weight^T)`` on a path or :data:`PER_TENSOR_RHT`."""
    if path == PER_TENSOR_RHT:
        a_spec = PRESETS["te"].replace(name="te_rht", hadamard=True)
        qw = quantize(weight, PRESETS["te"].replace(name="te_rht_weight", hadamard=True))

        def run(x):
            qa = quantize(x, a_spec)
            return qa, w4a4_reference(qa, qw, torch.bfloat16)
        return run
    p = get_path(path)
    if not p.quantized:
        raise ShapeError(f"path {p.name!r} does not quantize; the context swap compares NVFP4 bits")
    ew = prepare_weights(weight[None], p)

    def run(x):
        return quantize(x, p.act_spec), grouped_linear(x, ew, [x.shape[0]], backend=backend)
    return run


def _row_factors(q: NVFP4Tensor, rows: torch.Tensor) -> torch.Tensor:
    if q.outer_scale is None:
        return torch.ones(1, dtype=torch.float32)
    if q.outer_scale.ndim == 0:
        return q.outer_scale.reshape(1).float()
    return q.outer_scale[rows].float()


def gemm_context_swap(prompt_rows: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor,
                      path: str | ExecutionPath, *, m: int = 128, n_targets: int = 8,
                      backend: str = "torch") -> GemmSwapReport:
    """The four contexts (:func:`swap_matrices`) through ``path``'s FC1 GEMM with ``weight``
    ``[N, K]`` (one expert's FC1), compared with the original context bit for bit."""
    if weight.ndim != 2 or weight.shape[1] != prompt_rows.shape[-1]:
        raise ShapeError(f"FC1 weight must be [N, {prompt_rows.shape[-1]}], got {tuple(weight.shape)}")
    mats, pos, counts = swap_matrices(prompt_rows, pool, m=m, n_targets=n_targets)
    run = _runner(path, weight, backend)
    base = None
    cases = []
    for name in GEMM_CONTEXTS:
        with torch.no_grad():
            q, out = run(mats[name].to(weight.device))
        view = (q.codes[pos].cpu(), q.block_scales[pos].view(torch.uint8).cpu(),
                _row_factors(q, pos).cpu(), out[pos].detach().cpu())
        if base is None:
            base = view
        eq = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(view, base, strict=True)]
        cases.append(GemmSwapCase(name, counts[name], m - n_targets - counts[name], _sha(view[0]),
                                  _sha(view[1]), tuple(view[2].tolist()), _sha(view[3]), *eq))
    name = path if isinstance(path, str) else path.name
    return GemmSwapReport(name, tuple(pos.tolist()), (m, prompt_rows.shape[1]),
                          tuple(weight.shape), tuple(cases))


# --- on the diagnosed model --------------------------------------------------------------------

def _capture_rows(model: nn.Module, sequences: Sequence[Sequence[int]], layer: int, *,
                  batch_size: int, pad_id: int, backend: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per sequence, its real tokens' MoE inputs at ``layer`` (bf16 path); rows routed per expert."""
    dev = next(model.parameters()).device
    n_exp = int(model.config.num_experts)
    rows: list[torch.Tensor] = []
    load = torch.zeros(n_exp, dtype=torch.long)
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, mask = padded_batch(chunk, pad_id, "cpu")
        width = ids.shape[1]
        with torch.no_grad(), models.use_path(model, "bf16", backend=backend), \
                models.capture(model, [layer]) as cap:
            model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False)
        real = mask.reshape(-1).bool()
        h = cap[layer]["moe_in"].reshape(len(chunk) * width, -1).cpu()
        routing = cap[layer]["routing"].reshape(len(chunk) * width, -1).cpu()
        load += torch.bincount(routing[real].reshape(-1), minlength=n_exp)
        h = h.reshape(len(chunk), width, -1)
        rows.extend(h[r][mask[r].bool()] for r in range(len(chunk)))
    return rows, load


def _case_indices(lengths: list[int], cases: int) -> list[int]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    picks = [order[0], order[len(order) // 2], order[-1]] if cases >= 3 else order[:cases]
    picks += [i for i in order if i not in picks]
    return list(dict.fromkeys(picks))[:cases]


def fc1_context_swap(model: nn.Module, sequences: Sequence[Sequence[int]], paths: Sequence[str], *,
                     batch_size: int, pad_id: int, backend: str, layer: int | None = None,
                     cases: int = 3, m: int = 128, n_targets: int = 8) -> dict:
    """Run the paper's FC1 context swap on ``paths`` (quantized ones) plus the RHT reference."""
    moe = models.moe_layer_indices(model)
    layer = moe[0] if layer is None else layer
    if layer not in moe:
        raise ShapeError(f"layer {layer} has no routed experts; MoE layers: {moe}")
    if len(sequences) < 2:
        raise ShapeError("the context swap needs at least two sequences (a case and a pool)")
    rows, load = _capture_rows(model, sequences, layer, batch_size=batch_size, pad_id=pad_id,
                               backend=backend)
    expert = int(torch.argmax(load))
    weight = models.experts_module(model, layer).gate_up_proj[expert].detach()
    n_targets = min(n_targets, min(r.shape[0] for r in rows))
    quantized = [p for p in dict.fromkeys(paths) if get_path(p).quantized]
    report = {"layer": layer, "expert": expert, "expert_rows": int(load[expert]),
              "m": m, "n_targets": n_targets, "weight_shape": list(weight.shape),
              "input_shape": [m, int(weight.shape[1])], "reference": PER_TENSOR_RHT,
              "paths": [*quantized, PER_TENSOR_RHT], "cases": []}
    for idx in _case_indices([r.shape[0] for r in rows], cases):
        pool = torch.cat([r for i, r in enumerate(rows) if i != idx])
        case = {"sequence": idx, "rows": int(rows[idx].shape[0]), "paths": {}}
        for p in report["paths"]:
            rep = gemm_context_swap(rows[idx].to(weight.dtype), pool.to(weight.dtype), weight, p,
                                    m=m, n_targets=n_targets, backend=backend)
            case["paths"][p] = rep.to_dict()
        report["cases"].append(case)
    report["independent"] = {p: all(c["paths"][p]["independent"] for c in report["cases"])
                             for p in report["paths"]}
    return report


def _factors(v: list[float]) -> str:
    if len(v) == 1:
        return f"{v[0]:.6g} (shared)"
    return f"{min(v):.6g}..{max(v):.6g} ({len(v)} rows)"


def fc1_context_table(report: dict) -> Table | None:
    """One row per case, path and context: hashes (first 10 hex digits), factors, equalities."""
    if not report:
        return None
    t = Table(title=escape(
        f"FC1 context swap (layer {report['layer']}, expert {report['expert']}): "
        f"{report['n_targets']} target rows at fixed positions of a {report['input_shape'][0]}×"
        f"{report['input_shape'][1]} input, weight {report['weight_shape'][0]}×"
        f"{report['weight_shape'][1]}; '=' bitwise equal to the original context"),
        title_justify="left")
    for col in ("seq (rows)", "path", "context", "companions/pad", "payload sha256",
                "block-scale sha256", "row factors", "target output sha256", "equal P/S/F/O"):
        t.add_column(col)
    for case in report["cases"]:
        for p, r in case["paths"].items():
            for c in r["cases"]:
                eq = "/".join("=" if c[k] else "≠" for k in
                              ("payload_equal", "scales_equal", "factors_equal", "output_equal"))
                t.add_row(f"{case['sequence']} ({case['rows']})", escape(p), c["context"],
                          f"{c['companions']}/{c['padding']}", c["payload_sha256"][:10],
                          c["block_scale_sha256"][:10], _factors(c["row_factors"]),
                          c["output_sha256"][:10], eq)
    return t
