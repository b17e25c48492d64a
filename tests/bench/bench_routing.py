"""Routing replay (R3): record bytes, encode/decode throughput, learner overhead.

Three tables, each against a baseline measured in the same run:

1. **Bytes per token** of a routing record (:mod:`libalign.routing.records`) for the tiny demo
   model (4 MoE layers, top-2 of 8), Qwen3-30B-A3B (48 layers, top-8 of 128) and a
   256-expert and a 512-expert model (one and two bytes an id), ids only and with bf16 gate
   weights; ``encoded`` is the length an actual record's :meth:`to_bytes` gives, which must
   equal the planned one; the baseline is the same choices as int64 ``torch.topk`` indices
   (what a capture holds before packing).
2. **Throughput** on the CPU (and CUDA when present): encode (ids to raw bytes, the wire's
   base64 on top) and decode (:meth:`RoutingRecord.from_bytes`, its checks, and the wire
   model's validation) of ``--tokens`` tokens of Qwen3-30B-A3B routing. Baseline: ``clone``
   of the int64 indices.
3. **Learner step** of the embedded engine on CPU (the trained tiny Qwen3-MoE, ``--rollouts``
   rollouts sampled on ``nvfp4_minite``): ``nvfp4_minite`` with R3 (``recompute``), with the
   recorded weights (``record``) and counting only (``measure``) against the unreplayed step
   (``off``); median and best seconds of ``--repeats`` round-robin steps, and the paired
   overhead (median over rounds of a step's time over the baseline's in the same round).
   TRACE measured 7.4 % in total for its guidance.
4. With ``--ranks P`` (P >= 2): the same step of the **Megatron-core learner over P
   expert-parallel ``gloo`` ranks** on the CPU, driven through
   :class:`~alignd.learner.ranks.RankGroupEngine` (rank 0 checks and splits the routing
   records, every rank replays its share's): ``measure`` and ``recompute`` against ``off``,
   round robin, the same columns (wall time of rank 0's ``train_step``, which waits for every
   rank).

5. **R3 record against SGLang's dense form** (what slime, Miles and verl keep): bytes per
   token of a record (MoE layers only; ids, then with fp32 gate weights) against SGLang's
   ``[len - 1, num_hidden_layers, top_k]`` int32 (and its uint16/uint8 wires), Qwen3-30B-A3B
   and a model with dense layers in between; ``round trip`` checks ``to_dense`` /
   ``from_dense`` give back the same ids on a record of ``--tokens`` tokens.
6. **Replay at the TopKRouter** (:mod:`libalign.models.megatron_routing`) on the CPU: one
   Megatron-core ``TopKRouter`` of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8,
   fp32 router), forward of ``--tokens`` tokens, with ``recompute`` and ``record`` replay
   (every token has a record; a quarter of them disagree) and ``off`` (counting only), against
   the plain router, round robin in the same run.

Run: ``python -m tests.bench routing [-- --tokens 4096 --rollouts 32 --repeats 7 --ranks 2]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from pathlib import Path

import torch

from libalign.routing.records import RoutingRecord, bytes_per_token, id_dtype

from .measure import Col, overheads, pct, print_table, round_robin, seconds

MODELS = {"tiny (4 x top-2 of 8)": (4, 2, 8), "Qwen3-30B-A3B (48 x top-8 of 128)": (48, 8, 128),
          "256 experts (48 x top-8)": (48, 8, 256), "512 experts (48 x top-8)": (48, 8, 512)}


def _record(tokens: int, layers: int, k: int, experts: int, weights: bool,
            device: str = "cpu") -> RoutingRecord:
    g = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(tokens * layers, experts, generator=g, device=device)
    top = scores.topk(k, dim=-1)
    ids = top.indices.reshape(tokens, layers, k).to(id_dtype(experts))
    w = top.values.reshape(tokens, layers, k).to(torch.bfloat16) if weights else None
    return RoutingRecord(ids, tuple(range(layers)), experts, w)


def sizes(tokens: int = 64) -> list[dict]:
    """Table 1."""
    out = []
    for name, (layers, k, experts) in MODELS.items():
        for weights in (False, True):
            rec = _record(tokens, layers, k, experts, weights)
            ids, w = rec.to_bytes()
            encoded = (len(ids) + (len(w) if w else 0)) / tokens
            planned = bytes_per_token(layers, k, experts, weights=weights)
            int64 = layers * k * 8
            out.append({"model": name, "weights": weights, "planned": planned,
                        "encoded": encoded, "int64": int64, "vs_int64": planned / int64})
    return out


def _from_wire(wire) -> RoutingRecord:
    ids, w = wire.raw()
    return RoutingRecord.from_bytes(ids, positions=wire.positions, layers=wire.layers,
                                    top_k=wire.top_k, num_experts=wire.num_experts, weights=w)


def throughput(device: str, tokens: int, repeats: int) -> list[dict]:
    """Table 2 (Qwen3-30B-A3B routing, ids and bf16 weights)."""
    from alignclient.models import RoutingWire

    layers, k, experts = MODELS["Qwen3-30B-A3B (48 x top-8 of 128)"]
    rec = _record(tokens, layers, k, experts, True, device)
    idx64 = rec.experts.long()
    ids, w = rec.to_bytes()
    wire_kw = dict(layers=list(rec.layers), top_k=k, num_experts=experts,
                   experts=base64.b64encode(ids).decode(), weights=base64.b64encode(w).decode())
    cases = {
        "clone int64 indices (baseline)": lambda: idx64.clone(),
        "encode: to_bytes": rec.to_bytes,
        "encode: to_bytes + base64": lambda: [base64.b64encode(b) for b in rec.to_bytes()],
        "decode: from_bytes (checked)": lambda: RoutingRecord.from_bytes(
            ids, positions=tokens, layers=rec.layers, top_k=k, num_experts=experts, weights=w),
        "decode: wire validation + from_bytes": lambda: _from_wire(RoutingWire(**wire_kw)),
    }
    out = []
    base = None
    for what, fn in cases.items():
        s = seconds(fn, repeats, device, stat=statistics.median)
        base = base or s
        out.append({"device": device, "op": what, "seconds": s,
                    "tokens_per_s": tokens / s, "mb_per_s": rec.nbytes() / s / 1e6,
                    "baseline_over_op": base / s})
    return out


def _routed_batch(rollouts: int):
    """The trained tiny model, its task, and a GRPO batch of ``rollouts`` rollouts (groups of
    4) sampled on nvfp4_minite with their routing records (and gate weights)."""
    from alignd.learner.engine import TrainBatch

    from libalign import models
    from libalign.models.routing_replay import capture_routing

    model, task = models.trained_tiny_model()
    prompts = [p for p in task.prompts(rollouts // 4, seed=11) for _ in range(4)]
    with capture_routing(model, weights=True) as cap:
        r = models.generate(model, prompts, "nvfp4_minite", max_new_tokens=task.max_completion_len,
                            eos_id=task.eos_id, pad_id=task.pad_id, temperature=1.0)
    recs = cap.records()
    samp = [t.tolist() for t in r.logprobs]
    rewards = [float(i % 2) for i in range(len(prompts))]
    groups = [i // 4 for i in range(len(prompts))]
    return model, task, TrainBatch(r.sequences, r.prompt_lens, samp, rewards, groups,
                                   routing=recs)


def learner_steps(rollouts: int, repeats: int) -> list[dict]:
    """Table 3: the embedded learner's step with routing replay against the unreplayed one."""
    from alignd.learner.engine import TorchLearnerEngine, TrainBatch

    model, task, routed = _routed_batch(rollouts)
    engines, runs = {}, []
    for mode in ("off", "measure", "recompute", "record"):
        eng = engines[mode] = TorchLearnerEngine(model, "nvfp4_minite", pad_id=task.pad_id,
                                                 lr=0.0, routing_replay=mode)
        batch = TrainBatch(routed.sequences, routed.prompt_lens, routed.sampler_logprobs,
                           routed.rewards, routed.groups,
                           routing=None if mode == "off" else routed.routing)
        runs.append((lambda e=eng, b=batch: e.train_step(b), {"mode": mode}))
    rows = round_robin(runs, repeats)
    for row in rows:  # every step of a mode trains the same batch: one disagreement
        row["disagreement"] = engines[row["mode"]].routing_stats.disagreement
    return overheads(rows)


