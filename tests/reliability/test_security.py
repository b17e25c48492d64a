"""Pins the control API's security: schema fuzzing, bad inputs, tokens, secrets, the store's root.

The API runs under uvicorn on a free port against a private ``redis-server`` that needs a
password (``--requirepass``), with a temporary weight store holding a tiny published
version ``v1`` (registered). Pinned here:

* Schemathesis, from the API's own OpenAPI schema (``app.openapi()``): no generated
  request (valid and invalid by the schema, with and without the token) gets a 5xx;
  fixed seed (``derandomize``), no example database;
* oversize JSON and guidance bodies (declared and chunked) are 413, wrong content types
  and malformed JSON are 4xx, NaN and ±Infinity in log-probs, rewards and ttl_s are 422;
* traversal in version ids, rollout ids, consumer names and target paths is refused
  and nothing is read or written outside the store root (a valid version placed just
  outside it is never published; no file appears outside it);
* every mutating operation of the schema answers 401 without a token and 403 with a wrong
  one, before the body is read; the comparison is ``hmac.compare_digest``;
* neither the token nor the Redis password appears in any log record, in the output of
  the API as a process, or in any response;
* docker-compose.yml reaches Redis with a password.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
import redis
import schemathesis
import yaml
from alignd.api import middleware
from alignd.api.app import OPEN_ROUTES, create_app
from alignd.infra.settings import ApiSettings
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.services.api_server import api_settings, publish_files, serve
from tests.services.conftest import REDIS_SERVER, free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "sec-token-9f4e2a7c51b3d86e"
WRONG = "sec-wrong-0b1c2d3e4f5a6978"
REDIS_PASSWORD = "redis-pw-3c8e1f0a9b7d2e64"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SAMPLER = "nvfp4_minite"

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
pytestmark = needs_redis


def _schema() -> dict:
    """The API's OpenAPI schema (building the app connects to nothing)."""
    app = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_token="x",
                                 store_dir=Path("unused")))
    return app.openapi()


OPENAPI = _schema()
SCHEMA = schemathesis.openapi.from_dict(OPENAPI)
OPERATIONS = {op.definition.raw["operationId"]: op
              for op in (r.ok() for r in SCHEMA.get_all_operations())}
OPEN_OPERATIONS = {fn.__name__ for fn in OPEN_ROUTES}  # operation id = function name
MUTATING = sorted((m.upper(), p, o["operationId"]) for p, ops in OPENAPI["paths"].items()
                  for m, o in ops.items() if m.upper() in middleware.MUTATING)


@contextlib.contextmanager
def password_redis(workdir: Path) -> Iterator[str]:
    """A private redis-server that needs ``REDIS_PASSWORD``; yields its URL with the password."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--requirepass", REDIS_PASSWORD],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=REDIS_PASSWORD, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()
        yield f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def tree(root: Path) -> set[str]:
    """Every path under ``root``, relative."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The API served on a free port; v1 published and registered, one rollout stored.

    ``root`` holds the store (``root/box/store``) and, just outside it, a complete version
    at ``root/box/published/outside`` that a traversal would reach.
    """
    root = tmp_path_factory.mktemp("security")
    store = root / "box" / "store"
    publish_files(store, "v1")
    publish_files(root / "box", "outside")  # root/box/published/outside
    with password_redis(root / "redis") as url:
        app = create_app(api_settings(url, store, api_token=TOKEN), redis_give_up_s=0.3)
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            assert http.post("/v1/versions", json={"version_id": "v1"},
                             headers=AUTH).status_code == 201
            r = http.post("/v1/versions/v1/rollouts", headers=AUTH, json={"rollouts": [
                {"rollout_id": "r1", "prompt_len": 2, "tokens": [1, 2, 3, 4],
                 "logprobs": [-1.0, -2.0], "path": SAMPLER}]})
            assert r.status_code == 201, r.text
            yield type("Api", (), dict(url=base, http=http, root=root, store=store,
                                       redis_url=url))


def assert_4xx(resp: httpx.Response, status: int | None = None, code: str | None = None) -> None:
    """A typed client error (the given status and code, if any), nothing that echoes the token."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    if status is not None:
        assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "type", "message"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert TOKEN not in resp.text and WRONG not in resp.text and "Traceback" not in resp.text


