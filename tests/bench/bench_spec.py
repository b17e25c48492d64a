"""Quantize throughput of libalign's reference ``quantize`` against the peer quantizers.

Workload: the Qwen3-30B-A3B expert shapes of the project's anchor file
``converter_cpu_peers.json``: ``E`` experts of 1536x2048 (gate/up) and ``E`` experts of
2048x768 (down), BF16, seeded standard-normal data. Every quantizer runs in this one
process on the same inputs; each figure is the best of ``--repeats`` wall times (the
repeats go round-robin over the quantizers, after one untimed warm-up call each on a
small input). ``torch.set_num_threads`` is left at its default.

Effective bandwidth GB/s = (bytes in + bytes out) / seconds, with bytes in the BF16 input
and bytes out = packed codes + E4M3 block scales + outer scale(s), as each quantizer
returned them. ``vs torchao`` / ``vs modelopt`` are speed-ups: the baseline's seconds
divided by the row's seconds (above 1 = faster than the baseline).

Run: ``python -m tests.bench spec [-- --quick]`` or ``python -m tests.bench.bench_spec``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from libalign.spec import PRESETS, quantize

REPO = Path(__file__).resolve().parents[2]
ANCHOR_NAME = "converter_cpu_peers.json"
#: gate/up and down expert matrices of one Qwen3-30B-A3B MoE layer ([M, K]).
FULL_SHAPES = ((1536, 2048), (2048, 768))
QUICK_SHAPES = ((96, 128), (128, 64))
BASELINE_TORCHAO = "torchao to_nvfp4 per-tensor"
BASELINE_MODELOPT = "ModelOpt NVFP4QTensor.quantize"
TORCHAO_ROW = "torchao to_nvfp4 row-scaled"

# (codes uint8, block-scale bytes uint8, outer scale or None), one per produced tensor
Bits = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass
class Quantizer:
    """One timed row: ``run(stacks) -> list of Bits`` over the whole workload."""

    name: str
    granularity: str
    run: Callable[[list[torch.Tensor]], list[Bits]]
    times: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)  # minor page faults of each timed run
    bytes_out: int = 0
    bits: list[Bits] | None = None
    error: str | None = None

    @property
    def best(self) -> float | None:
        return min(self.times) if self.times else None


# --- the quantizers -------------------------------------------------------------------


def _libalign_bits(q) -> Bits:
    return q.codes, q.block_scales.view(torch.uint8), q.outer_scale


def _libalign(preset: str, per_matrix: bool) -> Callable[[list[torch.Tensor]], list[Bits]]:
    spec = PRESETS[preset]

    def run(stacks: list[torch.Tensor]) -> list[Bits]:
        if per_matrix:
            return [_libalign_bits(quantize(w, spec)) for s in stacks for w in s]
        return [_libalign_bits(quantize(s, spec)) for s in stacks]

    return run


def _peers():
    """The test suite's peer adapters (tests/libalign/peers.py, formerly tests/spec/)."""
    try:
        from tests.libalign import peers
    except ImportError:
        from tests.spec import peers
    return peers


def _torchao_tensor(stacks: list[torch.Tensor]) -> list[Bits]:
    peers = _peers()
    return [peers.torchao(s) for s in stacks]


