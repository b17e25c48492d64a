"""Cost per step of each importance-correction mode on CPU, against plain truncation.

One step is a slime-sized batch: ``--seqs`` sequences of up to ``--tokens`` tokens, fp32, the
correction computed from the two log-prob tensors as the trainer's hook does it (weights, mask,
and the metrics it logs). Each row is the median of ``--repeats`` timings and its ratio to the
plain truncated mode (libalign.metrics.importance.importance_weights, token level) measured in
the same run. ``python -m tests.bench importance``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from alignd.integrations import importance as ai

from libalign.metrics import importance as imp


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.seqs, a.tokens, a.repeats = 8, 64, 3
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: the figures are per step on a loaded 2-core CI box
    B, T = a.seqs, a.tokens
    lengths = torch.randint(T // 4, T + 1, (B,))
    old = -torch.rand(B, T) * 3
    roll = old + 0.05 * torch.randn(B, T)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).float()
    s = old - roll
    train = [old[i, : lengths[i]] for i in range(B)]
    rollout = [roll[i, : lengths[i]] for i in range(B)]
    masks = [torch.ones(int(n)) for n in lengths]
    pg = torch.zeros(int(lengths.sum()))

    def slime(**kw):
        args = SimpleNamespace(use_tis=True, tis_level="token", tis_mode="truncate",
                               tis_lower_bound=None, tis_upper_bound=2.0, use_rs=False,
                               rs_level="token", rs_lower_bound=None, rs_upper_bound=None,
                               rs_veto_threshold=None, tis_batch_normalize=False)
        for k, v in kw.items():
            setattr(args, k, v)
        return lambda: ai.slime_tis_function(args, pg_loss=pg, train_log_probs=train,
                                             rollout_log_probs=rollout, loss_masks=masks)

    rows = {
        "truncate, token (baseline)": lambda: imp.importance_weights(s, mask),
        "truncate, sequence": lambda: imp.importance_weights(s, mask, level="sequence"),
        "clip, geometric": lambda: imp.importance_weights(s, mask, level="geometric",
                                                          mode="clip"),
        "mask (MIS), token": lambda: imp.importance_weights(s, mask, mode="mask"),
        "icepop, token": lambda: imp.importance_weights(s, mask, mode="icepop"),
        "+ ratio rejection + veto": lambda: imp.veto_mask(s, mask, 1e-4) and imp.ratio_rejection(
            imp.importance_weights(s, mask), s, mask, level="sequence", upper=2.0),
        "divergence rejection, 3 keys": lambda: imp.divergence_rejection(
            s, mask, "token_k1,seq_mean_k3,seq_max_k2", "0.5_2,0.01,0.05"),
        "verl rollout_corr (IS + RS + metrics)": lambda: ai.verl_rollout_correction(
            old, roll, mask, rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2),
        "slime built-in TIS hook": slime(tis_mode=None, tis_clip=2.0, tis_clip_low=0.0),
        "slime MIS hook (truncate, metrics)": slime(),
        "slime MIS hook (RS + veto + batch norm)": slime(use_rs=True, rs_veto_threshold=1e-4,
                                                         tis_batch_normalize=True),
    }
    times = {name: _time(fn, a.repeats) for name, fn in rows.items()}
    base = times["truncate, token (baseline)"]
    print(f"importance correction on CPU, {B} sequences x up to {T} tokens "
          f"({int(lengths.sum())} valid), fp32, median of {a.repeats}")
    print("| mode | ms per step | vs truncate |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.3f} | {t / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
