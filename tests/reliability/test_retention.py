"""Retention against a real redis-server: what a run keeps of its history, and what it lets go.

Versions are published, converted by the real converter and served one after another by a real
sampler service; the retention pass (:mod:`alignd.infra.retention`) then retires and prunes
what no live sampler serves beyond the newest ``retain_versions``, with the store directories,
and never a version a live sampler's heartbeat names. Page cursors outlive the versions they
name. Samplers restarted under new names (the default, host and pid) used to leave a group
and a consumer behind per restart; after passes only the live one's remain. A pass that dies
between a version's directories and its record is finished by the next.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import redis
from alignclient.errors import VersionNotFoundError
from alignd.api.app import create_app
from alignd.converter.main import run_converter
from alignd.infra.events import ConvertedEvent, sampler_group
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.registry import Registry
from alignd.infra.retention import Retention, run_streams
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from alignd.infra.work import SAMPLER_GROUP, RolloutRequest
from alignd.sampler.service import SamplerService

from tests.reliability.test_faults import Rig, model_weights, sampler_engine, wait_for
from tests.services.api_server import TOKEN, api_settings, serve
from tests.services.moved_time import age_pending

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VERSIONS = 30
KEEP = 3
SERVED_OLD = 10  # the version a live sampler goes back to serving


def retention(rig: Rig, metrics: Metrics | None = None, **kw) -> Retention:
    """The converter's pass over the rig's run, ``retain_versions`` KEEP and no wait."""
    settings = rig.settings.model_copy(update={"retain_versions": KEEP, "retired_ttl_s": 0.0,
                                               **kw})
    return Retention.from_settings(settings, rig.bus, rig.reg, rig.store, metrics)


def dirs_of(rig: Rig, vid: str) -> list[str]:
    """Which of a version's store directories exist."""
    paths = {"published": rig.store.published_path(vid), "nvfp4": rig.store.version_path(vid),
             "export": rig.store.exports_root / "modelopt" / vid}
    return [k for k, p in paths.items() if p.is_dir()]


def sampler(rig: Rig, name: str, **kw) -> SamplerService:
    """A sampler service of the rig's run under ``name``, with its heartbeat beating; it
    takes over no abandoned request by itself (the test says when)."""
    settings = rig.settings.model_copy(update={"sampler_name": name, "claim_idle_ms": 600_000,
                                               **kw})
    rollouts = RolloutStore(redis.Redis.from_url(settings.redis_url), settings.key_prefix)
    svc = SamplerService(settings, sampler_engine(settings.store_dir), rig.bus, rollouts=rollouts)
    svc.heartbeat = ServiceHeartbeat(rig.bus, "sampler", name, 0.1, 5.0,
                                     prefix=settings.key_prefix).start()
    return svc


