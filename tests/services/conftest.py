"""Fixtures of the service tests: private redis-server processes and tiny BF16 versions.

Each server is a real ``redis-server`` on a free port in a temporary directory, without
snapshots; a test that restarts Redis asks for a persistent one (append-only file, fsync
always), as a production deployment would run. Tests that need Redis are skipped, with
the reason, only when ``redis-server`` is not installed (``./dev.sh test`` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

REDIS_SERVER = shutil.which("redis-server")
if REDIS_SERVER is None and os.environ.get("CI"):
    # in CI a missing server is a set-up failure, never a reason to skip
    raise RuntimeError("redis-server is not installed; ./dev.sh test installs it")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (./dev.sh test installs it)")


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One private redis-server process that can be stopped and started again."""

    def __init__(self, workdir: Path, *, persistent: bool = False):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.persistent = persistent
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else \
            ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *aof, "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.log()}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        """Shut the server down (SIGTERM: flushes the append-only file) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        p = self.workdir / "redis.log"
        return p.read_text()[-2000:] if p.exists() else ""


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One server shared by the session (flushed before each test that uses it)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (./dev.sh test installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the shared server, emptied for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def private_redis(tmp_path) -> Iterator[RedisServer]:
    """A persistent server of this test's own, which the test may stop and start."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (./dev.sh test installs it)")
    server = RedisServer(tmp_path / "redis", persistent=True)
    server.start()
    yield server
    server.stop()


def tiny_experts(experts: int = 4, rows: int = 64, k: int = 128, layers: int = 1,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """A small MoE-like BF16 state dict: per-expert projections, a router, a norm, a stack."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for e in range(experts):
            for proj, shape in (("gate_proj", (rows, k)), ("up_proj", (rows, k)),
                                ("down_proj", (k, rows))):
                w = torch.randn(shape, generator=g) * (0.02 * (e + 1))
                sd[f"{p}.mlp.experts.{e}.{proj}.weight"] = w.to(torch.bfloat16)
        sd[f"{p}.mlp.gate.weight"] = torch.randn(experts, k, generator=g).to(torch.bfloat16)
        sd[f"{p}.input_layernorm.weight"] = torch.ones(k, dtype=torch.bfloat16)
        sd[f"{p}.self_attn.q_proj.weight"] = torch.randn(k, k, generator=g).to(torch.bfloat16)
    sd["model.layers.0.mlp.experts.gate_up_proj"] = (
        torch.randn(experts, 2 * rows, k, generator=g) * 0.05).to(torch.bfloat16)
    return sd


@pytest.fixture
def service_env(tmp_path) -> dict[str, str]:
    """Environment for a converter subprocess (settings are added per test)."""
    env = dict(os.environ)
    env.update({"ALIGN_STORE_DIR": str(tmp_path / "store"), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1"})
    return env


def stop_processes(*procs: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM every process that still runs (once), wait ``grace_s`` for each, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
