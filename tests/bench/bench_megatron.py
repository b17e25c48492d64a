"""Megatron-core learner benchmark: forward + backward of a Megatron GPT MoE on each path.

The model is :func:`libalign.models.megatron.build_gpt_model` at Qwen3-30B-A3B's layer shapes
(:func:`libalign.models.qwen3_30b_a3b_shaped_config`: hidden 2048, 128 experts, top-8,
expert intermediate 768, 32 query / 4 key-value heads of 128, vocabulary 151,936) with two
decoder layers, random weights, one process (world size 1). All paths run in one process on
the same model and the same token batch, interleaved round by round so that clock drift hits
them alike; each number is a median of CUDA-event timings.

Rows, one per path (``bf16`` is the baseline the ratios divide by):

* ``model ms``: the whole model's forward and backward (``logits.sum().backward()``), weights
  already prepared (a weight version is quantized once and used for many micro-batches);
* ``experts ms``: layer 0's routed experts alone (FC1, SwiGLU, FC2 and the router weighting
  on the layer's own dispatched tokens), forward and backward;
* ``quantize ms``: preparing every expert stack of the model for the path once (what each
  optimizer step adds: new weights, new NVFP4 bits);
* ``rel L2``: the logits' relative L2 distance to a first ``bf16`` forward (a sanity check, not
  a quality claim: random weights; the ``bf16`` row shows the GPU's run-to-run noise, from the
  atomic scatter-add that combines the experts' outputs).

Measured (one H200, torch 2.11, megatron-core 0.19.2, 8,192 tokens as 4 x 2,048, median of
10 rounds): model 75.4 ms on ``bf16``, x1.06 ``nvfp4_naive``, x1.01 ``nvfp4_minite``, x1.21
``nvfp4_trace``; layer 0's experts 25.3 ms on ``bf16``, x1.09, x1.16, x1.38; quantizing all
expert weights 39-43 ms a step. The straight-through backward runs a Python loop over the
experts (:class:`libalign.gemm._GroupedSTE`), which keeps the step launch-bound and hides
part of the quantized forward's extra GPU time in the whole-model column.

``nvfp4_trace`` runs with the guided-rounding hook attached and no sampler records: every
row's key is formed and looked up, and the rows round to nearest in the path's own
activation pass (the cost of the guided path's bookkeeping).
``nvfp4_trace_rec`` is TRACE as a learner runs it: every expert row has a sampler record
(2 low bits a value, captured from this model's own ``nvfp4_minite`` forward on the same
batch, so the guided rows reproduce round-to-nearest and ``rel L2`` equals minite's).

The goal rows at the end divide by the same run's numbers: ``nvfp4_minite``
model time over ``bf16`` (goal <= 1.10), the weight quantization per step of
``nvfp4_minite`` (goal <= 5 ms), and ``nvfp4_trace_rec`` model time over ``nvfp4_minite``
(goal <= 1.074, TRACE's own overhead figure). Every step runs inside
:func:`libalign.gemm.finite_checks.deferred_finite_checks`, as the learner's does: each expert GEMM
queues its NaN/Inf check and the step reads them all once at its end.
``nvfp4_minite_sync`` checks at every GEMM instead (one device synchronisation each, which
stalls the host's queue: the behaviour outside a deferred block), ``nvfp4_minite_nocheck``
not at all (:func:`libalign.models.megatron.set_finite_check`). ``nvfp4_trace_rec`` rounds the
guided rows inside the Triton activation pass
(:func:`libalign.gemm.triton_grouped.fused_guidance`, the default);
``nvfp4_trace_rec_unfused`` quantizes them first (:func:`libalign.guidance.guided_quantize`:
dozens of tensor passes), as before that pass existed.

FP4 KV rows: ``nvfp4_minite_kv`` is ``nvfp4_minite`` with K and V quantized to
``kv_nvfp4`` in Megatron's attention and read back dequantized
(:mod:`libalign.models.megatron_kv`: the KV quantize and dequantize cost);
``nvfp4_trace_kv_rec`` is ``nvfp4_trace_kv_nvfp4`` as a learner runs it: expert rows and K/V
rows all guided by records (captured from this model's own ``nvfp4_minite_kv`` forward on the
batch, so its ``rel L2`` equals ``nvfp4_minite_kv``'s). Their goal row divides
``nvfp4_trace_kv_rec`` by ``nvfp4_minite`` (TRACE's 7.4 % for weight, activation and KV
guidance and the KV dequantization together). Both read K/V back in one fused Triton pass
(:func:`libalign.gemm.triton_grouped.triton_qdq_rows`, the default on CUDA); their ``_torchkv`` twins
take the unfused path instead (:func:`libalign.gemm.triton_grouped.fused_kv` off: ``ops.quantize`` or
``guided_quantize``, then ``dequantize_kv``; the same bits), as before that pass existed.

Routing replay (R3): ``nvfp4_minite_r3`` is ``nvfp4_minite`` with every token's
routing replayed from records (:func:`libalign.models.megatron_routing.replay_routing`, gate
weights recomputed): the records are this model's own top-k on the batch, with every 10th
token's experts shifted by one, so one token in ten is forced and the rest is compared and
kept. Its goal row divides it by ``nvfp4_minite`` (R3's bookkeeping: per layer a key lookup,
the set comparison and the forced probabilities).

Run: ``python -m tests.bench megatron [-- --tokens 8192 --repeats 10 --json out.json]``.
Without CUDA it prints that it skipped, unless ``--tiny`` (a 2-layer, 8-expert model small
enough for a CPU smoke run). Works with megatron-core 0.16 and 0.19.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

PATHS = ("bf16", "nvfp4_naive", "nvfp4_minite", "nvfp4_minite_sync", "nvfp4_minite_nocheck",
         "nvfp4_trace", "nvfp4_minite_r3",
         "nvfp4_trace_rec", "nvfp4_trace_rec_unfused", "nvfp4_minite_kv", "nvfp4_trace_kv_rec",
         "nvfp4_minite_kv_torchkv", "nvfp4_trace_kv_rec_torchkv")
RECORD_BITS = 2
GOALS = {"minite_model": 1.10, "quantize_ms": 5.0, "trace_rec_over_minite": 1.074}


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench_megatron", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, CPU allowed (smoke run)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 8192, tiny 64)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, tiny 16)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 10, tiny 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


class Timer:
    """Milliseconds of a callable: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)


