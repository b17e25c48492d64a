"""One sampler: its engine plus the Redis plumbing around it (the loop is :mod:`alignd.sampler.main`).

Three inputs, polled in turn:

* **converted** versions (``settings.converted_stream``, a consumer group of this sampler's
  own, ``sampler-<name>``, so every sampler sees every version): load it;
* **sync** requests (:func:`alignd.infra.events.sync_stream`, read by every sampler): load
  the named version if it is not the one served;
* **rollout requests** (:func:`alignd.infra.work.requests_stream` of the key prefix, the
  shared group ``samplers``: one sampler of the run per request): generate with the served
  version (loading the requested one first if needed), store rollouts (with their routing
  records when the request asks, for routing replay) and guidance records,
  announce them on :func:`alignd.infra.work.ready_stream`, acknowledge.

Every stream is the key prefix's own, so a sampler never takes another run's work.

A sampler serves only versions the registry lets it serve (``converted``, ``loading`` or
``serving``): the retention pass (:mod:`alignd.infra.retention`) may retire and prune a
version nobody holds. So the sampler names a version in its heartbeat (``loading``) *before*
it reads its bits, and checks the record again after the load, before it generates and
before it stores rollouts: a version retired or pruned meanwhile is refused with a typed
error (:class:`~alignclient.errors.StateTransitionError` naming its state, or
:class:`~alignclient.errors.VersionNotFoundError` once pruned), and nothing is stored for it.

Loading moves the registry's version ``converted -> loading -> serving`` (the first sampler to
get there does; later ones just load) and, when the store's bits fail verification or do not
fit the sampler's path, ``-> failed`` with the reason; the engine keeps serving what it had.
On start the sampler loads the newest version that is converted or beyond and can be served
(newest first, past any number that cannot); one it left ``loading`` when it was killed
mid-load (same sampler name) it loads and moves on to ``serving``. Handlers are idempotent:
a repeated converted or sync event of the version served changes nothing, and a repeated
rollout request whose rollouts are stored is answered again with them (rollouts are
write-once).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

from alignclient.errors import (
    AlignError,
    EventError,
    StateTransitionError,
    VersionNotFoundError,
)
from pydantic import ValidationError

from alignd.infra.bus import ClaimKeeper, Message, RedisBus
from alignd.infra.events import ConvertedEvent, sampler_group, sync_stream
from alignd.infra.registry import Registry, VersionRecord
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.rollouts import Rollout, routing_wire
from alignd.infra.telemetry import Metrics
from alignd.infra.work import (
    SAMPLER_GROUP,
    RolloutRequest,
    RolloutsReady,
    ready_stream,
    requests_stream,
)
from alignd.sampler.engine import RecordsRouting, SamplerEngine

log = logging.getLogger("alignd.sampler")


LOADABLE = ("converted", "loading", "serving")


class SamplerService:
    """One sampler: an engine plus the Redis plumbing around it."""

    def __init__(self, settings: SamplerSettings, engine: SamplerEngine, bus: RedisBus, *,
                 rollouts, guidance=None, metrics: Metrics | None = None,
                 stop: threading.Event | None = None):
        self.settings = settings
        self.engine = engine
        self.bus = bus
        self.registry = Registry(bus, settings.key_prefix)
        self.rollouts = rollouts
        self.guidance = guidance
        self.metrics = metrics if metrics is not None else Metrics()
        self.name = settings.sampler_name
        self.group = sampler_group(self.name)
        self._sync_last = "$"
        self.sync_stream = sync_stream(settings.key_prefix)
        self.requests_stream = requests_stream(settings.key_prefix)
        self.ready_stream = ready_stream(settings.key_prefix)
        self.load_seconds: dict[str, float] = {}
        self.heartbeat = None  # a ServiceHeartbeat when run as a service
        self.stop = stop if stop is not None else threading.Event()
        self._next_claim = 0.0

    # --- loading ------------------------------------------------------------------------

    def servable(self, version_id: str) -> VersionRecord:
        """The record of ``version_id`` if the registry lets it be served; otherwise a typed
        refusal: VersionNotFoundError (pruned, or never registered), StateTransitionError
        naming its state (retired, failed, not converted yet)."""
        rec = self.registry.get(version_id)
        if rec.state not in LOADABLE:
            raise StateTransitionError(version_id, rec.state, "serving",
                                       f"sampler {self.name} serves only "
                                       f"{', '.join(LOADABLE)} versions")
        return rec

    def load(self, version_id: str) -> bool:
        """Load ``version_id`` through the registry's states; False if it cannot be served.

        The heartbeat names the version as being loaded before its bits are read, and the
        record is read again after the load: a version retired or pruned meanwhile is not
        served (False), whatever the engine holds now.
        """
        rec = self.registry.get(version_id)
        if rec.state not in LOADABLE:
            log.info("version %s is %s; not loadable", version_id, rec.state)
            if self.engine.version_id == version_id and self.heartbeat is not None:
                self.heartbeat.set(version="")  # the engine's copy is served no more
            return False
        if self.engine.version_id == version_id:
            return True
        # a version left ``loading`` under this sampler's name is one a predecessor of ours
        # (the same sampler, killed mid-load) started: finish its move to ``serving``
        mine = rec.state == "loading" and rec.owner == self.name
        if rec.state == "converted":
            try:
                self.registry.transition(version_id, "loading", actor=self.name)
                mine = True
            except StateTransitionError:
                pass  # another sampler is loading it; load our copy anyway
        self._hold(version_id)
        t0 = time.perf_counter()
        try:
            self.engine.load(version_id)
        except AlignError as e:  # the version's fault (bad bits, wrong recipe) or the engine's
            log.error("version %s cannot be loaded: %s", version_id, e)
            self.metrics.sampler_loads.labels(outcome="refused").inc()
            if mine:
                with contextlib.suppress(StateTransitionError):
                    self.registry.fail(version_id, f"{e.code}: {e}", actor=self.name)
            return False
        finally:
            if self.heartbeat is not None:
                self.heartbeat.set(state="running", loading="")
        try:  # retired (or pruned) while it loaded: the engine's copy is not served
            self.servable(version_id)
        except (StateTransitionError, VersionNotFoundError) as e:
            log.error("version %s was loaded but is not servable any more: %s", version_id, e)
            self.metrics.sampler_loads.labels(outcome="refused").inc()
            if self.heartbeat is not None:
                self.heartbeat.set(version="")
            return False
        self.load_seconds[version_id] = time.perf_counter() - t0
        self.metrics.sampler_loads.labels(outcome="loaded").inc()
        self.metrics.sampler_load_seconds.observe(self.load_seconds[version_id])
        if self.heartbeat is not None:
            self.heartbeat.set(version=version_id)
        if mine:
            try:
                self.registry.transition(version_id, "serving", actor=self.name,
                                         expect_owner=self.name)
            except StateTransitionError as e:
                log.warning("version %s: %s", version_id, e)
        log.info("serving %s (loaded in %.2fs)", version_id, self.load_seconds[version_id])
        return True

    def _hold(self, version_id: str) -> None:
        """Name ``version_id`` in the heartbeat as being loaded, now (one beat), so a retention
        pass from here on keeps it; a beat that fails is logged (the check after the load
        still refuses a version retired meanwhile)."""
        if self.heartbeat is None:
            return
        self.heartbeat.set(state="loading", loading=version_id)
        try:
            self.heartbeat.beat()
        except Exception as e:  # Redis briefly down: the registry read after the load decides
            log.warning("heartbeat naming %s as loading not written: %s", version_id, e)

    def for_me(self, target_path: str | None) -> bool:
        """Whether a version converted for ``target_path`` (None: the default preset) fits this
        sampler's path; samplers of other paths may share the streams."""
        return target_path is None or target_path == self.engine.path

    def load_latest(self) -> str | None:
        """Load the newest servable version (on start) that is converted or beyond and fits
        this sampler: newest first, falling back past every one that cannot be served
        (corrupt, missing from the store, foreign), however deep, down to the oldest the
        registry lists. None if none can be served."""
        recs = [r for r in self.registry.list_versions() if r.state in LOADABLE
                and self.for_me(r.meta.get("target_path"))]
        for rec in sorted(recs, key=lambda r: r.created_at, reverse=True):
            if self.load(rec.version_id):
                return rec.version_id
        return None

    # --- rollouts -------------------------------------------------------------------------

    def serve_request(self, req: RolloutRequest) -> RolloutsReady:
        """Generate and store the rollouts of one request; the ready event says what happened."""
        t0 = time.perf_counter()
        base = dict(request_id=req.request_id, version_id=req.version_id, sampler=self.name)
        if not self.load(req.version_id):  # pruned: VersionNotFoundError
            self.servable(req.version_id)  # retired or failed: the typed refusal
            return RolloutsReady(**base, error=f"version {req.version_id!r} cannot be served "
                                 f"by this sampler (state {self.registry.state(req.version_id)})")
        prompts = [p for p in req.prompt_list() for _ in range(req.samples_per_prompt)]
        bits = req.guidance_bits or None
        ids = [f"{req.request_id}-{i:05d}" for i in range(len(prompts))]
        if self._stored_already(req.version_id, ids):  # a repeated request: announce again
            log.info("rollout request %s was served before; its rollouts are stored",
                     req.request_id)
            return RolloutsReady(**base, rollout_ids=json.dumps(ids), guidance=bits is not None,
                                 seconds=time.perf_counter() - t0)
        if req.routing and not (isinstance(self.engine, RecordsRouting)
                                and self.engine.records_routing):
            return RolloutsReady(**base, error=f"sampler engine {type(self.engine).__name__} "
                                 "cannot record routing (routing replay needs the embedded "
                                 "engine, or SGLang servers of an MoE model)")
        extra = {"routing": True} if req.routing else {}  # only engines that record routing
        gen = self.engine.generate(prompts, max_new_tokens=req.max_new_tokens,
                                   temperature=req.temperature, seed=req.seed, guidance_bits=bits,
                                   **extra)
        route = getattr(gen, "routing", None) or {}
        items = [Rollout(rollout_id=rid, prompt_len=p, tokens=s, logprobs=lp,
                         path=self.engine.path, guidance=bits is not None,
                         routing=routing_wire(route[i]) if i in route else None)
                 for i, (rid, s, p, lp) in enumerate(zip(ids, gen.sequences, gen.prompt_lens,
                                                         gen.logprobs, strict=True))]
        self.servable(req.version_id)  # retired while it generated: nothing is stored
        if bits is not None and self.guidance is not None:
            self.guidance.put_many(req.version_id, {ids[i]: rec.encode()
                                                    for i, rec in gen.guidance.items()})
        self.rollouts.put_rollouts(req.version_id, items)
        return RolloutsReady(**base, rollout_ids=json.dumps(ids), guidance=bits is not None,
                             seconds=time.perf_counter() - t0)

    def _stored_already(self, version_id: str, ids: list[str]) -> bool:
        """Whether every rollout of ``ids`` is stored for the version (rollouts are write-once)."""
        try:
            return len(self.rollouts.get_rollouts(version_id, ids)) == len(ids)
        except AlignError:  # RolloutNotFoundError: not (all) stored yet
            return False

    # --- the loop -------------------------------------------------------------------------

    def setup(self) -> None:
        """Consumer groups, then the newest loadable version."""
        self.bus.ensure_group(self.settings.converted_stream, self.group, start_id="$")
        self.bus.ensure_group(self.requests_stream, SAMPLER_GROUP)
        self.load_latest()

    def step(self, block_ms: int = 100) -> int:
        """Poll each input once; returns how many messages were handled. Once ``stop`` is
        set no new work is taken (a message read and not handled stays pending: another
        sampler reclaims it)."""
        handled = 0
        for m in self.bus.read(self.settings.converted_stream, self.group, self.name, count=8,
                               block_ms=1):
            try:
                ev = ConvertedEvent.from_fields(m.fields)
                if self.for_me(ev.target_path):
                    self.load(ev.version_id)
            except (EventError, AlignError) as e:
                log.error("converted event %s: %s", m.id, e)
            self.bus.ack(m.stream, self.group, m.id)
            handled += 1
            if self.stop.is_set():
                return handled
        handled += self._sync()
        if self.stop.is_set():
            return handled
        msgs = []
        now = time.monotonic()
        if now >= self._next_claim:  # requests a dead sampler took and never answered
            msgs = self.bus.reclaim(self.requests_stream, SAMPLER_GROUP, self.name,
                                    min_idle_ms=self.settings.claim_idle_ms, limit=1)
            self._next_claim = now if msgs else now + self.settings.claim_idle_ms / 2000
        if not msgs:
            msgs = self.bus.read(self.requests_stream, SAMPLER_GROUP, self.name, count=1, block_ms=block_ms)
        for m in msgs:
            self._request(m)
            handled += 1
        return handled

    def _sync(self) -> int:
        got = self.bus.call("read sync", lambda: self.bus.client.xread(
            {self.sync_stream: self._sync_last}, count=16, block=None))
        n = 0
        for _stream, entries in got or []:
            for mid, fields in entries:
                self._sync_last = mid
                n += 1
                vid = fields.get("version_id")
                if vid:
                    try:
                        self.load(vid)
                    except AlignError as e:
                        log.error("sync to %s: %s", vid, e)
        if self._sync_last == "$":  # pin the position so later entries are not missed
            last = self.bus.call("sync tail", lambda: self.bus.client.xrevrange(self.sync_stream,
                                                                                count=1))
            self._sync_last = last[0][0] if last else "0-0"
        return n

    def _request(self, m: Message) -> None:
        try:
            req = RolloutRequest.from_fields(m.fields)
        except EventError as e:
            log.error("rollout request %s dropped: %s", m.id, e)
            self.bus.ack(m.stream, SAMPLER_GROUP, m.id)
            return
        try:
            # refresh the message while generating, so a slow request is not taken for abandoned
            with ClaimKeeper(self.bus, m, SAMPLER_GROUP, self.name,
                           self.settings.heartbeat_ms / 1000):
                ready = self.serve_request(req)
        except (AlignError, ValidationError) as e:
            ready = RolloutsReady(request_id=req.request_id, version_id=req.version_id,
                                  sampler=self.name, error=f"{type(e).__name__}: {e}")
        self.metrics.sampler_requests.labels(outcome="error" if ready.error else "served").inc()
        self.bus.publish(self.ready_stream, ready.to_fields())
        self.bus.ack(m.stream, SAMPLER_GROUP, m.id)
