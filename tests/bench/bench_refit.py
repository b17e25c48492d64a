"""Refit benchmark: one weight version from a trainer's BF16 tensors into a colocated server's
parameters, NVFP4 (quantized on the way) against BF16 (the same tensors sent unchanged).

Workload: Qwen3-30B-A3B-shaped decoder layers with seeded random BF16 weights, in the Hugging
Face names a trainer's weight sync yields: per layer the attention projections (32 query heads,
4 key/value heads, head_dim 128, hidden 2048), their q/k norms, the two layer norms, the router
``mlp.gate.weight`` [128, 2048] and ``E`` experts of ``gate_proj``/``up_proj`` [768, 2048] and
``down_proj`` [2048, 768] (E=128 on a GPU; fewer on the CPU, ``--experts``). Embeddings and
``lm_head`` are left out: the figures are per layer, and scaled to the model's 48 layers.

Both refits go through :func:`alignd.sync.tensor.send_tensor_refit` with ``staged=False``:
each bucket travels as SGLang's ``flattened_bucket`` dict, pickled by ``ForkingPickler`` (on a
GPU the buffer crosses as a CUDA IPC handle, on the CPU as shared memory) and base64-encoded,
the string SGLang's ``update_weights_from_tensor`` takes. The NVFP4 refit quantizes the routed
experts under ``minite`` (codes, E4M3 block scales, fp32 row scales under SGLang's ModelOpt
names; everything else passes through); the BF16 refit (``spec=None``) is the baseline.

The server is a separate process (``torch.multiprocessing`` spawn) standing in for SGLang: it
receives each payload string through a pipe, deserializes it, copies every tensor of the bucket
into its own parameter of that name (one copy per tensor, as a model's ``load_weights`` does),
waits for the device and answers ``(True, "ok")``. It keeps one set of parameters per refit
kind, allocated the first time a name arrives: in the warm-up refit, outside the timing.

Measured, in the same run, round robin after one warm-up refit of each kind: the wall time of
a refit (median of ``--repeats``), the NVFP4/BF16 ratio (of the medians, and the median of the
per-round ratios), bytes moved, the refit's own split (``produce_s``: quantize and pack on the
trainer's thread; ``send_s``: the transport and the server's copies on the send thread; with the
overlap the wall time is near the larger, and ``produce + send - wall`` is the time hidden) and,
on a GPU, the trainer process's peak device memory over its weights during the refit
(``torch.cuda.max_memory_allocated``, reset before each refit), in buckets. After the timing
the server's copy of a passed-through tensor and of one quantized expert are checked against
the trainer's (the transport delivered every byte).

Goals, printed beside the figures (not asserted): the NVFP4 refit takes at most 0.40 of the
BF16 refit's time; peak extra device memory at most 2 buckets.

Run: ``python -m tests.bench refit [-- --device cuda --layers 4 --bucket-mb 512 --json out]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.multiprocessing as tmp
from alignd.sync.buckets import Bucket
from alignd.sync.stream import quantize_named
from alignd.sync.tensor import FLATTENED, deserialize, send_tensor_refit

HIDDEN, MOE_INTER, EXPERTS = 2048, 768, 128
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
FULL_LAYERS = 48
SPEC = "minite"
KINDS = ("bf16", "nvfp4")
#: Goals: NVFP4 refit time over BF16 refit time (at most), peak extra memory in buckets (at most).
GOAL_RATIO, GOAL_PEAK_BUCKETS = 0.40, 2.0
#: Seconds the trainer waits for one answer of the server before calling it dead.
ANSWER_TIMEOUT_S = 600.0


# --- the workload -------------------------------------------------------------------------------

def layer_shapes(layer: int, experts: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(hf_name, shape)`` of one decoder layer's tensors, in the order a trainer sends them."""
    p = f"model.layers.{layer}"
    out = [(f"{p}.input_layernorm.weight", (HIDDEN,)),
           (f"{p}.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
           (f"{p}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
           (f"{p}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
           (f"{p}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
           (f"{p}.self_attn.q_norm.weight", (HEAD_DIM,)),
           (f"{p}.self_attn.k_norm.weight", (HEAD_DIM,)),
           (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
           (f"{p}.mlp.gate.weight", (experts, HIDDEN))]
    for e in range(experts):
        out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (MOE_INTER, HIDDEN)),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (MOE_INTER, HIDDEN)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (HIDDEN, MOE_INTER))]
    return out


def layer_bytes(experts: int) -> int:
    """BF16 bytes of one layer."""
    return sum(2 * torch.Size(s).numel() for _, s in layer_shapes(0, experts))


def make_model(layers: int, experts: int, device: str, seed: int = 0
               ) -> list[tuple[str, torch.Tensor]]:
    """The trainer's named BF16 tensors of ``layers`` layers, generated on ``device`` (norms near
    one, projections randn * 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    named = []
    for layer in range(layers):
        for name, shape in layer_shapes(layer, experts):
            t = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device)
            t.mul_(0.02)
            if "norm" in name:
                t.add_(1.0)
            named.append((name, t))
    return named


def default_layers(device: str, experts: int, bucket_bytes: int) -> int:
    """Four layers on a GPU where they fit with ample headroom (half the free memory must hold the
    trainer's weights, the server's BF16 and NVFP4 parameters and eight buckets), one on the CPU."""
    if device != "cuda":
        return 1
    free, _ = torch.cuda.mem_get_info()
    per_layer = layer_bytes(experts) * 2.4  # weights + server BF16 copy + NVFP4 copy (0.3) + slack
    return max(1, min(4, int((free * 0.5 - 8 * bucket_bytes) // per_layer)))


# --- the server process -------------------------------------------------------------------------

def _load(params: dict[str, torch.Tensor], payload: str, clock: dict[str, float]) -> None:
    """One ``flattened_bucket`` payload into ``params``: one copy per tensor, a parameter
    allocated on a name's first sight. ``clock`` gathers the seconds spent unpickling (opening
    the IPC handle or shared memory) and copying (until the device is done)."""
    t0 = time.perf_counter()
    obj = deserialize(payload)
    t1 = time.perf_counter()
    for name, t in Bucket(obj["flattened_tensor"], list(obj["metadata"])).tensors():
        p = params.get(name)
        if p is None:
            p = params[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        p.copy_(t)
    if obj["flattened_tensor"].is_cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    clock["unpickle_s"] += t1 - t0
    clock["copy_s"] += t2 - t1
    clock["loads"] += 1


def serve(conn: Connection, device: str) -> None:
    """The stand-in SGLang server (the spawned process's target). Messages on ``conn``:
    ``("load", server, payload)`` loads a bucket into ``server``'s parameters and answers
    ``(ok, message)``; ``("get", server, names)`` answers those parameters, on the CPU;
    ``("count", server)`` answers ``(parameters, bytes)``; ``("clock", server)`` answers the
    seconds its loads spent unpickling and copying since the last ask, and zeroes them; None
    ends the process."""
    if device == "cuda":
        torch.cuda.set_device(0)
    servers: dict[str, dict[str, torch.Tensor]] = {}
    clocks: dict[str, dict[str, float]] = {}
    while (msg := conn.recv()) is not None:
        op, server = msg[0], msg[1]
        params = servers.setdefault(server, {})
        clock = clocks.setdefault(server, dict.fromkeys(("unpickle_s", "copy_s", "loads"), 0.0))
        try:
            if op == "load":
                _load(params, msg[2], clock)
                conn.send((True, "ok"))
            elif op == "get":
                conn.send({n: params[n].cpu().clone() for n in msg[2]})
            elif op == "clock":
                conn.send(dict(clock))
                clock.update(dict.fromkeys(clock, 0.0))
            elif op == "count":
                conn.send((len(params), sum(p.numel() * p.element_size() for p in params.values())))
            else:
                conn.send((False, f"unknown message {op!r}"))
        except Exception as e:  # the trainer raises it as the refit's error
            conn.send((False, f"{type(e).__name__}: {e}"))


class Server:
    """The server process and the trainer's end of its pipe."""

    def __init__(self, device: str):
        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, device), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, msg: tuple) -> object:
        """Send ``msg``, wait for the answer (RuntimeError if the process died meanwhile)."""
        self.conn.send(msg)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not self.conn.poll(1.0):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server process stopped answering "
                                   f"(exit code {self.proc.exitcode})")
        return self.conn.recv()

    def close(self) -> None:
        """End the process."""
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()


