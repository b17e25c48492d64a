"""W4A4 expert GEMM benchmark: the fused emulated path against the bf16 grouped GEMM.

Cells: the miniTE module shapes, 32 experts with 256, 1,024, 4,096 or 8,192 rows each, FC1
(K=2048, N=1536) and FC2 (K=768, N=2048); bf16 activations drawn per cell, weights
quantized once beforehand (a weight version is quantized once, used for many calls).
``--uneven`` spreads each cell's rows over the experts as routing does (no count a multiple
of the 128-row tiles, so every expert's rows are padded on the way into the GEMM).

Rows, all measured in this run on the same inputs (median of CUDA-event timings):

* ``bf16``: ``torch._grouped_mm`` on the bf16 operands — the named baseline;
* ``minite``: :func:`libalign.gemm.grouped_linear` on the ``nvfp4_minite`` path, activation
  quantization (row scales) included, with the NaN/Inf check queued as a learner's step queues
  it (inside :func:`libalign.gemm.finite_checks.deferred_finite_checks`, read once after the timed
  calls: the step's one synchronisation);
* ``sync``: the same with the check read at every call (one device sync each: the behaviour
  outside a deferred block);
* ``minite nocheck``: the same without the check;
* ``naive``: the ``nvfp4_naive`` path (per-tensor activation scale: an extra max pass),
  check deferred;
* ``gemm only``: the Triton GEMM on already-quantized activations (what the fusion costs);
* ``serial graph`` / ``padded graph``: the activation pass and GEMM in one stream, as a CUDA
  graph, with rows reaching the padded layout inside the pass / by a padded copy first (the
  two differ only under ``--uneven``).

The ratio column is each row's time over ``bf16``'s. The goal rows are
geometric means over the cells: ``minite`` eager (activation quantization and the NaN/Inf
check included) at most 1.3, ``nocheck graph`` (device time, CUDA graphs) at most 1.15.
``--profile`` adds, for the fewest rows of FC1 and FC2, a torch.profiler table of ten eager
``minite`` calls' host and device time per operation (launches, the check's sync) and
writes its Chrome trace under ``$OUT``. Each cell also reports the largest difference to the
float64 reference, in bf16 ulps, on 64 sampled rows per expert. Run: ``python -m tests.bench gemm``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from contextlib import nullcontext

import torch

from libalign import gemm
from libalign.gemm.finite_checks import deferred_finite_checks
from libalign.gemm.triton_grouped import triton_gemm_available, w4a4_grouped_triton

from .measure import cuda_graph, event_ms, graph_ms

CELLS = [("FC1", 2048, 1536), ("FC2", 768, 2048)]
ROWS = (256, 1024, 4096, 8192)


def _ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    ax = ref.float().abs().clamp(min=2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(ax)) - 7)
    return float(((out.float() - ref.float()).abs() / ulp).max())


def _check(a, ew, counts, out) -> float:
    """Max ulps against the float64 reference on a row sample of every expert."""
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    take = torch.cat([torch.arange(o, o + min(64, c)) for o, c in zip(offs, counts, strict=False)])
    sub_counts = [min(64, c) for c in counts]
    cpu_w = gemm.ExpertWeights(ew.path, ew.weight.cpu(), ew.q.to("cpu"), None, ew.dec.cpu())
    ref = gemm.grouped_linear(a[take.to(a.device)].cpu(), cpu_w, sub_counts, backend="reference")
    return _ulps(out[take.to(a.device)].cpu(), ref)


def _qdq_sweep(repeats: int) -> None:
    """Activation-pass bandwidth for tile sizes and warps against a copy of the same bytes."""
    from libalign.gemm import triton_kernels as tk

    print("activation pass sweep (graph-replayed; GB/s = bytes read + written)")
    for k in (2048, 768):
        a = torch.randn(262144, k, device="cuda", dtype=torch.bfloat16)
        moved = a.numel() * 4 + a.shape[0] * 4
        dst = torch.empty_like(a)
        copy_ms = graph_ms(lambda a=a, dst=dst: dst.copy_(a), repeats)
        line = [f"K={k}: copy {2 * a.numel() * 2 / copy_ms / 1e6:.0f} GB/s"]
        for elems, warps, chunk in ((4096, 4, 0), (4096, 4, 8), (4096, 4, 16), (8192, 4, 16),
                                    (4096, 4, 32), (8192, 8, 32), (16384, 8, 16)):
            ms = graph_ms(lambda a=a, e=elems, w=warps, c=chunk: tk.act_qdq(
                a, amax_floor=1e-12, tensor_amax=None, elems=e, num_warps=w, chunk=c), repeats)
            line.append(f"{elems}/{warps}/{chunk}: {moved / ms / 1e6:.0f}")
        print("  " + "  ".join(line), flush=True)
        del a, dst


def _profile(label: str, fn, out_dir: str) -> None:
    """torch.profiler over eager calls of ``fn``: host and device time per operation."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(f"profile of 10 eager calls, {label}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    if out_dir:
        prof.export_chrome_trace(os.path.join(out_dir, f"profile_{label.replace(' ', '_')}.json"))


