"""Recovery: what a sampler, a converter and an operator can get back after a failure.

Each test names its fault and what recovering from it means: a restarted sampler finds the
newest version it can serve however many newer ones are broken; a version that failed says
why (a full disk names itself and the path); an operator can retry a failed version once the
cause is gone; and hidden ``.tmp-*`` leftovers of killed writers go while the converter runs,
not only when it starts.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import redis
from alignclient import AlignClient
from alignclient.errors import StateTransitionError, VersionExistsError
from alignd.api.app import create_app
from alignd.converter.main import run_converter
from alignd.formats.weight_store import TMP_PREFIX, WeightStore
from alignd.infra.liveness import list_heartbeats
from alignd.infra.stores.rollouts import RolloutStore
from alignd.sampler.service import SamplerService

from libalign.atomic_dir import writer_tag
from tests.reliability.test_faults import PATH, Rig, model_weights, sampler_engine
from tests.services.api_server import TOKEN, api_settings, serve
from tests.services.moved_time import wait_until

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BROKEN = 5  # newest versions that cannot be served


def test_restarted_sampler_falls_back_past_five_unservable_versions(redis_url, tmp_path):
    """Fault: the 5 newest converted versions cannot be loaded (3 deleted from the store, 2
    with their manifest truncated) when a sampler starts. Survived: the sampler walks them
    newest first, records each as ``failed`` with its reason, and serves the 6th newest, the
    one good version (the fallback used to stop after 3 and serve nothing)."""
    rig = Rig(redis_url, tmp_path)
    vids = [f"r{i}" for i in range(BROKEN + 1)]  # r0 oldest, the only good one
    for i, vid in enumerate(vids):
        rig.publish(vid, model_weights(i + 1))
    rig.convert(len(vids))
    assert [rig.reg.state(v) for v in vids] == ["converted"] * len(vids)
    for i, vid in enumerate(vids[1:]):
        path = rig.store.version_path(vid)
        if i % 2:
            (path / "manifest.json").write_text("{")
        else:
            shutil.rmtree(path)
    engine = sampler_engine(rig.settings.store_dir)
    rollouts = RolloutStore(redis.Redis.from_url(redis_url), rig.settings.key_prefix)
    svc = SamplerService(rig.settings, engine, rig.bus, rollouts=rollouts)
    svc.setup()
    assert engine.version_id == "r0"
    assert rig.reg.state("r0") == "serving"
    for vid in vids[1:]:
        rec = rig.reg.get(vid)
        assert rec.state == "failed" and rec.reason, rec


def fill_the_disk(monkeypatch) -> list[str]:
    """Make every store write fail as a full disk does; returns the paths it refused."""
    refused: list[str] = []

    def no_space(self, out, *args, **kwargs):
        path = str(out / "nvfp4-00001.safetensors")
        refused.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(WeightStore, "write_into", no_space)
    return refused


def test_a_full_disk_fails_the_version_naming_the_disk(redis_url, tmp_path, monkeypatch):
    """Fault: the store's disk is full (every shard write raises ``ENOSPC``). Survived: the
    version goes ``failed`` on its first delivery with reason ``no_space`` naming the error,
    the file it could not write and the store's free bytes (it used to be redelivered until
    ``too_many_deliveries``, which says nothing of the disk); the message is acked and no
    staging directory is left behind."""
    rig = Rig(redis_url, tmp_path)
    refused = fill_the_disk(monkeypatch)
    rig.publish("f1", model_weights(1))
    rig.convert(1)
    rec = rig.reg.get("f1")
    assert rec.state == "failed", rec
    assert rec.reason.startswith("no_space: [Errno 28] No space left on device"), rec.reason
    assert len(refused) == 1 and repr(refused[0]) in rec.reason, rec.reason
    assert f"store {rig.store.root}" in rec.reason and "bytes free" in rec.reason
    assert rig.pending(rig.settings.published_stream, rig.settings.converter_group) == 0
    assert list(rig.store.versions_root.iterdir()) == []


def test_giving_up_on_a_version_says_its_last_error(redis_url, tmp_path, monkeypatch):
    """Fault: every store write raises ``EIO`` (not a full disk: tried again). Survived: after
    ``max_deliveries`` the version fails ``too_many_deliveries`` and the reason carries the
    error its last delivery met, not only the count."""
    rig = Rig(redis_url, tmp_path, max_deliveries=1)

    def io_error(self, out, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(out))

    monkeypatch.setattr(WeightStore, "write_into", io_error)
    rig.publish("e1", model_weights(1))
    rig.convert(2)  # the first delivery, then its redelivery after claim_idle_ms
    rec = rig.reg.get("e1")
    assert rec.state == "failed", rec
    assert rec.reason.startswith("too_many_deliveries: gave up after 1 deliveries"), rec.reason
    assert "OSError: [Errno 5] Input/output error" in rec.reason, rec.reason


def test_a_version_failed_for_a_full_disk_is_retried_once_space_is_freed(redis_url, tmp_path,
                                                                         monkeypatch):
    """Fault: the disk fills while a version converts. Recovered: once space is freed an
    operator retries it (``POST /v1/versions/{id}:retry`` through the client); it goes back to
    ``published`` with a new event, the converter converts it, and the store's copy verifies
    (re-publishing the id used to be the only way, and it answers 409)."""
    rig = Rig(redis_url, tmp_path)
    fill_the_disk(monkeypatch)
    rig.publish("g1", model_weights(1))
    rig.convert(1)
    assert rig.reg.get("g1").reason.startswith("no_space")
    monkeypatch.undo()  # space freed
    app = create_app(api_settings(redis_url, rig.store.root), redis_give_up_s=0.3)
    with serve(app) as url, AlignClient(url, token=TOKEN) as client:
        with pytest.raises(VersionExistsError):
            client.publish_version("g1", target_path=PATH)
        got = client.retry_version("g1")
        assert got.version.state == "published"
        rig.convert(1)
        assert client.get_version("g1").version.state == "converted"
        with pytest.raises(StateTransitionError):
            client.retry_version("g1")
    assert [(h.from_state, h.to_state) for h in rig.reg.history("g1")] == [
        ("", "published"), ("published", "converting"), ("converting", "failed"),
        ("failed", "published"), ("published", "converting"), ("converting", "converted")]
    rig.store.verify_version("g1")
    assert rig.pending(rig.settings.published_stream, rig.settings.converter_group) == 0


def _leftover(parent: Path, name: str, age_s: float) -> Path:
    """A hidden staging directory with one file, last modified ``age_s`` ago."""
    d = parent / name
    d.mkdir(parents=True)
    (d / "nvfp4-00001.safetensors").write_bytes(b"x" * 64)
    then = time.time() - age_s
    os.utime(d, (then, then))
    return d


def test_leftovers_are_swept_on_a_timer_while_the_converter_runs(redis_url, tmp_path):
    """Fault: hidden ``.tmp-*`` leftovers of killed writers appear in the store while a
    converter runs (they used to be swept only when a converter started). Recovered: with
    ``sweep_interval_s`` 0.2 s, within a few periods the running converter removes the stale
    ones of dead or unknown writers (in ``nvfp4/`` and ``published/``) and keeps a fresh one
    and a stale one whose writer (this process) is still running."""
    rig = Rig(redis_url, tmp_path, sweep_interval_s=0.2, sweep_stale_s=600)
    stop = threading.Event()
    thread = threading.Thread(target=run_converter, args=(rig.settings, stop), daemon=True)
    thread.start()
    try:
        # past the sweep on start: the converter sweeps before its first heartbeat
        wait_until(lambda: any(h["service"] == "converter" for h in list_heartbeats(
            rig.bus, rig.settings.key_prefix)), "the converter's first heartbeat")
        store = rig.store
        stale = [_leftover(store.versions_root, f"{TMP_PREFIX}k1.1-1.0123abcd", 7200),
                 _leftover(store.versions_root, f"{TMP_PREFIX}k2", 7200),
                 _leftover(store.published_root, f"{TMP_PREFIX}p1.deleted", 7200)]
        kept = [_leftover(store.versions_root, f"{TMP_PREFIX}fresh", 10),
                _leftover(store.versions_root, f"{TMP_PREFIX}live.{writer_tag()}.0123abcd", 7200)]
        deadline = time.monotonic() + 10
        while any(p.exists() for p in stale) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.name for p in stale if p.exists()] == []
        assert all(p.is_dir() for p in kept)
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(10)
