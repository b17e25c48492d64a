"""The deployment as separate processes: redis-server, api, converter, sampler and learner.

Each service runs as its own ``python -m services.<name>.main`` on loopback, configured only
through ``ALIGN_*`` variables, sharing one private redis-server and one weight-store
directory, exactly as ``docker compose`` runs them. The learner process runs one full
iteration (publish, convert, load, roll out with guidance, score, train) and exits 0; the
API then reports the version serving, every service's heartbeat and the discrepancy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import free_port, stop_processes
from .moved_time import wait_until

pytest.importorskip("transformers")

TOKEN = "test-token-0123456789"


def _spawn(module: str, env: dict, log, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_http(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")


def test_one_iteration_across_five_processes(private_redis, tmp_path):
    """api + converter + sampler + learner processes over one redis-server and one store."""
    port = free_port()
    env = dict(os.environ)
    env.update({
        "ALIGN_REDIS_URL": private_redis.url, "ALIGN_STORE_DIR": str(tmp_path / "store"),
        "ALIGN_API_PORT": str(port), "ALIGN_API_TOKEN": TOKEN, "ALIGN_SAMPLER_PATH": "nvfp4_minite",
        "ALIGN_LEARNER_PATH": "nvfp4_trace", "ALIGN_SAMPLER_NAME": "sampler-1",
        "ALIGN_CONSUMER_NAME": "converter-1", "ALIGN_BLOCK_MS": "100",
        "ALIGN_SERVICE_HEARTBEAT_S": "0.5", "ALIGN_SERVICE_HEARTBEAT_TTL_S": "5",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in  # noqa: SIM115 (closed below)
            ("api", "converter", "sampler", "learner")}
    procs = {
        "api": _spawn("alignd.api.main", env, logs["api"]),
        "converter": _spawn("alignd.converter.main", env, logs["converter"]),
        "sampler": _spawn("alignd.sampler.main", env, logs["sampler"]),
    }
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/readyz", time.monotonic() + 120)
        learner = subprocess.run(
            [sys.executable, "-m", "alignd.learner.main", "--steps", "1",
             "--prompts-per-step", "2", "--samples-per-prompt", "2", "--run-id", "proc"],
            env=env, capture_output=True, text=True, timeout=240)
        logs["learner"].write(learner.stdout + learner.stderr)
        assert learner.returncode == 0, learner.stderr[-3000:]
        step = json.loads(learner.stdout.strip().splitlines()[-1])
        assert step["version_id"] == "proc-00000" and step["delta"]["count"] > 0
        auth = {"Authorization": f"Bearer {TOKEN}"}  # reads need the token too
        status = httpx.get(f"{base}/v1/status", headers=auth, timeout=10).json()
        text = json.dumps(status)
        assert "proc-00000" in text and "serving" in text
        for service in ("api", "converter", "sampler"):
            assert service in text
        version = httpx.get(f"{base}/v1/versions/proc-00000", headers=auth, timeout=10).json()
        assert json.dumps(version).count("serving") >= 1
        disc = httpx.get(f"{base}/v1/discrepancy", params={"version": "proc-00000"},
                         headers=auth, timeout=10).json()
        assert "count" in json.dumps(disc)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert "libalign_" in metrics
        # nothing mutates without the token
        r = httpx.post(f"{base}/v1/sync", json={"version_id": "proc-00000"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"]
    finally:
        stop_processes(*procs.values())
        for f in logs.values():
            f.close()
    for name in ("converter", "sampler"):
        assert procs[name].returncode == 0, (tmp_path / f"{name}.log").read_text()[-3000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU-shim ranks; see tests/libalign/test_megatron_ep.py")
def test_megatron_learner_over_two_ranks_needs_no_converter(private_redis, tmp_path):
    """``learner --engine megatron --ep 2``: two rank processes train the tiny model's Megatron
    twin, each writes its part of every version, and a sampler process serves it with no
    converter running. SIGTERM to the learner ends it after the current step (exit 0), with
    both rank processes gone."""
    pytest.importorskip("megatron.core")
    from alignd.formats.weight_store import WeightStore
    from alignd.infra.bus import RedisBus
    from alignd.infra.registry import Registry
    from alignd.infra.settings import ServiceSettings

    env = dict(os.environ)
    env.update({
        "ALIGN_REDIS_URL": private_redis.url, "ALIGN_STORE_DIR": str(tmp_path / "store"),
        "ALIGN_SAMPLER_PATH": "nvfp4_minite", "ALIGN_LEARNER_PATH": "nvfp4_minite",
        "ALIGN_SAMPLER_NAME": "sampler-1", "ALIGN_BLOCK_MS": "100",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    with open(tmp_path / "sampler.log", "w") as log:
        sampler = _spawn("alignd.sampler.main", env, log)
        learner = subprocess.Popen(
            [sys.executable, "-m", "alignd.learner.main", "--engine", "megatron", "--ep", "2",
             "--steps", "50", "--prompts-per-step", "2", "--samples-per-prompt", "2",
             "--run-id", "ep"], env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        lines: list[str] = []
        ranks: list[int] = []
        try:
            deadline = time.monotonic() + 300
            while len(lines) < 2 and time.monotonic() < deadline:
                line = learner.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    lines.append(line)
            ranks = _children(learner.pid)
            learner.send_signal(signal.SIGTERM)
            rest, _ = learner.communicate(timeout=120)
            lines += [x for x in rest.splitlines() if x.startswith("{")]
        finally:
            stop_processes(learner, sampler)
    assert learner.returncode == 0, (tmp_path / "sampler.log").read_text()[-3000:]
    assert len(ranks) >= 2  # 2 ranks (+ spawn helper)
    wait_until(lambda: not any(_alive(pid) for pid in ranks), "the learner's ranks to exit")
    steps = [json.loads(x) for x in lines]
    assert 2 <= len(steps) < 50
    assert [s["version_id"] for s in steps[:2]] == ["ep-00000", "ep-00001"]
    assert all(s["delta"]["count"] > 0 for s in steps)
    settings = ServiceSettings(redis_url=private_redis.url, store_dir=tmp_path / "store")
    registry = Registry(RedisBus.from_settings(settings), settings.key_prefix)
    store = WeightStore(settings.store_dir)
    for s in steps:
        assert registry.state(s["version_id"]) == "serving"
        assert store.read_manifest(s["version_id"]).num_parts == 2
    assert sampler.returncode == 0, (tmp_path / "sampler.log").read_text()[-3000:]
