"""Pins crash safety: the converter SIGKILLed at several moments never leaves a visible
partial version, and a restarted one reclaims the message and finishes; a Redis restart
under a running converter is survived."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from alignd.converter.main import run_converter
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import ConverterSettings
from alignd.infra.telemetry import Metrics
from alignd.sync.bf16 import publish_version

from libalign.spec import PRESETS

from .conftest import tiny_experts
from .slow_services import sleeper
from .test_converter import assert_bits_equal_spec

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0,
             proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll ``cond`` every 5 ms; fail with the converter's log if it died or time ran out."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"converter exited ({proc.returncode}) before {what}:\n"
                        f"{log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.005)


def assert_no_partial_version(store: WeightStore, vid: str) -> None:
    """The store lists nothing, or the complete version, which verifies."""
    listed = store.list_versions()
    assert listed in ([], [vid]), listed
    if listed:
        store.verify_version(vid)


def test_sigkill_at_any_moment_then_restart(redis_url, service_env, tmp_path):
    """Kill after the claim, mid-write and after the rename; each restart reclaims the
    message; the version ends converted, verified, bit-exact, announced once."""
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "store")
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    sd = tiny_experts(experts=8, rows=128, k=256)
    publish_version(store.published_root, reg, bus, settings.published_stream, "v", sd)
    env = {**service_env, "ALIGN_REDIS_URL": redis_url, "ALIGN_HEARTBEAT_MS": "100",
           "ALIGN_CLAIM_IDLE_MS": "400", "ALIGN_BLOCK_MS": "100",
           "ALIGN_STORE_SHARD_BYTES": "40000"}
    slow_converter = [sys.executable, "-m", "tests.services.slow_services", "converter", "0.15"]
    tmp_shards = lambda: list(store.versions_root.glob(".tmp-v.*/nvfp4-*.safetensors"))  # noqa: E731
    kill_points = [
        ("claimed", lambda: reg.state("v") == "converting" and reg.get("v").owner == name),
        ("mid-write", lambda: len(tmp_shards()) >= 3),
        ("after rename", lambda: store.has_version("v")),
    ]
    log = tmp_path / "converter.log"
    for i, (moment, cond) in enumerate(kill_points):
        name = f"conv-{i}"
        with open(log, "a") as out:
            proc = subprocess.Popen(slow_converter, cwd=REPO,
                                    env={**env, "ALIGN_CONSUMER_NAME": name}, stdout=out,
                                    stderr=subprocess.STDOUT)
        try:
            wait_for(cond, moment, proc=proc, log=log)
        finally:
            proc.kill()
            proc.wait(10)
        assert reg.state("v") == "converting", moment
        assert_no_partial_version(store, "v")
        if moment == "mid-write":
            assert store.list_versions() == [] and tmp_shards()  # hidden partial leftovers
        if moment == "after rename":
            assert store.list_versions() == ["v"]
            committed = store.read_manifest("v")

    with open(log, "a") as out:
        proc = subprocess.Popen(slow_converter, cwd=REPO,
                                env={**env, "ALIGN_CONSUMER_NAME": "conv-final"}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: reg.state("v") == "converted", "converted", proc=proc, log=log)
        wait_for(lambda: bus.pending_count(settings.published_stream, settings.converter_group) == 0,
                 "ack", proc=proc, log=log)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, log.read_text()[-3000:]
    hist = [(h.from_state, h.to_state, h.actor) for h in reg.history("v")]
    assert hist[1:] == [
        ("published", "converting", "conv-0"), ("converting", "converting", "conv-1"),
        ("converting", "converting", "conv-2"), ("converting", "converting", "conv-final"),
        ("converting", "converted", "conv-final")]
    assert store.list_versions() == ["v"] and store.read_manifest("v") == committed
    assert_bits_equal_spec(store, "v", sd, PRESETS["minite"])
    events = bus.client.xrange(settings.converted_stream)
    assert [f["version_id"] for _id, f in events] == ["v"]


def test_redis_restart_while_converting(private_redis, tmp_path):
    """Redis stopped mid-conversion and while idle: the converter reconnects and finishes."""
    settings = ConverterSettings(redis_url=private_redis.url, store_dir=tmp_path / "store",
                                 consumer_name="conv", heartbeat_ms=100, claim_idle_ms=5000,
                                 block_ms=100, store_shard_bytes=40_000)
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    sd = tiny_experts(experts=4, rows=128, k=256)
    publish_version(store.published_root, reg, bus, settings.published_stream, "v1", sd)
    stop, metrics = threading.Event(), Metrics()
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(
        run_converter(settings, stop_event=stop, metrics=metrics, on_step=sleeper(0.1))))
    worker.start()
    try:
        wait_for(lambda: len(list(store.versions_root.glob(".tmp-v1.*/*.safetensors"))) >= 2,
                 "mid-write")
        private_redis.stop()
        time.sleep(0.8)  # the conversion goes on; its heartbeat and the state change wait
        private_redis.start()
        wait_for(lambda: reg.state("v1") == "converted", "v1 converted")
        private_redis.stop()  # now the loop is blocked in XREADGROUP
        time.sleep(0.5)
        private_redis.start()
        publish_version(store.published_root, reg, bus, settings.published_stream, "v2",
                        tiny_experts(experts=2, seed=5))
        wait_for(lambda: reg.state("v2") == "converted", "v2 converted")
    finally:
        stop.set()
        worker.join(30)
    assert not worker.is_alive() and result == [2]
    assert metrics.value("libalign_bus_redis_retries_total") >= 2
    assert store.list_versions() == ["v1", "v2"]
    assert_bits_equal_spec(store, "v1", sd, PRESETS["minite"])
    assert bus.pending_count(settings.published_stream, settings.converter_group) == 0
    assert [f["version_id"] for _id, f in bus.client.xrange(settings.converted_stream)] == ["v1", "v2"]
