"""Pins the Python client against the real API served by uvicorn: every method, typed errors, retries."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import alignclient.errors as E
import pytest
from alignclient import AlignClient, ApiUnreachableError, AsyncAlignClient, RemoteError, spec_sha256
from alignclient.client import Call
from alignclient.errors import error_classes, error_from_response
from alignclient.ids import ID_PATTERN, ID_RE, check_version_id, is_safe_id
from alignclient.models import LOGPROB_MAX, PublishRequest, Rollout, RolloutIds, RolloutList, Score
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.events import PublishedEvent
from alignd.infra.registry import Registry

from libalign.metrics import LOGPROB_TOLERANCE
from libalign.spec import PRESETS
from tests.services.api_server import TOKEN, api_settings, publish_files, serve
from tests.services.conftest import free_port


def rollout(rid: str, n: int = 3) -> Rollout:
    return Rollout(rollout_id=rid, prompt_len=2, tokens=list(range(2 + n)),
                   logprobs=[-1.0 - 0.1 * i for i in range(n)], path="nvfp4_minite")


@pytest.fixture
def api(redis_url, tmp_path):
    """The API served on a free port, v1 and v2 in the published store."""
    store = tmp_path / "store"
    publish_files(store, "v1")
    publish_files(store, "v2")
    app = create_app(api_settings(redis_url, store), redis_give_up_s=0.3)
    with serve(app) as url:
        yield type("Api", (), dict(url=url, redis_url=redis_url, store=store,
                                   registry=Registry(RedisBus(connect(redis_url)), "libalign")))


#: Ids on both sides of the rule's edges.
ID_SAMPLES = ["v1", "step-000123", "a.b_c-d", "0", "x" * 128, "x" * 129, "", ".hidden", "-x",
              "_x", "a/b", "a:b", "a b", "v1\n", "\nv1", "é", "a..b"]


def _accepts(fn) -> bool:
    try:
        fn()
    except ValueError:  # InputError, EventError and pydantic's ValidationError are ValueErrors
        return False
    return True


def test_wire_constants_match_the_daemon():
    """The client's schemas and the daemon's checks apply the one id rule alike; the log-prob
    bound is the daemon's; every error code is unique."""
    assert f"^{ID_RE.pattern}$" == ID_PATTERN
    for s in ID_SAMPLES:
        ok = ID_RE.fullmatch(s) is not None
        assert ok == (s in ("v1", "step-000123", "a.b_c-d", "0", "x" * 128, "a..b")), s
        assert is_safe_id(s) == ok, s
        assert _accepts(lambda s=s: check_version_id(s)) == ok, s
        assert _accepts(lambda s=s: PublishRequest(version_id=s)) == ok, s
        assert _accepts(lambda s=s: PublishedEvent(version_id=s, path="p")) == ok, s
    assert LOGPROB_MAX == LOGPROB_TOLERANCE
    codes = [c.code for c in vars(E).values()
             if isinstance(c, type) and issubclass(c, E.AlignError) and c.__module__ == E.__name__]
    assert len(codes) == len(set(codes)) == len(error_classes())


