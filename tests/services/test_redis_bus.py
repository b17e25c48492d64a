"""Pins the stream bus: ack semantics, reclaim after a consumer dies, claims kept while working, retries."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from alignclient.errors import BusUnavailableError
from alignclient.retry import RetryPolicy
from alignd.api.errors import status_for
from alignd.infra.bus import ClaimKeeper, RedisBus, connect
from alignd.infra.events import PublishedEvent
from alignd.infra.settings import DEFAULT_STREAM_MAXLEN

from .moved_time import age_pending, idle_ms, wait_until

S, G = "t:stream", "grp"


def bus_for(url: str, **kw) -> RedisBus:
    return RedisBus(connect(url), **kw)


def test_read_ack_and_pending(redis_url):
    """A read message stays pending until acked; a group is created once."""
    bus = bus_for(redis_url)
    assert bus.ensure_group(S, G) is True and bus.ensure_group(S, G) is False
    ev = PublishedEvent(version_id="v1", path="/p/v1")
    mid = bus.publish(S, ev.to_fields())
    [msg] = bus.read(S, G, "a", block_ms=100)
    assert (msg.id, msg.deliveries, msg.reclaimed) == (mid, 1, False)
    assert PublishedEvent.from_fields(msg.fields) == ev
    assert bus.read(S, G, "b", block_ms=50) == []  # one consumer per message
    assert bus.pending_count(S, G) == 1
    assert bus.ack(S, G, msg.id) == 1 and bus.ack(S, G, msg.id) == 0
    assert bus.pending_count(S, G) == 0


def test_reclaim_after_consumer_process_is_killed(redis_url):
    """A consumer SIGKILLed after reading leaves the message pending; a live one reclaims it
    once it is idle past min_idle_ms (its idle time set there, not waited for), with the
    delivery counted, and only then."""
    bus = bus_for(redis_url)
    bus.ensure_group(S, G)
    mid = bus.publish(S, {"version_id": "v1", "path": "/p"})
    code = (
        "import os, signal, redis\n"
        f"r = redis.Redis.from_url({redis_url!r})\n"
        f"r.xreadgroup({G!r}, 'doomed', {{{S!r}: '>'}}, count=1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == -9
    assert bus.pending_count(S, G) == 1
    assert bus.reclaim(S, G, "rescuer", min_idle_ms=60_000) == []  # not idle long enough
    age_pending(bus.client, S, G, mid, 60_000)
    [msg] = bus.reclaim(S, G, "rescuer", min_idle_ms=60_000)
    assert (msg.id, msg.reclaimed, msg.deliveries) == (mid, True, 2)
    assert msg.fields["version_id"] == "v1"
    bus.ack(S, G, msg.id)
    assert bus.pending_count(S, G) == 0


def test_claim_keeper_keeps_message_from_reclaim(redis_url):
    """A ClaimKeeper resets its message's idle time (set here to a minute, as if its consumer
    had been slow that long) before another consumer's reclaim sees it; touching someone
    else's message fails; once the keeper stops, the message idle past min_idle_ms is taken."""
    bus = bus_for(redis_url)
    bus.ensure_group(S, G)
    bus.publish(S, {"x": "1"})
    [msg] = bus.read(S, G, "worker", block_ms=100)
    with ClaimKeeper(bus, msg, G, "worker", period_s=0.05) as hb:
        age_pending(bus.client, S, G, msg.id, 60_000)
        wait_until(lambda: idle_ms(bus.client, S, G, msg.id) < 30_000, "the keeper's touch")
        assert bus.reclaim(S, G, "thief", min_idle_ms=30_000) == []
    assert not hb.lost
    assert bus.touch(S, G, "thief", msg.id) is False
    age_pending(bus.client, S, G, msg.id, 60_000)
    [stolen] = bus.reclaim(S, G, "thief", min_idle_ms=30_000)
    assert stolen.id == msg.id and bus.touch(S, G, "worker", msg.id) is False


def test_trimmed_pending_message_is_dropped(redis_url):
    """A pending entry whose message was deleted from the stream is acked by reclaim."""
    bus = bus_for(redis_url)
    bus.ensure_group(S, G)
    bus.publish(S, {"x": "1"})
    [msg] = bus.read(S, G, "a", block_ms=100)
    bus.client.xdel(S, msg.id)
    assert bus.reclaim(S, G, "b", min_idle_ms=0) == []
    assert bus.pending_count(S, G) == 0


