"""Rollouts and the learner–sampler discrepancy, kept in Redis per weight version.

The loop this module serves. A sampler generates a rollout with weight version ``v`` and
reports its tokens and the log-probability it gave each completion token
(:meth:`RolloutStore.put_rollouts`). The learner later scores the same tokens with the same
version and reports its own log-probabilities (:meth:`RolloutStore.put_scores`). Pairing
the two gives, per completion token, the execution gap

    δ = log p_learner − log p_sampler   (nats)

which :mod:`libalign.metrics` summarizes: mean and quantiles of |δ|, clip potential, TIS
truncation, k3. This module stores δ, not just its summary, so that any window of recent
tokens can be summarized again later (:meth:`RolloutStore.discrepancy`).

Keys (``P`` is the key prefix, ``v`` a version id, ``lp``/``sp`` learner/sampler path names)::

    P:rollouts:<v>               hash    rollout id -> the rollout as JSON (write-once)
    P:delta:<v>                  string  δ of every scored token of v, float32, appended
    P:delta:<v>:<lp>:<sp>        string  the same, only the tokens of one path pair
    P:delta:<v>:pairs            set     "<lp>:<sp>" pairs that have a δ string
    P:delta:<v>:scored           set     "<rollout id>:<lp>" already scored (idempotence)
    P:delta:index                zset    v -> server time of its latest score
    P:path_pairs                 set     "<lp>:<sp>" pairs kept apart, all versions (capped)

Path pairs. Path names come from writers (a trainer may register paths of its own,
:func:`libalign.gemm.register_path`, that the daemon does not know), and every pair costs a δ
string, a window read in each discrepancy and a series in ``/metrics``. So the store keeps at
most ``max_path_pairs`` pairs apart (``ALIGN_MAX_PATH_PAIRS``): the first ones scored, across
all versions, enter ``P:path_pairs``; the δ of any further pair is appended to the pair
``other:other`` (:data:`~alignclient.models.OTHER_PATH`, a name no writer may use), whose
window, histogram and gauges are then those of all such pairs together, and counted in
``libalign_scores_folded_total``. The set expires with the δ keys (every score refreshes it),
so while any version's δ lives, its pairs are in the set or are ``other:other``; a discrepancy
read reports at most ``max_path_pairs`` pairs besides ``other:other`` whatever Redis holds
(pairs written under a larger cap are left out of ``by_path``, logged, and still counted in
the overall statistics).

Why float32 strings. ``APPEND`` adds a batch's δ values to the end of a string in one
command, and ``GETRANGE`` reads the last N of them without touching the rest: a window
read costs 4N bytes, whatever the version holds. float32 keeps |δ| to 7 significant
digits, far below the 1e-4 nats the histograms resolve.

Atomicity. :meth:`~RolloutStore.put_rollouts` is one Lua script: it refuses the whole
batch if any id is already stored (:class:`~alignclient.errors.RolloutExistsError`), else
writes all of it, so a batch is never half stored. :meth:`~RolloutStore.put_scores`
computes δ in Python, then one Lua script appends it: a score whose ``(rollout id,
learner path)`` is already in ``P:delta:<v>:scored`` is skipped, so sending the same batch
twice (a retry after a lost reply) counts its tokens once. Window reads take the last
``4N`` bytes of one string in one script, so they always end on a value boundary.

Expiry. A version's rollout hash expires ``ttl_s`` after the last batch of rollouts, its
δ keys ``ttl_s`` after the last batch of scores (the control API uses ``guidance_ttl_s``,
so rollouts live about as long as their guidance records); ``None`` keeps them until
deleted. The index forgets versions whose δ string expired when it next reads them.

Poisoned records. A stored value no read can serve (a rollout that no longer validates, a
non-finite δ written behind the store's back) never breaks the reads of the others: an
unreadable rollout reads as not found (the full listing skips it), non-finite δ values are
left out of every window; each is logged.

Like the guidance store, the store needs a binary-safe client (``decode_responses=False``)
and one Redis (standalone or Sentinel), not Redis Cluster.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import redis
import torch
from alignclient.errors import (
    ConfigError,
    InputError,
    RolloutExistsError,
    RolloutNotFoundError,
    ShapeError,
)
from alignclient.ids import check_version_id
from alignclient.models import (
    OTHER_PATH,
    DeltaStats,
    DeltaSummary,
    Discrepancy,
    PathDiscrepancy,
    Rollout,
    RoutingWire,
    Score,
)
from alignclient.retry import RetryPolicy
from pydantic import ValidationError

from alignd.infra.bus import RedisBus
from alignd.infra.redis_clients import decodes
from alignd.infra.settings import DEFAULT_MAX_PATH_PAIRS
from alignd.infra.telemetry import Metrics, path_label
from libalign.metrics import DEFAULT_TIS_CAP, delta_stats, tis_weights, token_deltas
from libalign.routing.records import RoutingRecord

__all__ = ["DEFAULT_TTL_S", "DeltaSummary", "Discrepancy", "Rollout", "RolloutStore", "Score",
           "summarize"]

log = logging.getLogger(__name__)

#: Expiry of a version's keys after their last write when none is given (one day).
DEFAULT_TTL_S = 86_400.0
#: At most this many versions are read to fill a window that spans versions.
MAX_WINDOW_VERSIONS = 64
#: The pair every pair past ``max_path_pairs`` is recorded under.
OTHER_PAIR = f"{OTHER_PATH}:{OTHER_PATH}"

# KEYS[1] rollouts hash. ARGV: ttl_ms, then id, json pairs. Returns the ids already there.
_PUT_ROLLOUTS_LUA = """
local dup = {}
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then dup[#dup + 1] = ARGV[i] end
end
if #dup > 0 then return dup end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[1]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return dup
"""

# KEYS: delta, pairs, scored, index, pairs kept apart, the other pair's δ, then one key per
# path pair. ARGV: ttl_ms, version, max pairs, other pair's name, then per score: scored
# member, pair key index, pair name, bytes. A pair is kept apart if it already is or the
# set has room; else its δ goes to the other pair. Returns one flag per score: bit 0 set if
# recorded now (clear: recorded before), bit 1 set if its pair went to the other pair.
_PUT_SCORES_LUA = """
local ttl, cap, other = tonumber(ARGV[1]), tonumber(ARGV[3]), ARGV[4]
local flags, added, dest = {}, 0, {}
for i = 5, #ARGV, 4 do
  local k, name = tonumber(ARGV[i + 1]), ARGV[i + 2]
  if dest[k] == nil then
    if redis.call('SISMEMBER', KEYS[5], name) == 1 then
      dest[k] = k
    elseif redis.call('SCARD', KEYS[5]) < cap then
      redis.call('SADD', KEYS[5], name)
      dest[k] = k
    else
      dest[k] = 6
    end
  end
  local d = dest[k]
  local folded = 0
  if d == 6 then folded = 2 end
  if redis.call('SADD', KEYS[3], ARGV[i]) == 1 then
    redis.call('APPEND', KEYS[1], ARGV[i + 3])
    redis.call('APPEND', KEYS[d], ARGV[i + 3])
    if d == 6 then redis.call('SADD', KEYS[2], other) else redis.call('SADD', KEYS[2], name) end
    flags[#flags + 1] = 1 + folded
    added = added + 1
  else
    flags[#flags + 1] = folded
  end
end
if added > 0 then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[4], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[2])
end
if ttl > 0 then
  for k = 1, #KEYS do
    if k ~= 4 and redis.call('EXISTS', KEYS[k]) == 1 then redis.call('PEXPIRE', KEYS[k], ttl) end
  end
end
return flags
"""

# KEYS[1] a δ string; ARGV[1] bytes wanted. The last ARGV[1] bytes (all if fewer).
_TAIL_LUA = """
local n = redis.call('STRLEN', KEYS[1])
if n == 0 then return '' end
local start = n - tonumber(ARGV[1])
if start < 0 then start = 0 end
return redis.call('GETRANGE', KEYS[1], start, n - 1)
"""


def summarize(delta: np.ndarray | torch.Tensor) -> DeltaStats:
    """Statistics of a flat δ vector with libalign.metrics (all None for no tokens)."""
    d = torch.as_tensor(np.asarray(delta, dtype=np.float64))
    if d.numel() == 0:
        return DeltaStats()
    s = delta_stats(d).to_dict()
    tis = tis_weights(d, cap=DEFAULT_TIS_CAP, level="token")
    return DeltaStats(**s, tis_cap=DEFAULT_TIS_CAP, tis_truncated_fraction=tis.truncated_fraction)


@dataclass(frozen=True)
class _Scored:
    score: Score
    rollout: Rollout
    delta: np.ndarray  # float64


class RolloutStore:
    """Rollouts, learner scores and the δ they give, per weight version, in Redis."""

    def __init__(self, client: redis.Redis, prefix: str = "libalign", metrics: Metrics | None = None,
                 *, ttl_s: float | None = DEFAULT_TTL_S, retry: RetryPolicy | None = None,
                 max_path_pairs: int = DEFAULT_MAX_PATH_PAIRS):
        if decodes(client):
            raise ConfigError("the rollout store needs a binary-safe client (decode_responses=False)")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"ttl_s must be positive (or None), not {ttl_s}")
        if isinstance(max_path_pairs, bool) or not isinstance(max_path_pairs, int) \
                or max_path_pairs < 1:
            raise ConfigError(f"max_path_pairs must be a positive integer, not {max_path_pairs!r}")
        self.client = client
        self.prefix = prefix
        self.metrics = metrics
        self.max_path_pairs = max_path_pairs
        if metrics is not None:
            metrics.allow_path_pairs(max_path_pairs)
        self.ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        on_retry = (lambda what, e: metrics.redis_retries.inc()) if metrics is not None else None
        self.bus = RedisBus(client, retry=retry, on_retry=on_retry)
        self._put_rollouts = client.register_script(_PUT_ROLLOUTS_LUA)
        self._put_scores = client.register_script(_PUT_SCORES_LUA)
        self._tail = client.register_script(_TAIL_LUA)

    # --- keys -------------------------------------------------------------------------

    def _rollouts_key(self, version: str) -> str:
        return f"{self.prefix}:rollouts:{check_version_id(version)}"

    def _delta_key(self, version: str, pair: str | None = None) -> str:
        base = f"{self.prefix}:delta:{check_version_id(version)}"
        return base if pair is None else f"{base}:{pair}"

    @property
    def _index_key(self) -> str:
        return f"{self.prefix}:delta:index"

    @property
    def _path_pairs_key(self) -> str:
        return f"{self.prefix}:path_pairs"

    # --- rollouts -----------------------------------------------------------------------

    def put_rollouts(self, version: str, rollouts: Sequence[Rollout]) -> int:
        """Store a batch of rollouts, all or none; returns their completion tokens."""
        key = self._rollouts_key(version)
        if not rollouts:
            raise InputError("put_rollouts needs at least one rollout")
        seen: set[str] = set()
        args: list[object] = [self.ttl_ms]
        for r in rollouts:
            if not isinstance(r, Rollout):
                raise InputError(f"expected a Rollout, got {type(r).__name__}")
            if r.rollout_id in seen:
                raise InputError(f"rollout {r.rollout_id!r} appears twice in the batch")
            seen.add(r.rollout_id)
            args += [r.rollout_id, r.model_dump_json()]
        dup = self.bus.call(f"rollouts put {version}",
                            lambda: self._put_rollouts(keys=[key], args=args))
        if dup:
            raise RolloutExistsError(version, [d.decode() for d in dup])
        tokens = sum(r.completion_tokens for r in rollouts)
        if self.metrics is not None:
            for r in rollouts:
                self.metrics.rollout_tokens.labels(sampler_path=path_label(r.path)).inc(
                    r.completion_tokens)
        return tokens

    def get_rollouts(self, version: str, ids: Iterable[str] | None = None) -> list[Rollout]:
        """The stored rollouts (all, sorted by id, or those of ``ids`` in that order)."""
        key = self._rollouts_key(version)
        if ids is None:
            raw = self.bus.call(f"rollouts get {version}", lambda: self.client.hgetall(key))
            found = [stored_rollout(version, k.decode(), raw[k]) for k in sorted(raw)]
            return [r for r in found if r is not None]
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return []
        rows = self.bus.call(f"rollouts get {version}", lambda: self.client.hmget(key, wanted))
        out = []
        for rid, row in zip(wanted, rows, strict=True):
            r = None if row is None else stored_rollout(version, rid, row)
            if r is None:
                raise RolloutNotFoundError(version, rid)
            out.append(r)
        return out

    def list_rollout_ids(self, version: str) -> list[str]:
        """Ids of the rollouts stored for ``version``, sorted."""
        key = self._rollouts_key(version)
        return sorted(k.decode() for k in self.bus.call(f"rollouts ids {version}",
                                                         lambda: self.client.hkeys(key)))

    # --- scores -------------------------------------------------------------------------

    def _pair(self, scores: Sequence[Score], version: str) -> list[_Scored]:
        """Each score with its stored rollout and δ; typed errors for what does not fit."""
        seen: set[tuple[str, str]] = set()
        for s in scores:
            if not isinstance(s, Score):
                raise InputError(f"expected a Score, got {type(s).__name__}")
            if (s.rollout_id, s.path) in seen:
                raise InputError(f"rollout {s.rollout_id!r} is scored twice by path {s.path!r} "
                                 "in the batch")
            seen.add((s.rollout_id, s.path))
        rollouts = {r.rollout_id: r for r in self.get_rollouts(version, [s.rollout_id for s in scores])}
        learner, sampler = [], []
        for s in scores:
            r = rollouts[s.rollout_id]
            if len(s.logprobs) != r.completion_tokens:
                raise ShapeError(f"score of rollout {s.rollout_id!r} has {len(s.logprobs)} "
                                 f"log-probs; the rollout has {r.completion_tokens} completion "
                                 "tokens")
            learner.append(torch.tensor(s.logprobs, dtype=torch.float64))
            sampler.append(torch.tensor(r.logprobs, dtype=torch.float64))
        deltas = token_deltas(learner, sampler)
        return [_Scored(s, rollouts[s.rollout_id], d.numpy())
                for s, d in zip(scores, deltas, strict=True)]

    def put_scores(self, version: str, scores: Sequence[Score]) -> DeltaSummary:
        """Pair learner scores with stored rollouts, record δ, return the batch's statistics.

        A score already recorded (same rollout and learner path) is not counted again; the
        statistics returned cover the whole batch either way, per pair as recorded (a pair
        past ``max_path_pairs`` as ``other``/``other``).
        """
        if not scores:
            raise InputError("put_scores needs at least one score")
        scored = self._pair(scores, version)
        pairs: dict[str, int] = {}
        keys = [self._delta_key(version), self._delta_key(version, "pairs"),
                self._delta_key(version, "scored"), self._index_key, self._path_pairs_key,
                self._delta_key(version, OTHER_PAIR)]
        args: list[object] = [self.ttl_ms, version, self.max_path_pairs, OTHER_PAIR]
        for x in scored:
            pair = f"{x.score.path}:{x.rollout.path}"
            if pair not in pairs:
                keys.append(self._delta_key(version, pair))
                pairs[pair] = len(keys)  # Lua indexes KEYS from 1
            args += [f"{x.score.rollout_id}:{x.score.path}", pairs[pair], pair,
                     x.delta.astype("<f4").tobytes()]
        flags = [int(f) for f in self.bus.call(f"scores put {version}",
                                               lambda: self._put_scores(keys=keys, args=args))]
        recorded = [(_OTHER if f & 2 else (x.score.path, x.rollout.path), x.delta)
                    for x, f in zip(scored, flags, strict=True)]
        fresh = [r for r, f in zip(recorded, flags, strict=True) if f & 1]
        if self.metrics is not None:
            for (lp, sp), d in _by_pair(fresh).items():
                self.metrics.observe_abs_deltas(lp, sp, np.abs(d))
            self.metrics.scores_folded.inc(sum(1 for f in flags if f == 3))
        all_d = np.concatenate([x.delta for x in scored])
        return DeltaSummary(
            version_id=version, rollouts=len(scored), tokens=int(all_d.size),
            duplicates=len(scored) - len(fresh), stats=summarize(all_d),
            by_path=[PathDiscrepancy(learner_path=lp, sampler_path=sp, stats=summarize(d))
                     for (lp, sp), d in sorted(_by_pair(recorded).items())])

    # --- discrepancy --------------------------------------------------------------------

    def _tail_values(self, key: str, n: int) -> np.ndarray:
        """The last ``n`` float32 δ values of one string, as float64."""
        raw = self.bus.call(f"delta tail {key}", lambda: self._tail(keys=[key], args=[4 * n]))
        d = np.frombuffer(raw or b"", dtype="<f4").astype(np.float64)
        finite = np.isfinite(d)
        if not finite.all():
            log.warning("%s holds %d non-finite δ values; left out of the window", key,
                        int(d.size - finite.sum()))
            d = d[finite]
        return d

    def _pairs(self, version: str) -> list[str]:
        key = self._delta_key(version, "pairs")
        return sorted(p.decode() for p in self.bus.call(f"delta pairs {version}",
                                                         lambda: self.client.smembers(key)))

    def recent_versions(self) -> list[str]:
        """Versions with δ recorded, most recently scored first (expired ones are dropped)."""
        ids = self.bus.call("delta index", lambda: self.client.zrevrange(
            self._index_key, 0, MAX_WINDOW_VERSIONS - 1))
        out = []
        for raw in ids:
            v = raw.decode()
            if self.bus.call(f"delta exists {v}", lambda v=v: self.client.exists(self._delta_key(v))):
                out.append(v)
            else:
                self.bus.call(f"delta forget {v}", lambda v=v: self.client.zrem(self._index_key, v))
        return out

    def _window(self, versions: list[str], n: int, pair: str | None) -> tuple[np.ndarray, list[str]]:
        """The last ``n`` values across ``versions`` (newest first), and the versions used."""
        parts, used, left = [], [], n
        for v in versions:
            if left <= 0:
                break
            d = self._tail_values(self._delta_key(v, pair), left)
            if d.size:
                parts.append(d)
                used.append(v)
                left -= d.size
        parts.reverse()  # oldest first, like the strings themselves
        return (np.concatenate(parts) if parts else np.zeros(0)), used

    def discrepancy(self, version: str | None = None, window_tokens: int = 65_536) -> Discrepancy:
        """δ statistics of the last ``window_tokens`` tokens of ``version`` (None: recent versions).

        Without a version the window spans the most recently scored versions, newest
        first, until it holds ``window_tokens`` tokens; each path pair gets its own window
        of that size. (The control API exposes the recent window's statistics as gauges,
        read at every scrape: :class:`alignd.infra.telemetry.ClusterGauges`.)
        """
        if not isinstance(window_tokens, int) or window_tokens < 1:
            raise InputError(f"window_tokens must be a positive integer, not {window_tokens!r}")
        versions = [check_version_id(version)] if version is not None else self.recent_versions()
        d, used = self._window(versions, window_tokens, None)
        pairs = self._bounded(sorted({p for v in used for p in self._pairs(v)}))
        by_path = []
        for pair in pairs:
            lp, sp = pair.split(":", 1)
            pd, _ = self._window(versions, window_tokens, pair)
            stats = summarize(pd)
            by_path.append(PathDiscrepancy(learner_path=lp, sampler_path=sp, stats=stats))
        return Discrepancy(version_id=version, versions=used, window_tokens=window_tokens,
                           stats=summarize(d), by_path=by_path)

    def _bounded(self, pairs: list[str]) -> list[str]:
        """``pairs`` (sorted), at most ``max_path_pairs`` of them besides other:other; the rest
        (stored under a larger cap) left out and logged."""
        kept = [p for p in pairs if p != OTHER_PAIR]
        if len(kept) <= self.max_path_pairs:
            return pairs
        log.warning("the discrepancy window holds %d path pairs; the %d past max_path_pairs=%d "
                    "are left out of by_path", len(kept), len(kept) - self.max_path_pairs,
                    self.max_path_pairs)
        return sorted(kept[:self.max_path_pairs] + [p for p in pairs if p == OTHER_PAIR])


def routing_wire(record: RoutingRecord) -> RoutingWire:
    """The wire form of a routing record (base64 of its raw arrays)."""
    ids, w = record.to_bytes()
    return RoutingWire(layers=list(record.layers), top_k=record.top_k,
                       num_experts=record.num_experts, experts=base64.b64encode(ids).decode(),
                       weights=None if w is None else base64.b64encode(w).decode(),
                       weights_dtype=record.weights_dtype or "bfloat16",
                       version_id=record.version)


def routing_record(wire: RoutingWire) -> RoutingRecord:
    """A rollout's routing record from its wire form (RoutingRecordError if malformed)."""
    ids, w = wire.raw()
    return RoutingRecord.from_bytes(ids, positions=wire.positions, layers=wire.layers,
                                    top_k=wire.top_k, num_experts=wire.num_experts, weights=w,
                                    version=wire.version_id, weights_dtype=wire.weights_dtype)


def stored_rollout(version: str, rollout_id: str, raw: bytes) -> Rollout | None:
    """A stored rollout, or None (logged) if it no longer validates."""
    try:
        return Rollout.model_validate_json(raw)
    except ValidationError as e:
        log.warning("rollout %r of version %r is unreadable (%d errors); treated as absent",
                    rollout_id, version, e.error_count())
        return None


_OTHER = (OTHER_PATH, OTHER_PATH)


def _by_pair(recorded: list[tuple[tuple[str, str], np.ndarray]]
             ) -> dict[tuple[str, str], np.ndarray]:
    """δ grouped by the (learner path, sampler path) pair it was recorded under, in batch order."""
    groups: dict[tuple[str, str], list[np.ndarray]] = {}
    for pair, delta in recorded:
        groups.setdefault(pair, []).append(delta)
    return {k: np.concatenate(v) for k, v in groups.items()}
