"""Poison inputs: values JSON allows but no later read could serve, refused at the door.

Each poison is posted to the in-process app (``TestClient``, a real redis-server): it must
answer a typed 4xx, leave every Redis key and the published stream as they were, and every
read route must still answer 200 afterwards. Then records no request can write any more
(a ``meta`` nested 999 deep, a record with an unknown state, garbage history, a rollout that
no longer validates, inf in a δ string) are written straight into Redis: the read routes
stay 2xx or a typed 4xx.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis
from alignclient.errors import InputError
from alignclient.models import (
    FLOAT32_MAX,
    MAX_LEASE_TTL_S,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MIN_LEASE_TTL_S,
)
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import Registry
from fastapi.testclient import TestClient

from tests.services.api_server import TOKEN, api_settings, publish_files

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
SAMPLER, LEARNER = "nvfp4_minite", "bf16"
READS = ["/v1/versions", "/v1/versions?limit=1", "/v1/versions/v1", "/v1/status",
         "/v1/discrepancy", "/v1/discrepancy?version=v1", "/v1/versions/v1/rollouts",
         "/v1/versions/v1/rollouts?ids=r0", "/metrics", "/healthz", "/readyz"]


def nested(depth: int) -> str:
    """A JSON object nested ``depth`` levels deep, as text (no recursion to build it)."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def rollout(rid: str, **over) -> dict:
    base = {"rollout_id": rid, "prompt_len": 2, "tokens": [5, 6, 7, 8],
            "logprobs": [-0.5, -1.5], "reward": 1.0, "path": SAMPLER}
    return {**base, **over}


def rollouts_text(**over) -> str:
    return json.dumps({"rollouts": [rollout("p1", **over)]})


def scores_text(logprobs: list[float]) -> str:
    return json.dumps({"scores": [{"rollout_id": "r0", "logprobs": logprobs, "path": LEARNER}]})


