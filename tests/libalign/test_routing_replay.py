"""Routing replay (R3) on the tiny Qwen3-MoE: records, capture on the sampler, replay on the learner."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import RoutingMismatchError, RoutingMissingError, RoutingRecordError

from libalign import models
from libalign.models.routing_replay import (
    RoutingStats,
    RoutingTable,
    capture_routing,
    replay_routing,
    routing_geometry,
)
from libalign.routing.records import RoutingRecord, bytes_per_token, check_routing

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return models.trained_tiny_model()


@pytest.fixture(scope="module")
def sampled(tiny):
    """16 rollouts sampled on nvfp4_minite with their routing records (with weights)."""
    model, task = tiny
    with capture_routing(model, weights=True) as cap:
        r = models.generate(model, task.prompts(16, seed=3), "nvfp4_minite", max_new_tokens=8,
                            batch_size=8, seed=1)
    return r, cap.records("v1")


def _learner_routing(model, r, path, table=None, weights="recompute"):
    """The learner's routing (ids per sequence) while scoring under ``path`` (replayed or not)."""
    stats = RoutingStats()
    with replay_routing(model, table, weights=weights, stats=stats), \
            capture_routing(model, weights=True) as cap:
        lps = models.score_sequences(model, r.sequences, r.prompt_lens, path)
    return cap.records(), lps, stats


def _sets(ids):
    return ids.long().sort(-1).values


def test_record_bytes_round_trip_and_size():
    """ids one byte each up to 256 experts, two above; weights bf16; bytes_per_token counts them."""
    g = torch.Generator().manual_seed(0)
    for experts, dt in ((8, torch.uint8), (256, torch.uint8), (300, torch.int16)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:4] for _ in range(5 * 3)])
        ids = ids.reshape(5, 3, 4).to(dt)
        w = torch.rand(5, 3, 4, generator=g).to(torch.bfloat16)
        rec = RoutingRecord(ids, (0, 2, 5), experts, w, "v7")
        raw, wraw = rec.to_bytes()
        assert len(raw) == ids.numel() * (1 if dt == torch.uint8 else 2)
        assert rec.nbytes() == 5 * bytes_per_token(3, 4, experts, weights=True)
        back = RoutingRecord.from_bytes(raw, positions=5, layers=(0, 2, 5), top_k=4,
                                        num_experts=experts, weights=wraw, version="v7")
        assert torch.equal(back.experts, ids) and back.experts.dtype == dt
        assert torch.equal(back.weights.view(torch.int16), w.view(torch.int16))
    assert bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B
    assert bytes_per_token(4, 2, 8) == 8  # the tiny demo model


def test_malformed_records_are_refused():
    """wrong byte count, id out of range, an expert twice in a row, bad layer lists, bad weights."""
    ok = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    with pytest.raises(RoutingRecordError, match="bytes"):
        RoutingRecord.from_bytes(b"\x00" * 3, positions=2, layers=(0,), top_k=2, num_experts=8)
    with pytest.raises(RoutingRecordError, match=r"\[0, 3\)"):
        RoutingRecord(ok, (0,), 3)
    with pytest.raises(RoutingRecordError, match="twice"):
        RoutingRecord(torch.tensor([[[1, 1]]], dtype=torch.uint8), (0,), 8)
    with pytest.raises(RoutingRecordError, match="layers"):
        RoutingRecord(ok, (1, 0), 8)
    with pytest.raises(RoutingRecordError, match="uint8"):
        RoutingRecord(ok.long(), (0,), 8)
    with pytest.raises(RoutingRecordError, match="weights"):
        RoutingRecord(ok, (0,), 8, torch.full((2, 1, 2), float("nan"), dtype=torch.bfloat16))


def test_check_routing_names_the_mismatch():
    """version, layers, top_k, num_experts and token count each refused by field; a missing
    record is RoutingMissingError."""
    rec = RoutingRecord(torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8), (0,), 8,
                        version="v1")
    good = dict(positions={0: 2}, layers=[0], top_k=2, num_experts=8, version="v1")
    check_routing({0: rec}, **good)
    for field, change in (("version", {"version": "v2"}), ("layers", {"layers": [0, 1]}),
                          ("top_k", {"top_k": 3}), ("num_experts", {"num_experts": 16}),
                          ("positions", {"positions": {0: 5}})):
        with pytest.raises(RoutingMismatchError) as e:
            check_routing({0: rec}, **{**good, **change})
        assert e.value.field == field
    with pytest.raises(RoutingMissingError):
        check_routing({0: rec}, **{**good, "positions": {0: 2, 1: 4}})


