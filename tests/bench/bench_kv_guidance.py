"""FP4 KV cache and KV guidance (issue 19 items 1-2): record bytes, throughput, learner overhead.

Three tables, each against a baseline measured in the same run:

1. **Bytes per token** of K/V guidance for Qwen3-30B-A3B's shapes (48 layers, 4 KV heads of
   128: 1,024 K/V values a layer and token), as records hold them (codes' low bits, block
   scales, row scale, index), for ``kv_nvfp4`` and ``kv_mxfp4`` at ``b`` = 1, 2, 4, against
   the full-code record (``b = 4``); the ``encoded`` column is the length of an actual encoded
   record per token (random codes), which must equal the planned one.
2. **Throughput** on the CPU (and CUDA when present) for ``--tokens`` tokens through
   ``--layers`` layers of those shapes: the FP4 cache's write (:func:`libalign.kernels.quantize` of
   the K and V rows: the compiled kernels for ``kv_nvfp4`` and ``kv_mxfp4``) and read
   (:func:`libalign.models.kv_cache.dequantize_kv`: the spec's bits), and a record's encode
   and decode at ``b = 1``. Baseline: ``clone``, one copy of the bf16 K/V (what any pass
   over them must at least move); ``clone/op`` is the baseline's seconds over the row's
   (higher is better).
3. **Learner step** of the embedded engine on CPU (the tiny Qwen3-MoE, ``--rollouts``
   rollouts of the synthetic task): ``nvfp4_trace_kv_nvfp4`` with the sampler's activation +
   K/V records against ``nvfp4_trace`` with its activation records (the step without KV
   quantization), and both without records (K/V rounded to nearest against bf16 K/V); median
   and best seconds of ``--repeats`` round-robin steps and the overhead against the
   baseline (TRACE reports 7.4 % in total for its weight + KV guidance; of its step, KV
   TRACE is 2 % and KV dequantization 8 %).

Run: ``python -m tests.bench kv_guidance [-- --tokens 2048 --layers 2 --device cuda]``.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import torch

from libalign.guidance import GuidanceRecord, SiteRows
from libalign.guidance.sizes import size_for_config
from libalign.kernels import ops
from libalign.models.kv_cache import dequantize_kv
from libalign.spec import PRESETS

from .measure import Col, overheads, pct, print_table, round_robin, seconds

LAYERS, KV_HEADS, HEAD_DIM = 48, 4, 128
CONFIG = {"num_hidden_layers": LAYERS, "hidden_size": 2048, "moe_intermediate_size": 768,
          "num_experts_per_tok": 8, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "num_attention_heads": 32}
KV = ("kv_nvfp4", "kv_mxfp4")


def _kv_rows(tokens: int, kv: str, device: str, gen: torch.Generator) -> SiteRows:
    """A K (or V) section of one layer as capture holds it: one row per token and head."""
    n, block = tokens * KV_HEADS, PRESETS[kv].block_size
    return SiteRows(torch.arange(tokens, dtype=torch.int32).repeat_interleave(KV_HEADS).to(device),
                    torch.arange(KV_HEADS, dtype=torch.int16).repeat(tokens).to(device),
                    torch.randint(0, 16, (n, HEAD_DIM), dtype=torch.uint8, generator=gen).to(device),
                    torch.randint(0x20, 0x70, (n, HEAD_DIM // block), dtype=torch.uint8,
                                  generator=gen).to(device),
                    torch.rand(n, generator=gen).to(device), HEAD_DIM)


def _record(tokens: int, layers: int, kv: str, bits: int, device: str) -> GuidanceRecord:
    gen = torch.Generator().manual_seed(0)
    sites = {(layer, s): _kv_rows(tokens, kv, device, gen) for layer in range(layers)
             for s in ("k", "v")}
    return GuidanceRecord(bits, "minite", sites, kv_spec=kv)


def sizes(tokens: int) -> list[dict]:
    """Table 1: planned and encoded K/V record bytes per token, against b = 4."""
    rows = []
    for kv in KV:
        full = size_for_config(CONFIG, bits=4, sites=(), kv=True, kv_spec=kv)["kv"]
        for bits in (1, 2, 4):
            plan = size_for_config(CONFIG, bits=bits, sites=(), kv=True, kv_spec=kv)["kv"]
            rec = _record(tokens, 1, kv, bits, "cpu")
            data = rec.encode()
            (hlen,) = struct.unpack("<I", data[4:8])
            raw = sum(s["raw"] for s in json.loads(data[8:8 + hlen])["sections"])
            code_scales = (bits / 8 + 1 / PRESETS[kv].block_size) * 2 * KV_HEADS * HEAD_DIM * LAYERS
            rows.append({"kv": kv, "bits": bits, "planned": plan, "full": full,
                         "encoded": raw / tokens * LAYERS, "vs_full": plan / full,
                         "codes_scales": code_scales,
                         "codes_scales_vs_full": code_scales / ((4 / 8 + 1 / PRESETS[kv].block_size)
                                                                * 2 * KV_HEADS * HEAD_DIM * LAYERS)})
    return rows


def throughput(device: str, tokens: int, layers: int, repeats: int) -> list[dict]:
    """Table 2: cache write/read and record encode/decode, against a bf16 clone."""
    gen = torch.Generator().manual_seed(1)
    x = [(torch.randn(tokens * KV_HEADS, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
         .to(device) for _ in range(2 * layers)]
    values = sum(t.numel() for t in x)
    t_copy = seconds(lambda: [t.clone() for t in x], repeats, device)
    out = []
    for kv in KV:
        spec = PRESETS[kv]
        qs = [ops.quantize(t, spec) for t in x]
        rec = _record(tokens, layers, kv, 1, device)
        blob = rec.encode()
        timings = {
            "cache write": seconds(lambda s=spec: [ops.quantize(t, s) for t in x], repeats,
                                   device),
            "cache read": seconds(lambda q=qs: [dequantize_kv(t, torch.bfloat16) for t in q],
                                  repeats, device),
            "record encode": seconds(lambda r=rec: r.encode(), repeats, device),
            "record decode": seconds(lambda b=blob: GuidanceRecord.decode(b, device), repeats,
                                     device),
        }
        for op, t in timings.items():
            out.append({"device": device, "kv": kv, "op": op, "seconds": t,
                        "tokens_per_s": tokens / t, "values_per_s": values / t,
                        "copy_seconds": t_copy, "vs_copy": t_copy / t,
                        "backend": ops.backend_for(x[0], spec) if op == "cache write" else ""})
    return out


def _learner_setup(shape: str, rollouts: int, device: str):
    """``(model, prompts, max_new_tokens, eos_id, pad_id)`` of the learner-step table."""
    from libalign import models

    if shape == "tiny":
        model, task = models.trained_tiny_model()
        prompts = [p for p in task.prompts(rollouts // 4, 0) for _ in range(4)]
        return model.to(device), prompts, task.max_completion_len, task.eos_id, task.pad_id
    cfg = models.qwen3_30b_a3b_shaped_config(2)
    model = models.build_model(cfg, seed=0, device=device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (128,), generator=gen).tolist()
               for _ in range(rollouts // 4)]
    return model, [p for p in prompts for _ in range(4)], 32, -1, 0


def learner_steps(rollouts: int, repeats: int, shape: str = "tiny",
                  device: str = "cpu") -> list[dict]:
    """Table 3: the embedded learner's step with and without KV quantization/guidance."""
    from alignd.learner.engine import TorchLearnerEngine, TrainBatch

    from libalign import models

    model, prompts, new_tokens, eos_id, pad_id = _learner_setup(shape, rollouts, device)
    with models.use_kv_format(model, "kv_nvfp4"), models.capture_guidance(model) as cap, \
            models.capture_kv(model, cap):
        r = models.generate(model, prompts, "nvfp4_minite", max_new_tokens=new_tokens,
                            eos_id=eos_id, pad_id=pad_id, temperature=1.0)
    recs = cap.records(1)
    act_only = {i: GuidanceRecord(rec.bits, rec.spec, {k: v for k, v in rec.sites.items()
                                                       if k[1] in ("fc1", "fc2")})
                for i, rec in recs.items()}
    samp = [t.tolist() for t in r.logprobs]
    rewards = [float(i % 2) for i in range(len(prompts))]
    groups = [i // 4 for i in range(len(prompts))]
    cases = (("nvfp4_trace", act_only, "activation records (baseline)"),
             ("nvfp4_trace_kv_nvfp4", recs, "FP4 K/V guided, activation + K/V records"),
             ("nvfp4_trace", None, "no records (round to nearest)"),
             ("nvfp4_trace_kv_nvfp4", None, "FP4 K/V round to nearest, no records"))
    runs = []
    for path, guidance, what in cases:
        eng = TorchLearnerEngine(model, path, pad_id=pad_id, lr=0.0)
        batch = TrainBatch(r.sequences, r.prompt_lens, samp, rewards, groups, guidance)
        runs.append((lambda e=eng, b=batch: e.train_step(b),
                     {"path": path, "records": what, "shape": shape, "device": device}))
    out = round_robin(runs, repeats, device)
    refs = [out[0], out[0], out[2], out[2]]
    for row, ref in zip(out, refs, strict=True):
        row["against"] = ref["records"]
    return overheads(out, refs)


def _print(size_rows, tput_rows, step_rows, tokens, layers, rollouts) -> None:
    print(f"1. K/V guidance bytes per token, Qwen3-30B-A3B shapes ({LAYERS} layers x "
          f"{KV_HEADS} KV heads x {HEAD_DIM} x K,V); baseline: the full-code record (b=4)")
    print_table([Col("format", "9", "kv"), Col("bits", ">4", "bits"),
                 Col("planned B", "10.0f", "planned"), Col("encoded B", "10.0f", "encoded"),
                 Col("full B", "8.0f", "full"), Col("vs full", "8.3f", "vs_full"),
                 Col("codes+scales B", "15.0f", "codes_scales"),
                 Col("vs full", "8.3f", "codes_scales_vs_full")], size_rows)
    print("(planned/encoded: what a record holds, row scale and index included; codes+scales: "
          "TRACE's accounting)")
    print(f"\n2. throughput, {tokens} tokens x {layers} layers x K,V "
          f"({KV_HEADS}x{HEAD_DIM} values a token); baseline: a bf16 clone of K/V")
    print_table([Col("device", "7", "device"), Col("format", "9", "kv"), Col("op", "14", "op"),
                 Col("backend", "8", "backend"), Col("seconds", "9.4f", "seconds"),
                 Col("tokens/s", "10.0f", "tokens_per_s"),
                 Col("Mval/s", "8.1f", lambda r: r["values_per_s"] / 1e6),
                 Col("clone s", "9.5f", "copy_seconds"), Col("clone/op", "8.3f", "vs_copy")],
                tput_rows)
    if step_rows:
        print(f"\n3. embedded learner step on {step_rows[0]['device']}, {step_rows[0]['shape']} "
              f"Qwen3-MoE, {rollouts} rollouts; baselines: nvfp4_trace with activation records "
              "(rows 1-2), nvfp4_trace without records (rows 3-4)")
        print_table([Col("path", "22", "path"), Col("records", "44", "records"),
                     Col("median s", "8.3f", "seconds"), Col("overhead", ">9", pct("overhead", 9)),
                     Col("best s", "8.3f", "best"),
                     Col("overhead", ">9", pct("overhead_best", 9))], step_rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.bench kv_guidance``."""
    ap = argparse.ArgumentParser(prog="bench_kv_guidance", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--device", action="append", default=None,
                    help="cpu and/or cuda (default: cpu, plus cuda when available)")
    ap.add_argument("--no-learner", action="store_true", help="skip table 3 (needs transformers)")
    ap.add_argument("--learner-shape", choices=("tiny", "qwen3_30b"), default="tiny",
                    help="table 3's model: the trained tiny one, or 2 layers of Qwen3-30B-A3B "
                    "shapes (random weights, 128-token prompts, 32 new tokens; for a GPU)")
    ap.add_argument("--learner-device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: steadier on a shared host)")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1 layer, 16 rollouts")
    ap.add_argument("--out", type=Path, default=None, help="write bench_kv_guidance.json here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.rollouts = 512, 1, 16
    torch.set_num_threads(args.threads)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    size_rows = sizes(256)
    tput_rows = [r for dev in devices for r in throughput(dev, args.tokens, args.layers,
                                                          args.repeats)]
    step_rows = [] if args.no_learner else learner_steps(args.rollouts, args.repeats,
                                                         args.learner_shape, args.learner_device)
    _print(size_rows, tput_rows, step_rows, args.tokens, args.layers, args.rollouts)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kv_guidance.json").write_text(json.dumps(
            {"sizes": size_rows, "throughput": tput_rows, "learner": step_rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
