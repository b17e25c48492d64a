"""Importance correction inside slime, Miles and verl, under the names each one logs.

The modes themselves live in :mod:`libalign.metrics.importance`; this module plugs them into
each trainer's hook and reports them the way that trainer aggregates and names its metrics.

slime and Miles (``--custom-tis-function-path alignd.integrations.importance.slime_tis_function``)
---------------------------------------------------------------------------------------------------
:func:`slime_tis_function` has the signature slime's ``policy_loss_function`` calls
(``args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs``; Miles adds
``parallel_state`` and ``max_seq_lens``, taken by ``**kwargs``) and returns
``(pg_loss · weights, masks, metrics)``. It reads the arguments of slime's MIS example
(``examples/train_infer_mismatch_helper/mis.yaml``): ``use_tis``, ``tis_level``
(token/sequence/geometric), ``tis_mode`` (truncate/clip/mask, and ``icepop``),
``tis_lower_bound``/``tis_upper_bound``, ``use_rs``, ``rs_level``,
``rs_lower_bound``/``rs_upper_bound``, ``rs_veto_threshold``, ``tis_batch_normalize``. Without
``tis_mode`` it is slime's built-in ``vanilla_tis_function``: ``clamp(exp(s), tis_clip_low,
tis_clip)`` with no safety bound, metrics ``tis``, ``tis_clipfrac``, ``tis_abs``. With it, the
metrics are those of ``compute_mis_weights`` under ``mis_`` (perplexities, ``kl``, ``k3_kl``,
``chi2_token``/``chi2_seq``, fractions truncated, clipped, masked and vetoed, the weights before
and after bounding, the batch normalisation factor). Every metric is a per-token tensor that
slime's reducer averages; sequences are whole here (context parallelism 1).

:func:`slime_log_dict` is that reducer: each sample's masked sum divided by its denominator
(its rollout group's token count ``rollout_mask_sums``, or its own count), summed, summed over
the ranks of ``process_group`` when one is given (slime's all-reduce over DP×CP), divided by
the step's rollout count, keys prefixed ``train/``; with ``calculate_per_token_loss`` the token
sum divided by the token count (each sample counting at least 1). An all-masked batch gives 0.
:func:`miles_rollout_kl` is the per-token value Miles logs as ``train/train_rollout_kl``
(k3 of KL(rollout ‖ train) in fp32 with the log-ratio clamped to ±20 and the term to ±10).

verl
----
:func:`verl_rollout_correction` is verl's ``compute_rollout_correction_and_rejection_mask``:
``rollout_is`` (``"token"``, ``"sequence"``, and libalign's ``"geometric"``) with
``rollout_is_threshold`` (one number: truncate; ``"lower_upper"``: IcePop),
``rollout_is_batch_normalize``, ``rollout_rs`` keys with ``rollout_rs_threshold``, returning the
weights, the rejected mask and the ``rollout_corr/*`` metrics (``rollout_is_*`` with the ESS,
``rollout_rs_*``, and ``kl``, ``k3_kl``, perplexities, ``chi2_token``, ``chi2_seq``). On a batch
without a valid token verl raises; here the weights are 0, the mask is returned as it is and
no metric is reported. :func:`verl_policy_loss` wraps any function of verl's registered
policy-loss signature into one that applies the correction itself, as verl's bypass mode does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from libalign.errors import InputError, ShapeError
from libalign.metrics import importance as imp

SLIME_PREFIX = "train/"
VERL_PREFIX = "rollout_corr/"


# --------------------------------------------------------------------------- slime and Miles


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _append(metrics: dict[str, list[torch.Tensor]], key: str, value: torch.Tensor) -> None:
    metrics.setdefault(key, []).append(value.clone().detach())


def _ppl_metrics(train: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor,
                 metrics: dict[str, list[torch.Tensor]]) -> None:
    """slime's ``add_ppl_metrics`` of one sequence: perplexities, k1/k3 KL, χ² (per token)."""
    mean_train = (imp.row_mean(train, m)).expand_as(train)
    mean_rollout = (imp.row_mean(rollout, m)).expand_as(rollout)
    _append(metrics, "training_log_ppl", -mean_train)
    _append(metrics, "training_ppl", torch.exp(-mean_train))
    _append(metrics, "rollout_log_ppl", -mean_rollout)
    _append(metrics, "rollout_ppl", torch.exp(-mean_rollout))
    kl = imp.kl_terms(train, rollout)
    _append(metrics, "kl", kl["k1"])
    _append(metrics, "k3_kl", kl["k3"])
    diff = mean_rollout - mean_train
    _append(metrics, "log_ppl_diff", diff)
    _append(metrics, "log_ppl_abs_diff", diff.abs())
    _append(metrics, "ppl_ratio", torch.exp(diff))
    chi = imp.chi2_terms(train - rollout, m)
    _append(metrics, "chi2_token", (imp.row_mean(chi["token"], m) - 1.0).expand_as(train))
    _append(metrics, "chi2_seq", chi["sequence"].expand_as(train) - 1.0)


