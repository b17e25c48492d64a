"""Pins what the daemon requires of its Redis server (alignd.infra.redis_checks) and how the
guidance store tells eviction from expiry, against private redis-server processes.

* Start-up: a service (run_service) and the API (load_settings, and ``python -m alignd.api.main``
  as a process) refuse a server whose maxmemory-policy may evict (allkeys-lru, volatile-lru)
  with exit 2 and a message naming the policy and the fix ``maxmemory-policy noeviction``; the
  policy is read from INFO when an ACL refuses CONFIG; an unreadable policy is refused unless
  allowed (then warned and counted); an ACL user who may not run the daemon's commands is
  refused at start.
* Credentials: a wrong or missing password exits 2 naming the credentials, never the password;
  mid-run the bus does not retry refused credentials as a connection error.
* A full noeviction server: guidance puts, version publishes and rollout puts get "Redis is
  full" (StoreError), counted, and write nothing.
* Guidance: keys gone before the version's deadline are "lost" (tombstone, error, counter),
  keys gone with the injected clock past it "expired"; a record gone while its version stays
  is lost too; on a server evicting at run time no reader is told "expired".
* docker-compose.yml pins noeviction.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from alignclient.errors import (
    BusUnavailableError,
    ConfigError,
    GuidanceEvictedError,
    GuidanceNotFoundError,
    RedisFullError,
    StoreError,
)
from alignclient.models import Rollout
from alignclient.retry import RetryPolicy
from alignd.infra.bus import RedisBus
from alignd.infra.redis_checks import check_server
from alignd.infra.registry import Registry
from alignd.infra.service_main import load_settings, run_service
from alignd.infra.settings import ApiSettings, ConverterSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics

from tests.services.conftest import REDIS_SERVER, RedisServer
from tests.services.moved_time import FakeClock

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-7e1c93a05b2d48f6"
WRONG = "wrong-4d2a8c61f03b9e57"

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@pytest.fixture
def server(tmp_path) -> Iterator[RedisServer]:
    """A private, non-persistent redis-server this test may reconfigure (CONFIG SET, ACL)."""
    s = RedisServer(tmp_path / "redis")
    s.start()
    yield s
    s.stop()


@pytest.fixture
def admin(server) -> Iterator[redis.Redis]:
    """An administrator's client of ``server`` (the password once one is set)."""
    client = redis.Redis(port=server.port)
    yield client
    client.close()


@pytest.fixture
def service_env(monkeypatch) -> Iterator[None]:
    """No host ALIGN_* variable leaks in; the root log level run_service sets is restored."""
    for key in [k for k in os.environ if k.startswith("ALIGN_")]:
        monkeypatch.delenv(key)
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def refusals(reason: str) -> float:
    return Metrics().value("libalign_redis_refusals_total", {"reason": reason})


def url(server: RedisServer, user: str = "", password: str = "") -> str:
    cred = f"{user}:{password}@" if user or password else ""
    return f"redis://{cred}127.0.0.1:{server.port}/0"


