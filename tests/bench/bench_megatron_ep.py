"""Expert-parallel Megatron learner and sharded conversion, one process per rank.

What runs
---------
``--ep P`` processes form one expert-parallel group (``nccl`` with one GPU per rank; NVLink
multicast off in every process, see :mod:`libalign.models.megatron_parallel`). Each builds the
Megatron GPT MoE at Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts, top-8, expert
intermediate 768; ``--layers`` decoder layers, random weights) holding ``128/P`` experts per
layer, and feeds its own ``--tokens`` tokens. Then, per rank:

1. **Step time.** Forward and backward (``logits.sum().backward()``) on each path (``bf16`` is
   the baseline the ratios divide by; ``nvfp4_minite`` runs libalign's W4A4 expert GEMM
   forward and the straight-through bf16 product backward), interleaved round by round,
   every round started together (a barrier), timed with CUDA events; medians.
2. **Sharded conversion.** Each rank quantizes its own expert slices on its own GPU (the fused
   kernel behind :func:`libalign.kernels.quantize`) and writes its part of one version
   (:func:`alignd.sync.sharded.publish_sharded`); the last part to land commits
   the merged manifest. Per rank: the kernel alone (input GB/s of bf16 weights, best of three,
   into reused outputs; ranks sharing a GPU take turns) and the whole part (device-to-host
   copy, checksums, fsynced files; rank 0 also writes the dense tensors). Baseline in the same run: rank 0
   converts the gathered model (every expert, one GPU) with the unsharded writer; the sharded
   version must read back bit-identical to it.
3. **Kill test** (after the group is gone): ``P`` plain processes write the parts of another
   version; one SIGKILLs itself right after its first shard file. The version must not
   become visible (the parent polls the store all along), the other parts must be intact,
   and re-running the killed part must commit a version bit-identical to the gathered one.

Run: ``python -m tests.bench megatron_ep [-- --ep 2 --layers 2 --tokens 8192 --json out.json]``.
``--share-gpu`` runs the ranks on one GPU through ``gloo`` (a functional check where only one
GPU is lent: the step times then include host-memory collectives and two ranks sharing one
GPU, so they are not EP speed). ``--tiny`` is a CPU smoke run (gloo, a 2-layer 8-expert
model). Without enough GPUs (and neither flag) it prints that it skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .bench_megatron import Timer

PATHS = ("bf16", "nvfp4_minite")


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench_megatron_ep", description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size = number of ranks")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192, tiny 64)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, tiny 16)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 8, tiny 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--spec", default="minite", help="conversion preset (default minite, row-scaled)")
    p.add_argument("--store", default=None, help="weight store directory (default: a temp dir)")
    p.add_argument("--shard-mb", type=int, default=256, help="shard file size in MiB")
    p.add_argument("--share-gpu", action="store_true", help="all ranks on one GPU via gloo")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPUs via gloo (smoke run)")
    p.add_argument("--no-kill", action="store_true", help="skip the kill test")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _config(o: dict):
    from libalign.models import qwen3_30b_a3b_shaped_config, tiny_config

    over = {} if o["vocab"] is None else {"vocab_size": o["vocab"]}
    if o["tiny"]:
        return tiny_config(num_hidden_layers=o["layers"], vocab_size=o["vocab"] or 48,
                           hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32)
    return qwen3_30b_a3b_shaped_config(num_layers=o["layers"], **over)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --- the rank body -----------------------------------------------------------------------------

def rank_main(info, o: dict) -> dict:
    """One rank: step times per path, then its part of the sharded conversion."""
    import torch.distributed as dist
    from alignd.formats.convert import resolve_spec
    from alignd.formats.selection import make_select
    from alignd.formats.weight_store import WeightStore
    from alignd.sync.sharded import publish_sharded

    from libalign.kernels import ops
    from libalign.models import megatron as mg
    from libalign.models.megatron_cpu import cpu_shims
    from libalign.models.megatron_export import export_hf_state_dict, local_expert_stacks
    from libalign.models.train import cpu_threads

    dev, cuda = info.device, info.device.type == "cuda"
    cfg = _config(o)
    timer = Timer(cuda)
    out: dict = {"rank": info.rank, "ep_rank": info.ep_rank, "device": str(dev),
                 "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "paths": {}}
    threads = cpu_threads(1) if not cuda else _null()
    with cpu_shims(enabled=not cuda), threads:
        model = mg.build_gpt_model(cfg, "bf16", device=dev, seed=o["seed"])
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        out["local_expert_params"] = experts
        g = torch.Generator().manual_seed(1000 + info.rank)
        ids = torch.randint(0, cfg.vocab_size, (o["batch"], o["seq"]), generator=g).to(dev)

        def step():
            for p in model.parameters():
                p.grad = None
            mg.gpt_logits(model, ids).float().sum().backward()

        samples = {p: [] for p in o["paths"]}
        quant = {p: [] for p in o["paths"]}

        def quantize_all():
            mg.clear_weight_cache(model)
            for ex in mg.experts_modules(model).values():
                ex.linear_fc1.prepared()
                ex.linear_fc2.prepared()

        for path in o["paths"]:
            mg.set_path(model, path)
            for _ in range(o["warmup"]):
                step()
        for _ in range(o["repeats"]):
            for path in o["paths"]:
                mg.set_path(model, path)
                quant[path].append(timer(quantize_all))
                dist.barrier()
                samples[path].append(timer(step))
        for path in o["paths"]:
            out["paths"][path] = {"step_ms": statistics.median(samples[path]),
                                  "quantize_ms": statistics.median(quant[path])}
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        ids = None  # free the batch before converting
        for p in model.parameters():
            p.grad = None
        mg.clear_weight_cache(model)

        # sharded conversion: the kernel alone on this rank's expert slices ...
        spec = resolve_spec(o["spec"])
        stacks = list(local_expert_stacks(model).values())
        nbytes = sum(t.numel() * t.element_size() for t in stacks)
        outs = [ops.quantize(s, spec) for s in stacks]  # warm-up; reused outputs below
        kernel_s = math.inf
        for turn in range(info.world_size if o["share_gpu"] else 1):
            dist.barrier()  # ranks sharing one GPU take turns, so each is timed alone
            if o["share_gpu"] and turn != info.rank:
                continue
            for _ in range(3):  # best of three
                _sync(dev)
                t = time.perf_counter()
                for s, q in zip(stacks, outs, strict=True):
                    ops.quantize(s, spec, out=q)
                _sync(dev)
                kernel_s = min(kernel_s, time.perf_counter() - t)
        del stacks, outs
        # ... and the whole part, written and committed
        store = WeightStore(o["store"])
        dist.barrier()
        t = time.perf_counter()
        res = publish_sharded(model, cfg, store, o["vid"], spec, device=str(dev),
                              shard_bytes=o["shard_bytes"])
        part_s = time.perf_counter() - t
        dist.barrier()
        out["convert"] = {"expert_bytes": nbytes, "kernel_s": kernel_s,
                          "kernel_gbps": nbytes / kernel_s / 1e9, "part_s": part_s,
                          "part_gbps": nbytes / part_s / 1e9, "committed": res.committed,
                          "stored_bytes": res.stored_bytes}
        # the baseline: the gathered model converted on one device by the unsharded writer
        fused = export_hf_state_dict(model, cfg, device=None)  # collective (all-gather)
        if info.rank == 0:
            _sync(dev)
            t = time.perf_counter()
            store.write_version(o["vid"] + "-gathered", fused, spec, select=make_select(),
                                shard_bytes=o["shard_bytes"], device=str(dev))
            out["gathered_s"] = time.perf_counter() - t
            out["gathered_expert_bytes"] = sum(v.numel() * v.element_size()
                                               for k, v in fused.items() if ".experts." in k)
        del fused
        dist.barrier()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- the kill test -----------------------------------------------------------------------------

def _expert_slices(o: dict, part: int, parts: int, device: str):
    """Deterministic expert stacks of the kill test: expert ``e`` of layer ``i`` is drawn from
    its own seed, so a part's slice does not depend on how the experts are split."""
    from alignd.formats.sharded_version import Piece

    cfg = _config(o)
    e_all, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    per = e_all // parts
    dev = torch.device(device)
    for i in range(cfg.num_hidden_layers):
        for stack, shape in (("gate_up_proj", (2 * inter, h)), ("down_proj", (h, inter))):
            rows = []
            for e in range(part * per, (part + 1) * per):
                g = torch.Generator(device=dev).manual_seed(i * 100_003 + e * 7 + len(stack))
                rows.append(torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
                            .mul_(0.02).to(torch.bfloat16))
            name = f"model.layers.{i}.mlp.experts.{stack}"
            yield name, Piece(torch.stack(rows), part * per, e_all)


