"""What several benchmarks share: timing a callable on a device, timing steps round robin against
a baseline row measured in the same run, and printing a table of rows.

Used by bench_guidance, bench_kv_guidance, bench_mxfp4, bench_routing, bench_strict and the
probes (not a benchmark itself: ``python -m tests.bench`` runs the ``bench_*`` modules only).
"""

from __future__ import annotations

import cProfile
import pstats
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch


def sync(device) -> None:
    """Wait for the device's queued work (a CUDA device; nothing on the CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], repeats: int, device="cpu", stat=min,
            warm: bool = True) -> float:
    """``stat`` (``min``: the best; ``statistics.median``) of ``repeats`` timed calls of ``fn``
    (after one warm-up call unless ``warm`` is False), each ended by a device :func:`sync`."""
    if warm:
        fn()
        sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return stat(times)


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds a call of ``fn`` on a CUDA device: ``calls`` calls queued back to back
    (after five warm-up calls and a synchronisation), over ``calls``. Meaningful where the
    device keeps up, so the host never waits on it."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def profiled(fn: Callable[[], object], calls: int) -> pstats.Stats:
    """A ``cProfile`` of ``calls`` back-to-back calls of ``fn`` on a CUDA device (the device
    synchronised after them, outside the profile): where their host time goes."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    return pstats.Stats(prof)


def cuda_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn``, captured after three warm-up calls on a side stream
    (what capture asks: allocations and lazy initialisation done before it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def event_ms(fn: Callable[[], object], repeats: int, per_sample: int = 1) -> float:
    """Median milliseconds of a call of ``fn`` on the current CUDA stream over ``repeats``
    samples, each ``per_sample`` calls back to back between two CUDA events (after three
    warm-up calls). With more than one call a sample the device never waits on the host
    between calls, so a host slow to launch does not add its latency to a short kernel."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(per_sample):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / per_sample)
    return statistics.median(times)


#: Graph replays a :func:`graph_ms` sample times back to back.
GRAPH_REPLAYS = 10


def graph_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of replaying a CUDA graph of ``fn``: its device time, without the
    host's launch overhead (replays queued :data:`GRAPH_REPLAYS` at a time, so the device
    runs them back to back and no replay waits for the host)."""
    return event_ms(cuda_graph(fn).replay, repeats, GRAPH_REPLAYS)


def round_robin(cases: Sequence[tuple[Callable[[], object], dict]], repeats: int,
                device="cpu") -> list[dict]:
    """Time each case's step once per round, ``repeats`` rounds after one warm-up call each
    (round robin: a busy spell on a shared host hits every case alike); every case's row gets
    its ``times``. Returns the rows."""
    for step, _row in cases:
        step()
    for _ in range(repeats):
        for step, row in cases:
            sync(device)
            t = time.perf_counter()
            step()
            sync(device)
            row.setdefault("times", []).append(time.perf_counter() - t)
    return [row for _, row in cases]


def overheads(rows: list[dict], refs: Sequence[dict] | None = None) -> list[dict]:
    """Each row's median (``seconds``) and ``best`` of its ``times``, and its overhead over its
    baseline row (``refs[i]``; default: the first row) by median, by best, and ``paired``:
    the median over rounds of the row's time over the baseline's in the same round (a slow
    spell on a shared host that covers a round cancels)."""
    refs = refs or [rows[0]] * len(rows)
    for row in rows:
        row["seconds"] = statistics.median(row["times"])
        row["best"] = min(row["times"])
    for row, ref in zip(rows, refs, strict=True):
        row["overhead"] = row["seconds"] / ref["seconds"] - 1
        row["overhead_best"] = row["best"] / ref["best"] - 1
        row["overhead_paired"] = statistics.median(
            t / b for t, b in zip(row["times"], ref["times"], strict=True)) - 1
    return rows


@dataclass(frozen=True)
class Col:
    """A table column: its title, the format spec of its cells (width included, e.g. ``"8"``,
    ``">4"``, ``"9.4f"``) and the row key or a function of the row giving the cell's value.
    Titles align as the cells do: right for numbers and ``>`` specs, else left."""

    title: str
    spec: str
    value: str | Callable[[dict], object]

    def cell(self, row: dict) -> str:
        v = row[self.value] if isinstance(self.value, str) else self.value(row)
        return format(v, self.spec)

    def head(self) -> str:
        align, width = re.match(r"([<>^]?)(\d*)", self.spec).groups()
        align = align or (">" if re.search(r"[dfge%]$", self.spec) else "<")
        return f"{self.title:{align}{width}}"


def pct(key: str, width: int) -> Callable[[dict], str]:
    """A cell function: ``row[key]`` as a percentage with two decimals, ``width`` wide."""
    return lambda row: f"{100 * row[key]:{width - 1}.2f}%"


def print_table(cols: Sequence[Col], rows: Iterable[dict]) -> None:
    """The titles, then a line a row."""
    print(" ".join(c.head() for c in cols))
    for row in rows:
        print(" ".join(c.cell(row) for c in cols))
