"""Pins the control API: every route's contract, bad input as typed 4xx, nothing half done.

Runs the FastAPI app in process (``TestClient``) against a real redis-server and a
temporary weight store holding a tiny published BF16 version.
"""

from __future__ import annotations

import math
import time

import pytest
import redis
import torch
from alignclient.errors import ConfigError
from alignclient.framing import decode_frames
from alignclient.models import spec_sha256
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.events import PublishedEvent, SyncEvent, sync_stream
from alignd.infra.registry import Registry
from alignd.infra.telemetry import Metrics
from fastapi.testclient import TestClient

from libalign.metrics import delta_stats, tis_weights
from libalign.spec import PRESETS
from tests.services.api_server import TOKEN, api_settings, publish_files
from tests.services.conftest import free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SAMPLER, LEARNER = "nvfp4_minite", "bf16"


def rollout(rid: str, n: int = 4, prompt: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lp = (-0.5 - torch.rand(n, generator=g, dtype=torch.float64) * 2.5).tolist()
    return {"rollout_id": rid, "prompt_len": prompt, "tokens": list(range(prompt + n)),
            "logprobs": lp, "reward": 1.0, "path": SAMPLER, "guidance": False}


def score(r: dict, shift: float = 0.01) -> dict:
    return {"rollout_id": r["rollout_id"], "logprobs": [x - shift for x in r["logprobs"]],
            "path": LEARNER}


@pytest.fixture
def env(redis_url, tmp_path):
    """A running app (lifespan on) with version v1 in the published store, not yet registered."""
    store = tmp_path / "store"
    publish_files(store, "v1")
    settings = api_settings(redis_url, store)
    metrics = Metrics()
    app = create_app(settings, metrics=metrics, redis_give_up_s=0.3)
    raw = redis.Redis.from_url(redis_url)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield type("Env", (), dict(http=http, settings=settings, metrics=metrics, store=store,
                                   raw=raw, app=app,
                                   registry=Registry(RedisBus(connect(redis_url)),
                                                     settings.key_prefix)))
    raw.close()


def data_keys(raw: redis.Redis) -> set[bytes]:
    """Every key except the liveness bookkeeping that changes on its own."""
    return {k for k in raw.keys("*") if b":heartbeat" not in k}


def assert_error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "type", "message"}
    assert body["error"]["code"] == code, body
    assert "Traceback" not in resp.text
    return body["error"]


def publish(env, vid: str = "v1", **body):
    return env.http.post("/v1/versions", json={"version_id": vid, **body}, headers=AUTH)


def drive(env, vid: str, *states: str) -> None:
    for s in states:
        env.registry.transition(vid, s, actor="test")


# --- start-up, health ----------------------------------------------------------------


def test_create_app_needs_a_token_unless_dev_mode(redis_url, tmp_path):
    """No token and no dev mode: ConfigError; dev mode runs without one and leaves POSTs open."""
    with pytest.raises(ConfigError, match="ALIGN_API_TOKEN"):
        create_app(api_settings(redis_url, tmp_path, api_token=None))
    app = create_app(api_settings(redis_url, tmp_path, api_token=None, dev_mode=True))
    with TestClient(app) as http:
        r = http.post("/v1/spec/check", json={"sha256": spec_sha256(PRESETS["minite"].to_dict())})
        assert r.status_code == 200


def test_health_and_readiness(env):
    """/healthz is the process; /readyz pings Redis."""
    assert env.http.get("/healthz").json() == {"status": "ok"}
    assert env.http.get("/readyz").json() == {"status": "ready", "redis": True}