def _slime_vanilla(args: Any, pg_loss: torch.Tensor, train: list[torch.Tensor],
                   rollout: list[torch.Tensor], loss_masks: list[torch.Tensor]):
    """slime's built-in TIS: ``clamp(exp(s), tis_clip_low, tis_clip)`` on the concatenated
    tokens, no safety bound (``tis_clip_low`` 0, its default, leaves the lower side open)."""
    hi, lo = float(_arg(args, "tis_clip", 2.0)), float(_arg(args, "tis_clip_low", 0.0))
    if not (0.0 <= lo <= hi and hi > 0.0 and hi < float("inf")):
        raise InputError(f"tis_clip_low {lo!r} and tis_clip {hi!r} must satisfy "
                         "0 <= tis_clip_low <= tis_clip < inf")
    s = torch.cat(train, dim=0) - torch.cat(rollout, dim=0)
    ratio = imp.raw_weights(s, None)
    w = torch.clamp(ratio, min=lo, max=hi)
    metrics = {"tis": ratio.clone().detach(), "tis_clipfrac": (w != ratio).float(),
               "tis_abs": (ratio - 1).abs()}
    return pg_loss * w, loss_masks, metrics


def slime_tis_function(args: Any, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                       rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor],
                       **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor],
                                               dict[str, torch.Tensor]]:
    """slime's ``--custom-tis-function-path`` hook (module doc)."""
    if not (len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)):
        raise ShapeError(f"train_log_probs, rollout_log_probs and loss_masks hold "
                         f"{len(train_log_probs)}, {len(rollout_log_probs)} and {len(loss_masks)} "
                         "sequences; they must match")
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks, strict=True)):
        if not (t.shape == r.shape == m.shape):
            raise ShapeError(f"sequence {i}: train {tuple(t.shape)}, rollout {tuple(r.shape)} and "
                             f"loss mask {tuple(m.shape)} must have one shape")
        imp.check_log_ratio(t, m, f"train_log_probs[{i}]")
        imp.check_log_ratio(r, m, f"rollout_log_probs[{i}]")
    if _arg(args, "tis_mode") is None:
        return _slime_vanilla(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks)
    weights, masks, metrics = mis_weights(args, train_log_probs, rollout_log_probs, loss_masks)
    out = {f"mis_{k}": torch.cat(v, dim=0) for k, v in metrics.items()}
    if weights is not None:
        pg_loss = pg_loss * torch.cat(weights, dim=0)
    return pg_loss, masks, out


