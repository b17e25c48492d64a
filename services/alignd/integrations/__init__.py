"""In-process integration for RL trainers (slime, verl, your own loop).

Inside its training loop a trainer calls :class:`Monitor` with the two log-probability
tensors it already holds: the gap comes back under slime's, verl's and libalign's names
(:mod:`alignd.integrations.gap`), the Prometheus families go on the trainer's registry under
libalign's names, and the batch is pushed to the daemon in the background
(:mod:`alignd.integrations.push`: a queue bounded in batches and bytes, bounded retries, never
blocking the step).
:class:`WeightPublisher` publishes a weight version from the state dict in memory.

This package sits above the services in the layers (it reuses the learner's
``announce_converted``) and below the tools; it is the one place that combines the client,
the metrics and the store for a foreign process.
"""

from alignd.integrations.gap import SLIME_ABS_DIFF, VERL_KEYS, BatchGap, gap_metrics
from alignd.integrations.monitor import Monitor, WeightPublisher
from alignd.integrations.push import (
    DEFAULT_PUSH_QUEUE_BYTES,
    DEFAULT_PUSH_RETRY,
    PushBatch,
    ScorePusher,
)

__all__ = ["DEFAULT_PUSH_QUEUE_BYTES", "DEFAULT_PUSH_RETRY", "SLIME_ABS_DIFF", "VERL_KEYS",
           "BatchGap", "Monitor", "PushBatch", "ScorePusher", "WeightPublisher", "gap_metrics"]
