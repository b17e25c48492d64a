"""One learner over several expert-parallel ranks: rank 0 drives, the other ranks follow.

The RL loop (:class:`~alignd.learner.loop.LearnerLoop`) talks to Redis, the rollout store and
the samplers; it is one process. A Megatron learner with expert parallelism ``P`` is ``P``
processes, and every forward pass is collective (the token dispatcher gathers all ranks'
tokens), so all of them must run every score, train and export call together.

:class:`RankGroupEngine` is the engine rank 0 hands to the loop. Each call is broadcast as a
command (:func:`torch.distributed.broadcast_object_list`) with one payload per rank; every rank
runs it on its own :class:`~alignd.learner.megatron_engine.MegatronLearnerEngine` and rank 0
gathers the answers (:func:`torch.distributed.gather_object`). The other ranks sit in
:func:`follow` until rank 0 sends ``stop``.

How the work is shared
----------------------
* **train**: the batch is cut into ``P`` contiguous shares of whole GRPO groups with the same
  number of rollouts each (every group's advantages are computed where its rollouts are); the
  engine makes the step the whole batch's (see :mod:`alignd.learner.megatron_engine`).
* **score**: the rollouts are cut into ``P`` contiguous shares; a short share is topped up with
  copies of its last rollout (scored, then dropped) so that every rank runs the same number of
  micro-batches.
* **publish**: :meth:`RankGroupEngine.publish_converted` has every rank quantize and write its
  part of the version (:func:`~alignd.sync.sharded.publish_sharded`); the loop
  then registers and announces it as converted, with no converter in between.

Guidance records (``nvfp4_trace``): every rank gets all of them, keyed by global rollout
index, and names its rows by global index too (the engine's ``key_offset``), because its experts
round the tokens of every rank. Top-up copies in a score share are dropped after scoring; under
the row-scaled paths their rows change no other row's bits.

Routing replay (``routing_replay``: measure, recompute, record): rank 0 checks the batch's
routing records first, as one process would (the same typed errors, before any rank works),
then every rank gets the records of its own share only, keyed within the share: routers are
replicated and route a rank's own tokens before the dispatcher gathers them, so a rank forces
and counts its own tokens (the engine's ``key_offset`` names them by global index, and
``scored_rows`` leaves a score share's top-up copies unrouted and uncounted). Each rank returns
its counts with its answer; :attr:`RankGroupEngine.routing_stats` is their sum, what one
process would count on the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from alignclient.errors import ConfigError, InputError

from alignd.formats.weight_store import WeightStore
from alignd.learner.engine import TrainBatch
from alignd.learner.megatron_engine import MegatronLearnerEngine
from alignd.sync.sharded import publish_sharded
from libalign.models.kv_cache import KVScales
from libalign.models.routing_replay import RoutingStats

STOP = "stop"


def _world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _broadcast(obj: Any = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any] | None:
    rank, world = _world()
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _reindex(records: Mapping[int, Any] | None, lo: int, hi: int) -> dict[int, Any] | None:
    """The records of batch indices ``lo..hi-1``, keyed within that share (None if none)."""
    if not records:
        return None
    return {i - lo: rec for i, rec in records.items() if lo <= i < hi} or None


def split_batch(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """``parts`` contiguous shares of whole groups, equal in rollouts; InputError otherwise."""
    n = len(batch.sequences)
    if n % parts:
        raise InputError(f"a batch of {n} rollouts does not split into {parts} equal shares")
    per = n // parts
    out = []
    for r in range(parts):
        lo, hi = r * per, (r + 1) * per
        if r and batch.groups[lo] == batch.groups[lo - 1]:
            raise InputError(f"GRPO group {batch.groups[lo]} straddles ranks {r - 1} and {r}; "
                             f"use groups that divide the {per} rollouts of a share")
        out.append(TrainBatch(batch.sequences[lo:hi], batch.prompt_lens[lo:hi],
                              batch.sampler_logprobs[lo:hi], batch.rewards[lo:hi],
                              batch.groups[lo:hi], _reindex(batch.guidance, lo, hi),
                              None if batch.old_logprobs is None else batch.old_logprobs[lo:hi],
                              _reindex(batch.routing, lo, hi)))
    return out


def split_rollouts(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                   guidance: Mapping[int, Any] | None, parts: int,
                   routing: Mapping[int, Any] | None = None) -> list[tuple]:
    """``parts`` contiguous shares of rollouts to score, each ``(seqs, plens, guidance, keep,
    offset, routing)``; a short share is topped up with copies of its last rollout, ``keep``
    says how many count. ``guidance`` is re-indexed within the share (copies included),
    ``routing`` too (the ``keep`` rollouts that count only: copies are not routed)."""
    n = len(sequences)
    if n < 1:
        raise InputError("no rollouts to score")
    per = -(-n // parts)
    out = []
    for r in range(parts):
        lo, hi = min(n, r * per), min(n, (r + 1) * per)
        if lo == hi:  # only possible when n is small: borrow the last rollout
            lo, hi = n - 1, n
            keep = 0
        else:
            keep = hi - lo
        seqs = [list(map(int, s)) for s in sequences[lo:hi]]
        plens = list(prompt_lens[lo:hi])
        g = _reindex(guidance, lo, hi)
        last = len(seqs) - 1
        while len(seqs) < per:
            seqs.append(seqs[last])
            plens.append(plens[last])
            if g is not None and last in g:
                g[len(seqs) - 1] = g[last]
        out.append((seqs, plens, g, keep, lo, _reindex(routing, lo, lo + keep)))
    return out


def execute(engine: MegatronLearnerEngine, command: str, payload: Any) -> Any:
    """Run one command on this rank's engine (every rank, rank 0 included); ``score`` and
    ``train`` answer ``(result, routing counts of this rank)``."""
    if command == "score":
        (seqs, plens, _share_guidance, keep, offset, routing), guidance = payload
        scores = _with_offset(engine, offset, engine.score, seqs, plens, guidance, routing,
                              scored_rows=keep)
        return scores[:keep], _counts(engine)
    if command == "train":
        share, offset, guidance = payload
        share = TrainBatch(share.sequences, share.prompt_lens, share.sampler_logprobs,
                           share.rewards, share.groups, guidance, share.old_logprobs,
                           share.routing)
        return _with_offset(engine, offset, engine.train_step, share), _counts(engine)
    if command == "export":
        return engine.export_weights()  # collective (all-gather of the experts)
    if command == "publish":
        root, vid, spec, quantize, kv_format, kv_scales = payload
        res = publish_sharded(engine.model, engine.hf_config, WeightStore(root), vid, spec,
                              quantize=quantize, kv_format=kv_format, kv_scales=kv_scales)
        return None if res is None else res.committed
    raise ConfigError(f"unknown rank command {command!r}")


def _with_offset(engine: MegatronLearnerEngine, offset: int, fn, *args,
                 scored_rows: int | None = None):
    """Call ``fn`` with rows keyed by global rollout index (share index + ``offset``), and
    only the first ``scored_rows`` rollouts routed by records (None: all)."""
    engine.key_offset, engine.scored_rows = offset, scored_rows
    try:
        return fn(*args)
    finally:
        engine.key_offset, engine.scored_rows = 0, None


def _counts(engine: MegatronLearnerEngine) -> RoutingStats:
    """This rank's routing counts of its last call, as plain integers (for gathering)."""
    mine = RoutingStats()
    mine.merge(engine.routing_stats)
    return mine