def mis_weights(args: Any, train_log_probs: list[torch.Tensor],
                rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]):
    """``(weights, masks, metrics)`` per sequence, in slime's ``compute_mis_weights`` order."""
    metrics: dict[str, list[torch.Tensor]] = {}
    mode = imp.check_choice(_arg(args, "tis_mode"), imp.MODES, "tis_mode")
    level = imp.check_choice(_arg(args, "tis_level", "token"), imp.LEVELS, "tis_level")
    upper, lower = imp.check_bounds_pair(_arg(args, "tis_upper_bound", 2.0),
                                         _arg(args, "tis_lower_bound"), "tis bounds")
    use_rs = bool(_arg(args, "use_rs", False))
    if use_rs:
        rs_level = imp.check_choice(_arg(args, "rs_level", "token"), imp.LEVELS, "rs_level")
        rs_upper, rs_lower = imp.check_bounds_pair(
            _arg(args, "rs_upper_bound") or upper,
            _arg(args, "rs_lower_bound") if _arg(args, "rs_lower_bound") is not None else lower,
            "rs bounds")
    veto = _arg(args, "rs_veto_threshold")
    for t, r, m in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        _ppl_metrics(t, r, m.float(), metrics)
    if not _arg(args, "use_tis", True):
        return None, loss_masks, metrics
    all_w, all_m = [], []
    for t, r, loss_mask in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        m = loss_mask.float()
        s = t - r
        corr = imp.importance_weights(s, m, level=level, mode=mode, upper=upper, lower=lower)
        _append(metrics, "tis_weight_before_bound", corr.raw)
        _fraction_metrics(metrics, "tis_", mode, corr.raw, lower, upper)
        _append(metrics, "tis_weight_after_bound", corr.weights)
        keep = corr.mask
        if use_rs:
            rs = imp.ratio_rejection(corr, s, m, level=rs_level, upper=rs_upper, lower=rs_lower)
            rs_raw = imp.raw_weights(imp.level_log_ratio(s, m, rs_level))
            _fraction_metrics(metrics, "rs_", "mask", rs_raw, rs_lower, rs_upper)
            keep = rs.mask
            if veto is not None:
                vmask, catastrophic = imp.veto_mask(s, m, veto)
                _append(metrics, "rs_catastrophic_token_fraction", catastrophic.int())
                _append(metrics, "rs_catastrophic_seq_fraction",
                        catastrophic.any().int().expand_as(m))
                keep = keep * vmask
        _append(metrics, "is_ratio_mean_after_tis_rs", corr.weights)
        all_w.append(corr.weights.detach())
        all_m.append(keep.detach().float())  # slime's masks are fp32 whatever the log-probs
    if _arg(args, "tis_batch_normalize", False):
        all_w, mean = imp.batch_normalize(all_w, loss_masks, level)
        for w in all_w:
            _append(metrics, "batch_norm_factor", mean.expand_as(w))
    for w, loss_mask in zip(all_w, loss_masks, strict=True):
        m = loss_mask.float()
        _append(metrics, "is_ratio_mean_final", imp.row_mean(w, m).expand_as(w))
        valid = m.bool()
        lo = w[valid].min() if valid.any() else torch.tensor(0.0, dtype=w.dtype)
        hi = w[valid].max() if valid.any() else torch.tensor(0.0, dtype=w.dtype)
        _append(metrics, "is_ratio_min_final", lo.expand_as(w))
        _append(metrics, "is_ratio_max_final", hi.expand_as(w))
    return all_w, all_m, metrics


def _fraction_metrics(metrics, prefix: str, mode: str, raw: torch.Tensor, lower: float,
                      upper: float) -> None:
    """The per-token flags slime logs for each bounding mode."""
    if mode == "truncate":
        _append(metrics, f"{prefix}truncate_fraction", (raw > upper).int())
        return
    name = {"clip": "clip", "mask": "mask", "icepop": "icepop"}[mode]
    _append(metrics, f"{prefix}{name}_fraction_low", (raw < lower).int())
    _append(metrics, f"{prefix}{name}_fraction_high", (raw > upper).int())


def miles_rollout_kl(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor
                     ) -> torch.Tensor:
    """Per-token ``train_rollout_kl`` of Miles: ``exp(s) − 1 − s`` with ``s = train − rollout``
    in fp32, NaN/±Inf mapped to 0/±20, ``s`` clamped to ±20 and the term to ±10."""
    s = -(rollout_log_probs.float() - train_log_probs.float())
    s = torch.clamp(torch.nan_to_num(s, nan=0.0, posinf=imp.SAFETY_BOUND,
                                     neginf=-imp.SAFETY_BOUND),
                    min=-imp.SAFETY_BOUND, max=imp.SAFETY_BOUND)
    return torch.clamp(s.exp() - 1 - s, min=-10, max=10)


