"""W4A4 expert GEMM benchmark: the fused emulated path against the bf16 grouped GEMM.

Cells: the miniTE module shapes, 32 experts with 256, 1,024, 4,096 or 8,192 rows each, FC1
(K=2048, N=1536) and FC2 (K=768, N=2048); bf16 activations drawn per cell, weights
quantized once beforehand (a weight version is quantized once, used for many calls).

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
* ``inner``: ``minite`` in the one-phase form (the activation pass writes a bf16 inner-value
  tensor the GEMM reads; :func:`libalign.gemm.triton_grouped.gemm_codes` off), beside the
  two-phase form every other W4A4 row runs (codes and scale bytes decoded in the GEMM's
  loads), in the same run;
* ``trace``: ``minite`` with every row rounded by a sampler's record (TRACE, 2 low bits a
  value, records of a perturbed copy of the activations), check deferred.

``graph`` rows are device time of a CUDA graph of the call (``nocheck``, ``inner``, ``trace``
without the check; ``gemm``/``codes gemm`` and ``qdq``/``codes qdq`` the one- and two-phase
kernels alone). The ratio column is each row's time over ``bf16``'s (graphs: over ``bf16
graph``'s). The goal rows are geometric means over the cells: issue 21 item 3, ``minite``
eager (activation quantization and the NaN/Inf check included) at most 1.3 and ``nocheck
graph`` at most 1.15; the two-phase form's, ``minite`` eager at most 1.20, ``nocheck graph``
at most 1.10, and ``trace`` eager at most 1.05 times ``minite``.
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
from libalign.gemm.triton_grouped import gemm_codes, triton_gemm_available, w4a4_grouped_triton
from libalign.guidance import RowGuide
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import low_bits

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


def _guide(a: torch.Tensor, tk) -> RowGuide:
    """Records for every row of ``a``: a sampler's 2 low code bits, block and row scales of a
    perturbed copy (quantized by the activation pass itself: its bits are the spec's)."""
    noisy = a + 0.01 * torch.randn_like(a) * a.float().abs().mean().to(a.dtype)
    codes, scales, dec = tk.act_codes(noisy, amax_floor=1e-12, tensor_amax=None)
    m = a.shape[0]
    return RowGuide(2, torch.ones(m, dtype=torch.bool, device=a.device),
                    torch.arange(m, device=a.device), low_bits(unpack_nibbles(codes), 2),
                    scales, dec)


def _one_phase(key: str) -> bool:
    """Rows timed in the one-phase form (a bf16 inner-value tensor between the kernels)."""
    return key.startswith("inner")


def _cell(name, k, n, rows, args, w, ew, ew_naive, ew_trace, tk) -> dict:
    """Measure one (GEMM, rows per expert) cell and print its line."""
    dev = w.device
    counts = [rows] * args.experts
    m = rows * args.experts
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    lay = gemm.group_layout(counts, 128)
    offs = torch.tensor(lay.offsets(padded=False)[1:], dtype=torch.int32, device=dev)
    spec = ew.path.act_spec
    inner, dec = tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=None)
    codes, scales, _ = tk.act_codes(a, amax_floor=spec.amax_floor, tensor_amax=None)
    guide = _guide(a, tk)
    tiles = lay.tile_expert(128, dev)
    wt = w.transpose(1, 2)
    runs = {
        "bf16": lambda: torch._grouped_mm(a, wt, offs=offs),
        "minite": lambda: gemm.grouped_linear(a, ew, lay, backend="triton"),
        "sync": lambda: gemm.grouped_linear(a, ew, lay, backend="triton"),
        "nocheck": lambda: gemm.grouped_linear(a, ew, lay, backend="triton", check_finite=False),
        "naive": lambda: gemm.grouped_linear(a, ew_naive, lay, backend="triton"),
        "inner": lambda: gemm.grouped_linear(a, ew, lay, backend="triton"),
        "trace": lambda: gemm.grouped_linear(a, ew_trace, lay, backend="triton", act_guide=guide),
        "gemm": lambda: tk.grouped_gemm(inner, dec, ew.inner, ew.dec, tiles, 128),
        "codes gemm": lambda: tk.grouped_gemm_codes(codes, scales, dec, ew.inner, ew.dec, tiles,
                                                    128),
    }
    untimed = {  # graphed only
        "serial": lambda: w4a4_grouped_triton(a, spec, ew.inner, ew.dec, lay, check_finite=False,
                                              chunks=1),
        "inner nocheck": runs["nocheck"],
        "trace nocheck": lambda: gemm.grouped_linear(a, ew_trace, lay, backend="triton",
                                                     act_guide=guide, check_finite=False),
        "qdq": lambda: tk.act_qdq(a, amax_floor=spec.amax_floor, tensor_amax=None),
        "codes qdq": lambda: tk.act_codes(a, amax_floor=spec.amax_floor, tensor_amax=None),
    }
    with torch.no_grad():
        # rounds interleave the variants so clock drift hits them alike; median per variant
        graphs = {}
        for key in ("bf16", "nocheck", "serial", "inner nocheck", "trace nocheck", "gemm",
                    "codes gemm", "qdq", "codes qdq"):
            with gemm_codes(not _one_phase(key)):
                graphs[f"{key.replace(' nocheck', '')} graph"] = cuda_graph(
                    {**runs, **untimed}[key])
        timed = dict(runs)
        timed.update({key: g.replay for key, g in graphs.items()})
        samples: dict[str, list[float]] = {key: [] for key in timed}
        for _ in range(args.rounds):
            for key, fn in timed.items():
                with nullcontext() if key == "sync" else deferred_finite_checks(), \
                        gemm_codes(not _one_phase(key)):
                    samples[key].append(event_ms(fn, args.repeats))
        ms = {key: statistics.median(v) for key, v in samples.items()}
        with gemm_codes(True):
            out = runs["minite"]()
        with gemm_codes(False):
            same = bool(torch.equal(out, runs["inner"]()))
        ulps = _check(a, ew, counts, out)
        if args.profile and rows == args.rows[0]:  # the host-bound cells
            with deferred_finite_checks():
                _profile(f"{name} {rows} minite", runs["minite"], os.environ.get("OUT", ""))
    r = {key: ms[key] / ms["bf16"] for key in ms if "graph" not in key}
    r.update({key: ms[key] / ms["bf16 graph"] for key in ms if "graph" in key})
    r["trace/minite"] = ms["trace"] / ms["minite"]
    flops = 2.0 * m * k * n
    row = {"cell": f"{name} {rows}", "ms": ms, "ratio": r, "max_ulps": ulps,
           "one_phase_bits_equal": same,
           "bf16_tflops": flops / ms["bf16"] / 1e9, "minite_tflops": flops / ms["minite"] / 1e9}
    print(f"{row['cell']:<11}" + "".join(f"{ms[c]:>8.3f}{r[c]:>6.2f}" for c in COLUMNS)
          + f"{ulps:>6.1f}{'' if same else '  BITS DIFFER from the one-phase form'}", flush=True)
    return row


