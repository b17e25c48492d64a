"""An independent oracle for slime's and Miles' importance correction, in plain float64.

What each quantity *is* follows the peers (facts, not their code):

* slime's mismatch importance sampling, ``compute_mis_weights`` in
  ``examples/train_infer_mismatch_helper/mis.py``, and its built-in ``vanilla_tis_function`` /
  ``icepop_function`` in ``slime/backends/megatron_utils/loss.py``, at THUDM/slime
  624b824a898ab0ec1fcb4d373004c7f3852bf515;
* Miles' ``compute_approx_kl`` (``low_var_kl``) in
  ``miles/backends/training_utils/loss_hub/math_utils.py`` at radixark/miles
  31f1ca961a94cb860cec3b2dea34ec332bfa8f76.

The oracle turns every tensor into a Python list of floats and walks it sequence by sequence,
token by token, with :mod:`math`. It shares no code with libalign
(``libalign/metrics/importance.py``) and none with the peers, so agreement is evidence, not
tautology. Its real-valued outputs are therefore *not* bit-identical to a vectorised float32 or
float64 implementation (different summation order, libm's ``exp`` against torch's); the tests
compare those with a tolerance and compare the 0/1 outputs (masks, fractions, vetoes) exactly.

Notation, per sequence ``i`` with tokens ``t`` and a 0/1 loss mask ``m``:

* ``d_t = train_t - rollout_t`` (log of the ratio π_train / π_rollout);
* the level's log-ratio: ``token`` → ``d_t``; ``sequence`` → ``Σ m_t d_t`` on every token;
  ``geometric`` → ``Σ m_t d_t / max(Σ m_t, 1)`` on every token;
* a weight is ``exp(clamp(level log-ratio, -20, 20))`` (slime's safety bound), then bounded by
  the mode, then zeroed where ``m_t = 0``.

Conventions that matter at the edges: a masked mean divides by ``max(count, 1)`` so a sequence
without a valid token has mean 0; its masked min and max are 0; every per-sequence quantity is
repeated on each of the sequence's tokens.
"""

from __future__ import annotations

import math

SAFETY = 20.0


def _floats(t) -> list[float]:
    return [float(x) for x in t.reshape(-1).tolist()]


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _msum(xs, ms) -> float:
    total = 0.0
    for x, m in zip(xs, ms, strict=True):
        total += x * m
    return total


def _mmean(xs, ms) -> float:
    return _msum(xs, ms) / max(sum(ms), 1.0)


def _level_log_ratio(d, m, level: str) -> list[float]:
    if level == "token":
        return list(d)
    if level == "sequence":
        return [_msum(d, m)] * len(d)
    if level == "geometric":
        return [_mmean(d, m)] * len(d)
    raise ValueError(level)


def _ppl_metrics(tr, ro, m) -> dict[str, list[float]]:
    """The diagnostics slime logs for every sequence, with or without correction."""
    n = len(tr)
    mean_tr, mean_ro = _mmean(tr, m), _mmean(ro, m)
    d = [a - b for a, b in zip(tr, ro, strict=True)]
    rho2 = [math.exp(_clamp(x, -SAFETY, SAFETY)) ** 2 for x in d]
    diff = mean_ro - mean_tr
    return {
        "training_log_ppl": [-mean_tr] * n,
        "training_ppl": [math.exp(-mean_tr)] * n,
        "rollout_log_ppl": [-mean_ro] * n,
        "rollout_ppl": [math.exp(-mean_ro)] * n,
        "kl": [b - a for a, b in zip(tr, ro, strict=True)],          # rollout − train, per token
        "k3_kl": [math.exp(x) - x - 1.0 for x in d],                 # no safety bound here
        "log_ppl_diff": [diff] * n,
        "log_ppl_abs_diff": [abs(diff)] * n,
        "ppl_ratio": [math.exp(diff)] * n,
        "chi2_token": [_mmean(rho2, m) - 1.0] * n,
        "chi2_seq": [math.exp(2.0 * _clamp(_msum(d, m), -SAFETY, SAFETY)) - 1.0] * n,
    }


