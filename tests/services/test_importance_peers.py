"""Pins importance correction against the peers on the same tensors: verl by its own code,
slime and Miles by an oracle written from their formulas.

verl: ``compute_rollout_correction_and_rejection_mask`` (verl/trainer/ppo/rollout_corr_helper.py)
and ``compute_policy_loss_bypass_mode`` (verl/trainer/ppo/core_algos.py) of verl 0.9.1, run from
the files ./dev.sh installs beside the venv (tests/services/verl_source.py; skipped where they are
absent). slime and Miles: an oracle in this project's words, tests/services/mis_oracle.py, that
computes in plain float64 what slime's ``compute_mis_weights``
(``examples/train_infer_mismatch_helper/mis.py``), ``vanilla_tis_function`` and
``icepop_function`` (``slime/backends/megatron_utils/loss.py``) at THUDM/slime
624b824a898ab0ec1fcb4d373004c7f3852bf515, Miles' ``compute_approx_kl`` at radixark/miles
31f1ca961a94cb860cec3b2dea34ec332bfa8f76, and slime's reducer (``get_sum_of_sample_mean`` with
``reduce_train_step_metrics``) compute. verl comparisons are exact (``torch.equal`` on tensors,
``==`` on floats, NaN matching NaN); oracle comparisons are exact on 0/1 decisions (masks,
fractions, vetoes, key sets) and within a stated float tolerance on real values (see ``close``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from alignd.integrations import importance as ai
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libalign.errors import InputError, NonFiniteError, ShapeError
from tests.services import mis_oracle as oracle
from tests.services import verl_source

needs_verl = pytest.mark.skipif(not verl_source.available(),
                                reason="verl is not installed beside the venv (./dev.sh test)")


def batch(seed: int, dtype=torch.float64, mask_dtype=torch.float32, lengths=(9, 4, 1, 7, 0),
          spread=0.3, T=9):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    roll = old + spread * torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(-1)).to(mask_dtype)
    return old, roll, mask


def same_metrics(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    bad = {k: (a[k], b[k]) for k in a
           if not (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k])
                                    and math.isnan(b[k])))}
    assert not bad, bad


# --------------------------------------------------------------------------- verl

VERL_CASES = [
    dict(rollout_is="token"),
    dict(rollout_is="sequence", rollout_is_threshold=5.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
    dict(rollout_is="sequence", rollout_is_threshold="0.2_8.0"),
    dict(rollout_is="token", rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_is_threshold=3.0),
    dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.5"),
    dict(rollout_is="token", rollout_rs="token_k2,token_k3,seq_max_k2,seq_max_k3",
         rollout_rs_threshold=0.02),
    dict(rollout_is="token", rollout_rs="seq_sum_k1,seq_sum_k2,seq_sum_k3",
         rollout_rs_threshold="0.3_3,0.5,0.2"),
    dict(rollout_is="sequence", rollout_rs="seq_mean_k1,seq_mean_k2,seq_mean_k3",
         rollout_rs_threshold="1.5,0.05,0.05"),
]


@needs_verl
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float32), (torch.float32, torch.int64),
                                    (torch.float32, torch.bool)], ids=["f64", "f32-int", "f32-bool"])
@pytest.mark.parametrize("case", range(len(VERL_CASES)))
def test_verl_rollout_correction_is_verls(case, dtypes):
    """Weights, rejected mask and every rollout_corr/* metric (IS with ESS, RS per key, KL, PPL,
    χ²) equal verl's compute_rollout_correction_and_rejection_mask bit for bit, for every IS
    level and threshold form, each rejection key, batch normalisation, and fp32/fp64 log-probs
    with float, integer and bool masks."""
    kw = VERL_CASES[case]
    old, roll, mask = batch(case, *dtypes)
    proto, m1, met1 = verl_source.rollout_corr()["compute_rollout_correction_and_rejection_mask"](
        old, roll, mask, **kw)
    w2, m2, met2 = ai.verl_rollout_correction(old, roll, mask, **kw)
    if proto is None:
        assert w2 is None
    else:
        w1 = proto.batch["rollout_is_weights"]
        assert w1.dtype == w2.dtype and torch.equal(w1, w2)
    assert m1.dtype == m2.dtype and torch.equal(m1, m2)
    same_metrics(met1, met2)


@needs_verl
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), spread=st.sampled_from([0.01, 0.3, 2.0, 30.0]),
       level=st.sampled_from(["token", "sequence"]),
       threshold=st.sampled_from([2.0, 1.2, "0.5_2.0", "0.9_1.1"]),
       lengths=st.lists(st.integers(0, 8), min_size=1, max_size=5).filter(any))
def test_verl_weights_property(seed, spread, level, threshold, lengths):
    """On random batches (|s| up to ~100, past the ±20 safety bound) the weights and metrics
    are verl's; where IcePop zeroes every weight verl's ESS divides by zero and libalign's is 0."""
    old, roll, mask = batch(seed, lengths=lengths, spread=spread, T=8)
    w2, m2, met2 = ai.verl_rollout_correction(old, roll, mask, rollout_is=level,
                                              rollout_is_threshold=threshold)
    try:
        proto, m1, met1 = verl_source.rollout_corr()[
            "compute_rollout_correction_and_rejection_mask"](
            old, roll, mask, rollout_is=level, rollout_is_threshold=threshold)
    except ZeroDivisionError:  # verl's ESS when IcePop zeroed every weight; libalign says 0
        assert not w2.any() and met2["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        return
    assert torch.equal(proto.batch["rollout_is_weights"], w2) and torch.equal(m1, m2)
    same_metrics(met1, met2)


class _ActorConfig(dict):
    """The fields of verl's ActorConfig its policy losses read."""

    def __init__(self, corr: dict):
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = 0.2, 0.2, 0.28
        self.global_batch_info = {}
        self.policy_loss = {"rollout_correction": corr}


@needs_verl
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_verl_policy_loss_wrapper_is_verls_bypass_mode(loss_type):
    """verl_policy_loss around verl's own vanilla (PPO-clip) or REINFORCE loss gives the loss,
    its gradient and the metrics of verl's bypass_mode policy loss."""
    losses = verl_source.policy_losses()
    corr = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                rollout_rs_threshold="0.6_1.6")
    old, roll, mask = batch(3)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(4), dtype=old.dtype)
    cfg = _ActorConfig({**corr, "loss_type": loss_type})
    lp1 = old.clone().requires_grad_(True)
    lp2 = old.clone().requires_grad_(True)
    want, wmet = losses["compute_policy_loss_bypass_mode"](roll, lp1, adv, mask, "token-mean", cfg)
    inner = (losses["compute_policy_loss_vanilla"] if loss_type == "ppo_clip"
             else losses["compute_policy_loss_reinforce"])
    fn = ai.verl_policy_loss(inner, apply_weights=loss_type == "reinforce", **corr)
    got, gmet = fn(roll, lp2, adv, mask, "token-mean", cfg)
    want.backward()
    got.backward()
    assert torch.equal(want, got) and torch.equal(lp1.grad, lp2.grad)
    same_metrics(wmet, gmet)


@needs_verl
def test_verl_all_masked_batch():
    """verl raises on a batch without a valid token; libalign returns zero weights, the mask as
    it is and no rollout_corr metric."""
    old, roll, mask = batch(5, lengths=(0, 0))
    with pytest.raises(ValueError):
        verl_source.rollout_corr()["compute_rollout_correction_and_rejection_mask"](
            old, roll, mask, rollout_is="token")
    w, m, met = ai.verl_rollout_correction(old, roll, mask, rollout_is="token")
    assert met == {} and torch.equal(m, mask) and not w.any()


# --------------------------------------------------------------------------- slime and Miles


def slime_inputs(seed: int, lengths=(7, 3, 1, 5), spread=0.3, dtype=torch.float32,
                 masked_row: int | None = None):
    g = torch.Generator().manual_seed(seed)
    train = [-torch.rand(n, generator=g, dtype=dtype) * 2 for n in lengths]
    rollout = [t + spread * torch.randn(t.shape, generator=g, dtype=dtype) for t in train]
    masks = [(torch.rand(n, generator=g) > 0.2).float() for n in lengths]
    if masked_row is not None:
        masks[masked_row] = torch.zeros_like(masks[masked_row])
    return train, rollout, masks


def mis_args(**kw):
    base = dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_lower_bound=None,
                tis_upper_bound=2.0, use_rs=False, rs_level="token", rs_lower_bound=None,
                rs_upper_bound=None, rs_veto_threshold=None, tis_batch_normalize=False)
    return SimpleNamespace(**{**base, **kw})


SLIME_CASES = [
    dict(),
    dict(tis_level="sequence", tis_upper_bound=3.0),
    dict(tis_level="geometric", tis_mode="clip", tis_lower_bound=0.9, tis_upper_bound=1.05),
    dict(tis_mode="clip", tis_lower_bound=0.5),
    dict(tis_mode="mask", tis_lower_bound=0.7, tis_upper_bound=1.4),
    dict(use_rs=True, rs_veto_threshold=0.5),
    dict(use_rs=True, rs_level="sequence", rs_lower_bound=0.3, rs_upper_bound=3.0,
         rs_veto_threshold=1e-4, tis_batch_normalize=True),
    dict(tis_level="sequence", use_rs=True, rs_level="geometric", tis_batch_normalize=True),
    dict(tis_mode="mask", use_rs=True, rs_level="token", rs_upper_bound=1.5),
    dict(use_tis=False),
]


def close(got, want, dtype, what: str) -> None:
    """Real values against the oracle's float64 ones.

    Not bitwise: the oracle sums left to right with libm's ``exp`` in float64, libalign sums
    with torch's vectorised reductions and ``exp`` in the log-probs' dtype (and torch's float32
    ``exp`` itself differs between a tensor's vectorised body and its scalar tail). The bound is
    a few rounding steps of that dtype, relative, with an absolute floor for values near 0
    (``exp(x) − x − 1``, χ² − 1)."""
    got = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
    want = torch.tensor(want, dtype=torch.float64).reshape(-1)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def exact(got, want, what: str) -> None:
    """0/1 outputs (masks, fractions, vetoes) are decisions, compared exactly."""
    got = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
    assert got.tolist() == [float(x) for x in want], what


DISCRETE = ("fraction",)  # metric names holding 0/1 decisions


@pytest.mark.parametrize("masked_row", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(len(SLIME_CASES)))
def test_slime_mis_is_slimes(case, dtype, masked_row):
    """slime_tis_function with slime's MIS arguments gives the weights (applied to pg_loss),
    masks and every metric of slime's compute_mis_weights, each under mis_ as
    compute_mis_weights_with_cp names them, as the float64 oracle (tests/services/mis_oracle.py)
    computes them: truncate / clip / mask at token, sequence and geometric level, rejection at
    each level with a veto, batch normalisation, and a sequence with no valid token."""
    args = mis_args(**SLIME_CASES[case])
    train, rollout, masks = slime_inputs(case, dtype=dtype, masked_row=masked_row)
    pg = torch.randn(sum(t.numel() for t in train), dtype=dtype)
    w1, m1, met1 = oracle.mis(args, train, rollout, masks)
    pg2, m2, met2 = ai.slime_tis_function(args, pg_loss=pg, train_log_probs=train,
                                          rollout_log_probs=rollout, loss_masks=masks,
                                          total_lengths=[], response_lengths=[])
    if w1 is None:
        assert torch.equal(pg, pg2)
    else:
        close(pg2, [p * w for p, w in zip(pg.tolist(), [x for w in w1 for x in w], strict=True)], dtype, "pg")
    assert len(m1) == len(m2)
    for i, (a, b) in enumerate(zip(m1, m2, strict=True)):
        assert b.dtype == torch.float32
        exact(b, a, f"mask {i}")
    assert {f"mis_{k}" for k in met1} == set(met2), {f"mis_{k}" for k in met1} ^ set(met2)
    for k, v in met1.items():
        if any(tag in k for tag in DISCRETE):
            exact(met2[f"mis_{k}"], v, k)
        else:
            close(met2[f"mis_{k}"], v, dtype, k)


@pytest.mark.parametrize("low", [0.0, 0.5])
def test_slime_builtin_tis_is_slimes(low):
    """Without tis_mode the function is slime's vanilla_tis_function (clamp to
    [tis_clip_low, tis_clip], no safety bound): same pg_loss, the masks handed back as they
    came, and tis/tis_clipfrac/tis_abs."""
    args = SimpleNamespace(tis_clip=2.0, tis_clip_low=low)
    train, rollout, masks = slime_inputs(1, spread=1.0)
    pg = torch.randn(sum(t.numel() for t in train))
    kw = dict(pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    w1, met1 = oracle.builtin_tis(train, rollout, low, 2.0)
    p2, m2, met2 = ai.slime_tis_function(args, **kw)
    close(p2, [p * w for p, w in zip(pg.tolist(), w1, strict=True)], torch.float32, "pg")
    assert m2 is masks and set(met1) == set(met2)
    exact(met2["tis_clipfrac"], met1["tis_clipfrac"], "tis_clipfrac")
    close(met2["tis"], met1["tis"], torch.float32, "tis")
    close(met2["tis_abs"], met1["tis_abs"], torch.float32, "tis_abs")


def test_icepop_is_slimes_and_miles_icepop_at_valid_tokens():
    """tis_mode="icepop" zeroes the weights outside [lower, upper] as slime's (and Miles')
    icepop_function does; at valid tokens with |s| < 20 the weighted pg_loss is the same."""
    train, rollout, masks = slime_inputs(2, spread=1.0)
    pg = torch.randn(sum(t.numel() for t in train))
    kw = dict(pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    w1, _ = oracle.builtin_tis(train, rollout, 0.5, 2.0, icepop=True)
    p2, _, _ = ai.slime_tis_function(mis_args(tis_mode="icepop", tis_lower_bound=0.5), **kw)
    valid = torch.cat(masks).bool()
    want = [p * w for p, w, v in zip(pg.tolist(), w1, valid.tolist(), strict=True) if v]
    assert 0.0 in want and any(want)  # both sides of the band are exercised
    close(p2[valid], want, torch.float32, "pg")


def test_slime_log_dict_is_slimes_group_mean_and_miles_kl():
    """slime_log_dict reduces each metric as slime reports it (per-sample masked sums over the
    rollout group's token count, summed, over the rollout count, train/ prefix), including
    Miles' train_rollout_kl (its compute_approx_kl, low_var_kl, of rollout against train); an
    all-masked batch logs 0. Relative tolerance 1e-6: the oracle sums in float64, libalign in
    the metrics' float32."""
    train, rollout, masks = slime_inputs(3)
    groups = [0, 0, 1, 1]
    group_tokens = {g: sum(float(m.sum()) for m, gg in zip(masks, groups, strict=True) if gg == g)
                    for g in set(groups)}
    denoms = [torch.tensor(group_tokens[g]) for g in groups]
    kl = ai.miles_rollout_kl(torch.cat(train), torch.cat(rollout))
    assert kl.dtype == torch.float32
    close(kl, oracle.miles_low_var_kl(torch.cat(train), torch.cat(rollout)), torch.float32, "kl")
    _, _, met = ai.slime_tis_function(mis_args(), pg_loss=torch.zeros(kl.numel()),
                                      train_log_probs=train, rollout_log_probs=rollout,
                                      loss_masks=masks)
    met["train_rollout_kl"] = kl
    got = ai.slime_log_dict(met, masks, rollout_mask_sums=denoms, n_rollouts=2)
    assert set(got) == {f"train/{k}" for k in met}
    for k, v in met.items():
        assert got[f"train/{k}"] == pytest.approx(oracle.group_mean(v, masks, denoms, 2),
                                                  rel=1e-6, abs=1e-7), k
    empty = [torch.zeros_like(m) for m in masks]
    assert set(ai.slime_log_dict({"train_rollout_kl": kl}, empty).values()) == {0.0}


def test_miles_kl_edges():
    """Miles' low_var_kl at its clamps: a NaN log-ratio counts as 0, ±inf and |x| > 20 are
    held at ±20, and the estimate is capped at 10."""
    train = torch.tensor([0.0, -1.0, float("nan"), 0.0, -30.0, 5.0, float("-inf")])
    rollout = torch.tensor([0.0, -2.0, 0.0, -30.0, 0.0, -1.0, 0.0])
    got = ai.miles_rollout_kl(train, rollout)
    close(got, oracle.miles_low_var_kl(train, rollout), torch.float32, "kl")


def test_slime_log_dict_reduces_over_a_process_group():
    """With a process group the sums are all-reduced before the division (one gloo rank here:
    the value is the local one)."""
    import torch.distributed as dist

    train, rollout, masks = slime_inputs(4)
    kl = ai.miles_rollout_kl(torch.cat(train), torch.cat(rollout))
    local = ai.slime_log_dict({"train_rollout_kl": kl}, masks)
    created = not dist.is_initialized()  # a group another test of this process left is reused
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        reduced = ai.slime_log_dict({"train_rollout_kl": kl}, masks, process_group=dist.group.WORLD)
    finally:
        if created:
            dist.destroy_process_group()
    assert reduced == local


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_by_name():
    """NaN at a valid token, mismatched shapes, unknown modes, levels and keys, and bounds out
    of order raise typed errors that name the culprit."""
    train, rollout, masks = slime_inputs(5)
    train[1] = train[1].clone()
    train[1][0] = float("nan")
    masks[1][0] = 1.0
    with pytest.raises(NonFiniteError, match="train_log_probs\\[1\\]"):
        ai.slime_tis_function(mis_args(), pg_loss=torch.zeros(16), train_log_probs=train,
                              rollout_log_probs=rollout, loss_masks=masks)
    with pytest.raises(ShapeError, match="sequences"):
        ai.slime_tis_function(mis_args(), pg_loss=torch.zeros(1), train_log_probs=train[:2],
                              rollout_log_probs=rollout, loss_masks=masks)
    with pytest.raises(InputError, match="tis_mode"):
        ai.slime_tis_function(mis_args(tis_mode="trunc"), pg_loss=torch.zeros(16),
                              train_log_probs=rollout, rollout_log_probs=rollout, loss_masks=masks)
    old, roll, mask = batch(0)
    with pytest.raises(InputError, match="rollout_is"):
        ai.verl_rollout_correction(old, roll, mask, rollout_is="tokens")
    with pytest.raises(InputError, match="rejection key"):
        ai.verl_rollout_correction(old, roll, mask, rollout_rs="seq_max_k1", rollout_rs_threshold=1)
    with pytest.raises(InputError, match="lower bound"):
        ai.verl_rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold="3_2")
    with pytest.raises(ShapeError, match="mask"):
        ai.verl_rollout_correction(old, roll, mask[:, :3], rollout_is="token")


def test_docs_snippet_runs():
    """docs/snippets/importance_peers.py (shown on docs/concepts/objective.md) runs as written."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "importance_peers.py"
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "train/train_rollout_kl" in out and len(out.splitlines()) == 2