def slime_log_dict(metrics: dict[str, torch.Tensor], loss_masks: Sequence[torch.Tensor], *,
                   rollout_mask_sums: Sequence[float] | None = None,
                   n_rollouts: int | None = None, calculate_per_token_loss: bool = False,
                   process_group: Any = None, prefix: str = SLIME_PREFIX) -> dict[str, float]:
    """Per-token metrics (concatenated over samples) reduced as slime logs them (module doc).

    ``n_rollouts`` (slime's ``step_global_batch_size``, the rollout count of the whole step
    across ranks) defaults to the number of samples given.
    """
    lengths = [int(m.numel()) for m in loss_masks]
    denoms = rollout_mask_sums if rollout_mask_sums is not None else [m.sum() for m in loss_masks]
    if len(denoms) != len(lengths):
        raise ShapeError(f"rollout_mask_sums has {len(denoms)} entries for {len(lengths)} samples")
    keys = list(metrics)
    sums = []
    for k in keys:
        v = metrics[k]
        if v.numel() != sum(lengths):
            raise ShapeError(f"metric {k} has {v.numel()} values but the loss masks hold "
                             f"{sum(lengths)} tokens")
        parts = v.split(lengths, dim=0)
        if calculate_per_token_loss:
            sums.append(sum([(x * m).sum() for x, m in zip(parts, loss_masks, strict=True)]))
        else:
            sums.append(sum([(x * m).sum() / torch.clamp_min(torch.as_tensor(d), 1)
                             for x, m, d in zip(parts, loss_masks, denoms, strict=True)]))
    count = sum([torch.clamp_min(m.sum(), 1) for m in loss_masks]) if calculate_per_token_loss \
        else 0
    values = torch.tensor([float(count)] + [float(s) for s in sums], dtype=torch.float64)
    if process_group is not None:
        torch.distributed.all_reduce(values, group=process_group)
    vals = values.tolist()
    den = vals[0] if calculate_per_token_loss else float(n_rollouts if n_rollouts is not None
                                                         else len(lengths))
    return {f"{prefix}{k}": (v / den if den else 0.0) for k, v in zip(keys, vals[1:], strict=True)}


# --------------------------------------------------------------------------- verl