class PipeSink:
    """SGLang's ``update_weights_from_tensor`` for one set of the server's parameters."""

    def __init__(self, server: Server, name: str):
        self.server, self.name = server, name

    def update_weights_from_tensor(self, *, serialized_named_tensors: list[str],
                                   load_format: str | None, flush_cache: bool,
                                   weight_version: str | None) -> object:
        """Load one bucket; the server's ``(ok, message)``."""
        if load_format != FLATTENED:
            return False, f"this server loads {FLATTENED!r} buckets, not {load_format!r}"
        return self.server.ask(("load", self.name, serialized_named_tensors[0]))


# --- measuring ----------------------------------------------------------------------------------

def refit_once(named, sink: PipeSink, spec: str | None, version: str, bucket_bytes: int,
               cuda: bool, weights_bytes: int) -> dict:
    """One refit's figures: its report's split, wall time and (on a GPU) peak extra memory."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rep = send_tensor_refit(named, sink, version_id=version, spec=spec, staged=False,
                            bucket_bytes=bucket_bytes)
    wall = time.perf_counter() - t0
    row = {"wall_s": wall, "produce_s": rep.produce_s, "send_s": rep.send_s, "bytes": rep.bytes,
           "buckets": rep.buckets, "tensors": rep.tensors, "peak_extra_bytes": None}
    if cuda:
        row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - weights_bytes
    return row


class NullSink:
    """A sink that answers at once and loads nothing: the producer's time without a server."""

    def update_weights_from_tensor(self, **_kwargs) -> object:
        """``(True, "ok")`` for any bucket."""
        return True, "ok"


