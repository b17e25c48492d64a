"""Retention: what a run keeps of its history, and how the rest is let go safely.

Without it every version ever published keeps its registry record and its store directories
(published BF16, NVFP4, SGLang exports) forever, stays ``serving`` after samplers moved on,
and every sampler that ever ran leaves a consumer and a group on the streams. One pass of
:class:`Retention` (the converter runs it every ``retention_interval_s``, the first one an
interval after it starts) does four things, in this order:

1. **Retire.** A ``serving`` version moves to ``retired`` (a history entry with the reason)
   when it is not in use and ``retain_versions`` newer versions serve. *In use* means held
   by a service instance (:func:`alignd.infra.liveness.held_versions`): a sampler names in
   its heartbeat the version it serves and, before it reads a version's bits, the one it is
   loading; what its last beat named stays held for ``held_version_grace_s`` after that beat
   unless it stopped cleanly, so a sampler paused or cut off past its heartbeat's ttl keeps
   its version (a live heartbeat's ``version`` counts too). A ``failed``
   version does too once it has been failed for ``retired_ttl_s`` without an operator
   retrying it, unless it is among the newest ``retain_versions`` versions. ``published``,
   ``converting``, ``converted`` and ``loading`` versions are never touched: they are work in
   flight. The newest servable versions therefore survive for a restarted sampler to fall
   back on, whatever failed after them.
2. **Prune.** A ``retired`` version that has been retired for ``retired_ttl_s`` and that no
   live heartbeat names loses its store directories (:meth:`WeightStore.discard
   <alignd.formats.weight_store.WeightStore.discard>`: each renamed out of sight, then
   deleted), *then* its record, history and index entry (:meth:`Registry.prune
   <alignd.infra.registry.Registry.prune>`, one script that leaves a tombstone so page
   cursors naming it still lead on). Crash safety is by order and idempotence: a pass that
   dies between the two leaves a ``retired`` record whose directories are gone (or a
   ``.tmp-*`` leftover that the store's sweep removes); the next pass finds it retired and
   old, discards nothing more and deletes the record. Nothing is ever deleted while a
   record could still send a reader to it: only ``retired`` versions are pruned, and no
   sampler loads a retired one. A sampler that read a version's record just before a pass
   retired it finds out after its load (it checks the record again, see
   :meth:`alignd.sampler.service.SamplerService.load`) and serves nothing from it.
3. **Exports.** With a ModelOpt export root (the converter's ``sampler_layout=modelopt``),
   the exports of pruned versions go with them (step 2, also under an ``sglang_export_dir``
   outside the store), and of the other exports only the newest ``retain_exports`` are kept,
   besides every export a live sampler serves or that a sampler may still load (its version
   ``converting``, ``converted`` or ``loading``): an export is read by a server only during
   its ``update_weights_from_disk``, so a version served is the last one that needs its own.
4. **Dead consumers.** On each stream of the run (those of the settings under the key
   prefix: published, converted, sync, rollout requests and completions) a consumer idle for
   ``dead_consumer_idle_ms`` with nothing pending, whose name no live heartbeat carries, is
   deleted from its group (``XGROUP DELCONSUMER``); a dead consumer with pending entries is
   left for a live one to reclaim them (``XAUTOCLAIM``) and goes at a later pass. A
   sampler's own group on the converted stream (:func:`~alignd.infra.events.sampler_group`,
   one per sampler name, and the default name is host and pid) is destroyed once none of its
   consumers is alive and no live sampler has its name: nobody else reads that group, so
   its pending entries died with the sampler. Shared groups (``converter``, ``samplers``)
   are never destroyed: their position in the stream is the run's.

Idle time alone does not tell a dead consumer: Redis 7.0 resets it only when a read delivers
something (7.2 at every read), so a live consumer of a quiet stream looks idle. What protects
it is its heartbeat: a consumer (or a sampler's group) whose name a live heartbeat carries is
never removed. The check and the removal are one script per group, so a consumer is never
deleted while it holds an entry delivered after the check; one deleted while idle and empty
is made again by its next read. Every step is one the next pass would repeat, so passes may
overlap (two converters) or die anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from alignclient.errors import StateTransitionError
from alignclient.ids import safe_id

from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.events import SAMPLER_GROUP_PREFIX, sampler_group, sync_stream
from alignd.infra.liveness import held_versions, list_heartbeats
from alignd.infra.registry import Registry, VersionAge
from alignd.infra.settings import ConverterSettings
from alignd.infra.telemetry import Metrics
from alignd.infra.work import ready_stream, requests_stream
from libalign.atomic_dir import discard_directory

log = logging.getLogger(__name__)

# KEYS[1] stream. ARGV: group, idle ms, 1 if the group is a gone sampler's own, names kept.
# One script, so no consumer is removed while it holds an entry delivered after the check.
_CLEAN_LUA = """
local keep = {}
for i = 4, #ARGV do keep[ARGV[i]] = true end
local alive, removed = 0, {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if keep[f['name']] or tonumber(f['idle']) < tonumber(ARGV[2]) then
    alive = alive + 1
  elseif tonumber(f['pending']) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    table.insert(removed, f['name'])
  end
end
if ARGV[3] == '1' and alive == 0 then
  redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
  return {1, removed}
end
return {0, removed}
"""


@dataclass
class RetentionReport:
    """What one pass did: version ids retired and pruned, ``stream/group/consumer`` names of
    consumers removed and ``stream/group`` names of groups destroyed."""

    retired: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    exports_pruned: list[str] = field(default_factory=list)
    consumers_removed: list[str] = field(default_factory=list)
    groups_destroyed: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many of each (the labels of ``libalign_retention_actions_total``)."""
        return {"retired": len(self.retired), "pruned": len(self.pruned),
                "exports_pruned": len(self.exports_pruned),
                "consumers_removed": len(self.consumers_removed),
                "groups_destroyed": len(self.groups_destroyed)}


def run_streams(settings: ConverterSettings) -> list[str]:
    """The streams of the run that the retention pass looks after: every stream the settings
    and the key prefix name, those under the prefix only (an override outside it may be
    shared with another run)."""
    prefix = settings.key_prefix
    names = [settings.published_stream, settings.converted_stream, sync_stream(prefix),
             requests_stream(prefix), ready_stream(prefix)]
    return [s for s in dict.fromkeys(names) if s.startswith(f"{prefix}:")]


class Retention:
    """One run's retention pass (see the module docstring); :meth:`run` does one."""

    def __init__(self, bus: RedisBus, registry: Registry, store: WeightStore, *,
                 streams: list[str], retain_versions: int, retired_ttl_s: float,
                 dead_consumer_idle_ms: int, actor: str = "retention",
                 metrics: Metrics | None = None, exports: ModelOptExport | None = None,
                 retain_exports: int = 3, heartbeat_ttl_s: float | None = None,
                 held_grace_s: float = 600.0, clock: Callable[[], float] | None = None):
        if retain_versions < 1:
            raise ValueError(f"retain_versions must be at least 1, got {retain_versions}")
        self.bus, self.registry, self.store = bus, registry, store
        self.streams = streams
        self.retain = retain_versions
        self.ttl_s = retired_ttl_s
        self.idle_ms = dead_consumer_idle_ms
        self.actor = actor
        self.metrics = metrics
        self.exports = exports
        self.retain_exports = retain_exports
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.grace_s = held_grace_s
        self.clock = clock
        self._clean = bus.client.register_script(_CLEAN_LUA)

    @classmethod
    def from_settings(cls, settings: ConverterSettings, bus: RedisBus, registry: Registry,
                      store: WeightStore, metrics: Metrics | None = None,
                      exports: ModelOptExport | None = None,
                      clock: Callable[[], float] | None = None) -> Retention:
        """The pass a converter runs, with its settings' limits and streams (and the exports
        it writes, if any); ``clock`` replaces the Redis server's (epoch seconds)."""
        return cls(bus, registry, store, streams=run_streams(settings), exports=exports,
                   heartbeat_ttl_s=settings.service_heartbeat_ttl_s,
                   held_grace_s=settings.held_version_grace_s, clock=clock,
                   retain_exports=settings.retain_exports,
                   retain_versions=settings.retain_versions,
                   retired_ttl_s=settings.retired_ttl_s,
                   dead_consumer_idle_ms=settings.dead_consumer_idle_ms,
                   actor=settings.consumer_name, metrics=metrics)

    def run(self) -> RetentionReport:
        """One pass: retire, prune, remove dead consumers and groups; returns what it did."""
        report = RetentionReport()
        now = self._now()
        live = [h for h in list_heartbeats(self.bus, self.registry.prefix,
                                           ttl_s=self.heartbeat_ttl_s, now=now) if h["up"]]
        held = held_versions(self.bus, self.registry.prefix, grace_s=self.grace_s, now=now)
        in_use = ({h["version"] for h in live if h["version"]}
                  | {v for versions in held.values() for v in versions})
        # an instance within its grace keeps its consumers and its own group too
        live += [{"service": m.split(":", 1)[0], "name": m.split(":", 1)[1]} for m in held]
        self._retire(self.registry.ages(), in_use, report)
        ages = self.registry.ages()
        self._prune(ages, in_use, report)
        self._prune_exports(self.registry.ages(), in_use, report)
        self._consumers({h["name"] for h in live},
                        {h["name"] for h in live if h["service"] == "sampler"}, report)
        counts = report.counts()
        if self.metrics is not None:
            for action, n in counts.items():
                self.metrics.retention_actions.labels(action=action).inc(n)
        if any(counts.values()):
            log.info("retention: %s", ", ".join(f"{n} {a}" for a, n in counts.items()))
        return report

    def _now(self) -> float:
        """The clock given, else the Redis server's: the one the registry's timestamps and
        the heartbeats come from."""
        if self.clock is not None:
            return self.clock()
        sec, usec = self.bus.call("retention time", self.bus.client.time)
        return sec + usec / 1e6

    def _retire(self, ages: list[VersionAge], in_use: set[str], report: RetentionReport) -> None:
        """``serving`` past the newest ``retain`` serving ones, and ``failed`` for the ttl
        (outside the newest ``retain`` versions), not in use -> ``retired``."""
        keep_serving = {a.version_id for a in [a for a in ages if a.state == "serving"]
                        [-self.retain:]}
        newest = {a.version_id for a in ages[-self.retain:]}
        now = self._now()
        for a in ages:
            if a.version_id in in_use:
                continue
            if a.state == "serving" and a.version_id not in keep_serving:
                why = (f"retention: no live sampler serves it and {self.retain} newer "
                       "versions serve")
            elif (a.state == "failed" and a.version_id not in newest
                  and now - a.since >= self.ttl_s):
                why = f"retention: failed for {now - a.since:.0f}s and not retried"
            else:
                continue
            try:
                self.registry.transition(a.version_id, "retired", actor=self.actor, reason=why)
            except StateTransitionError as e:  # moved meanwhile (say an operator's retry)
                log.info("retention leaves %s: %s", a.version_id, e)
                continue
            report.retired.append(a.version_id)

    def _prune(self, ages: list[VersionAge], in_use: set[str], report: RetentionReport) -> None:
        """``retired`` for the ttl and not in use: store directories first, then the record."""
        now = self._now()
        for a in ages:
            if a.state != "retired" or a.version_id in in_use or now - a.since < self.ttl_s:
                continue
            try:
                gone = self.store.discard(a.version_id)
                if self.exports is not None and discard_directory(
                        self.exports.path(a.version_id)):  # an export root outside the store
                    gone.append(self.exports.path(a.version_id))
            except OSError as e:  # the record stays, so the next pass tries again
                log.warning("retention could not delete the directories of %s: %s",
                            a.version_id, e)
                continue
            try:
                self.registry.prune(a.version_id)
            except StateTransitionError as e:  # cannot happen: retired is terminal
                log.warning("retention leaves the record of %s: %s", a.version_id, e)
                continue
            log.debug("pruned %s (%s)", a.version_id, ", ".join(map(str, gone)) or "no dirs")
            report.pruned.append(a.version_id)

    def _prune_exports(self, ages: list[VersionAge], in_use: set[str],
                       report: RetentionReport) -> None:
        """All but the newest ``retain_exports`` exports, never one served or still to load."""
        if self.exports is None:
            return
        on_the_way = {a.version_id for a in ages
                      if a.state in ("published", "converting", "converted", "loading")}
        try:
            report.exports_pruned += self.exports.prune(self.retain_exports,
                                                        protect=in_use | on_the_way)
        except OSError as e:  # the next pass tries again
            log.warning("retention could not prune exports under %s: %s", self.exports.dir, e)

    def _consumers(self, live_names: set[str], live_samplers: set[str],
                   report: RetentionReport) -> None:
        """Dead consumers out of every group of the run's streams; dead samplers' groups gone."""
        own_groups = {sampler_group(n) for n in live_samplers}
        for stream in self.streams:
            for g in self._xinfo(f"XINFO GROUPS {stream}",
                                 lambda s=stream: self.bus.client.xinfo_groups(s)):
                group = str(g["name"])
                names = [str(c["name"]) for c in self._xinfo(
                    f"XINFO CONSUMERS {stream} {group}",
                    lambda s=stream, gr=group: self.bus.client.xinfo_consumers(s, gr))]
                keep = [n for n in names if n in live_names or safe_id(n, "c") in live_names]
                per_instance = (group.startswith(SAMPLER_GROUP_PREFIX)
                                and group not in own_groups)
                args = [group, self.idle_ms, int(per_instance), *keep]
                destroyed, removed = self._xinfo(
                    f"retention {stream} {group}",
                    lambda s=stream, a=args: self._clean(keys=[s], args=a)) or (0, [])
                report.consumers_removed += [f"{stream}/{group}/{n}" for n in removed]
                if destroyed:
                    report.groups_destroyed.append(f"{stream}/{group}")

    def _xinfo(self, what: str, fn: Callable[[], Any]) -> list[Any]:
        """An ``XINFO`` (or cleaning script) reply; empty if its stream or group is gone
        (nothing to clean)."""
        def call() -> list[Any]:
            try:
                return list(fn())
            except redis.exceptions.ResponseError as e:
                if "no such key" in str(e).lower() or "nogroup" in str(e).lower():
                    return []
                raise
        return self.bus.call(what, call)
