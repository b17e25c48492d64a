"""Converter benchmark: fused BF16 -> NVFP4 kernels and the whole weight sync, with baselines.

Workload: the expert weights of Qwen3-30B-A3B MoE layers, ``E`` experts of 1536x2048
(fused gate/up) and ``E`` experts of 2048x768 (down), BF16, seeded randn. On a CUDA
device the default is one full layer (E=128, 1.21 GB in); on the CPU, E=8 (75.5 MB).

Table 1, kernel throughput, every row measured in this run on the same inputs:
effective GB/s = (bytes read + bytes written) / seconds. The named baselines are a
copy of the same input bytes (device-to-device on a GPU, memcpy into pre-touched memory
on the CPU: read + write), torchao's ``nvfp4_quantize`` with one outer scale per row
(``torch.compile``-d on a GPU, eager on the CPU) and, on the CPU, ModelOpt's
``NVFP4QTensor.quantize``. Ratios are bandwidth ratios (row GB/s / baseline GB/s).
GPU rows are the median of CUDA-event timings over ``--repeats`` runs after warm-up
(what a caller pays, end to end), with the kernels' own device time beside them;
CPU rows the best of ``--repeats`` wall times. ``fresh`` rows allocate their outputs in
the call (what a caller pays); ``reused`` rows write into outputs of an earlier call. On
the CPU the table names the kernel's instruction-set path (the libalign rows run the best
one), adds a ``CPU path`` row for each path this CPU runs (scalar, avx2, avx512, forced
with ``libalign.kernels.set_cpu_kernel_path``) and bit-checks each path. Pin it to the cores it
should use (``taskset -c 0,1``); the kernel uses ``torch.get_num_threads()`` threads.

Table 2, whole sync: the expert set of ``--layers`` layers moves from the learner's
memory to where the sampler loads it from. On a GPU: BF16 is copied device-to-host into
pinned memory; NVFP4 is quantized on the device (minite, row scales) and its codes,
scales and row scales are copied device-to-host; a colocated variant copies
device-to-device instead. On the CPU the path runs through the project's own weight
store: publish BF16 shards, convert, write the store version with its manifest and
checksums, and read it back verified (``ready to load``), against publishing the BF16
version and reading it back the same way.

On a GPU the goal rows close the output: ``quantize_many`` end to end against
the copy and compiled torchao, its kernels alone against the copy, the K=768 stack's
kernel bandwidth over the K=2048 stack's (each quantized alone), and table 2's colocated
and to-host ratios, each with its target and whether this run met it.

Every libalign row is checked bit for bit against ``libalign.spec.quantize`` on the same
input. Run: ``python -m tests.bench convert [-- --device cuda --layers 48]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from libalign.kernels import ops
from libalign.spec import PRESETS, quantize
from libalign.sync import empty_destination, quantize_into

SHAPES = ((1536, 2048), (2048, 768))


@dataclass
class Row:
    """One measured configuration of table 1."""

    name: str
    run: Callable[[], object]
    bytes_moved: Callable[[object], int]
    times: list[float] = field(default_factory=list)
    result: object = None
    error: str | None = None
    note: str = ""
    in_bytes: int | None = None  # bytes read, when not the whole layer's

    @property
    def seconds(self) -> float | None:
        if not self.times:
            return None
        return statistics.median(self.times) if self.note == "median" else min(self.times)


def make_stacks(experts: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """The two BF16 expert stacks of one layer (generated on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn((experts, m, k), generator=gen, dtype=torch.float32, device=device)
            .to(torch.bfloat16) for m, k in SHAPES]


def _in_bytes(stacks) -> int:
    return sum(s.numel() * s.element_size() for s in stacks)


def _out_bytes(qs) -> int:
    total = 0
    for q in qs:
        total += q.codes.numel() + q.block_scales.numel()
        if q.outer_scale is not None:
            total += 4 * q.outer_scale.numel()
    return total


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_rows(rows: list[Row], device: str, repeats: int) -> None:
    """Warm every row up once, then time ``repeats`` round-robin runs of each."""
    for r in rows:
        try:
            r.result = r.run()
            _sync(device)
        except Exception as exc:  # a missing peer is reported, not fatal
            r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    for _ in range(repeats):
        for r in rows:
            if r.error:
                continue
            gc.collect()
            if device == "cuda":
                # an untimed call right before: the collection above leaves the device idle
                # long enough to drop its clocks, and a caller converting layer after layer
                # finds it busy
                r.result = r.run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                r.result = r.run()
                end.record()
                end.synchronize()
                r.times.append(start.elapsed_time(end) / 1e3)
                r.note = "median"
            else:
                t0 = time.perf_counter()
                r.result = r.run()
                r.times.append(time.perf_counter() - t0)