def _torchao_row(stacks: list[torch.Tensor]) -> list[Bits]:
    """torchao's NVFP4Tensor.to_nvfp4 with one outer scale per output row.

    torchao has no row domain; its per-expert path (``per_tensor_scale`` of shape
    [E, 1, 1]) is used with every row as its own "expert": the stack is viewed as
    [E*M, 1, K] and ``per_tensor_scale = row amax / 2688`` has shape [E*M, 1, 1]. The
    arithmetic is torchao's own ``nvfp4_quantize``, element for element.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    out = []
    for s in stacks:
        k = s.shape[-1]
        rows = s.contiguous().view(-1, 1, k)
        pts = per_tensor_amax_to_scale(torch.amax(torch.abs(rows), dim=(1, 2))).view(-1, 1, 1)
        t = NVFP4Tensor.to_nvfp4(rows, block_size=16, per_tensor_scale=pts)
        out.append((t.qdata.view(torch.uint8).view(*s.shape[:-1], -1),
                    t.scale.view(torch.uint8).view(*s.shape[:-1], -1),
                    pts.reshape(s.shape[:-1])))
    return out


def _modelopt(stacks: list[torch.Tensor]) -> list[Bits]:
    # Called directly (the test adapter clones its input; quantize does not modify it).
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    out = []
    for s in stacks:
        for w in s:
            qt, wsf, wsf2 = NVFP4QTensor.quantize(w, 16)
            out.append((qt._quantized_data.view(torch.uint8), wsf.view(torch.uint8),
                        wsf2.reshape(-1)))
    return out


def _compressed_tensors(stacks: list[torch.Tensor]) -> list[Bits]:
    peers = _peers()
    return [peers.compressed_tensors(w) for s in stacks for w in s]


def quantizers() -> list[Quantizer]:
    return [
        Quantizer("libalign minite", "row", _libalign("minite", per_matrix=False)),
        Quantizer("libalign torchao", "expert", _libalign("torchao", per_matrix=False)),
        Quantizer("libalign modelopt", "matrix", _libalign("modelopt", per_matrix=True)),
        Quantizer("libalign compressed_tensors", "matrix",
                  _libalign("compressed_tensors", per_matrix=True)),
        Quantizer("libalign te", "matrix", _libalign("te", per_matrix=True)),
        Quantizer(BASELINE_TORCHAO, "expert", _torchao_tensor),
        Quantizer(TORCHAO_ROW, "row", _torchao_row),
        Quantizer(BASELINE_MODELOPT, "matrix", _modelopt),
        Quantizer("compressed-tensors NVFP4", "matrix", _compressed_tensors),
    ]


#: libalign preset row -> the peer row whose bits it must reproduce.
BIT_PAIRS = {
    "libalign torchao": BASELINE_TORCHAO,
    "libalign modelopt": BASELINE_MODELOPT,
    "libalign compressed_tensors": "compressed-tensors NVFP4",
}


# --- measurement ----------------------------------------------------------------------


def make_workload(experts: int, shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((experts, m, k), generator=gen, dtype=torch.float32).to(torch.bfloat16)
            for m, k in shapes]


def _nbytes(bits: list[Bits]) -> int:
    total = 0
    for codes, scales, outer in bits:
        total += codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
        if outer is not None:
            total += outer.numel() * outer.element_size()
    return total


def _same_bits(a: list[Bits], b: list[Bits]) -> bool:
    """Codes and block-scale bytes identical, outer scales equal as fp32 values."""
    flat = [(torch.cat([x[i].reshape(-1) for x in bits]) if bits else None) for bits in (a, b)
            for i in (0, 1)]
    if not (torch.equal(flat[0], flat[2]) and torch.equal(flat[1], flat[3])):
        return False
    oa = torch.cat([x[2].reshape(-1).float() for x in a if x[2] is not None])
    ob = torch.cat([x[2].reshape(-1).float() for x in b if x[2] is not None])
    return oa.shape == ob.shape and torch.equal(oa, ob)


def measure(qs: list[Quantizer], stacks: list[torch.Tensor], repeats: int,
            warmup: list[torch.Tensor]) -> tuple[float, float]:
    """Time every quantizer; returns the 1-minute load average before and after."""
    load_before = os.getloadavg()[0]
    for q in qs:  # imports, lazily built tables, first-call dispatch: untimed
        try:
            q.run(warmup)
        except Exception as exc:
            q.error = f"{type(exc).__name__}: {exc}"
    for _ in range(repeats):
        for q in qs:
            if q.error:
                continue
            q.bits = None
            gc.collect()
            try:
                flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                bits = q.run(stacks)
                q.times.append(time.perf_counter() - start)
                q.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt)
            except Exception as exc:
                q.error = f"{type(exc).__name__}: {exc}"
                continue
            q.bits = bits
            q.bytes_out = _nbytes(bits)
    return load_before, os.getloadavg()[0]


def row_variant_check(qs: list[Quantizer], stacks: list[torch.Tensor]) -> bool | None:
    """Untimed: does libalign's torchao preset with a row domain give the row-scaled bits?"""
    peer = next(q for q in qs if q.name == TORCHAO_ROW).bits
    if peer is None:
        return None
    spec = PRESETS["torchao"].replace(name="torchao_row", outer_domain="row")
    return _same_bits([_libalign_bits(quantize(s, spec)) for s in stacks], peer)