def test_thirty_served_versions_keep_the_newest_three_and_the_one_in_use(redis_url, tmp_path):
    """Fault: 30 versions published, converted and served one after another stayed ``serving``
    with all their directories forever. Held: with ``retain_versions`` 3 and ``retired_ttl_s``
    0 one pass keeps exactly the newest 3 and the old one a live sampler went back to (its
    heartbeat names it): records, index entries and published/nvfp4/export directories; the
    other 26 are retired (a history entry with the reason, counted) and pruned from the
    registry, the index and the disk. Page cursors naming pruned versions still lead on
    (registry and ``GET /v1/versions?before=``). Once that sampler stops, the next pass
    retires and prunes the old one too."""
    rig = Rig(redis_url, tmp_path)
    vids = [f"r{i:02d}" for i in range(VERSIONS)]
    for i, vid in enumerate(vids):
        rig.publish(vid, model_weights(i + 1))
    rig.convert(VERSIONS)
    svc = sampler(rig, "s1")
    try:
        for vid in vids:
            assert svc.load(vid)
        assert svc.load(vids[SERVED_OLD])  # a sync back to an old version
        for vid in vids[::7]:  # an SGLang sampler's exports of some versions
            (rig.store.exports_root / "modelopt" / vid).mkdir(parents=True)
        wait_for(lambda: rig.bus.client.hget("libalign:heartbeat:sampler:s1", "version")
                 == vids[SERVED_OLD], "the heartbeat to name the old version", timeout=10)
        assert {rig.reg.state(v) for v in vids} == {"serving"}
        assert all(dirs_of(rig, v)[:2] == ["published", "nvfp4"] for v in vids)
        cursors = [rig.reg.page(5, before=v).next_before for v in (vids[25], vids[12])]
        metrics = Metrics()
        pass1 = retention(rig, metrics)
        report = pass1.run()
        kept = [vids[SERVED_OLD], *vids[-KEEP:]]
        gone = [v for v in vids if v not in kept]
        assert sorted(report.retired) == sorted(report.pruned) == gone
        assert [r.version_id for r in rig.reg.list_versions()] == kept
        assert rig.reg.count() == len(kept) == 4
        assert {rig.reg.state(v) for v in kept} == {"serving"}
        for vid in gone:
            with pytest.raises(VersionNotFoundError):
                rig.reg.get(vid)
            assert dirs_of(rig, vid) == [], vid
        assert all(dirs_of(rig, v)[:2] == ["published", "nvfp4"] for v in kept)
        assert sorted(rig.store.list_versions()) == sorted(kept)
        assert sorted(p.name for p in rig.store.published_root.iterdir()) == sorted(kept)
        for action in ("retired", "pruned"):
            assert metrics.registry.get_sample_value("libalign_retention_actions_total",
                                                     {"action": action}) == 26
        # cursors of pruned versions: the next page starts just before them
        assert cursors == [vids[20], vids[7]]
        assert [r.version_id for r in rig.reg.page(5, before=vids[20]).records] == [vids[10]]
        assert [r.version_id for r in rig.reg.page(5, before=vids[7]).records] == []
        app = create_app(api_settings(redis_url, rig.settings.store_dir))
        with serve(app) as url, httpx.Client(base_url=url, timeout=30,
                                             headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            r = http.get(f"/v1/versions?limit=2&before={vids[28]}")
            assert r.status_code == 200, r.text
            assert [v["version_id"] for v in r.json()["versions"]] == [vids[SERVED_OLD], vids[27]]
            r = http.get(f"/v1/versions?limit=2&before={vids[20]}")
            assert r.status_code == 200, r.text
            assert [v["version_id"] for v in r.json()["versions"]] == [vids[SERVED_OLD]]
            assert http.get("/v1/versions?limit=2&before=never-was").status_code == 404
        again = pass1.run()  # a second pass finds nothing to do
        assert again.counts() == dict.fromkeys(again.counts(), 0)
    finally:
        svc.heartbeat.stop()  # the sampler stops: its version is in use no more
    report = retention(rig).run()
    assert report.retired == report.pruned == [vids[SERVED_OLD]]
    assert [r.version_id for r in rig.reg.list_versions()] == vids[-KEEP:]
    assert dirs_of(rig, vids[SERVED_OLD]) == []


def test_a_live_sampler_keeps_its_version_through_many_passes(redis_url, tmp_path):
    """Held: a version a live sampler's heartbeat names is never retired, over 20 passes
    while 6 newer versions serve (walked through the registry); a stopped sampler protects
    nothing. Failed versions go only once failed for ``retired_ttl_s`` and outside the newest
    ``retain_versions``; work in flight (published .. loading) is never touched."""
    rig = Rig(redis_url, tmp_path)
    serving = ["a0", "a1", "a2", "a3", "a4", "a5", "a6"]
    for vid in serving:
        rig.reg.create(vid, str(rig.store.published_path(vid)))
        rig.store.published_path(vid).mkdir(parents=True)
        for s in ("converting", "converted", "loading", "serving"):
            rig.reg.transition(vid, s, actor="t")
    for vid, states in {"p": [], "c": ["converting"], "d": ["converting", "converted"],
                        "l": ["converting", "converted", "loading"]}.items():
        rig.reg.create(vid, "/x")
        for s in states:
            rig.reg.transition(vid, s, actor="t")
    beat = ServiceHeartbeat(rig.bus, "sampler", "old-one", 0.1, 5.0).start()
    beat.set(version="a0")
    beat.beat()
    try:
        for _ in range(20):
            retention(rig, retired_ttl_s=3600.0).run()
            assert rig.reg.state("a0") == "serving"
        # with a ttl of an hour the retired ones keep their records and directories
        assert [rig.reg.state(v) for v in serving] == ["serving"] + ["retired"] * 3 + [
            "serving"] * 3
        assert all(rig.store.published_path(v).is_dir() for v in serving)
        assert [rig.reg.state(v) for v in "pcdl"] == ["published", "converting", "converted",
                                                     "loading"]
        hist = rig.reg.history("a1")[-1]
        assert hist.to_state == "retired" and hist.reason.startswith("retention: no live sampler")
    finally:
        beat.stop()
    report = retention(rig).run()
    assert sorted(report.pruned) == ["a0", "a1", "a2", "a3"]
    assert [r.version_id for r in rig.reg.list_versions()] == ["a4", "a5", "a6", *"pcdl"]
    # failed: kept among the newest 3 or within the ttl; pruned afterwards
    for vid in ("f-old", "f-new"):
        rig.reg.create(vid, "/x")
        rig.reg.fail(vid, "boom")
    for vid in ("n1", "n2", "n3"):
        rig.reg.create(vid, "/x")
    assert retention(rig, retired_ttl_s=3600.0).run().retired == []
    assert retention(rig, retain_versions=4).run().pruned == ["f-old"]  # f-new is 4th newest
    assert rig.reg.state("f-new") == "failed"
    assert retention(rig).run().pruned == ["f-new"]


def consumers(rig: Rig, stream: str, group: str) -> list[str]:
    return sorted(c["name"] for c in rig.bus.client.xinfo_consumers(stream, group))


def groups(rig: Rig, stream: str) -> list[str]:
    return sorted(g["name"] for g in rig.bus.client.xinfo_groups(stream))


def test_restarted_samplers_leave_no_growing_groups_or_consumers(redis_url, tmp_path):
    """Fault: every sampler restart under a new name (the default: host and pid) left its own
    group on the converted stream and a consumer in the shared ``samplers`` group behind: 10
    restarts, 10 of each. Held: a pass whose idle threshold (a minute) nobody has passed yet
    removes nothing; one whose threshold everyone has passed (0 ms: the idle time is the
    server's, so it is not waited for) leaves only the live sampler's, kept by its
    heartbeat, and with such a pass after each of 10 more restarts the counts stay at 1; a
    dead consumer that still holds a pending request stays until a live sampler reclaimed
    it; the converter's group and the shared group are never destroyed; another prefix's
    groups are not touched."""
    rig = Rig(redis_url, tmp_path)
    conv, reqs = rig.settings.converted_stream, f"{rig.settings.key_prefix}:events:rollout_requests"
    assert conv in run_streams(rig.settings) and reqs in run_streams(rig.settings)
    rig.bus.ensure_group(rig.settings.published_stream, rig.settings.converter_group)
    other = "otherrun:events:converted"
    rig.bus.ensure_group(other, sampler_group("gone"))
    pass_ = retention(rig, dead_consumer_idle_ms=0)  # everyone idle past it: only heartbeats keep

    def restart(i: int) -> SamplerService:
        """Sampler ``i`` starts, is told of a converted version and serves one request (Redis
        makes a consumer at its first delivery)."""
        svc = sampler(rig, f"host-{1000 + i}")
        svc.setup()
        rig.bus.publish(conv, ConvertedEvent(version_id=f"c{i}", path="/x", preset="minite",
                                             tensors=1, stored_bytes=1).to_fields())
        rig.bus.publish(reqs, RolloutRequest(request_id=f"q{i}", version_id=f"c{i}",
                                             prompts="[[1, 2]]", max_new_tokens=1).to_fields())
        assert svc.step(block_ms=100) == 2
        return svc

    live = None
    for i in range(10):
        if live is not None:
            live.heartbeat.stop()
        live = restart(i)
    assert len(groups(rig, conv)) == 10 and len(consumers(rig, reqs, SAMPLER_GROUP)) == 10
    early = retention(rig, dead_consumer_idle_ms=60_000).run()
    assert (early.consumers_removed, early.groups_destroyed) == ([], [])
    report = pass_.run()
    assert len(report.groups_destroyed) == 9 and len(report.consumers_removed) == 9 + 9
    assert groups(rig, conv) == [sampler_group(live.name)]
    assert consumers(rig, reqs, SAMPLER_GROUP) == [live.name]
    # a dead sampler that took a request and never answered it
    req = RolloutRequest(request_id="held", version_id="a0", prompts="[[1]]", max_new_tokens=1)
    rig.bus.publish(reqs, req.to_fields())
    [held_msg] = rig.bus.read(reqs, SAMPLER_GROUP, live.name, count=1, block_ms=10)
    held_id = held_msg.id
    holder = live.name
    for i in range(10, 20):
        live.heartbeat.stop()
        live = restart(i) if i != 10 else sampler(rig, f"host-{1000 + i}")
        if i == 10:  # this one only joins: it has not read the request stream yet
            live.setup()
        pass_.run()
        assert groups(rig, conv) == [sampler_group(live.name)], i
        names = consumers(rig, reqs, SAMPLER_GROUP)
        if i < 15:
            assert holder in names and len(names) <= 2, (i, names)
        if i == 14:  # a live sampler takes the request over and answers it
            age_pending(rig.bus.client, reqs, SAMPLER_GROUP, held_id, 60_000)  # its holder's silence
            taken = rig.bus.reclaim(reqs, SAMPLER_GROUP, live.name, min_idle_ms=30_000)
            assert [m.fields["request_id"] for m in taken] == ["held"]
            rig.bus.ack(reqs, SAMPLER_GROUP, taken[0].id)
        if i > 15:
            assert names == [live.name], (i, names)
    live.heartbeat.stop()
    assert groups(rig, rig.settings.published_stream) == [rig.settings.converter_group]
    assert groups(rig, reqs) == [SAMPLER_GROUP]
    assert groups(rig, other) == [sampler_group("gone")]


def test_a_pass_that_died_between_directories_and_record_is_finished(redis_url, tmp_path,
                                                                     monkeypatch):
    """Fault: the pass dies after it deleted a retired version's directories and before its
    record (here the record's delete raises). Recovered: the record stays ``retired`` with
    its directories gone; the converter logs the failed pass and goes on; the next pass
    deletes the record, and every other prunable version, without error."""
    rig = Rig(redis_url, tmp_path, retain_versions=1, retired_ttl_s=0.0,
              retention_interval_s=0.2)
    vids = ["k0", "k1", "k2", "k3"]
    for vid in vids:
        rig.reg.create(vid, "/x")
        rig.store.published_path(vid).mkdir(parents=True)
        rig.store.version_path(vid).mkdir(parents=True)
        for s in ("converting", "converted", "loading", "serving"):
            rig.reg.transition(vid, s, actor="t")
    real_prune = Registry.prune
    calls: list[str] = []

    def dies_once(self, version_id):
        calls.append(version_id)
        if len(calls) == 1:
            raise OSError("killed between the directories and the record")
        return real_prune(self, version_id)

    monkeypatch.setattr(Registry, "prune", dies_once)
    with pytest.raises(OSError, match="killed"):
        retention(rig, retain_versions=1).run()
    assert rig.reg.state("k0") == "retired" and dirs_of(rig, "k0") == []
    assert [rig.reg.state(v) for v in vids] == ["retired"] * 3 + ["serving"]
    assert dirs_of(rig, "k1") == ["published", "nvfp4"]
    # the converter's timer runs the next pass
    stop = threading.Event()
    thread = threading.Thread(target=run_converter, args=(rig.settings, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: rig.reg.count() == 1, "the next pass to finish the pruning", timeout=30)
    finally:
        stop.set()
        thread.join(10)
    assert [r.version_id for r in rig.reg.list_versions()] == ["k3"]
    assert all(dirs_of(rig, v) == [] for v in vids[:3]) and dirs_of(rig, "k3")[:1] == ["published"]
    assert calls[:2] == ["k0", "k0"]