def mis(args, train, rollout, masks):
    """slime's mismatch importance sampling, for lists of 1-D tensors.

    Returns ``(weights or None, masks, metrics)``: per-sequence lists of floats, and metric
    name → one flat list over all sequences (the order slime concatenates them in). Without
    ``use_tis`` only the diagnostics are computed and the masks come back unchanged.
    """
    T = [_floats(t) for t in train]
    R = [_floats(t) for t in rollout]
    M = [_floats(t) for t in masks]
    metrics: dict[str, list[float]] = {}

    def put(name, values):
        metrics.setdefault(name, []).extend(values)

    for tr, ro, m in zip(T, R, M, strict=True):
        for k, v in _ppl_metrics(tr, ro, m).items():
            put(k, v)
    if not args.use_tis:
        return None, M, metrics

    up = args.tis_upper_bound
    lo = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / up
    rs_lo = args.rs_lower_bound if args.rs_lower_bound is not None else lo
    rs_up = args.rs_upper_bound if args.rs_upper_bound is not None else up
    # slime takes the veto's log as a float32 scalar; the comparison then runs in the log-probs'
    # dtype, so the threshold is float32(log(veto)) widened.
    veto_log = None
    if args.use_rs and args.rs_veto_threshold is not None:
        import numpy as np
        veto_log = float(np.log(np.float32(args.rs_veto_threshold)))

    W, NEW_M = [], []
    for tr, ro, m in zip(T, R, M, strict=True):
        d = [a - b for a, b in zip(tr, ro, strict=True)]
        raw = [math.exp(_clamp(x, -SAFETY, SAFETY)) for x in _level_log_ratio(d, m, args.tis_level)]
        put("tis_weight_before_bound", raw)
        keep = list(m)
        if args.tis_mode == "truncate":
            put("tis_truncate_fraction", [float(w > up) for w in raw])
            w = [min(max(x, 0.0), up) * mt for x, mt in zip(raw, m, strict=True)]
        elif args.tis_mode == "clip":
            put("tis_clip_fraction_low", [float(x < lo) for x in raw])
            put("tis_clip_fraction_high", [float(x > up) for x in raw])
            w = [_clamp(x, lo, up) * mt for x, mt in zip(raw, m, strict=True)]
        elif args.tis_mode == "mask":
            put("tis_mask_fraction_low", [float(x < lo) for x in raw])
            put("tis_mask_fraction_high", [float(x > up) for x in raw])
            keep = [mt * float(lo <= x <= up) for x, mt in zip(raw, m, strict=True)]
            w = [x * mt for x, mt in zip(raw, m, strict=True)]      # rejected tokens keep w
        else:
            raise ValueError(args.tis_mode)
        put("tis_weight_after_bound", w)

        if args.use_rs:
            rs = [math.exp(_clamp(x, -SAFETY, SAFETY)) for x in _level_log_ratio(d, m, args.rs_level)]
            # the fractions count every position, padding included, as slime's do
            put("rs_mask_fraction_low", [float(x < rs_lo) for x in rs])
            put("rs_mask_fraction_high", [float(x > rs_up) for x in rs])
            keep = [k * float(rs_lo <= x <= rs_up) for x, k in zip(rs, keep, strict=True)]
            if veto_log is not None:
                bad = [float(x < veto_log and mt != 0) for x, mt in zip(d, m, strict=True)]
                vetoed = any(bad)
                put("rs_catastrophic_token_fraction", bad)
                put("rs_catastrophic_seq_fraction", [float(vetoed)] * len(d))
                if vetoed:
                    keep = [0.0] * len(d)
        put("is_ratio_mean_after_tis_rs", w)
        W.append(w)
        NEW_M.append(keep)

    if args.tis_batch_normalize:
        if args.tis_level == "token":      # mean weight over all valid tokens of the batch
            mean = sum(_msum(w, m) for w, m in zip(W, M, strict=True)) / max(
                sum(sum(m) for m in M), 1.0)
        elif args.tis_level == "sequence":  # mean over sequences of each one's masked mean
            mean = sum(_mmean(w, m) for w, m in zip(W, M, strict=True)) / len(W)
        else:
            raise ValueError("slime normalises token and sequence levels only")
        factor = mean if mean > 1e-8 else 1.0
        if mean > 1e-8:
            W = [[x / mean for x in w] for w in W]
        for w in W:
            put("batch_norm_factor", [factor] * len(w))

    for w, m in zip(W, M, strict=True):
        valid = [x for x, mt in zip(w, m, strict=True) if mt != 0]
        put("is_ratio_mean_final", [_mmean(w, m)] * len(w))
        put("is_ratio_min_final", [min(valid) if valid else 0.0] * len(w))
        put("is_ratio_max_final", [max(valid) if valid else 0.0] * len(w))
    return W, NEW_M, metrics


def builtin_tis(train, rollout, low: float, high: float, *, icepop: bool = False):
    """slime's built-in per-token corrections on the concatenated batch.

    ``ratio = exp(train − rollout)`` with no safety bound. Vanilla TIS weights by the ratio
    clamped to ``[low, high]``; IcePop keeps the ratio inside ``[low, high]`` and zeroes it
    outside. Returns ``(weights, {"tis": ratio, "tis_clipfrac": weight ≠ ratio,
    "tis_abs": |ratio − 1|})`` as flat lists.
    """
    tr = [x for t in train for x in _floats(t)]
    ro = [x for t in rollout for x in _floats(t)]
    ratio = [math.exp(a - b) for a, b in zip(tr, ro, strict=True)]
    w = [(r if low <= r <= high else 0.0) if icepop else _clamp(r, low, high) for r in ratio]
    return w, {"tis": ratio, "tis_clipfrac": [float(a != b) for a, b in zip(w, ratio, strict=True)],
               "tis_abs": [abs(r - 1.0) for r in ratio]}


def miles_low_var_kl(train, rollout) -> list[float]:
    """Miles' ``low_var_kl`` of the rollout policy against the training one, per token.

    With ``x = train − rollout`` (NaN → 0, ±inf → ±20, then clamped to [-20, 20]) it is
    ``exp(x) − 1 − x``, clamped to [-10, 10].
    """
    out = []
    for a, b in zip(_floats(train), _floats(rollout), strict=True):
        x = a - b
        x = 0.0 if math.isnan(x) else _clamp(x, -SAFETY, SAFETY)
        out.append(_clamp(math.exp(x) - 1.0 - x, -10.0, 10.0))
    return out


def group_mean(values, masks, denominators, n_rollouts: int) -> float:
    """slime's reported value of a per-token metric: for each sample, the masked sum of its
    tokens over its denominator (at least 1), summed over samples, then over the rollout count."""
    flat = _floats(values)
    total, at = 0.0, 0
    for m, den in zip(masks, denominators, strict=True):
        mm = _floats(m)
        total += _msum(flat[at:at + len(mm)], mm) / max(float(den), 1.0)
        at += len(mm)
    return total / n_rollouts
