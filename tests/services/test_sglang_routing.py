"""R3 through SGLang: the adapter asks for routed experts and stores them as routing records.

Against the recorded-contract server (uvicorn on a real port), whose ``routed_experts`` follows
SGLang 0.5.23's layout (``state_capturer/routed_experts.py``, ``base.py``,
``detokenizer_manager.py``: base64 of int32 ``[len(tokens) - 1, num_hidden_layers, top_k]``,
zero rows for layers without a router) and the narrowed wire of sgl-project/sglang#31219
(``meta_info.routed_experts_dtype``). The ids each record holds are compared with the fake
router's own choice for every token and MoE layer, read as Miles reads the payload
(``miles/rollout/generate_utils/generate_endpoint_utils.py``: ``_decode_topk_buffer`` with
``len(sample.tokens) - 1`` rows).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time

import numpy as np
import pytest
import redis
from alignclient.errors import EngineMismatchError, RoutingRecordError, SpecError
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.rollouts import RolloutStore, routing_record
from alignd.infra.work import READY, REQUESTS, RolloutRequest, RolloutsReady
from alignd.sampler.service import SamplerService
from alignd.sampler.sglang_engine import SGLangSamplerEngine
from alignd.sampler.sglang_routing import SGLangRouting
from alignd.sampler.sglang_sampler import build_sglang_sampler

from tests.services.api_server import serve
from tests.services.sglang_contract import SGLangContract
from tests.services.test_sglang_engine import EOS, FAST, ORIGINAL, model_dir, store_version

#: A model of 4 decoder layers, MoE at 1 and 3 (``mlp_only_layers`` [0, 2]), top-2 of 8.
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          "num_hidden_layers": 4, "mlp_only_layers": [0, 2], "num_experts": 8,
          "num_experts_per_tok": 2}
SERVER = {"num_layers": 4, "layers": [1, 3], "top_k": 2, "num_experts": 8}


@pytest.fixture
def rig(tmp_path):
    """``rig(routed_experts=..., **engine_kw)``: a contract server and an engine with the
    model's routing geometry, v1 converted."""
    store = tmp_path / "store"
    store_version(store, "v1")
    mdir = model_dir(tmp_path)
    (mdir / "config.json").write_text(json.dumps(CONFIG))
    exporter = ModelOptExport(WeightStore(store), mdir, tmp_path / "exports")
    with contextlib.ExitStack() as stack:
        def make(routed_experts=SERVER, **engine_kw):
            contract = SGLangContract(env_vars=ORIGINAL, routed_experts=routed_experts,
                                      model_path=str(mdir))
            url = stack.enter_context(serve(contract.app))
            engine_kw.setdefault("routing", SGLangRouting.from_config(mdir))
            engine = stack.enter_context(SGLangSamplerEngine(url, exporter, eos_id=EOS,
                                                             timeouts=FAST, **engine_kw))
            engine.load("v1")
            return contract, engine, store, mdir, url
        yield make


def _miles_decode(b64: str, rows: int, num_layers: int) -> np.ndarray:
    x = np.frombuffer(base64.b64decode(b64.encode("ascii")), dtype=np.int32)
    return x.reshape(rows, num_layers, -1)


def test_geometry_comes_from_the_model_config(tmp_path):
    """MoE layers from mlp_only_layers / decoder_sparse_step / first_k_dense_replace; a dense
    model has none (the engine then records no routing)."""
    assert SGLangRouting.from_config(CONFIG) == SGLangRouting(4, (1, 3), 2, 8)
    deepseek = {"num_hidden_layers": 5, "first_k_dense_replace": 1, "n_routed_experts": 64,
                "num_experts_per_tok": 6}
    assert SGLangRouting.from_config(deepseek).layers == (1, 2, 3, 4)
    assert SGLangRouting.from_config({"num_hidden_layers": 2}) is None
    with pytest.raises(RoutingRecordError, match="int64"):
        SGLangRouting(4, (1,), 2, 8, dtype="int64")


def test_generate_asks_for_routed_experts_and_keeps_the_moe_layers(rig):
    """``return_routed_experts`` in the request; one record per row with ``len(tokens) - 1``
    positions, the fake router's ids at every MoE layer in slot order, the served version."""
    contract, engine, *_ = rig()
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3]]
    gen = engine.generate(prompts, max_new_tokens=5, seed=3, routing=True)
    body = next(c.body for c in contract.calls if c.path == "/generate")
    assert body["return_routed_experts"] is True
    assert sorted(gen.routing) == [0, 1, 2]
    for i, seq in enumerate(gen.sequences):
        rec = gen.routing[i]
        assert rec.positions == len(seq) - 1 and rec.version == "v1"
        assert rec.layers == (1, 3) and rec.num_experts == 8 and rec.weights is None
        dense = _miles_decode(contract.routed_payload(seq)["routed_experts"], len(seq) - 1, 4)
        assert np.array_equal(rec.to_dense(4).numpy(), dense)
        for j in range(rec.positions):
            for c, layer in enumerate((1, 3)):
                assert rec.experts[j, c].tolist() == contract.route(seq[:j + 1], layer)
    plain = engine.generate(prompts, max_new_tokens=2, seed=3)
    assert plain.routing == {}
    assert "return_routed_experts" not in [c.body for c in contract.calls
                                           if c.path == "/generate"][-1]


