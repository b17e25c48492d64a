"""Bounded shutdown: each service exits within ``ALIGN_SHUTDOWN_TIMEOUT_S`` of SIGTERM whatever it
was doing, and a conversion it was in the middle of is resumed, not finished at any cost.

The converter abandons a conversion before its next tensor once told to stop (staging
directory removed, message not acked, version left ``converting``) and the next converter
reclaims it and converts it to the same bits. What cannot stop half-way (a sampler's load,
here slowed to a minute) is cut off at the bound with exit status 3. The API stops waiting
for a client trickling an upload at the bound. The subprocess tests time SIGTERM to exit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from alignd.converter.main import run_converter
from alignd.formats.convert import convert_published, resolve_spec
from alignd.formats.weight_store import TMP_PREFIX, WeightStore
from alignd.infra.liveness import held_versions
from alignd.infra.service_main import EXIT_CUT_OFF, exit_after_stop
from alignd.infra.settings import ServiceSettings

from tests.reliability.test_faults import PATH, REPO, Rig, model_weights, wait_for
from tests.services.conftest import free_port, stop_processes, tiny_experts

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SHARD_BYTES = 40_000
BOUND_S = 2.0  # ALIGN_SHUTDOWN_TIMEOUT_S of the subprocess tests
GRACEFUL_BOUND_S = 10.0  # the converter's: its graceful stop shows in status 0, not the bound


def shard_digests(store: WeightStore, vid: str) -> dict[str, str]:
    """SHA-256 of each shard file of a store version."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.version_path(vid).glob("nvfp4-*.safetensors"))}


def staging(store: WeightStore) -> list[str]:
    """Hidden staging directories left in the store's version root."""
    root = store.versions_root
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TMP_PREFIX)) \
        if root.is_dir() else []


def reference_digests(rig: Rig, vid: str, tmp_path: Path) -> dict[str, str]:
    """The shard digests of an uninterrupted conversion of ``vid`` with the converter's
    arguments, into a store of its own."""
    ref = WeightStore(tmp_path / "reference")
    convert_published(rig.store.published_path(vid), ref, vid, resolve_spec(rig.settings.preset),
                      shard_bytes=SHARD_BYTES)
    return shard_digests(ref, vid)


def test_a_converter_stopped_mid_conversion_is_resumed_bit_identically(redis_url, tmp_path):
    """Fault: a stop during a conversion was honoured only once the whole version was written
    (11.4 s for a 6.5 GB checkpoint, growing with the model). Held: the stop event, set from
    the step hook after the 2nd of many shards, ends ``run_converter`` before the next tensor
    (milliseconds); no staging directory is left, nothing is in the store, the version
    is still ``converting`` (never failed) and its message pending; the next converter
    reclaims it and ends with shards bit-identical to an uninterrupted conversion, the
    version ``converted`` once."""
    rig = Rig(redis_url, tmp_path, store_shard_bytes=SHARD_BYTES, claim_idle_ms=200,
              heartbeat_ms=100)
    rig.publish("v", tiny_experts(experts=8, rows=128, k=256), target_path=None)
    stop, shards, stopped_at = threading.Event(), [], []

    def hook(label: str) -> None:
        if label.startswith("shard"):
            shards.append(label)
            if len(shards) == 2:
                stop.set()
                stopped_at.append(time.monotonic())

    assert run_converter(rig.settings, stop, on_step=hook) == 1
    took = time.monotonic() - stopped_at[0]
    print(f"\nconverter: stop to return {took:.3f} s after {len(shards)} of many shards")
    assert took < 2.0 and len(shards) == 2
    assert staging(rig.store) == [] and not rig.store.has_version("v")
    assert rig.reg.state("v") == "converting"
    assert "failed" not in [h.to_state for h in rig.reg.history("v")]
    assert rig.pending(rig.settings.published_stream, rig.settings.converter_group) == 1
    later = rig.settings.model_copy(update={"consumer_name": "conv-2"})
    assert run_converter(later, max_messages=1) == 1
    assert rig.reg.state("v") == "converted"
    assert [h.to_state for h in rig.reg.history("v")].count("converted") == 1
    assert rig.reg.get("v").owner == "conv-2"
    assert rig.pending(rig.settings.published_stream, rig.settings.converter_group) == 0
    got = shard_digests(rig.store, "v")
    print(f"resumed by the next converter: {len(got)} shards, bit-identical to the reference")
    assert len(got) > 10 and got == reference_digests(rig, "v", tmp_path)