def profile_producer(named, sink: PipeSink, bucket_bytes: int, cuda: bool,
                     weights_bytes: int) -> None:
    """Print where an NVFP4 refit's producer spends its time: one refit into a sink that
    answers at once (the producer's split without the server), then one into the server under
    ``cProfile`` (the calling thread only: the producer; the send thread is not profiled)."""
    alone = [refit_once(named, NullSink(), SPEC, f"null-{i}", bucket_bytes, cuda, weights_bytes)
             for i in range(3)]
    best = min(alone, key=lambda r: r["wall_s"])
    print(f"nvfp4 refit into a sink that loads nothing: wall {best['wall_s'] * 1e3:.1f} ms, "
          f"produce {best['produce_s'] * 1e3:.1f} ms, send {best['send_s'] * 1e3:.1f} ms "
          f"(best of 3)")
    prof = cProfile.Profile()
    prof.enable()
    refit_once(named, sink, SPEC, "profiled", bucket_bytes, cuda, weights_bytes)
    prof.disable()
    stats = pstats.Stats(prof)
    print("the producer's thread, one nvfp4 refit into the server (cProfile):")
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(22)


def summarize(rows: list[dict], layers: int, bucket_bytes: int) -> dict:
    """Medians of a kind's timed refits, per layer and scaled to 48 layers."""
    med = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "produce_s", "send_s")}
    peaks = [r["peak_extra_bytes"] for r in rows if r["peak_extra_bytes"] is not None]
    out = {**med, "walls": [r["wall_s"] for r in rows], "bytes": rows[0]["bytes"],
           "buckets": rows[0]["buckets"], "tensors": rows[0]["tensors"],
           "hidden_s": med["produce_s"] + med["send_s"] - med["wall_s"],
           "per_layer_s": med["wall_s"] / layers,
           "scaled_48_layers_s": med["wall_s"] / layers * FULL_LAYERS,
           "peak_extra_bytes": max(peaks) if peaks else None}
    out["peak_extra_buckets"] = (out["peak_extra_bytes"] / bucket_bytes if peaks else None)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have one shape, one dtype and the same bytes (a NaN equals itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def check_delivery(server: Server, named: list[tuple[str, torch.Tensor]]) -> dict[str, bool]:
    """The server's copies of a passed-through tensor (the first router) in both kinds, and of
    one quantized expert in the NVFP4 kind, equal the trainer's."""
    src = dict(named)
    router = next(n for n in src if n.endswith("mlp.gate.weight"))
    expert = next(n for n in src if ".experts." in n)
    want = dict(quantize_named([(expert, src[expert])], SPEC))
    got = {k: server.ask(("get", k, [router])) for k in KINDS}
    parts = server.ask(("get", "nvfp4", list(want)))
    checks = {f"{k} router passed through": same_bytes(got[k][router], src[router]) for k in KINDS}
    checks["nvfp4 expert bits"] = all(same_bytes(parts[n], t) for n, t in want.items())
    return checks


def measure(args) -> dict:
    """Run both refits round robin and return every figure."""
    cuda = args.device == "cuda"
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    if args.layers is None:
        args.layers = default_layers(args.device, args.experts, bucket_bytes)
    named = make_model(args.layers, args.experts, args.device, args.seed)
    if cuda:
        torch.cuda.synchronize()
    weights_bytes = torch.cuda.memory_allocated() if cuda else 0
    in_bytes = sum(t.numel() * t.element_size() for _, t in named)
    server = Server(args.device)
    try:
        sinks = {k: PipeSink(server, k) for k in KINDS}
        specs = {"bf16": None, "nvfp4": SPEC}
        rows: dict[str, list[dict]] = {k: [] for k in KINDS}
        for rnd in range(args.repeats + 1):  # round 0 warms up: kernels, IPC, parameters
            for k in KINDS:
                row = refit_once(named, sinks[k], specs[k], f"{k}-{rnd}", bucket_bytes, cuda,
                                 weights_bytes)
                if rnd:
                    rows[k].append(row)
            if rnd == 0:
                for k in KINDS:
                    server.ask(("clock", k))
        clocks = {k: server.ask(("clock", k)) for k in KINDS}
        counts = {k: server.ask(("count", k)) for k in KINDS}
        if getattr(args, "profile", False):
            profile_producer(named, sinks["nvfp4"], bucket_bytes, cuda, weights_bytes)
        checks = check_delivery(server, named)
    finally:
        server.close()
    res = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "transport": "CUDA IPC" if cuda else "shared memory", "torch": torch.__version__,
           "layers": args.layers, "experts": args.experts, "bucket_bytes": bucket_bytes,
           "repeats": args.repeats, "input_bytes": in_bytes, "weights_bytes": weights_bytes,
           "refits": {k: summarize(rows[k], args.layers, bucket_bytes) for k in KINDS},
           "server_params": {k: {"tensors": c[0], "bytes": c[1]} for k, c in counts.items()},
           "server_clock_per_refit": {k: {n: v / args.repeats for n, v in c.items()}
                                      for k, c in clocks.items()},
           "checks": checks}
    nv, bf = res["refits"]["nvfp4"], res["refits"]["bf16"]
    res["ratio"] = nv["wall_s"] / bf["wall_s"]
    res["ratio_paired"] = statistics.median(
        n["wall_s"] / b["wall_s"] for n, b in zip(rows["nvfp4"], rows["bf16"], strict=True))
    res["bytes_ratio"] = nv["bytes"] / bf["bytes"]
    res["goals"] = {
        "nvfp4_over_bf16_time": {"value": res["ratio"], "at_most": GOAL_RATIO},
        "peak_extra_buckets": {"value": nv["peak_extra_buckets"], "at_most": GOAL_PEAK_BUCKETS}}
    for g in res["goals"].values():
        g["met"] = None if g["value"] is None else g["value"] <= g["at_most"]
    # every refit left a complete set of parameters behind, of the bytes it sent
    res["ok"] = all(checks.values()) and all(
        res["server_params"][k]["tensors"] == res["refits"][k]["tensors"]
        and res["server_params"][k]["bytes"] == res["refits"][k]["bytes"] for k in KINDS)
    return res