def test_narrowed_wire_dtype_is_read_from_meta_info(rig):
    """A server sending uint16 (SGLANG_ROUTED_EXPERTS_DTYPE) and saying so in meta_info."""
    contract, engine, *_ = rig(routed_experts={**SERVER, "dtype": "uint16"})
    gen = engine.generate([[1, 2]], max_new_tokens=3, routing=True)
    seq = gen.sequences[0]
    assert gen.routing[0].experts[0, 1].tolist() == contract.route(seq[:1], 3)


def test_what_the_adapter_refuses(rig, tmp_path):
    """No server flag, garbage, a dtype other than the one configured, no geometry: each a
    typed error naming the request and the fault."""
    _, engine, *_ = rig(routed_experts=None)
    with pytest.raises(EngineMismatchError, match="--enable-return-routed-experts") as e:
        engine.generate([[1, 2]], max_new_tokens=2, routing=True)
    assert e.value.field == "enable_return_routed_experts"
    contract, engine, *_ = rig()
    contract.corrupt_routed_experts = "!!not base64!!"
    with pytest.raises(RoutingRecordError, match=r"request libalign-.*not standard base64"):
        engine.generate([[1, 2]], max_new_tokens=2, routing=True)
    contract.corrupt_routed_experts = base64.b64encode(b"\0" * 12).decode()
    with pytest.raises(RoutingRecordError, match="holds 12 bytes"):
        engine.generate([[1, 2]], max_new_tokens=2, routing=True)
    _, engine, *_ = rig(routed_experts={**SERVER, "dtype": "uint8"},
                          routing=SGLangRouting(4, (1, 3), 2, 8, dtype="uint16"))
    with pytest.raises(RoutingRecordError, match=r"'uint8'.*told 'uint16'"):
        engine.generate([[1, 2]], max_new_tokens=2, routing=True)
    _, engine, *_ = rig(routing=None)
    assert not engine.records_routing
    with pytest.raises(SpecError, match="routing geometry"):
        engine.generate([[1, 2]], max_new_tokens=2, routing=True)


def test_rollout_requests_with_routing_are_stored_with_their_records(rig, redis_url):
    """The sampler service over SGLang (built as the service builds it): a request with
    ``routing`` stores each rollout with its record, which reads back bit for bit."""
    contract, _, store, mdir, url = rig()
    settings = SamplerSettings(redis_url=redis_url, store_dir=store, sampler_name="sgl-r3",
                               block_ms=50, sglang_model_dir=str(mdir))
    engine, rollouts, _ = build_sglang_sampler(settings, url, eos_id=EOS, timeouts=FAST,
                                               path="nvfp4_naive", export_dir=mdir.parent / "exports")
    assert engine.records_routing and engine.routing.layers == (1, 3)
    bus = RedisBus.from_settings(settings)
    registry = Registry(bus, settings.key_prefix)
    registry.create("v1", str(store / "published" / "v1"))
    for state in ("converting", "converted"):
        registry.transition("v1", state, actor="test")
    rollouts = RolloutStore(redis.Redis.from_url(redis_url), settings.key_prefix)
    svc = SamplerService(settings, engine, bus, rollouts=rollouts)
    svc.setup()
    req = RolloutRequest(request_id="req-r3", version_id="v1", prompts=json.dumps([[1, 2], [3]]),
                         max_new_tokens=4, seed=5, routing=True)
    bus.publish(REQUESTS, req.to_fields())
    svc.bus.ensure_group(READY, "test")
    deadline = time.monotonic() + 10
    while not svc.step(block_ms=50) and time.monotonic() < deadline:
        pass
    [msg] = bus.read(READY, "test", "t", count=10, block_ms=100)
    ready = RolloutsReady.from_fields(msg.fields)
    assert ready.error is None
    for ro in rollouts.get_rollouts("v1", ready.ids()):
        rec = routing_record(ro.routing)
        assert rec.positions == len(ro.tokens) - 1 and rec.version == "v1"
        assert rec.experts[-1, 0].tolist() == contract.route(ro.tokens[:-1], 1)
    engine.close()

