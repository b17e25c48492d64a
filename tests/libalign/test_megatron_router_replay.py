"""Routing replay (R3) at Megatron-core's ``TopKRouter``, on stock and libalign experts (CPU).

What is pinned, and against which peer code:

* forced tokens under ``weights="recompute"`` get the probabilities and routing map that
  Megatron-core's own ``RouterReplay`` gives in ``REPLAY_FORWARD`` for the same indices, bit
  for bit, with softmax after top-k, softmax before top-k and sigmoid scores
  (``megatron/core/transformer/moe/router_replay.py`` and ``moe_utils.py``'s
  ``topk_routing_with_score_function``, megatron-core 0.16.1 as installed); tokens whose own
  top-k set equals the record keep the router's own output bit for bit;
* capture keeps Megatron's slot order (``torch.topk``'s, what ``RouterReplayAction.RECORD``
  keeps) and the gate weights in the router's fp32;
* ``weights="record"`` with fp32 weights replays the recording forward bit for bit on a
  perturbed router, with Megatron's ``SequentialMLP`` experts and with libalign's, while ids
  alone (``recompute``) do not, nor bf16-rounded weights where the experts weigh in fp32
  (``SequentialMLP``): the point Miles makes in its issue #2722 (radixark/miles), that
  replaying ids alone is incomplete;
* slime's per-layer selection (``slime/backends/megatron_utils/actor.py``:
  ``rollout_routed_experts[:, layer_id]`` for every layer with a router, dense layers skipped)
  of a record's dense form gives the ids each router replays.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from libalign.errors import RoutingRecordError, SpecError
from libalign.guidance import row_keys
from libalign.models import megatron as mg
from libalign.models import megatron_routing as mr
from libalign.models import train as train_mod
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.routing_replay import RoutingTable
from libalign.routing.records import RoutingRecord
from tests.libalign.megatron_config import small_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU-shim test; Megatron's CUDA router is not shimmed")

CFG = small_config()


@pytest.fixture(autouse=True)
def _shims(megatron_world):
    with cpu_shims(), train_mod.cpu_threads(1):
        yield


def _stock(seed: int = 0):
    """A GPT with Megatron's own local spec: ``SequentialMLP`` experts, fp32 router."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = mg.transformer_config_from_hf(CFG, moe_router_dtype="fp32")
    spec = get_gpt_layer_local_spec(num_experts=8, qk_layernorm=True, normalization="RMSNorm")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=CFG.vocab_size,
                         max_sequence_length=64, position_embedding_type="rope",
                         rotary_base=mg.rope_theta(CFG),
                         share_embeddings_and_output_weights=False)
    return model.bfloat16().eval()


def _model(kind: str):
    if kind == "stock":
        return _stock()
    return mg.build_gpt_model(CFG, "bf16", moe_router_dtype="fp32", device="cpu").eval()


def _batch(b: int = 4, s: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CFG.vocab_size, (b, s), generator=g)
    keys = row_keys(torch.arange(b)[:, None], torch.arange(s).expand(b, s))
    return ids, keys


def _logits(model, ids):
    with torch.no_grad():
        return mg.gpt_logits(model, ids)


