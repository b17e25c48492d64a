"""Runs in one process: every thread and embedded namespace a run starts ends with it, and two
runs, one after the other or at once, never see each other's keys.

Before, the embedded server was one per process under one key prefix: a second ``run_demo``
in the same process found the first run's versions in the registry and its sampler tried to
load them ("version ... cannot be loaded: not found in the weight store"), and two
:class:`ServiceThreads` on separate stores took each other's events. Now a run gets a private
embedded server (:func:`run_namespace`) dropped when it ends, and two ServiceThreads on one
namespace with different stores are refused.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from alignclient.errors import ConfigError
from alignd.infra.redis_clients import embedded_names, run_namespace
from alignd.infra.settings import AllInOneSettings
from alignd.tools.demo.run import DemoConfig, run_demo
from alignd.tools.in_process import ServiceThreads

from tests.reliability.test_faults import PATH, Rig, model_weights, sampler_engine, wait_for

pytest.importorskip("transformers")


def _live() -> set[tuple[str, int]]:
    return {(t.name, t.ident) for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def _no_tqdm_monitor(monkeypatch):
    """tqdm starts one monitor thread per process on its first bar (model loading draws one);
    off here, so the threads counted are the runs' own."""
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)


def _demo(out: Path) -> dict:
    return run_demo(DemoConfig(configs=("bf16",), steps=2, seeds=1, prompts_per_step=2,
                               samples_per_prompt=2, out_dir=out))


def _versions(report: dict) -> set[str]:
    return {s["version_id"] for c in report["configs"] for s in c["steps"]}


@pytest.fixture
def foreign_loads(caplog):
    """The sampler's error lines about versions it cannot load (another run's, before)."""
    caplog.set_level(logging.ERROR, logger="alignd.sampler")
    return lambda: [r.getMessage() for r in caplog.records if "cannot be loaded" in r.getMessage()]


def test_two_demo_runs_one_after_the_other_and_at_once_share_nothing(tmp_path, foreign_loads):
    """Two ``run_demo`` calls in one process one after the other, then two at once on threads:
    every run completes on its own versions, no sampler ever tries to load another run's
    version, and after each phase the live threads and the embedded servers are exactly those
    from before (the runs' converter and sampler threads ended, their namespaces dropped)."""
    threads, servers = _live(), embedded_names()
    first, second = _demo(tmp_path / "a"), _demo(tmp_path / "b")
    assert foreign_loads() == []
    assert _live() == threads and embedded_names() == servers
    assert _versions(first) and _versions(second) and not _versions(first) & _versions(second)

    reports, errors = {}, []

    def run(name: str) -> None:
        try:
            reports[name] = _demo(tmp_path / name)
        except BaseException as e:
            errors.append(e)

    both = [threading.Thread(target=run, args=(n,)) for n in ("c", "d")]
    for t in both:
        t.start()
    for t in both:
        t.join(600)
    assert errors == [] and sorted(reports) == ["c", "d"]
    assert all(len(r["configs"][0]["steps"]) == 2 for r in reports.values())
    assert not _versions(reports["c"]) & _versions(reports["d"])
    assert foreign_loads() == []
    assert _live() == threads and embedded_names() == servers


def test_two_service_threads_on_one_namespace_and_two_stores_are_refused(tmp_path):
    """Two ServiceThreads in one process with default settings (embedded default, default
    prefix) and separate stores: the second is refused with ConfigError naming both stores and
    how to separate them; after the first closes, the namespace is free again."""
    engine = sampler_engine(tmp_path / "a")
    a = AllInOneSettings(store_dir=tmp_path / "a", sampler_path=PATH, block_ms=50)
    b = AllInOneSettings(store_dir=tmp_path / "b", sampler_path=PATH, block_ms=50)
    assert a.consumer_name != b.consumer_name
    threads = _live()
    with ServiceThreads(a, engine, rollouts=None):
        with pytest.raises(ConfigError, match="already serves the weight store") as e:
            ServiceThreads(b, sampler_engine(tmp_path / "b"), rollouts=None)
        assert str((tmp_path / "a").resolve()) in str(e.value)
        assert "run_namespace" in str(e.value)
    with ServiceThreads(b, sampler_engine(tmp_path / "b"), rollouts=None):
        pass
    assert _live() == threads


def test_two_service_threads_in_their_own_namespaces_serve_their_own_versions(tmp_path):
    """Two ServiceThreads at once, each in its own run_namespace over its own store, 3 versions
    published to each interleaved: each run's converter converts exactly its own versions and
    its sampler ends serving its own newest; neither registry lists the other's versions; both
    namespaces are dropped at the end and no thread is left."""
    threads, servers = _live(), embedded_names()
    base = {n: AllInOneSettings(store_dir=tmp_path / n / "store", sampler_path=PATH,
                                heartbeat_ms=100, claim_idle_ms=1000, block_ms=50)
            for n in ("a", "b")}
    vids = {n: [f"{n}{i}" for i in range(3)] for n in base}
    with run_namespace(base["a"]) as sa, run_namespace(base["b"]) as sb:
        assert sa.redis_url != sb.redis_url
        rigs = {n: Rig(s.redis_url, tmp_path / n, consumer_name=s.consumer_name)
                for n, s in (("a", sa), ("b", sb))}
        engines = {n: sampler_engine(rigs[n].settings.store_dir) for n in rigs}
        svcs = [ServiceThreads(rigs[n].settings, engines[n], rollouts=None) for n in rigs]
        try:
            for i in range(3):
                for n, rig in rigs.items():
                    rig.publish(vids[n][i], model_weights(10 * (n == "b") + i + 1))
            for n, rig in rigs.items():
                wait_for(lambda n=n, rig=rig: engines[n].version_id == vids[n][-1]
                         and all(rig.reg.state(v) in ("converted", "serving") for v in vids[n]),
                         f"run {n} serving its newest version")
        finally:
            for svc in svcs:
                svc.close()
        for n, rig in rigs.items():
            assert sorted(r.version_id for r in rig.reg.list_versions()) == vids[n]
    assert embedded_names() == servers and _live() == threads
