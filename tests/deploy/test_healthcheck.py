"""deploy/healthcheck.py (``align-healthcheck`` in the images), run as the container runs it.

HTTP mode against the services' own metrics server (healthy, unhealthy, nobody listening);
heartbeat mode against a private password-protected redis-server with the services' own
ServiceHeartbeat (live, another service, stopped, wrong password).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.telemetry import serve_metrics
from prometheus_client import CollectorRegistry

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"
REDIS_SERVER = shutil.which("redis-server")


def run_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The script as a process, with only PATH and ``env`` in its environment."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=full, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def metrics_server():
    """``start(healthy) -> port`` of the services' metrics server (stopped afterwards)."""
    servers = []

    def start(healthy: bool) -> int:
        server = serve_metrics(CollectorRegistry(), 0, "127.0.0.1", healthy=lambda: healthy)
        servers.append(server)
        return server.server_port

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_default_url_follows_the_services_settings():
    """ALIGN_METRICS_PORT set: its /healthz; else the API's /readyz on ALIGN_API_PORT (8000)."""
    spec = importlib.util.spec_from_file_location("align_healthcheck", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.default_url({"ALIGN_METRICS_PORT": "9101"}) == "http://127.0.0.1:9101/healthz"
    assert mod.default_url({"ALIGN_API_PORT": "8123"}) == "http://127.0.0.1:8123/readyz"
    assert mod.default_url({}) == "http://127.0.0.1:8000/readyz"


def test_http_mode_healthy_unhealthy_and_down(metrics_server):
    """Exit 0 on the server's 200, 1 on its 503 and 1 when nothing listens; the line says why."""
    up = metrics_server(True)
    r = run_check(env={"ALIGN_METRICS_PORT": str(up)})
    assert r.returncode == 0 and r.stdout.startswith("healthy:") and "HTTP 200" in r.stdout
    sick = metrics_server(False)
    r = run_check("--url", f"http://127.0.0.1:{sick}/healthz")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy:") and "HTTP 503" in r.stdout
    t0 = time.monotonic()
    r = run_check("--url", f"http://127.0.0.1:{free_port()}/healthz", "--timeout", "1")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy:")
    assert time.monotonic() - t0 < 10


@pytest.fixture
def redis_with_password(tmp_path):
    """A private redis-server that requires a password, as in docker-compose.yml."""
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI (./dev.sh test installs it)")
        pytest.skip("redis-server is not installed (./dev.sh test installs it)")
    port, password = free_port(), "s3cret-pw"
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", password, "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.02)
    try:
        yield client, f"redis://:{password}@127.0.0.1:{port}/0", port
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_heartbeat_mode(redis_with_password):
    """Healthy while this host's learner beats; not for another service, not once it stopped,
    not with a wrong password, not without ALIGN_REDIS_URL."""
    client, url, port = redis_with_password
    env = {"ALIGN_REDIS_URL": url}
    r = run_check("--heartbeat", "learner", env=env)
    assert r.returncode == 1 and "no live learner heartbeat" in r.stdout
    beat = ServiceHeartbeat(client, "learner", "run-7", period_s=0.2, ttl_s=5.0).start()
    try:
        deadline = time.monotonic() + 5
        while beat.beats == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = run_check("--heartbeat", "learner", env=env)
        assert r.returncode == 0, r.stdout
        assert "learner run-7" in r.stdout and socket.gethostname() in r.stdout
        assert run_check("--heartbeat", "sampler", env=env).returncode == 1
        bad = run_check("--heartbeat", "learner",
                        env={"ALIGN_REDIS_URL": f"redis://:wrong@127.0.0.1:{port}/0"})
        assert bad.returncode == 1 and "Redis" in bad.stdout
        other_prefix = run_check("--heartbeat", "learner", env={**env, "ALIGN_KEY_PREFIX": "x"})
        assert other_prefix.returncode == 1
    finally:
        beat.stop()
    r = run_check("--heartbeat", "learner", env=env)
    assert r.returncode == 1 and "run-7 stopped" in r.stdout
    r = run_check("--heartbeat", "learner")
    assert r.returncode == 1 and "ALIGN_REDIS_URL is not set" in r.stdout
