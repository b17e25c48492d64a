"""With verl: log the execution gap from the batch verl already holds (docs/engines/verl.md).

In verl's PPO step, ``batch`` carries ``old_log_probs`` (the actor's recomputation),
``rollout_log_probs`` (the rollout engine's) and ``response_mask``. One Monitor per trainer
process; ``monitor.observe`` returns verl's own ``training/rollout_probs_diff_*`` keys beside
libalign's, exports libalign's Prometheus families, and (with ``ALIGN_API_URL``) pushes the
batch to the daemon in the background. tests/services/test_integrations.py runs this file.
"""

import os

import torch
from alignd.integrations import Monitor
from prometheus_client import CollectorRegistry

registry = CollectorRegistry()  # serve it with alignd.infra.telemetry.serve_metrics(registry, port)
monitor = Monitor(registry, api=os.environ.get("ALIGN_API_URL"),
                  token=os.environ.get("ALIGN_API_TOKEN"), sampler_path="nvfp4_minite")

# stand-ins for verl's batch.batch["old_log_probs"], ["rollout_log_probs"], ["response_mask"],
# ["responses"] and the prompts (verl keeps them left-padded in batch.batch["prompts"])
g = torch.Generator().manual_seed(0)
old_log_probs = -torch.rand(4, 16, generator=g) * 3
rollout_log_probs = (old_log_probs + 0.01 * torch.randn(4, 16, generator=g)).clamp(max=0.0)
response_mask = torch.arange(16).expand(4, 16) < torch.tensor([[16], [12], [9], [5]])
responses = torch.randint(0, 1000, (4, 16), generator=g)
prompts = [[1, 2, 3]] * 4

metrics = {}
metrics.update(monitor.observe(old_log_probs, rollout_log_probs, response_mask,
                               version=os.environ.get("ALIGN_VERSION"), step=0,
                               completions=responses, prompts=prompts))
# truncated importance weights for the policy loss, from the same tensors
weights = monitor.tis_weights(old_log_probs, rollout_log_probs, response_mask).weights
print({k: round(v, 6) for k, v in metrics.items() if k.startswith("training/")})
monitor.close()