def render(res: dict) -> None:
    """Print the figures, the goals beside them."""
    mb = res["bucket_bytes"] / (1 << 20)
    print(f"Refit on {res['device']} through {res['transport']} to a server process: "
          f"{res['layers']} layer(s) of {res['experts']} experts, {res['input_bytes'] / 1e9:.3f} "
          f"GB BF16, buckets of {mb:g} MiB, median of {res['repeats']} after a warm-up")
    print(f"{'refit':6} {'wall ms':>9} {'produce ms':>10} {'send ms':>9} {'hidden ms':>9} "
          f"{'GB moved':>9} {'buckets':>7} {'tensors':>7} {'peak extra':>10} "
          f"{'ms/layer':>9} {'48 layers s':>11}")
    for k in KINDS:
        r = res["refits"][k]
        peak = "n/a" if r["peak_extra_buckets"] is None else f"{r['peak_extra_buckets']:.2f} bkt"
        print(f"{k:6} {r['wall_s'] * 1e3:9.1f} {r['produce_s'] * 1e3:10.1f} "
              f"{r['send_s'] * 1e3:9.1f} {r['hidden_s'] * 1e3:9.1f} {r['bytes'] / 1e9:9.3f} "
              f"{r['buckets']:7d} {r['tensors']:7d} {peak:>10} {r['per_layer_s'] * 1e3:9.2f} "
              f"{r['scaled_48_layers_s']:11.2f}")
    print("server, per refit: " + "; ".join(
        f"{k} unpickle {c['unpickle_s'] * 1e3:.1f} ms, copies {c['copy_s'] * 1e3:.1f} ms "
        f"({c['loads']:.0f} buckets)" for k, c in res["server_clock_per_refit"].items()))
    print(f"NVFP4/BF16 refit time: {res['ratio']:.3f} (paired by round: "
          f"{res['ratio_paired']:.3f}); bytes moved: {res['bytes_ratio']:.3f}")
    print("delivered: " + ", ".join(f"{k}: {'equal' if v else 'DIFFERS'}"
                                    for k, v in res["checks"].items()))
    print("goals (not asserted):")
    names = {"nvfp4_over_bf16_time": "NVFP4 refit / BF16 refit (time)",
             "peak_extra_buckets": "peak extra device memory, NVFP4 refit (buckets)"}
    for key, g in res["goals"].items():
        if g["value"] is None:
            print(f"  {names[key]:50} n/a on this device")
            continue
        print(f"  {names[key]:50} {g['value']:7.3f}  goal <= {g['at_most']:g}  "
              f"{'met' if g['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    """Measure, print, write ``--json``; non-zero when the server's parameters are not what the
    trainer sent."""
    ap = argparse.ArgumentParser(prog="python -m tests.bench refit",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 4 on a GPU where they fit, 1 on the CPU)")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per layer (default: 128 on a GPU, 8 on the CPU)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="bucket size in MiB (default: 512 on a GPU, 64 on the CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed refits of each kind (default: 7 on a GPU, 3 on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--profile", action="store_true",
                    help="after the timing, profile the NVFP4 refit's producer")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.experts is None:
        args.experts = EXPERTS if cuda else 8
    if args.bucket_mb is None:
        args.bucket_mb = 512 if cuda else 64
    if args.repeats is None:
        args.repeats = 7 if cuda else 3
    res = measure(args)
    render(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
