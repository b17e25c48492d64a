"""Pins the embedded default: with ``redis_url=None`` the registry, the event bus and the
guidance store run on one in-process server, shared by every client of the process.

The guidance store's own scenarios (chunked round trips, replace, corruption, budget and
leases, refusal, TTL) run on the embedded server through the ``backend`` fixture of
``test_guidance_store.py``; here the store is made the way services make it, from
Settings.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
from alignclient.errors import GuidanceChecksumError, StateTransitionError, VersionExistsError
from alignd.infra.bus import ClaimKeeper, RedisBus, connect
from alignd.infra.redis_clients import (
    binary_client,
    embedded_server,
    is_embedded,
    reset_embedded,
    text_client,
)
from alignd.infra.registry import REENTRANT, STATES, TRANSITIONS, Registry
from alignd.infra.settings import AllInOneSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.telemetry import Metrics

from tests.services.moved_time import age_pending, idle_ms, wait_until
from tests.services.test_registry import drive

S, G = "t:stream", "grp"


@pytest.fixture
def cfg() -> Iterator[AllInOneSettings]:
    """Settings of the embedded default, on a fresh embedded server."""
    reset_embedded()
    yield AllInOneSettings(redis_url=None, key_prefix="t", guidance_chunk_bytes=1000,
                           guidance_budget_bytes=10_000, guidance_ttl_s=None)
    reset_embedded()


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# --- the clients ---------------------------------------------------------------------


def test_clients_share_one_server_per_process(cfg):
    """Text and binary clients made from the same settings see each other's writes; the
    server is created once even when many threads ask at the same moment; reset_embedded
    starts an empty one; connect(None) is the embedded server, not an error."""
    reset_embedded()
    barrier = threading.Barrier(8)
    seen: list[object] = []

    def ask() -> None:
        barrier.wait()
        seen.append(embedded_server())
    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in seen}) == 1 and seen[0] is embedded_server()

    text, binary = text_client(cfg), binary_client(cfg)
    assert is_embedded(text) and is_embedded(binary)
    text.set("k", "v\r\n\0é")
    assert binary.get("k") == "v\r\n\0é".encode() and connect(None).get("k") == "v\r\n\0é"
    reset_embedded()
    assert text_client(cfg).get("k") is None  # a new, empty server
    assert text.get("k") == "v\r\n\0é"  # old clients keep the old one


# --- the registry --------------------------------------------------------------------


def test_registry_lifecycle(cfg):
    """Create, every transition to serving, history with server times, failure reasons,
    duplicates and illegal moves, all through the registry's Lua scripts."""
    reg = Registry(RedisBus.from_settings(cfg), cfg.key_prefix)
    rec = reg.create("v1", "/p/v1", actor="learner", meta={"step": 3})
    assert (rec.state, rec.meta) == ("published", {"step": 3})
    for s in ("converting", "converted", "loading", "serving"):
        assert reg.transition("v1", s, actor="conv").state == s
    hist = reg.history("v1")
    assert [h.to_state for h in hist] == [
        "published", "converting", "converted", "loading", "serving"]
    assert [h.at for h in hist] == sorted(h.at for h in hist) and hist[0].at > 1.5e9
    with pytest.raises(VersionExistsError):
        reg.create("v1", "/other")
    with pytest.raises(StateTransitionError):
        reg.transition("v1", "failed", reason="too late")
    reg.create("v2", "/p/v2")
    reg.transition("v2", "converting", actor="c1")
    with pytest.raises(StateTransitionError, match="reclaim"):
        reg.transition("v2", "converting", actor="c2")
    reg.transition("v2", "converting", actor="c2", reclaim=True)
    with pytest.raises(StateTransitionError, match="owned by 'c2'"):
        reg.fail("v2", "boom", actor="c1", expect_owner="c1")
    assert reg.fail("v2", "boom", actor="c2", expect_owner="c2").reason == "boom"
    assert [r.version_id for r in reg.list_versions()] == ["v1", "v2"]
    assert [r.version_id for r in reg.list_versions(state="failed")] == ["v2"]


