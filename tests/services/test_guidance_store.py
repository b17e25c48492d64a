"""Pins the guidance store: bit-exact round trips, atomic replace, typed misses, budget
eviction order and leases, TTL reconciliation, and no partial record after Redis or the
writer dies mid-put.

The tests that take ``backend`` run three times: on a real redis-server through the
socket path, on the same server through the pipeline path, and on the embedded
in-process server (which picks the pipeline path by itself). The crash and restart tests
need a real server and run on it only."""

from __future__ import annotations

import logging
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from alignclient.errors import (
    BusUnavailableError,
    ConfigError,
    GuidanceBudgetError,
    GuidanceChecksumError,
    GuidanceEvictedError,
    GuidanceNotFoundError,
    InputError,
    PayloadTooLargeError,
    StoreError,
)
from alignclient.retry import RetryPolicy
from alignd.api.errors import status_for
from alignd.infra.redis_clients import binary_client, reset_embedded
from alignd.infra.settings import GuidanceStoreSettings
from alignd.infra.stores import guidance as guidance_store
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.telemetry import Metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from .moved_time import FakeClock, expire_now

REPO = Path(__file__).resolve().parents[2]


def store_for(url: str | redis.Redis, **kw) -> GuidanceStore:
    kw.setdefault("prefix", "t")
    return GuidanceStore(url, **kw)


BACKENDS = ("redis", "redis-pipeline", "embedded")


@pytest.fixture(params=BACKENDS)
def backend(request) -> Iterator[Callable[..., GuidanceStore]]:
    """Makes stores (``backend(**kw)``) on one of BACKENDS, empty at the start of the test."""
    if request.param != "embedded":
        url = request.getfixturevalue("redis_url")
        path = "pipeline" if request.param == "redis-pipeline" else "auto"
        yield lambda **kw: store_for(url, payload_path=path, **kw)
        return
    reset_embedded()
    client = binary_client(GuidanceStoreSettings(redis_url=None))
    yield lambda **kw: store_for(client, **kw)
    client.close()
    reset_embedded()


def test_payload_path_follows_the_backend(backend, request):
    """A real server gets the socket path unless told otherwise; the embedded server,
    whose connections have no socket, gets the pipeline path by itself."""
    want = {"redis": "socket", "redis-pipeline": "pipeline", "embedded": "pipeline"}
    with backend() as s:
        assert s.payload_path == want[request.node.callspec.params["backend"]]
        s.put("v", "r", b"x")
        assert s.get("v", "r") == b"x"


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def assert_consistent(store: GuidanceStore) -> dict[tuple[str, str], bytes]:
    """Chunk keys are exactly those the metas name, the accounting adds up, every record
    verifies; returns the records."""
    r, p = store.client, store.prefix
    keys = [k.decode() for k in r.scan_iter(match=f"{p}:v:*", count=1000)]
    parts = {k: k[len(p) + 1:].split(":") for k in keys}  # ids hold no ':'
    chunks = {k for k, x in parts.items() if len(x) == 6 and x[2] == "c"}
    metas = {k for k, x in parts.items() if len(x) == 4 and x[2] == "r"}
    index = [v.decode() for v in r.zrange(f"{p}:index", 0, -1)]
    want_chunks, want_metas, total, records = set(), set(), 0, {}
    for v in index:
        vbytes = 0
        for rid in sorted(x.decode() for x in r.smembers(f"{p}:v:{v}:rollouts")):
            m = r.hgetall(f"{p}:v:{v}:r:{rid}")
            want_metas.add(f"{p}:v:{v}:r:{rid}")
            want_chunks |= {f"{p}:v:{v}:c:{rid}:{m[b'gen'].decode()}:{i}"
                            for i in range(int(m[b"n"]))}
            vbytes += int(m[b"len"])
        assert int(r.hget(f"{p}:bytes", v) or 0) == vbytes, v
        total += vbytes
        records.update({(v, rid): data for rid, data in store.get_many(
            v, store.rollouts(v)).items()})
    assert chunks == want_chunks, "orphan or missing chunk keys"
    assert metas == want_metas, "orphan or missing rollout metas"
    assert {k.decode() for k in r.hkeys(f"{p}:bytes")} == set(index)
    assert int(r.get(f"{p}:total") or 0) == total
    return records


