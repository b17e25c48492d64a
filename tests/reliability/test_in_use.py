"""Retention and the versions samplers use, against a real redis-server and the real sampler.

"In use" is what a sampler holds: the version it serves, the one it is loading (named in
its heartbeat before it reads the bits) and, when its heartbeat lapsed without a clean stop,
what its last beat named, for ``held_version_grace_s`` after it. The clock of the retention
pass is injected, so a lapse of 13 s or of the whole grace takes no wall time. A sampler
never serves, or stores rollouts for, a version that is retired or pruned: it refuses with a
typed error.
"""

from __future__ import annotations

import json

import pytest
import redis
from alignclient.errors import StateTransitionError, VersionNotFoundError
from alignd.infra.liveness import ServiceHeartbeat, held_versions
from alignd.infra.retention import Retention
from alignd.infra.settings import ConverterSettings
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.work import (
    SAMPLER_GROUP,
    RolloutRequest,
    RolloutsReady,
    ready_stream,
    requests_stream,
)
from alignd.sampler.service import SamplerService
from pydantic import ValidationError

from tests.reliability.test_faults import Rig, model_weights, sampler_engine
from tests.reliability.test_retention import dirs_of

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

GRACE_S = 600.0
TTL_S = 10.0  # the heartbeat ttl of the rig's settings (the default)


def server_now(rig: Rig) -> float:
    sec, usec = rig.bus.client.time()
    return sec + usec / 1e6


def pass_at(rig: Rig, offset_s: float = 0.0, **kw) -> Retention:
    """The converter's pass, ``retain_versions`` 1, pruning at once, whose clock runs
    ``offset_s`` ahead of the Redis server's."""
    settings = rig.settings.model_copy(update={"retain_versions": 1, "retired_ttl_s": 0.0,
                                               "held_version_grace_s": GRACE_S, **kw})
    return Retention.from_settings(settings, rig.bus, rig.reg, rig.store,
                                   clock=lambda: server_now(rig) + offset_s)


def paused_sampler(rig: Rig, name: str = "s1") -> SamplerService:
    """A sampler service whose heartbeat beats only when the sampler or the test says so (no
    thread: a paused process), over the rig's run."""
    settings = rig.settings.model_copy(update={"sampler_name": name})
    rollouts = RolloutStore(redis.Redis.from_url(settings.redis_url), settings.key_prefix)
    svc = SamplerService(settings, sampler_engine(settings.store_dir), rig.bus, rollouts=rollouts)
    svc.heartbeat = ServiceHeartbeat(rig.bus, "sampler", name, 1.0, TTL_S,
                                     prefix=settings.key_prefix)
    return svc


def served_rig(redis_url, tmp_path, n: int = 2) -> tuple[Rig, list[str]]:
    """``n`` versions published and converted (v0 oldest)."""
    rig = Rig(redis_url, tmp_path)
    vids = [f"v{i}" for i in range(n)]
    for i, vid in enumerate(vids):
        rig.publish(vid, model_weights(i + 1))
    rig.convert(n)
    return rig, vids


def test_a_pass_during_a_load_keeps_the_version(redis_url, tmp_path):
    """Fault: a retention pass (``retain_versions`` 1, ``retired_ttl_s`` 0) ran while a
    sampler loaded an older serving version (a sync back to v0, v1 newest): the version was
    invisible to retention (named in the heartbeat only after the load), so it was retired
    and pruned and ``load()`` still returned True. Held: the sampler names v0 in its heartbeat
    before reading it; a pass before the engine reads the bits and another after it keep v0
    (and v1, still served) with record and directories; ``load()`` is True and v0 serves."""
    rig, (v0, v1) = served_rig(redis_url, tmp_path)
    svc = paused_sampler(rig)
    assert svc.load(v0) and svc.load(v1)
    svc.heartbeat.beat()
    real_load = svc.engine.load
    reports = []

    def load_with_passes(vid):
        reports.append(pass_at(rig).run())  # before the engine reads the bits
        out = real_load(vid)
        reports.append(pass_at(rig).run())  # after it read them
        return out

    svc.engine.load = load_with_passes
    assert svc.load(v0)
    assert [r.retired + r.pruned for r in reports] == [[], []]
    assert rig.reg.state(v0) == rig.reg.state(v1) == "serving"
    assert dirs_of(rig, v0)[:2] == ["published", "nvfp4"]
    assert svc.engine.version_id == v0
    assert held_versions(rig.bus, rig.settings.key_prefix, grace_s=GRACE_S) == {
        "sampler:s1": [v1, v0]}
    svc.heartbeat.stop()  # a clean stop: nothing is held, and v0 is not the newest
    report = pass_at(rig).run()
    assert report.retired == report.pruned == [v0]


