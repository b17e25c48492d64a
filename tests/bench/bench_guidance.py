"""Guidance record encode/decode throughput, on the CPU and (when present) on a CUDA device.

Workload: one rollout of ``--tokens`` token positions through ``--layers`` MoE layers of
Qwen3-30B-A3B shape (FC1 input 2,048 values per token; FC2 input 8 × 768 per token), the
sampler's full E2M1 codes, E4M3 block scales and fp32 row scales as capture holds them
(random codes; sizes, not values, set the cost). For ``bits`` in 1, 2, 4 (and 1 with zlib):

* ``encode``: :meth:`GuidanceRecord.encode` from rows on the device to the final bytes;
* ``decode``: :meth:`GuidanceRecord.decode` from bytes to rows (low bits) on the device.

Baseline, measured in the same run: ``clone``, one copy of the captured code tensors on the
device (one byte a value read and written): the memory traffic any encoder (reading the codes)
or decoder (writing them) must at least pay. Columns: seconds (best of ``--repeats``),
tokens/s, values/s, record MB/s, and ``clone/op``, the baseline's seconds over the row's
(1.0 = as fast as a bare copy of the codes; higher is better).

Run: ``python -m tests.bench guidance [-- --tokens 4096 --layers 4 --device cuda]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from libalign.guidance import GuidanceRecord, SiteRows

from .measure import Col, print_table, seconds

HIDDEN, INTER, TOP_K = 2048, 768, 8


def _rows(tokens: int, site: str, device: str, gen: torch.Generator) -> SiteRows:
    n = tokens if site == "fc1" else tokens * TOP_K
    k = HIDDEN if site == "fc1" else INTER
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen).to(device)
    scales = torch.randint(0x20, 0x70, (n, k // 16), dtype=torch.uint8, generator=gen).to(device)
    rs = torch.rand(n, generator=gen).to(device)
    pos = torch.arange(tokens, dtype=torch.int32).repeat_interleave(n // tokens).to(device)
    exp = (torch.full((n,), -1, dtype=torch.int16) if site == "fc1" else
           torch.randint(0, 128, (n,), dtype=torch.int16, generator=gen)).to(device)
    return SiteRows(pos, exp, codes, scales, rs, k)


def run(device: str, tokens: int, layers: int, repeats: int) -> list[dict]:
    """One table's rows for ``device``."""
    gen = torch.Generator().manual_seed(0)
    sites = {(layer, s): _rows(tokens, s, device, gen) for layer in range(layers)
             for s in ("fc1", "fc2")}
    values = sum(r.codes.numel() for r in sites.values())
    rows = []
    for bits, compress in ((1, "none"), (2, "none"), (4, "none"), (1, "zlib")):
        rec = GuidanceRecord(bits, "minite", sites)
        blob = rec.encode(compress)
        size = len(blob)
        t_copy = seconds(lambda: [r.codes.clone() for r in sites.values()], repeats, device)
        t_enc = seconds(lambda rec=rec, c=compress: rec.encode(c), repeats, device)
        t_dec = seconds(lambda b=blob: GuidanceRecord.decode(b, device), repeats, device)
        for op, t in (("encode", t_enc), ("decode", t_dec)):
            rows.append({"device": device, "bits": bits, "compress": compress, "op": op,
                         "bytes": size, "bytes_per_token": size / tokens, "seconds": t,
                         "tokens_per_s": tokens / t, "mb_per_s": size / t / 1e6,
                         "values_per_s": values / t,
                         "copy_seconds": t_copy, "vs_copy": t_copy / t})
    return rows


def _print(rows: list[dict], tokens: int, layers: int) -> None:
    print(f"one rollout: {tokens} token positions x {layers} layers (fc1 {HIDDEN} + fc2 "
          f"{TOP_K}x{INTER} values per token per layer)")
    print_table([Col("device", "8", "device"), Col("bits", ">4", "bits"),
                 Col("zip", ">5", "compress"), Col("op", "7", "op"),
                 Col("B/token", "9.0f", "bytes_per_token"), Col("seconds", "9.4f", "seconds"),
                 Col("tokens/s", "10.0f", "tokens_per_s"),
                 Col("Gval/s", "7.2f", lambda r: r["values_per_s"] / 1e9),
                 Col("MB/s", "8.0f", "mb_per_s"), Col("clone s", "9.5f", "copy_seconds"),
                 Col("clone/op", "8.3f", "vs_copy")], rows)
    by = {(r["device"], r["bits"], r["compress"]): r["bytes"] for r in rows}
    for dev in sorted({r["device"] for r in rows}):
        b1, b4, z1 = by[(dev, 1, "none")], by[(dev, 4, "none")], by[(dev, 1, "zlib")]
        print(f"{dev}: b=1 record is {b1 / b4:.3f} of the full-code record ({b1 / tokens:.0f} vs "
              f"{b4 / tokens:.0f} B/token); with zlib {z1 / b4:.3f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.bench guidance``."""
    ap = argparse.ArgumentParser(prog="bench_guidance", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", action="append", default=None,
                    help="cpu and/or cuda (default: cpu, plus cuda when available)")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1 layer")
    ap.add_argument("--out", type=Path, default=None, help="write bench_guidance.json here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.layers = 512, 1
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    rows = []
    for dev in devices:
        rows += run(dev, args.tokens, args.layers, args.repeats)
    _print(rows, args.tokens, args.layers)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_guidance.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