def test_registry_transition_table(cfg):
    """Exactly the moves in TRANSITIONS succeed, from every state to every state; the
    rest raise and leave state and history unchanged."""
    reg = Registry(RedisBus.from_settings(cfg), cfg.key_prefix)
    for source in STATES:
        for target in STATES:
            vid = f"{source}-{target}"
            drive(reg, vid, source)
            before = reg.history(vid)
            legal = target in TRANSITIONS[source] and not (source == target and
                                                           target in REENTRANT)
            reason = "why" if target == "failed" else ""
            if legal:
                assert reg.transition(vid, target, reason=reason).state == target
                assert len(reg.history(vid)) == len(before) + 1
            else:
                with pytest.raises(StateTransitionError):
                    reg.transition(vid, target, reason=reason)
                assert reg.state(vid) == source and reg.history(vid) == before


def test_registry_race_between_two_threads(cfg):
    """Two threads, each with its own client, race for published -> converting on 30
    versions: exactly one wins each, and the history records the winner only."""
    setup = Registry(RedisBus.from_settings(cfg), cfg.key_prefix)
    vids = [f"race{i}" for i in range(30)]
    for vid in vids:
        setup.create(vid, f"/p/{vid}")
    regs = [Registry(RedisBus.from_settings(cfg), cfg.key_prefix) for _ in range(2)]
    wins: dict[str, list[int]] = {vid: [] for vid in vids}
    barrier = threading.Barrier(2)

    def racer(i: int) -> None:
        for vid in vids:
            barrier.wait()
            try:
                regs[i].transition(vid, "converting", actor=f"c{i}")
                wins[vid].append(i)
            except StateTransitionError:
                pass
    threads = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for vid in vids:
        assert len(wins[vid]) == 1, (vid, wins[vid])
        hist = setup.history(vid)
        assert [h.to_state for h in hist] == ["published", "converting"]
        assert hist[-1].actor == f"c{wins[vid][0]}" == setup.get(vid).owner


# --- the bus -------------------------------------------------------------------------


def test_bus_publish_read_ack(cfg):
    """A read message stays pending until acked; each message goes to one consumer."""
    bus = RedisBus.from_settings(cfg)
    assert bus.ensure_group(S, G) is True and bus.ensure_group(S, G) is False
    mid = bus.publish(S, {"version_id": "v1", "path": "/p"})
    [msg] = bus.read(S, G, "a", block_ms=50)
    assert (msg.id, msg.fields, msg.deliveries) == (mid, {"version_id": "v1", "path": "/p"}, 1)
    assert bus.read(S, G, "b", block_ms=20) == []
    assert bus.pending_count(S, G) == 1
    assert bus.ack(S, G, mid) == 1 and bus.ack(S, G, mid) == 0
    assert bus.pending_count(S, G) == 0


def test_bus_blocking_read_wakes_on_publish(cfg):
    """A consumer blocked in XREADGROUP gets a message another client publishes at once,
    not after its block time."""
    reader, writer = RedisBus.from_settings(cfg), RedisBus.from_settings(cfg)
    reader.ensure_group(S, G)
    threading.Timer(0.1, lambda: writer.publish(S, {"n": "1"})).start()
    t0 = time.monotonic()
    [msg] = reader.read(S, G, "a", block_ms=5_000)
    assert msg.fields == {"n": "1"} and time.monotonic() - t0 < 2.0


