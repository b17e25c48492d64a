"""With slime: log the execution gap from slime's per-sample tensors (docs/engines/slime.md).

slime keeps one 1-D tensor per sample: ``log_probs`` (Megatron's), ``rollout_log_probs``
(SGLang's) and ``loss_masks``. The monitor takes one tensor per sequence; select the
loss-masked tokens first, and the value under slime's name ``train_rollout_logprob_abs_diff``
is the one slime logs. tests/services/test_integrations.py runs this file.
"""

import os

import torch
from alignd.integrations import Monitor

monitor = Monitor(api=os.environ.get("ALIGN_API_URL"), token=os.environ.get("ALIGN_API_TOKEN"))

# stand-ins for rollout_data["log_probs"], ["rollout_log_probs"], ["loss_masks"], ["tokens"]
g = torch.Generator().manual_seed(1)
lengths = [7, 3, 11]
log_probs = [-torch.rand(n, generator=g) * 2 for n in lengths]
rollout_log_probs = [(lp + 0.02 * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
                     for lp in log_probs]
loss_masks = [torch.ones(n, dtype=torch.int64) for n in lengths]
tokens = [torch.randint(0, 1000, (4 + n,), generator=g) for n in lengths]  # prompt of 4 + response

keep = [m.bool() for m in loss_masks]
log_dict = monitor.observe([lp[k] for lp, k in zip(log_probs, keep, strict=True)],
                           [rp[k] for rp, k in zip(rollout_log_probs, keep, strict=True)],
                           version=os.environ.get("ALIGN_VERSION"), step=0,
                           completions=[t[4:][k] for t, k in zip(tokens, keep, strict=True)],
                           prompts=[t[:4] for t in tokens])
print("train_rollout_logprob_abs_diff", log_dict["train_rollout_logprob_abs_diff"])
monitor.close()