COLUMNS = ["bf16", "minite", "sync", "nocheck", "naive", "inner", "trace", "gemm", "codes gemm",
           "bf16 graph", "nocheck graph", "inner graph", "trace graph", "serial graph",
           "gemm graph", "codes gemm graph", "qdq graph", "codes qdq graph"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench gemm")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also sweep the activation pass's tiles")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of eager calls")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
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
    header = (f"{'cell':<11}" + "".join(f"{c.replace('graph', 'gr'):>14}" for c in (
        ["bf16 ms  x", *COLUMNS[1:]])) + f"{'ulps':>6}")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(header)
    for name, k, n in CELLS:
        w = (torch.randn(args.experts, n, k, device=dev) * 0.02).to(torch.bfloat16)
        ew = gemm.prepare_weights(w, "nvfp4_minite")
        ew_naive = gemm.prepare_weights(w, "nvfp4_naive")
        ew_trace = gemm.prepare_weights(w, "nvfp4_trace")
        for rows in args.rows:
            results.append(_cell(name, k, n, rows, args, w, ew, ew_naive, ew_trace, tk))
    geo = {key: math.exp(statistics.fmean(math.log(x["ratio"][key]) for x in results))
           for key in ("minite", "sync", "nocheck", "naive", "inner", "trace", "trace/minite",
                       "gemm", "codes gemm", "nocheck graph", "inner graph", "trace graph",
                       "serial graph", "gemm graph", "codes gemm graph", "qdq graph",
                       "codes qdq graph")}
    print("geometric mean of ratios over bf16: "
          + ", ".join(f"{key} {v:.3f}" for key, v in geo.items()))
    print("two-phase and one-phase outputs bit-equal in every cell:",
          all(x["one_phase_bits_equal"] for x in results))
    print("goals (same-run bf16 baselines; W4A4 rows in the two-phase form, 'inner' the one-phase):")
    for key, label, target in (
            ("minite", "issue 21 item 3: W4A4 + activation quantization, eager", 1.3),
            ("sync", "  ... the check synchronising every call", 1.3),
            ("nocheck graph", "issue 21 item 3: ... CUDA graphs", 1.15),
            ("minite", "two-phase: W4A4 + activation quantization, eager", 1.20),
            ("nocheck graph", "two-phase: ... device time, CUDA graphs", 1.10),
            ("trace/minite", "two-phase: TRACE with records over minite, eager", 1.05),
            ("inner", "(one-phase form, eager; no goal)", None),
            ("inner graph", "(one-phase form, CUDA graphs; no goal)", None)):
        verdict = "" if target is None else \
            f"  goal <= {target}  {'met' if geo[key] <= target else 'NOT met'}"
        print(f"  {label:56} {geo[key]:6.3f}{verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": results, "geomean": geo, "device": torch.cuda.get_device_name()}, f,
                      indent=1)
    return 0
