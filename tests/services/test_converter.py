"""Pins the converter service in-process against a real Redis: the happy path bit for bit,
failures that name the tensor while the service goes on, duplicates, reclaim, metrics."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import torch
from alignclient.errors import EventError
from alignd.converter.main import run_converter
from alignd.formats.convert import convert_published
from alignd.formats.selection import is_expert_weight
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.events import ConvertedEvent, PublishedEvent
from alignd.infra.registry import Registry
from alignd.infra.settings import ConverterSettings
from alignd.infra.telemetry import Metrics, serve_metrics
from alignd.sync.bf16 import publish_version

from libalign.spec import PRESETS
from libalign.spec import quantize as spec_quantize

from .conftest import tiny_experts


@pytest.fixture
def env(redis_url, tmp_path):
    """Settings, bus, registry and store of one converter deployment."""
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                                 consumer_name="conv-1", heartbeat_ms=50, claim_idle_ms=300,
                                 block_ms=100)
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    bus.ensure_group(settings.published_stream, settings.converter_group)
    return settings, bus, reg, store


def publish(env, vid, sd, **kw):
    settings, bus, reg, store = env
    return publish_version(store.published_root, reg, bus, settings.published_stream, vid, sd, **kw)


def converted_events(env) -> list[ConvertedEvent]:
    settings, bus, _, _ = env
    return [ConvertedEvent.from_fields(f) for _id, f in bus.client.xrange(settings.converted_stream)]


def assert_bits_equal_spec(store, vid, sd, spec):
    """Every stored byte equals libalign.spec.quantize's (atol=0); raws are byte copies."""
    sv = store.read_version(vid)
    assert set(sv.tensors) == set(sd)
    for name, t in sd.items():
        got = sv[name]
        if is_expert_weight(name, t):
            ref = spec_quantize(t, spec)
            assert torch.equal(got.codes, ref.codes), name
            assert torch.equal(got.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8))
            assert torch.equal(got.outer_scale.view(torch.int32), ref.outer_scale.view(torch.int32))
        else:
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_happy_path(env):
    """4 experts x 64x128 BF16: converted, announced, acked, verified and bit-exact; metrics."""
    settings, bus, reg, store = env
    sd = tiny_experts(experts=4, rows=64, k=128)
    publish(env, "v1", sd, shard_bytes=30_000)
    metrics = Metrics()
    assert run_converter(settings, max_messages=1, metrics=metrics) == 1
    rec = reg.get("v1")
    assert rec.state == "converted" and rec.owner == "conv-1"
    assert [h.to_state for h in reg.history("v1")] == ["published", "converting", "converted"]
    assert bus.pending_count(settings.published_stream, settings.converter_group) == 0
    [ev] = converted_events(env)
    assert (ev.version_id, ev.path, ev.preset) == ("v1", str(store.version_path("v1")), "minite")
    assert ev.tensors == len(sd) and ev.stored_bytes == store.read_manifest("v1").totals.stored_bytes
    assert_bits_equal_spec(store, "v1", sd, PRESETS["minite"])
    assert metrics.value("libalign_versions_converted_total") == 1
    assert metrics.value("libalign_conversion_stage_seconds_count", {"stage": "quantize"}) == 1
    assert metrics.value("libalign_conversion_input_bytes_total") == sum(t.numel() * 2 for t in sd.values())
    assert metrics.value("libalign_conversion_output_bytes_total") == ev.stored_bytes


def test_on_step_hears_every_durable_step(env):
    """run_converter's on_step gets each shard, the manifest and the commit, in order."""
    settings, _bus, _reg, store = env
    publish(env, "v1", tiny_experts(experts=4, rows=64, k=128))
    steps: list[str] = []
    assert run_converter(settings.model_copy(update={"store_shard_bytes": 20_000}),
                         max_messages=1, on_step=steps.append) == 1
    shards = sorted(p.name for p in store.version_path("v1").glob("*.safetensors"))
    assert len(shards) > 1
    assert steps == [f"shard {name}" for name in shards] + ["manifest", "committed"]


