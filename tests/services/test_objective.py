"""The learner's objective knobs: the TIS cap and level, PPO ratio clipping
and the ``max_version_diff`` staleness bound, in the engine, the loop, the settings and the API."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import ConfigError, StaleRolloutError, VersionNotFoundError
from alignd.api.app import create_app
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import Registry
from alignd.infra.settings import AllInOneSettings, ApiSettings, LearnerSettings
from alignd.infra.staleness import StalenessGuard, versions_after
from alignd.infra.telemetry import Metrics
from alignd.learner.engine import TorchLearnerEngine, TrainBatch
from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
from fastapi.testclient import TestClient
from pydantic import ValidationError

from libalign import models
from tests.services.api_server import TOKEN, api_settings

TASK = models.SyntheticTask()
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=11):
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=seed)


def _batch(model, n=2, group=2):
    prompts = [p for p in TASK.prompts(n, 1) for _ in range(group)]
    r = models.generate(model, prompts, "bf16", max_new_tokens=5, seed=3, eos_id=TASK.eos_id,
                        pad_id=TASK.pad_id)
    return r.sequences, r.prompt_lens


# --- TIS cap and level -------------------------------------------------------------------------


def test_the_cap_sets_the_weight_of_a_large_ratio():
    """A token with ratio 4 weighs 2 at cap 2 and 4 at cap 5; ratios below the cap are kept."""
    old = [torch.log(torch.tensor([4.0, 1.0, 0.5]))]
    samp = [torch.zeros(3)]
    for cap, want, cut in ((2.0, [2.0, 1.0, 0.5], 1), (5.0, [4.0, 1.0, 0.5], 0)):
        eng = TorchLearnerEngine(_model(), tis_cap=cap, pad_id=TASK.pad_id)
        w, truncated, total = eng.importance_weights(old, samp)
        assert torch.allclose(w[0], torch.tensor(want), rtol=1e-6), cap
        assert (truncated, total) == (cut, 3)
    seq = TorchLearnerEngine(_model(), tis_cap=5.0, tis_level="sequence", pad_id=TASK.pad_id)
    w, truncated, total = seq.importance_weights(old, samp)  # one weight: min(4·1·0.5, 5) = 2
    assert torch.allclose(w[0], torch.full((3,), 2.0), rtol=1e-6) and (truncated, total) == (0, 1)
    off = TorchLearnerEngine(_model(), use_tis=False, pad_id=TASK.pad_id)
    assert torch.equal(off.importance_weights(old, samp)[0][0], torch.ones(3))


def test_the_cap_scales_the_step():
    """Every token at ratio 4: the gradient at cap 5 is twice the one at cap 2, and only
    cap 2 truncates."""
    seqs, plens = _batch(_model())
    got = {}
    for cap in (2.0, 5.0):
        eng = TorchLearnerEngine(_model(), tis_cap=cap, pad_id=TASK.pad_id, max_grad_norm=1e9)
        lp = eng.score(seqs, plens)
        samp = [[v - math.log(4.0) for v in x] for x in lp]
        got[cap] = eng.train_step(TrainBatch(seqs, plens, samp, [1.0, 0.0, 0.0, 1.0],
                                             [0, 0, 1, 1]))
    assert got[2.0]["tis_truncated_fraction"] == 1.0 and got[5.0]["tis_truncated_fraction"] == 0
    assert got[5.0]["grad_norm"] == pytest.approx(2 * got[2.0]["grad_norm"], rel=1e-4)
    assert got[2.0]["grad_norm"] > 0


# --- PPO ratio clipping ------------------------------------------------------------------------


@pytest.mark.parametrize(("adv", "want"), [(1.0, [0.0, 1.0, 0.5]), (-1.0, [-1.5, -1.0, 0.0])])
def test_the_clip_blocks_the_gradient_beyond_the_band(adv, want):
    """ε = 0.2, ratios 1.5, 1, 0.5: with A > 0 the token above 1.2 gives no gradient, the one
    below 0.8 still pushes up; with A < 0 the reverse. Elsewhere d/d log π = w·r·A."""
    eng = TorchLearnerEngine(_model(), ppo_clip_eps=0.2, pad_id=TASK.pad_id)
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = lp.detach() - torch.log(torch.tensor([1.5, 1.0, 0.5]))
    term, held = eng.rollout_objective(lp, old, torch.ones(3), adv)
    term.backward()
    assert torch.allclose(lp.grad, torch.tensor(want), atol=1e-6)
    assert held == 1
    plain = TorchLearnerEngine(_model(), pad_id=TASK.pad_id)  # no ε: every token pulls
    lp.grad = None
    plain.rollout_objective(lp, old, torch.ones(3), adv)[0].backward()
    assert torch.allclose(lp.grad, adv * torch.tensor([1.5, 1.0, 0.5]), atol=1e-6)


def test_a_step_whose_every_token_is_clipped_moves_nothing():
    """old log-probs that put A > 0 rollouts above 1 + ε and A < 0 ones below 1 − ε: the
    clipped step has zero gradient; the same batch without ε does not."""
    seqs, plens = _batch(_model())
    rewards, groups = [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]
    norms = {}
    for eps in (0.2, None):
        eng = TorchLearnerEngine(_model(), ppo_clip_eps=eps, pad_id=TASK.pad_id)
        lp = eng.score(seqs, plens)
        shift = [math.log(1.5) if r > 0.5 else -math.log(1.5) for r in rewards]
        old = [[v - s for v in x] for x, s in zip(lp, shift, strict=True)]
        stats = eng.train_step(TrainBatch(seqs, plens, lp, rewards, groups, old_logprobs=old))
        norms[eps] = stats["grad_norm"]
        assert stats["ppo_clipped_fraction"] == (1.0 if eps else 0.0)
    assert norms[0.2] == 0.0 and norms[None] > 0


def test_engine_knobs_are_checked():
    """A cap, level or ε out of range is a ConfigError naming it."""
    for kw, name in (({"tis_cap": 0.0}, "tis_cap"), ({"tis_cap": math.inf}, "tis_cap"),
                     ({"tis_level": "tokens"}, "tis_level"), ({"ppo_clip_eps": 1.0}, "ppo_clip_eps"),
                     ({"ppo_clip_eps": 0.0}, "ppo_clip_eps")):
        with pytest.raises(ConfigError, match=name):
            TorchLearnerEngine(_model(), pad_id=TASK.pad_id, **kw)


# --- settings --------------------------------------------------------------------------------


def test_settings_validate_the_knobs(monkeypatch):
    """Each out-of-range knob is refused at start naming its field; the environment sets them."""
    for cls, bad in ((LearnerSettings, {"tis_cap": 0}), (LearnerSettings, {"tis_cap": "inf"}),
                     (LearnerSettings, {"ppo_clip_eps": 1.0}),
                     (LearnerSettings, {"ppo_clip_eps": -0.1}),
                     (LearnerSettings, {"tis_level": "tokens"}),
                     (LearnerSettings, {"max_version_diff": -1}),
                     (ApiSettings, {"max_version_diff": -1}),
                     (ApiSettings, {"stale_rollouts": "keep"})):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            cls(**bad)
    d = LearnerSettings()
    assert (d.tis_cap, d.tis_level, d.ppo_clip_eps, d.max_version_diff, d.stale_rollouts) == \
        (2.0, "token", None, None, "drop")
    for k, v in (("TIS_CAP", "5"), ("PPO_CLIP_EPS", "0.2"), ("MAX_VERSION_DIFF", "3"),
                 ("STALE_ROLLOUTS", "refuse")):
        monkeypatch.setenv(f"ALIGN_{k}", v)
    s = LearnerSettings()
    assert (s.tis_cap, s.ppo_clip_eps, s.max_version_diff, s.stale_rollouts) == \
        (5.0, 0.2, 3, "refuse")


# --- staleness -------------------------------------------------------------------------------


@pytest.fixture
def registry(redis_url):
    """A registry holding v0 (oldest) ... v4 (newest)."""
    reg = Registry(RedisBus(connect(redis_url)), "libalign")
    for i in range(5):
        reg.create(f"v{i}", "nvfp4_minite", actor="test")
    return reg


def test_distance_is_creation_order_and_survives_pruning(registry):
    """v0 is 4 versions older than v4 (the newest); pruning v1 and v2 does not make it fresher."""
    assert versions_after(registry, "v0") == (4, "v4")
    assert versions_after(registry, "v3", "v4") == (1, "v4")
    assert versions_after(registry, "v4", "v4") == (0, "v4")
    assert versions_after(registry, "v4", "v1") == (-3, "v1")
    for vid in ("v1", "v2"):
        for state in ("converting", "converted", "loading", "serving", "retired"):
            registry.transition(vid, state, actor="test")
        assert registry.prune(vid)
    assert versions_after(registry, "v0") == (4, "v4")
    assert versions_after(registry, "v1", "v3") == (2, "v3")  # a pruned id is still placed
    with pytest.raises(VersionNotFoundError, match="v9"):
        versions_after(registry, "v9")


def _loop(redis_url, tmp_path, engine_kw=None, **settings) -> tuple[LearnerLoop, Metrics]:
    s = AllInOneSettings(redis_url=redis_url, store_dir=tmp_path / "store", **settings)
    metrics = Metrics()
    eng = TorchLearnerEngine(_model(), pad_id=TASK.pad_id, **(engine_kw or {}))
    loop = LearnerLoop(s, eng, LoopParts.build(s, metrics=metrics, stores=False),
                       RolloutPlan(prompts=lambda step: [], reward=TASK.verify,
                                   sampler_path=s.sampler_path))
    loop.current_version = "v4"
    return loop, metrics


def _train_batch():
    seqs, plens = _batch(_model())
    return TrainBatch(seqs, plens, [[-1.0] * (len(s) - p) for s, p in zip(seqs, plens, strict=True)],
                      [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])


def test_a_rollout_beyond_the_bound_is_dropped_and_counted(registry, redis_url, tmp_path):
    """max_version_diff=3: rollouts of v0 (4 older than v4) are dropped and counted; v1's train."""
    loop, metrics = _loop(redis_url, tmp_path, max_version_diff=3)
    batch = _train_batch()
    assert loop.train("v0", batch) == {"dropped_stale": 4}
    assert metrics.value("libalign_rollouts_stale_total", {"action": "dropped"}) == 4
    assert loop.engine.steps == 0
    assert loop.train("v1", batch)["tokens"] > 0 and loop.engine.steps == 1
    assert metrics.value("libalign_rollouts_stale_total", {"action": "dropped"}) == 4
    assert loop.objective()["max_version_diff"] == 3 and loop.objective()["tis_cap"] == 2.0