def _vsum(x: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(axis=axis)


def _vmean(x: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return _vsum(x, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def parse_is_threshold(threshold: str | float) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: ``(upper, lower)``, ``lower`` None for one number."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise InputError(f"rollout_is_threshold must be a number or 'lower_upper', got "
                         f"{threshold!r}")
    if isinstance(threshold, str) and "_" in threshold:
        lo_s, up_s = threshold.split("_", 1)
        try:
            up, lo = imp.check_bounds_pair(float(up_s), float(lo_s), "rollout_is_threshold")
        except ValueError as e:
            raise InputError(f"rollout_is_threshold {threshold!r}: {e}") from e
        return up, lo
    try:
        up, _ = imp.check_bounds_pair(float(threshold), None, "rollout_is_threshold")
    except ValueError as e:
        raise InputError(f"rollout_is_threshold {threshold!r}: {e}") from e
    return up, None


def _is_metrics(w, raw, level_ratio, mask, level, upper, lower) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (``rollout_is_*``), in its order of operations."""
    out: dict[str, float] = {}
    lower_v = 1.0 / upper if lower is None else lower
    log_up = torch.log(torch.tensor(upper, device=w.device))
    log_lo = torch.log(torch.tensor(lower_v, device=w.device))
    if level != "token":
        s = level_ratio[..., :1]
        out["rollout_is_max"] = torch.exp(torch.clamp(s.max(), max=imp.SAFETY_BOUND)).item()
        out["rollout_is_min"] = torch.exp(s.min()).item()
        out["rollout_is_mean"] = _vmean(w, mask).item()
        out["rollout_is_ratio_fraction_high"] = (s > log_up).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (s < log_lo).float().mean().item()
    else:
        out["rollout_is_mean"] = _vmean(w, mask).item()
        out["rollout_is_ratio_fraction_high"] = _vmean((raw > upper).float(), mask).item()
        out["rollout_is_ratio_fraction_low"] = _vmean((raw < lower_v).float(), mask).item()
        mb = mask.bool()
        out["rollout_is_max"] = w.masked_fill(~mb, float("-inf")).max().item()
        out["rollout_is_min"] = w.masked_fill(~mb, float("inf")).min().item()
    if mask.sum() > 1:
        ws = w.clamp(min=0.0, max=upper)
        mean = _vmean(ws, mask)
        var = _vmean(ws.square(), mask) - mean.square()
        out["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = imp.effective_sample_size(w, mask, upper)
    seq = _vmean(w, mask, axis=-1)
    out["rollout_is_seq_mean"] = seq.mean().item()
    out["rollout_is_seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = seq.max().item()
    out["rollout_is_seq_min"] = seq.min().item()
    out["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max().item()
    raw_seq = _vmean(raw, mask, axis=-1)
    out["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean().item()
    out["rollout_is_seq_fraction_low"] = (raw_seq < lower_v).float().mean().item()
    return out


def _rs_metrics(key: str, info: dict, mask: torch.Tensor, seq_valid: torch.Tensor
                ) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` of one rejection key (``rollout_rs_<key>_*``)."""
    p = f"rollout_rs_{key}"
    is_k1, token = key.endswith("k1"), key.startswith("token")
    up = info["upper"]
    lo = info["lower"] if is_k1 else 0.0
    stat = info["statistic"]
    tok_stat = stat if token else stat.unsqueeze(-1).expand_as(mask)
    seq = _vmean(tok_stat, mask, axis=-1) if token else stat
    seq_valid_vals = seq[seq_valid]
    mb = mask.bool()
    out: dict[str, float] = {f"{p}_mean": _vmean(tok_stat, mask).item()}
    if not token and seq_valid_vals.numel() > 0:
        out[f"{p}_max"] = seq_valid_vals.max().item()
        out[f"{p}_min"] = seq_valid_vals.min().item()
        out[f"{p}_fraction_high"] = (seq_valid_vals > up).float().mean().item()
        out[f"{p}_fraction_low"] = (seq_valid_vals < lo).float().mean().item() if is_k1 else 0.0
    else:
        out[f"{p}_max"] = tok_stat.masked_fill(~mb, float("-inf")).max().item()
        out[f"{p}_min"] = tok_stat.masked_fill(~mb, float("inf")).min().item()
        out[f"{p}_fraction_high"] = _vmean((tok_stat > up).float(), mask).item()
        out[f"{p}_fraction_low"] = _vmean((tok_stat < lo).float(), mask).item() if is_k1 else 0.0
    if mask.sum() > 1:
        c = tok_stat.clamp(min=lo if is_k1 else 0.0, max=up)
        mean = _vmean(c, mask)
        var = _vmean(c.square(), mask) - mean.square()
        out[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        out[f"{p}_std"] = 0.0
    if seq_valid_vals.numel() > 0:
        out[f"{p}_seq_mean"] = seq_valid_vals.mean().item()
        out[f"{p}_seq_std"] = seq_valid_vals.std().item() if seq_valid_vals.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = seq_valid_vals.max().item()
        out[f"{p}_seq_min"] = seq_valid_vals.min().item()
        out[f"{p}_seq_max_deviation"] = (seq_valid_vals - 0.0).abs().max().item()
        out[f"{p}_seq_fraction_high"] = (seq_valid_vals > up).float().mean().item()
        if is_k1:
            out[f"{p}_seq_fraction_low"] = (seq_valid_vals < lo).float().mean().item()
    return out


def _offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
                       ) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: perplexities, k1/k3 KL, χ² (token and sequence)."""
    out: dict[str, float] = {}
    mean_train = _vmean(old, mask, axis=-1)
    out["training_ppl"] = torch.exp(-mean_train).mean().item()
    out["training_log_ppl"] = (-mean_train).mean().item()
    kl = imp.kl_terms(old, rollout)
    out["kl"] = _vmean(kl["k1"], mask).item()
    out["k3_kl"] = _vmean(kl["k3"], mask).item()
    mean_rollout = _vmean(rollout, mask, axis=-1)
    out["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    out["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    out["log_ppl_diff"] = diff.mean().item()
    out["log_ppl_abs_diff"] = diff.abs().mean().item()
    out["log_ppl_diff_max"] = diff.max().item()
    out["log_ppl_diff_min"] = diff.min().item()
    out["ppl_ratio"] = torch.exp(diff).mean().item()
    s = old - rollout
    rho2 = torch.exp(torch.clamp(s, min=-imp.SAFETY_BOUND, max=imp.SAFETY_BOUND)).square()
    out["chi2_token"] = (_vmean(rho2, mask) - 1.0).item()
    seq_s = torch.clamp(_vsum(s, mask, axis=-1), min=-imp.SAFETY_BOUND, max=imp.SAFETY_BOUND)
    out["chi2_seq"] = (torch.exp(2.0 * seq_s).mean() - 1.0).item()
    return out


def verl_rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                            response_mask: torch.Tensor, *, rollout_is: str | None = None,
                            rollout_is_threshold: str | float | None = 2.0,
                            rollout_is_batch_normalize: bool = False,
                            rollout_rs: str | None = None,
                            rollout_rs_threshold: str | float | None = None, mode: str | None = None
                            ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(weights or None, mask, metrics)`` as verl's rollout correction gives them (module
    doc). ``mode`` overrides the bounding verl infers from the threshold (``truncate`` for one
    number, ``icepop`` for ``lower_upper``) with any of :data:`libalign.metrics.importance.MODES`."""
    if old_log_prob.dim() != 2:
        raise ShapeError(f"verl's batches are padded [B, T]; got shape {tuple(old_log_prob.shape)}")
    log_ratio = imp.log_ratio_of(old_log_prob, rollout_log_prob, response_mask)
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise InputError("rollout_rs needs rollout_rs_threshold")
    if not bool(response_mask.bool().any()):
        weights = None if rollout_is is None else torch.zeros_like(log_ratio)
        return weights, response_mask.clone(), {}
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        level = imp.check_choice(rollout_is, imp.LEVELS, "rollout_is")
        upper, lower = parse_is_threshold(rollout_is_threshold)
        how = mode or ("truncate" if lower is None else "icepop")
        corr = imp.importance_weights(log_ratio, response_mask, level=level, mode=how,
                                      upper=upper, lower=lower)
        raw = corr.raw * response_mask
        weights = corr.weights
        metrics.update(_is_metrics(weights, raw, corr.level_ratio, response_mask, level, upper,
                                   lower))
        if lower is not None:
            oob = (raw < lower) | (raw > upper)
            metrics["rollout_is_oob_ratio"] = _vmean(oob.float(), response_mask).item()
        if rollout_is_batch_normalize:
            weights, mean = imp.batch_normalize(weights, response_mask,
                                                "token" if level == "token" else "sequence")
            metrics["rollout_is_batch_norm_factor"] = mean.item()
    new_mask = response_mask.clone()
    if rollout_rs is not None:
        new_mask, rs = _verl_rejection(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs)
    metrics.update(_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask, {f"{VERL_PREFIX}{k}": v for k, v in metrics.items()}


def _verl_rejection(log_ratio, mask, keys, thresholds):
    """The rejected mask and ``rollout_rs_*`` metrics of verl's ``compute_rollout_rejection_mask``."""
    keep, per_key = imp.divergence_rejection(log_ratio, mask, keys, thresholds)
    mb = mask.bool()
    seq_valid = mask.sum(dim=-1) > 0
    out: dict[str, float] = {}
    for key, info in per_key.items():
        out.update(_rs_metrics(key, info, mask, seq_valid))
        tok_keep = info["keep"].to(log_ratio.dtype)
        seq_keep = (~((~info["keep"]) & mb)).all(dim=-1)
        sv = seq_valid.float()
        out[f"rollout_rs_{key}_masked_fraction"] = _vmean(1 - tok_keep, mask).item()
        out[f"rollout_rs_{key}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * sv).sum() / sv.sum()).item()
            if sv.sum() > 0 else 0.0)
    out["rollout_rs_masked_fraction"] = _vmean(1 - keep, mask).item()
    final_keep = (keep > 0.5) & mb
    out["rollout_rs_seq_masked_fraction"] = (~final_keep & mb).any(dim=-1).float().mean().item()
    return (mask * keep).to(dtype=mask.dtype), out


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def verl_policy_loss(inner: PolicyLoss, *, apply_weights: bool = False, **correction: Any
                     ) -> PolicyLoss:
    """A policy loss of verl's registered signature that corrects for the sampler itself.

    The returned function takes ``(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode="token-mean", config=None, rollout_is_weights=None)`` with ``old_log_prob``
    the rollout engine's log-probs (verl's bypass mode), computes
    :func:`verl_rollout_correction` between ``log_prob`` and them (``correction`` takes its
    keywords), and calls ``inner`` with the rejected mask and, when ``apply_weights``, the
    weights (REINFORCE-style losses; a PPO-clip loss already carries the ratio). The
    ``rollout_corr/*`` metrics are merged into ``inner``'s. Register it with verl's
    ``register_policy_loss("libalign")``.
    """

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                    advantages: torch.Tensor, response_mask: torch.Tensor,
                    loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: torch.Tensor | None = None):
        with torch.no_grad():
            weights, mask, metrics = verl_rollout_correction(
                log_prob, old_log_prob, response_mask, **correction)
        loss, pg_metrics = inner(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                 config, rollout_is_weights=weights if apply_weights else None)
        pg_metrics.update(metrics)
        return loss, pg_metrics

    return policy_loss