def test_other_preset_and_all_linear(env):
    """ALIGN_PRESET and ALIGN_CONVERT_ALL_LINEAR reach the conversion."""
    settings, _bus, _reg, store = env
    settings = settings.model_copy(update={"preset": "modelopt", "convert_all_linear": True})
    sd = tiny_experts(experts=2)
    publish(env, "v", sd)
    run_converter(settings, max_messages=1)
    sv = store.read_version("v")
    q = sv["model.layers.0.self_attn.q_proj.weight"]
    ref = spec_quantize(sd["model.layers.0.self_attn.q_proj.weight"], PRESETS["modelopt"])
    assert q.bitwise_equal(ref) and q.outer_scale.shape == ()


def test_target_path_chooses_the_weight_spec(env):
    """A version published for nvfp4_naive gets one outer scale per expert; for bf16, no codes."""
    settings, _bus, _reg, store = env
    sd = tiny_experts(experts=3)
    publish(env, "naive", sd, target_path="nvfp4_naive")
    publish(env, "plain", sd, target_path="bf16")
    assert run_converter(settings, max_messages=2) == 2
    from libalign.gemm import PATHS

    stack = "model.layers.0.mlp.experts.gate_up_proj"
    q = store.read_version("naive")[stack]
    assert q.bitwise_equal(spec_quantize(sd[stack], PATHS["nvfp4_naive"].weight_spec))
    assert q.outer_scale.shape == (3,)
    raw = store.read_version("plain")
    assert all(torch.equal(raw[n].view(torch.uint8), t.view(torch.uint8)) for n, t in sd.items())
    events = {e.version_id: e for e in converted_events(env)}
    assert events["naive"].target_path == "nvfp4_naive" and events["naive"].preset == "te_expert"
    assert events["plain"].target_path == "bf16"


