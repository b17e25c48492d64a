"""Probe: host time of one eager strict call, against the stock op, and where it goes.

For decode-sized calls (the device work is tens of microseconds, so a caller waits on the
host): the strict 2048x2048 linear at 8 rows, the grouped product of a decode step's 64 rows
over 128 experts (counts on the device), attention over 1024 keys (8 sequences, 32/4 heads),
log-softmax over 151,936 at 8 rows, each beside its stock counterpart. Host microseconds a
call = the time to queue 200 calls back to back, over 200 (the device keeps up, so nothing
waits on it). Then a ``cProfile`` of the strict attention and linear calls: the functions the
host time is spent in. Run: ``python -m tests.bench.probe_strict_host``.
"""

from __future__ import annotations

import torch

from libalign.strict import attention as strict_attention
from libalign.strict import tensorcore

from .measure import host_us, profiled


def _rnd(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)


def main() -> None:
    x, w = _rnd(8, 2048), _rnd(2048, 2048, scale=2048 ** -0.5, seed=1)
    ex = _rnd(128, 1536, 2048, scale=2048 ** -0.5, seed=2)
    a = _rnd(64, 2048, seed=3)
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    counts[:64] = 1
    ids = torch.arange(64, device="cuda")
    q, k, v = _rnd(8, 32, 1, 128, seed=4), _rnd(8, 4, 1024, 128, seed=5), _rnd(8, 4, 1024, 128, seed=6)
    seen = torch.ones(8, 1, 1, 1024, dtype=torch.bool, device="cuda")
    logits = _rnd(8, 151936).float()
    cases = [
        ("linear 2048x2048, 8 rows", lambda: tensorcore.matmul(x, w),
         lambda: torch.nn.functional.linear(x, w)),
        ("grouped, 64 rows over 128 experts", lambda: tensorcore.grouped_matmul(
            a, ex, counts, out_dtype=torch.bfloat16),
         lambda: torch._grouped_mm(a, ex[:64].transpose(1, 2), offs=(ids + 1).int())),
        ("attention, 1024 keys", lambda: strict_attention.attention(q, k, v, seen, 0.088),
         lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        ("log_softmax 151936, 8 rows", lambda: tensorcore.log_softmax(logits),
         lambda: torch.log_softmax(logits, -1)),
        ("visible_range (attention's first launch)", lambda: strict_attention.visible_range(seen),
         None),
    ]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'call':44} {'strict us':>10} {'stock us':>9} {'ratio':>6}")
    for name, strict, stock in cases:
        s = host_us(strict)
        b = host_us(stock) if stock is not None else float("nan")
        print(f"{name:44} {s:10.1f} {b:9.1f} {s / b:6.2f}")
    for name, fn in (("attention", cases[2][1]), ("linear", cases[0][1])):
        stats = profiled(fn, 200)
        print(f"\ncProfile, 200 strict {name} calls (tottime, s):")
        stats.sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