def test_capture_covers_every_fed_token(tiny, sampled):
    """One record per rollout, len(tokens) - 1 positions (the last token is never fed), every
    MoE layer, the model's top-k, ids in range."""
    model, _ = tiny
    r, recs = sampled
    geo = routing_geometry(model)
    assert sorted(recs) == list(range(len(r.sequences)))
    for i, s in enumerate(r.sequences):
        rec = recs[i]
        assert rec.positions == len(s) - 1
        assert list(rec.layers) == geo["layers"] and rec.top_k == geo["top_k"]
        assert rec.version == "v1" and rec.weights is not None


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_replay_routes_every_token_as_the_sampler_did(tiny, sampled, path):
    """With R3 the learner sends every fed token at every layer to the sampler's experts (the
    same top-k set; a token whose set agreed keeps its own slot order); without it, the bf16
    learner disagrees somewhere (so the test can fail)."""
    model, _ = tiny
    r, recs = sampled
    table = RoutingTable(recs)
    mine, _, stats = _learner_routing(model, r, path, table)
    for i in recs:
        n = recs[i].positions
        assert torch.equal(_sets(mine[i].experts[:n]), _sets(recs[i].experts)), i
    own, _, _ = _learner_routing(model, r, path, None)
    differ = sum(int((_sets(own[i].experts[:recs[i].positions]) != _sets(recs[i].experts))
                     .any(-1).sum()) for i in recs)
    if path == "bf16":
        assert differ > 0 and stats.disagreement > 0
    assert stats.total == sum(rec.positions for rec in recs.values()) * len(recs[0].layers)


def test_replay_of_the_learners_own_routing_changes_nothing(tiny, sampled):
    """Records of the learner's own routing: scores bit for bit those without replay, disagreement 0."""
    model, _ = tiny
    r, _ = sampled
    own, plain, _ = _learner_routing(model, r, "bf16", None)
    _, replayed, stats = _learner_routing(model, r, "bf16", RoutingTable(own))
    assert stats.disagreement == 0.0
    for a, b in zip(plain, replayed, strict=True):
        assert torch.equal(a, b)


def test_record_weights_are_taken_from_the_record(tiny, sampled):
    """weights='record': the gate weights applied are the sampler's recorded ones."""
    model, _ = tiny
    r, recs = sampled
    mine, _, _ = _learner_routing(model, r, "bf16", RoutingTable(recs), weights="record")
    for i in recs:
        n = recs[i].positions
        assert torch.equal(mine[i].weights[:n].view(torch.int16), recs[i].weights.view(torch.int16))


def test_forced_gate_weights_train_the_router(tiny, sampled):
    """R3 recomputes forced tokens' gate weights from the learner's logits: the router gets a
    gradient through them (and the forward differs from the unreplayed one where forced)."""
    model, _ = tiny
    r, recs = sampled
    table = RoutingTable(recs)
    ids = torch.tensor([r.sequences[0]])
    keys = torch.arange(ids.shape[1]).unsqueeze(0)
    from libalign.guidance import row_keys
    from libalign.models.paths import set_row_keys
    router = models.decoder_layers(model)[1].mlp.gate
    set_row_keys(model, row_keys(0, keys))
    try:
        with replay_routing(model, table) as stats:
            model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    finally:
        set_row_keys(model, None)
    assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)
    assert stats.total > 0
    model.zero_grad(set_to_none=True)


def test_replay_refuses_records_of_another_model(tiny, sampled):
    """A table made for other layers or top-k, or weights='record' without weights, is refused."""
    model, _ = tiny
    _, recs = sampled
    rec = recs[0]
    other = RoutingRecord(rec.experts[:, :2], rec.layers[:2], rec.num_experts)
    with pytest.raises(RoutingRecordError, match="layers"), \
            replay_routing(model, RoutingTable({0: other})):
        pass
    bare = RoutingRecord(rec.experts, rec.layers, rec.num_experts)
    with pytest.raises(RoutingRecordError, match="weights"), \
            replay_routing(model, RoutingTable({0: bare}), weights="record"):
        pass