def kill_writer(part: int, parts: int, o: dict, vid: str, device: str, kill: bool) -> None:
    """A part writer in a plain process; with ``kill`` it SIGKILLs itself after one shard."""
    from alignd.formats.convert import resolve_spec
    from alignd.formats.sharded_version import write_part
    from alignd.formats.weight_store import WeightStore

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))

    def on_step(what: str) -> None:
        if kill and what.startswith("shard"):
            os.kill(os.getpid(), signal.SIGKILL)

    write_part(WeightStore(o["store"]), vid, part, parts, _expert_slices(o, part, parts, device),
               resolve_spec(o["spec"]), shard_bytes=o["kill_shard_bytes"], device=device,
               on_step=on_step)


def _kill_test(o: dict, parts: int, devices: list[str]) -> dict:
    import multiprocessing as mp

    from alignclient.errors import VersionNotFoundError
    from alignd.formats.convert import resolve_spec
    from alignd.formats.sharded_version import part_status
    from alignd.formats.weight_store import WeightStore

    store, vid, victim = WeightStore(o["store"]), "kill-test", parts - 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=kill_writer, args=(p, parts, o, vid, devices[p], p == victim))
             for p in range(parts)]
    seen = False
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        seen |= vid in store.list_versions()
        time.sleep(0.01)
    for p in procs:
        p.join()
    seen |= vid in store.list_versions()
    status = part_status(store, vid, parts)
    try:
        store.read_version(vid)
        readable = True
    except VersionNotFoundError:
        readable = False
    out = {"exit_codes": [p.exitcode for p in procs], "visible_before_rerun": seen or readable,
           "status_after_kill": status}
    t = time.perf_counter()
    p = ctx.Process(target=kill_writer, args=(victim, parts, o, vid, devices[victim], False))
    p.start()
    p.join()
    out["rerun_exit"], out["rerun_s"] = p.exitcode, time.perf_counter() - t
    out["visible_after_rerun"] = vid in store.list_versions()
    got = store.read_version(vid)  # checksums verified
    ref_store = WeightStore(Path(o["store"]) / "reference")
    slices = [dict(_expert_slices(o, q, parts, devices[0])) for q in range(parts)]
    whole = {name: torch.cat([s[name].tensor for s in slices]) for name in slices[0]}
    del slices
    ref_store.write_version(vid, whole, resolve_spec(o["spec"]), device=devices[0])
    ref = ref_store.read_version(vid)
    out["bitwise_equal_gathered"] = _versions_equal(got, ref)
    return out