def test_a_rollout_beyond_the_bound_is_refused_naming_both_versions(registry, redis_url, tmp_path):
    """stale_rollouts=refuse: StaleRolloutError names v0, v4, the distance and the bound."""
    loop, metrics = _loop(redis_url, tmp_path, max_version_diff=3, stale_rollouts="refuse")
    with pytest.raises(StaleRolloutError, match=r"'v0' are 4 versions older than .*'v4'.* 3") as e:
        loop.train("v0", _train_batch())
    assert (e.value.version_id, e.value.current_version, e.value.distance) == ("v0", "v4", 4)
    assert metrics.value("libalign_rollouts_stale_total", {"action": "refused"}) == 4
    assert loop.engine.steps == 0


def test_later_ppo_epochs_move_the_ratio_into_the_clip(registry, redis_url, tmp_path):
    """ppo_epochs=3 with ε = 0.2 and π_old = the scores: three steps on one batch; the first
    sees r = 1 (nothing clipped), the last has tokens held by the clip."""
    got = {}
    for epochs in (1, 3):
        loop, _ = _loop(redis_url, tmp_path, {"ppo_clip_eps": 0.2, "lr": 0.05},
                        ppo_epochs=epochs, ppo_clip_eps=0.2)
        b = _train_batch()
        lp = loop.engine.score(b.sequences, b.prompt_lens)
        got[epochs] = loop.train("v4", TrainBatch(b.sequences, b.prompt_lens, lp, b.rewards,
                                                  b.groups, old_logprobs=lp))
        assert loop.engine.steps == epochs and loop.objective()["ppo_epochs"] == epochs
    assert got[1]["ppo_clipped_fraction"] == 0.0
    assert got[3]["ppo_clipped_fraction"] > 0.0