def test_streams_are_capped_at_stream_maxlen(redis_url):
    """Every XADD trims (MAXLEN ~ N): 2,000 events through a bus capped at 200 leave at most
    2N entries, the newest kept, and a group still gets the events that come after."""
    n = 200
    bus = bus_for(redis_url, stream_maxlen=n)
    bus.ensure_group(S, G)
    ids = [bus.publish(S, {"n": str(i)}) for i in range(2_000)]
    length = bus.client.xlen(S)
    assert n <= length <= 2 * n
    assert bus.client.xrevrange(S, count=1)[0][0] == ids[-1]  # trimming takes the oldest
    assert bus.client.xrange(S, count=1)[0][0] != ids[0]
    got = bus.read(S, G, "a", count=5_000, block_ms=100)
    assert len(got) == length and got[-1].id == ids[-1]
    new = bus.publish(S, {"n": "new"})
    [msg] = bus.read(S, G, "a", block_ms=100)
    assert (msg.id, msg.fields) == (new, {"n": "new"})


def test_default_bus_caps_streams(redis_url):
    """A bus built without a cap still caps, at ALIGN_STREAM_MAXLEN's default; a cap below 1
    is refused."""
    assert bus_for(redis_url).stream_maxlen == DEFAULT_STREAM_MAXLEN
    with pytest.raises(ValueError, match="stream_maxlen"):
        bus_for(redis_url, stream_maxlen=0)


def test_group_recreated_after_redis_lost_it(redis_url):
    """XREADGROUP on a stream whose group vanished (Redis restarted empty) recreates it."""
    bus = bus_for(redis_url)
    bus.ensure_group(S, G)
    bus.client.flushall()
    assert bus.read(S, G, "a", block_ms=10) == []
    bus.publish(S, {"x": "1"})
    assert len(bus.read(S, G, "a", block_ms=100)) == 1


def test_calls_wait_for_redis_to_come_back(private_redis):
    """A publish while Redis is down retries with backoff and lands once it restarts."""
    retries: list[str] = []
    bus = bus_for(private_redis.url, retry=RetryPolicy(initial_s=0.02, max_s=0.1),
                  on_retry=lambda what, e: retries.append(what))
    bus.ensure_group(S, G)
    bus.publish(S, {"n": "0"})
    private_redis.stop()
    restarter = threading.Timer(0.6, private_redis.start)
    restarter.start()
    t0 = time.monotonic()
    bus.publish(S, {"n": "1"})
    restarter.join()
    assert time.monotonic() - t0 >= 0.5 and retries and retries[0].startswith("XADD")
    assert [m.fields["n"] for m in bus.read(S, G, "a", count=5, block_ms=100)] == ["0", "1"]


def test_gives_up_with_typed_error(private_redis):
    """With a retry budget, an unreachable Redis raises BusUnavailableError (503)."""
    bus = bus_for(private_redis.url, retry=RetryPolicy(initial_s=0.02, deadline_s=0.3))
    private_redis.stop()
    t0 = time.monotonic()
    with pytest.raises(BusUnavailableError) as ei:
        bus.publish(S, {"x": "1"})
    assert status_for(ei.value) == 503 and 0.3 <= time.monotonic() - t0 < 5


def test_stop_event_ends_retrying(private_redis):
    """A set stop event turns the next failed attempt into BusUnavailableError at once."""
    stop = threading.Event()
    bus = bus_for(private_redis.url, stop_event=stop)
    private_redis.stop()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(BusUnavailableError):
        bus.publish(S, {"x": "1"})
    assert stop.is_set()


def test_reclaim_limit_claims_only_what_it_returns(redis_url):
    """reclaim(limit=1) takes one abandoned message; the others stay with the dead consumer."""
    bus = bus_for(redis_url)
    bus.ensure_group(S, G)
    ids = [bus.publish(S, {"n": str(i)}) for i in range(3)]
    assert len(bus.read(S, G, "dead", count=3, block_ms=100)) == 3
    [first] = bus.reclaim(S, G, "live", min_idle_ms=0, limit=1)
    owners = {r["message_id"]: r["consumer"] for r in bus.client.xpending_range(S, G, "-", "+", 10)}
    assert first.id == ids[0] and owners == {ids[0]: "live", ids[1]: "dead", ids[2]: "dead"}
    assert [m.id for m in bus.reclaim(S, G, "live", min_idle_ms=0)] == ids
