"""Bounded growth: what a read costs does not grow with the history.

Two APIs share one real redis-server under different key prefixes: one holds 10 versions, the
other 2,000 (registered straight through the registry, every tenth walked to ``serving``).
``GET /v1/status`` and ``GET /v1/versions?limit=50`` are timed through uvicorn on both,
alternately so that drift on a shared machine hits both alike; the p50 at 2,000 versions must
stay within 2x of the p50 at 10 (before paging it grew 6 -> 789 ms). The pages themselves are
pinned too: ``limit`` honoured, ``before`` walks every version once, the newest last.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import httpx
import pytest
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import Registry

from tests.services.api_server import TOKEN, api_settings, serve

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVING = ("converting", "converted", "loading", "serving")
REPEATS = 60


def fill(registry: Registry, n: int) -> list[str]:
    """Register ``n`` versions, every tenth walked to serving; returns their ids, oldest first."""
    vids = [f"v{i:05d}" for i in range(n)]
    for i, vid in enumerate(vids):
        registry.create(vid, f"/published/{vid}", actor="test")
        if i % 10 == 0:
            for s in SERVING:
                registry.transition(vid, s, actor="test")
    return vids


@contextlib.contextmanager
def api_on(redis_url: str, tmp_path, prefix: str, versions: int):
    """An API on its own key prefix holding ``versions`` versions; yields (client, ids)."""
    registry = Registry(RedisBus(connect(redis_url)), prefix)
    vids = fill(registry, versions)
    app = create_app(api_settings(redis_url, tmp_path / prefix, key_prefix=prefix))
    with serve(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        yield http, vids


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def timed(http: httpx.Client, route: str) -> float:
    t = time.perf_counter()
    r = http.get(route)
    elapsed = time.perf_counter() - t
    assert r.status_code == 200, r.text
    return elapsed


def test_pages_follow_the_cursor(redis_url, tmp_path):
    """``limit`` is honoured, ``next_before`` leads through every version once, newest page
    first; ``state`` filters the pages; an unknown cursor is 404, a bad one 422."""
    with api_on(redis_url, tmp_path, "paged", 137) as (http, vids):
        first = http.get("/v1/versions?limit=50").json()
        assert [v["version_id"] for v in first["versions"]] == vids[-50:]
        seen, before = [], None
        while True:
            q = "/v1/versions?limit=50" + (f"&before={before}" if before else "")
            page = http.get(q).json()
            assert len(page["versions"]) <= 50
            seen = [v["version_id"] for v in page["versions"]] + seen
            before = page["next_before"]
            if before is None:
                break
        assert seen == vids
        serving = http.get("/v1/versions?state=serving&limit=5").json()
        assert [v["version_id"] for v in serving["versions"]] == vids[::10][-5:]
        assert http.get("/v1/versions?before=v99999").status_code == 404
        assert http.get("/v1/versions?before=a/b").status_code == 422
        status = http.get("/v1/status").json()
        assert (status["versions_total"], status["versions_counted"]) == (137, 100)
        assert sum(status["versions_by_state"].values()) == 100
        assert status["latest"]["serving"] == "v00130"


@pytest.mark.slow
def test_reads_cost_the_page_not_the_history(redis_url, tmp_path):
    """p50 of /v1/status and /v1/versions?limit=50 at 2,000 versions within 2x of 10."""
    with (api_on(redis_url, tmp_path, "small", 10) as (small, _),
          api_on(redis_url, tmp_path, "big", 2_000) as (big, _)):
        p50 = {}
        for route in ("/v1/status", "/v1/versions?limit=50"):
            for http in (small, big):  # warm up: first-seen serving versions, connections
                timed(http, route)
            t_small, t_big = [], []
            for _ in range(REPEATS):
                t_small.append(timed(small, route))
                t_big.append(timed(big, route))
            p50[route] = (p50_ms(t_small), p50_ms(t_big))
        print({route: f"{a:.2f} ms at 10, {b:.2f} ms at 2,000" for route, (a, b) in p50.items()})
        for route, (at_10, at_2000) in p50.items():
            assert at_2000 <= 2 * at_10, (route, at_10, at_2000)