def api_process(redis_url: str) -> subprocess.CompletedProcess:
    """``python -m alignd.api.main`` against ``redis_url``; it must end by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALIGN_")}
    env.update(ALIGN_REDIS_URL=redis_url, ALIGN_DEV_MODE="1", ALIGN_API_PORT="0",
               ALIGN_REDIS_RETRY_S="5")
    return subprocess.run([sys.executable, "-m", "alignd.api.main"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# --- the eviction policy at start-up ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_services_refuse_to_start_on_an_evicting_policy(server, admin, service_env,
                                                        monkeypatch, caplog, policy):
    """With maxmemory 2mb and an evicting policy, a service's run_service and the API's
    load_settings exit 2 before anything runs, logging the policy and the fix; the check
    itself raises ConfigError. noeviction passes."""
    admin.config_set("maxmemory", "2mb")
    admin.config_set("maxmemory-policy", policy)
    monkeypatch.setenv("ALIGN_REDIS_URL", server.url)
    ran = []
    with caplog.at_level(logging.ERROR):
        assert run_service(logging.getLogger("t"), ConverterSettings,
                           lambda s, stop: ran.append(s)) == 2
        assert load_settings(logging.getLogger("t"), ApiSettings) is None
    assert ran == []
    assert caplog.text.count(f"maxmemory-policy {policy!r}") == 2
    assert caplog.text.count("Set maxmemory-policy noeviction") == 2
    client = redis.Redis.from_url(server.url)
    with pytest.raises(ConfigError, match=f"maxmemory-policy '{policy}' \\(CONFIG GET"):
        check_server(client)
    admin.config_set("maxmemory-policy", "noeviction")
    assert check_server(client).policy == "noeviction"
    assert run_service(logging.getLogger("t"), ConverterSettings,
                       lambda s, stop: ran.append(s)) == 0 and len(ran) == 1
    assert admin.keys("*") == []  # the probe leaves nothing behind
    client.close()


def test_api_process_exits_2_on_an_evicting_policy(server, admin):
    """``python -m alignd.api.main`` on allkeys-lru: exit 2, the policy and the fix on stderr,
    no traceback."""
    admin.config_set("maxmemory-policy", "allkeys-lru")
    proc = api_process(server.url)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "configuration error" in proc.stderr and "'allkeys-lru'" in proc.stderr
    assert "maxmemory-policy noeviction" in proc.stderr and "Traceback" not in proc.stderr


def test_policy_from_info_when_config_is_refused_and_unreadable_only_if_allowed(
        server, admin, caplog):
    """An ACL user refused CONFIG gets the policy from INFO memory (and an evicting one is
    refused from there); refused both, the check refuses unless allowed, which warns and
    counts libalign_redis_policy_unverified_total."""
    admin.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "+@all", "-config")
    admin.execute_command("ACL", "SETUSER", "blind", "on", ">pw", "~*", "+@all", "-config",
                          "-info")
    noconfig = redis.Redis.from_url(url(server, "noconfig", "pw"))
    blind = redis.Redis.from_url(url(server, "blind", "pw"))
    assert check_server(noconfig).source == "INFO memory"
    admin.config_set("maxmemory-policy", "volatile-lru")
    with pytest.raises(ConfigError, match=r"'volatile-lru' \(INFO memory\).*TTLs"):
        check_server(noconfig)
    with pytest.raises(ConfigError, match=r"maxmemory-policy is unreadable.*"
                       r"ALIGN_REDIS_ALLOW_UNVERIFIED_POLICY"):
        check_server(blind)
    m = Metrics()
    before = m.value("libalign_redis_policy_unverified_total")
    with caplog.at_level(logging.WARNING):
        assert check_server(blind, allow_unverified=True).policy is None
    assert m.value("libalign_redis_policy_unverified_total") == before + 1
    assert "STARTING UNVERIFIED" in caplog.text
    noconfig.close()
    blind.close()


def test_a_user_who_may_not_run_the_daemons_commands_is_refused_at_start(server, admin):
    """An ACL user without XADD, or without the key prefix's keys, fails the probe with a
    ConfigError naming the permission problem, counted as noperm; nothing is left behind."""
    admin.execute_command("ACL", "SETUSER", "nostream", "on", ">pw", "~*", "+@all", "-xadd")
    admin.execute_command("ACL", "SETUSER", "otherkeys", "on", ">pw", "~other:*", "+@all")
    before = refusals("noperm")
    for user in ("nostream", "otherkeys"):
        client = redis.Redis.from_url(url(server, user, "pw"))
        with pytest.raises(ConfigError, match="may not run a command the daemon needs"):
            check_server(client, key_prefix="t")
        client.close()
    assert refusals("noperm") == before + 2
    assert [k for k in admin.keys("*") if admin.ttl(k) == -1] == []  # the probe's TTLs


# --- credentials -----------------------------------------------------------------------------


def test_wrong_or_missing_password_exits_2_without_the_password(server, admin, service_env,
                                                                monkeypatch, caplog):
    """A wrong password (process: ``python -m alignd.api.main``) and none at all (in-process
    run_service) exit 2 naming refused credentials; the password text appears nowhere."""
    admin.config_set("requirepass", PASSWORD)
    proc = api_process(url(server, password=WRONG))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "configuration error" in proc.stderr and "refused the credentials" in proc.stderr
    assert "with a password" in proc.stderr and "Traceback" not in proc.stderr
    for secret in (WRONG, PASSWORD):
        assert secret not in proc.stderr and secret not in proc.stdout
    assert "retrying" not in proc.stderr  # not taken for an unreachable server
    monkeypatch.setenv("ALIGN_REDIS_URL", server.url)
    with caplog.at_level(logging.ERROR):
        assert run_service(logging.getLogger("t"), ConverterSettings, lambda s, stop: 0) == 2
    assert "refused the credentials" in caplog.text and "without a password" in caplog.text
    assert PASSWORD not in caplog.text


def test_bus_does_not_retry_refused_credentials_mid_run(server, admin):
    """The password changes while a bus is connected and its connection drops: the next call
    raises ConfigError on its first attempt (no retry, counted as auth), where a connection
    error is retried until the deadline."""
    admin.config_set("requirepass", PASSWORD)
    admin = redis.Redis(port=server.port, password=PASSWORD)
    retried = []
    bus = RedisBus(redis.Redis.from_url(url(server, password=PASSWORD)),
                   retry=RetryPolicy(initial_s=0.05, max_s=0.1, deadline_s=1.0),
                   on_retry=lambda what, e: retried.append(e))
    assert bus.call("ping", bus.client.ping)
    admin.config_set("requirepass", WRONG)
    admin = redis.Redis(port=server.port, password=WRONG)
    admin.client_kill_filter(_type="normal", skipme=True)
    before = refusals("auth")
    with pytest.raises(ConfigError, match="refused the credentials"):
        bus.call("ping", bus.client.ping)
    assert retried == []
    assert refusals("auth") == before + 1
    server.stop()  # a real connection error is still retried, then given up
    with pytest.raises(BusUnavailableError, match="unreachable"):
        bus.call("ping", bus.client.ping)
    assert retried
    bus.client.close()
    admin.close()


# --- a full noeviction server ----------------------------------------------------------------


def test_a_full_redis_refuses_writes_typed_counted_and_whole(server, admin):
    """maxmemory below what Redis already uses, noeviction: a guidance put (both payload
    paths), a version publish and a rollout put raise StoreError 'Redis is full: OOM command
    not allowed', each counted as oom, and not one key is written; reads still work, and once
    memory is there again the same put succeeds."""
    store = GuidanceStore(server.url, prefix="t", ttl_s=3600.0)
    piped = GuidanceStore(server.url, prefix="t", ttl_s=3600.0, payload_path="pipeline")
    store.put("v0", "r0", b"kept")
    text = redis.Redis.from_url(server.url, decode_responses=True)
    registry = Registry(RedisBus(text), "t")
    rollouts = RolloutStore(redis.Redis.from_url(server.url), "t", ttl_s=3600.0)
    rollout = Rollout(rollout_id="r1", prompt_len=1, tokens=[1, 2], logprobs=[-0.5],
                      path="nvfp4_minite")
    keys = sorted(admin.keys("*"))
    admin.config_set("maxmemory", "1")
    before = refusals("oom")
    full = "Redis is full: OOM command not allowed"
    with pytest.raises(RedisFullError, match=full):
        store.put_many("v1", {"a": b"x" * 100_000, "b": b"y" * 10})
    with pytest.raises(RedisFullError, match=full):
        piped.put("v1", "a", b"x" * 1000)
    with pytest.raises(RedisFullError, match=full):
        registry.create_and_announce("v1", "/published/v1", "t:events:published",
                                     {"version_id": "v1"})
    with pytest.raises(RedisFullError, match=full):
        rollouts.put_rollouts("v1", [rollout])
    assert refusals("oom") == before + 4
    assert sorted(admin.keys("*")) == keys
    assert store.get("v0", "r0") == b"kept"
    admin.config_set("maxmemory", "0")
    assert store.put("v1", "a", b"x" * 1000).total_bytes == 1004
    for s in (store, piped):
        s.close()
    text.close()
    rollouts.client.close()


# --- guidance: eviction told from expiry -----------------------------------------------------


@pytest.fixture(params=["redis", "embedded"])
def guidance(request, tmp_path) -> Iterator[tuple[GuidanceStore, Metrics, FakeClock]]:
    """A guidance store (TTL one hour, the injected clock, metrics) on a real server or the
    embedded one."""
    if request.param == "redis":
        s = RedisServer(tmp_path / "redis")
        s.start()
        target, stop = s.url, s.stop
    else:
        import fakeredis

        target, stop = fakeredis.FakeRedis(), lambda: None
    m, clock = Metrics(), FakeClock()
    store = GuidanceStore(target, prefix="t", ttl_s=3600.0, metrics=m, clock=clock)
    yield store, m, clock
    store.close()
    stop()


def delete_behind_the_back(store: GuidanceStore, version: str) -> int:
    """Delete every key of ``version`` as Redis' eviction or expiry would; how many."""
    keys = list(store.client.scan_iter(match=f"{store.prefix}:v:{version}*"))
    return store.client.delete(*keys)


