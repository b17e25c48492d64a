"""Probe: device time of the strict kernels under other tile shapes and attention settings.

Prints, for each candidate :func:`libalign.strict.tensorcore.matmul` configuration, the CUDA
graph time of a 2048x2048 linear, an expert's 1536x2048 product and the 151936x2048 LM head at
8 and 512 rows, whether each gives the bits of the large-call configuration, and cuBLAS's time
as the baseline; then attention's decode (8 x 32/4 heads, 1024 keys) and prefill (4 x 512
tokens) times per (warps, stages, key chunk, query rows[, chunks walked by one program])
against PyTorch's SDPA, and whether each gives the default settings' bits, then the default
settings with the attention module's launch switches (``DEPENDENT_LAUNCH``, ``LATE_FIRST``)
off and on, timed in the same run. It informs the
choice of ``SMALL_CONFIGS``, ``FEW_ROWS_CONFIGS`` and the attention settings; the tests check the bits.
Run: ``python -m tests.bench.probe_strict_tiles`` (``--attention``: the attention rows only,
under the settings the kernel runs by default and their neighbours).
"""

from __future__ import annotations

import argparse
import os

import torch

from libalign.strict import attention as strict_attention
from libalign.strict import tensorcore

from .measure import graph_ms


def _rnd(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.probe_strict_tiles")
    ap.add_argument("--attention", action="store_true",
                    help="time attention only (the default settings and their neighbours)")
    ap.add_argument("--products", action="store_true",
                    help="time the products only, under candidates that also vary the K step")
    ap.add_argument("--bits", metavar="FILE",
                    help="attention's default outputs: saved to FILE when it does not exist, "
                         "else compared with it (another commit's bits)")
    args = ap.parse_args(argv)
    only_attention = args.attention
    print(f"device: {torch.cuda.get_device_name()}")
    if not only_attention:
        _products(args.products)
    if not args.products:
        _attention(only_attention, args.bits)
    if not (only_attention or args.products):
        _profile_layer()


def _products(k_steps: bool) -> None:
    """The strict products under each candidate tile shape against cuBLAS (``k_steps``:
    candidates of 64 rows whose K step is 64, 128 or 256)."""
    big = tensorcore.CONFIGS[torch.bfloat16]
    cands = [big, (64, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 32, 64, 4, 4),
             (64, 128, 64, 4, 4), (128, 64, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3)]
    if k_steps:
        cands = [big, (64, 128, 64, 4, 4), (64, 64, 256, 4, 3), (16, 64, 256, 4, 3),
                 (16, 128, 256, 4, 3), (16, 32, 256, 4, 3), (32, 64, 256, 4, 3),
                 (16, 64, 128, 4, 4), (64, 256, 64, 8, 3)]
    print(f"{'product':22} {'rows':>5} {'cuBLAS ms':>10} " + " ".join(
        f"{'x'.join(map(str, c[:3]))}/{c[3]}w{c[4]}s".rjust(18) for c in cands))
    for name, n in (("linear 2048x2048", 2048), ("expert 1536x2048", 1536),
                    ("LM head 151936x2048", 151936)):
        w = _rnd(n, 2048, scale=2048 ** -0.5, seed=1)
        for m in (8, 512):
            x = _rnd(m, 2048, seed=2)
            base = graph_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), 30)
            ref = tensorcore.matmul(x, w, config=big)
            cells = []
            for c in cands:
                try:
                    ms = graph_ms(lambda x=x, w=w, c=c: _product(x, w, c), 30)
                    same = torch.equal(_product(x, w, c), ref)
                except Exception as e:  # a tile this card cannot run (shared memory)
                    cells.append(type(e).__name__[:17].rjust(18))
                    continue
                cells.append(f"{ms:.4f} {ms / base:5.2f}x {'=' if same else '!'}".rjust(18))
            print(f"{name:22} {m:5d} {base:10.4f} " + " ".join(cells))


