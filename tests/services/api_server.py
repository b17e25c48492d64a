"""Test helpers: the control API on a real port (uvicorn in a thread) and its fixtures' data."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from alignd.formats.published import write_published
from alignd.infra.settings import ApiSettings
from fastapi import FastAPI

from tests.services.conftest import free_port, tiny_experts

TOKEN = "test-token-0123456789"


def api_settings(redis_url: str | None, store: Path, **kw) -> ApiSettings:
    """Settings of a test API: small body limits, fast heartbeats, a token, no status cache
    (the tests read /v1/status right after changing Redis; tests/reliability/test_overload.py
    tests the cache)."""
    base = dict(redis_url=redis_url, store_dir=store, api_token=TOKEN, max_body_bytes=64 << 10,
                max_guidance_body_bytes=32 << 10, service_heartbeat_s=0.2,
                service_heartbeat_ttl_s=2.0, discrepancy_window_tokens=4096,
                guidance_budget_bytes=1 << 20, status_cache_s=0.0)
    base.update(kw)
    return ApiSettings(**base)


def publish_files(store: Path, version_id: str) -> Path:
    """Write a tiny BF16 version into the store's published directory (the learner's part)."""
    return write_published(store / "published", version_id,
                           tiny_experts(experts=2, rows=16, k=32))


@contextlib.contextmanager
def serve(app: FastAPI, port: int | None = None) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``port`` (default: a free one) in a thread; yields its base URL."""
    port = free_port() if port is None else port
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