def vanished(m: Metrics, cause: str) -> float:
    return m.value("libalign_guidance_vanished_total", {"cause": cause})


def test_guidance_gone_before_its_deadline_is_lost_not_expired(guidance, caplog):
    """Keys of a version deleted behind the store's back 13 s after the put (deadline one
    hour away): the reader gets GuidanceEvictedError saying 'lost' and naming the deadline,
    never 'expired'; vanished{cause=lost} counts it once, an error is logged."""
    store, m, clock = guidance
    store.put("v1", "r", b"record")
    clock.now += 13
    assert delete_behind_the_back(store, "v1") >= 3
    with caplog.at_level(logging.ERROR), \
            pytest.raises(GuidanceEvictedError, match=r"was lost .*before its deadline") as e:
        store.get("v1", "r")
    assert "expired" not in str(e.value) and "maxmemory-policy" in str(e.value)
    assert (vanished(m, "lost"), vanished(m, "expired")) == (1, 0)
    assert "version 'v1' is lost" in caplog.text
    with pytest.raises(GuidanceEvictedError, match="was lost"):  # the tombstone stays
        store.get("v1", "r")
    assert vanished(m, "lost") == 1 and store.total_bytes() == 0


def test_guidance_gone_past_its_deadline_is_expired(guidance):
    """The same keys gone with the injected clock past the deadline: 'expired: its TTL of
    3600 s', counted as expired, not lost."""
    store, m, clock = guidance
    store.put("v1", "r", b"record")
    clock.now += 3600.5
    delete_behind_the_back(store, "v1")
    with pytest.raises(GuidanceEvictedError, match=r"expired at .*expired: its TTL of 3600 s"):
        store.get("v1", "r")
    assert (vanished(m, "lost"), vanished(m, "expired")) == (0, 1)