def test_the_deadline_thread_cuts_off_only_a_late_stop():
    """Pinned: ``exit_after_stop`` calls its exit with status 3 once the stop event has been
    set for the timeout, never while the service is not stopping, and not at all when the
    block is left in time (its thread ends with the block). The default bound (15 s) is half
    the compose file's ``stop_grace_period``."""
    calls: list[int] = []
    stop = threading.Event()
    with exit_after_stop(stop, 0.05, logging.getLogger("t"), calls.append) as t:
        time.sleep(0.1)
        assert calls == []  # not stopping
        stop.set()
        t.join(5)
    assert calls == [EXIT_CUT_OFF] and not t.is_alive()
    calls.clear()
    with exit_after_stop(threading.Event(), 0.05, logging.getLogger("t"),
                         calls.append) as t:
        pass
    assert not t.is_alive() and calls == []
    grace = re.search(r"stop_grace_period: (\d+)s", (REPO / "docker-compose.yml").read_text())
    assert ServiceSettings.model_fields["shutdown_timeout_s"].default == 15.0 <= int(grace.group(1)) / 2


# --- SIGTERM to exit, each service a process -------------------------------------------------

def _env(redis_url: str, store: Path, **kw: str) -> dict[str, str]:
    return {**os.environ, "ALIGN_REDIS_URL": redis_url, "ALIGN_STORE_DIR": str(store),
            "ALIGN_SHUTDOWN_TIMEOUT_S": str(BOUND_S), "ALIGN_BLOCK_MS": "100",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **kw}