def test_bus_reclaim_and_claim_keeper(cfg):
    """A message left by a consumer is reclaimed once idle past min_idle_ms (both messages'
    idle time set to a minute, not waited for), with its delivery counted; a ClaimKeeper
    resets a live consumer's message before the reclaim sees it; trimmed entries are
    dropped; a group lost with the data is recreated."""
    bus = RedisBus.from_settings(cfg)
    bus.ensure_group(S, G)
    ids = [bus.publish(S, {"n": str(i)}) for i in range(2)]
    dead, alive = bus.read(S, G, "dead", count=2, block_ms=50)
    with ClaimKeeper(bus, alive, G, "dead", period_s=0.03) as hb:
        for m in (dead, alive):
            age_pending(bus.client, S, G, m.id, 60_000)
        wait_until(lambda: idle_ms(bus.client, S, G, alive.id) < 30_000, "the keeper's touch")
        [got] = bus.reclaim(S, G, "rescuer", min_idle_ms=30_000)
    assert not hb.lost
    assert (got.id, got.reclaimed, got.deliveries) == (ids[0], True, 2)
    assert bus.touch(S, G, "dead", dead.id) is False  # it belongs to the rescuer now
    assert bus.touch(S, G, "rescuer", dead.id) is True
    bus.ack(S, G, got.id)
    bus.client.xdel(S, alive.id)
    assert bus.reclaim(S, G, "rescuer", min_idle_ms=0) == []  # trimmed: acked, not returned
    assert bus.pending_count(S, G) == 0
    bus.client.flushall()
    assert bus.read(S, G, "a", block_ms=10) == []  # NOGROUP -> recreated
    bus.publish(S, {"n": "2"})
    assert [m.fields for m in bus.read(S, G, "a", block_ms=50)] == [{"n": "2"}]


# --- the guidance store --------------------------------------------------------------


def test_guidance_store_from_settings(cfg):
    """GuidanceStore.from_settings on the embedded default takes the pipeline path and
    applies the guidance_* settings; records it writes are seen by another store of the
    process; corruption, eviction and metrics behave as on a real Redis."""
    m = Metrics()
    data = blob(4500, 1)
    with GuidanceStore.from_settings(cfg, metrics=m) as s:
        assert s.payload_path == "pipeline" and (s.chunk_bytes, s.budget_bytes) == (1000, 10_000)
        s.put_many("v1", {"r0": data, "r1": memoryview(data)[:10]})
        assert len(list(s.client.scan_iter(match="t:guidance:v:v1:c:r0:*"))) == 5
        with GuidanceStore.from_settings(cfg) as other:
            assert other.get_many("v1", ["r0", "r1"]) == {"r0": data, "r1": data[:10]}
        key = next(iter(s.client.scan_iter(match="t:guidance:v:v1:c:r0:*:4")))
        s.client.set(key, b"\1" * 500)
        with pytest.raises(GuidanceChecksumError, match="rollout 'r0', weight version 'v1'"):
            s.get("v1", "r0")
        s.acquire("v1", "learner-0", ttl_s=30)
        s.put("v2", "r", blob(3000))
        res = s.put("v3", "r", blob(5000))
        assert [e.version for e in res.evicted] == ["v2"]
        assert [v.version for v in s.versions()] == ["v1", "v3"]
        assert m.value("libalign_guidance_stored_bytes") == 9510
        assert m.value("libalign_guidance_put_bytes_total") == 12_510


def test_services_share_the_embedded_server(cfg):
    """The pieces of the one-process main job meet on one server: a version the learner
    registers and announces is seen by a converter's bus and registry, and the sampler's
    guidance for it by the learner's store."""
    learner_bus, converter_bus = RedisBus.from_settings(cfg), RedisBus.from_settings(cfg)
    learner, converter = (Registry(b, cfg.key_prefix) for b in (learner_bus, converter_bus))
    converter_bus.ensure_group(cfg.published_stream, cfg.converter_group)
    learner.create("v7", "/p/v7", actor="learner")
    learner_bus.publish(cfg.published_stream, {"version_id": "v7", "path": "/p/v7"})
    [msg] = converter_bus.read(cfg.published_stream, cfg.converter_group, "conv", block_ms=50)
    assert converter.transition(msg.fields["version_id"], "converting").state == "converting"
    converter_bus.ack(cfg.published_stream, cfg.converter_group, msg.id)
    assert learner.state("v7") == "converting"
    with GuidanceStore.from_settings(cfg) as sampler, GuidanceStore.from_settings(cfg) as reader:
        sampler.put("v7", "rollout-0", b"\x00\r\n\xff" * 100)
        assert reader.get("v7", "rollout-0") == b"\x00\r\n\xff" * 100
