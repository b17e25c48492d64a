"""Pushing a trainer's rollouts and scores to the daemon without ever holding up a step.

:meth:`ScorePusher.submit` puts one batch on a bounded queue and returns at once; it never
blocks and never raises. A daemon thread takes batches in order and sends each through the
control API: the rollouts first (tokens and the sampler's log-probs, when the trainer generated
them itself), then the learner's scores, which the daemon pairs with them into δ (its
``libalign_logprob_abs_delta`` and ``/v1/discrepancy``).

The queue is bounded twice: at most ``queue_size`` batches and at most ``queue_bytes`` bytes of
tensors held (:attr:`PushBatch.nbytes`: waiting batches and the one being sent). The bytes are
what matters to the trainer's memory: one batch of 256 rollouts × 4,096 tokens holds about
24 MiB (two float64 log-probs and one int64 token id per token), so while the daemon is away
the default :data:`DEFAULT_PUSH_QUEUE_BYTES` (256 MiB) holds about ten of them and drops the
rest, where a bound in batches alone would grow to gigabytes.

What can go wrong, and what is counted (:class:`~alignd.infra.telemetry.TrainerMetrics`):

* the queue is at either bound (the daemon has been away for a while): the new batch is
  dropped, ``libalign_integration_pushes_total{outcome="dropped"}``;
* the failure may pass (:func:`alignclient.retry.transient`, the contract's one
  classification; every push call is retry-safe): the API cannot be reached or did not answer
  within the client's deadline, or it answered 500/502/503/504 (it failed inside, a gateway,
  Redis away, overloaded). The stage is retried by the contract's one retry policy
  (:class:`alignclient.retry.RetryPolicy`: jittered exponential backoff, at most
  ``retry.attempts`` attempts), each retry counted in
  ``libalign_integration_push_retries_total``; once the attempts run out the batch is
  ``abandoned`` and the next one gets its own attempts, so an outage costs bounded time per
  batch and the queue keeps moving;
* the API refuses the batch (:func:`alignclient.retry.refused`, a 4xx: unknown version, an id
  that breaks the rules, a stale version): ``rejected``, logged with the daemon's words, never
  retried;
* the API answers something that does not follow the contract: ``abandoned``, logged;
* ``put_rollouts`` answers ``rollout_exists`` for a batch whose earlier attempt landed
  (its reply was lost): the rollouts are there, so the scores follow as usual; the daemon
  counts a score it already holds once.

Every call the thread makes ends by the client's deadline (``AlignClient(deadline_s=...)``),
so :meth:`ScorePusher.close` can wait for the thread to end: it gives queued batches their
time, stops the retrying, and joins the thread for at most the deadline of the call in flight.

Batches that wait keep their tensors on the CPU (the caller's copies are not touched); the
JSON bodies are built on this thread, not in the training step.
"""

from __future__ import annotations

import logging
import operator
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from alignclient import AlignClient
from alignclient.errors import AlignError, DTypeError, InputError, RolloutExistsError, ShapeError
from alignclient.models import MAX_BATCH
from alignclient.retry import RetryPolicy, refused, transient

from alignd.infra.telemetry import TrainerMetrics

log = logging.getLogger(__name__)

