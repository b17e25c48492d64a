"""Pins the read guard: the API's data needs a token to be read, not only to be changed.

The route table is the front door's own (the ``routes`` the app hands
:class:`~alignd.api.middleware.Frontdoor`), so a route added later is checked without
touching this file; the OpenAPI schema's paths must all be in it. Pinned, against a real
redis-server and an app holding one version (with a secret in its ``meta``), one rollout and
one guidance record:

* every GET and HEAD route outside the open set answers 401 ``unauthorized`` without a token
  (and with a non-Bearer scheme), 403 ``forbidden`` with a wrong one, and 200 with the API
  token and with the read token; the open set (``/healthz``, ``/readyz``, ``/metrics``, the
  status page's HTML, ``/docs``, ``/openapi.json``) answers 200 either way;
* no error answer holds the data (version id, rollout id, meta, store path);
* reads fail closed: an unknown path and a wrong method are 401 before they are 404/405;
* the read token never changes state: every mutating route answers 403 with it, and no key
  is written;
* each token is compared with :func:`hmac.compare_digest`, against both tokens every time;
* ``open_reads`` opens reads only (writes still need the token); ``dev_mode`` without a
  token opens both, and each is logged;
* ``/metrics``, open, holds no id, meta, path or host name;
* the Python client and ``alignd status`` read with a token (``--token``,
  ``ALIGN_READ_TOKEN``) and fail typed without one.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from alignclient import AlignClient
from alignclient.errors import ForbiddenError, UnauthorizedError
from alignd.api import middleware
from alignd.api.app import create_app
from alignd.api.middleware import Frontdoor, is_open_route
from alignd.infra.settings import ApiSettings
from alignd.tools.cli import app as cli
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.services.api_server import TOKEN, api_settings, publish_files, serve
from tests.services.conftest import REDIS_SERVER

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

READ_TOKEN = "read-token-7c4a91e0d2b6"
WRONG = "wrong-token-3f8d1b2a6e90"
SECRET = "meta-secret-b81f3c"
VERSION, ROLLOUT = "guarded-v1", "guarded-r1"
API_AUTH = {"Authorization": f"Bearer {TOKEN}"}
READ_AUTH = {"Authorization": f"Bearer {READ_TOKEN}"}
#: a concrete value for each path parameter of the route table
PARAMS = {"version_id": VERSION, "rollout_id": ROLLOUT}


def _door_routes(app) -> list:
    """The routes the app's front door matches requests against (its ``routes`` argument)."""
    door = next(m for m in app.user_middleware if m.cls is Frontdoor)
    return list(door.kwargs["routes"])


def _concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], template)


_TABLE_APP = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_token="x",
                                    store_dir=Path("unused")))
ROUTES = _door_routes(_TABLE_APP)
READS = sorted((m, _concrete(r.path), is_open_route(r.endpoint)) for r in ROUTES
               for m in ({"GET", "HEAD"} if "GET" in r.methods else set()))
WRITES = sorted((m, _concrete(r.path)) for r in ROUTES for m in r.methods
                if m in middleware.MUTATING)
OPEN = {path for _, path, is_open in READS if is_open}


def test_the_table_covers_the_schema_and_the_open_set_is_the_declared_one():
    """Every path of the OpenAPI schema is in the door's table; what is open is exactly health,
    metrics, the page and FastAPI's schema and docs (so a new route is guarded unless marked)."""
    table = {r.path for r in ROUTES}
    assert set(_TABLE_APP.openapi()["paths"]) <= table
    declared = {"/healthz", "/readyz", "/metrics", "/", "/openapi.json", "/docs",
                "/docs/oauth2-redirect"}
    assert declared == OPEN
    assert len(READS) >= 20 and len(WRITES) >= 10


@pytest.fixture
def env(redis_url, tmp_path):
    """An app with a token and a read token: one version (meta holds SECRET), a rollout, guidance."""
    store = tmp_path / "store"
    publish_files(store, VERSION)
    settings = api_settings(redis_url, store, read_token=READ_TOKEN)
    raw = redis.Redis.from_url(redis_url)
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        r = http.post("/v1/versions", json={"version_id": VERSION, "meta": {"note": SECRET}},
                      headers=API_AUTH)
        assert r.status_code == 201, r.text
        r = http.post(f"/v1/versions/{VERSION}/rollouts", headers=API_AUTH, json={"rollouts": [
            {"rollout_id": ROLLOUT, "prompt_len": 2, "tokens": [1, 2, 3, 4],
             "logprobs": [-1.0, -2.0], "path": "nvfp4_minite"}]})
        assert r.status_code == 201, r.text
        r = http.put(f"/v1/guidance/{VERSION}/{ROLLOUT}", content=b"\x07" * 256, headers=API_AUTH)
        assert r.status_code == 200, r.text
        yield type("Env", (), dict(http=http, raw=raw, store=store))
    raw.close()


