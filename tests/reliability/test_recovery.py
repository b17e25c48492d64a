"""Recovery: what a sampler, a converter and an operator can get back after a failure.

Each test names its fault and what recovering from it means: a restarted sampler finds the
newest version it can serve however many newer ones are broken; a version that failed says
why (a full disk names itself and the path); an operator can retry a failed version once the
cause is gone; and hidden ``.tmp-*`` leftovers of killed writers go while the converter runs,
not only when it starts.
"""

from __future__ import annotations

import shutil

import pytest
import redis
from alignd.infra.stores.rollouts import RolloutStore
from alignd.sampler.service import SamplerService

from tests.reliability.test_faults import Rig, model_weights, sampler_engine

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
