"""Diagnosis benchmark: ``alignd diagnose`` end to end, with the seconds of every stage.

On a CUDA device the model is Qwen3-30B-A3B-shaped (128 experts, hidden 2048, top-8, random
weights, ``--layers`` decoder layers, prompts of random token ids); on the CPU the built-in
trained tiny model. The run is the same code path as the command line (shared-token paired
comparison to the bf16 floor, localization, 2×2 replay, context swap), and the tables printed
are the report's own: statistics with intervals, the comparison to the floor, the context
swap and the timings. The named baseline of each NVFP4 condition is the ``bf16/bf16`` floor
measured on the same tokens in the same run (its ratio column is P99 |δ| over the floor's).

Run: ``python -m tests.bench diagnose [-- --layers 4 --prompts 256 --out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from alignd.tools.diagnose import DiagnoseConfig, render, run_diagnosis, write_outputs
from rich.console import Console


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench diagnose")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--n-boot", type=int, default=500)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_diagnose"))
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    cfg = DiagnoseConfig(
        model="qwen3-30b-a3b-shaped" if gpu else "tiny", num_layers=args.layers,
        num_prompts=args.prompts or (128 if gpu else 512), prompt_len=args.prompt_len,
        max_new_tokens=args.new_tokens if gpu else None, localize_sequences=32 if gpu else 128,
        n_boot=args.n_boot, device=args.device)
    start = time.perf_counter()
    report = run_diagnosis(cfg)
    write_outputs(report, Path(args.out))
    console = Console(width=200)
    render.render_report(report, console)
    shape = f" ({args.layers} layers)" if gpu else ""
    console.print(f"model: {cfg.model}{shape} on {args.device}; "
                  f"wall {time.perf_counter() - start:.1f} s; report in {args.out}")
    return 0