def test_bad_versions_fail_by_name_and_service_goes_on(env):
    """NaN, missing shard, int dtype and a malformed event each end the message (acked);
    the failed versions name the tensor or shard; the good version after them converts."""
    settings, bus, reg, store = env
    nan = tiny_experts(experts=2)
    bad_name = "model.layers.0.mlp.experts.1.down_proj.weight"
    nan[bad_name] = nan[bad_name].clone()
    nan[bad_name][7, 3] = float("nan")
    publish(env, "v-nan", nan)
    publish(env, "v-shard", tiny_experts(experts=2), shard_bytes=20_000)
    index = store.published_path("v-shard") / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"]
    (store.published_path("v-shard") / wmap[bad_name]).unlink()
    ints = tiny_experts(experts=2)
    ints["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.ones(64, 128, dtype=torch.int16)
    publish(env, "v-int", ints)
    bus.publish(settings.published_stream, {"event": "published", "path": "/nowhere"})
    good = tiny_experts(experts=2, seed=3)
    publish(env, "v-good", good)
    metrics = Metrics()
    assert run_converter(settings, max_messages=5, metrics=metrics) == 5

    r = reg.get("v-nan")
    assert r.state == "failed" and r.reason.startswith("non_finite:") and bad_name in r.reason
    assert "(7, 3)" in r.reason
    r = reg.get("v-shard")
    assert r.state == "failed" and r.reason.startswith("missing_shard:") and wmap[bad_name] in r.reason
    r = reg.get("v-int")
    assert r.state == "failed" and r.reason.startswith("invalid_dtype:")
    assert "experts.0.up_proj.weight" in r.reason
    assert reg.state("v-good") == "converted"
    assert store.list_versions() == ["v-good"]
    assert_bits_equal_spec(store, "v-good", good, PRESETS["minite"])
    assert bus.pending_count(settings.published_stream, settings.converter_group) == 0
    assert [e.version_id for e in converted_events(env)] == ["v-good"]
    for reason in ("non_finite", "missing_shard", "invalid_dtype", "invalid_event"):
        assert metrics.value("libalign_versions_failed_total", {"reason": reason}) == 1, reason


def test_duplicate_event_reuses_the_version(env):
    """A second published event for a converted version re-announces it without rewriting."""
    settings, bus, reg, store = env
    ev = publish(env, "v", tiny_experts(experts=2))
    run_converter(settings, max_messages=1)
    created = store.read_manifest("v").created_at
    bus.publish(settings.published_stream, ev.to_fields())
    run_converter(settings, max_messages=1)
    assert store.read_manifest("v").created_at == created
    assert [e.version_id for e in converted_events(env)] == ["v", "v"]
    assert [h.to_state for h in reg.history("v")].count("converted") == 1
    assert bus.pending_count(settings.published_stream, settings.converter_group) == 0


def dead_consumer_takes(env, vid_state: str | None = "converting") -> str:
    """A consumer reads the next message, optionally claims its version, and dies."""
    settings, bus, reg, _ = env
    [msg] = bus.read(settings.published_stream, settings.converter_group, "dead", block_ms=100)
    if vid_state:
        reg.transition(msg.fields["version_id"], vid_state, actor="dead")
    return msg.id


def test_reclaims_work_of_a_dead_consumer(env):
    """A message left pending in 'converting' is reclaimed on start, re-entered and finished."""
    settings, bus, reg, store = env
    sd = tiny_experts(experts=2)
    publish(env, "v", sd)
    dead_consumer_takes(env)
    metrics = Metrics()
    assert run_converter(settings, max_messages=1, metrics=metrics) == 1
    hist = [(h.from_state, h.to_state, h.actor) for h in reg.history("v")]
    assert hist[1:] == [("published", "converting", "dead"), ("converting", "converting", "conv-1"),
                        ("converting", "converted", "conv-1")]
    assert metrics.value("libalign_bus_messages_reclaimed_total") == 1
    assert_bits_equal_spec(store, "v", sd, PRESETS["minite"])
    assert bus.pending_count(settings.published_stream, settings.converter_group) == 0


def test_backlog_of_abandoned_messages_is_drained(env):
    """Several messages of a dead consumer are all reclaimed, one at a time, and finished."""
    settings, bus, reg, _store = env
    for i in range(3):
        publish(env, f"v{i}", tiny_experts(experts=1, seed=i))
    got = bus.read(settings.published_stream, settings.converter_group, "dead", count=3, block_ms=100)
    assert len(got) == 3
    metrics = Metrics()
    assert run_converter(settings, max_messages=3, metrics=metrics) == 3
    assert [reg.state(f"v{i}") for i in range(3)] == ["converted"] * 3
    assert metrics.value("libalign_bus_messages_reclaimed_total") == 3


def test_reclaim_after_commit_reuses_store_version(env):
    """A predecessor that died after the rename: its verified version is kept, not rewritten."""
    settings, _bus, reg, store = env
    sd = tiny_experts(experts=2)
    publish(env, "v", sd)
    dead_consumer_takes(env)
    first = convert_published(store.published_path("v"), store, "v", PRESETS["minite"])
    run_converter(settings, max_messages=1)
    assert reg.state("v") == "converted" and store.read_manifest("v") == first


def test_poison_message_fails_after_max_deliveries(env):
    """A message delivered more than max_deliveries times fails its version instead of looping."""
    settings, _bus, reg, store = env
    settings = settings.model_copy(update={"max_deliveries": 1})
    publish(env, "v", tiny_experts(experts=2))
    dead_consumer_takes(env)
    run_converter(settings, max_messages=1)
    rec = reg.get("v")
    assert rec.state == "failed" and rec.reason.startswith("too_many_deliveries")
    assert store.list_versions() == []


def test_stop_event_ends_the_loop(env):
    """run_converter returns promptly when its stop event is set."""
    settings, _, _, _ = env
    stop = threading.Event()
    t = threading.Timer(0.3, stop.set)
    t.start()
    assert run_converter(settings, stop_event=stop) == 0
    t.join()


def test_metrics_endpoint(tmp_path):
    """/metrics serves the libalign_ metrics of a private registry; /healthz answers."""
    metrics = Metrics()
    metrics.observe_failure(ValueError("not an AlignError"))
    server = serve_metrics(metrics.registry, 0, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert 'libalign_conversion_stage_seconds_bucket{le="0.001",stage="read"}' in text
        assert 'libalign_versions_failed_total{reason="other"} 1.0' in text
        assert urllib.request.urlopen(f"{base}/healthz", timeout=5).status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert Metrics().value("libalign_versions_failed_total", {"reason": "other"}) == 0


def test_published_event_validation():
    """Events with a bad version id or the wrong kind raise EventError (an InputError)."""
    with pytest.raises(EventError, match="version_id"):
        PublishedEvent.from_fields({"event": "published", "version_id": "../x", "path": "/p"})
    with pytest.raises(EventError):
        PublishedEvent.from_fields({"event": "converted", "version_id": "v", "path": "/p"})