RANK_MODES = ("off", "measure", "recompute")


def rank_steps(info, batch, repeats: int, threads: int) -> dict | None:
    """Table 4, one rank: an engine per mode of :data:`RANK_MODES`; every round, each mode's
    step once (rank 0 drives a RankGroupEngine, the others follow); round 0 warms up."""
    from alignd.learner.megatron_engine import MegatronLearnerEngine
    from alignd.learner.ranks import RankGroupEngine, follow

    from libalign import models
    from libalign.models.megatron_cpu import cpu_shims

    torch.set_num_threads(threads)
    model, task = models.trained_tiny_model(device="cpu")
    rows = {m: {"mode": m, "times": [], "disagreement": None} for m in RANK_MODES}
    with cpu_shims(enabled=info.device.type == "cpu"):
        engines = {m: MegatronLearnerEngine.from_hf_state_dict(
            model.state_dict(), model.config, "nvfp4_minite", device=info.device, lr=0.0,
            pad_id=task.pad_id, routing_replay=m) for m in RANK_MODES}
        for rnd in range(repeats + 1):
            for m in RANK_MODES:
                if info.rank != 0:
                    follow(engines[m])
                    continue
                group = RankGroupEngine(engines[m])
                try:
                    t = time.perf_counter()
                    group.train_step(batch)
                    dt = time.perf_counter() - t
                finally:
                    group.close()
                if rnd:
                    rows[m]["times"].append(dt)
                rows[m]["disagreement"] = group.routing_stats.disagreement
    return list(rows.values()) if info.rank == 0 else None