def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _sigterm_to_exit(proc: subprocess.Popen, log: Path) -> tuple[float, int]:
    """Seconds from SIGTERM to the process's exit, and its status."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running 30 s after SIGTERM:\n{log.read_text()[-3000:]}")
    return time.monotonic() - t0, rc


def test_converter_process_sigterm_mid_conversion(redis_url, tmp_path):
    """Fault: SIGTERM mid-conversion; the converter exited only after the whole version (11.4 s
    for 6.5 GB). Held: the converter process (each of 15 shards slowed by 0.3 s), SIGTERMed
    after its 2nd staged shard, exits 0 (it stopped before its next tensor; the bound, 10 s
    here, would cut it off with status 3), leaves no staging directory and the version
    ``converting`` with its message pending; a converter started after it finishes the
    version bit-identically."""
    rig = Rig(redis_url, tmp_path, store_shard_bytes=SHARD_BYTES, claim_idle_ms=200,
              heartbeat_ms=100)
    rig.publish("v", tiny_experts(experts=8, rows=128, k=256), target_path=None)
    log = tmp_path / "converter.log"
    env = _env(redis_url, rig.store.root, ALIGN_CONSUMER_NAME="conv-1",
               ALIGN_STORE_SHARD_BYTES=str(SHARD_BYTES), ALIGN_HEARTBEAT_MS="100",
               ALIGN_CLAIM_IDLE_MS="200", ALIGN_SHUTDOWN_TIMEOUT_S=str(GRACEFUL_BOUND_S))
    proc = _spawn(["-m", "tests.services.slow_services", "converter", "0.3"], env, log)
    try:
        wait_for(lambda: len(list(rig.store.versions_root.glob(
            f"{TMP_PREFIX}v.*/nvfp4-*.safetensors"))) >= 2, "two staged shards", log=log)
        took, rc = _sigterm_to_exit(proc, log)
    finally:
        stop_processes(proc)
    print(f"\nconverter process: SIGTERM to exit {took:.2f} s, status {rc}")
    assert rc == 0 and took < GRACEFUL_BOUND_S, log.read_text()[-3000:]
    assert "conversion of v abandoned before tensor" in log.read_text()
    assert staging(rig.store) == [] and rig.reg.state("v") == "converting"
    assert rig.pending(rig.settings.published_stream, rig.settings.converter_group) == 1
    later = rig.settings.model_copy(update={"consumer_name": "conv-2"})
    assert run_converter(later, max_messages=1) == 1
    assert rig.reg.state("v") == "converted"
    assert shard_digests(rig.store, "v") == reference_digests(rig, "v", tmp_path)


def test_sampler_process_sigterm_mid_load_is_cut_off_at_the_bound(redis_url, tmp_path):
    """Fault: SIGTERM to a sampler busy loading; it exited after 19 s, when the load was done.
    Held: a sampler process whose load takes a minute (slowed), SIGTERMed while its heartbeat
    says ``loading``, exits with status 3 within the bound plus a second; the version it was
    loading stays held (no clean stop: kept for the grace period), still ``serving``."""
    rig = Rig(redis_url, tmp_path)
    rig.publish("a1", model_weights(1))
    rig.convert(1)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    log = tmp_path / "sampler.log"
    env = _env(redis_url, rig.store.root, ALIGN_SAMPLER_NAME="s1", ALIGN_SAMPLER_PATH=PATH,
               ALIGN_SERVICE_HEARTBEAT_S="0.2", ALIGN_SERVICE_HEARTBEAT_TTL_S="5")
    proc = _spawn(["-m", "tests.services.slow_services", "sampler", "60"], env, log)
    try:
        wait_for(lambda: client.hget("libalign:heartbeat:sampler:s1", "state") == "loading",
                 "the sampler loading a1", log=log)
        took, rc = _sigterm_to_exit(proc, log)
    finally:
        stop_processes(proc)
    print(f"\nsampler process: SIGTERM to exit {took:.2f} s, status {rc}")
    assert rc == EXIT_CUT_OFF and took < BOUND_S + 1.0, log.read_text()[-3000:]
    assert "after the signal to stop" in log.read_text()
    assert held_versions(rig.bus, "libalign", grace_s=600) == {"sampler:s1": ["a1"]}
    assert rig.reg.state("a1") == "loading"


def test_api_process_sigterm_with_a_stalled_upload(redis_url, tmp_path):
    """Fault: SIGTERM to the API while a client trickles a guidance upload: uvicorn waited for
    the upload (59 s). Held: the API process, with an upload of 20,000 declared bytes of which
    100 were sent, cancels it at the bound (2 s) and exits within the bound plus 2 s (by the
    signal, as uvicorn ends); nothing listens afterwards."""
    rig = Rig(redis_url, tmp_path)
    rig.reg.create("g0", "/x")
    port = free_port()
    token = "test-token-0123456789"
    log = tmp_path / "api.log"
    env = _env(redis_url, rig.store.root, ALIGN_API_PORT=str(port), ALIGN_API_TOKEN=token)
    proc = _spawn(["-m", "alignd.api.main"], env, log)
    sock = None
    try:
        def up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return True
            except OSError:
                return False

        wait_for(up, "the API listening", log=log)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall((f"PUT /v1/guidance/g0/r0 HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {token}\r\n"
                      "Content-Type: application/octet-stream\r\nContent-Length: 20000\r\n\r\n"
                      ).encode() + b"\0" * 100)
        time.sleep(0.3)  # the request is in the handler, reading its body
        took, rc = _sigterm_to_exit(proc, log)
    finally:
        if sock is not None:
            sock.close()
        stop_processes(proc)
    print(f"\napi process: SIGTERM to exit {took:.2f} s, status {rc}")
    # uvicorn re-raises the signal it handled once it has shut down: killed by SIGTERM
    assert rc == -signal.SIGTERM and took < BOUND_S + 2.0, log.read_text()[-3000:]
    assert "timeout graceful shutdown exceeded" in log.read_text()
    assert not up()
