"""Pins the version registry: every legal and illegal transition, history, races, fencing."""

from __future__ import annotations

import threading

import pytest
from alignclient.errors import (
    ConfigError,
    InputError,
    StateTransitionError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignclient.models import VERSION_STATES
from alignd.api.errors import status_for
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import (
    MAX_TOMBSTONES,
    REENTRANT,
    STATES,
    TRANSITIONS,
    Registry,
    VersionAge,
    VersionState,
)

# A legal path from 'published' to each state.
PATH_TO = {
    "published": [],
    "converting": ["converting"],
    "converted": ["converting", "converted"],
    "loading": ["converting", "converted", "loading"],
    "serving": ["converting", "converted", "loading", "serving"],
    "failed": ["failed"],
    "retired": ["converting", "converted", "loading", "serving", "retired"],
}


def make_registry(url: str, prefix: str = "t") -> Registry:
    return Registry(RedisBus(connect(url)), prefix)


def drive(reg: Registry, vid: str, state: str) -> None:
    """Create ``vid`` and walk it to ``state`` along legal moves."""
    reg.create(vid, f"/published/{vid}", actor="learner")
    for s in PATH_TO[state]:
        reg.transition(vid, s, actor="c1", reason="boom" if s == "failed" else "")


def test_lifecycle_records_history(redis_url):
    """published -> ... -> serving: each step in the history with from, to, actor and server time."""
    reg = make_registry(redis_url)
    rec = reg.create("v1", "/p/v1", actor="learner", meta={"step": 7})
    assert (rec.state, rec.path, rec.meta) == ("published", "/p/v1", {"step": 7})
    for s in PATH_TO["serving"]:
        assert reg.transition("v1", s, actor="conv-a").state == s
    hist = reg.history("v1")
    assert [(h.from_state, h.to_state) for h in hist] == [
        ("", "published"), ("published", "converting"), ("converting", "converted"),
        ("converted", "loading"), ("loading", "serving")]
    assert hist[0].actor == "learner" and all(h.actor == "conv-a" for h in hist[1:])
    times = [h.at for h in hist]
    assert times == sorted(times) and times[0] > 1.5e9
    assert reg.get("v1").updated_at == times[-1]
    assert [r.version_id for r in reg.list_versions(state="serving")] == ["v1"]


@pytest.mark.parametrize("source", STATES)
@pytest.mark.parametrize("target", STATES)
def test_transition_table(redis_url, source, target):
    """Exactly the moves in TRANSITIONS succeed; the rest raise and change nothing."""
    reg = make_registry(redis_url)
    drive(reg, "v", source)
    before = reg.history("v")
    legal = target in TRANSITIONS[source] and not (source == target and target in REENTRANT)
    reason = "why" if target == "failed" else ""
    if legal:
        assert reg.transition("v", target, actor="x", reason=reason).state == target
        assert len(reg.history("v")) == len(before) + 1
    else:
        with pytest.raises(StateTransitionError) as ei:
            reg.transition("v", target, actor="x", reason=reason)
        assert ei.value.code == "illegal_transition" and status_for(ei.value) == 409
        assert (ei.value.current, ei.value.target) == (source, target)
        assert reg.state("v") == source and reg.history("v") == before


def test_reentering_converting_needs_reclaim(redis_url):
    """converting -> converting only for a reclaimed message; the new owner is recorded."""
    reg = make_registry(redis_url)
    drive(reg, "v", "converting")
    with pytest.raises(StateTransitionError, match="reclaim"):
        reg.transition("v", "converting", actor="c2")
    rec = reg.transition("v", "converting", actor="c2", reclaim=True)
    assert rec.state == "converting" and rec.owner == "c2"
    assert reg.history("v")[-1].from_state == reg.history("v")[-1].to_state == "converting"


def test_failed_keeps_reason(redis_url):
    """failed needs a reason and the record and history keep it."""
    reg = make_registry(redis_url)
    drive(reg, "v", "converting")
    with pytest.raises(InputError):
        reg.transition("v", "failed")
    rec = reg.fail("v", "non_finite: tensor 'x.weight'", actor="c1")
    assert rec.state == "failed" and rec.reason == "non_finite: tensor 'x.weight'"
    assert reg.history("v")[-1].reason == rec.reason


def test_unknown_and_duplicate_versions(redis_url):
    """Unknown ids raise VersionNotFoundError (404); creating twice VersionExistsError (409)."""
    reg = make_registry(redis_url)
    for call in (lambda: reg.get("nope"), lambda: reg.history("nope"),
                 lambda: reg.transition("nope", "converting")):
        with pytest.raises(VersionNotFoundError) as ei:
            call()
        assert status_for(ei.value) == 404
    reg.create("v", "/p")
    with pytest.raises(VersionExistsError) as ei:
        reg.create("v", "/other")
    assert status_for(ei.value) == 409 and reg.get("v").path == "/p"
    with pytest.raises(InputError):
        reg.create("../escape", "/p")
    with pytest.raises(InputError):
        reg.transition("v", "deleted")


def test_owner_fence(redis_url):
    """expect_owner refuses a move when another consumer took the version over."""
    reg = make_registry(redis_url)
    drive(reg, "v", "converting")  # owner c1
    reg.transition("v", "converting", actor="c2", reclaim=True)
    with pytest.raises(StateTransitionError, match="owned by 'c2'"):
        reg.transition("v", "converted", actor="c1", expect_owner="c1")
    assert reg.transition("v", "converted", actor="c2", expect_owner="c2").state == "converted"


def test_retried_transition_is_idempotent(redis_url):
    """A transition re-sent with its token after a lost reply succeeds instead of X -> X."""
    reg = make_registry(redis_url)
    drive(reg, "v", "converting")
    keys = [reg._key("v"), reg._history_key("v")]
    args = ["converted", "tok-1", "", "c1", "converting", ""]
    assert reg._transition(keys=keys, args=args)[0] == "ok"
    assert reg._transition(keys=keys, args=args)[0] == "ok"  # the retry
    assert reg._transition(keys=keys, args=[*args[:1], "tok-2", *args[2:]])[0] == "illegal"
    assert [h.to_state for h in reg.history("v")].count("converted") == 1


@pytest.mark.parametrize("source,target", [("published", "converting"), ("converted", "loading")])
def test_race_for_one_transition_has_one_winner(redis_url, source, target):
    """Eight clients race for the same move on each of 15 versions: exactly one wins each."""
    setup = make_registry(redis_url)
    vids = [f"race{i}" for i in range(15)]
    for vid in vids:
        drive(setup, vid, source)
    regs = [make_registry(redis_url) for _ in range(8)]
    wins: dict[str, list[int]] = {vid: [] for vid in vids}
    losses: dict[str, int] = dict.fromkeys(vids, 0)
    lock = threading.Lock()

    def racer(i: int) -> None:
        for vid in vids:
            barrier.wait()
            try:
                regs[i].transition(vid, target, actor=f"c{i}")
                with lock:
                    wins[vid].append(i)
            except StateTransitionError:
                with lock:
                    losses[vid] += 1

    barrier = threading.Barrier(len(regs))
    threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(regs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for vid in vids:
        assert len(wins[vid]) == 1 and losses[vid] == len(regs) - 1, (vid, wins[vid])
        hist = setup.history(vid)
        assert [h.to_state for h in hist].count(target) == 1
        assert hist[-1].actor == f"c{wins[vid][0]}" == setup.get(vid).owner


def test_retry_and_announce_is_one_transaction(redis_url):
    """failed -> published and its event together; nothing when the stream is broken, the
    version is not failed (409) or unknown (404); the record's reason is cleared, the history
    keeps it."""
    reg = make_registry(redis_url)
    drive(reg, "v", "failed")
    raw = reg.bus.client
    raw.set("broken", "not a stream")
    with pytest.raises(ConfigError, match="not a stream"):
        reg.retry_and_announce("v", "broken", {"version_id": "v"}, actor="op")
    assert reg.state("v") == "failed" and reg.get("v").reason == "boom"
    rec, event_id = reg.retry_and_announce("v", "events", {"version_id": "v"}, actor="op",
                                           reason="retried")
    assert (rec.state, rec.reason, rec.owner) == ("published", "", "op")
    assert raw.xrange("events") == [(event_id, {"version_id": "v"})]
    assert [(h.from_state, h.to_state, h.reason) for h in reg.history("v")[-2:]] == [
        ("published", "failed", "boom"), ("failed", "published", "retried")]
    with pytest.raises(StateTransitionError, match="only a failed version") as ei:
        reg.retry_and_announce("v", "events", {"version_id": "v"})
    assert status_for(ei.value) == 409 and ei.value.current == "published"
    with pytest.raises(VersionNotFoundError):
        reg.retry_and_announce("nope", "events", {"version_id": "nope"})
    assert len(raw.xrange("events")) == 1


def test_publish_and_retry_trim_the_stream(redis_url):
    """The XADDs inside the publish and retry transactions carry the bus's cap: 1,000
    versions announced on a bus capped at 100 leave at most 200 events, the newest last."""
    reg = Registry(RedisBus(connect(redis_url), stream_maxlen=100), "t")
    last = ""
    for i in range(1_000):
        _, last = reg.create_and_announce(f"v{i}", f"/p/v{i}", "events", {"version_id": f"v{i}"})
    assert 100 <= reg.bus.client.xlen("events") <= 200
    reg.fail("v0", "boom")
    _, retried = reg.retry_and_announce("v0", "events", {"version_id": "v0"})
    assert reg.bus.client.xlen("events") <= 200
    assert [e[0] for e in reg.bus.client.xrevrange("events", count=2)] == [retried, last]


def test_pages_walk_the_index_newest_first(redis_url):
    """``page`` gives the newest ``limit`` versions oldest first and a cursor; following the
    cursors visits every version once, in order; ``state`` filters across chunks; a missing
    record or an unreadable one is skipped (also by ``recent_states``), an unknown cursor is
    not found."""
    reg = make_registry(redis_url)
    vids = [f"v{i:03d}" for i in range(23)]
    for vid in vids:
        reg.create(vid, f"/p/{vid}")
    for vid in vids[::3]:
        reg.fail(vid, "boom")
    first = reg.page(5)
    assert [r.version_id for r in first.records] == vids[-5:] and first.next_before == vids[-5]
    seen, cursor = [], None
    while True:
        page = reg.page(5, before=cursor)
        seen = [r.version_id for r in page.records] + seen
        cursor = page.next_before
        if cursor is None:
            break
    assert seen == vids
    failed = reg.page(4, state="failed")
    assert [r.version_id for r in failed.records] == vids[::3][-4:]
    rest = reg.page(4, state="failed", before=failed.next_before)
    assert [r.version_id for r in rest.records] == vids[::3][:-4] and rest.next_before is None
    assert reg.list_versions(limit=3) == reg.page(3).records
    assert [r.version_id for r in reg.list_versions()] == vids and reg.count() == 23
    reg.bus.client.delete("t:version:v022")
    reg.bus.client.hset("t:version:v021", "state", "molten")
    assert [r.version_id for r in reg.page(2).records] == ["v019", "v020"]
    assert reg.recent_states(5) == [VersionState("v018", "failed"),
                                    VersionState("v019", "published"),
                                    VersionState("v020", "published")]
    with pytest.raises(VersionNotFoundError, match="cursor"):
        reg.page(2, before="nope")
    with pytest.raises(InputError, match="limit"):
        reg.page(0)


def test_retired_is_the_one_terminal_state(redis_url):
    """``serving -> retired`` and ``failed -> retired`` are legal and recorded with their
    reason; nothing leaves ``retired`` (not even an operator's retry); the contract lists the
    same states as the registry."""
    assert set(VERSION_STATES) == set(STATES) and "retired" in STATES
    assert TRANSITIONS["retired"] == frozenset()
    assert [s for s in STATES if "retired" in TRANSITIONS[s]] == ["serving", "failed"]
    reg = make_registry(redis_url)
    drive(reg, "s", "serving")
    drive(reg, "f", "failed")
    for vid in ("s", "f"):
        rec = reg.transition(vid, "retired", actor="janitor", reason="retention: old")
        assert rec.state == "retired" and rec.owner == "janitor"
        last = reg.history(vid)[-1]
        assert (last.to_state, last.reason, last.actor) == ("retired", "retention: old", "janitor")
        for target in STATES:
            with pytest.raises(StateTransitionError):
                reg.transition(vid, target, actor="x", reason="why")
    with pytest.raises(StateTransitionError, match="only a failed version"):
        reg.retry_and_announce("f", "events", {"version_id": "f"})
    for source in ("published", "converting", "converted", "loading"):
        drive(reg, f"in-{source}", source)
        with pytest.raises(StateTransitionError):
            reg.transition(f"in-{source}", "retired", actor="x")
    assert reg.get("in-loading").state == "loading"


def test_prune_deletes_a_retired_record_and_keeps_its_cursor(redis_url):
    """``prune`` deletes only a retired version's record, history and index entry (one
    script; again is a no-op); ``ages`` reports state and time of the last change; a page
    cursor naming a pruned version still leads to the versions created before it."""
    reg = make_registry(redis_url)
    vids = [f"v{i:02d}" for i in range(12)]
    for vid in vids:
        drive(reg, vid, "serving")
    ages = reg.ages()
    assert [a.version_id for a in ages] == vids and all(a.state == "serving" for a in ages)
    assert ages[-1] == VersionAge("v11", "serving", reg.get("v11").updated_at)
    with pytest.raises(StateTransitionError, match="only a retired version"):
        reg.prune("v05")
    page = reg.page(4, before="v08")
    assert [r.version_id for r in page.records] == vids[4:8] and page.next_before == "v04"
    for vid in ("v04", "v05", "v06", "v08"):
        reg.transition(vid, "retired", actor="janitor", reason="old")
        assert reg.prune(vid) is True
        assert reg.prune(vid) is False  # idempotent
        with pytest.raises(VersionNotFoundError):
            reg.get(vid)
        with pytest.raises(VersionNotFoundError):
            reg.history(vid)
    left = [v for v in vids if v not in ("v04", "v05", "v06", "v08")]
    assert [r.version_id for r in reg.list_versions()] == left and reg.count() == len(left)
    assert [a.version_id for a in reg.ages()] == left
    # cursors that were pruned: the page continues just before them
    assert [r.version_id for r in reg.page(4, before="v08").records] == ["v01", "v02", "v03", "v07"]
    older = reg.page(2, before="v04")
    assert [r.version_id for r in older.records] == ["v02", "v03"] and older.next_before == "v02"
    seen, cursor = [], "v06"
    while cursor is not None:
        page = reg.page(1, before=cursor)
        seen = [r.version_id for r in page.records] + seen
        cursor = page.next_before
    assert seen == ["v00", "v01", "v02", "v03"]
    with pytest.raises(VersionNotFoundError, match="cursor"):
        reg.page(2, before="never-was")
    # an index entry whose record is gone (a pass that died half-way) is cleaned too
    reg.bus.client.delete("t:version:v09")
    assert reg.prune("v09") is True and "v09" not in [a.version_id for a in reg.ages()]
    assert reg.bus.client.zcard("t:versions:pruned") == 5 <= MAX_TOMBSTONES