def test_a_version_lost_during_a_load_is_not_served(redis_url, tmp_path):
    """Fault: a sampler without a heartbeat (nothing names what it loads) loads an old
    version while a pass retires and prunes it, once before the engine reads the bits (v0)
    and once right after (v1); before, ``load()`` returned True and the sampler served a
    version with no record and no directories. Held: both loads return False (v0: its bits
    are gone; v1: the record checked after the load is gone), the engine's copy of v1 is
    never served: requests for either are refused with VersionNotFoundError and no rollout
    is stored."""
    rig, (v0, v1, v2) = served_rig(redis_url, tmp_path, n=3)
    svc = paused_sampler(rig)
    svc.heartbeat = None
    assert svc.load(v0) and svc.load(v1) and svc.load(v2)
    real_load = svc.engine.load
    svc.engine.load = lambda vid: (pass_at(rig, retain_versions=2).run(), real_load(vid))[1]
    assert not svc.load(v0)  # pruned before the read: the store refuses it
    assert [r.version_id for r in rig.reg.list_versions()] == [v1, v2]
    svc.engine.load = lambda vid: (real_load(vid), pass_at(rig).run())[0]
    assert not svc.load(v1)  # read whole, then pruned: the check after the load refuses it
    assert [r.version_id for r in rig.reg.list_versions()] == [v2]
    assert svc.engine.version_id == v1  # the engine holds its bits, but they are not served
    for vid in (v0, v1):
        req = RolloutRequest(request_id=f"q-{vid}", version_id=vid, prompts="[[1, 2]]",
                             max_new_tokens=2)
        with pytest.raises(VersionNotFoundError):
            svc.serve_request(req)
        assert svc.rollouts.list_rollout_ids(vid) == []


def test_a_lapsed_heartbeat_keeps_its_version_within_the_grace(redis_url, tmp_path):
    """Fault: a sampler paused 13 s (heartbeat ttl 10 s) with ``retain_versions`` 1: its
    version was retired and, with ``retired_ttl_s`` 0, pruned while it still served it.
    Held (clock injected): 13 s and 599 s after its last beat its version a0 stays serving
    through passes while a1 and a2 serve newer; 601 s after, it is retired and pruned; a
    sampler that stopped cleanly holds nothing at once. A grace not above the heartbeat ttl
    is refused by the settings."""
    rig = Rig(redis_url, tmp_path)
    for vid in ("a0", "a1", "a2"):
        rig.reg.create(vid, str(rig.store.published_path(vid)))
        rig.store.published_path(vid).mkdir(parents=True)
        for s in ("converting", "converted", "loading", "serving"):
            rig.reg.transition(vid, s, actor="t")
    beat = ServiceHeartbeat(rig.bus, "sampler", "paused", 1.0, TTL_S)
    beat.set(version="a0")
    beat.beat()  # its last beat; then the process is paused
    other = ServiceHeartbeat(rig.bus, "sampler", "live", 1.0, TTL_S)
    other.set(version="a2")
    for lapse in (13.0, 599.0):
        other.beat()
        report = pass_at(rig, lapse).run()
        assert rig.reg.state("a0") == "serving", lapse
        assert report.retired == (["a1"] if lapse == 13.0 else []), lapse
    assert rig.reg.state("a2") == "serving"
    report = pass_at(rig, 601.0).run()
    assert report.retired == report.pruned == ["a0"]
    assert not rig.store.published_path("a0").exists()
    # a clean stop lets go at once
    beat.set(version="a2")
    beat.beat()
    other.stop()
    assert held_versions(rig.bus, "libalign", grace_s=GRACE_S) == {"sampler:paused": ["a2"]}
    beat.stop()
    assert held_versions(rig.bus, "libalign", grace_s=GRACE_S) == {}
    with pytest.raises(ValidationError, match="held_version_grace_s"):
        ConverterSettings(held_version_grace_s=10.0, service_heartbeat_ttl_s=10.0)