def rank_group_steps(ranks: int, rollouts: int, repeats: int, threads: int) -> list[dict]:
    """Table 4: the Megatron learner over ``ranks`` gloo ranks, R3 against the plain step."""
    from libalign.models.megatron_parallel import launch

    _model, _task, batch = _routed_batch(rollouts)
    got = launch(rank_steps, ranks, args=(batch, repeats, threads), backend="gloo",
                 timeout_s=3600)
    return overheads(got[0])


#: (decoder layers, MoE layers, top-k, experts) of table 5
DENSE_MODELS = {"Qwen3-30B-A3B (48 layers, all MoE, top-8 of 128)": (48, 48, 8, 128),
                "48 layers, every other MoE, top-8 of 256": (48, 24, 8, 256)}


def dense_sizes(tokens: int) -> list[dict]:
    """Table 5: record bytes against SGLang's dense form, and a lossless round trip."""
    from libalign.routing.records import dense_bytes_per_token

    rows = []
    for name, (num_layers, moe, k, experts) in DENSE_MODELS.items():
        rec = _record(min(tokens, 512), moe, k, experts, False)
        step = num_layers // moe
        rec = RoutingRecord(rec.experts, tuple(range(step - 1, num_layers, step)), experts)
        back = RoutingRecord.from_dense(rec.to_dense(num_layers), layers=rec.layers,
                                        num_experts=experts)
        ids = bytes_per_token(moe, k, experts)
        rows.append({"model": name, "record_ids": ids,
                     "record_fp32_weights": bytes_per_token(moe, k, experts, weights=True,
                                                            weight_bytes=4),
                     "dense_int32": dense_bytes_per_token(num_layers, k),
                     "dense_uint16": dense_bytes_per_token(num_layers, k, "uint16"),
                     "dense_uint8": dense_bytes_per_token(num_layers, k, "uint8")
                     if experts <= 256 else None,
                     "int32_over_record": dense_bytes_per_token(num_layers, k) / ids,
                     "round_trip": torch.equal(back.experts, rec.experts)})
    return rows