def test_redis_down_is_503_bus_unavailable(tmp_path):
    """Redis unreachable: readiness and data routes answer 503 bus_unavailable within the budget."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    app = create_app(api_settings(url, tmp_path), redis_give_up_s=0.2)
    with TestClient(app, raise_server_exceptions=False) as http:
        t = time.monotonic()
        assert_error(http.get("/readyz"), 503, "bus_unavailable")
        assert_error(http.get("/v1/versions", headers=AUTH), 503, "bus_unavailable")
        assert_error(http.post("/v1/versions", json={"version_id": "v1"}, headers=AUTH), 404,
                     "version_not_found")  # the store is checked before Redis
        assert time.monotonic() - t < 5
        assert http.get("/healthz").status_code == 200
        assert http.get("/metrics").status_code == 200  # counters still served


# --- versions --------------------------------------------------------------------------


def test_publish_registers_and_announces_once(env):
    """201 with the record; one published event on the stream; a second publish is 409 and adds nothing."""
    r = publish(env, meta={"step": 7}, target_path=SAMPLER)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["version"]["state"] == "published"
    assert body["version"]["meta"] == {"step": 7, "target_path": SAMPLER}
    assert body["stream"] == env.settings.published_stream
    entries = env.raw.xrange(env.settings.published_stream)
    assert len(entries) == 1 and entries[0][0].decode() == body["event_id"]
    ev = PublishedEvent.from_fields({k.decode(): v.decode() for k, v in entries[0][1].items()})
    assert ev.version_id == "v1" and ev.path == str(env.store / "published" / "v1")
    assert ev.target_path == SAMPLER
    assert_error(publish(env), 409, "version_exists")
    assert len(env.raw.xrange(env.settings.published_stream)) == 1
    detail = env.http.get("/v1/versions/v1", headers=AUTH).json()
    assert [h["to_state"] for h in detail["history"]] == ["published"]
    assert detail["history"][0]["actor"] == "api"


def test_publish_refuses_missing_and_incomplete_versions(env):
    """No directory: 404; an index naming an absent shard: 422 missing_shard; Redis untouched."""
    before = data_keys(env.raw)
    assert_error(publish(env, "v9"), 404, "version_not_found")
    broken = publish_files(env.store, "v2")
    next(broken.glob("model-*.safetensors")).unlink()
    err = assert_error(publish(env, "v2"), 422, "missing_shard")
    assert "model-00001" in err["message"]
    (env.store / "published" / "v3").mkdir()
    assert_error(publish(env, "v3"), 422, "invalid_layout")
    assert data_keys(env.raw) == before
    assert env.registry.list_versions() == []


def test_publish_with_a_broken_stream_leaves_no_record(env):
    """The event cannot be written (stream key of another type): 500 invalid_config, no record."""
    env.raw.set(env.settings.published_stream, b"not a stream")
    assert_error(publish(env), 500, "invalid_config")
    assert not env.raw.exists(f"{env.settings.key_prefix}:version:v1")
    assert env.registry.list_versions() == []


def test_list_and_get_versions(env):
    """List oldest first with state filter and limit; get returns record and history; unknown 404."""
    publish_files(env.store, "v2")
    assert publish(env, "v1").status_code == 201
    assert publish(env, "v2").status_code == 201
    drive(env, "v1", "converting")
    ids = [v["version_id"] for v in env.http.get("/v1/versions", headers=AUTH).json()["versions"]]
    assert ids == ["v1", "v2"]
    first = env.http.get("/v1/versions?limit=1", headers=AUTH).json()["versions"]
    assert [v["version_id"] for v in first] == ["v2"]
    conv = env.http.get("/v1/versions", params={"state": "converting"}, headers=AUTH).json()["versions"]
    assert [v["version_id"] for v in conv] == ["v1"]
    hist = env.http.get("/v1/versions/v1", headers=AUTH).json()["history"]
    assert [(h["from_state"], h["to_state"]) for h in hist] == [("", "published"),
                                                               ("published", "converting")]
    assert_error(env.http.get("/v1/versions/nope", headers=AUTH), 404, "version_not_found")


def test_sync_needs_a_converted_version(env):
    """Before converted: 409; converted: 202 and one sync event on <prefix>:events:sync."""
    assert publish(env).status_code == 201
    err = assert_error(env.http.post("/v1/sync", json={"version_id": "v1"}, headers=AUTH), 409,
                       "illegal_transition")
    assert "converted" in err["message"]
    stream = sync_stream(env.settings.key_prefix)
    assert env.raw.xlen(stream) == 0
    drive(env, "v1", "converting", "converted")
    r = env.http.post("/v1/sync", json={"version_id": "v1"}, headers=AUTH)
    assert r.status_code == 202 and r.json()["stream"] == stream == "libalign:events:sync"
    (eid, fields), = env.raw.xrange(stream)
    ev = SyncEvent.from_fields({k.decode(): v.decode() for k, v in fields.items()})
    assert ev.version_id == "v1" and eid.decode() == r.json()["event_id"]
    assert_error(env.http.post("/v1/sync", json={"version_id": "zz"}, headers=AUTH), 404,
                 "version_not_found")


# --- rollouts, scores, discrepancy -------------------------------------------------------


def test_rollouts_scores_and_discrepancy(env):
    """δ = learner − sampler per token, summarized by libalign.metrics; duplicates never count twice."""
    assert publish(env).status_code == 201
    rs = [rollout(f"r{i}", n=5 + i, seed=i) for i in range(4)]
    r = env.http.post("/v1/versions/v1/rollouts", json={"rollouts": rs}, headers=AUTH)
    assert r.status_code == 201 and r.json() == {"version_id": "v1", "stored": 4, "tokens": 26}
    ids = env.http.get("/v1/versions/v1/rollouts", headers=AUTH).json()["rollout_ids"]
    assert ids == ["r0", "r1", "r2", "r3"]
    got = env.http.get("/v1/versions/v1/rollouts", params={"ids": "r2,r0"}, headers=AUTH).json()["rollouts"]
    assert [g["rollout_id"] for g in got] == ["r2", "r0"] and got[1] == rs[0]

    shifts = [0.01, -0.3, 0.5, 0.0]
    scores = [score(r_, s) for r_, s in zip(rs, shifts, strict=True)]
    r = env.http.post("/v1/versions/v1/scores", json={"scores": scores}, headers=AUTH)
    assert r.status_code == 200, r.text
    summary = r.json()
    delta = torch.cat([torch.full((5 + i,), -s, dtype=torch.float64) for i, s in enumerate(shifts)])
    want = delta_stats(delta)
    assert summary["tokens"] == 26 and summary["duplicates"] == 0
    for k in ("mean_abs", "p50_abs", "p99_abs", "max_abs", "clip_potential", "k3_kl"):
        assert math.isclose(summary["stats"][k], getattr(want, k), rel_tol=1e-9, abs_tol=1e-12), k
    assert summary["stats"]["tis_truncated_fraction"] == tis_weights(delta).truncated_fraction
    assert [(p["learner_path"], p["sampler_path"]) for p in summary["by_path"]] == [(LEARNER, SAMPLER)]

    key = f"{env.settings.key_prefix}:delta:v1".encode()
    assert env.raw.strlen(key) == 4 * 26
    again = env.http.post("/v1/versions/v1/scores", json={"scores": scores}, headers=AUTH).json()
    assert again["duplicates"] == 4 and again["stats"] == summary["stats"]
    assert env.raw.strlen(key) == 4 * 26
    labels = {"learner_path": LEARNER, "sampler_path": SAMPLER}
    assert env.metrics.value("libalign_logprob_abs_delta_count", labels) == 26
    assert env.metrics.value("libalign_rollout_tokens_total", {"sampler_path": SAMPLER}) == 26

    d = env.http.get("/v1/discrepancy", params={"version": "v1", "window_tokens": 7}, headers=AUTH).json()
    assert d["stats"]["count"] == 7 and d["versions"] == ["v1"]
    last7 = delta[-7:].to(torch.float32).to(torch.float64)
    assert math.isclose(d["stats"]["mean_abs"], float(last7.abs().mean()), rel_tol=1e-6)
    recent = env.http.get("/v1/discrepancy", headers=AUTH).json()
    assert recent["version_id"] is None and recent["stats"]["count"] == 26
    assert recent["window_tokens"] == env.settings.discrepancy_window_tokens
    assert env.metrics.value("libalign_discrepancy_p99_abs", labels) > 0.49


def test_rollout_batches_are_all_or_nothing(env):
    """A batch naming one stored id is refused whole (409) and stores none of its others."""
    assert publish(env).status_code == 201
    assert env.http.post("/v1/versions/v1/rollouts", json={"rollouts": [rollout("a")]},
                         headers=AUTH).status_code == 201
    before = env.raw.hgetall(f"{env.settings.key_prefix}:rollouts:v1")
    err = assert_error(env.http.post("/v1/versions/v1/rollouts",
                                     json={"rollouts": [rollout("b"), rollout("a")]}, headers=AUTH),
                       409, "rollout_exists")
    assert "'a'" in err["message"]
    assert env.raw.hgetall(f"{env.settings.key_prefix}:rollouts:v1") == before
    assert_error(env.http.post("/v1/versions/v1/rollouts",
                               json={"rollouts": [rollout("c"), rollout("c")]}, headers=AUTH),
                 422, "invalid_input")
    assert_error(env.http.post("/v1/versions/v9/rollouts", json={"rollouts": [rollout("a")]},
                               headers=AUTH), 404, "version_not_found")


def test_scores_that_do_not_fit_are_refused_without_writing(env):
    """Unknown rollout: 404; wrong length: 422 naming the rollout; log-prob > 0 or NaN: 422."""
    assert publish(env).status_code == 201
    r0 = rollout("r0")
    assert env.http.post("/v1/versions/v1/rollouts", json={"rollouts": [r0]},
                         headers=AUTH).status_code == 201
    before = data_keys(env.raw)

    def post(scores, **kw):
        return env.http.post("/v1/versions/v1/scores", json={"scores": scores}, headers=AUTH, **kw)

    assert_error(post([score(r0), score(rollout("ghost"))]), 404, "rollout_not_found")
    short = dict(score(r0), logprobs=score(r0)["logprobs"][:-1])
    assert "'r0'" in assert_error(post([short]), 422, "invalid_shape")["message"]
    positive = dict(score(r0), logprobs=[0.5, *score(r0)["logprobs"][1:]])
    assert "logprobs.0" in assert_error(post([positive]), 422, "invalid_input")["message"]
    nan_body = ('{"scores": [{"rollout_id": "r0", "path": "bf16", "logprobs": [NaN, -1, -1, -1]}]}')
    assert_error(env.http.post("/v1/versions/v1/scores", content=nan_body,
                               headers={**AUTH, "Content-Type": "application/json"}),
                 422, "invalid_input")
    assert data_keys(env.raw) == before


# --- guidance ---------------------------------------------------------------------------


def test_guidance_put_get_batch_and_leases(env):
    """Bytes round-trip; the batch framing decodes; leases acquire and release; misses are 404."""
    assert publish(env).status_code == 201
    blobs = {f"r{i}": bytes([i]) * (1000 * (i + 1)) for i in range(3)}
    for rid, blob in blobs.items():
        r = env.http.put(f"/v1/guidance/v1/{rid}", content=blob, headers=AUTH)
        assert r.status_code == 200 and r.json()["bytes"] == len(blob)
    r = env.http.get("/v1/guidance/v1/r1", headers=AUTH)
    assert r.content == blobs["r1"] and r.headers["content-type"] == "application/octet-stream"
    r = env.http.post("/v1/guidance/v1:batch", json={"rollout_ids": ["r2", "r0"]}, headers=AUTH)
    assert r.status_code == 200
    got = decode_frames(r.content)
    assert list(got) == ["r2", "r0"] and got["r2"] == blobs["r2"] and got["r0"] == blobs["r0"]
    assert_error(env.http.post("/v1/guidance/v1:batch", json={"rollout_ids": ["r0", "zz"]},
                               headers=AUTH), 404, "guidance_not_found")
    skip = env.http.post("/v1/guidance/v1:batch", json={"rollout_ids": ["r0", "zz"],
                                                        "missing": "skip"}, headers=AUTH)
    assert list(decode_frames(skip.content)) == ["r0"]
    assert_error(env.http.get("/v1/guidance/v1/zz", headers=AUTH), 404, "guidance_not_found")
    lease = env.http.post("/v1/guidance/v1/lease", json={"consumer": "learner-0", "ttl_s": 30},
                          headers=AUTH)
    assert lease.json()["held"] is True
    status = env.http.get("/v1/status", headers=AUTH).json()
    assert status["guidance"]["leased_versions"] == ["v1"]
    assert status["guidance"]["stored_bytes"] == sum(map(len, blobs.values()))
    rel = env.http.delete("/v1/guidance/v1/lease", params={"consumer": "learner-0"}, headers=AUTH)
    assert rel.json()["held"] is True
    rel = env.http.delete("/v1/guidance/v1/lease", params={"consumer": "learner-0"}, headers=AUTH)
    assert rel.json()["held"] is False
    assert_error(env.http.put("/v1/guidance/v9/r0", content=b"x", headers=AUTH), 404,
                 "version_not_found")


def test_guidance_uploads_past_the_limit_are_refused_while_read(env):
    """Declared or chunked, a body over max_guidance_body_bytes is 413 and stores nothing."""
    assert publish(env).status_code == 201
    limit = env.settings.max_guidance_body_bytes
    before = data_keys(env.raw)
    assert_error(env.http.put("/v1/guidance/v1/r0", content=b"x" * (limit + 1), headers=AUTH),
                 413, "payload_too_large")

    def chunks():
        for _ in range(limit // 1000 + 2):
            yield b"y" * 1000

    err = assert_error(env.http.put("/v1/guidance/v1/r0", content=chunks(), headers=AUTH),
                       413, "payload_too_large")
    assert "guidance record upload" in err["message"]
    assert_error(env.http.put("/v1/guidance/v1/r0", content=b"", headers=AUTH), 422,
                 "invalid_input")
    assert data_keys(env.raw) == before
    ok = env.http.put("/v1/guidance/v1/r0", content=b"z" * limit, headers=AUTH)
    assert ok.status_code == 200


# --- bad input everywhere ----------------------------------------------------------------

BIG = "x" * (70 << 10)
JSON = {"Content-Type": "application/json"}

BAD = [
    # (method, url, request kwargs, status, code)
    ("post", "/v1/versions", dict(json={"version_id": "v1"}, headers={}), 401, "unauthorized"),
    ("post", "/v1/versions", dict(json={"version_id": "v1"},
                                  headers={"Authorization": "Bearer wrong"}), 403, "forbidden"),
    ("post", "/v1/versions", dict(json={"version_id": "v1"},
                                  headers={"Authorization": TOKEN}), 401, "unauthorized"),
    ("put", "/v1/guidance/v1/r0", dict(content=b"x", headers={}), 401, "unauthorized"),
    ("delete", "/v1/guidance/v1/lease?consumer=c", dict(headers={"Authorization": "Bearer x"}),
     403, "forbidden"),
    ("post", "/v1/versions", dict(content=b'{"version_id": ', headers={**AUTH, **JSON}), 400,
     "malformed_body"),
    ("post", "/v1/versions", dict(content=b"\xff\xfe", headers={**AUTH, **JSON}), 400,
     "malformed_body"),
    ("post", "/v1/versions", dict(json=["v1"], headers=AUTH), 422, "invalid_input"),
    ("post", "/v1/versions", dict(json={"version_id": 7}, headers=AUTH), 422, "invalid_input"),
    ("post", "/v1/versions", dict(json={"version_id": "../etc"}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions", dict(json={"version_id": "v1", "extra": 1}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions", dict(json={"version_id": "v1", "meta": BIG}, headers=AUTH), 413,
     "payload_too_large"),
    ("post", "/v1/versions", dict(content=iter([b'{"version_id": "', BIG.encode(), b'"}']),
                                  headers={**AUTH, **JSON}), 413, "payload_too_large"),
    ("post", "/v1/versions", dict(content=b"{}", headers={**AUTH, **JSON,
                                                           "Content-Length": "abc"}), 400,
     "malformed_body"),
    ("post", "/v1/sync", dict(json={}, headers=AUTH), 422, "invalid_input"),
    ("post", "/v1/versions/v1/rollouts", dict(json={"rollouts": []}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), prompt_len=0)]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), tokens=[1, 2, 3])]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), tokens="abc")]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), logprobs=[-1.0])]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a:b"))]}, headers=AUTH), 422, "invalid_input"),
    ("post", "/v1/versions/v1/scores", dict(json={"scores": "nope"}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), path="other")]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/rollouts",
     dict(json={"rollouts": [dict(rollout("a"), path="p" * 65)]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/v1/scores",
     dict(json={"scores": [dict(score(rollout("r0")), path="other")]}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/versions/bad$/scores", dict(json={"scores": [score(rollout("a"))]},
                                              headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions?limit=abc", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions?limit=0", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions?state=sleeping", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions/v1/rollouts?ids=,", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions/v1/rollouts?ids=a%3Ab", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/versions/v1/rollouts?ids=nope", dict(headers=AUTH), 404, "rollout_not_found"),
    ("get", "/v1/discrepancy?window_tokens=0", dict(headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/discrepancy?version=zz", dict(headers=AUTH), 404, "version_not_found"),
    ("get", "/v1/guidance/v1/a%3Ab", dict(headers=AUTH), 422, "invalid_input"),
    ("post", "/v1/guidance/v1/lease", dict(json={"consumer": "c", "ttl_s": -1}, headers=AUTH),
     422, "invalid_input"),
    ("post", "/v1/guidance/v1:batch", dict(json={"rollout_ids": []}, headers=AUTH), 422,
     "invalid_input"),
    ("post", "/v1/spec/check", dict(json={"sha256": "abc"}, headers=AUTH), 422, "invalid_input"),
    ("get", "/v1/nothing", dict(headers=AUTH), 404, "route_not_found"),
    ("patch", "/v1/versions", dict(headers=AUTH), 405, "method_not_allowed"),
]


@pytest.mark.parametrize(("method", "url", "kw", "status", "code"), BAD,
                         ids=[f"{m}-{u[:40]}-{s}" for m, u, _, s, _ in BAD])
def test_bad_input_is_a_typed_4xx_and_changes_nothing(env, method, url, kw, status, code):
    """Each bad request: its status and code in the typed body, never a 500, no key written."""
    assert publish(env).status_code == 201
    assert env.http.post("/v1/versions/v1/rollouts", json={"rollouts": [rollout("r0")]},
                         headers=AUTH).status_code == 201
    before = {k: env.raw.dump(k) for k in data_keys(env.raw)}
    events = env.raw.xlen(env.settings.published_stream)
    assert_error(getattr(env.http, method)(url, **kw), status, code)
    assert {k: env.raw.dump(k) for k in data_keys(env.raw)} == before
    assert env.raw.xlen(env.settings.published_stream) == events


def test_unexpected_errors_are_a_typed_500_without_traceback(env, monkeypatch):
    """A bug inside a route: 500 internal_error naming only the exception class."""
    st = env.app.state.align

    def boom(*a, **k):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(st.registry, "page", boom)
    err = assert_error(env.http.get("/v1/versions", headers=AUTH), 500, "internal_error")
    assert "RuntimeError" in err["message"] and "secret detail" not in err["message"]
    labels = {"route": "/v1/versions", "status_class": "5xx"}
    assert env.metrics.value("libalign_api_requests_total", labels) == 1


# --- spec, status, metrics ----------------------------------------------------------------


def test_spec_and_its_check(env):
    """The spec's SHA-256 over canonical JSON; a match is 200, a mismatch 409 naming both hashes."""
    spec = env.http.get("/v1/spec", headers=AUTH).json()
    assert spec["spec"] == PRESETS["minite"].to_dict()
    assert spec["sha256"] == spec_sha256(PRESETS["minite"].to_dict())
    assert (spec["sampler_path"], spec["learner_path"]) == (SAMPLER, LEARNER)
    ok = env.http.post("/v1/spec/check", json={"sha256": spec["sha256"]}, headers=AUTH)
    assert ok.json() == {"match": True, "sha256": spec["sha256"]}
    other = spec_sha256(PRESETS["te"].to_dict())
    err = assert_error(env.http.post("/v1/spec/check", json={"sha256": other}, headers=AUTH),
                       409, "spec_mismatch")
    assert spec["sha256"] in err["message"] and other in err["message"]