# --- schemathesis ---------------------------------------------------------------------


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "anonymous"])
@pytest.mark.parametrize("operation_id", sorted(OPERATIONS))
def test_schemathesis_no_server_errors(api, operation_id, token):
    """Requests generated from the schema (valid and invalid) never get a 5xx."""
    op = OPERATIONS[operation_id]
    strategies = [op.as_strategy(generation_mode=GenerationMode.POSITIVE)]
    if op.body or op.path_parameters or op.query:
        strategies.append(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    seen: list[int] = []

    @settings(max_examples=25, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=st.one_of(strategies))
    def check(case):
        if token is None:
            case.headers = {k: v for k, v in (case.headers or {}).items()
                            if k.lower() != "authorization"}
        resp = case.call(base_url=api.url, headers=headers, timeout=30)
        seen.append(resp.status_code)
        case.validate_response(resp, checks=[not_a_server_error])

    check()
    assert seen and all(s < 500 for s in seen), seen
    if token is None and op.method.upper() in middleware.MUTATING:
        assert set(seen) <= {401, 404, 405}, seen
    elif token is None and operation_id not in OPEN_OPERATIONS:
        assert set(seen) == {401}, seen  # reads are guarded too, whatever the path holds


# --- bodies ----------------------------------------------------------------------------


def test_oversize_json_bodies_are_413_before_reading(api):
    """Declared or chunked, a JSON body over max_body_bytes (64 KiB here) is 413."""
    big = json.dumps({"version_id": "v1", "meta": {"x": "a" * (80 << 10)}}).encode()
    r = api.http.post("/v1/versions", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert_4xx(r, 413, "payload_too_large")

    def chunks():
        for _ in range(20):
            yield b" " * (8 << 10)

    r = api.http.post("/v1/versions/v1/rollouts", content=chunks(),
                      headers={**AUTH, "Content-Type": "application/json"})
    assert_4xx(r, 413, "payload_too_large")


def test_oversize_guidance_is_413_and_stores_nothing(api):
    """A guidance upload over max_guidance_body_bytes (32 KiB here), declared or chunked: 413, no record."""
    r = api.http.put("/v1/guidance/v1/big", content=b"\x01" * (40 << 10),
                     headers={**AUTH, "Content-Type": "application/octet-stream"})
    assert_4xx(r, 413, "payload_too_large")

    def chunks():
        for _ in range(10):
            yield b"\x02" * (8 << 10)

    r = api.http.put("/v1/guidance/v1/big2", content=chunks(),
                     headers={**AUTH, "Content-Type": "application/octet-stream"})
    assert_4xx(r, 413, "payload_too_large")
    for rid in ("big", "big2"):
        assert_4xx(api.http.get(f"/v1/guidance/v1/{rid}", headers=AUTH), 404)


@pytest.mark.parametrize("content_type,body", [
    ("text/plain", b'{"version_id": "v1"}'),
    ("application/x-www-form-urlencoded", b"version_id=v1"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--"),
    ("application/xml", b"<version_id>v1</version_id>"),
    ("application/json", b""),
], ids=["text", "form", "multipart", "xml", "empty-json"])
def test_wrong_content_types_are_4xx(api, content_type, body):
    """A JSON route given another media type (or nothing) answers a typed 4xx."""
    for path in ("/v1/versions", "/v1/sync", "/v1/spec/check", "/v1/versions/v1/scores"):
        assert_4xx(api.http.post(path, content=body, headers={**AUTH, "Content-Type": content_type}))


@pytest.mark.parametrize("body", [
    b'{"version_id": ', b'{"version_id": "v1",}', b"\xff\xfe\x00garbage", b"[" * 50_000,
    b'{"version_id": "v1"} trailing', b"null", b"[1, 2]", b'"v1"',
], ids=["truncated", "trailing-comma", "binary", "deep-nesting", "trailing-text", "null",
        "array", "string"])
def test_malformed_json_is_4xx(api, body):
    """Malformed JSON is 400 malformed_body (or 422 for a well-formed non-object), never a 5xx."""
    for path in ("/v1/versions", "/v1/versions/v1/rollouts", "/v1/guidance/v1:batch"):
        r = api.http.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert_4xx(r)
        assert r.status_code in (400, 422), r.text


def _rollout_text(logprob: str, reward: str = "1.0") -> bytes:
    return (f'{{"rollouts": [{{"rollout_id": "nf", "prompt_len": 2, "tokens": [1, 2, 3, 4], '
            f'"logprobs": [-1.0, {logprob}], "reward": {reward}, "path": "{SAMPLER}"}}]}}').encode()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_nan_and_inf_in_bodies_are_422(api, value):
    """Non-finite log-probs (rollouts and scores), rewards and lease ttl_s: 422 invalid_input."""
    jh = {**AUTH, "Content-Type": "application/json"}
    for body in (_rollout_text(value), _rollout_text("-1.0", reward=value)):
        assert_4xx(api.http.post("/v1/versions/v1/rollouts", content=body, headers=jh), 422,
                   "invalid_input")
    score = f'{{"scores": [{{"rollout_id": "r1", "logprobs": [-1.0, {value}], "path": "bf16"}}]}}'
    assert_4xx(api.http.post("/v1/versions/v1/scores", content=score.encode(), headers=jh), 422,
               "invalid_input")
    lease = f'{{"consumer": "c1", "ttl_s": {value}}}'
    assert_4xx(api.http.post("/v1/guidance/v1/lease", content=lease.encode(), headers=jh), 422,
               "invalid_input")
    ids = api.http.get("/v1/versions/v1/rollouts", headers=AUTH).json()["rollout_ids"]
    assert "nf" not in ids


# --- traversal -------------------------------------------------------------------------

TRAVERSALS = ["../x", "..", ".", "%2e%2e", "%2e%2e%2fx", "..%2f..%2fx", "%252e%252e", "/etc/passwd",
              "..\\x", "a\\..\\..\\x", "a/../../x", "../../published/outside", "~", "%00",
              "C:\\x", "v1/../v1"]


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_traversal_in_ids_is_refused_and_stays_inside_the_store(api, bad):
    """Version ids, rollout ids, consumers and target paths that escape: 4xx, nothing outside the root."""
    before_root, before_store = tree(api.root / "box"), tree(api.store)
    h = api.http
    jh = {**AUTH, "Content-Type": "application/json"}
    seg = bad  # sent as spelled; the client percent-encodes what a URL cannot hold
    responses = [
        h.post("/v1/versions", json={"version_id": bad}, headers=AUTH),
        h.post("/v1/versions", json={"version_id": "v1", "target_path": bad}, headers=AUTH),
        h.post("/v1/sync", json={"version_id": bad}, headers=AUTH),
        h.get(f"/v1/versions/{seg}", headers=AUTH),
        h.get(f"/v1/versions/{seg}/rollouts", headers=AUTH),
        h.get("/v1/versions/v1/rollouts", params={"ids": bad}, headers=AUTH),
        h.get("/v1/discrepancy", params={"version": bad}, headers=AUTH),
        h.post(f"/v1/versions/{seg}/rollouts", content=_rollout_text("-1.0"), headers=jh),
        h.post("/v1/versions/v1/rollouts", headers=AUTH, json={"rollouts": [
            {"rollout_id": bad, "prompt_len": 2, "tokens": [1, 2, 3], "logprobs": [-1.0],
             "path": SAMPLER}]}),
        h.post("/v1/versions/v1/rollouts", headers=AUTH, json={"rollouts": [
            {"rollout_id": "ok1", "prompt_len": 2, "tokens": [1, 2, 3], "logprobs": [-1.0],
             "path": bad}]}),
        h.post("/v1/versions/v1/scores", headers=AUTH, json={"scores": [
            {"rollout_id": bad, "logprobs": [-1.0], "path": "bf16"}]}),
        h.put(f"/v1/guidance/{seg}/r1", content=b"\x01" * 64,
              headers={**AUTH, "Content-Type": "application/octet-stream"}),
        h.put(f"/v1/guidance/v1/{seg}", content=b"\x01" * 64,
              headers={**AUTH, "Content-Type": "application/octet-stream"}),
        h.get(f"/v1/guidance/v1/{seg}", headers=AUTH),
        h.get(f"/v1/guidance/{seg}/r1", headers=AUTH),
        h.post("/v1/guidance/v1:batch", json={"rollout_ids": [bad]}, headers=AUTH),
        h.post("/v1/guidance/v1/lease", json={"consumer": bad, "ttl_s": 5}, headers=AUTH),
        h.delete("/v1/guidance/v1/lease", params={"consumer": bad}, headers=AUTH),
    ]
    for r in responses:
        sent = unquote(r.request.url.raw_path.decode())
        if r.status_code < 400 and f"{{{bad}}}" not in "{" + sent.replace("/", "}{") + "}":
            continue  # the client normalised the segment away ("." or ".."): the server never saw it
        assert 400 <= r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text)
        assert TOKEN not in r.text
    assert tree(api.root / "box") - before_root <= {f"store/{p}" for p in tree(api.store)}
    assert tree(api.store) == before_store
    versions = [v["version_id"] for v in h.get("/v1/versions", headers=AUTH).json()["versions"]]
    assert versions == ["v1"]


def test_shard_names_in_an_index_cannot_leave_the_version(api):
    """A published index naming a shard outside its directory: publish is 422 invalid_layout."""
    vdir = publish_files(api.store, "evil")
    index = vdir / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    outside = api.root / "box" / "published" / "outside"
    target = next(outside.glob("model-*.safetensors"))
    for shard in (f"../../../published/outside/{target.name}", str(target)):
        data["weight_map"] = dict.fromkeys(data["weight_map"], shard)
        index.write_text(json.dumps(data))
        r = api.http.post("/v1/versions", json={"version_id": "evil"}, headers=AUTH)
        assert_4xx(r, 422, "invalid_layout")
    listed = api.http.get("/v1/versions", headers=AUTH).json()["versions"]
    assert "evil" not in [v["version_id"] for v in listed]


# --- authentication --------------------------------------------------------------------


def _fill(path: str) -> str:
    return path.replace("{version_id}", "v1").replace("{rollout_id}", "r1")


def test_the_schema_has_the_mutating_operations_we_expect():
    """The enumeration below covers every POST/PUT/PATCH/DELETE operation of the schema."""
    assert {op for _, _, op in MUTATING} >= {
        "publish_version", "sync_version", "put_rollouts", "put_scores", "put_guidance",
        "get_guidance_batch", "acquire_guidance_lease", "release_guidance_lease", "check_spec"}


@pytest.mark.parametrize("method,path,operation_id", MUTATING, ids=[m[2] for m in MUTATING])
def test_every_mutating_operation_needs_the_token(api, method, path, operation_id):
    """No Authorization or not Bearer: 401; a wrong token (or one a byte off): 403; even with a bad body."""
    url = _fill(path)
    params = {"consumer": "c1"} if operation_id == "release_guidance_lease" else None
    body = b"{not json"
    cases = [({}, 401, "unauthorized"),
             ({"Authorization": f"Basic {TOKEN}"}, 401, "unauthorized"),
             ({"Authorization": "Bearer"}, 401, "unauthorized"),
             ({"Authorization": f"Bearer {WRONG}"}, 403, "forbidden"),
             ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 403, "forbidden"),
             ({"Authorization": f"Bearer {TOKEN}x"}, 403, "forbidden")]
    for headers, status, code in cases:
        r = api.http.request(method, url, params=params, content=body,
                             headers={**headers, "Content-Type": "application/json"})
        assert_4xx(r, status, code)
        assert "authorization" not in {k.lower() for k in r.headers}


def test_token_compare_is_constant_time(api, monkeypatch):
    """The front door compares tokens with hmac.compare_digest (source and a spy on a request)."""
    src = inspect.getsource(middleware.Frontdoor._auth_error)
    assert "hmac.compare_digest(" in src
    assert not re.search(r"(==|!=)\s*self\.token|self\.token\s*(==|!=)", src)
    calls = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    r = api.http.post("/v1/spec/check", json={"sha256": "0" * 64},
                      headers={"Authorization": f"Bearer {WRONG}"})
    assert r.status_code == 403
    assert calls == [(WRONG.encode(), TOKEN.encode())]


# --- secrets ---------------------------------------------------------------------------


def _requests(http: httpx.Client | TestClient) -> list:
    """A spread of requests: good and bad tokens, bad bodies, 404s, Redis work."""
    bad = {"Authorization": f"Bearer {WRONG}"}
    return [
        http.get("/healthz"), http.get("/readyz"), http.get("/metrics"),
        http.get("/v1/status", headers=AUTH), http.get("/v1/status", headers=bad),
        http.post("/v1/versions", json={"version_id": "v1"}, headers=AUTH),
        http.post("/v1/versions", json={"version_id": "v1"}, headers=bad),
        http.post("/v1/versions", json={"version_id": "nope"}, headers=AUTH),
        http.post("/v1/versions", content=b"{bad", headers={**AUTH, "Content-Type": "application/json"}),
        http.post("/v1/sync", json={"version_id": "v1"}, headers={"Authorization": TOKEN}),
        http.get("/v1/versions/zz", headers=AUTH), http.get("/nowhere", headers=AUTH),
        http.put("/v1/guidance/v1/r1", content=b"\x00" * 128, headers=AUTH),
        http.put("/v1/guidance/v1/r1", content=b"\x00" * (40 << 10), headers=AUTH),
    ]


def _no_secret(text: str, where: str) -> None:
    for secret in (TOKEN, WRONG, REDIS_PASSWORD):
        assert secret not in text, f"{secret!r} appears in {where}"


def test_secrets_never_logged_in_process(api, caplog, capfd, tmp_path):
    """Every log record (DEBUG and up, all loggers) and stdout/stderr: no token, no Redis password."""
    caplog.set_level(logging.DEBUG)
    responses = _requests(api.http)
    # an API whose Redis (URL with a password) is down: errors and warnings get logged
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"
    app = create_app(api_settings(url, tmp_path, api_token=TOKEN), redis_give_up_s=0.2)
    with TestClient(app, raise_server_exceptions=False) as http:
        down = _requests(http)
    assert any(r.status_code == 503 for r in down)
    for r in responses + down:
        _no_secret(r.text + json.dumps(dict(r.headers)), f"a response to {r.request.url}")
    text = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records)
    _no_secret(text, "the log records")
    out, err = capfd.readouterr()
    _no_secret(out + err, "stdout/stderr")