def test_no_bound_admits_anything_without_asking_redis(registry):
    """max_version_diff=None: every version is admitted, even one the registry never saw."""
    assert StalenessGuard(registry, None).admit("never-made", "v4")


def _rollout(rid: str) -> dict:
    return {"rollout_id": rid, "prompt_len": 2, "tokens": [1, 2, 3, 4], "logprobs": [-1.0, -2.0],
            "reward": 1.0, "path": "nvfp4_minite", "guidance": False}


@pytest.mark.parametrize("policy", ["refuse", "drop"])
def test_the_api_bounds_rollouts_by_the_newest_version(registry, redis_url, tmp_path, policy):
    """PUT rollouts of v0 with max_version_diff=3 (v4 newest): 409 stale_rollout naming both
    versions, or 201 with dropped=1 and nothing stored; counted either way. v1's are stored."""
    metrics = Metrics()
    settings = api_settings(redis_url, tmp_path / "store", max_version_diff=3,
                            stale_rollouts=policy)
    with TestClient(create_app(settings, metrics=metrics), raise_server_exceptions=False) as http:
        r = http.post("/v1/versions/v0/rollouts", json={"rollouts": [_rollout("a")]},
                      headers=AUTH)
        if policy == "refuse":
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "stale_rollout" and "'v0'" in err["message"] \
                and "'v4'" in err["message"]
        else:
            assert r.status_code == 201 and r.json() == {"version_id": "v0", "stored": 0,
                                                         "tokens": 0, "dropped": 1}
        action = "refused" if policy == "refuse" else "dropped"
        assert metrics.value("libalign_rollouts_stale_total", {"action": action}) == 1
        assert http.get("/v1/versions/v0/rollouts", headers=AUTH).json()["rollout_ids"] == []
        ok = http.post("/v1/versions/v1/rollouts", json={"rollouts": [_rollout("b")]},
                       headers=AUTH)
        assert ok.status_code == 201 and ok.json() == {"version_id": "v1", "stored": 1,
                                                       "tokens": 2}
        status = http.get("/v1/status", headers=AUTH).json()
        api = [s for s in status["services"] if s["service"] == "api"]
        assert api and api[0]["info"]["max_version_diff"] == 3
        assert api[0]["info"]["stale_rollouts"] == policy


