"""Pins service heartbeats: server-time beats, expiry, stopped vs gone, listing."""

from __future__ import annotations

import pytest
import redis
from alignclient.errors import InputError
from alignd.infra.liveness import ServiceHeartbeat, list_heartbeats

from .moved_time import expire_now, wait_until


def test_beats_report_state_version_and_info(redis_url):
    """A running instance is up with its version and info; stop() reports it stopped (down)."""
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    hb = ServiceHeartbeat(c, "sampler", "s-1", period_s=0.05, ttl_s=1.0, prefix="t",
                          info=lambda: {"version": "v3", "tokens_per_s": 12.5})
    with hb:
        wait_until(lambda: hb.beats >= 2, "two beats")  # the first at once, then every period
        (row,) = list_heartbeats(c, "t", ttl_s=1.0)
        assert row["service"] == "sampler" and row["name"] == "s-1" and row["up"]
        assert row["version"] == "v3" and row["info"] == {"tokens_per_s": 12.5}
        assert row["state"] == "running" and row["age_s"] <= 1.0
        assert 0 < c.pttl("t:heartbeat:sampler:s-1") <= 1000
    (row,) = list_heartbeats(redis.Redis.from_url(redis_url), "t")  # a bytes client works too
    assert row["state"] == "stopped" and not row["up"]


def test_a_dead_instance_expires_and_stays_listed_as_gone(redis_url):
    """A beat sets the hash's TTL to ttl_s; once no beat renewed it (the expiry done here at
    once), the index still lists the instance, down and gone, aged from its last beat."""
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    hb = ServiceHeartbeat(c, "converter", "c-1", period_s=1.0, ttl_s=30.0, prefix="t")
    hb.beat()  # one beat, then the "process" dies
    assert list_heartbeats(c, "t")[0]["up"]
    key = "t:heartbeat:converter:c-1"
    assert 0 < c.pttl(key) <= 30_000
    at = float(c.hget(key, "at"))
    assert expire_now(c, key) == 1
    (row,) = list_heartbeats(c, "t", now=at + 31.0)
    assert not row["up"] and row["state"] == "gone" and row["age_s"] == 31.0


def test_names_and_periods_are_checked(redis_url):
    """Unknown services, unsafe names and a period not below the ttl are refused."""
    c = redis.Redis.from_url(redis_url)
    with pytest.raises(InputError):
        ServiceHeartbeat(c, "database", "x")
    with pytest.raises(InputError):
        ServiceHeartbeat(c, "api", "a:b")
    with pytest.raises(InputError):
        ServiceHeartbeat(c, "api", "a", period_s=5, ttl_s=5)
