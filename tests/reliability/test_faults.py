"""Faults injected into real processes over a real redis-server, and what surviving them means.

Each test names its fault and its survival criterion. Common to all: no published version
and no event is lost, no version is converted twice, the weight store never shows a torn
version, and the registry never says ``converted`` (or beyond) for bits that do not verify.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch
from alignclient.errors import StateTransitionError, VersionExistsError
from alignd.converter.main import run_converter
from alignd.formats.published import write_published
from alignd.formats.weight_store import TMP_PREFIX, WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.events import ConvertedEvent, PublishedEvent, SyncEvent, sync_stream
from alignd.infra.registry import Registry
from alignd.infra.settings import AllInOneSettings
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.work import READY, REQUESTS, RolloutRequest, RolloutsReady
from alignd.sampler.engine import TorchSamplerEngine
from alignd.sampler.main import run_sampler
from alignd.sampler.service import SamplerService
from alignd.sync.bf16 import publish_version

from libalign import models
from tests.services.conftest import stop_processes, tiny_experts
from tests.services.slow_services import sleeper

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASK = models.SyntheticTask()
PATH = "nvfp4_minite"


# --- helpers ------------------------------------------------------------------------------

def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0,
             log: Path | None = None) -> None:
    """Poll ``cond`` every 5 ms until true; fail naming ``what`` (and the log) on timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(0.005)


def assert_no_torn_version(store: WeightStore, reg: Registry, vids: list[str]) -> None:
    """Every visible version directory is complete and verifies; the registry never says
    converted (or later) for a version whose bits are not in the store and verified."""
    root = store.versions_root
    visible = sorted(p.name for p in root.iterdir()
                     if not p.name.startswith(TMP_PREFIX)) if root.is_dir() else []
    assert visible == store.list_versions(), f"a visible directory lacks its manifest: {visible}"
    for vid in visible:
        store.verify_version(vid)
    for vid in vids:
        if reg.state(vid) in ("converted", "loading", "serving"):
            assert vid in visible, f"{vid} is {reg.state(vid)} but not in the store"


def conversions(reg: Registry, vid: str) -> int:
    """How many times the registry recorded ``vid`` becoming converted."""
    return sum(h.to_state == "converted" for h in reg.history(vid))


def model_weights(seed: int) -> dict[str, torch.Tensor]:
    """BF16 weights of the sampler's tiny model (``embedded.build_sampler``), perturbed by seed."""
    model = models.build_model(models.tiny_config(vocab_size=TASK.vocab_size), seed=0)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().float()
        if seed and v.is_floating_point():
            v = v + 1e-3 * torch.randn(v.shape, generator=g)
        out[k] = v.to(torch.bfloat16).contiguous()
    return out


def sampler_engine(store_dir: Path) -> TorchSamplerEngine:
    """The embedded sampler engine over the tiny model, as the sampler service builds it."""
    model = models.build_model(models.tiny_config(vocab_size=TASK.vocab_size), seed=0)
    return TorchSamplerEngine(model, WeightStore(store_dir), PATH, batch_size=16,
                              eos_id=TASK.eos_id, pad_id=TASK.pad_id)


class Rig:
    """Settings, bus, registry and store over one Redis and one store directory."""

    def __init__(self, url: str, tmp_path: Path, **kw):
        defaults = dict(redis_url=url, store_dir=tmp_path / "store", consumer_name="conv",
                        sampler_name="s1", sampler_path=PATH, heartbeat_ms=100,
                        claim_idle_ms=1000, block_ms=50)
        self.settings = AllInOneSettings(**{**defaults, **kw})
        self.bus = RedisBus.from_settings(self.settings)
        self.reg = Registry(self.bus, self.settings.key_prefix)
        self.store = WeightStore(self.settings.store_dir)

    def publish(self, vid: str, tensors: dict[str, torch.Tensor],
                target_path: str | None = PATH) -> None:
        publish_version(self.store.published_root, self.reg, self.bus,
                        self.settings.published_stream, vid, tensors, target_path=target_path)

    def convert(self, n: int) -> None:
        """Run a converter in this thread until it handled ``n`` messages."""
        assert run_converter(self.settings, max_messages=n) == n

    def stream_vids(self, stream: str) -> list[str]:
        return [f["version_id"] for _id, f in self.bus.client.xrange(stream)]

    def pending(self, stream: str, group: str) -> int:
        return self.bus.pending_count(stream, group)


# --- 1. converter SIGKILLed at 20 points ---------------------------------------------------

def _tmp_dirs(store: WeightStore, vid: str) -> set[Path]:
    return {p for p in store.versions_root.glob(f"{TMP_PREFIX}{vid}.*")
            if ".old." not in p.name and ".deleted." not in p.name}