def test_a_sampler_refuses_a_retired_or_pruned_version_and_stores_nothing(redis_url, tmp_path):
    """Fault: a sampler paused past its grace resumed serving v0, which retention had retired
    and pruned meanwhile; it answered a rollout request for v0 and stored 4 rollouts that the
    API then 404s. Held: with v0 retired (kept, ``retired_ttl_s`` 1 h) the engine still
    holding v0 gets a request for it over the stream: the ready event says
    StateTransitionError (retired -> serving), no rollout is stored; once pruned,
    VersionNotFoundError, nothing stored; v1 retired while it generates: refused before
    storing, nothing stored."""
    rig, (v0, v1) = served_rig(redis_url, tmp_path)
    svc = paused_sampler(rig)
    assert svc.load(v0) and svc.load(v1) and svc.load(v0)  # a sync back to v0
    svc.heartbeat.beat()
    report = pass_at(rig, GRACE_S + 1, retired_ttl_s=3600.0).run()  # paused past the grace
    assert report.retired == [v0] and report.pruned == []
    assert svc.engine.version_id == v0
    reqs, ready = requests_stream(rig.settings.key_prefix), ready_stream(rig.settings.key_prefix)

    def ask(request_id: str, vid: str) -> RolloutsReady:
        """The sampler, resumed, takes one request for ``vid``; its ready event."""
        rig.bus.ensure_group(rig.settings.converted_stream, svc.group, start_id="$")
        rig.bus.ensure_group(reqs, SAMPLER_GROUP)
        req = RolloutRequest(request_id=request_id, version_id=vid, prompts="[[1, 2], [3]]",
                             samples_per_prompt=2, max_new_tokens=2, guidance_bits=1)
        rig.bus.publish(reqs, req.to_fields())
        assert svc.step(block_ms=100) == 1
        (_id, fields), = rig.bus.client.xrevrange(ready, count=1)
        return RolloutsReady.from_fields(fields)

    got = ask("q-retired", v0)
    assert got.error.startswith("StateTransitionError: weight version 'v0': retired -> serving")
    assert got.ids() == []
    assert svc.rollouts.list_rollout_ids(v0) == []
    assert svc.heartbeat.version == ""  # it names no version it may not serve
    assert pass_at(rig, GRACE_S + 1).run().pruned == [v0]
    got = ask("q-pruned", v0)
    assert got.error.startswith("VersionNotFoundError")
    assert svc.rollouts.list_rollout_ids(v0) == []
    # retired while it generates
    assert svc.load(v1)
    real_generate = svc.engine.generate

    def retired_meanwhile(*a, **kw):
        out = real_generate(*a, **kw)
        rig.reg.transition(v1, "retired", actor="test", reason="retired during generation")
        return out

    svc.engine.generate = retired_meanwhile
    with pytest.raises(StateTransitionError, match="retired -> serving"):
        svc.serve_request(RolloutRequest(request_id="q-mid", version_id=v1,
                                         prompts=json.dumps([[1, 2]]), max_new_tokens=2))
    assert svc.rollouts.list_rollout_ids(v1) == []