# --- round trips -------------------------------------------------------------------


def test_round_trip_small_and_chunked(backend):
    """Small and multi-chunk records come back bit for bit, from bytes, bytearray and
    memoryview inputs; a chunked record is split into ceil(len / chunk) values."""
    with backend(chunk_bytes=1000) as s:
        small, big = blob(10, 1), blob(10_500, 2)
        s.put("v1", "small", small)
        res = s.put_many("v1", {"big": bytearray(big), "view": memoryview(big)[7:5007]})
        assert (res.rollouts, res.bytes, res.total_bytes, res.evicted) == (2, 15_500, 15_510, ())
        assert s.get("v1", "small") == small
        assert s.get("v1", "big") == big and isinstance(s.get("v1", "big"), bytes)
        assert s.get("v1", "view") == big[7:5007]
        assert len(list(s.client.scan_iter(match="t:guidance:v:v1:c:big:*"))) == 11
        assert s.rollouts("v1") == ["big", "small", "view"]
        assert_consistent(s)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), pieces=st.integers(1, 64), extra=st.integers(0, 5000))
def test_round_trip_property(backend, size, pieces, extra):
    """Any size and chunk size (shorter or longer than the record) round-trip exactly."""
    chunk = -(-size // pieces) + extra
    data = blob(size, size ^ chunk)
    with backend(chunk_bytes=chunk) as s:
        s.put("v", "r", data)
        assert s.get("v", "r") == data
        s.put("v", "r", data[: size // 2 + 1])
        assert s.get("v", "r") == data[: size // 2 + 1]
        assert assert_consistent(s) == {("v", "r"): data[: size // 2 + 1]}


def test_get_many_batches(backend, monkeypatch):
    """get_many fetches 50 records with one meta pipeline and one payload exchange (the
    pipeline path: a second pipeline), in request order; duplicates collapse;
    missing='skip' leaves absent ones out."""
    with backend(chunk_bytes=4096) as s:
        data = {f"r{i}": blob(1000 + 997 * i, i) for i in range(50)}
        s.put_many("v", data)
        calls = {"pipeline": 0, "payload": 0}

        def count(name, fn):
            def wrapped(*a, **k):
                calls[name] += 1
                return fn(*a, **k)
            return wrapped
        monkeypatch.setattr(s.client, "pipeline", count("pipeline", s.client.pipeline))
        if s.payload_path == "socket":
            monkeypatch.setattr(s._bulk, "get_connection", count("payload", s._bulk.get_connection))
        ids = [*reversed(data), "r3"]
        got = s.get_many("v", ids)
        sock = s.payload_path == "socket"
        assert calls == ({"pipeline": 1, "payload": 1} if sock else {"pipeline": 2, "payload": 0})
        assert list(got) == list(reversed(data)) and got == data
        assert s.get_many("v", ["r1", "nope"], missing="skip") == {"r1": data["r1"]}
        assert s.get_many("v", []) == {}


def test_get_retries_when_replaced_between_round_trips(backend, monkeypatch):
    """A record replaced after its meta was read (old chunks gone) is read again."""
    with backend(chunk_bytes=100) as s:
        s.put("v", "r", blob(1000, 1))
        metas = s._metas

        def replace_after_reading_metas(version, ids):
            out = metas(version, ids)
            if not getattr(s, "_replaced", False):
                s._replaced = True
                s.put("v", "r", blob(700, 2))
            return out
        monkeypatch.setattr(s, "_metas", replace_after_reading_metas)
        assert s.get("v", "r") == blob(700, 2)


def test_replace_with_fewer_chunks_leaves_no_orphans(backend):
    """Replacing a 7-chunk record by a 2-chunk one removes the old chunks in the same
    transaction; the accounting follows the new length."""
    with backend(chunk_bytes=1000) as s:
        s.put("v", "r", blob(6500, 1))
        s.put("v", "other", blob(10, 2))
        res = s.put("v", "r", blob(1500, 3))
        assert res.total_bytes == 1510
        assert len(list(s.client.scan_iter(match="t:guidance:v:v:c:r:*"))) == 2
        assert assert_consistent(s)[("v", "r")] == blob(1500, 3)
        assert s.versions()[0][:3] == ("v", 1510, 2)


def test_stored_format_reads_and_is_written(backend):
    """The key layout and meta fields (guidance_scripts) are the stored format: a record laid
    out by hand, as earlier releases wrote it, reads back; a put writes that same layout."""
    data = b"0123456789"
    with backend(chunk_bytes=4) as s:
        r, p = s.client, s.prefix
        r.hset(f"{p}:v:old", mapping={"created": "1700000000.000000", "seq": 1, "deadline_ms": 0})
        r.zadd(f"{p}:index", {"old": 1})
        r.set(f"{p}:seq", 1)
        r.hset(f"{p}:bytes", "old", 10)
        r.set(f"{p}:total", 10)
        r.sadd(f"{p}:v:old:rollouts", "r0")
        r.hset(f"{p}:v:old:r:r0", mapping={"len": 10, "n": 3, "cs": 4, "gen": "g1",
                                            "crc": zlib.crc32(data), "created": "1700000000.0"})
        for i in range(3):
            r.set(f"{p}:v:old:c:r0:g1:{i}", data[4 * i : 4 * i + 4])
        assert s.get("old", "r0") == data
        assert s.versions()[0][:4] == ("old", 10, 1, 1700000000.0)
        s.put("new", "r1", data)
        meta = r.hgetall(f"{p}:v:new:r:r1")
        assert {k: meta[k] for k in (b"len", b"n", b"cs", b"crc")} == {
            b"len": b"10", b"n": b"3", b"cs": b"4", b"crc": str(zlib.crc32(data)).encode()}
        gen = meta[b"gen"].decode()
        assert [r.get(f"{p}:v:new:c:r1:{gen}:{i}") for i in range(3)] == [
            data[:4], data[4:8], data[8:]]
        assert int(r.zscore(f"{p}:index", "new")) == 2 and int(r.get(f"{p}:total")) == 20
        assert assert_consistent(s) == {("old", "r0"): data, ("new", "r1"): data}


# --- misses and bad input ------------------------------------------------------------


def test_unknown_version_and_rollout(backend):
    """An unknown version and an unknown rollout of a known version are told apart."""
    with backend() as s:
        with pytest.raises(GuidanceNotFoundError) as e:
            s.get("nope", "r")
        assert type(e.value) is GuidanceNotFoundError
        assert (e.value.version_id, e.value.rollout_id) == ("nope", None)
        s.put("v", "r", b"x")
        with pytest.raises(GuidanceNotFoundError) as e:
            s.get_many("v", ["r", "missing"])
        assert type(e.value) is GuidanceNotFoundError
        assert (e.value.version_id, e.value.rollout_id) == ("v", "missing")
        assert "rollout 'missing' of weight version 'v'" in str(e.value)
        with pytest.raises(GuidanceNotFoundError):
            s.rollouts("nope")


def test_corrupt_chunk_is_detected(backend):
    """A chunk overwritten behind the store's back (same or other length) raises
    GuidanceChecksumError naming the version and rollout."""
    with backend(chunk_bytes=1000) as s:
        data = blob(2500, 1)
        s.put("v7", "r3", data)
        key = next(iter(s.client.scan_iter(match="t:guidance:v:v7:c:r3:*:1")))
        s.client.set(key, b"\0" + data[1001:2000])
        with pytest.raises(GuidanceChecksumError, match=r"rollout 'r3', weight version 'v7'.*crc32"):
            s.get("v7", "r3")
        s.client.set(key, b"short")
        with pytest.raises(GuidanceChecksumError, match="chunk 1 holds 5 bytes"):
            s.get("v7", "r3")
        s.client.set(key, data[1000:2000])
        assert s.get("v7", "r3") == data  # the connection stayed usable


def test_failed_commit_script_leaves_no_chunks(backend, monkeypatch):
    """A commit script that fails inside EXEC raises StoreError; the chunks its
    transaction wrote are removed and the stored record is untouched."""
    with backend(chunk_bytes=100) as s:
        s.put("v", "r", blob(250, 1))
        before = sorted(s.client.keys("t:guidance:*"))
        monkeypatch.setattr(guidance_store, "_COMMIT_LUA", "return redis.call('NOSUCHCMD')")
        with pytest.raises(StoreError, match="commit script failed"):
            s.put("v", "r", blob(500, 2))
        monkeypatch.undo()
        assert sorted(s.client.keys("t:guidance:*")) == before
        assert assert_consistent(s) == {("v", "r"): blob(250, 1)}


def test_oversize_record_is_refused_before_writing(backend):
    """A record above max_record_bytes raises PayloadTooLargeError and writes nothing."""
    with backend(max_record_bytes=1000) as s:
        with pytest.raises(PayloadTooLargeError) as e:
            s.put_many("v", {"ok": b"x" * 10, "big": b"x" * 1001})
        assert (e.value.size, e.value.limit) == (1001, 1000)
        assert s.client.dbsize() == 0


@pytest.mark.parametrize("version,rollout,data", [
    ("", "r", b"x"), ("v:1", "r", b"x"), ("v" * 129, "r", b"x"), (1, "r", b"x"),
    ("v", "-r", b"x"), ("v", "r/1", b"x"), ("v", None, b"x"),
    ("v", "r", b""), ("v", "r", "text"), ("v", "r", [1, 2]),
])
def test_bad_ids_and_records_are_input_errors(redis_url, version, rollout, data):
    """Ids outside the safe charset or length and non-byte or empty records are refused."""
    with store_for(redis_url) as s:
        with pytest.raises(InputError):
            s.put(version, rollout, data)
        assert s.client.dbsize() == 0


def test_text_client_is_refused(redis_url):
    """The store needs a binary-safe client."""
    with pytest.raises(ConfigError, match="decode_responses"):
        GuidanceStore(redis.Redis.from_url(redis_url, decode_responses=True))


# --- budget, eviction, leases --------------------------------------------------------


def test_budget_evicts_oldest_versions_first(backend):
    """Over budget, whole versions go in the order of their first put (a later put to an
    old version does not make it younger); the writer's version is never evicted."""
    m = Metrics()
    with backend(budget_bytes=3000, metrics=m) as s:
        for v in ("v1", "v2", "v3"):
            s.put(v, "r0", blob(1000))
        s.put("v1", "r0", blob(1000, 5))  # replace: same size, no eviction
        res = s.put("v4", "r0", blob(1000))
        assert [e.version for e in res.evicted] == ["v1"]
        res = s.put_many("v4", {"r1": blob(900), "r2": blob(900)})
        assert [(e.version, e.bytes, e.in_use_by) for e in res.evicted] == [
            ("v2", 1000, ()), ("v3", 1000, ())]
        assert [v.version for v in s.versions()] == ["v4"]
        assert s.total_bytes() == 2800 == m.value("libalign_guidance_stored_bytes")
        assert m.value("libalign_guidance_evictions_total", {"in_use": "false"}) == 3
        with pytest.raises(GuidanceEvictedError, match=r"evicted at .*budget of 3000 bytes"):
            s.get("v1", "r0")
        assert_consistent(s)


def test_leased_version_is_skipped(backend):
    """A version with a live lease is passed over for the next-oldest unleased one."""
    with backend(budget_bytes=2500) as s:
        s.put("v1", "r", blob(1000))
        s.put("v2", "r", blob(1000))
        s.acquire("v1", "learner-0", ttl_s=30)
        res = s.put("v3", "r", blob(1000))
        assert [e.version for e in res.evicted] == ["v2"]
        assert [(v.version, v.leased_by) for v in s.versions()] == [
            ("v1", ("learner-0",)), ("v3", ())]
        assert s.release("v1", "learner-0") is True and s.release("v1", "learner-0") is False


def test_in_use_eviction_is_loud(backend, caplog):
    """on_in_use='evict': with only leased versions left, the oldest goes, with a
    warning, the in_use='true' count and a tombstone naming its consumers."""
    m = Metrics()
    with backend(budget_bytes=2500, metrics=m) as s:
        s.put("v1", "r", blob(1000))
        s.put("v2", "r", blob(1000))
        s.acquire("v1", "learner-0", ttl_s=30)
        s.acquire("v1", "learner-1", ttl_s=30)
        s.acquire("v2", "learner-2", ttl_s=30)
        with caplog.at_level(logging.WARNING, logger="alignd.infra.stores.guidance"):
            res = s.put("v3", "r", blob(1000))
        assert [(e.version, e.in_use_by) for e in res.evicted] == [
            ("v1", ("learner-0", "learner-1"))]
        assert "while in use by learner-0, learner-1" in caplog.text
        assert m.value("libalign_guidance_evictions_total", {"in_use": "true"}) == 1
        with pytest.raises(GuidanceEvictedError) as e:
            s.get("v1", "r")
        assert "evicted while in use by learner-0, learner-1" in str(e.value)
        assert e.value.code == "guidance_evicted" and status_for(e.value) == 410


def test_in_use_refuse_writes_nothing(backend):
    """on_in_use='refuse': GuidanceBudgetError names the leased versions; no version is
    evicted (not even the unleased one) and nothing of the put remains."""
    m = Metrics()
    with backend(budget_bytes=3000, on_in_use="refuse", metrics=m) as s:
        for v in ("v1", "v2", "v3"):
            s.put(v, "r", blob(1000))
        s.acquire("v1", "learner-0", ttl_s=30)
        s.acquire("v2", "learner-1", ttl_s=30)
        before = sorted(s.client.keys("t:guidance:v:*"))
        with pytest.raises(GuidanceBudgetError, match=r"'v1' \(leased by learner-0\), 'v2' "
                                                      r"\(leased by learner-1\)"):
            s.put_many("v4", {"a": blob(1000), "b": blob(1000)})
        assert sorted(s.client.keys("t:guidance:v:*")) == before
        assert [v.version for v in s.versions()] == ["v1", "v2", "v3"]
        assert s.total_bytes() == 3000
        assert m.value("libalign_guidance_refused_puts_total") == 1
        assert_consistent(s)


def test_record_larger_than_budget_is_refused(backend):
    """A put larger than the whole budget, or that would grow its version past it,
    raises GuidanceBudgetError and leaves the store as it was."""
    with backend(budget_bytes=2000) as s:
        with pytest.raises(GuidanceBudgetError, match="larger than the whole"):
            s.put("v", "r", blob(2001))
        assert s.client.dbsize() == 0
        s.put("v0", "r", blob(500))
        s.put("v", "a", blob(1500))
        with pytest.raises(GuidanceBudgetError, match="would hold 3000 bytes"):
            s.put("v", "b", blob(1500))
        assert assert_consistent(s).keys() == {("v0", "r"), ("v", "a")}


def test_lease_expires(backend):
    """A lease is a key with the lease's TTL: once Redis expires it (done here at once, as
    at the TTL's end) it no longer protects its version and the next eviction takes it."""
    with backend(budget_bytes=1500) as s:
        s.put("v1", "r", blob(1000))
        s.acquire("v1", "learner-0", ttl_s=30)
        assert s.versions()[0].leased_by == ("learner-0",)
        lease = "t:guidance:v:v1:lease:learner-0"
        assert 0 < s.client.pttl(lease) <= 30_000
        assert 0 < s.client.pttl("t:guidance:v:v1:lessees") <= 30_000
        assert expire_now(s.client, lease) == 1
        assert s.versions()[0].leased_by == ()
        res = s.put("v2", "r", blob(1000))
        assert [(e.version, e.in_use_by) for e in res.evicted] == [("v1", ())]


def test_ttl_expiry_reconciles_accounting(backend):
    """Every key of a version gets one deadline, the store's clock plus ttl_s; once they
    expired (done here at once) with the clock past the deadline, the next script drops
    the version from the index and the totals and leaves an 'expired' tombstone."""
    clock = FakeClock()
    with backend(ttl_s=60, chunk_bytes=100, clock=clock) as s:
        s.put("v1", "r", blob(1000))
        keys = list(s.client.scan_iter(match="t:guidance:v:v1*"))
        assert len(keys) == 10 + 3  # 10 chunks, the meta, the version hash, its rollouts
        deadline_ms = int(s.client.hget("t:guidance:v:v1", "deadline_ms"))
        assert abs(deadline_ms - (clock() + 60) * 1000) <= 1
        assert {s.client.pexpiretime(k) for k in keys} == {deadline_ms}
        clock.advance(61)  # past the deadline
        assert expire_now(s.client, *keys) == len(keys)
        assert s.client.zrange("t:guidance:index", 0, -1) == [b"v1"]  # not reconciled yet
        res = s.put("v2", "r", blob(10))
        assert res.total_bytes == 10
        assert [v.version for v in s.versions()] == ["v2"]
        with pytest.raises(GuidanceEvictedError, match=r"expired: its TTL of 60 s"):
            s.get("v1", "r")
        assert_consistent(s)


def test_versions_delete_and_stats(backend):
    """versions() lists bytes, rollouts, creation and lessees; delete_version leaves a
    tombstone; stats() sums up."""
    with backend(budget_bytes=10_000) as s:
        t0 = time.time()
        s.put_many("v1", {"a": blob(100), "b": blob(200)})
        s.put("v2", "a", blob(50))
        s.acquire("v2", "learner-0", ttl_s=30)
        (v1, b1, n1, c1, l1), v2 = s.versions()
        assert (v1, b1, n1, l1) == ("v1", 300, 2, ()) and abs(c1 - t0) < 60
        assert v2.leased_by == ("learner-0",)
        st_ = s.stats()
        assert (st_["versions"], st_["rollouts"], st_["stored_bytes"]) == (2, 3, 350)
        assert st_["leased_versions"] == ["v2"] and st_["budget_used_ratio"] == 0.035
        assert s.delete_version("v1") is True and s.delete_version("v1") is False
        with pytest.raises(GuidanceEvictedError, match="deleted by request"):
            s.get("v1", "a")
        assert s.total_bytes() == 50
        assert_consistent(s)


def test_metrics_and_settings(redis_url):
    """Hits, misses and bytes are counted; from_settings applies the guidance_* fields."""
    m = Metrics()
    cfg = GuidanceStoreSettings(redis_url=redis_url, key_prefix="t", guidance_budget_bytes=5000,
                                guidance_ttl_s=60, guidance_chunk_bytes=128,
                                guidance_max_record_bytes=4000, guidance_on_in_use="refuse")
    with GuidanceStore.from_settings(cfg, metrics=m) as s:
        assert (s.budget_bytes, s.ttl_s, s.chunk_bytes, s.max_record_bytes, s.on_in_use) == (
            5000, 60, 128, 4000, "refuse")
        s.put_many("v", {"a": blob(1000), "b": blob(300)})
        s.get_many("v", ["a", "b", "c"], missing="skip")
        assert m.value("libalign_guidance_put_bytes_total") == 1300
        assert m.value("libalign_guidance_get_bytes_total") == 1300
        assert m.value("libalign_guidance_hits_total") == 2
        assert m.value("libalign_guidance_misses_total") == 1
        assert m.value("libalign_guidance_stored_bytes") == 1300
        assert 0 < s.client.pttl("t:guidance:v:v") <= 60_000
    with pytest.raises(ValidationError):
        GuidanceStoreSettings(guidance_on_in_use="drop")


def test_concurrent_puts_keep_accounting_exact(backend):
    """Three writers putting and replacing under a tight budget leave totals that add up
    and no orphan keys."""
    with backend(budget_bytes=20_000, chunk_bytes=500) as s:
        errors = []

        def writer(w: int) -> None:
            rng = random.Random(w)
            try:
                for i in range(25):
                    s.put_many(f"w{w}-{i % 6}", {f"r{j}": blob(rng.randrange(1, 2500), i)
                                                 for j in range(rng.randrange(1, 4))})
            except Exception as e:
                errors.append(e)
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert s.total_bytes() <= 20_000
        assert_consistent(s)


# --- crashes -------------------------------------------------------------------------

_WRITER = """
import random, struct, sys
from alignd.infra.stores.guidance import GuidanceStore
s = GuidanceStore(sys.argv[1], prefix="t", chunk_bytes=64 * 1024)
i = 0
while True:
    i += 1
    s.put_many("v", {f"r{j}": struct.pack("<Q", i) + random.Random(i * 10 + j).randbytes(2 << 20)
                     for j in range(4)})
    print(i, flush=True)
"""


def wait_for_open_multi(r: redis.Redis, timeout: float = 20.0) -> int:
    """Poll CLIENT LIST until a connection is inside MULTI with queued commands; their count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = [int(c.get("multi", -1)) for c in r.client_list()]
        if max(queued, default=-1) > 0:
            return max(queued)
    pytest.fail("never saw a writer inside MULTI")


def writer_blob(i: int, j: int) -> bytes:
    return struct.pack("<Q", i) + random.Random(i * 10 + j).randbytes(2 << 20)


def test_sigkill_mid_put_many_leaves_whole_records(redis_url):
    """A writer SIGKILLed while streaming a 4-record, 128-chunk put_many leaves each record
    whole: either the last committed one or the new one, never a mix, no stray chunks."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, redis_url], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    watcher = redis.Redis.from_url(redis_url)
    try:
        for _ in range(3):
            assert proc.stdout.readline(), "writer died"
        assert wait_for_open_multi(watcher) > 0  # chunks queued, EXEC not yet sent
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with store_for(redis_url) as s:
        records = assert_consistent(s)
        assert sorted(records) == [("v", f"r{j}") for j in range(4)]
        for (_, rid), data in records.items():
            (i,) = struct.unpack("<Q", data[:8])
            assert i >= 3 and data == writer_blob(i, int(rid[1:]))


def test_redis_stopped_mid_put(private_redis):
    """Redis dies under a stream of large puts: the writer gets BusUnavailableError
    after its short give-up budget; after the restart every record is whole."""
    s = store_for(private_redis.url, chunk_bytes=1 << 20,
                  retry=RetryPolicy(initial_s=0.02, max_s=0.1, deadline_s=0.5))
    outcome: list = []
    done = threading.Event()

    def writer() -> None:
        i = 0
        try:
            while True:
                i += 1
                s.put_many("v", {f"r{j}": struct.pack("<Q", i) + blob(3 << 20, j)
                                 for j in range(3)})
                done.set()
        except Exception as e:
            outcome.append((i, e))
            done.set()
    t = threading.Thread(target=writer)
    t.start()
    assert done.wait(30)
    assert wait_for_open_multi(redis.Redis.from_url(private_redis.url)) > 0
    private_redis.stop()
    t.join(30)
    [(last, err)] = outcome
    assert isinstance(err, BusUnavailableError), repr(err)
    private_redis.start()
    records = assert_consistent(s)
    for (_, rid), data in records.items():
        (i,) = struct.unpack("<Q", data[:8])
        assert i <= last and data[8:] == blob(3 << 20, int(rid[1:]))
    s.close()
