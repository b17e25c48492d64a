"""Routing records (R3) through the services: the wire form, the sampler, the REST API, the loop."""

from __future__ import annotations

import base64
import copy

import pytest
import torch
from alignclient.errors import RoutingMismatchError, RoutingMissingError
from alignclient.models import Rollout, RoutingWire
from pydantic import ValidationError

pytest.importorskip("transformers")

from alignd.formats.convert import convert_published, target_spec
from alignd.formats.published import write_published
from alignd.formats.weight_store import WeightStore
from alignd.infra.stores.rollouts import routing_record, routing_wire
from alignd.infra.telemetry import Metrics
from alignd.learner.engine import TorchLearnerEngine
from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
from alignd.sampler.engine import TorchSamplerEngine

from libalign import models
from libalign.routing.records import RoutingRecord
from libalign.spec import PRESETS
from tests.services.test_api import AUTH, env, publish  # noqa: F401  (env is a fixture)
from tests.services.test_rl_loop import TASK, deploy  # noqa: F401  (deploy is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _wire(**kw) -> dict:
    ids = bytes([0, 1, 2, 3, 4, 5, 6, 7] * 3)  # 3 tokens x 2 layers x 2 experts... twice
    base = dict(layers=[0, 1], top_k=2, num_experts=8, experts=base64.b64encode(ids).decode())
    base.update(kw)
    return base


def test_wire_validates_shape_range_and_layers():
    """Whole tokens of ids, ids below num_experts (one and two bytes), increasing layers, top_k
    within the experts, weights of the ids' count, standard base64 only."""
    w = RoutingWire(**_wire())
    assert w.positions == 6 and w.id_bytes == 1
    bad = [dict(experts=base64.b64encode(b"\x00" * 5).decode()),  # not whole tokens
           dict(num_experts=7),  # id 7 out of range
           dict(layers=[1, 0]), dict(layers=[-1, 0]), dict(top_k=9),
           dict(weights=base64.b64encode(b"\x00" * 3).decode()),
           dict(experts="not base64!")]
    for change in bad:
        with pytest.raises(ValidationError):
            RoutingWire(**_wire(**change))
    wide = torch.tensor([[[299, 3]]], dtype=torch.int16)
    rec = RoutingRecord(wide, (4,), 300)
    assert routing_record(routing_wire(rec)).experts.tolist() == [[[299, 3]]]
    with pytest.raises(ValidationError):
        RoutingWire(**{**routing_wire(rec).model_dump(), "num_experts": 299})


def test_rollout_routing_covers_all_but_the_last_token():
    """A rollout's routing must have len(tokens) - 1 positions."""
    body = dict(rollout_id="r0", prompt_len=3, tokens=list(range(7)), logprobs=[-1.0] * 4,
                path="nvfp4_minite")
    Rollout(**body, routing=_wire())
    with pytest.raises(ValidationError, match="routing covers 6 tokens"):
        Rollout(**{**body, "tokens": list(range(8)), "logprobs": [-1.0] * 5}, routing=_wire())


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    """A bf16 sampler serving version v1 (a random tiny model converted into its store)."""
    model = models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)
    store = WeightStore(tmp_path_factory.mktemp("s"))
    write_published(store.published_root, "v1",
                    {k: v.detach() for k, v in model.state_dict().items()})
    spec, quantize = target_spec(PRESETS["minite"], "bf16")
    convert_published(store.published_path("v1"), store, "v1", spec, quantize=quantize)
    eng = TorchSamplerEngine(model, store, "bf16", batch_size=4, eos_id=TASK.eos_id,
                             pad_id=TASK.pad_id)
    eng.load("v1")
    return eng


def test_sampler_records_routing_and_it_survives_the_wire(sampler):
    """generate(routing=True): one record per prompt, len - 1 positions, the served version;
    the wire form gives the same ids and weights back."""
    gen = sampler.generate(TASK.prompts(5, 0), max_new_tokens=4, routing=True)
    assert sorted(gen.routing) == list(range(5))
    for i, s in enumerate(gen.sequences):
        rec = gen.routing[i]
        assert rec.positions == len(s) - 1 and rec.version == "v1"
        back = routing_record(routing_wire(rec))
        assert torch.equal(back.experts, rec.experts) and back.layers == rec.layers
    plain = sampler.generate(TASK.prompts(5, 0), max_new_tokens=4)
    assert plain.routing == {} and plain.sequences == gen.sequences


def test_rest_api_stores_and_returns_routing(env, sampler):  # noqa: F811
    """POST rollouts with routing, GET them back: the same record, bit for bit."""
    assert publish(env).status_code == 201
    gen = sampler.generate(TASK.prompts(2, 1), max_new_tokens=4, routing=True)
    rs = [Rollout(rollout_id=f"r{i}", prompt_len=p, tokens=s, logprobs=lp, path="bf16",
                  routing=routing_wire(gen.routing[i])).model_dump()
          for i, (s, p, lp) in enumerate(zip(gen.sequences, gen.prompt_lens, gen.logprobs,
                                             strict=True))]
    r = env.http.post("/v1/versions/v1/rollouts", json={"rollouts": rs}, headers=AUTH)
    assert r.status_code == 201, r.text
    got = env.http.get("/v1/versions/v1/rollouts", params={"ids": "r0,r1"},
                       headers=AUTH).json()["rollouts"]
    for i, g in enumerate(got):
        rec = routing_record(RoutingWire(**g["routing"]))
        assert torch.equal(rec.experts, gen.routing[i].experts)
    bad = copy.deepcopy(rs[0])
    bad["rollout_id"] = "r9"
    bad["routing"]["num_experts"] = 2
    r = env.http.post("/v1/versions/v1/rollouts", json={"rollouts": [bad]}, headers=AUTH)
    assert r.status_code == 422 and "expert ids" in r.text