def _product(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    """``x @ w.T`` under tile ``config``. ``matmul`` refuses a K step other than its own (the
    step could be part of the bits); the probe launches such a candidate itself to find out."""
    if config[2] == tensorcore.CONFIGS[x.dtype][2]:
        return tensorcore.matmul(x, w, config=config)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    tensorcore._launch_matmul(x, w, out, config=config)
    return out


def _attention(short: bool, bits: str | None) -> None:
    """Decode and prefill attention under each setting against SDPA, and the bits."""
    q, k, v = _rnd(8, 32, 1, 128), _rnd(8, 4, 1024, 128), _rnd(8, 4, 1024, 128)
    seen = torch.ones(8, 1, 1, 1024, dtype=torch.bool, device="cuda")
    qp, kp, vp = _rnd(4, 32, 512, 128), _rnd(4, 4, 512, 128), _rnd(4, 4, 512, 128)
    causal = torch.ones(512, 512, dtype=torch.bool, device="cuda").tril().expand(4, 1, 512, 512)
    sdpa_d = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, enable_gqa=True), 30)
    sdpa_p = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        qp, kp, vp, is_causal=True, enable_gqa=True), 30)
    print(f"\nattention: SDPA decode {sdpa_d:.4f} ms, prefill {sdpa_p:.4f} ms")
    ref_d = strict_attention.attention(q, k, v, seen, 128 ** -0.5)
    ref_p = strict_attention.attention(qp, kp, vp, causal, 128 ** -0.5)
    if bits and os.path.exists(bits):
        saved = torch.load(bits)
        print(f"default bits as {bits}: decode {torch.equal(saved['decode'].cuda(), ref_d)}, "
              f"prefill {torch.equal(saved['prefill'].cuda(), ref_p)}")
    elif bits:
        torch.save({"decode": ref_d.cpu(), "prefill": ref_p.cpu()}, bits)
    cfgs = ((4, 3, 256, 64, False), (8, 3, 256, 64, False), (8, 3, 256, 128, False),
            (8, 3, 256, 128, True), (8, 3, 256, 64, True), (8, 2, 256, 128, True),
            (4, 3, 256, 64, True), (8, 3, 0, 128), (8, 3, 0, 64), (8, 3, 512, 128, True),
            (4, 3, 256, 32, False))
    if short:
        cfgs = ((4, 3, 256, 64, False), (8, 3, 256, 128, True), (8, 2, 256, 128, True),
                (8, 4, 256, 128, True), (4, 3, 256, 64, True), (4, 2, 256, 64, True),
                (4, 1, 256, 64, True), (4, 2, 256, 32, True),
                (8, 3, 256, 64, True))
    for cfg in cfgs:
        try:
            _setting(cfg, q, k, v, seen, qp, kp, vp, causal, ref_d, ref_p, sdpa_d, sdpa_p)
        except Exception as e:  # a setting this card cannot run (shared memory): say so, go on
            print(f"setting {cfg}: {type(e).__name__}: {str(e)[:160]}")
    _launch_switches(q, k, v, seen, qp, kp, vp, causal, ref_d, ref_p, sdpa_d, sdpa_p)
    vr = graph_ms(lambda: strict_attention.visible_range(causal), 30)
    print(f"visible_range of the prefill mask: {vr:.4f} ms (program tile "
          f"{strict_attention.VISIBLE_TILE})")
    default, want = strict_attention.VISIBLE_TILE, strict_attention.visible_range(causal)
    for tile in ((512, 4), (1024, 4), (4096, 4), (8192, 8), (512, 1), (1024, 2), (2048, 2)):
        strict_attention.VISIBLE_TILE = tile
        try:
            same = all(torch.equal(a, b) for a, b in zip(strict_attention.visible_range(causal),
                                                         want, strict=True))
            vr = graph_ms(lambda: strict_attention.visible_range(causal), 30)
            dec = graph_ms(lambda: strict_attention.visible_range(seen), 30)
            print(f"  tile {tile}: prefill mask {vr:.4f} ms, decode mask {dec:.4f} ms, "
                  f"same: {same}")
        finally:
            strict_attention.VISIBLE_TILE = default


def _launch_switches(q, k, v, seen, qp, kp, vp, causal, ref_d, ref_p, sdpa_d, sdpa_p) -> None:
    """The default settings with each launch switch of the attention module off and on
    (DEPENDENT_LAUNCH, LATE_FIRST): time against SDPA, and the default bits."""
    saved = strict_attention.DEPENDENT_LAUNCH, strict_attention.LATE_FIRST
    try:
        for dependent in (False, True):
            for late in (False, True):
                strict_attention.DEPENDENT_LAUNCH, strict_attention.LATE_FIRST = dependent, late
                print(f"default settings, dependent launch {dependent}, late queries first "
                      f"{late}:", end=" ")
                try:
                    _setting(None, q, k, v, seen, qp, kp, vp, causal, ref_d, ref_p, sdpa_d,
                             sdpa_p)
                except Exception as e:  # a switch this card or driver cannot run: say so
                    print(f"{type(e).__name__}: {str(e)[:160]}")
    finally:
        strict_attention.DEPENDENT_LAUNCH, strict_attention.LATE_FIRST = saved


def _setting(cfg, q, k, v, seen, qp, kp, vp, causal, ref_d, ref_p, sdpa_d, sdpa_p) -> None:
    """One attention setting's decode and prefill times and whether it gives the default bits."""
    same = (torch.equal(strict_attention.attention(q, k, v, seen, 128 ** -0.5, config=cfg), ref_d),
            torch.equal(strict_attention.attention(qp, kp, vp, causal, 128 ** -0.5, config=cfg),
                        ref_p))
    d = graph_ms(lambda c=cfg: strict_attention.attention(q, k, v, seen, 128 ** -0.5, config=c), 30)
    p = graph_ms(lambda c=cfg: strict_attention.attention(qp, kp, vp, causal, 128 ** -0.5,
                                                    config=c), 30)
    if cfg is None:
        label = "default"
    else:
        mode = "" if len(cfg) < 5 else (" serial" if cfg[4] else " split")
        label = f"warps {cfg[0]} stages {cfg[1]} key chunk {cfg[2]} query rows {cfg[3]}{mode}"
    print(f"{label}: decode {d:.4f} ms "
          f"({d / sdpa_d:.2f}x), prefill {p:.4f} ms ({p / sdpa_p:.2f}x); bits as the "
          f"default: {same}")


def _profile_layer() -> None:
    """The CUDA kernels of one strict and one normal bf16 Qwen3-30B-A3B-shaped layer forward
    (4 x 512 tokens), largest total first."""
    from libalign import models
    from libalign.models import strict

    cfg = models.qwen3_30b_a3b_shaped_config(num_layers=1, vocab_size=4096)
    model = models.build_model(cfg, seed=0, device="cuda")
    ids = torch.randint(0, 4096, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
    models.set_path(model, "bf16")
    for on in (False, True):
        with torch.no_grad(), strict.use_strict(model, on):
            for _ in range(2):
                model.model(input_ids=ids)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model.model(input_ids=ids)
                torch.cuda.synchronize()
        print(f"\nlayer forward, strict={on}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main()