def expert_counts(rows: int, experts: int, uneven: bool) -> list[int]:
    """``rows`` for every expert, or with ``uneven`` a routed-like spread about that mean: from
    a quarter to 1.75 times it, each a multiple of 16 and none of 128 (every expert's rows
    then need padding to the GEMM's 128-row tiles)."""
    if not uneven:
        return [rows] * experts
    out = []
    for i in range(experts):
        c = 16 * max(1, round(rows * (0.25 + 1.5 * i / max(1, experts - 1)) / 16))
        out.append(c + 16 if c % 128 == 0 else c)
    return out


def _cell(name, k, n, rows, args, w, ew, ew_naive, tk) -> dict:
    """Measure one (GEMM, rows per expert) cell and print its line."""
    dev = w.device
    counts = expert_counts(rows, args.experts, args.uneven)
    m = sum(counts)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    lay = gemm.group_layout(counts, 128)
    offs = torch.tensor(lay.offsets(padded=False)[1:], dtype=torch.int32, device=dev)
    spec = ew.path.act_spec
    src = lay.source_rows(dev) if lay.padded_total != lay.total else None
    inner, dec = tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=None, src_rows=src)
    tiles = lay.tile_expert(128, dev)
    wt = w.transpose(1, 2)
    runs = {
        "bf16": lambda: torch._grouped_mm(a, wt, offs=offs),
        "minite": lambda: gemm.grouped_linear(a, ew, lay, backend="triton"),
        "sync": lambda: gemm.grouped_linear(a, ew, lay, backend="triton"),
        "nocheck": lambda: gemm.grouped_linear(a, ew, lay, backend="triton", check_finite=False),
        "naive": lambda: gemm.grouped_linear(a, ew_naive, lay, backend="triton"),
        "gemm": lambda: tk.grouped_gemm(inner, dec, ew.inner, ew.dec, tiles, 128),
        "serial": lambda: w4a4_grouped_triton(a, spec, ew.inner, ew.dec, lay, check_finite=False,
                                          chunks=1),
    }
    # the activations padded by a copy first, then the same pass and GEMM (the path before
    # the pass gathered rows into the padded layout itself)
    runs["padded"] = lambda: lay.unpad(tk.pipelined(
        lay.pad(a), amax_floor=spec.amax_floor, tensor_amax=None, w_inner=ew.inner, w_dec=ew.dec,
        tile_expert=tiles, pad=128)[0])
    runs["qdq"] = lambda: tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=None,
                                     src_rows=src)
    with torch.no_grad():
        # rounds interleave the variants so clock drift hits them alike; median per variant
        graphs = {f"{key} graph": cuda_graph(runs[key])
                  for key in ("bf16", "nocheck", "serial", "padded", "gemm", "qdq")}
        timed = {key: fn for key, fn in runs.items() if key not in ("qdq", "serial", "padded")}
        timed.update({key: g.replay for key, g in graphs.items()})
        samples: dict[str, list[float]] = {key: [] for key in timed}
        for _ in range(args.rounds):
            for key, fn in timed.items():
                with nullcontext() if key == "sync" else deferred_finite_checks():
                    samples[key].append(event_ms(fn, args.repeats))
        ms = {key: statistics.median(v) for key, v in samples.items()}
        ulps = _check(a, ew, counts, runs["minite"]())
        if args.profile and rows == args.rows[0]:  # the host-bound cells
            with deferred_finite_checks():
                _profile(f"{name} {rows} minite", runs["minite"], os.environ.get("OUT", ""))
    r = {key: ms[key] / ms["bf16"] for key in ms if "graph" not in key}
    r.update({key: ms[key] / ms["bf16 graph"] for key in ms if "graph" in key})
    flops = 2.0 * m * k * n
    row = {"cell": f"{name} {rows}", "ms": ms, "ratio": r, "max_ulps": ulps,
           "bf16_tflops": flops / ms["bf16"] / 1e9, "minite_tflops": flops / ms["minite"] / 1e9}
    cols = ["bf16", "minite", "sync", "nocheck", "naive", "gemm", "bf16 graph", "nocheck graph",
            "serial graph", "padded graph", "gemm graph", "qdq graph"]
    print(f"{row['cell']:<11}" + "".join(f"{ms[c]:>8.3f}{r[c]:>6.2f}" for c in cols)
          + f"{ulps:>6.1f}", flush=True)
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench gemm")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also sweep the activation pass's tiles")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of eager calls")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--uneven", action="store_true",
                    help="experts' rows spread about --rows (each padded to the tiles)")
    ap.add_argument("--json", default=os.environ.get("OUT", "") and os.path.join(os.environ["OUT"],
                                                                                   "bench_gemm.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench gemm needs a CUDA device; skipped")
        return 0
    if not triton_gemm_available("cuda"):
        print("bench gemm: Triton W4A4 kernels unavailable on this device")
        return 1
    from libalign.gemm import triton_kernels as tk

    dev = "cuda"
    torch.manual_seed(0)
    if args.sweep:
        _qdq_sweep(args.repeats)
    results = []
    header = (f"{'cell':<11}" + "".join(f"{c:>14}" for c in (
        "bf16 ms  x", "minite", "sync", "nocheck", "naive", "gemm", "bf16 graph", "nocheck gr", "serial gr",
        "padded gr", "gemm gr", "qdq gr")) + f"{'ulps':>6}")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(header)
    for name, k, n in CELLS:
        w = (torch.randn(args.experts, n, k, device=dev) * 0.02).to(torch.bfloat16)
        ew = gemm.prepare_weights(w, "nvfp4_minite")
        ew_naive = gemm.prepare_weights(w, "nvfp4_naive")
        for rows in args.rows:
            results.append(_cell(name, k, n, rows, args, w, ew, ew_naive, tk))
    geo = {key: math.exp(statistics.fmean(math.log(x["ratio"][key]) for x in results))
           for key in ("minite", "sync", "nocheck", "naive", "gemm", "nocheck graph", "serial graph",
                       "padded graph", "gemm graph")}
    print("geometric mean of ratios over bf16: "
          + ", ".join(f"{key} {v:.3f}" for key, v in geo.items()))
    print("goals (same-run bf16 baselines):")
    for key, label, target in (("minite", "W4A4 + activation quantization, eager", 1.3),
                               ("sync", "  ... the check synchronising every call", 1.3),
                               ("nocheck graph", "W4A4 + activation quantization, CUDA graphs",
                                1.15)):
        print(f"  {label:48} {geo[key]:6.3f}  goal <= {target}  "
              f"{'met' if geo[key] <= target else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": results, "geomean": geo, "device": torch.cuda.get_device_name()}, f,
                      indent=1)
    return 0