def _loop_for(engine, metrics):
    loop = LearnerLoop.__new__(LearnerLoop)  # only the routing check is exercised
    loop.engine = engine
    loop.parts = LoopParts(bus=None, registry=None, store=None, staleness=None, metrics=metrics)
    return loop


def test_loop_refuses_and_counts_rollouts_without_routing(sampler):
    """Under R3 a rollout without a record is refused and counted; records of another version
    or top-k are refused by field; 'measure' takes what is there."""
    gen = sampler.generate(TASK.prompts(3, 2), max_new_tokens=4, routing=True)
    items = [Rollout(rollout_id=f"r{i}", prompt_len=p, tokens=s, logprobs=lp, path="bf16",
                     routing=routing_wire(gen.routing[i]) if i != 1 else None)
             for i, (s, p, lp) in enumerate(zip(gen.sequences, gen.prompt_lens, gen.logprobs,
                                                strict=True))]
    metrics = Metrics()
    eng = TorchLearnerEngine(copy.deepcopy(sampler.model), "bf16", pad_id=TASK.pad_id,
                             routing_replay="recompute")
    loop = _loop_for(eng, metrics)
    with pytest.raises(RoutingMissingError, match="1 of 3"):
        loop.routing_records("v1", items)
    assert metrics.registry.get_sample_value("libalign_rollouts_unreplayed_total") == 1
    whole = [items[0], items[2]]
    assert sorted(loop.routing_records("v1", whole)) == [0, 1]
    with pytest.raises(RoutingMismatchError) as e:
        loop.routing_records("v2", whole)
    assert e.value.field == "version"
    eng.routing_replay = "measure"
    assert sorted(loop.routing_records("v1", items)) == [0, 2]
    with pytest.raises(RoutingMissingError):  # the engine refuses too, whoever calls it
        TorchLearnerEngine(copy.deepcopy(sampler.model), "bf16", routing_replay="record").score(
            gen.sequences, gen.prompt_lens)


def test_r3_iteration_through_the_services(deploy):  # noqa: F811
    """One loop iteration with routing replay: the sampler stores routing with every rollout,
    the learner scores and trains routed by it and reports the disagreement before forcing."""
    d = deploy("nvfp4_minite")
    eng = TorchLearnerEngine(d.learner_model, "nvfp4_minite", pad_id=TASK.pad_id, lr=1e-4,
                             routing_replay="recompute")
    loop = LearnerLoop(d.settings, eng, LoopParts.build(d.settings, bus=d.bus, rollouts=d.rollouts,
                                                        guidance=d.guidance),
                       RolloutPlan(prompts=lambda step: TASK.prompts(2, step), reward=TASK.verify,
                                   sampler_path="nvfp4_minite", prompts_per_step=2,
                                   samples_per_prompt=2, max_new_tokens=4, timeout_s=60))
    r = loop.iteration(0)
    stored = d.rollouts.get_rollouts(r.version_id)
    assert stored and all(x.routing is not None for x in stored)
    assert all(x.routing.version_id == r.version_id for x in stored)
    assert r.routing["decisions"] == sum(len(x.tokens) - 1 for x in stored) * 2
    assert 0.0 <= r.routing["disagreement"] <= 1.0
    assert r.train["tokens"] == r.delta["tokens"]


def test_demo_r3_configuration_and_routing_column(tmp_path):
    """alignd demo --configs nvfp4_minite,nvfp4_minite_r3: R3 only where named (not in the
    default set), every step reports its routing disagreement, the table has the column."""
    from alignd.tools.cli import app
    from alignd.tools.demo.run import DEFAULT_CONFIGS
    from typer.testing import CliRunner

    assert "nvfp4_minite_r3" not in DEFAULT_CONFIGS
    res = CliRunner().invoke(app, ["demo", "--steps", "1", "--seeds", "1", "--configs",
                                   "nvfp4_minite,nvfp4_minite_r3", "--prompts-per-step", "2",
                                   "--samples-per-prompt", "2", "--no-api",
                                   "--out", str(tmp_path / "demo")], terminal_width=220)
    assert res.exit_code == 0, res.output
    import json

    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    modes = {c["name"]: c["routing_replay"] for c in report["configs"]}
    assert modes == {"nvfp4_minite": "measure", "nvfp4_minite_r3": "recompute"}
    for c in report["configs"]:
        (step,) = c["steps"]
        assert step["routing_decisions"] > 0 and 0 <= step["routing_disagreement"] <= 1
        assert c["summary"]["routing_disagreement"] == step["routing_disagreement"]
    assert "routing" in res.output and "R3" in res.output