# --- the demo --------------------------------------------------------------------------------


def test_the_demo_takes_the_knobs_and_reports_them(tmp_path):
    """alignd demo --tis-cap 5 --ppo-clip-eps 0.2 --max-version-diff 3: the learner trains with
    them, the table's caption and the report say so; its on-policy rollouts are never dropped."""
    import json

    from alignd.tools.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--steps", "2", "--seeds", "1", "--configs", "nvfp4_minite",
                              "--prompts-per-step", "2", "--samples-per-prompt", "2", "--no-api",
                              "--tis-cap", "5", "--ppo-clip-eps", "0.2", "--ppo-epochs", "2",
                              "--max-version-diff", "3",
                              "--out", str(tmp_path / "demo")], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "TIS cap 5 (token level), PPO clip ε 0.2 over 2 step(s) a batch, max_version_diff 3" \
        in " ".join(res.output.split())
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    (c,) = report["configs"]
    assert c["objective"] == {"tis": True, "tis_cap": 5.0, "tis_level": "token",
                              "ppo_clip_eps": 0.2, "ppo_epochs": 2, "max_version_diff": 3,
                              "stale_rollouts": "drop"}
    assert c["summary"]["rollouts_dropped_stale"] == 0
    assert all("ppo_clipped_fraction" in s["train"] for s in c["steps"])
    bad = runner.invoke(app, ["demo", "--ppo-clip-eps", "1.5", "--no-api", "--out",
                              str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "ppo_clip_eps" in bad.output