def follow(engine: MegatronLearnerEngine) -> int:
    """Ranks other than 0: run rank 0's commands until ``stop``; return how many ran."""
    rank, _world_size = _world()
    if rank == 0:
        raise ConfigError("rank 0 drives (RankGroupEngine); follow() is for the other ranks")
    done = 0
    while True:
        command, payloads = _broadcast()
        if command == STOP:
            return done
        try:
            result: Any = ("ok", execute(engine, command, payloads[rank]))
        except Exception as e:
            result = ("error", f"{type(e).__name__}: {e}")
        _gather(result)
        done += 1


class RankGroupEngine:
    """Rank 0's learner engine for the loop: every call runs on all ranks (see module doc)."""

    def __init__(self, engine: MegatronLearnerEngine):
        rank, self.world = _world()
        if rank != 0:
            raise ConfigError("RankGroupEngine runs on rank 0; the other ranks call follow()")
        self.engine = engine
        self.closed = False
        self.routing_stats = RoutingStats()
        """routing disagreement of the last score or train_step call, summed over the ranks"""

    @property
    def path(self) -> str:
        return self.engine.path

    @property
    def kv_scales(self) -> KVScales | None:
        """The K/V global scales every rank's engine writes with (built with the same)."""
        return self.engine.kv_scales

    @property
    def routing_replay(self) -> str:
        """The routing replay mode (every rank's engine is built with the same)."""
        return self.engine.routing_replay

    def routing_geometry(self) -> dict:
        """The model's MoE layers, top-k and expert count (routing records must match)."""
        return self.engine.routing_geometry()

    def objective(self) -> dict:
        """The objective's settings (every rank's engine is built with the same)."""
        return self.engine.objective()

    def _run(self, command: str, payloads: list[Any]) -> list[Any]:
        if self.closed:
            raise ConfigError("the rank group was stopped")
        _broadcast((command, payloads))
        try:
            mine: Any = ("ok", execute(self.engine, command, payloads[0]))
        except Exception as e:
            mine = ("error", f"{type(e).__name__}: {e}")
        answers = _gather(mine)
        errors = [f"rank {r}: {v}" for r, (status, v) in enumerate(answers) if status == "error"]
        if errors:
            raise ConfigError(f"{command} failed on {len(errors)} rank(s): " + "; ".join(errors))
        return [v for _status, v in answers]

    def _counted(self, answers: list[tuple[Any, RoutingStats]]) -> list[Any]:
        """The ranks' results; their routing counts summed into :attr:`routing_stats`."""
        total = RoutingStats()
        for _result, counts in answers:
            total.merge(counts)
        self.routing_stats = total
        return [result for result, _counts in answers]

    def score(self, sequences, prompt_lens, guidance=None, routing=None) -> list[list[float]]:
        """Teacher-forced log-probs, each rank scoring its share (routed by its records)."""
        self.routing_stats = RoutingStats()
        records = self.engine.routing_for(routing, sequences)  # refused here, as in one process
        shares = split_rollouts(sequences, prompt_lens, None, self.world, records)
        whole = dict(guidance) if guidance else None
        parts = self._counted(self._run("score", [(sh, whole) for sh in shares]))
        return [lp for part in parts for lp in part]

    def train_step(self, batch: TrainBatch) -> dict:
        """One GRPO + TIS step over the whole batch, each rank training on its share."""
        batch.check()
        self.routing_stats = RoutingStats()
        records = self.engine.routing_for(batch.routing, batch.sequences)
        batch = TrainBatch(batch.sequences, batch.prompt_lens, batch.sampler_logprobs,
                           batch.rewards, batch.groups, batch.guidance, batch.old_logprobs,
                           records)
        shares = split_batch(batch, self.world)
        whole = dict(batch.guidance) if batch.guidance else None
        per = len(batch.sequences) // self.world
        return self._counted(self._run("train", [(sh, r * per, whole)
                                                 for r, sh in enumerate(shares)]))[0]

    def export_weights(self):
        """The gathered Hugging Face state dict (every rank takes part)."""
        return self._run("export", [None] * self.world)[0]

    def publish_converted(self, store: WeightStore, version_id: str, spec, *,
                          quantize: bool = True, kv_format: str | None = None,
                          kv_scales: KVScales | None = None) -> None:
        """Every rank converts and writes its part of ``version_id`` (its manifest naming the
        sampler's KV format and scales); one of them commits it."""
        done = self._run("publish", [(str(store.root), version_id, spec, quantize, kv_format,
                                      kv_scales)] * self.world)
        # ranks finishing together may both commit (the commit is idempotent): at least one
        if not any(done) or not store.has_version(version_id):
            raise ConfigError(f"sharded version {version_id!r} was not committed "
                              f"(commits per rank: {done})")

    def close(self) -> None:
        """Release the other ranks from :func:`follow`."""
        if not self.closed:
            _broadcast((STOP, None))
            self.closed = True