# --- table 1 rows ---------------------------------------------------------------------------


def libalign_row(name, stacks, preset, layout="linear", reuse=False, batched=False) -> Row:
    """libalign.kernels.quantize over both stacks (fresh or reused outputs), or quantize_many."""
    spec = PRESETS[preset]
    outs: list = []

    def run():
        if batched:
            return ops.quantize_many(stacks, spec, scale_layout=layout)
        if reuse and outs:
            return [ops.quantize(s, spec, scale_layout=layout, out=o)
                    for s, o in zip(stacks, outs, strict=True)]
        qs = [ops.quantize(s, spec, scale_layout=layout) for s in stacks]
        if reuse:
            outs.extend(qs)
        return qs

    return Row(name, run, _out_bytes, in_bytes=_in_bytes(stacks))


def cpu_path_row(stacks, path) -> Row:
    """The C++ kernel forced to one instruction-set path (scalar, avx2, avx512): minite,
    linear scales, fresh outputs. The path is set before every run and restored after."""
    spec = PRESETS["minite"]

    def run():
        ops.set_cpu_kernel_path(path)
        try:
            return [ops.quantize(s, spec) for s in stacks]
        finally:
            ops.set_cpu_kernel_path(None)

    return Row(f"libalign minite (row), fresh outputs, CPU path {path}", run, _out_bytes)


def kernel_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """Device time of the quantize kernels one call of ``run`` launches (torch.profiler),
    without the host's part (allocation, launch, the flag read) that the ms column pays."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages()
                   if "quantize_rows" in e.key or "amax_rows" in e.key)
    return total_us / repeats / 1e6


def copy_row(stacks, device) -> Row:
    """A copy of the same input bytes into pre-allocated (pre-touched) destinations."""
    dst = [torch.empty_like(s) for s in stacks]
    for d in dst:
        d.zero_()

    def run():
        for d, s in zip(dst, stacks, strict=True):
            d.copy_(s)
        return dst

    return Row("copy of the input bytes (read + write)", run, lambda _: _in_bytes(stacks))


def torchao_rowwise(stacks, compiled: bool) -> Row:
    """torchao's nvfp4_quantize with per_tensor_scale = row amax / 2688, one 'tensor' per row."""
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    def quant(x):
        rows = x.reshape(-1, 1, x.shape[-1])
        pts = per_tensor_amax_to_scale(torch.amax(torch.abs(rows), dim=(1, 2))).view(-1, 1, 1)
        scales, codes = nvfp4_quantize(rows, 16, pts)
        return codes, scales, pts

    fn = torch.compile(quant, dynamic=False) if compiled else quant

    def run():
        return [fn(s) for s in stacks]

    def moved(res):
        return sum(c.numel() * c.element_size() + sc.numel() * sc.element_size()
                   + 4 * p.numel() for c, sc, p in res)

    name = "torchao nvfp4_quantize, row scale" + (" (torch.compile)" if compiled else " (eager)")
    return Row(name, run, moved)