# --- reporting ------------------------------------------------------------------------


def _malloc_heap_only() -> bool:
    """glibc: stop serving large blocks with mmap and never trim the heap (M_MMAP_MAX=0)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(
            libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1)))
    except (OSError, AttributeError):
        return False


def find_anchor(explicit: str | None) -> Path | None:
    candidates = [Path(explicit)] if explicit else []
    if os.environ.get("LIBALIGN_ANCHORS"):
        candidates.append(Path(os.environ["LIBALIGN_ANCHORS"]) / ANCHOR_NAME)
    candidates += [REPO / "shared" / "anchors" / ANCHOR_NAME,
                   REPO.parent / "shared" / "anchors" / ANCHOR_NAME]
    return next((p for p in candidates if p.is_file()), None)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def build_results(qs, stacks, repeats, anchor_path, row_check=None,
                  load=(None, None), no_mmap=False) -> dict[str, Any]:
    bytes_in = sum(s.numel() * s.element_size() for s in stacks)
    by_name = {q.name: q for q in qs}
    base_ao = by_name[BASELINE_TORCHAO].best
    base_mo = by_name[BASELINE_MODELOPT].best
    rows = []
    for q in qs:
        t = q.best
        rows.append({
            "quantizer": q.name,
            "outer_granularity": q.granularity,
            "seconds": t,
            "all_seconds": q.times,
            "minor_faults_best_run": q.faults[q.times.index(t)] if q.times else None,
            "bytes_out": q.bytes_out or None,
            "GBps": None if t is None else (bytes_in + q.bytes_out) / t / 1e9,
            "vs_torchao": None if t is None or base_ao is None else base_ao / t,
            "vs_modelopt": None if t is None or base_mo is None else base_mo / t,
            "error": q.error,
        })
    bit_checks = {}
    for mine, peer in BIT_PAIRS.items():
        a, b = by_name[mine].bits, by_name[peer].bits
        bit_checks[f"{mine} == {peer}"] = None if a is None or b is None else _same_bits(a, b)
    bit_checks[f"libalign torchao preset, outer_domain='row' (untimed) == {TORCHAO_ROW}"] = (
        row_check
    )
    anchor = None
    if anchor_path is not None:
        anchor = {"path": str(anchor_path), **json.loads(anchor_path.read_text())}
    return {
        "workload": {
            "shapes": [list(s.shape) for s in stacks],
            "dtype": "bfloat16",
            "bytes_in": bytes_in,
        },
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_before_after": list(load),
        "malloc_no_mmap": no_mmap,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "torchao": _version("torchao"),
            "nvidia-modelopt": _version("nvidia-modelopt"),
            "compressed-tensors": _version("compressed-tensors"),
        },
        "rows": rows,
        "bit_checks": bit_checks,
        "anchor_recorded_elsewhere": anchor,
    }


def _anchor_rows(anchor: dict[str, Any]) -> list[tuple[str, str, str]]:
    total = anchor.get("bytes_in", 0) + anchor.get("bytes_out", 0)
    out = []
    for key, val in anchor.items():
        if key.endswith("_GBps") and isinstance(val, (int, float)):
            secs = total / (val * 1e9) if total and val else None
            out.append((key.removesuffix("_GBps"), _fmt(secs, ".3f"), f"{val:.3f}"))
    return out


def footnotes(res: dict[str, Any]) -> list[str]:
    w = res["workload"]
    v = res["versions"]
    notes = [
        f"Workload {' + '.join('x'.join(map(str, s)) for s in w['shapes'])} BF16 "
        f"({w['bytes_in']:,} bytes in), seeded randn; best of {res['repeats']} "
        f"round-robin repeats; torch {v['torch']}, {res['threads']} threads (default), "
        f"torchao {v['torchao']}, modelopt {v['nvidia-modelopt']}, "
        f"compressed-tensors {v['compressed-tensors']}; 1-min load average "
        f"{_fmt(res['loadavg_1min_before_after'][0], '.2f')} before, "
        f"{_fmt(res['loadavg_1min_before_after'][1], '.2f')} after (includes this benchmark; "
        "other work on the machine inflates every figure).",
        "GB/s = (bytes in + bytes out) / s; bytes out = packed codes + E4M3 block scales + "
        "outer scales as returned (per-row rows store 4 B per row, per-tensor 4 B per "
        "matrix). 'vs X' = X's seconds / this row's seconds (>1 = faster).",
        "Outer granularity: row = one per output row; expert = one per matrix, the 3-D "
        "stack in one call; matrix = one per matrix, looped over the 2-D matrices in "
        "Python. The libalign presets run at their peer's granularity.",
        "torchao row-scaled: torchao has no row outer scale; its per-expert path "
        "(per_tensor_scale [E,1,1]) is used with each row as an 'expert' (input viewed as "
        "[E*M,1,K], per_tensor_scale = row amax/2688 of shape [E*M,1,1]), pure PyTorch, "
        "the same nvfp4_quantize arithmetic; the anchor's 'rowwise' figure was recorded "
        "by a script not in this repo, so the two may not be the same call.",
        "ModelOpt is called directly per matrix (no input clone); compressed-tensors via "
        f"{_peers().__name__} (generate_gparam + compute_dynamic_scales_and_zp + "
        "NVFP4PackedCompressor.compress) per matrix.",
    ]
    flt = ", ".join(f"{r['quantizer']} {r['minor_faults_best_run'] / 1e3:.0f}k"
                    for r in res["rows"] if r["minor_faults_best_run"] is not None)
    notes.append(
        f"Minor page faults in each best run: {flt}. glibc serves each temporary above its "
        "mmap threshold (32 MiB at most) with fresh pages, so whole-stack calls pay page "
        "faults that per-matrix loops do not"
        + (" (this run: --no-mmap, large blocks reused from the heap)." if res["malloc_no_mmap"]
           else "; --no-mmap removes that cost.")
    )
    checks = ", ".join(f"{k}: {'bit-exact' if ok else ('DIFFERS' if ok is False else 'n/a')}"
                       for k, ok in res["bit_checks"].items())
    notes.append(f"Same-input bit check (codes, scale bytes, outer values): {checks}.")
    for r in res["rows"]:
        if r["error"]:
            notes.append(f"{r['quantizer']} failed: {r['error']}")
    return notes


def render(res: dict[str, Any]) -> None:
    headers = ("quantizer (outer scale)", "seconds", "GB/s", "vs torchao", "vs modelopt")
    body = [(f"{r['quantizer']} ({r['outer_granularity']})", _fmt(r["seconds"], ".3f"),
             _fmt(r["GBps"], ".3f"), _fmt(r["vs_torchao"], ".2f"),
             _fmt(r["vs_modelopt"], ".2f")) for r in res["rows"]]
    anchor = res["anchor_recorded_elsewhere"]
    a_title = "Recorded elsewhere, NOT measured in this run"
    a_rows = _anchor_rows(anchor) if anchor else []
    notes = footnotes(res)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = Table = None
    if Console is not None and Table is not None:
        console = Console(width=max(100, min(140, Console().width)))
        table = Table(title="NVFP4 quantize throughput (measured now, same inputs)")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in body:
            table.add_row(*row)
        console.print(table)
        if anchor:
            at = Table(title=f"{a_title}: {anchor['path']}",
                       caption=anchor.get("what", ""))
            for i, h in enumerate(("anchor figure", "seconds (implied)", "GB/s")):
                at.add_column(h, justify="left" if i == 0 else "right")
            for row in a_rows:
                at.add_row(*row)
            console.print(at)
        for i, n in enumerate(notes, 1):
            console.print(f"[{i}] {n}", highlight=False, markup=False)
        return
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
    line = "  ".join
    print("NVFP4 quantize throughput (measured now, same inputs)")
    for r in (headers, *body):
        print(line(c.ljust(w) if i == 0 else c.rjust(w)
                   for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    if anchor:
        print(f"\n{a_title}: {anchor['path']}\n  {anchor.get('what', '')}")
        for name, secs, gbps in a_rows:
            print(f"  {name:<55} {secs:>8} s  {gbps:>8} GB/s")
    print()
    for i, n in enumerate(notes, 1):
        print(f"[{i}] {n}")


RECIPE_BENCH_PRESETS = ("te", "te_row", "modelopt", "flashinfer_pertoken", "te_4over6",
                        "te_row_4over6", "flashinfer_pertoken_4over6")


def recipe_throughput(stacks: list[torch.Tensor], repeats: int) -> list[dict[str, Any]]:
    """Per preset: the kernel door (:func:`libalign.kernels.quantize`, which routes what the
    compiled kernels do not serve to the spec) against the spec itself, same inputs, same run,
    best of ``repeats``; the two outputs compared bit for bit. On CUDA stacks each timing
    synchronizes the device before and after the calls, and one untimed call per side first
    builds and compiles what it needs."""
    from libalign.kernels import ops

    cuda = stacks[0].is_cuda

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for name in RECIPE_BENCH_PRESETS:
        spec = PRESETS[name]
        times = {"kernel": [], "spec": []}
        outs = {}
        if cuda:
            for fn in (ops.quantize, quantize):
                fn(stacks[0], spec)
        for _ in range(repeats):
            for side, fn in (("kernel", ops.quantize), ("spec", quantize)):
                sync()
                t0 = time.perf_counter()
                outs[side] = [fn(x, spec) for x in stacks]
                sync()
                times[side].append(time.perf_counter() - t0)
        nbytes = sum(x.numel() * x.element_size() + q.nbytes
                     for x, q in zip(stacks, outs["spec"], strict=True))
        same = all(a.bitwise_equal(b) for a, b in zip(outs["kernel"], outs["spec"], strict=True))
        k, r = min(times["kernel"]), min(times["spec"])
        rows.append({"preset": name, "served_by": ops.backend_for(stacks[0], spec),
                     "kernel_s": k, "spec_s": r, "kernel_gbps": nbytes / k / 1e9,
                     "spec_gbps": nbytes / r / 1e9, "speedup": r / k, "bit_identical": same})
    return rows


def render_recipes(rows: list[dict[str, Any]]) -> None:
    print("\n| preset | served by | kernel door GB/s | spec GB/s | kernel vs spec | bits |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['served_by']} | {r['kernel_gbps']:.2f} | "
              f"{r['spec_gbps']:.2f} | {r['speedup']:.1f}x | "
              f"{'identical' if r['bit_identical'] else 'DIFFER'} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench spec --",
                                description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8, help="experts per stack (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, best kept (default 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny shapes {QUICK_SHAPES} for a smoke run")
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--no-mmap", action="store_true",
                   help="glibc only: mallopt(M_MMAP_MAX=0) so large temporaries are reused from "
                        "the heap instead of page-faulting fresh mmap'd memory on every call")
    p.add_argument("--anchor", metavar="PATH", help=f"anchor file (default: find {ANCHOR_NAME})")
    p.add_argument("--recipes", action="store_true",
                   help="only the production recipes' presets: kernel door against the spec")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where --recipes runs (default cpu)")
    args = p.parse_args(argv)
    if args.experts < 1 or args.repeats < 1:
        p.error("--experts and --repeats must be at least 1")

    if args.no_mmap and not _malloc_heap_only():
        p.error("--no-mmap needs glibc's mallopt")
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    stacks = make_workload(args.experts, shapes, args.seed)
    if args.recipes:
        print(f"recipes on {args.device}"
              + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
        rows = recipe_throughput([x.to(args.device) for x in stacks], args.repeats)
        render_recipes(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return 0 if all(r["bit_identical"] for r in rows) else 1
    warmup = make_workload(1, QUICK_SHAPES, args.seed + 1)
    qs = quantizers()
    load = measure(qs, stacks, args.repeats, warmup)
    res = build_results(qs, stacks, args.repeats, find_anchor(args.anchor),
                        row_variant_check(qs, stacks), load, args.no_mmap)
    render(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}")
    failed = [q.name for q in qs if q.error]
    mismatched = [k for k, ok in res["bit_checks"].items() if ok is False]
    if failed or mismatched:
        print(f"failed: {failed}; bit mismatches: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