def router_replay(tokens: int, repeats: int, device: str = "cpu") -> list[dict]:
    """Table 6: a Qwen3-30B-A3B-shaped TopKRouter's forward with replay against without, on
    ``device`` (the router and its input there; records stay where the replay keeps them)."""
    from libalign.guidance import row_keys
    from libalign.models import megatron_routing as mr
    from libalign.models.megatron_cpu import cpu_shims, single_process_group
    from libalign.models.routing_replay import RoutingTable

    with single_process_group("gloo"), cpu_shims(enabled=device == "cpu"):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig

        cfg = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=32,
                                num_moe_experts=128, moe_router_topk=8, moe_router_dtype="fp32",
                                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                                params_dtype=torch.bfloat16, bf16=True,
                                moe_token_dispatcher_type="allgather")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            router = TopKRouter(config=cfg,
                                pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        router = router.to(device)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, 1, 2048, generator=g).to(torch.bfloat16).to(device)
        router.row_keys = row_keys(0, torch.arange(tokens))
        with mr.capture_routers({0: router}, weights=True) as cap, torch.no_grad():
            router(x)
        rec = cap.records()[0]
        flip = torch.arange(tokens) % 4 == 0  # a quarter of the tokens disagree
        ids = rec.experts.clone()
        used = torch.zeros(tokens, 128, dtype=torch.bool, device=ids.device).scatter(
            1, ids[:, 0].long(), True)
        unused = (~used).to(torch.int8).argmax(1)  # the lowest expert a row does not name
        ids[flip, 0, -1] = unused[flip].to(ids.dtype)
        table = RoutingTable({0: RoutingRecord(ids, rec.layers, 128, rec.weights)})

        seen: dict[str, float | None] = {"none": None}

        def run(mode):
            def step():
                with torch.no_grad():
                    if mode == "none":
                        return router(x)
                    with mr.replay_routers({0: router}, table, weights=mode) as st:
                        out = router(x)
                    seen[mode] = st.disagreement
                    return out
            return step

        rows = round_robin([(run(m), {"mode": m, "device": device})
                            for m in ("none", "off", "recompute", "record")], repeats, device)
    for row in rows:
        row["disagreement"] = seen[row["mode"]]
    return overheads(rows)


def _print_steps(rows: list[dict]) -> None:
    print_table([Col("routing_replay", "14", "mode"), Col("median s", "9.4f", "seconds"),
                 Col("best s", "8.4f", "best"), Col("overhead", ">9", pct("overhead", 9)),
                 Col("(best)", ">8", pct("overhead_best", 8)),
                 Col("(paired)", ">9", pct("overhead_paired", 9)),
                 Col("disagreement", ">12", lambda r: "–" if r["disagreement"] is None
                     else f"{100 * r['disagreement']:.2f}%")], rows)


def _print_r3(dense_rows, router_rows, tokens) -> None:
    print("\n5. R3 record (MoE layers, uint8/int16 ids) against SGLang's dense "
          "[len-1, layers, k] form (int32: what slime, Miles and verl keep); bytes per token")
    print_table([Col("model", "48", "model"), Col("record", "7.0f", "record_ids"),
                 Col("+fp32 w", "8.0f", "record_fp32_weights"),
                 Col("int32", "6.0f", "dense_int32"), Col("uint16", "7.0f", "dense_uint16"),
                 Col("uint8", ">6", lambda r: "–" if r["dense_uint8"] is None
                     else str(r["dense_uint8"])),
                 Col("int32/rec", "9.2f", "int32_over_record"),
                 Col("lossless", ">8", lambda r: str(r["round_trip"]))], dense_rows)
    for dev in dict.fromkeys(r["device"] for r in router_rows):
        print(f"\n6. TopKRouter forward on {dev}, Qwen3-30B-A3B shape (2048 -> 128, top-8, "
              f"fp32), {tokens} tokens, every token recorded, 1 in 4 disagreeing; baseline: "
              "no replay")
        _print_steps([r for r in router_rows if r["device"] == dev])