def test_every_sync_method_against_the_served_api(api):
    """publish → convert (registry) → sync → rollouts → scores → discrepancy → guidance → status."""
    with AlignClient(api.url, token=TOKEN) as c:
        assert c.healthz().status == "ok" and c.readyz().redis is True
        pub = c.publish_version("v1", meta={"step": 1}, target_path="nvfp4_minite")
        assert pub.version.state == "published" and pub.event_id
        assert [v.version_id for v in c.list_versions().versions] == ["v1"]
        assert c.list_versions(state="serving").versions == []
        for s in ("converting", "converted"):
            api.registry.transition("v1", s, actor="conv")
        assert c.sync_version("v1").state == "converted"
        assert [h.to_state for h in c.get_version("v1").history] == [
            "published", "converting", "converted"]

        stored = c.put_rollouts("v1", [rollout("r0"), rollout("r1", 4).model_dump()])
        assert (stored.stored, stored.tokens) == (2, 7)
        ids = c.get_rollouts("v1")
        assert isinstance(ids, RolloutIds) and ids.rollout_ids == ["r0", "r1"]
        full = c.get_rollouts("v1", ["r1"])
        assert isinstance(full, RolloutList) and full.rollouts[0] == rollout("r1", 4)
        summary = c.put_scores("v1", [Score(rollout_id="r0", logprobs=[-1.0, -1.2, -1.1],
                                            path="bf16")])
        assert summary.tokens == 3 and summary.stats.max_abs == pytest.approx(0.1)
        assert c.get_discrepancy("v1", window_tokens=2).stats.count == 2
        assert c.get_discrepancy().versions == ["v1"]

        assert c.put_guidance("v1", "r0", b"\x01" * 300).bytes == 300
        c.put_guidance("v1", "r1", bytearray(b"\x02" * 5))
        assert c.get_guidance("v1", "r0") == b"\x01" * 300
        assert c.get_guidance_batch("v1", ["r1", "r0"]) == {"r1": b"\x02" * 5, "r0": b"\x01" * 300}
        assert c.get_guidance_batch("v1", ["zz", "r1"], missing="skip") == {"r1": b"\x02" * 5}
        assert c.acquire_guidance_lease("v1", "learner-0", 30).held is True
        assert c.release_guidance_lease("v1", "learner-0").held is True

        spec = c.get_spec()
        assert spec.sha256 == spec_sha256(PRESETS["minite"].to_dict())
        assert c.check_spec(spec.sha256).match is True
        status = c.get_status()
        assert status.versions_by_state["converted"] == 1 and status.guidance.rollouts == 2
        assert any(s.service == "api" and s.up for s in status.services)
        assert "libalign_api_requests_total" in c.metrics()
        assert "<canvas" in c.status_page()


def test_errors_come_back_as_the_daemons_classes(api):
    """Each error code raises its libalign.errors class with the server's message and status."""
    with AlignClient(api.url, token=TOKEN, retries=0) as c:
        with pytest.raises(E.VersionNotFoundError, match="'nope'") as ei:
            c.get_version("nope")
        assert ei.value.status == 404 and ei.value.version_id == "nope"
        first = c.publish_version("v1")
        again = c.publish_version("v1")  # the same directory: the version it made, no new event
        assert again.version == first.version and first.event_id and again.event_id is None
        with pytest.raises(E.VersionExistsError):
            c.publish_version("v1", target_path="nvfp4_minite")
        with pytest.raises(E.VersionNotFoundError, match="published store"):
            c.publish_version("v7")
        with pytest.raises(E.StateTransitionError):
            c.sync_version("v1")
        with pytest.raises(E.RolloutNotFoundError):
            c.put_scores("v1", [Score(rollout_id="ghost", logprobs=[-1.0], path="bf16")])
        c.put_rollouts("v1", [rollout("r0")])
        with pytest.raises(E.RolloutExistsError):
            c.put_rollouts("v1", [rollout("r0")])
        with pytest.raises(E.ShapeError, match="'r0'"):
            c.put_scores("v1", [Score(rollout_id="r0", logprobs=[-1.0], path="bf16")])
        with pytest.raises(E.GuidanceNotFoundError) as gi:
            c.get_guidance("v1", "r9")
        assert gi.value.rollout_id == "r9"
        with pytest.raises(E.PayloadTooLargeError) as pi:
            c.put_guidance("v1", "r0", b"x" * (64 << 10))
        assert pi.value.status == 413
        with pytest.raises(E.SpecMismatchError):
            c.check_spec(spec_sha256(PRESETS["te"].to_dict()))
        with pytest.raises(E.InputError):
            c.get_version("bad..id$")
        with pytest.raises(E.InputError):  # refused by the client's own model before sending
            c.put_rollouts("v1", [{"rollout_id": "x", "prompt_len": 5, "tokens": [1],
                                   "logprobs": [], "path": "p"}])
    with AlignClient(api.url, retries=0) as anon, pytest.raises(E.UnauthorizedError):
        anon.publish_version("v2")
    with AlignClient(api.url, token="wrong", retries=0) as bad, pytest.raises(E.ForbiddenError):
        bad.publish_version("v2")