def test_converter_sigkill_at_20_points_never_tears_a_version(redis_url, tmp_path):
    """Fault: the converter process SIGKILLed 20 times, at seeded random points: after it
    claims a version, while shard 1/2/3 is written or fsynced, after the manifest is written
    in the hidden temporary directory, after the rename into place (plus a random 0-80 ms,
    so kills also land mid-shard and between the registry update and the ack). Survived:
    after every kill each visible store version is complete and verifies against its
    manifest (leftovers are hidden ``.tmp-*`` only), ``list_versions`` lists only those, and
    the registry says converted only for verified bits; a restarted converter reclaims the
    dead one's message, and in the end every published version is converted exactly once."""
    rig = Rig(redis_url, tmp_path)
    store, reg = rig.store, rig.reg
    log = tmp_path / "converter.log"
    child_kw = dict(redis_url=redis_url, store_dir=str(store.root), heartbeat_ms=100,
                    claim_idle_ms=300, block_ms=50, max_deliveries=1000,
                    store_shard_bytes=80_000)
    step_delay_s = 0.05
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.reliability.procs"])
    from tests.reliability.procs import converter_process

    vids: list[str] = []
    done: set[str] = set()  # converted (final here: no sampler runs)

    def top_up() -> None:
        """Keep two versions waiting that no converter finished yet."""
        done.update(v for v in vids if v not in done and reg.state(v) == "converted")
        while len(vids) - len(done) < 2:
            vid = f"v{len(vids):03d}"
            rig.publish(vid, tiny_experts(experts=2, rows=128, k=256, seed=len(vids)),
                        target_path=None)
            vids.append(vid)

    def owned(name: str) -> str | None:
        for vid in [v for v in vids if v not in done]:
            rec = reg.get(vid)
            if rec.state == "converting" and rec.owner == name:
                return vid
        return None

    def shards(vid: str, known: set[Path], k: int) -> bool:
        return any(len(list(d.glob("nvfp4-*.safetensors"))) >= k
                   for d in _tmp_dirs(store, vid) - known)

    points = ["claimed", "shard1", "shard2", "shard3", "manifest", "renamed"]
    rng = random.Random(20261203)
    plan = [(points[i % len(points)], rng.uniform(0.0, 0.08)) for i in range(20)]
    rng.shuffle(plan)
    assert len(set(plan)) == 20
    killed_at: list[tuple[str, str, float]] = []
    proc = None
    try:
        for i, (point, offset) in enumerate(plan):
            top_up()
            name = f"conv-{i:02d}"
            known = {d for v in vids for d in _tmp_dirs(store, v)}

            def reached(name=name, point=point, known=known) -> bool:
                vid = owned(name)
                if vid is None:
                    top_up()  # a point missed on one version is reached on the next
                    return False
                if point == "claimed":
                    return True
                if point.startswith("shard"):
                    return shards(vid, known, int(point[-1]))
                if point == "manifest":
                    return any((d / "manifest.json").is_file()
                               for d in _tmp_dirs(store, vid) - known)
                return store.has_version(vid)  # renamed into place, not yet recorded

            proc = ctx.Process(target=converter_process,
                               args=({**child_kw, "consumer_name": name}, str(log), step_delay_s))
            proc.start()
            wait_for(reached, f"kill {i}: {point}", timeout=30, log=log)
            vid = owned(name) or "?"
            time.sleep(offset)  # the seeded random part of the kill point
            proc.kill()
            proc.join(10)
            assert proc.exitcode == -signal.SIGKILL, (point, proc.exitcode)
            killed_at.append((point, vid, offset))
            assert_no_torn_version(store, reg, vids)
        assert len(killed_at) == 20 and {p for p, _v, _o in killed_at} == set(points)
        assert any(list(store.versions_root.glob(f"{TMP_PREFIX}*"))), "no kill hit a write"

        proc = ctx.Process(target=converter_process,
                           args=({**child_kw, "consumer_name": "conv-final"}, str(log),
                                 step_delay_s))
        proc.start()
        wait_for(lambda: all(reg.state(v) == "converted" for v in vids), "all converted",
                 log=log)
        wait_for(lambda: rig.pending(rig.settings.published_stream,
                                     rig.settings.converter_group) == 0, "all acked", log=log)
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
    assert_no_torn_version(store, reg, vids)
    assert store.list_versions() == vids
    for vid in vids:
        assert conversions(reg, vid) == 1, reg.history(vid)
    assert set(rig.stream_vids(rig.settings.converted_stream)) == set(vids)
    assert rig.stream_vids(rig.settings.published_stream) == vids