def _print(size_rows, tput_rows, step_rows, tokens, rollouts, rank_rows=(), ranks=0) -> None:
    print("1. routing record bytes per token; baseline: int64 top-k indices")
    print_table([Col("model", "36", "model"), Col("weights", ">7", lambda r: str(r["weights"])),
                 Col("planned B", "9.0f", "planned"), Col("encoded B", "9.0f", "encoded"),
                 Col("int64 B", "8.0f", "int64"), Col("vs int64", "8.3f", "vs_int64")], size_rows)
    print(f"\n2. encode/decode of {tokens} tokens of Qwen3-30B-A3B routing (ids + bf16 weights); "
          "baseline: clone of the int64 indices")
    print_table([Col("device", "6", "device"), Col("op", "40", "op"),
                 Col("ms", "9.3f", lambda r: 1e3 * r["seconds"]),
                 Col("Mtok/s", "8.3f", lambda r: r["tokens_per_s"] / 1e6),
                 Col("MB/s", "9.1f", "mb_per_s"), Col("clone/op", "9.3f", "baseline_over_op")],
                tput_rows)
    if step_rows:
        print(f"\n3. embedded learner step (CPU, tiny model, {rollouts} rollouts sampled on "
              "nvfp4_minite, learner nvfp4_minite); baseline: routing_replay=off")
        _print_steps(step_rows)
    if rank_rows:
        print(f"\n4. Megatron-core learner over {ranks} expert-parallel gloo ranks (CPU, "
              f"RankGroupEngine, same batch and paths); baseline: routing_replay=off")
        _print_steps(rank_rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.bench routing``."""
    ap = argparse.ArgumentParser(prog="bench_routing", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--device", action="append", default=None,
                    help="cpu and/or cuda (default: cpu, plus cuda when available)")
    ap.add_argument("--no-learner", action="store_true", help="skip table 3 (needs transformers)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="also table 4: the Megatron learner over this many ranks (0: skip)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: steadier on a shared host)")
    ap.add_argument("--no-router", action="store_true",
                    help="skip table 6 (needs megatron-core)")
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 16 rollouts, 3 repeats")
    ap.add_argument("--out", type=Path, default=None, help="write bench_routing.json here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.rollouts, args.repeats = 1024, 16, 3
    torch.set_num_threads(args.threads)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    size_rows = sizes()
    bad = [r for r in size_rows if r["encoded"] != r["planned"]]
    tput_rows = [r for dev in devices for r in throughput(dev, args.tokens, args.repeats)]
    step_rows = [] if args.no_learner else learner_steps(args.rollouts, args.repeats)
    rank_rows = rank_group_steps(args.ranks, args.rollouts, args.repeats, args.threads) \
        if args.ranks > 1 else []
    dense_rows = dense_sizes(args.tokens)
    router_rows = [] if args.no_router else [
        r for dev in devices for r in router_replay(args.tokens, args.repeats, dev)]
    _print(size_rows, tput_rows, step_rows, args.tokens, args.rollouts, rank_rows, args.ranks)
    _print_r3(dense_rows, router_rows, args.tokens)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_routing.json").write_text(json.dumps(
            {"sizes": size_rows, "throughput": tput_rows, "learner": step_rows,
             "rank_group": rank_rows, "dense": dense_rows, "router": router_rows}, indent=1))
    if not all(r["round_trip"] for r in dense_rows):
        print("a record did not survive the dense form")
        return 1
    if bad:
        print(f"encoded sizes differ from the plan: {bad}")
        return 1
    return 0
