"""SGLang weight sync: what a version costs before the servers read it, old way against new.

Workload: one MoE layer of Qwen3-30B-A3B shapes in the per-expert names SGLang loads,
``E`` experts of gate/up 768x2048 and down 2048x768, BF16, seeded randn (E=8 by default:
75.5 MB; ``--experts``).

Baseline, measured in this run: what a sampler does on every load without the converter's
one export per version: convert the published BF16 version into a ModelOpt NVFP4
checkpoint on the CPU (:func:`alignd.formats.export.convert_checkpoint`, tensor-scaled
``modelopt`` preset, fused gate/up sharing one scale), inside its load.

Rows:

* the sampler's load step with the converter's export present (the new way: it only checks
  the export is there);
* the converter's re-layout of the store version into that export, once per version
  (:class:`alignd.formats.modelopt_export.ModelOptExport`, no quantization);
* the converter's store conversion, which both ways pay (BF16 -> the store version under the
  SGLang path's spec, fused siblings sharing one maximum).

Best of ``--repeats`` wall times; ratios are to the baseline. The export's codes are checked
against the store's (the same bits, re-laid out). Run: ``python -m tests.bench sglang_sync``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from alignd.formats.convert import convert_published
from alignd.formats.export import convert_checkpoint
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.published import write_published
from alignd.formats.weight_store import WeightStore
from safetensors.torch import load_file

from libalign.gemm import get_path

INTER, HIDDEN = 768, 2048


def weights(experts: int) -> dict[str, torch.Tensor]:
    """One MoE layer's experts in Qwen3-MoE's per-expert names, plus a router and a norm."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp"
    sd = {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER))):
            sd[f"{p}.experts.{e}.{proj}.weight"] = (torch.randn(shape, generator=g) * 0.02
                                                    ).bfloat16()
    sd[f"{p}.gate.weight"] = torch.randn(experts, HIDDEN, generator=g).bfloat16()
    sd["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return sd


def best(fn: Callable[[int], object], repeats: int) -> float:
    """The best wall time of ``fn(i)`` over ``repeats`` calls."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    """Print the table; non-zero if the export's bits differ from the store's."""
    ap = argparse.ArgumentParser(prog="python -m tests.bench sglang_sync")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        root = Path(tmp)
        model = root / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
        (model / "tokenizer.json").write_text("{}")
        store = WeightStore(root / "store")
        sd = weights(args.experts)
        src = write_published(store.published_root, "v", sd)
        (src / "config.json").write_text((model / "config.json").read_text())
        bytes_in = sum(t.numel() * t.element_size() for t in sd.values())

        def old(i: int) -> None:  # the sampler's own BF16 -> ModelOpt conversion, per load
            convert_checkpoint(src, root / f"old-{i}", preset="modelopt", fmt="modelopt")

        spec = get_path("nvfp4_naive").weight_spec

        def store_conversion(i: int) -> None:
            convert_published(src, store, f"s{i}", spec, share_fused=True)

        exports = ModelOptExport(store, model)

        def relayout(i: int) -> None:
            shutil.rmtree(exports.path("s0"), ignore_errors=True)
            exports.write("s0")

        def sampler_new(i: int) -> None:
            exports("s0")

        t_old = best(old, args.repeats)
        t_store = best(store_conversion, args.repeats)
        t_relayout = best(relayout, args.repeats)
        t_new = best(sampler_new, max(args.repeats, 10))
        stored = store.read_version("s0")
        got = {}
        for f in exports.path("s0").glob("*.safetensors"):
            got.update(load_file(f))
        same = all(torch.equal(got[f"{n.removesuffix('.weight')}.weight"], q.codes)
                   for n, q in stored.tensors.items() if not isinstance(q, torch.Tensor))
    rows = [("baseline: sampler converts BF16 -> ModelOpt on every load (before)", "sampler",
             "every load, every sampler", t_old),
            ("sampler load step, export present (now)", "sampler", "every load", t_new),
            ("re-layout store version -> ModelOpt export (now)", "converter", "once per version",
             t_relayout),
            ("store conversion, BF16 -> store version (both)", "converter", "once per version",
             t_store)]
    print(f"SGLang weight sync, {args.experts} experts of {INTER}x{HIDDEN} (gate, up) and "
          f"{HIDDEN}x{INTER} (down), {bytes_in / 1e6:.1f} MB BF16, CPU, best of "
          f"{args.repeats}; export bits equal the store's: {same}")
    print(f"| {'step':<70} | {'where':<9} | {'paid':<25} | {'ms':>9} | {'x baseline':>10} |")
    print(f"|{'-' * 72}|{'-' * 11}|{'-' * 27}|{'-' * 11}|{'-' * 12}|")
    for name, where, paid, t in rows:
        print(f"| {name:<70} | {where:<9} | {paid:<25} | {t * 1e3:>9.3f} | {t / t_old:>10.5f} |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