def _code(resp: httpx.Response) -> str | None:
    return resp.json()["error"]["code"] if resp.content else None


def _no_data(resp: httpx.Response, store: Path) -> None:
    for leak in (VERSION, ROLLOUT, SECRET, str(store)):
        assert leak not in resp.text, (resp.request.url, leak)


def test_every_read_route_needs_a_token_except_the_open_set(env):
    """401 without a token or with another scheme, 403 with a wrong one, 200 with either token."""
    checked = 0
    for method, path, is_open in READS:
        def call(headers, method=method, path=path):
            return env.http.request(method, path, headers=headers)

        anon, basic, wrong = call({}), call({"Authorization": f"Basic {TOKEN}"}), call(
            {"Authorization": f"Bearer {WRONG}"})
        api, read = call(API_AUTH), call(READ_AUTH)
        where = f"{method} {path}"
        # GET answers 200 with a token; HEAD what the router says (FastAPI's routes take no
        # HEAD: 405), as long as the door let it through
        passed = 200 if method == "GET" else api.status_code
        assert passed not in (401, 403) and passed < 500, (where, api.text)
        if is_open:
            statuses = [r.status_code for r in (anon, basic, wrong, api, read)]
            assert statuses == [passed] * 5, (where, statuses)
            continue
        assert anon.status_code == 401 and basic.status_code == 401, where
        assert wrong.status_code == 403, where
        if method == "GET":
            assert (_code(anon), _code(basic), _code(wrong)) == (
                "unauthorized", "unauthorized", "forbidden"), where
        for denied in (anon, basic, wrong):
            _no_data(denied, env.store)
        assert api.status_code == read.status_code == passed, (where, api.text, read.text)
        checked += 1
    assert checked == sum(1 for *_, is_open in READS if not is_open) >= 14


def test_reads_fail_closed(env):
    """A path outside the table and a method a route does not take need the token too."""
    for method, path, known in [("GET", "/v1/nothing", 404), ("HEAD", "/nothing/at/all", 404),
                                ("GET", "/v1/sync", 405), ("GET", f"/v1/guidance/{VERSION}:batch",
                                                           405)]:
        assert env.http.request(method, path).status_code == 401, (method, path)
        assert env.http.request(method, path, headers=READ_AUTH).status_code == known, path


def test_the_read_token_never_changes_state(env):
    """Every mutating route: 403 forbidden naming ALIGN_API_TOKEN, before the body; no key written."""
    before = {k: env.raw.dump(k) for k in env.raw.keys("*") if b":heartbeat" not in k}
    for method, path in WRITES:
        r = env.http.request(method, path, json={"version_id": VERSION}, headers=READ_AUTH)
        assert r.status_code == 403 and _code(r) == "forbidden", (method, path, r.text)
        assert "ALIGN_API_TOKEN" in r.json()["error"]["message"]
    assert {k: env.raw.dump(k) for k in env.raw.keys("*") if b":heartbeat" not in k} == before


def test_both_tokens_are_compared_in_constant_time(env, monkeypatch):
    """Each given token is compared with hmac.compare_digest against both configured tokens."""
    calls = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    both = [(WRONG.encode(), TOKEN.encode()), (WRONG.encode(), READ_TOKEN.encode())]
    assert env.http.get("/v1/status", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 403
    assert calls == both
    calls.clear()
    assert env.http.get("/v1/status", headers=API_AUTH).status_code == 200
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (TOKEN.encode(), READ_TOKEN.encode())]
    calls.clear()
    assert env.http.post("/v1/sync", json={"version_id": VERSION},
                         headers=READ_AUTH).status_code == 403
    assert calls == [(READ_TOKEN.encode(), TOKEN.encode()),
                     (READ_TOKEN.encode(), READ_TOKEN.encode())]


