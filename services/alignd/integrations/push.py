"""Pushing a trainer's rollouts and scores to the daemon without ever holding up a step.

:meth:`ScorePusher.submit` puts one batch on a bounded queue and returns at once; it never
blocks and never raises. A daemon thread takes batches in order and sends each through the
control API: the rollouts first (tokens and the sampler's log-probs, when the trainer generated
them itself), then the learner's scores, which the daemon pairs with them into δ (its
``libalign_logprob_abs_delta`` and ``/v1/discrepancy``).

What can go wrong, and what is counted (:class:`~alignd.infra.telemetry.TrainerMetrics`):

* the queue is full (the daemon has been away for a while): the new batch is dropped,
  ``libalign_integration_pushes_total{outcome="dropped"}``;
* the API cannot be reached, or answers 502/503/504 (Redis away) or ``overloaded``: the stage
  is retried by the contract's one retry policy (:class:`alignclient.retry.RetryPolicy`:
  jittered exponential backoff, at most ``retry.attempts`` attempts), each retry counted in
  ``libalign_integration_push_retries_total``; once the attempts run out the batch is
  ``abandoned`` and the next one gets its own attempts, so an outage costs bounded time per
  batch and the queue keeps moving;
* the API refuses the batch (unknown version, an id that breaks the rules, a stale version):
  ``rejected``, logged with the daemon's words, never retried;
* ``put_rollouts`` answers ``rollout_exists`` for a batch whose earlier attempt landed
  (its reply was lost): the rollouts are there, so the scores follow as usual; the daemon
  counts a score it already holds once.

Batches that wait keep their tensors on the CPU (the caller's copies are not touched); the
JSON bodies are built on this thread, not in the training step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from alignclient import AlignClient
from alignclient.errors import (
    AlignError,
    ApiUnreachableError,
    BusUnavailableError,
    OverloadedError,
    RolloutExistsError,
    ShapeError,
)
from alignclient.models import MAX_BATCH
from alignclient.retry import RETRY_STATUSES, RetryPolicy

from alignd.infra.telemetry import TrainerMetrics

log = logging.getLogger(__name__)

#: Default retries of one batch stage: 0.2 s doubling to 5 s, 8 attempts (about 25 s).
DEFAULT_PUSH_RETRY = RetryPolicy(initial_s=0.2, max_s=5.0, attempts=8)


@dataclass
class PushBatch:
    """One observed batch as the daemon stores it: per rollout, its valid tokens' values."""

    version_id: str
    rollout_ids: list[str]
    learner: list[torch.Tensor]  # float64 CPU, one per rollout
    sampler: list[torch.Tensor]
    learner_path: str
    sampler_path: str
    completions: list[torch.Tensor] | None = None  # int64 CPU completion token ids
    prompts: list[list[int]] | None = None
    rollouts_stored: bool = field(default=False)


def transient(error: BaseException) -> bool:
    """Whether a failed call may succeed later: unreachable, a gateway or Redis away, busy."""
    if isinstance(error, ApiUnreachableError | BusUnavailableError | OverloadedError):
        return True
    return isinstance(error, AlignError) and getattr(error, "status", None) in RETRY_STATUSES


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + MAX_BATCH, n)) for i in range(0, n, MAX_BATCH)]


class ScorePusher:
    """A background thread that sends :class:`PushBatch` es through ``client`` (see the module doc)."""

    def __init__(self, client: AlignClient, metrics: TrainerMetrics, *, queue_size: int = 1000,
                 retry: RetryPolicy = DEFAULT_PUSH_RETRY):
        self.client = client
        self.metrics = metrics
        self.retry = retry
        self._queue: queue.Queue[PushBatch] = queue.Queue(maxsize=max(1, int(queue_size)))
        self._closing = threading.Event()
        self._idle = threading.Condition()
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name="alignd-push", daemon=True)
        self._thread.start()

    def submit(self, batch: PushBatch) -> bool:
        """Queue ``batch``; False (and counted as dropped) when the queue is full or closed."""
        if self._closing.is_set():
            self.metrics.pushes.labels(outcome="dropped").inc()
            return False
        with self._idle:
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.metrics.pushes.labels(outcome="dropped").inc()
                return False
            self._busy += 1
        self.metrics.push_queue.set(self._queue.qsize())
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued batch is delivered, rejected or abandoned; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Give queued batches ``timeout_s`` to land, then stop (the rest are abandoned)."""
        self.flush(timeout_s)
        self._closing.set()
        self._thread.join(timeout_s)

    # --- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self.metrics.push_queue.set(self._queue.qsize())
            try:
                outcome = "abandoned" if self._closing.is_set() else self._send(batch)
            except Exception:  # never let the thread die: count and go on
                log.exception("pushing version %s failed unexpectedly", batch.version_id)
                outcome = "abandoned"
            self.metrics.pushes.labels(outcome=outcome).inc()
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _call(self, fn):
        return self.retry.call(fn, transient=transient, stop_event=self._closing,
                               on_retry=lambda n, wait, e: self.metrics.push_retries.inc())

    def _send(self, b: PushBatch) -> str:
        try:
            if b.completions is not None and not b.rollouts_stored:
                dropped = sum(self._put_rollouts(b, part) for part in _chunks(len(b.rollout_ids)))
                if dropped:
                    log.warning("the daemon dropped %d rollouts of version %s as stale (older "
                                "than its max_version_diff allows); their scores are not sent",
                                dropped, b.version_id)
                    return "rejected"
                b.rollouts_stored = True
            for part in _chunks(len(b.rollout_ids)):
                scores = [{"rollout_id": r, "logprobs": lp.tolist(), "path": b.learner_path}
                          for r, lp in zip(b.rollout_ids[part], b.learner[part], strict=True)]
                self._call(lambda s=scores: self.client.put_scores(b.version_id, s))
        except AlignError as e:
            if transient(e):
                log.warning("push of %d rollouts of version %s abandoned (retries spent or "
                            "closing): %s", len(b.rollout_ids), b.version_id, e)
                return "abandoned"
            log.warning("the daemon refused %d rollouts of version %s: %s: %s",
                        len(b.rollout_ids), b.version_id, type(e).__name__, e)
            return "rejected"
        return "delivered"

    def _put_rollouts(self, b: PushBatch, part: slice) -> int:
        """Store one chunk of the batch's rollouts; how many the daemon dropped as stale."""
        assert b.completions is not None and b.prompts is not None
        rollouts = [{"rollout_id": r, "prompt_len": len(p), "tokens": [*p, *c.tolist()],
                     "logprobs": s.tolist(), "path": b.sampler_path}
                    for r, p, c, s in zip(b.rollout_ids[part], b.prompts[part],
                                          b.completions[part], b.sampler[part], strict=True)]
        try:
            reply = self._call(lambda: self.client.put_rollouts(b.version_id, rollouts))
        except RolloutExistsError:
            return 0  # an earlier attempt stored them and its reply was lost
        return int(getattr(reply, "dropped", 0) or 0)


def split_rows(values: torch.Tensor, seq: torch.Tensor, n_seq: int) -> list[torch.Tensor]:
    """Flat sequence-major values as one CPU tensor per sequence (empty where none)."""
    counts = torch.bincount(seq, minlength=n_seq).tolist()
    return list(torch.split(values.detach().cpu(), counts))


def as_prompts(prompts: Sequence, n: int) -> list[list[int]]:
    """Prompt token ids as lists of ints, one per rollout (tensors, lists or tuples)."""
    out = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if len(out) != n:
        raise ShapeError(f"prompts has {len(out)} entries but the batch has {n} sequences")
    return out