#: Default retries of one batch stage: 0.2 s doubling to 5 s, 8 attempts (about 25 s).
DEFAULT_PUSH_RETRY = RetryPolicy(initial_s=0.2, max_s=5.0, attempts=8)
#: Default bound of the push queue in bytes of tensors held (256 MiB).
DEFAULT_PUSH_QUEUE_BYTES = 256 << 20
#: Default bound of the push queue in batches.
DEFAULT_PUSH_QUEUE_BATCHES = 1000


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
    prompts: list[torch.Tensor] | None = None  # int64 CPU prompt token ids
    rollouts_stored: bool = field(default=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the batch holds (what it costs the trainer while it waits)."""
        parts = [*self.learner, *self.sampler, *(self.completions or ()), *(self.prompts or ())]
        return sum(t.numel() * t.element_size() for t in parts)


def push_transient(error: BaseException) -> bool:
    """Whether a failed push call may succeed later (every push call is retry-safe)."""
    return transient(error, idempotent=True)


class _Closing(Exception):
    """The pusher is closing: the batch in hand is abandoned."""


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + MAX_BATCH, n)) for i in range(0, n, MAX_BATCH)]


class ScorePusher:
    """A background thread that sends :class:`PushBatch` es through ``client`` (see the module doc)."""

    def __init__(self, client: AlignClient, metrics: TrainerMetrics, *,
                 queue_size: int = DEFAULT_PUSH_QUEUE_BATCHES,
                 queue_bytes: int = DEFAULT_PUSH_QUEUE_BYTES,
                 retry: RetryPolicy = DEFAULT_PUSH_RETRY):
        if int(queue_size) < 1 or int(queue_bytes) < 1:
            raise InputError(f"the push queue needs room: queue_size {queue_size} and "
                             f"queue_bytes {queue_bytes} must be >= 1")
        self.client = client
        self.metrics = metrics
        self.retry = retry
        self.queue_bytes = int(queue_bytes)
        self._queue: queue.Queue[tuple[PushBatch, int]] = queue.Queue(maxsize=int(queue_size))
        self._closing = threading.Event()
        self._idle = threading.Condition()
        self._busy = 0
        self._held = 0  # bytes of the batches queued or being sent
        self._thread = threading.Thread(target=self._run, name="alignd-push", daemon=True)
        self._thread.start()

    def submit(self, batch: PushBatch) -> bool:
        """Queue ``batch``; False (and counted as dropped) when the queue is at its batch or
        byte bound, or closed."""
        nbytes = batch.nbytes
        with self._idle:
            ok = not self._closing.is_set() and self._held + nbytes <= self.queue_bytes
            if ok:
                try:
                    self._queue.put_nowait((batch, nbytes))
                except queue.Full:
                    ok = False
            if ok:
                self._busy += 1
                self._held += nbytes
            held = self._held
        if not ok:
            self.metrics.pushes.labels(outcome="dropped").inc()
            return False
        self.metrics.push_queue.set(self._queue.qsize())
        self.metrics.push_queue_bytes.set(held)
        return True

    @property
    def held_bytes(self) -> int:
        """Bytes of the batches queued or being sent."""
        with self._idle:
            return self._held

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

    def close(self, timeout_s: float = 5.0) -> bool:
        """Give queued batches ``timeout_s`` to land, then stop and join the thread.

        Stopping ends the retry waits at once and abandons what is still queued (counted);
        the call in flight ends by the client's deadline, which is how long the join waits
        beyond ``timeout_s``. True when the thread has ended; False, logged, if it is still
        running after that (a daemon thread, left to end on its own).
        """
        self.flush(timeout_s)
        self._closing.set()
        grace = float(getattr(self.client, "deadline_s", timeout_s)) + 1.0
        self._thread.join(grace)
        if self._thread.is_alive():
            log.warning("the push thread is still running %.1f s after close; abandoning it",
                        grace)
            return False
        return True

    @property
    def alive(self) -> bool:
        """Whether the push thread is running."""
        return self._thread.is_alive()

    # --- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            try:
                batch, nbytes = self._queue.get(timeout=0.1)
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
                self._held -= nbytes
                held = self._held
                self._idle.notify_all()
            self.metrics.push_queue_bytes.set(held)

    def _call(self, fn):
        if self._closing.is_set():
            raise _Closing
        return self.retry.call(fn, transient=push_transient, stop_event=self._closing,
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
        except _Closing:
            return "abandoned"
        except AlignError as e:
            if refused(e):
                log.warning("the daemon refused %d rollouts of version %s: %s: %s",
                            len(b.rollout_ids), b.version_id, type(e).__name__, e)
                return "rejected"
            log.warning("push of %d rollouts of version %s abandoned (%s): %s: %s",
                        len(b.rollout_ids), b.version_id,
                        "retries spent or closing" if push_transient(e) else "not retryable",
                        type(e).__name__, e)
            return "abandoned"
        return "delivered"

    def _put_rollouts(self, b: PushBatch, part: slice) -> int:
        """Store one chunk of the batch's rollouts; how many the daemon dropped as stale."""
        assert b.completions is not None and b.prompts is not None
        rollouts = [{"rollout_id": r, "prompt_len": len(p), "tokens": [*p.tolist(), *c.tolist()],
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


def _prompt(p, i: int) -> torch.Tensor:
    """One prompt's token ids as a flat int64 CPU tensor (InputError naming row ``i`` if not ids)."""
    if isinstance(p, torch.Tensor):
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise DTypeError(f"prompts row {i} must hold integer token ids, got {p.dtype}")
        return p.detach().reshape(-1).to("cpu", torch.int64)
    try:
        return torch.tensor([operator.index(v) for v in p], dtype=torch.int64)
    except (TypeError, OverflowError, RuntimeError) as e:
        raise InputError(f"prompts row {i} must be a sequence of integer token ids: {e}") from e


def as_prompts(prompts: Sequence, n: int) -> list[torch.Tensor]:
    """Prompt token ids as int64 CPU tensors, one per rollout (from tensors, lists or tuples)."""
    out = [_prompt(p, i) for i, p in enumerate(prompts)]
    if len(out) != n:
        raise ShapeError(f"prompts has {len(out)} entries but the batch has {n} sequences")
    return out
