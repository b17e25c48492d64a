"""Profiling probe for the CUDA converter kernel (run under ncu; not a benchmark table).

``ncu --clock-control none -k regex:quantize_rows --launch-skip 2 -c 2 --section
SpeedOfLight ... python -m tests.bench.profile_convert`` quantizes one Qwen3-30B-A3B layer's
gate/up and down stacks once each after a warm-up call on each shape, so the profiler sees
exactly one steady-state launch of each.

``--timeline`` (no ncu): where a ``quantize_many`` call's time goes, and the host time
before its first kernel launch, with and without the profiler.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from libalign.kernels import native, ops
from libalign.spec import PRESETS


class LaunchClock:
    """Stands in for the CUDA kernel library: notes the perf_counter ns at which each
    quantize or amax launch call begins and ends (``calls``), around the real function."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if name not in ("nvfp4_quantize_cuda", "nvfp4_amax_cuda"):
            return fn

        def timed(*args):
            t = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                self.calls.append((t, time.perf_counter_ns()))
        return timed


def host_times(run, calls: int = 50) -> dict[str, float]:
    """Medians over ``calls`` calls of ``run()``, each from an idle device (no profiler; the
    clock's wrapper adds about a µs), in µs from the call's start: ``first`` (the first
    launch call begins), ``in_launch`` (time inside the launch calls, the CUDA runtime's
    part), ``last`` (the last launch call returns) and ``end`` (the call returns, after the
    flag read has waited for the kernels); ``events``: CUDA events recorded right before and
    after the call, as ``bench convert``'s ms column times it (host and device together)."""
    real = native.load
    clock = LaunchClock(real("cuda"))
    native.load = lambda kind: clock if kind == "cuda" else real(kind)
    rows = []
    try:
        for _ in range(calls):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            clock.calls = []
            start.record()
            t0 = time.perf_counter_ns()
            run()
            t1 = time.perf_counter_ns()
            stop.record()
            stop.synchronize()
            c = clock.calls
            rows.append((c[0][0] - t0, sum(b - a for a, b in c), c[-1][1] - t0, t1 - t0,
                         start.elapsed_time(stop) * 1e6))
    finally:
        native.load = real
    return {key: statistics.median(r[i] for r in rows) / 1e3
            for i, key in enumerate(("first", "in_launch", "last", "end", "events"))}


def timeline(preset: str, calls: int = 3) -> None:
    """Where a caller's time goes in ``quantize_many`` on one layer: the host (CPU) operations
    and device kernels of the last of ``calls`` steady-state calls, in start order, in µs from
    the call's start, with the GPU's idle gaps (``--timeline``; no ncu needed)."""
    from torch.profiler import ProfilerActivity, profile

    stacks = [torch.randn((128, m, k), device="cuda", dtype=torch.bfloat16)
              for m, k in ((1536, 2048), (2048, 768))]
    for _ in range(3):
        ops.quantize_many(stacks, PRESETS[preset])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with torch.profiler.record_function("quantize_many"):
                ops.quantize_many(stacks, PRESETS[preset])
            torch.cuda.synchronize()
    evs = sorted(prof.events(), key=lambda e: e.time_range.start)
    marks = [e for e in evs if e.name == "quantize_many"]
    t0, t1 = marks[-1].time_range.start, marks[-1].time_range.end
    kernels = []
    for e in evs:
        if e.time_range.start < t0 or e.time_range.start > t1 + 2000:
            continue
        gpu = e.device_type.name == "CUDA"
        if gpu:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        print(f"{'GPU' if gpu else 'CPU'} {e.time_range.start - t0:9.1f} "
              f"{e.time_range.end - e.time_range.start:9.1f}  {e.name[:90]}")
    busy = sum(b - a for a, b, _ in kernels)
    print(f"call {t1 - t0:.1f} us on the host; kernels busy {busy:.1f} us; first kernel at "
          f"{kernels[0][0] - t0 if kernels else float('nan'):.1f} us; last ends at "
          f"{kernels[-1][1] - t0 if kernels else float('nan'):.1f} us")
    launches = [e.time_range.start - t0 for e in evs if t0 <= e.time_range.start <= t1
                and e.device_type.name != "CUDA" and "Launch" in e.name]
    first_q = next((a - t0 for a, _, name in kernels if "quantize" in name), float("nan"))
    print(f"profiled: host reaches its first launch call at "
          f"{launches[0] if launches else float('nan'):.1f} us; the first quantize kernel "
          f"starts at {first_q:.1f} us")
    spec = PRESETS[preset]
    print("host µs from the call's start, no profiler, median of 50 calls from an idle device:")
    for name, run in (("quantize_many, both stacks", lambda: ops.quantize_many(stacks, spec)),
                      ("quantize_many, K=2048 stack", lambda: ops.quantize_many(stacks[:1], spec)),
                      ("ops.quantize, K=2048 stack", lambda: ops.quantize(stacks[0], spec))):
        t = host_times(run)
        print(f"  {name:28} first launch call at {t['first']:6.1f}; inside launch calls "
              f"{t['in_launch']:6.1f}; last launch returns {t['last']:6.1f}; returns at "
              f"{t['end']:7.1f}; events {t['events']:7.1f}")
    out = os.environ.get("OUT")
    if out:
        prof.export_chrome_trace(os.path.join(out, f"quantize_many_{preset}.json"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--timeline" in argv:
        rest = [a for a in argv if a != "--timeline"]
        timeline(rest[0] if rest else "minite")
        return 0
    preset = argv[0] if argv else "minite"
    stacks = [torch.randn((128, m, k), device="cuda", dtype=torch.bfloat16)
              for m, k in ((1536, 2048), (2048, 768))]
    for x in stacks:  # build, load, warm up (smaller launches of the same kernels)
        ops.quantize(x[:2], PRESETS[preset])
    torch.cuda.synchronize()
    for x in stacks:
        ops.quantize(x, PRESETS[preset])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