# --- 2. Redis stopped and restarted mid-run ------------------------------------------------

def test_redis_restart_mid_run_loses_nothing(private_redis, tmp_path):
    """Fault: the append-only redis-server stopped for about a second while a converter
    thread writes a version and a sampler thread serves, and again while idle; a publisher
    publishes before, during (its calls retry with backoff until Redis is back) and after.
    Survived: every one of the 6 versions is published once, converted exactly once
    (registry history), announced, loaded by the sampler (which serves the last one), no
    message is left pending in any group, and nothing is failed or stuck in ``loading``."""
    rig = Rig(private_redis.url, tmp_path, store_shard_bytes=400_000)
    s = rig.settings
    retries = Counter()
    pub_bus = RedisBus.from_settings(s, on_retry=lambda what, _e: retries.update([what]))
    pub_reg = Registry(pub_bus, s.key_prefix)

    def publish(vid: str, seed: int) -> None:
        """Files, then registry + event in one transaction, retried until Redis answers."""
        path = write_published(rig.store.published_root, vid, model_weights(seed))
        event = PublishedEvent(version_id=vid, path=str(path), target_path=PATH)
        try:
            pub_reg.create_and_announce(vid, str(path), s.published_stream, event.to_fields(),
                                        meta={"target_path": PATH})
        except VersionExistsError:  # the first attempt's reply was lost, its write was not
            assert pub_reg.get(vid).path == str(path)

    stop = threading.Event()
    engine = sampler_engine(s.store_dir)
    rollouts = RolloutStore(redis.Redis.from_url(private_redis.url), s.key_prefix)
    threads = [threading.Thread(target=run_converter, args=(s, stop),
                                kwargs=dict(on_step=sleeper(0.1)), daemon=True),
               threading.Thread(target=run_sampler, args=(s, engine, stop),
                                kwargs=dict(rollouts=rollouts), daemon=True)]
    vids = [f"r{i}" for i in range(6)]
    try:
        for t in threads:
            t.start()
        publish(vids[0], 1)
        wait_for(lambda: engine.version_id == vids[0], "r0 serving")
        publish(vids[1], 2)
        # stop Redis while the converter is between durable steps of r1
        wait_for(lambda: list(rig.store.versions_root.glob(f"{TMP_PREFIX}r1.*/*.safetensors")),
                 "r1 mid-write")
        private_redis.stop()
        during = threading.Thread(target=lambda: [publish(vids[2], 3), publish(vids[3], 4)])
        during.start()
        wait_for(lambda: retries, "the publisher retrying against the stopped Redis")
        time.sleep(0.3)  # the converter finishes its write meanwhile; its state change waits
        private_redis.start()
        during.join(60)
        assert not during.is_alive()
        wait_for(lambda: engine.version_id == vids[3], "r3 serving")
        private_redis.stop()  # idle: the loops are blocked in XREADGROUP
        time.sleep(0.5)
        private_redis.start()
        publish(vids[4], 5)
        publish(vids[5], 6)
        wait_for(lambda: engine.version_id == vids[5], "r5 serving")
        wait_for(lambda: rig.reg.state(vids[5]) == "serving", "r5 registry serving")
        wait_for(lambda: rig.pending(s.published_stream, s.converter_group) == 0, "acks")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert sum(retries.values()) >= 1
    assert rig.stream_vids(s.published_stream) == vids
    assert set(rig.stream_vids(s.converted_stream)) == set(vids)
    assert rig.store.list_versions() == vids
    assert_no_torn_version(rig.store, rig.reg, vids)
    for vid in vids:
        assert conversions(rig.reg, vid) == 1, rig.reg.history(vid)
        assert rig.reg.state(vid) in ("converted", "serving"), rig.reg.get(vid)
    assert rig.pending(s.converted_stream, "sampler-s1") == 0


# --- 3. sampler SIGKILLed mid-load -------------------------------------------------------

def _heartbeat(client: redis.Redis, name: str) -> dict[str, str]:
    return client.hgetall(f"libalign:heartbeat:sampler:{name}")