@contextlib.contextmanager
def app_warnings() -> Iterator[list[str]]:
    """The warnings ``alignd.api.app`` logs meanwhile, from a handler on that logger itself (the
    root's handlers may carry a repeat filter that holds back a message seen shortly before)."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("alignd.api.app")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_open_reads_opens_reads_only_and_dev_mode_opens_both(redis_url, tmp_path):
    """open_reads: reads without a token, writes still 401. dev_mode and no token: both open.
    Either is logged when the app is made."""
    store = tmp_path / "store"
    publish_files(store, VERSION)
    with app_warnings() as seen:
        opened = create_app(api_settings(redis_url, store, open_reads=True))
    assert [w for w in seen if "read routes are open (open_reads)" in w], seen
    with TestClient(opened) as http:
        assert http.get("/v1/status").status_code == 200
        assert http.get(f"/v1/versions/{VERSION}").status_code == 404  # not registered
        r = http.post("/v1/versions", json={"version_id": VERSION})
        assert r.status_code == 401 and _code(r) == "unauthorized"
        assert http.get("/v1/status", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 200
    with app_warnings() as seen:
        dev = create_app(api_settings(redis_url, store, api_token=None, dev_mode=True))
    assert [w for w in seen if "read routes are open (dev mode, no token)" in w], seen
    assert [w for w in seen if "mutating routes are open" in w], seen
    with TestClient(dev) as http:
        assert http.post("/v1/versions", json={"version_id": VERSION}).status_code == 201
        assert http.get(f"/v1/versions/{VERSION}").status_code == 200
    with app_warnings() as seen:
        create_app(api_settings(redis_url, store))
    assert seen == []  # a token and no open_reads: nothing is open


def test_metrics_are_open_and_hold_no_data(env):
    """/metrics without a token: route templates, states and counts; no id, meta, path or host."""
    assert env.http.get(f"/v1/versions/{VERSION}", headers=READ_AUTH).status_code == 200
    text = env.http.get("/metrics").text
    assert 'route="/v1/versions/{version_id}"' in text  # the request above, by its template
    heartbeat = next(k.decode() for k in env.raw.keys("*heartbeat*"))
    name = heartbeat.rsplit(":", 1)[-1]
    for leak in (VERSION, ROLLOUT, SECRET, str(env.store), name):
        assert leak not in text, leak


def test_client_and_cli_read_with_a_token(redis_url, tmp_path):
    """AlignClient: no token -> UnauthorizedError on reads, health open; read token -> reads,
    ForbiddenError on writes. alignd status: exit 2 without a token, 0 with --token or the env."""
    store = tmp_path / "store"
    publish_files(store, VERSION)
    app = create_app(api_settings(redis_url, store, read_token=READ_TOKEN))
    runner = CliRunner()
    with serve(app) as url:
        with AlignClient(url, token=TOKEN, retries=0) as writer:
            writer.publish_version(VERSION, meta={"note": SECRET})
        with AlignClient(url, retries=0) as anon:
            assert anon.healthz().status == "ok" and "libalign_" in anon.metrics()
            with pytest.raises(UnauthorizedError):
                anon.get_status()
            with pytest.raises(UnauthorizedError):
                anon.get_version(VERSION)
        with AlignClient(url, token=READ_TOKEN, retries=0) as reader:
            assert reader.get_version(VERSION).version.meta["note"] == SECRET
            assert reader.get_status().versions_by_state["published"] == 1
            with pytest.raises(ForbiddenError, match="ALIGN_API_TOKEN"):
                reader.sync_version(VERSION)
        env = {"ALIGN_READ_TOKEN": None, "ALIGN_API_TOKEN": None}  # unset
        res = runner.invoke(cli, ["status", "--url", url], env=env)
        assert res.exit_code == 2 and "UnauthorizedError" in res.output, res.output
        res = runner.invoke(cli, ["status", "--url", url, "--token", READ_TOKEN], env=env)
        assert res.exit_code == 0 and "published 1" in res.output, res.output
        res = runner.invoke(cli, ["status", "--url", url, "--json"],
                            env={**env, "ALIGN_READ_TOKEN": READ_TOKEN})
        assert res.exit_code == 0 and '"published": 1' in res.output, res.output
        res = runner.invoke(cli, ["status", "--url", url, "--json"],
                            env={**env, "ALIGN_API_TOKEN": TOKEN})
        assert res.exit_code == 0, res.output
