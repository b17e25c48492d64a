"""Two daemons on one redis-server, told apart only by ``ALIGN_KEY_PREFIX``.

Before the streams followed the key prefix, two runs on one Redis shared the ``published``,
``converted`` and rollout streams and their consumer groups: a converter took the other run's
event, could not find the version in its own registry, acknowledged and dropped it (13 of 20
versions stayed ``published`` forever), and one run's sampler answered the other's rollout
request with ``VersionNotFoundError``. Here each run has its converter and its sampler as
threads, both runs publish at once, and each must serve every one of its own versions and
see nothing of the other's.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from alignd.converter.main import run_converter
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.work import RolloutRequest, RolloutsReady, ready_stream, requests_stream
from alignd.sampler.main import run_sampler

from tests.reliability.test_faults import (
    TASK,
    Rig,
    conversions,
    model_weights,
    sampler_engine,
    wait_for,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VERSIONS = 5  # per run


def test_two_prefixes_on_one_redis_keep_their_own_versions(redis_url, tmp_path):
    """Fault: two daemons (prefixes ``runA`` and ``runB``, default stream names) on one
    redis-server, each with a converter and a sampler thread, publishing 5 versions each
    interleaved, then one rollout request each. Survived: every version of each run is
    converted exactly once by its own converter and loaded by its own sampler (the last one
    serving), its registry, store and streams hold only its own versions, each request is
    answered by its own run's sampler without error, every Redis key on the server starts
    with one of the two prefixes, and each run's consumer groups hold only its own
    consumers, with nothing pending."""
    prefixes = {"runA": "a", "runB": "b"}
    rigs = {p: Rig(redis_url, tmp_path / p, key_prefix=p, consumer_name=f"conv-{v}",
                   sampler_name=f"s{v}") for p, v in prefixes.items()}
    vids = {p: [f"{v}{i}" for i in range(VERSIONS)] for p, v in prefixes.items()}
    stop = threading.Event()
    engines, threads = {}, []
    for p, rig in rigs.items():
        s = rig.settings
        assert s.published_stream == f"{p}:events:published"
        engines[p] = sampler_engine(s.store_dir)
        rollouts = RolloutStore(redis.Redis.from_url(redis_url), s.key_prefix)
        threads += [threading.Thread(target=run_converter, args=(s, stop), daemon=True),
                    threading.Thread(target=run_sampler, args=(s, engines[p], stop),
                                     kwargs=dict(rollouts=rollouts), daemon=True)]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        for p, rig in rigs.items():  # each sampler has made its groups before anything is sent
            wait_for(lambda rig=rig: rig.bus.client.exists(requests_stream(rig.settings.key_prefix)),
                     f"{p}'s sampler up")
        for i in range(VERSIONS):  # interleaved: both runs' events in flight together
            for p, rig in rigs.items():
                rig.publish(vids[p][i], model_weights(10 * (p == "runB") + i + 1))
        for p, rig in rigs.items():
            wait_for(lambda p=p, rig=rig: all(rig.reg.state(v) in ("converted", "serving")
                                              for v in vids[p])
                     and engines[p].version_id == vids[p][-1], f"every {p} version loaded")
        sync_s = time.monotonic() - t0
        for p, rig in rigs.items():
            req = RolloutRequest(request_id=f"{p}-req", version_id=vids[p][-1],
                                 prompts=json.dumps(TASK.prompts(2, 0)), max_new_tokens=3)
            rig.bus.publish(requests_stream(p), req.to_fields())
        ready: dict[str, list[RolloutsReady]] = {}

        def answered() -> bool:
            for p, rig in rigs.items():
                ready[p] = [RolloutsReady.from_fields(f)
                            for _i, f in rig.bus.client.xrange(ready_stream(p))]
            return all(ready.values())

        wait_for(answered, "both rollout requests answered")
        for p, rig in rigs.items():
            s = rig.settings
            wait_for(lambda rig=rig, s=s: rig.pending(s.published_stream, s.converter_group) == 0
                     and rig.pending(s.converted_stream, f"sampler-{s.sampler_name}") == 0
                     and rig.pending(requests_stream(s.key_prefix), "samplers") == 0,
                     f"{p}: nothing pending")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)

    served = 0
    for p, rig in rigs.items():
        s, mine, name = rig.settings, vids[p], rig.settings.sampler_name
        records = rig.reg.list_versions()
        assert sorted(r.version_id for r in records) == mine, records
        assert all(r.path.startswith(str(s.store_dir)) for r in records), records
        for vid in mine:
            assert conversions(rig.reg, vid) == 1, rig.reg.history(vid)
            assert rig.reg.state(vid) in ("converted", "serving"), rig.reg.get(vid)
            assert any(h.to_state == "serving" for h in rig.reg.history(vid)), vid
            served += 1
        assert rig.reg.state(mine[-1]) == "serving"
        assert rig.store.list_versions() == mine
        assert rig.stream_vids(s.published_stream) == mine
        assert sorted(rig.stream_vids(s.converted_stream)) == mine
        [answer] = ready[p]
        assert (answer.request_id, answer.error, answer.sampler, answer.version_id) == (
            f"{p}-req", None, name, mine[-1]), answer
        assert len(answer.ids()) == 2
        groups = {s.published_stream: {s.converter_group: {s.consumer_name}},
                  s.converted_stream: {f"sampler-{name}": {name}},
                  requests_stream(p): {"samplers": {name}}}
        for stream, want in groups.items():
            got = {g["name"]: {c["name"] for c in rig.bus.client.xinfo_consumers(stream, g["name"])}
                   for g in rig.bus.client.xinfo_groups(stream)}
            assert got == want, (stream, got)
    assert served == 2 * VERSIONS

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = list(client.scan_iter(count=1000))
    foreign = [k for k in keys if not k.startswith(("runA:", "runB:"))]
    assert not foreign, f"keys outside both prefixes: {foreign}"
    for p, other in (("runA", "runB"), ("runB", "runA")):
        for k in (k for k in keys if k.startswith(f"{p}:")):
            assert not any(v in k.split(":") for v in vids[other]), (p, k)
    print(f"isolation: {served}/{2 * VERSIONS} versions served by their own run in "
          f"{sync_s:.1f}s, {len(keys)} keys all prefixed, 2/2 requests answered by their own "
          "sampler")