def test_secrets_never_logged_by_the_api_process(api, tmp_path):
    """``python -m alignd.api.main`` (INFO logging, uvicorn) prints neither secret."""
    port = free_port()
    env = dict(os.environ, ALIGN_REDIS_URL=api.redis_url, ALIGN_API_TOKEN=TOKEN,
               ALIGN_STORE_DIR=str(api.store), ALIGN_API_PORT=str(port), ALIGN_API_HOST="127.0.0.1",
               ALIGN_MAX_GUIDANCE_BODY_BYTES=str(32 << 10), PYTHONUNBUFFERED="1")
    log = tmp_path / "api.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "alignd.api.main"], env=env, cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        with httpx.Client(base_url=base, timeout=30) as http:
            for r in _requests(http):
                _no_secret(r.text + json.dumps(dict(r.headers)), f"a response to {r.request.url}")
    finally:
        proc.terminate()
        proc.wait(20)
    text = log.read_text()
    assert "Uvicorn running" in text or "Application startup complete" in text, text[-2000:]
    _no_secret(text, "the API process's output")


# --- deployment ------------------------------------------------------------------------


def test_compose_reaches_redis_with_a_password():
    """Every ALIGN_REDIS_URL in docker-compose.yml carries ${REDIS_PASSWORD}; redis runs --requirepass."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    urls = []
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        if "ALIGN_REDIS_URL" in env:
            urls.append((name, env["ALIGN_REDIS_URL"]))
    assert {"api", "converter", "sampler", "learner", "sampler-cpu", "learner-cpu"} <= {n for n, _ in urls}
    for name, u in urls:
        assert re.match(r"^redis://:\$\{REDIS_PASSWORD[}:]", u), (name, u)
    cmd = compose["services"]["redis"]["command"]
    cmd = cmd if isinstance(cmd, list) else cmd.split()
    i = cmd.index("--requirepass")
    assert cmd[i + 1].startswith("${REDIS_PASSWORD"), cmd
    raw = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"redis://[^:\s]*@|redis://redis:", raw), "a Redis URL without a password"