def _versions_equal(a, b) -> bool:
    """Same tensor names; raw tensors equal, NVFP4 ones bit for bit (NVFP4Tensor.bitwise_equal)."""
    if set(a.tensors) != set(b.tensors):
        return False
    for name, x in a.tensors.items():
        y = b.tensors[name]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif not x.bitwise_equal(y):
            return False
    return True


# --- the parent ---------------------------------------------------------------------------------

def _options(args, store: str) -> dict:
    tokens = args.tokens or (64 if args.tiny else 8192)
    seq = min(args.seq or (16 if args.tiny else 2048), tokens)
    return {"layers": args.layers, "vocab": args.vocab, "tiny": args.tiny, "seed": 0,
            "batch": max(1, tokens // seq), "seq": seq,
            "repeats": args.repeats or (2 if args.tiny else 8), "warmup": args.warmup,
            "paths": [p for p in args.paths.split(",") if p], "spec": args.spec, "store": store,
            "share_gpu": bool(args.share_gpu),
            "vid": "ep-step-0", "shard_bytes": (1 << 14) if args.tiny else args.shard_mb << 20,
            "kill_shard_bytes": (1 << 12) if args.tiny else 64 << 20}


def _print(results: dict) -> None:
    ranks, paths = results["ranks"], results["options"]["paths"]
    print(f"\nstep time per rank (forward + backward, {results['options']['batch']} x "
          f"{results['options']['seq']} tokens per rank), median of "
          f"{results['options']['repeats']} rounds")
    print(f"{'rank':<6}{'device':<10}" + "".join(f"{p + ' ms':>18}{'x bf16':>8}" for p in paths)
          + f"{'quantize ms':>13}{'peak GiB':>10}")
    for r in ranks:
        base = r["paths"].get("bf16", {}).get("step_ms")
        row = f"{r['rank']:<6}{r['device']:<10}"
        for p in paths:
            ms = r["paths"][p]["step_ms"]
            row += f"{ms:>18.2f}{(ms / base if base else math.nan):>8.3f}"
        q = [r["paths"][p]["quantize_ms"] for p in paths if p != "bf16"]
        row += f"{(q[0] if q else math.nan):>13.2f}{r.get('peak_gib', math.nan):>10.1f}"
        print(row)
    print(f"\nsharded conversion ({results['options']['spec']}), per rank; baseline: rank 0 "
          f"converting the gathered model")
    print(f"{'rank':<6}{'expert GB':>10}{'kernel s':>10}{'kernel GB/s':>13}{'part s':>9}"
          f"{'part GB/s':>11}{'committed':>11}")
    for r in ranks:
        c = r["convert"]
        print(f"{r['rank']:<6}{c['expert_bytes'] / 1e9:>10.3f}{c['kernel_s']:>10.4f}"
              f"{c['kernel_gbps']:>13.1f}{c['part_s']:>9.2f}{c['part_gbps']:>11.2f}"
              f"{c['committed']!s:>11}")
    g = results["gathered"]
    print(f"gathered: {g['expert_bytes'] / 1e9:.3f} GB in {g['seconds']:.2f} s; sharded wall "
          f"(slowest part) {g['sharded_wall_s']:.2f} s = x{g['speedup']:.2f} faster; "
          f"bit-identical: {g['bitwise_equal']}")
    k = results.get("kill")
    if k:
        print(f"kill test: exit codes {k['exit_codes']}, visible before re-run "
              f"{k['visible_before_rerun']}, parts {k['status_after_kill']}, re-run exit "
              f"{k['rerun_exit']} in {k['rerun_s']:.1f} s, visible after {k['visible_after_rerun']}, "
              f"bit-identical to gathered {k['bitwise_equal_gathered']}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("bench_megatron_ep: skipped, megatron-core is not installed")
        return 0
    from alignd.formats.weight_store import WeightStore

    from libalign.models.megatron_parallel import NO_MULTICAST_ENV, launch

    gpus = torch.cuda.device_count()
    if args.tiny:
        backend, device = "gloo", "cpu"
    elif args.share_gpu and gpus >= 1:
        backend, device = "gloo", "cuda"
    elif gpus >= args.ep:
        backend, device = "nccl", "cuda"
    else:
        print(f"bench_megatron_ep: skipped, --ep {args.ep} needs {args.ep} GPUs ({gpus} visible); "
              f"--share-gpu runs it on one GPU through gloo, --tiny on CPUs")
        return 0
    tmp = None
    if args.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-megatron-ep-")
    store = args.store or tmp.name
    o = _options(args, store)
    print(f"bench_megatron_ep: ep {args.ep}, backend {backend} on {device}, {gpus} GPU(s), "
          f"env {NO_MULTICAST_ENV}", flush=True)
    t0 = time.perf_counter()
    ranks = launch(rank_main, args.ep, args=(o,), backend=backend, device=device,
                   timeout_s=args.timeout)
    print(f"ranks done in {time.perf_counter() - t0:.1f} s", flush=True)
    ws = WeightStore(store)
    sharded = ws.read_version(o["vid"])
    gathered = ws.read_version(o["vid"] + "-gathered")
    wall = max(r["convert"]["part_s"] for r in ranks)
    results = {"options": o, "backend": backend, "device": device, "gpus": gpus,
               "env": NO_MULTICAST_ENV, "ranks": ranks,
               "gathered": {"seconds": ranks[0]["gathered_s"],
                            "expert_bytes": ranks[0]["gathered_expert_bytes"],
                            "sharded_wall_s": wall, "speedup": ranks[0]["gathered_s"] / wall,
                            "bitwise_equal": _versions_equal(sharded, gathered)}}
    del sharded, gathered
    if not args.no_kill:
        devices = [f"cuda:{p % gpus}" if device == "cuda" else "cpu" for p in range(args.ep)]
        results["kill"] = _kill_test(o, args.ep, devices)
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if tmp is not None:
        tmp.cleanup()
    ok = results["gathered"]["bitwise_equal"] and (
        args.no_kill or (not results["kill"]["visible_before_rerun"]
                         and results["kill"]["bitwise_equal_gathered"]))
    return 0 if ok else 1