def _perturb(model, scale: float = 0.03, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in mr.routers(model).values():
            r.weight += scale * torch.randn(r.weight.shape, generator=g).to(r.weight.dtype)


@pytest.mark.parametrize("kind", ["stock", "libalign"])
def test_record_mode_replays_the_recording_forward_bitwise(kind):
    """fp32 weights, slot for slot: the perturbed router's forward equals the recording one bit
    for bit; ids alone (recompute) and bf16-rounded weights give other logits."""
    model = _model(kind)
    ids, keys = _batch()
    mr.set_router_keys(model, keys.T)
    with mr.capture_routing(model, weights=True) as cap:
        want = _logits(model, ids)
    recs = cap.records("v1")
    assert len(recs) == ids.shape[0]
    assert all(r.weights.dtype == torch.float32 and r.version == "v1" for r in recs.values())
    _perturb(model)
    moved = _logits(model, ids)
    assert not torch.equal(moved, want)
    with mr.replay_routing(model, RoutingTable(recs), weights="record") as st:
        got = _logits(model, ids)
    assert st.disagreement > 0  # the perturbed router chose otherwise: the test can fail
    assert torch.equal(got, want)
    with mr.replay_routing(model, RoutingTable(recs), weights="recompute"):
        ids_only = _logits(model, ids)
    assert not torch.equal(ids_only, want)
    bf16 = {i: RoutingRecord(r.experts, r.layers, r.num_experts, r.weights.bfloat16())
            for i, r in recs.items()}
    with mr.replay_routing(model, RoutingTable(bf16), weights="record"):
        rounded = _logits(model, ids)
    # Megatron's SequentialMLP weighs expert outputs by the fp32 probabilities: bf16 weights
    # are not enough there; libalign's experts take the gate weights in bf16 (Qwen3's order)
    assert torch.equal(rounded, want) == (kind == "libalign")
    mr.set_router_keys(model, None)


@pytest.fixture(scope="module")
def router(megatron_world):
    with cpu_shims():
        return mr.routers(_stock())[0]


@pytest.mark.parametrize("score, pre_softmax", [("softmax", False), ("softmax", True),
                                                ("sigmoid", False)])
def test_recompute_equals_megatron_router_replay(router, score, pre_softmax):
    """Forced tokens: Megatron-core's ``RouterReplay`` (REPLAY_FORWARD) output, bit for bit;
    tokens whose own set equals the record (also in another slot order): the router's own."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    T, E, k = 96, 8, 2
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g)
    own = torch.topk(logits if score == "softmax" else torch.sigmoid(logits), k).indices
    rec = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    rec[:24] = own[:24]  # same set, same order
    rec[24:48] = own[24:48].flip(1)  # same set, other order
    saved = (router.config.moe_router_pre_softmax, router.score_function)
    router.config.moe_router_pre_softmax, router.score_function = pre_softmax, score
    try:
        router.row_keys = row_keys(0, torch.arange(T))
        plain = router.routing(logits.clone())
        table = RoutingTable({0: RoutingRecord(rec[:, None].to(torch.uint8), (0,), E)})
        with mr.replay_routers({0: router}, table) as st:
            ours = router.routing(logits.clone())
        upstream = RouterReplay()
        try:
            upstream.set_target_indices(rec)
            upstream.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.router_replay = upstream
            theirs = router.routing(logits.clone())
        finally:
            router.router_replay = None
            RouterReplay.global_router_replay_instances.remove(upstream)
    finally:
        router.config.moe_router_pre_softmax, router.score_function = saved
        router.row_keys = None
    agree = torch.zeros(T, dtype=torch.bool)
    agree[:48] = True
    agree |= (rec.sort(1).values == own.sort(1).values).all(1)
    assert st.differ[0] == int((~agree).sum()) > 0
    for mine, ref in ((ours[0], theirs[0]), (ours[1], theirs[1])):
        assert torch.equal(mine[~agree], ref[~agree])
    for mine, ref in ((ours[0], plain[0]), (ours[1], plain[1])):
        assert torch.equal(mine[agree], ref[agree])
    assert torch.equal(ours[1][~agree], torch.zeros_like(ours[1][~agree]).scatter(
        1, rec[~agree], True))


def test_capture_keeps_megatron_slot_order_and_fp32_weights(router):
    """Captured ids are ``torch.topk``'s order (RouterReplayAction.RECORD's), weights the
    router's fp32 probabilities at them."""
    T = 40
    logits = torch.randn(T, 8, generator=torch.Generator().manual_seed(5))
    router.row_keys = row_keys(2, torch.arange(T))
    try:
        with mr.capture_routers({0: router}, weights=True) as cap:
            probs, _ = router.routing(logits.clone())
    finally:
        router.row_keys = None
    rec = cap.records()[2]
    top = torch.topk(logits, 2).indices
    assert torch.equal(rec.experts[:, 0].long(), top)
    assert rec.weights.dtype == torch.float32
    assert torch.equal(rec.weights[:, 0], probs.gather(1, top))