def test_sampler_sigkill_mid_load_restarts_on_the_last_good_version(redis_url, tmp_path):
    """Fault: the sampler process (``python -m alignd.sampler.main``; the first one from
    ``tests.services.slow_services``, whose loads take 2 s longer) SIGKILLed while it loads a
    new version, after the registry moved it to ``loading``. Survived: while it is down the
    registry still shows the old version serving and the interrupted one ``loading`` (not
    failed, bits intact); the restarted sampler comes up serving the newest loadable
    version, which is the interrupted one: it loads it, finishes its move to ``serving``,
    reports it in its heartbeat, and serves a rollout request with it."""
    rig = Rig(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    log = tmp_path / "sampler.log"
    env = {**os.environ, "ALIGN_REDIS_URL": redis_url, "ALIGN_STORE_DIR": str(rig.store.root),
           "ALIGN_SAMPLER_NAME": "s1", "ALIGN_SAMPLER_PATH": PATH, "ALIGN_BLOCK_MS": "100",
           "ALIGN_SERVICE_HEARTBEAT_S": "0.2", "ALIGN_SERVICE_HEARTBEAT_TTL_S": "30",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def spawn(load_delay_s: float | None = None) -> subprocess.Popen:
        cmd = ["-m", "alignd.sampler.main"] if load_delay_s is None else \
            ["-m", "tests.services.slow_services", "sampler", str(load_delay_s)]
        with open(log, "a") as out:
            return subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    rig.publish("a1", model_weights(1))
    rig.convert(1)
    proc = spawn(load_delay_s=2)
    try:
        wait_for(lambda: _heartbeat(client, "s1").get("version") == "a1", "a1 loaded", log=log)
        assert rig.reg.state("a1") == "serving"
        rig.publish("a2", model_weights(2))
        rig.convert(1)
        wait_for(lambda: rig.reg.state("a2") == "loading", "a2 loading", log=log)
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        # down: the last good version is still the one serving, the new one intact
        assert rig.reg.state("a1") == "serving" and rig.reg.get("a2").owner == "s1"
        assert rig.reg.state("a2") == "loading"
        assert _heartbeat(client, "s1")["version"] == "a1"
        rig.store.verify_version("a2")
        assert_no_torn_version(rig.store, rig.reg, ["a1", "a2"])

        proc = spawn()
        wait_for(lambda: _heartbeat(client, "s1").get("pid") == str(proc.pid)
                 and _heartbeat(client, "s1").get("version") == "a2", "a2 loaded on restart",
                 log=log)
        wait_for(lambda: rig.reg.state("a2") == "serving", "a2 serving", log=log)
        hist = [(h.from_state, h.to_state, h.actor) for h in rig.reg.history("a2")]
        assert hist[-2:] == [("converted", "loading", "s1"), ("loading", "serving", "s1")]
        req = RolloutRequest(request_id="after-restart", version_id="a2",
                             prompts=json.dumps(TASK.prompts(2, 0)), max_new_tokens=3)
        rig.bus.publish(REQUESTS, req.to_fields())
        got: list[RolloutsReady] = []

        def ready() -> bool:
            got[:] = [RolloutsReady.from_fields(f) for _i, f in client.xrange(READY)]
            return bool(got)

        wait_for(ready, "rollouts served after the restart", log=log)
        assert got[0].error is None and got[0].version_id == "a2" and len(got[0].ids()) == 2
    finally:
        stop_processes(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


# --- 4. a stored shard corrupted after conversion ----------------------------------------

def _flip_tensor_byte(shard: Path, want: Callable[[str, dict], bool]) -> str:
    """XOR one byte in the middle of the first tensor ``want`` accepts; returns its name."""
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for name, meta in header.items():
        if name != "__metadata__" and want(name, meta):
            start, end = meta["data_offsets"]
            raw[8 + n + (start + end) // 2] ^= 0xFF
            shard.write_bytes(bytes(raw))
            return name
    raise AssertionError(f"no tensor to corrupt in {shard}")


def test_corrupted_shard_is_refused_and_the_old_version_keeps_serving(redis_url, tmp_path):
    """Fault: one byte of a packed-code tensor flipped in a shard of a converted version
    before the sampler loads it. Survived: the sampler's checksum check refuses it, the
    version goes ``failed`` with a reason naming the checksum and the tensor, the sampler
    keeps serving the old version (rollouts for it still work), and a request for the
    corrupted one is refused (StateTransitionError: failed) instead of bad tokens."""
    rig = Rig(redis_url, tmp_path)
    engine = sampler_engine(rig.settings.store_dir)
    rollouts = RolloutStore(redis.Redis.from_url(redis_url), rig.settings.key_prefix)
    svc = SamplerService(rig.settings, engine, rig.bus, rollouts=rollouts)
    rig.publish("c1", model_weights(1))
    rig.convert(1)
    svc.setup()
    assert engine.version_id == "c1" and rig.reg.state("c1") == "serving"
    rig.publish("c2", model_weights(2))
    rig.convert(1)
    assert rig.reg.state("c2") == "converted"
    shard = sorted(rig.store.version_path("c2").glob("*.safetensors"))[0]
    tensor = _flip_tensor_byte(shard, lambda name, meta: meta["dtype"] == "U8"
                               and name.endswith("gate_up_proj"))  # packed E2M1 codes
    assert svc.step(block_ms=1) >= 1  # the converted event of c2
    rec = rig.reg.get("c2")
    assert rec.state == "failed", rec
    assert rec.reason.startswith("checksum_mismatch") and repr(tensor) in rec.reason, rec.reason
    assert engine.version_id == "c1" and rig.reg.state("c1") == "serving"
    ok = svc.serve_request(RolloutRequest(request_id="old", version_id="c1",
                                          prompts=json.dumps(TASK.prompts(2, 0)),
                                          max_new_tokens=3))
    assert ok.error is None and len(ok.ids()) == 2
    with pytest.raises(StateTransitionError, match="'c2': failed -> serving"):
        svc.serve_request(RolloutRequest(request_id="bad", version_id="c2",
                                         prompts=json.dumps(TASK.prompts(2, 0)),
                                         max_new_tokens=3))
    assert engine.version_id == "c1"


# --- 5. duplicate and out-of-order events ------------------------------------------------

def test_duplicate_and_out_of_order_events_are_idempotent(redis_url, tmp_path):
    """Fault: the same ``published`` event delivered twice (before and after conversion), a
    ``converted`` event for the version already serving, a sync for an old version followed
    by one for the new version, and a rollout request delivered twice. Survived: one
    conversion per version (registry history, one store write), no error and no state
    change from the duplicates, the sampler ends on the newest version, and the repeated
    request is answered again with the same stored rollouts instead of an error."""
    rig = Rig(redis_url, tmp_path)
    s = rig.settings
    rig.publish("d1", model_weights(1))
    (_id, fields), = rig.bus.client.xrange(s.published_stream)
    rig.bus.publish(s.published_stream, fields)  # the same event again, before conversion
    rig.convert(2)
    assert conversions(rig.reg, "d1") == 1 and rig.store.list_versions() == ["d1"]
    manifest = rig.store.read_manifest("d1")

    engine = sampler_engine(s.store_dir)
    rollouts = RolloutStore(redis.Redis.from_url(redis_url), s.key_prefix)
    svc = SamplerService(s, engine, rig.bus, rollouts=rollouts)
    svc.setup()
    svc.step(block_ms=1)  # pins the sync stream position
    assert engine.version_id == "d1" and rig.reg.state("d1") == "serving"
    history = rig.reg.history("d1")

    rig.bus.publish(s.published_stream, fields)  # and again, after it serves
    converted_before = rig.stream_vids(s.converted_stream)
    rig.convert(1)
    assert rig.stream_vids(s.converted_stream) == converted_before  # nothing re-announced
    rig.bus.publish(s.converted_stream, ConvertedEvent(
        version_id="d1", path=str(rig.store.version_path("d1")), preset="minite", tensors=1,
        stored_bytes=1, target_path=PATH).to_fields())
    assert svc.step(block_ms=1) == 1
    assert rig.reg.history("d1") == history and engine.version_id == "d1"
    assert rig.store.read_manifest("d1") == manifest

    rig.publish("d2", model_weights(2))
    rig.convert(1)
    stream = sync_stream(s.key_prefix)
    rig.bus.publish(stream, SyncEvent(version_id="d1").to_fields())
    rig.bus.publish(stream, SyncEvent(version_id="d2").to_fields())
    assert svc.step(block_ms=1) == 3  # converted d2, sync d1, sync d2
    assert engine.version_id == "d2"
    assert rig.reg.state("d1") == "serving" and rig.reg.state("d2") == "serving"
    assert rig.reg.history("d1") == history
    assert [conversions(rig.reg, v) for v in ("d1", "d2")] == [1, 1]

    req = RolloutRequest(request_id="twice", version_id="d2",
                         prompts=json.dumps(TASK.prompts(2, 0)), max_new_tokens=3, seed=7)
    for _ in range(2):
        rig.bus.publish(REQUESTS, req.to_fields())
    assert svc.step(block_ms=1) == 1 and svc.step(block_ms=1) == 1
    ready = [RolloutsReady.from_fields(f) for _i, f in rig.bus.client.xrange(READY)]
    assert [r.error for r in ready] == [None, None], ready
    assert ready[0].ids() == ready[1].ids() and len(ready[0].ids()) == 2
    assert rollouts.list_rollout_ids("d2") == ready[0].ids()
    assert rig.pending(REQUESTS, "samplers") == 0
    assert rig.pending(s.published_stream, s.converter_group) == 0
    assert sorted(rig.store.list_versions()) == ["d1", "d2"]