def test_status_with_zero_data(env):
    """An empty daemon: zero counts, no latest, an empty discrepancy, the API's own heartbeat."""
    s = env.http.get("/v1/status", headers=AUTH).json()
    assert set(s["versions_by_state"].values()) == {0} and set(s["latest"].values()) == {None}
    assert s["weight_version_lag"] == 0
    assert s["discrepancy"]["stats"]["count"] == 0 and s["discrepancy"]["stats"]["p99_abs"] is None
    assert s["guidance"]["stored_bytes"] == 0
    api = [x for x in s["services"] if x["service"] == "api"]
    assert len(api) == 1 and api[0]["up"] and api[0]["info"]["preset"] == "minite"


def test_status_and_metrics_follow_versions_to_serving(env):
    """Counts per state, lag, sync stage histogram observed once, route-template labels, no redirect."""
    publish_files(env.store, "v2")
    assert publish(env, "v1").status_code == 201
    assert publish(env, "v2").status_code == 201
    drive(env, "v1", "converting", "converted", "loading", "serving")
    s = env.http.get("/v1/status", headers=AUTH).json()
    assert s["versions_by_state"]["serving"] == 1 and s["versions_by_state"]["published"] == 1
    assert s["latest"]["serving"] == "v1" and s["latest"]["published"] == "v2"
    assert s["weight_version_lag"] == 1
    r = env.http.get("/metrics", follow_redirects=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'libalign_sync_stage_seconds_count{stage="total"} 1.0' in text
    env.http.get("/metrics")
    assert env.metrics.value("libalign_sync_stage_seconds_count", {"stage": "load"}) == 1
    assert env.metrics.value("libalign_weight_version_lag") == 1
    assert env.metrics.value("libalign_service_up", {"service": "api"}) == 1
    assert env.metrics.value("libalign_service_up", {"service": "sampler"}) == 0
    env.http.get("/v1/versions/v2", headers=AUTH)
    env.http.get("/v1/versions/nope", headers=AUTH)
    assert env.metrics.value("libalign_api_requests_total",
                             {"route": "/v1/versions/{version_id}", "status_class": "2xx"}) == 1
    assert env.metrics.value("libalign_api_requests_total",
                             {"route": "/v1/versions/{version_id}", "status_class": "4xx"}) == 1
    assert 'route="/v1/versions/v2"' not in env.http.get("/metrics").text
    drive(env, "v2", "converting", "converted", "loading", "serving")
    assert env.http.get("/v1/status", headers=AUTH).json()["weight_version_lag"] == 0
    assert env.metrics.value("libalign_sync_stage_seconds_count", {"stage": "total"}) == 2


def test_a_scrape_alone_reads_the_shared_state(env):
    """Without /v1/status: one /metrics reads Redis and carries the new sync, lag and services."""
    assert publish(env, "v1").status_code == 201
    drive(env, "v1", "converting", "converted", "loading", "serving")
    text = env.http.get("/metrics").text
    assert 'libalign_sync_stage_seconds_count{stage="total"} 1.0' in text
    assert "libalign_weight_version_lag 0.0" in text
    assert 'libalign_service_up{service="api"} 1.0' in text
    assert 'libalign_service_up{service="converter"} 0.0' in text
    assert 'libalign_sync_stage_seconds_count{stage="total"} 1.0' in env.http.get("/metrics").text


def test_status_page_is_served_self_contained(env):
    """GET / is one HTML page with inline script and style, no external resources."""
    r = env.http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "<canvas" in html and "/v1/status" in html and "/v1/discrepancy" in html
    assert "src=" not in html and "href=" not in html and "http" not in html.split("<script>")[0]


def test_embedded_client_object_is_accepted(redis_url, tmp_path):
    """create_app takes any redis.Redis-compatible client and derives the other decoding."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    app = create_app(api_settings(None, tmp_path), client=client)
    st = app.state.align
    assert st.text is client
    assert st.binary.connection_pool.connection_kwargs["decode_responses"] is False
    with TestClient(app) as http:
        assert http.get("/readyz").status_code == 200
        assert http.get("/v1/status", headers=AUTH).status_code == 200
    client.close()