def test_unknown_codes_and_foreign_bodies_are_remote_errors():
    """A code the client does not know, or a body that is not the API's: RemoteError with status."""
    err = error_from_response(418, b'{"error": {"code": "teapot", "type": "X", "message": "hot"}}')
    assert type(err) is RemoteError and err.code == "teapot" and err.status == 418
    assert isinstance(err, E.AlignError)
    err = error_from_response(502, b"<html>bad gateway</html>", method="GET", url="http://x/")
    assert type(err) is RemoteError and err.code == "http_502" and "bad gateway" in str(err)


def test_unreachable_api_after_retries(tmp_path):
    """Nothing listens: ApiUnreachableError after the allowed attempts, with backoff."""
    with AlignClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05) as c:
        t = time.monotonic()
        with pytest.raises(ApiUnreachableError, match="3 attempt"):
            c.healthz()
        assert 0.05 < time.monotonic() - t < 5


class Silent:
    """A TCP server that accepts connections, reads, and never answers: every request times out."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_timeouts_retry_only_idempotent_calls():
    """A read timeout is retried for an idempotent call, never for a non-idempotent one."""
    srv = Silent()
    try:
        with AlignClient(f"http://127.0.0.1:{srv.port}", timeout=0.2, retries=2,
                         backoff_s=0.01) as c:
            with pytest.raises(ApiUnreachableError):
                c.get_spec()
            assert srv.accepted == 3
            once = Call("POST", "/v1/anything", lambda r: r, idempotent=False, json={})
            with pytest.raises(ApiUnreachableError, match="1 attempt"):
                c._do(once)
            assert srv.accepted == 4
    finally:
        srv.close()


def test_retries_ride_out_a_redis_restart(private_redis, tmp_path):
    """Redis stopped: 503 BusUnavailableError without retries; with them, success once it is back."""
    publish_files(tmp_path / "store", "v1")
    app = create_app(api_settings(private_redis.url, tmp_path / "store"), redis_give_up_s=0.2)
    with serve(app) as url, AlignClient(url, token=TOKEN, retries=0) as once, \
            AlignClient(url, token=TOKEN, retries=8, backoff_s=0.1, max_backoff_s=0.4) as patient:
        patient.publish_version("v1")
        private_redis.stop()
        with pytest.raises(E.BusUnavailableError) as ei:
            once.list_versions()
        assert ei.value.status == 503
        timer = threading.Timer(0.6, private_redis.start)
        timer.start()
        try:
            t = time.monotonic()
            versions = patient.list_versions().versions
            assert [v.version_id for v in versions] == ["v1"]  # persisted across the restart
            assert time.monotonic() - t >= 0.5
        finally:
            timer.join()
        assert once.readyz().redis is True


def test_async_client(api):
    """The async client: same methods awaited, same typed errors, a context manager."""

    async def main():
        async with AsyncAlignClient(api.url, token=TOKEN, retries=1, backoff_s=0.01) as c:
            assert (await c.healthz()).status == "ok"
            pub = await c.publish_version("v2")
            assert pub.version.version_id == "v2"
            assert (await c.publish_version("v2")).event_id is None  # the same directory again
            with pytest.raises(E.VersionExistsError):
                await c.publish_version("v2", target_path="nvfp4_minite")
            await c.put_rollouts("v2", [rollout("a"), rollout("b")])
            results = await asyncio.gather(c.get_rollouts("v2"), c.get_spec(), c.get_status())
            assert results[0].rollout_ids == ["a", "b"]
            summary = await c.put_scores("v2", [Score(rollout_id="a", logprobs=[-1, -1.1, -1.2],
                                                      path="bf16")])
            assert summary.stats.max_abs == pytest.approx(0.0, abs=1e-12)
            await c.put_guidance("v2", "a", b"abc")
            assert await c.get_guidance_batch("v2", ["a"]) == {"a": b"abc"}
            with pytest.raises(E.GuidanceNotFoundError):
                await c.get_guidance("v2", "b")
            lease = await c.acquire_guidance_lease("v2", "c1", 5)
            assert lease.held and (await c.release_guidance_lease("v2", "c1")).held
            assert (await c.check_spec(results[1].sha256)).match

    asyncio.run(main())


def test_retry_version_sync_and_async(api):
    """retry_version: a failed version back to published with a new event; 409 for any other
    state, 404 for an unknown id; the same from the async client."""
    raw = connect(api.redis_url)
    stream = api_settings(api.redis_url, api.store).published_stream
    with AlignClient(api.url, token=TOKEN) as c:
        c.publish_version("v1", target_path="nvfp4_minite")
        with pytest.raises(E.StateTransitionError, match="only a failed version"):
            c.retry_version("v1")
        with pytest.raises(E.VersionNotFoundError):
            c.retry_version("nope")
        api.registry.transition("v1", "failed", actor="conv", reason="no_space: disk full")
        got = c.retry_version("v1")
        assert got.version.state == "published" and got.version.reason == ""
        assert got.stream == stream
        (_, first), (eid, again) = raw.xrange(stream)
        assert eid == got.event_id  # the same event announced again, published now
        assert {**again, "published_at": ""} == {**first, "published_at": ""}
        assert float(again["published_at"]) > float(first["published_at"])
        hist = c.get_version("v1").history
        assert [(h.from_state, h.to_state) for h in hist[-2:]] == [
            ("published", "failed"), ("failed", "published")]
        assert "no_space: disk full" in hist[-1].reason
        with pytest.raises(E.StateTransitionError):
            c.retry_version("v1")

    async def main():
        async with AsyncAlignClient(api.url, token=TOKEN) as c:
            await c.publish_version("v2")
            api.registry.transition("v2", "failed", actor="conv", reason="boom")
            assert (await c.retry_version("v2")).version.state == "published"
            with pytest.raises(E.StateTransitionError):
                await c.retry_version("v2")

    asyncio.run(main())
    assert api.registry.state("v2") == "published" and len(raw.xrange(stream)) == 4


def test_list_versions_pages_sync_and_async(api):
    """list_versions(limit, before): the newest page and the cursor to the next, older one,
    from both clients; the status counts the newest page of all versions."""
    vids = [f"p{i:02d}" for i in range(7)]
    for vid in vids:
        api.registry.create(vid, f"/p/{vid}")
    with AlignClient(api.url, token=TOKEN) as c:
        page = c.list_versions(limit=3)
        assert [v.version_id for v in page.versions] == vids[-3:] and page.next_before == "p04"
        older = c.list_versions(limit=3, before=page.next_before)
        assert [v.version_id for v in older.versions] == vids[1:4]
        last = c.list_versions(limit=3, before=older.next_before)
        assert [v.version_id for v in last.versions] == ["p00"] and last.next_before is None
        status = c.get_status()
        assert (status.versions_total, status.versions_counted) == (7, 7)

    async def main():
        async with AsyncAlignClient(api.url, token=TOKEN) as c:
            page = await c.list_versions(limit=2, before="p04")
            assert [v.version_id for v in page.versions] == ["p02", "p03"]
            assert page.next_before == "p02"

    asyncio.run(main())


def test_client_does_not_import_the_daemon():
    """alignclient imports nothing from alignd (it ships without the daemon)."""
    import subprocess
    import sys

    code = ("import sys, alignclient, alignclient.client, alignclient.models; "
            "bad = [m for m in sys.modules if m == 'services' or m.startswith('services.')]; "
            "assert not bad, bad; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)

