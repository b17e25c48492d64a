"""Importance correction in slime, Miles and verl with libalign's modes (docs/concepts/objective.md).

slime / Miles: point ``--custom-tis-function-path`` at
``alignd.integrations.importance.slime_tis_function`` and pass the MIS arguments (below as a
namespace). verl: wrap a registered policy loss with ``verl_policy_loss`` (bypass mode), or call
``verl_rollout_correction`` on the batch. tests/services/test_importance_peers.py runs this file.
"""

from types import SimpleNamespace

import torch
from alignd.integrations.importance import (
    miles_rollout_kl,
    slime_log_dict,
    slime_tis_function,
    verl_rollout_correction,
)

g = torch.Generator().manual_seed(0)

# slime / Miles: one 1-D tensor per sample, as slime's policy_loss_function hands them over
lengths = [7, 3, 11]
train = [-torch.rand(n, generator=g) * 2 for n in lengths]
rollout = [t + 0.05 * torch.randn(n, generator=g) for t, n in zip(train, lengths, strict=True)]
masks = [torch.ones(n) for n in lengths]
args = SimpleNamespace(use_tis=True, tis_level="geometric", tis_mode="mask",
                       tis_lower_bound=0.99, tis_upper_bound=1.01, use_rs=True,
                       rs_level="token", rs_lower_bound=0.5, rs_upper_bound=2.0,
                       rs_veto_threshold=1e-4, tis_batch_normalize=False)
pg_loss = torch.randn(sum(lengths), generator=g)
pg_loss, masks_after, metrics = slime_tis_function(
    args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
metrics["train_rollout_kl"] = miles_rollout_kl(torch.cat(train), torch.cat(rollout))
# slime's reduction: per-sample sums over the rollout group's tokens, over the rollout count;
# pass process_group=... (the DP x CP group) to sum over ranks first
log = slime_log_dict(metrics, masks, rollout_mask_sums=[7.0, 14.0, 14.0], n_rollouts=2)
print({k: round(v, 6) for k, v in log.items() if k in ("train/train_rollout_kl",
                                                       "train/mis_chi2_token")})

# verl: padded [B, T] with response_mask, as in its PPO batch
old_log_probs = -torch.rand(4, 16, generator=g) * 3
rollout_log_probs = old_log_probs + 0.05 * torch.randn(4, 16, generator=g)
response_mask = (torch.arange(16).expand(4, 16) < torch.tensor([[16], [12], [9], [5]])).float()
weights, response_mask, corr_metrics = verl_rollout_correction(
    old_log_probs, rollout_log_probs, response_mask, rollout_is="token",
    rollout_is_threshold="0.5_2.0", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2,0.1")
print(round(corr_metrics["rollout_corr/rollout_is_eff_sample_size"], 6),
      round(corr_metrics["rollout_corr/chi2_token"], 6))