def _config(args):
    from libalign.models import qwen3_30b_a3b_shaped_config, tiny_config

    over = {} if args.vocab is None else {"vocab_size": args.vocab}
    if args.tiny:
        return tiny_config(num_hidden_layers=args.layers, vocab_size=args.vocab or 48, hidden_size=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32)
    return qwen3_30b_a3b_shaped_config(num_layers=args.layers, **over)


def _run(args) -> dict:
    from contextlib import nullcontext

    from libalign.gemm.finite_checks import deferred_finite_checks
    from libalign.models import megatron as mg
    from libalign.models.megatron_cpu import cpu_shims, single_process_group

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = _config(args)
    tokens = args.tokens or (64 if args.tiny else 8192)
    seq = min(args.seq or (16 if args.tiny else 2048), tokens)
    batch = max(1, tokens // seq)
    repeats = args.repeats or (2 if args.tiny else 10)
    paths = [p for p in args.paths.split(",") if p]
    timer = Timer(cuda)
    results: dict = {"config": {
        "hidden": cfg.hidden_size, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "moe_intermediate": cfg.moe_intermediate_size, "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size, "batch": batch, "seq": seq,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "megatron_core": _megatron_version()}, "paths": {}}
    print(f"bench_megatron: {results['config']}", flush=True)
    with single_process_group(), cpu_shims():
        t0 = time.perf_counter()
        model = mg.build_gpt_model(cfg, "bf16", backend=args.backend, device=dev)
        print(f"built the model in {time.perf_counter() - t0:.1f} s "
              f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)", flush=True)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
        from libalign.guidance import row_keys

        # sequence b, position s: the keys a sampler's records carry, in Megatron's [s, b] order
        keys = row_keys(torch.arange(batch, device=dev)[:, None],
                        torch.arange(seq, device=dev).expand(batch, seq)).T

        captured = {}
        layer0 = mg.moe_layers(model)[0]

        def grab(_mod, inp):
            captured["x"], captured["counts"], captured["probs"] = (
                inp[0].detach(), inp[1], inp[2].detach())

        hook = layer0.experts.register_forward_pre_hook(grab)
        with torch.no_grad():
            ref = mg.gpt_logits(model, ids).float()
        hook.remove()

        def checks(path):  # as a learner's step: every GEMM's NaN/Inf check read once at the end
            return nullcontext() if path.endswith("_sync") else deferred_finite_checks()

        def model_step(path):
            for p in model.parameters():
                p.grad = None
            with checks(path):
                mg.gpt_logits(model, ids).sum().backward()

        def experts_step(path):
            x = captured["x"].clone().requires_grad_(True)
            with checks(path):
                y, _ = layer0.experts(x, captured["counts"], captured["probs"])
                y.backward(torch.ones_like(y))

        def quantize_all():
            mg.clear_weight_cache(model)
            for ex in mg.experts_modules(model).values():
                ex.linear_fc1.prepared()
                ex.linear_fc2.prepared()

        guided = any(p.startswith("nvfp4_trace_rec") for p in paths)
        table = _records(mg, model, ids, keys, dev) if guided else None
        table_kv = _records(mg, model, ids, keys, dev, kv=True) \
            if any(p.startswith("nvfp4_trace_kv_rec") for p in paths) else None
        routes = _routing_table(mg, model, ids, keys, dev, batch, seq) \
            if any(p.endswith("_r3") for p in paths) else None
        samples = {p: {"model": [], "experts": [], "quantize": []} for p in paths}
        for path in paths:  # warm-up, compile, first quantization; quality check
            mg.set_path(model, _model_path(path))
            with _path_ctx(mg, model, path, keys, table, table_kv, routes):
                for _ in range(args.warmup):
                    model_step(path)
                    experts_step(path)
                with torch.no_grad():
                    out = mg.gpt_logits(model, ids).float()
            rel = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
            results["paths"][path] = {"rel_l2_vs_bf16": rel}
            del out
        for _ in range(repeats):
            for path in paths:
                mg.set_path(model, _model_path(path))
                with _path_ctx(mg, model, path, keys, table, table_kv, routes):
                    samples[path]["quantize"].append(timer(quantize_all))
                    samples[path]["model"].append(timer(lambda: model_step(path)))  # noqa: B023
                    samples[path]["experts"].append(timer(lambda: experts_step(path)))  # noqa: B023
        mg.set_row_keys(model, None)
    base = {k: statistics.median(samples["bf16"][k]) for k in ("model", "experts")} \
        if "bf16" in samples else None
    print(f"{'path':<28}{'model ms':>10}{'x bf16':>8}{'experts ms':>12}{'x bf16':>8}"
          f"{'quantize ms':>13}{'rel L2':>10}")
    for path in paths:
        r = results["paths"][path]
        for k in ("model", "experts", "quantize"):
            r[f"{k}_ms"] = statistics.median(samples[path][k])
        if base:
            r["model_ratio"] = r["model_ms"] / base["model"]
            r["experts_ratio"] = r["experts_ms"] / base["experts"]
        q = "-" if path == "bf16" else f"{r['quantize_ms']:.2f}"
        print(f"{path:<28}{r['model_ms']:>10.2f}{r.get('model_ratio', math.nan):>8.3f}"
              f"{r['experts_ms']:>12.2f}{r.get('experts_ratio', math.nan):>8.3f}{q:>13}"
              f"{r['rel_l2_vs_bf16']:>10.4f}", flush=True)
    results["goals"] = _goals(results["paths"])
    return results


def _goals(rows: dict) -> list[dict]:
    """The goal rows, each a ratio or time of this run against its goal."""
    out = []

    def add(name, value, goal, unit):
        if value is None or math.isnan(value):
            return
        out.append({"goal": name, "value": value, "target": goal, "met": value <= goal})
        print(f"  {name:<44}{value:>9.3f}{unit:<3} goal <= {goal:g}{unit}  "
              f"{'met' if value <= goal else 'NOT met'}", flush=True)

    print("goals (same-run baselines):")
    mn = rows.get("nvfp4_minite", {})
    add("nvfp4_minite whole model / bf16", mn.get("model_ratio"), GOALS["minite_model"], "x")
    for key, name in (("nvfp4_minite_sync", "nvfp4_minite, a sync per GEMM's check / bf16"),
                      ("nvfp4_minite_nocheck", "nvfp4_minite, no NaN check / bf16")):
        add(name, rows.get(key, {}).get("model_ratio"), GOALS["minite_model"], "x")
    add("nvfp4_minite weight quantization per step", mn.get("quantize_ms"), GOALS["quantize_ms"],
        "ms")
    for key, name in (("nvfp4_trace_rec", "nvfp4_trace (records) whole model / minite"),
                      ("nvfp4_trace_rec_unfused", "  ... guided rounding before the act pass"),
                      ("nvfp4_trace_kv_rec", "nvfp4_trace + FP4 KV (records) / minite"),
                      ("nvfp4_trace_kv_rec_torchkv", "  ... K/V read back by torch ops"),
                      ("nvfp4_minite_r3", "nvfp4_minite + routing replay / minite")):
        if key in rows and mn:
            add(name, rows[key]["model_ms"] / mn["model_ms"], GOALS["trace_rec_over_minite"], "x")
    kv = rows.get("nvfp4_minite_kv", {})
    ratios = [(f"{a} / {b}", rows[a]["model_ms"] / rows[b]["model_ms"]) for a, b in (
        ("nvfp4_minite_kv", "nvfp4_minite"), ("nvfp4_minite_kv_torchkv", "nvfp4_minite"),
        ("nvfp4_trace_kv_rec", "nvfp4_minite_kv"), ("nvfp4_trace_kv_rec_torchkv",
                                                    "nvfp4_minite_kv_torchkv"))
        if a in rows and b in rows]
    if ratios and kv:  # the FP4 KV cost and the KV guidance's over it (no goal: TRACE's parts)
        print("FP4 KV ratios (same run):")
        for name, value in ratios:
            print(f"  {name:<52}{value:>9.3f}x", flush=True)
    return out


def _model_path(path: str) -> str:
    return "nvfp4_minite" if path in ("nvfp4_minite_nocheck", "nvfp4_minite_sync",
                                      "nvfp4_minite_kv", "nvfp4_minite_kv_torchkv",
                                      "nvfp4_minite_r3") else \
        "nvfp4_trace" if path.startswith("nvfp4_trace") else path


def _records(mg, model, ids, keys, dev, kv: bool = False):
    """A guidance table with a record for every expert row: the model's own nvfp4_minite
    activations of this batch, captured through the experts' activation hook (``kv``: of a
    forward with FP4 K/V, whose K/V rows are captured too)."""
    from contextlib import nullcontext

    from libalign.guidance import GuidanceCapture, GuidanceTable
    from libalign.kernels import ops
    from libalign.models import megatron_kv
    from libalign.spec import PRESETS

    cap = GuidanceCapture(PRESETS["minite"])

    def hook(layer, site, a, spec, row_keys):
        q = ops.quantize(a.detach(), spec)
        cap.add(layer, site, q, row_keys)
        return q

    mods = mg.experts_modules(model)
    mg.set_path(model, "nvfp4_trace")
    mg.set_row_keys(model, keys)
    for ex in mods.values():
        ex.act_hook = hook
    try:
        with torch.no_grad(), megatron_kv.use_kv(model, "kv_nvfp4", capture=cap) if kv \
                else nullcontext():
            mg.gpt_logits(model, ids)
    finally:
        for ex in mods.values():
            ex.act_hook = None
        mg.set_row_keys(model, None)
    table = GuidanceTable(cap.records(RECORD_BITS), dev)
    print(f"records: {len(table.sites)} sites, {RECORD_BITS} bits a value", flush=True)
    return table


def _routing_table(mg, model, ids, keys, dev, batch: int, seq: int):
    """R3 records for the batch: the model's own top-k per token and MoE layer (captured from
    Megatron's routers), every 10th token's experts shifted by one (forced on replay)."""
    from libalign.models.paths import wrapped_method
    from libalign.models.routing_replay import RoutingTable
    from libalign.routing.records import RoutingRecord

    routers = {i: layer.router for i, layer in mg.moe_layers(model).items()}
    own: dict[int, torch.Tensor] = {}

    def make(i, original):
        def routing(logits, *args, **kwargs):
            probs, rmap = original(logits, *args, **kwargs)
            k = int(rmap[0].sum())
            own[i] = rmap.nonzero()[:, 1].reshape(rmap.shape[0], k)  # ascending ids per token
            return probs, rmap
        return routing

    mg.set_row_keys(model, keys)
    try:
        with torch.no_grad(), wrapped_method(routers, "routing", make):
            mg.gpt_logits(model, ids)
    finally:
        mg.set_row_keys(model, None)
    layers = sorted(own)
    e = model.config.num_moe_experts
    idx = torch.stack([own[i] for i in layers], 1)  # [s*b, L, k] in Megatron's [s, b] order
    idx[::10] = (idx[::10] + 1) % e  # still k distinct experts, another set
    idx = idx.reshape(seq, batch, len(layers), -1).to("cpu", torch.uint8 if e <= 256 else torch.int16)
    recs = {b: RoutingRecord(idx[:, b].contiguous(), tuple(layers), e) for b in range(batch)}
    return RoutingTable(recs, dev)


def _megatron_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # older layouts
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown"))


class _path_ctx:
    """Attach the guided-rounding hook and row keys on ``nvfp4_trace`` (no records) and
    ``nvfp4_trace_rec`` (``table``'s records); FP4 K/V on the ``_kv`` rows (guided by
    ``table_kv`` on ``nvfp4_trace_kv_rec``, whose experts take its records too)."""

    def __init__(self, mg, model, path, keys, table=None, table_kv=None, routes=None):
        self.mg, self.model, self.keys = mg, model, keys
        self.routes = routes if path.endswith("_r3") else None
        self.r3_ctx = None
        self.on = path.startswith("nvfp4_trace")
        self.table = table if path.startswith("nvfp4_trace_rec") else \
            table_kv if path.startswith("nvfp4_trace_kv_rec") else None
        self.kv = "_kv" in path
        self.unchecked = path.endswith("_nocheck")
        self.unfused = path.endswith("_unfused")
        self.torch_kv = path.endswith("_torchkv")
        self.ctx = self.fused_ctx = self.kv_ctx = None

    def __enter__(self):
        if self.unchecked:
            self.mg.set_finite_check(self.model, False)
        if self.unfused:
            from libalign.gemm.triton_grouped import fused_guidance

            self.fused_ctx = fused_guidance(False)
            self.fused_ctx.__enter__()
        if self.on:
            self.mg.set_row_keys(self.model, self.keys)
            self.ctx = self.mg.use_guidance(self.model, self.table)
            self.ctx.__enter__()
        if self.routes is not None:
            from libalign.models.megatron_routing import replay_routing

            self.mg.set_row_keys(self.model, self.keys)
            self.r3_ctx = replay_routing(self.model, self.routes, weights="recompute")
            self.r3_ctx.__enter__()
        if self.kv:
            from libalign.models import megatron_kv

            if self.torch_kv:
                from libalign.gemm.triton_grouped import fused_kv

                self.torch_kv_ctx = fused_kv(False)
                self.torch_kv_ctx.__enter__()
            self.kv_ctx = megatron_kv.use_kv(self.model, "kv_nvfp4", self.table)
            self.kv_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.unchecked:
            self.mg.set_finite_check(self.model, True)
        if self.fused_ctx is not None:
            self.fused_ctx.__exit__(*exc)
        if self.kv_ctx is not None:
            self.kv_ctx.__exit__(*exc)
            if self.torch_kv:
                self.torch_kv_ctx.__exit__(*exc)
        if self.r3_ctx is not None:
            self.r3_ctx.__exit__(*exc)
            self.mg.set_row_keys(self.model, None)
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.mg.set_row_keys(self.model, None)
        return False


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("bench_megatron: skipped, needs a CUDA device (--tiny runs a small model on the CPU)")
        return 0
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("bench_megatron: skipped, megatron-core is not installed (pip install 'libalign[megatron]')")
        return 0
    results = _run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