def test_a_record_gone_while_its_version_stays_is_lost(guidance):
    """A record's meta key, or one of its chunks, deleted while its version is stored: the
    read says 'lost' (not 'unknown rollout', not 'replaced while being read'), counted in
    lost_records; get_many(missing='skip') skips it but still counts it."""
    store, m, _clock = guidance
    store.put_many("v1", {"a": b"a" * 10, "b": b"b" * 10, "c": b"c" * 10})
    store.client.delete(store.keys.rollout("v1", "a"))
    gen = store.client.hget(store.keys.rollout("v1", "b"), "gen").decode()
    store.client.delete(store.keys.chunk("v1", "b", gen, 0))
    with pytest.raises(GuidanceEvictedError, match="lost: its meta key is gone"):
        store.get("v1", "a")
    with pytest.raises(GuidanceEvictedError, match="lost: chunks of its record are gone"):
        store.get("v1", "b")
    assert store.get_many("v1", ["a", "c"], missing="skip") == {"c": b"c" * 10}
    assert m.value("libalign_guidance_lost_records_total") == 3
    with pytest.raises(GuidanceNotFoundError) as e:  # never put: unknown, not lost
        store.get("v1", "zz")
    assert type(e.value) is GuidanceNotFoundError


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru"])
def test_no_reader_is_told_expired_when_redis_evicts_at_run_time(server, admin, policy):
    """The policy switched to an evicting one after start, maxmemory 1 MB above what Redis
    uses: 60 versions of 64 KB. Every record a read misses raises a GuidanceNotFoundError and
    none says 'expired'; under volatile-lru, which spares the index and the deadlines (no TTL),
    the vanished versions are counted as lost (the numbers go to RELIABILITY.md)."""
    m = Metrics()
    store = GuidanceStore(server.url, prefix="t", ttl_s=86_400.0, metrics=m)
    admin.config_set("maxmemory", admin.info("memory")["used_memory"] + (1 << 20))
    admin.config_set("maxmemory-policy", policy)
    puts, full = 0, 0
    for i in range(60):
        try:
            store.put(f"v{i}", "r", bytes([i]) * (64 << 10))
            puts += 1
        except StoreError:
            full += 1  # allkeys-lru never refuses; volatile-lru once nothing volatile is left
    told: dict[str, int] = {"readable": 0, "lost": 0, "expired": 0, "other": 0}
    for i in range(60):
        try:
            assert store.get(f"v{i}", "r") == bytes([i]) * (64 << 10)
            told["readable"] += 1
        except GuidanceNotFoundError as e:
            word = next((w for w in ("lost", "expired") if w in str(e)), "other")
            told[word] += 1
    print(f"{policy}: {puts} puts, {full} refused full, told {told}, vanished "
          f"lost={vanished(m, 'lost')} expired={vanished(m, 'expired')}, lost records="
          f"{m.value('libalign_guidance_lost_records_total')}")
    assert told["expired"] == 0 and vanished(m, "expired") == 0
    assert told["readable"] < 60  # 3.8 MB never fit in 1 MB
    if policy == "volatile-lru":  # the index and deadlines carry no TTL: they stay to tell
        assert vanished(m, "lost") >= 1 and vanished(m, "unknown") == 0
    store.close()


def test_compose_pins_noeviction():
    """docker-compose.yml starts Redis with --maxmemory-policy noeviction."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    cmd = compose["services"]["redis"]["command"]
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