def test_slime_layer_selection_of_the_dense_form_is_what_each_router_replays():
    """slime's actor hands MoE layer ``layer_id`` the column ``dense[:, layer_id]`` of the
    int32 ``[len-1, layers, k]`` array (dense layers skipped): the record's ids of that layer."""
    g = torch.Generator().manual_seed(1)
    ids = torch.rand(9, 2, 8, generator=g).argsort(-1)[..., :2].to(torch.uint8)
    rec = RoutingRecord(ids, (1, 3), 8)
    dense = rec.to_dense(4)
    moe_layer_freq = [0, 1, 0, 1]
    picked = {layer_id: dense[:, layer_id] for layer_id in range(4) if moe_layer_freq[layer_id]}
    assert sorted(picked) == list(rec.layers)
    table = RoutingTable({0: rec})
    keys = row_keys(0, torch.arange(9))
    for j, layer in enumerate(rec.layers):
        _, got, _ = table.lookup(layer, keys)
        assert torch.equal(got, picked[layer].long()) and torch.equal(got, rec.experts[:, j].long())


def test_replay_refuses_what_it_cannot_do(router):
    """Missing keys, a table for other layers, the fused router: typed errors naming why."""
    rec = RoutingRecord(torch.tensor([[[0, 1]]], dtype=torch.uint8), (0,), 8)
    with pytest.raises(SpecError, match="set_router_keys"), \
            mr.replay_routers({0: router}, RoutingTable({0: rec})):
        router.routing(torch.randn(1, 8))
    other = RoutingRecord(torch.tensor([[[0, 1]]], dtype=torch.uint8), (1,), 8)
    with pytest.raises(RoutingRecordError, match="layers"), \
            mr.replay_routers({0: router}, RoutingTable({0: other})):
        pass
    router.config.moe_router_fusion = True
    try:
        with pytest.raises(SpecError, match="unfused"), \
                mr.replay_routers({0: router}, RoutingTable({0: rec})):
            pass
    finally:
        router.config.moe_router_fusion = False


def test_docs_snippet_takes_sglang_answers_into_a_stock_megatron_learner():
    """docs/snippets/r3_sglang_megatron.py (shown on docs/concepts/routing-replay.md): SGLang
    answers, encoded as SGLang's detokenizer encodes them, become records that force a
    perturbed stock router to the recorded experts; the same logits as replay_routing itself."""
    import base64
    import runpy
    from pathlib import Path

    snippet = runpy.run_path(str(Path(__file__).resolve().parents[2] / "docs" / "snippets" /
                                 "r3_sglang_megatron.py"))
    model = _stock()
    ids, keys = _batch(b=3, s=9, seed=4)
    mr.set_router_keys(model, keys.T)
    with mr.capture_routing(model) as cap:
        _logits(model, ids)
    recs = cap.records("v3")
    mr.set_router_keys(model, None)
    config = {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}
    answers = [{"meta_info": {"weight_version": "v3", "routed_experts": base64.b64encode(
        recs[i].to_dense(2).numpy().tobytes()).decode("utf-8")}} for i in range(3)]
    sequences = [[*row.tolist(), 0] for row in ids]  # the last token is drawn, never fed
    got = snippet["records_from_sglang"](answers, sequences, config)
    assert all(torch.equal(got[i].experts, recs[i].experts) and got[i].version == "v3"
               for i in range(3))
    _perturb(model)
    with torch.no_grad():
        logits, disagreement = snippet["replay"](model, ids, got)
    assert disagreement > 0
    mr.set_router_keys(model, keys.T)
    with mr.replay_routing(model, RoutingTable(recs)):
        want = _logits(model, ids)
    assert torch.equal(logits, want)