@pytest.fixture
def env(redis_url, tmp_path):
    """The app with v1 published and one rollout r0 stored and scored."""
    store = tmp_path / "store"
    publish_files(store, "v1")
    settings = api_settings(redis_url, store, max_body_bytes=1 << 20)
    raw = redis.Redis.from_url(redis_url)
    with TestClient(create_app(settings, redis_give_up_s=0.3), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"}) as http:  # reads need it too
        assert http.post("/v1/versions", json={"version_id": "v1", "meta": {"step": 1}},
                         headers=AUTH).status_code == 201
        assert http.post("/v1/versions/v1/rollouts", content=json.dumps(
            {"rollouts": [rollout("r0")]}), headers=AUTH).status_code == 201
        assert http.post("/v1/versions/v1/scores", content=scores_text([-0.6, -1.4]),
                         headers=AUTH).status_code == 200
        yield type("Env", (), dict(http=http, settings=settings, raw=raw))
    raw.close()


def snapshot(env) -> dict:
    """Every data key's dump (heartbeats change on their own) and the stream's length."""
    keys = {k: env.raw.dump(k) for k in env.raw.keys("*") if b":heartbeat" not in k}
    return {"keys": keys, "events": env.raw.xlen(env.settings.published_stream)}


def assert_reads_answer(env, ok=(200,)) -> None:
    for url in READS:
        r = env.http.get(url)
        assert r.status_code in ok, (url, r.status_code, r.text[:300])


#: (name, method, url, body text, status, code, words the message must hold)
POISON = [
    ("meta-depth-33", "post", "/v1/versions",
     '{"version_id": "v1", "meta": ' + nested(MAX_META_DEPTH + 1) + "}", 422, "invalid_input",
     ["meta", str(MAX_META_DEPTH)]),
    ("meta-depth-256", "post", "/v1/versions",
     '{"version_id": "v1", "meta": ' + nested(256) + "}", 422, "invalid_input", ["meta"]),
    ("meta-depth-999", "post", "/v1/versions",
     '{"version_id": "v1", "meta": ' + nested(999) + "}", 422, "invalid_input", ["meta"]),
    # (a parser whose stack is shorter than 999 frames refuses it earlier: 400 malformed_body)
    ("meta-64KiB+1", "post", "/v1/versions",
     json.dumps({"version_id": "v1", "meta": {"x": "y" * (MAX_META_BYTES - 7)}}), 422,
     "invalid_input", ["meta", str(MAX_META_BYTES)]),
    ("meta-NaN", "post", "/v1/versions", '{"version_id": "v1", "meta": {"x": NaN}}', 422,
     "invalid_input", ["meta"]),
    ("logprob--3.5e38", "post", "/v1/versions/v1/rollouts",
     rollouts_text(logprobs=[-3.5e38, -1.0]), 422, "invalid_input", ["logprobs"]),
    ("logprob--1e308", "post", "/v1/versions/v1/rollouts",
     rollouts_text(logprobs=[-1.0, -1e308]), 422, "invalid_input", ["logprobs"]),
    ("score--3.5e38", "post", "/v1/versions/v1/scores", scores_text([-3.5e38, -1.0]), 422,
     "invalid_input", ["logprobs"]),
    ("reward-1e308", "post", "/v1/versions/v1/rollouts", rollouts_text(reward=1e308), 422,
     "invalid_input", ["reward"]),
    ("reward--1e308", "post", "/v1/versions/v1/rollouts", rollouts_text(reward=-1e308), 422,
     "invalid_input", ["reward"]),
    ("reward-3.5e38", "post", "/v1/versions/v1/rollouts", rollouts_text(reward=3.5e38), 422,
     "invalid_input", ["reward"]),
    ("token-str", "post", "/v1/versions/v1/rollouts", rollouts_text(tokens=[5, 6, "3", 8]), 422,
     "invalid_input", ["tokens", "integer"]),
    ("token-true", "post", "/v1/versions/v1/rollouts", rollouts_text(tokens=[5, 6, True, 8]),
     422, "invalid_input", ["tokens", "integer"]),
    ("token-3.0", "post", "/v1/versions/v1/rollouts", rollouts_text(tokens=[5, 6, 3.0, 8]), 422,
     "invalid_input", ["tokens", "integer"]),
    ("prompt_len-2.0", "post", "/v1/versions/v1/rollouts", rollouts_text(prompt_len=2.0), 422,
     "invalid_input", ["prompt_len", "integer"]),
    ("prompt_len-str", "post", "/v1/versions/v1/rollouts", rollouts_text(prompt_len="2"), 422,
     "invalid_input", ["prompt_len", "integer"]),
    ("lease-5e-324", "post", "/v1/guidance/v1/lease", '{"consumer": "c", "ttl_s": 5e-324}', 422,
     "invalid_input", ["ttl_s"]),
    ("lease-0.5ms", "post", "/v1/guidance/v1/lease", '{"consumer": "c", "ttl_s": 0.0005}', 422,
     "invalid_input", ["ttl_s"]),
    ("lease-1day+1s", "post", "/v1/guidance/v1/lease",
     json.dumps({"consumer": "c", "ttl_s": MAX_LEASE_TTL_S + 1}), 422, "invalid_input", ["ttl_s"]),
    ("lease-1e308", "post", "/v1/guidance/v1/lease", '{"consumer": "c", "ttl_s": 1e308}', 422,
     "invalid_input", ["ttl_s"]),
]


@pytest.mark.parametrize(("method", "url", "body", "status", "code", "words"),
                         [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_poison_is_a_typed_4xx_writes_nothing_and_reads_still_answer(env, request, method, url,
                                                                    body, status, code, words):
    """The poison: its typed 4xx naming the field; not one key or event written; reads 200."""
    request_id = request.node.callspec.id
    if url == "/v1/versions":  # a fresh id, so a refusal is not the 409 of an existing one
        body = body.replace('"v1"', '"v9"', 1)
        publish_files(env.settings.store_dir, "v9")
    before = snapshot(env)
    r = getattr(env.http, method)(url, content=body, headers=AUTH)
    err = r.json()["error"]
    if r.status_code == 400 and "999" in request_id:
        assert err["code"] == "malformed_body", err
    else:
        assert r.status_code == status, r.text[:500]
        assert err["code"] == code and all(w in err["message"] for w in words), err
    assert snapshot(env) == before
    assert_reads_answer(env)


def test_the_limits_themselves_are_accepted_and_served(env):
    """meta exactly MAX_META_DEPTH deep, log-probs and rewards at ±FLOAT32_MAX, the lease bounds."""
    publish_files(env.settings.store_dir, "v2")
    r = env.http.post("/v1/versions", headers=AUTH,
                      content='{"version_id": "v2", "meta": ' + nested(MAX_META_DEPTH) + "}")
    assert r.status_code == 201, r.text[:300]
    assert env.http.get("/v1/versions/v2").json()["version"]["meta"]["a"]
    edge = rollout("edge", logprobs=[-FLOAT32_MAX, -1.0], reward=-FLOAT32_MAX)
    assert env.http.post("/v1/versions/v1/rollouts", content=json.dumps({"rollouts": [edge]}),
                         headers=AUTH).status_code == 201
    s = env.http.post("/v1/versions/v1/scores", headers=AUTH, content=json.dumps(
        {"scores": [{"rollout_id": "edge", "logprobs": [0.0, -FLOAT32_MAX], "path": LEARNER}]}))
    assert s.status_code == 200, s.text[:300]
    for ttl in (MIN_LEASE_TTL_S, MAX_LEASE_TTL_S):
        assert env.http.post("/v1/guidance/v1/lease", json={"consumer": "c", "ttl_s": ttl},
                             headers=AUTH).status_code == 200
    assert_reads_answer(env)
    d = env.http.get("/v1/discrepancy?version=v1").json()
    assert d["stats"]["count"] == 4  # the δ of ±3.4e38 stored finite in float32, and counted


def test_records_written_behind_the_api_never_break_the_reads(env):
    """Unservable records put straight into Redis: reads stay 2xx or a typed 4xx, never 5xx."""
    p = env.settings.key_prefix
    env.raw.hset(f"{p}:version:v1", "meta", nested(999))  # what publish stored before the limit
    assert_reads_answer(env)
    v1 = env.http.get("/v1/versions/v1").json()["version"]
    assert "meta_unreadable" in v1["meta"]
    listed = env.http.get("/v1/versions").json()["versions"]
    assert [v["version_id"] for v in listed] == ["v1"] and "meta_unreadable" in listed[0]["meta"]

    env.raw.hset(f"{p}:version:bad", mapping={"version_id": "bad", "state": "sleeping",
                                                "created_at": "x", "updated_at": "1"})
    env.raw.zadd(f"{p}:versions", {"bad": 1e12})
    env.raw.rpush(f"{p}:version:v1:history", "not json", json.dumps({"to": "x"}))
    env.raw.hset(f"{p}:rollouts:v1", "rx", b'{"rollout_id": "rx", "tokens": "garbage"}')
    inf = np.array([np.inf, -np.inf, np.nan], dtype="<f4").tobytes()
    env.raw.append(f"{p}:delta:v1", inf)
    assert_reads_answer(env)
    assert [v["version_id"] for v in env.http.get("/v1/versions").json()["versions"]] == ["v1"]
    bad = env.http.get("/v1/versions/bad")
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "version_not_found"
    assert "unreadable" in bad.json()["error"]["message"]
    assert len(env.http.get("/v1/versions/v1").json()["history"]) == 1
    rx = env.http.get("/v1/versions/v1/rollouts?ids=rx")
    assert rx.status_code == 404 and rx.json()["error"]["code"] == "rollout_not_found"
    assert env.http.get("/v1/discrepancy?version=v1").json()["stats"]["count"] == 2
    status = env.http.get("/v1/status").json()
    assert status["discrepancy"]["stats"]["count"] == 2
    assert sum(status["versions_by_state"].values()) == 1


def test_writers_behind_the_api_are_held_to_the_meta_limits(env, redis_url):
    """Registry.create and create_and_announce (the learner's own publish) refuse a poison meta."""
    registry = Registry(RedisBus(connect(redis_url)), env.settings.key_prefix)
    deep = json.loads(nested(MAX_META_DEPTH + 1))
    before = snapshot(env)
    with pytest.raises(InputError, match="MAX_META_DEPTH"):
        registry.create("v7", "/nowhere", meta=deep)
    with pytest.raises(InputError, match="MAX_META_BYTES"):
        registry.create_and_announce("v7", "/nowhere", env.settings.published_stream,
                                     {"version_id": "v7"}, meta={"x": "y" * MAX_META_BYTES})
    assert snapshot(env) == before
    assert_reads_answer(env)