def modelopt_row(stacks) -> Row:
    """ModelOpt's NVFP4QTensor.quantize, one call per expert matrix (per-tensor scale)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    def run():
        out = []
        for s in stacks:
            for w in s:
                qt, wsf, wsf2 = NVFP4QTensor.quantize(w, 16)
                out.append((qt._quantized_data, wsf, wsf2))
        return out

    def moved(res):
        return sum(a.numel() + b.numel() + 4 * c.numel() for a, b, c in res)

    return Row("ModelOpt NVFP4QTensor.quantize (per matrix)", run, moved)


def spec_row(stacks) -> Row:
    """The reference spec itself (minite)."""
    return Row("libalign spec reference, minite (row)",
               lambda: [quantize(s, PRESETS["minite"]) for s in stacks], _out_bytes)


def _preset_checks(stacks) -> dict[str, bool]:
    checks = {}
    for preset in ("minite", "te", "torchao"):
        spec = PRESETS[preset]
        ok = True
        for s in stacks:
            sample = s[: min(8, s.shape[0])]
            k = ops.quantize(sample, spec, backend="kernel")
            r = quantize(sample, spec)
            ok &= k.bitwise_equal(r)
        checks[f"{preset} kernel == spec"] = bool(ok)
    return checks


def bit_check(stacks, device) -> dict[str, bool]:
    """Kernel bits == spec bits on this run's inputs, for each preset benchmarked (on the
    CPU, for each instruction-set path this CPU runs; the unnamed ones: the best path)."""
    checks = {}
    for path in ops.cpu_kernel_paths()[1:] if device == "cpu" else ():
        ops.set_cpu_kernel_path(path)
        try:
            checks |= {f"{k} [{path}]": v for k, v in _preset_checks(stacks).items()}
        finally:
            ops.set_cpu_kernel_path(None)
    return _preset_checks(stacks) | checks


def table1(args, device) -> dict:
    stacks = make_stacks(args.experts, device)
    rows = [
        copy_row(stacks, device),
        libalign_row("libalign minite (row), linear scales, fresh outputs", stacks, "minite"),
        libalign_row("libalign minite (row), quantize_many (one sync)", stacks, "minite",
                     batched=True),
        libalign_row("libalign minite (row), linear scales, reused outputs", stacks, "minite",
                     reuse=True),
        libalign_row("libalign minite (row), 128x4 swizzled scales", stacks, "minite",
                     layout="swizzled"),
        *[libalign_row(f"libalign minite (row), the K={s.shape[-1]} stack alone", [s], "minite",
                       batched=True) for s in stacks],
        libalign_row("libalign te (tensor: max pass + encode)", stacks, "te", batched=True),
        libalign_row("libalign torchao (expert: max pass + encode)", stacks, "torchao",
                     batched=True),
        torchao_rowwise(stacks, compiled=device == "cuda"),
    ]
    if device == "cuda":
        rows.append(torchao_rowwise(stacks, compiled=False))
    else:
        rows += [cpu_path_row(stacks, path) for path in ops.cpu_kernel_paths()]
        rows += [modelopt_row(stacks), spec_row(stacks)]
    time_rows(rows, device, args.repeats)
    kernel_s = {r.name: kernel_seconds(r.run) for r in rows
                if device == "cuda" and r.name.startswith("libalign") and not r.error}
    bytes_in = _in_bytes(stacks)
    res = {"bytes_in": bytes_in, "rows": []}
    for r in rows:
        moved = None if r.result is None or r.error else \
            (bytes_in if r.in_bytes is None else r.in_bytes) + r.bytes_moved(r.result)
        t = r.seconds
        res["rows"].append({"name": r.name, "seconds": t, "bytes_moved": moved,
                            "GBps": None if t is None or moved is None else moved / t / 1e9,
                            "kernel_seconds": kernel_s.get(r.name), "error": r.error})
    res["bit_checks"] = bit_check(stacks, device)
    if device == "cpu":
        res["cpu_kernel_path"], res["cpu_kernel_paths"] = ops.cpu_kernel_path(), ops.cpu_kernel_paths()
    return res


# --- table 2: whole sync --------------------------------------------------------------------


def sync_gpu(args) -> dict:
    """Learner GPU tensors -> pinned host (or colocated device) buffers, BF16 vs NVFP4."""
    layers = [make_stacks(args.experts, "cuda", seed=i) for i in range(args.layers)]
    spec = PRESETS["minite"]
    # Destinations: two layers' worth of each kind, alternated. Every copy is far larger
    # than any cache, so its time is the same as into distinct buffers for all layers,
    # and 48 layers' worth of pinned host memory (74 GB) is not needed to measure it.
    q0 = [ops.quantize(s, spec) for s in layers[0]]
    bf16_host = [[torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in layers[0]]
                 for _ in range(2)]
    fp4_host = [[(torch.empty(q.codes.shape, dtype=torch.uint8, pin_memory=True),
                  torch.empty(q.block_scales.shape, dtype=torch.uint8, pin_memory=True),
                  torch.empty(q.outer_scale.shape, dtype=torch.float32, pin_memory=True))
                 for q in q0] for _ in range(2)]
    bf16_dev = [[torch.empty_like(s) for s in layers[0]] for _ in range(2)]
    fp4_dev = [[(torch.empty_like(q.codes), torch.empty_like(q.block_scales.view(torch.uint8)),
                 torch.empty_like(q.outer_scale)) for q in q0] for _ in range(2)]

    def bf16(dst):
        for i, layer in enumerate(layers):
            for s, h in zip(layer, dst[i % 2], strict=True):
                h.copy_(s, non_blocking=True)

    def nvfp4(dst):
        for i, layer in enumerate(layers):
            for q, (c, sc, o) in zip(ops.quantize_many(layer, spec), dst[i % 2], strict=True):
                c.copy_(q.codes, non_blocking=True)
                sc.copy_(q.block_scales.view(torch.uint8), non_blocking=True)
                o.copy_(q.outer_scale, non_blocking=True)

    # weight_sync.quantize_into: kernels write colocated destinations themselves; host
    # destinations get staged sets copied on a second stream while the next layer converts
    sources = [s for layer in layers for s in layer]
    into_host = [[empty_destination(s, spec, device="cpu", pin_memory=True) for s in layers[0]]
                 for _ in range(2)]
    into_dev = [[empty_destination(s, spec) for s in layers[0]] for _ in range(2)]

    def into(dst):
        n = len(layers[0])
        quantize_into(sources, [dst[(i // n) % 2][i % n] for i in range(len(sources))], spec)

    cases = {"host: BF16 copy": lambda: bf16(bf16_host),
             "host: NVFP4 convert + copy (quantize_into)": lambda: into(into_host),
             "host: NVFP4 quantize_many per layer, then copy": lambda: nvfp4(fp4_host),
             "colocated: BF16 copy": lambda: bf16(bf16_dev),
             "colocated: NVFP4 convert + copy (quantize_into)": lambda: into(into_dev),
             "colocated: NVFP4 quantize_many per layer, then copy": lambda: nvfp4(fp4_dev)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(args.sync_repeats):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    last = fp4_host[(len(layers) - 1) % 2]
    ok = all(torch.equal(h[0], quantize(s.cpu(), spec).codes)
             for s, h in zip(layers[-1], last, strict=True))
    for dst in (into_host, into_dev):  # quantize_into's last layer, every field
        for s, d in zip(layers[-1], dst[(len(layers) - 1) % 2], strict=True):
            ref = quantize(s.cpu(), spec)
            ok = ok and torch.equal(d.codes.cpu(), ref.codes) and torch.equal(
                d.block_scales.view(torch.uint8).cpu(), ref.block_scales.view(torch.uint8)) \
                and torch.equal(d.outer_scale.cpu().view(torch.int32), ref.outer_scale.view(torch.int32))
    bf16_bytes = sum(_in_bytes(layer) for layer in layers)
    fp4_bytes = len(layers) * sum(a.numel() + b.numel() + 4 * c.numel() for a, b, c in fp4_host[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"layers": args.layers, "bf16_bytes": bf16_bytes, "nvfp4_bytes": fp4_bytes,
            "seconds": med, "all_seconds": times, "host_copy_bits_ok": ok,
            "ratio_host": med["host: NVFP4 convert + copy (quantize_into)"] / med["host: BF16 copy"],
            "ratio_colocated": (med["colocated: NVFP4 convert + copy (quantize_into)"]
                                / med["colocated: BF16 copy"]),
            "ratio_host_per_layer": (med["host: NVFP4 quantize_many per layer, then copy"]
                                     / med["host: BF16 copy"]),
            "ratio_colocated_per_layer": (med["colocated: NVFP4 quantize_many per layer, then copy"]
                                          / med["colocated: BF16 copy"])}


def sync_cpu(args) -> dict:
    """Publish -> converted -> ready to load through the weight store, NVFP4 vs BF16.

    Both paths run the same code: the learner publishes BF16 shards, the store version is
    written from them (atomically, with a manifest and per-tensor SHA-256), and the
    sampler reads it back verified. The BF16 path stores the expert weights as they are
    (a store version with nothing selected for quantization); the NVFP4 path quantizes
    them with the minite preset on the way (``convert_published``).
    """
    from alignd.formats.convert import convert_published
    from alignd.formats.hf_checkpoint import HFCheckpoint
    from alignd.formats.published import write_published
    from alignd.formats.selection import is_expert_weight
    from alignd.formats.weight_store import WeightStore

    tensors = {}
    for layer in range(args.layers):
        for (_m, k), s in zip(SHAPES, make_stacks(args.experts, "cpu", seed=layer), strict=True):
            for e in range(s.shape[0]):
                pre = f"model.layers.{layer}.mlp.experts.{e}"
                if k == 2048:  # the fused 1536 rows are the checkpoint's gate and up
                    half = s.shape[1] // 2
                    tensors[f"{pre}.gate_proj.weight"] = s[e, :half].contiguous()
                    tensors[f"{pre}.up_proj.weight"] = s[e, half:].contiguous()
                else:
                    tensors[f"{pre}.down_proj.weight"] = s[e].contiguous()
    spec, keep = PRESETS["minite"], (lambda name, t: False)
    times: dict[str, list[float]] = {k: [] for k in (
        "service: BF16 publish + store + load", "service: NVFP4 publish + convert + store + load",
        "learner-side: BF16 store + load", "learner-side: NVFP4 convert + store + load")}
    with tempfile.TemporaryDirectory(dir=args.store_root) as root:
        store, pub = WeightStore(Path(root) / "store"), Path(root) / "published"

        def timed(key, fn):
            t0 = time.perf_counter()
            out = fn()
            times[key].append(time.perf_counter() - t0)
            return out

        for i in range(args.sync_repeats):
            def via_service_bf16(i=i):
                src = write_published(pub, f"b{i}", tensors)
                store.write_version(f"b{i}", HFCheckpoint(src).iter_tensors(), spec, select=keep)
                return store.read_version(f"b{i}", verify=True)

            def via_service_nvfp4(i=i):
                convert_published(write_published(pub, f"v{i}", tensors), store, f"v{i}", spec)
                return store.read_version(f"v{i}", verify=True)

            def direct_bf16(i=i):
                store.write_version(f"db{i}", tensors, spec, select=keep)
                return store.read_version(f"db{i}", verify=True)

            def direct_nvfp4(i=i):
                store.write_version(f"dv{i}", tensors, spec, select=is_expert_weight)
                return store.read_version(f"dv{i}", verify=True)

            timed("service: BF16 publish + store + load", via_service_bf16)
            got = timed("service: NVFP4 publish + convert + store + load", via_service_nvfp4)
            timed("learner-side: BF16 store + load", direct_bf16)
            timed("learner-side: NVFP4 convert + store + load", direct_nvfp4)
        name = next(iter(tensors))
        ok = got[name].bitwise_equal(quantize(tensors[name], spec))
    best = {k: min(v) for k, v in times.items()}
    vals = list(best.values())
    return {"layers": args.layers, "experts": args.experts, "seconds": best, "all_seconds": times,
            "bf16_bytes": _in_bytes(list(tensors.values())), "stored_bits_ok": bool(ok),
            "ratio_service": vals[1] / vals[0], "ratio_learner_side": vals[3] / vals[2]}


# --- report ---------------------------------------------------------------------------------


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def render(res: dict, device: str) -> None:
    t1 = res["table1"]
    base = {r["name"]: r["GBps"] for r in t1["rows"]}
    copy = base.get("copy of the input bytes (read + write)")
    tao = next((r["GBps"] for r in t1["rows"] if r["name"].startswith("torchao") and
                ("compile" in r["name"] or device == "cpu")), None)
    mo = base.get("ModelOpt NVFP4QTensor.quantize (per matrix)")
    print(f"\nTable 1: BF16 -> NVFP4 on {res['device']} ({t1['bytes_in'] / 1e9:.3f} GB in)")
    if t1.get("cpu_kernel_path"):
        print(f"CPU kernel path: {t1['cpu_kernel_path']} (this CPU runs "
              f"{', '.join(t1['cpu_kernel_paths'])}; {res['threads']} threads); the libalign "
              "rows without a path name run it")
    kernel = device == "cuda"
    head = f"{'row':62} {'ms':>9} {'GB/s':>9} {'vs copy':>8} {'vs torchao':>10}"
    head += f" {'vs modelopt':>11}" if mo else ""
    head += f" {'kernel ms':>9} {'kernel vs copy':>14}" if kernel else ""
    print(head)
    for r in t1["rows"]:
        g = r["GBps"]
        line = (f"{r['name'][:62]:62} {_fmt(r['seconds'] and r['seconds'] * 1e3, '9.3f')} "
                f"{_fmt(g, '9.1f')} {_fmt(g and copy and g / copy, '8.2f')} "
                f"{_fmt(g and tao and g / tao, '10.2f')}")
        if mo:
            line += f" {_fmt(g and g / mo, '11.1f')}"
        ks = r.get("kernel_seconds")
        if kernel and ks:
            kg = r["bytes_moved"] / ks / 1e9
            line += f" {ks * 1e3:9.3f} {_fmt(copy and kg / copy, '14.2f')}"
        if r["error"]:
            line += f"  ERROR {r['error']}"
        print(line)
    print("bit checks:", ", ".join(f"{k}: {'bit-exact' if v else 'DIFFERS'}"
                                   for k, v in t1["bit_checks"].items()))
    t2 = res.get("table2")
    if t2:
        print(f"\nTable 2: whole sync of {t2['layers']} layers' expert weights")
        for k, v in t2["seconds"].items():
            print(f"  {k:48} {v:9.3f} s")
        for k in ("ratio_service", "ratio_learner_side", "ratio_host", "ratio_colocated",
                  "ratio_host_per_layer", "ratio_colocated_per_layer"):
            if k in t2:
                print(f"  {k:48} {t2[k]:9.3f} (NVFP4 time / BF16 time)")
        for key in ("host_copy_bits_ok", "stored_bits_ok"):
            if key in t2:
                print(f"  NVFP4 bytes where the sampler loads them == spec: {t2[key]}")
    if kernel:
        goal_rows(res, copy, tao)


#: the GPU converter's goals: (name, value key, at least / at most, target)
GOALS = (("1. quantize_many end to end / copy (GB/s)", "e2e_vs_copy", ">=", 0.85),
         ("1. quantize_many end to end / compiled torchao", "e2e_vs_torchao", ">=", 6.0),
         ("1. kernels alone / copy (GB/s)", "kernel_vs_copy", ">=", 0.92),
         ("1. K=768 stack per byte / K=2048 stack (kernels)", "k768_vs_k2048", ">=", 1.0),
         ("2. colocated NVFP4 convert + copy / BF16 copy", "ratio_colocated", "<=", 0.70),
         ("2. to host NVFP4 convert + copy / BF16 copy", "ratio_host", "<=", 0.30))


def goal_rows(res: dict, copy: float | None, tao: float | None) -> None:
    """Print each goal's value from this run's rows against its target (met or not)."""
    rows = {r["name"]: r for r in res["table1"]["rows"]}
    many = rows.get("libalign minite (row), quantize_many (one sync)", {})

    def kernel_gbps(r):
        ks = r.get("kernel_seconds") if r else None
        return r["bytes_moved"] / ks / 1e9 if ks and r.get("bytes_moved") else None

    alone = {k: kernel_gbps(rows.get(f"libalign minite (row), the K={k} stack alone"))
             for k in (2048, 768)}
    got = {"e2e_vs_copy": many.get("GBps") and copy and many["GBps"] / copy,
           "e2e_vs_torchao": many.get("GBps") and tao and many["GBps"] / tao,
           "kernel_vs_copy": kernel_gbps(many) and copy and kernel_gbps(many) / copy,
           "k768_vs_k2048": alone[768] and alone[2048] and alone[768] / alone[2048],
           **{k: res.get("table2", {}).get(k) for k in ("ratio_colocated", "ratio_host")}}
    res["goals"] = {}
    print("\ngoals (every ratio against this run's baselines):")
    for name, key, op, target in GOALS:
        v = got.get(key)
        if v is None:
            continue
        met = v >= target if op == ">=" else v <= target
        res["goals"][key] = {"value": v, "target": target, "met": met}
        print(f"  {name:52} {v:7.3f}  goal {op} {target:g}  {'met' if met else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_convert", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=None, help="experts per layer")
    ap.add_argument("--layers", type=int, default=None, help="layers in the whole-sync table")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--no-sync", action="store_true", help="skip table 2")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--json", default=None, help="write all numbers to this file")
    ap.add_argument("--store-root", default=None, help="where the CPU sync writes its store")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.experts is None:
        args.experts = 2 if args.quick else (128 if cuda else 8)
    if args.layers is None:
        args.layers = 1 if args.quick else (48 if cuda else 2)
    if args.repeats is None:
        args.repeats = 2 if args.quick else (20 if cuda else 5)
    warnings.filterwarnings("ignore")
    res = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "kernel_backend": ops.backend_for(make_stacks(1, args.device)[0]),
           "table1": table1(args, args.device)}
    if not args.no_sync:
        res["table2"] = sync_gpu(args) if cuda else sync_cpu(args)
    render(res, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    ok = all(res["table1"]["bit_checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
