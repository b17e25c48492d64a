"""The refit path: named BF16 tensors -> NVFP4 in SGLang's names -> buckets -> a staged receiver.

Bits are compared with atol = 0 against the two other ways the same tensors become ModelOpt
tensors: :func:`libalign.kernels.quantize` + :func:`libalign.checkpoint.to_modelopt` per tensor,
and the ModelOpt export of a weight-store version (:class:`alignd.formats.modelopt_export.
ModelOptExport`), which is what an SGLang server loads from disk.
"""

from __future__ import annotations

import json

import pytest
import torch
from alignclient.errors import (
    DTypeError,
    EngineMismatchError,
    InputError,
    LayoutError,
    NonFiniteError,
    PayloadTooLargeError,
    ShapeError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.selection import make_select
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus, connect
from alignd.infra.registry import Registry
from alignd.sync import tensor as T
from alignd.sync.announce import RefitStages
from alignd.sync.buckets import Bucket, BucketEntry, RefitHeader, buckets, layout, pack
from alignd.sync.receive import RefitReceiver
from alignd.sync.refit import RefitReport
from alignd.sync.stream import quantize_named
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from libalign.checkpoint import to_modelopt
from libalign.kernels import ops
from libalign.models.megatron_parallel import launch
from libalign.spec import PRESETS, shared_outer_amax
from tests.services import refit_workers as W

MINITE, MODELOPT = PRESETS["minite"], PRESETS["modelopt"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype, shape, bytes)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def stack_model(seed: int = 1) -> dict[str, torch.Tensor]:
    """Transformers-5 names: 3-D expert stacks, a router, attention, a norm, an embedding."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.k_proj.weight": (torch.randn(32, 64, generator=g) * 9).bfloat16(),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.gate_up_proj":
            (torch.randn(4, 64, 64, generator=g) * torch.logspace(-2, 1, 64).reshape(1, -1, 1)
             ).bfloat16(),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 32, generator=g).bfloat16(),
    }


# --- the stream ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["minite", "modelopt"])
def test_stream_equals_the_modelopt_export_of_a_store_version(tmp_path, spec):
    """3-D stacks and (all_linear) q/k/v: the stream's tensors are the export's, bit for bit."""
    sd = stack_model()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    store = WeightStore(tmp_path / "store")
    s = PRESETS[spec]
    amax = {}
    if spec == "modelopt":  # the converter shares fused siblings' maxima for SGLang
        qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        shared = shared_outer_amax([sd[n] for n in qkv], s)
        amax = {n: shared.clone() for n in qkv}
    store.write_version("v1", sd, s, select=make_select(all_linear=True), outer_amax=amax)
    out = ModelOptExport(store, tmp_path / "model")("v1")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = {}
    for shard in set(index.values()):
        files.update(load_file(out / shard))
    streamed = dict(quantize_named(sd.items(), spec, all_linear=True))
    assert set(streamed) == set(files)
    for name, t in streamed.items():
        assert same(t, files[name]), name
    assert streamed["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (32, 32)


def test_stream_quantizes_each_tensor_as_the_kernels_do_and_passes_the_rest_unchanged():
    named = W.named_weights(seed=3)
    out = list(quantize_named(named, "minite", bucket_bytes=4096))
    got = dict(out)
    for name, t in named:
        if ".experts." not in name:
            assert got[name] is t  # passed through: the same object
            continue
        want = to_modelopt(ops.quantize(t, MINITE), row_scaled_ok=True)
        module = name.removesuffix(".weight")
        for key, w in want.items():
            assert same(got[f"{module}.{key}"], w), (name, key)
    # pass-through tensors keep their order among themselves
    order = [n for n, _ in out if ".experts." not in n]
    assert order == [n for n, _ in named if ".experts." not in n]


def test_tensor_scaled_siblings_share_one_outer_scale_whatever_their_order():
    named = W.named_weights(seed=4)
    # up before gate, and down in between: the group waits for both members
    e0 = [x for x in named if ".experts.0." in x[0]]
    reordered = [e0[1], e0[2], e0[0]] + [x for x in named if ".experts.0." not in x[0]]
    got = dict(quantize_named(reordered, "modelopt"))
    g, u = (dict(named)[f"model.layers.0.mlp.experts.0.{p}.weight"] for p in ("gate_proj", "up_proj"))
    amax = shared_outer_amax([g, u], MODELOPT)
    for p, t in (("gate_proj", g), ("up_proj", u)):
        want = to_modelopt(ops.quantize(t, MODELOPT, outer_amax=amax))
        for key, w in want.items():
            assert same(got[f"model.layers.0.mlp.experts.0.{p}.{key}"], w), (p, key)
    # experts are scaled apart, so unshared maxima would differ: the sharing is visible
    assert same(got["model.layers.0.mlp.experts.0.gate_proj.weight_scale_2"],
                got["model.layers.0.mlp.experts.0.up_proj.weight_scale_2"])


def test_the_stream_holds_at_most_one_bucket_of_input():
    """It pulls from the trainer's iterator only until a batch of ``bucket_bytes`` closes."""
    named = W.named_weights(seed=5, experts=16)
    pulled = []

    def source():
        for item in named:
            pulled.append(item[0])
            yield item

    bucket = 3 * 32 * 64 * 2  # one expert's three projections
    it = quantize_named(source(), "minite", bucket_bytes=bucket)
    first_quantized = next(n for n, _ in it if n.endswith(".weight_scale"))
    assert first_quantized.startswith("model.layers.0.mlp.experts.0.")
    held = [n for n in pulled if ".experts." in n]
    assert len(held) <= 3, held  # one bucket's worth, never the model


def test_stream_refuses_bad_input_by_name():
    ok = W.named_weights()
    nan = [(n, t.clone()) for n, t in ok]
    nan[5][1][1, 2] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        list(quantize_named(nan, "minite"))
    assert e.value.tensor == nan[5][0] and nan[5][0] in str(e.value)
    with pytest.raises(DTypeError, match=r"experts\.0\.gate_proj"):
        list(quantize_named([("model.layers.0.mlp.experts.0.gate_proj.weight",
                              torch.zeros(4, 16, dtype=torch.int32))], "minite"))
    with pytest.raises(LayoutError, match=r"experts\.fused_w"):
        list(quantize_named([("model.layers.0.mlp.experts.fused_w",
                              torch.zeros(2, 4, 16, dtype=torch.bfloat16))], "minite"))
    with pytest.raises(ShapeError, match="up_proj"):
        list(quantize_named([("m.experts.0.gate_proj.weight", torch.ones(4, 32).bfloat16()),
                             ("m.experts.0.up_proj.weight", torch.ones(4, 16).bfloat16())],
                            "modelopt"))
    with pytest.raises(LayoutError, match="have not arrived"):
        list(quantize_named([(f"m.experts.{e}.gate_proj.weight", torch.ones(64, 64).bfloat16())
                             for e in range(4)], "modelopt", bucket_bytes=20000))
    for spec in ("mxfp4", "te_row"):
        with pytest.raises(LayoutError, match="no SGLang method"):
            next(quantize_named(ok, spec))
    with pytest.raises(LayoutError, match="layout"):
        next(quantize_named(ok, "minite", layout="store"))
    with pytest.raises(InputError, match="bucket_bytes"):
        next(quantize_named(ok, "minite", bucket_bytes=0))


# --- buckets -------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8,
                                           torch.float8_e4m3fn]),
                          st.lists(st.integers(1, 5), min_size=0, max_size=3)),
                min_size=1, max_size=8))
def test_buckets_round_trip_every_tensor_aligned(specs):
    named = []
    for i, (dtype, shape) in enumerate(specs):
        raw = torch.arange(torch.Size(shape).numel() * dtype.itemsize) % 251
        named.append((f"t{i}", raw.to(torch.uint8).view(dtype).reshape(shape)))
    b = pack(named)
    for e in b.entries:
        assert e.start_idx % e.dtype.itemsize == 0 and e.numel == e.end_idx - e.start_idx
    # the receiving side's layout from names, dtypes and shapes alone is the same
    assert layout([e.name for e in b.entries], [e.dtype for e in b.entries],
                  [e.shape for e in b.entries]) == b.entries
    back = dict(b.tensors())
    for name, t in named:
        assert same(back[name], t)
    again = Bucket(b.flat, [BucketEntry.from_dict(e.to_dict()) for e in b.entries])
    assert all(same(x, y) for (_, x), (_, y) in zip(again.tensors(), b.tensors(), strict=True))


def test_a_tensor_larger_than_a_bucket_travels_alone():
    named = [("a", torch.zeros(10, dtype=torch.uint8)), ("big", torch.zeros(100, dtype=torch.uint8)),
             ("b", torch.zeros(10, dtype=torch.uint8)), ("c", torch.zeros(10, dtype=torch.uint8))]
    got = [[e.name for e in b.entries] for b in buckets(named, 32)]
    assert got == [["a"], ["big"], ["b", "c"]]
    with pytest.raises(InputError, match="twice"):
        pack([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(LayoutError, match="do not hold"):
        BucketEntry.from_dict({**pack(named[:1]).entries[0].to_dict(), "end_idx": 3})


# --- the receiver --------------------------------------------------------------------------------

def bucketed(named, version="v1", size=8192, **header):
    """(header, tensors) pairs of a version, as the sender makes them."""
    from alignd.sync.buckets import Digest
    bs = list(buckets(named, size))
    d = Digest()
    out = []
    for i, b in enumerate(bs):
        d.add(b.entries)
        last = i == len(bs) - 1
        h = RefitHeader(version, i, last=last, tensors=d.count if last else None,
                        digest=d.hexdigest() if last else None, **header)
        out.append((h, b.tensors()))
    return out


def test_the_receiver_applies_a_version_only_when_it_is_whole_and_verified():
    applied = []
    r = RefitReceiver(lambda named: applied.append(dict(named)), quantization="libalign_minite")
    named = list(quantize_named(W.named_weights(), "minite"))
    parts = bucketed(named, quantization="libalign_minite")
    assert len(parts) > 2
    for h, ts in parts[:-1]:
        assert r.receive(h, ts) is None and not applied  # staged, the old weights serve
    assert r.receive(*parts[-1]) == "v1"
    assert len(applied) == 1 and all(same(applied[0][n], t) for n, t in named)

    # a bucket lost on the way: the version is refused whole, nothing applied
    v2 = bucketed(named, "v2", quantization="libalign_minite")
    r.receive(*v2[0])
    with pytest.raises(LayoutError, match="bucket 2 of version 'v2' arrived; bucket 1"):
        r.receive(*v2[2])
    assert r.staged_version is None and len(applied) == 1
    # the same version again, once applied
    with pytest.raises(WeightVersionMismatchError):
        r.receive(*parts[0])
    # a new version after the failure goes through
    for h, ts in bucketed(named, "v3", quantization="libalign_minite"):
        r.receive(h, ts)
    assert r.applied == ["v1", "v3"]


def test_the_receiver_refuses_what_its_model_does_not_load():
    named = list(quantize_named(W.named_weights(), "minite"))
    applied = []
    r = RefitReceiver(lambda n: applied.append(n), model="qwen3-moe", quantization="libalign_minite")
    with pytest.raises(EngineMismatchError) as e:
        r.receive(*bucketed(named, quantization="modelopt_fp4")[0])
    assert e.value.field == "quantization"
    with pytest.raises(EngineMismatchError) as e:
        r.receive(*bucketed(named, model="llama", quantization="libalign_minite")[0])
    assert e.value.field == "model"
    for h, ts in bucketed(named, quantization="libalign_minite"):
        r.receive(h, ts)
    # the first version fixed the layout: another shape, or a missing tensor, is refused
    bad = [(n, t[:1] if n.endswith("experts.2.down_proj.weight") else t) for n, t in named]
    with pytest.raises(EngineMismatchError, match=r"experts\.2\.down_proj\.weight") as e:
        for h, ts in bucketed(bad, "v2", quantization="libalign_minite"):
            r.receive(h, ts)
    assert e.value.field == "model"
    with pytest.raises(EngineMismatchError, match="lacks 1"):
        for h, ts in bucketed(named[1:], "v3", quantization="libalign_minite"):
            r.receive(h, ts)
    assert len(applied) == 1


def test_the_receiver_refuses_non_finite_oversize_and_failed_applies():
    named = W.named_weights()
    nan = [(n, t.clone()) for n, t in named]
    nan[1][1][0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"mlp\.gate\.weight"):
        for h, ts in bucketed(nan):
            RefitReceiver(lambda n: None).receive(h, ts)
    # the same as a whole bucket (checked a dtype run at a time), and in E4M3 scale bytes
    b = next(buckets(nan, 1 << 20))
    with pytest.raises(NonFiniteError, match=r"mlp\.gate\.weight"):
        RefitReceiver(lambda n: None).receive_bucket(RefitHeader("v", 0), b)
    q = list(quantize_named(named, "minite"))
    scale = next(i for i, (n, _) in enumerate(q) if n.endswith("experts.1.up_proj.weight_scale"))
    broken_scale = q[scale][1].clone()
    broken_scale.view(torch.uint8)[0, 0] = 0x7F
    q[scale] = (q[scale][0], broken_scale)
    with pytest.raises(NonFiniteError, match=r"experts\.1\.up_proj\.weight_scale"):
        RefitReceiver(lambda n: None).receive_bucket(RefitHeader("v", 0), next(buckets(q, 1 << 20)))
    with pytest.raises(PayloadTooLargeError):
        RefitReceiver(lambda n: None, max_bucket_bytes=100).receive(*bucketed(named)[0])

    def broken(_):
        raise RuntimeError("the model refused")

    r = RefitReceiver(broken)
    with pytest.raises(WeightUpdateError, match="the model refused"):
        for h, ts in bucketed(named):
            r.receive(h, ts)
    assert r.applied == [] and r.staged_version is None


# --- the colocated transport --------------------------------------------------------------------

class FakeModel(torch.nn.Module):
    """What the custom loader needs of an SGLang model: ``load_weights`` and ``quant_config``."""

    class QuantConfig:
        def get_name(self):
            return "libalign_minite"

    def __init__(self):
        super().__init__()
        self.quant_config = self.QuantConfig()
        self.loads: list[dict] = []

    def load_weights(self, named):
        self.loads.append({n: t.clone() for n, t in named})


class InProcessSink:
    """SGLang's side of update_weights_from_tensor, in this process."""

    def __init__(self, model):
        self.model, self.calls, self.session = model, [], []

    def begin_weight_update(self):
        self.session.append("begin")
        return {"success": True, "message": "ok"}

    def end_weight_update(self):
        self.session.append(f"end after {len(self.calls)}")
        return {"success": True, "message": "ok"}

    def update_weights_from_tensor(self, *, serialized_named_tensors, load_format, flush_cache,
                                   weight_version):
        self.calls.append((load_format, flush_cache, weight_version))
        payload = T.deserialize(serialized_named_tensors[0])
        if load_format == T.FLATTENED:
            b = Bucket(payload["flattened_tensor"], payload["metadata"])
            self.model.load_weights(b.tensors())
        else:
            T.load_refit(self.model, payload)
        return {"success": True, "message": "ok"}


def test_tensor_refit_staged_and_flattened_deliver_the_streams_bits(redis_url):
    named = W.named_weights(seed=7, experts=8)
    want = dict(quantize_named(named, "minite"))
    model = FakeModel()
    sink = InProcessSink(model)
    registry = Registry(RedisBus(connect(redis_url)), "refit-test")
    stages = RefitStages(registry, "v1", "tensor")
    report = T.send_tensor_refit(named, sink, version_id="v1", bucket_bytes=4096, stages=stages)
    assert isinstance(report, RefitReport) and report.buckets == len(sink.calls) > 2
    assert len(model.loads) == 1 and set(model.loads[0]) == set(want)
    assert all(same(model.loads[0][n], t) for n, t in want.items())
    assert [c[1:] for c in sink.calls][-1] == (True, "v1")
    assert sink.session == ["begin", f"end after {report.buckets}"]  # SGLang's session
    assert all(c == (T.LOADER, False, None) for c in sink.calls[:-1])
    rec = registry.get("v1")
    assert rec.state == "serving" and rec.path == "refit:tensor"
    states = [h.to_state for h in registry.history("v1")]
    assert states == ["published", "converting", "converted", "loading", "serving"]

    flat = FakeModel()
    T.send_tensor_refit(named, InProcessSink(flat), version_id="v2", staged=False,
                        bucket_bytes=4096)
    got = {n: t for load in flat.loads for n, t in load.items()}
    assert len(flat.loads) > 2 and all(same(got[n], t) for n, t in want.items())

    # a failing server: the refit raises, the version is marked failed with the reason
    class Refusing(InProcessSink):
        def update_weights_from_tensor(self, **kw):
            return (False, "out of memory")

    refusing = Refusing(FakeModel())
    with pytest.raises(WeightUpdateError, match="out of memory"):
        T.send_tensor_refit(named, refusing, version_id="v3", bucket_bytes=4096,
                            stages=RefitStages(registry, "v3", "tensor"))
    assert refusing.session == ["begin", "end after 0"]  # the session is closed after a failure
    assert registry.get("v3").state == "failed" and "out of memory" in registry.get("v3").reason


def test_bf16_refit_sends_the_tensors_unchanged():
    named = W.named_weights(seed=8)
    model = FakeModel()
    model.quant_config = None
    T.send_tensor_refit(named, InProcessSink(model), version_id="b1", spec=None, bucket_bytes=4096)
    assert all(same(model.loads[0][n], t) for n, t in named)


# --- the distributed transport, two processes on gloo ------------------------------------------

def test_distributed_refit_over_gloo_applies_each_version_whole():
    out = launch(W.refit_ranks, 2, args=("minite", 6000, 2), backend="gloo", timeout_s=240)
    reports, applied = out[0], out[1]
    assert len(applied) == 2 and all(b > 2 for b, _, _ in reports)
    for v in range(2):
        want = dict(quantize_named(W.named_weights(seed=v), "minite"))
        got = dict(applied[v])
        assert set(got) == set(want) and reports[v][1] == len(want)
        assert all(same(got[n], t) for n, t in want.items())


# --- the trainers' adapters ----------------------------------------------------------------------

def test_miles_quantize_params_follows_the_checkpoints_config():
    from alignclient.errors import ConfigError
    from alignd.formats.quant_configs import minite_quantization_config
    from alignd.integrations.refit import quantize_params, verl_weights

    sd = stack_model()
    qkv = [(n, t) for n, t in sd.items() if "self_attn" in n]
    config = minite_quantization_config(["model.layers.0.self_attn.k_proj"])
    out = dict(quantize_params(None, "decoder.layers.0.self_attention.linear_qkv.weight", qkv,
                               config))
    assert out["model.layers.0.self_attn.k_proj.weight"] is sd["model.layers.0.self_attn.k_proj.weight"]
    want = to_modelopt(ops.quantize(sd["model.layers.0.self_attn.q_proj.weight"], MINITE),
                       row_scaled_ok=True)
    for key, w in want.items():
        assert same(out[f"model.layers.0.self_attn.q_proj.{key}"], w)
    assert "model.layers.0.self_attn.v_proj.weight_scale_2" in out
    # verl's generator: the same tensors, the router and norms untouched
    streamed = dict(verl_weights(iter(sd.items()), {"quant_method": "libalign_minite"}))
    assert streamed["model.layers.0.mlp.gate.weight"] is sd["model.layers.0.mlp.gate.weight"]
    assert "model.layers.0.mlp.experts.0.down_proj.weight_scale" in streamed
    for bad in ({"quant_method": "modelopt_fp4"}, None):
        with pytest.raises(ConfigError):
            quantize_params(None, "x", qkv, bad)


def test_the_refit_snippet_runs():
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "docs" / "snippets" /
                       "refit_from_tensors.py"), run_name="__main__")


@pytest.mark.parametrize("preset,fmt", [("minite", "modelopt"), ("modelopt", "modelopt"),
                                        ("te_4over6", "modelopt"),
                                        ("compressed_tensors", "compressed-tensors")])
def test_alignd_convert_splits_expert_stacks_as_the_stream_does(tmp_path, preset, fmt):
    """A transformers-5 checkpoint (3-D expert stacks) through ``alignd convert``: every stack
    becomes per-expert weights; in the ModelOpt layout they equal the refit stream's bit for bit,
    in compressed-tensors each expert reads back as the stack's expert."""
    from alignd.formats.export import convert_checkpoint
    from safetensors.torch import save_file

    from libalign.checkpoint import from_compressed_tensors

    sd = stack_model(seed=9)
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    dst = convert_checkpoint(src, tmp_path / "out", preset=preset, fmt=fmt).dst
    files = load_file(dst / "model.safetensors")
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    assert stack not in files and "model.layers.0.mlp.experts.down_proj" not in files
    if fmt == "modelopt":
        streamed = dict(quantize_named(sd.items(), preset))
        for name, t in streamed.items():
            assert same(files[name], t), name
        assert set(streamed) == set(files)
        return
    q = ops.quantize(sd[stack], PRESETS[preset])
    for e in range(4):
        for part, rows in (("gate_proj", slice(0, 32)), ("up_proj", slice(32, 64))):
            pre = f"model.layers.0.mlp.experts.{e}.{part}"
            back = from_compressed_tensors({k: files[f"{pre}.{k}"] for k in
                                            ("weight_packed", "weight_scale", "weight_global_scale")},
                                           PRESETS[preset])
            assert torch.equal(back.dequantize(), q.expert(e).dequantize()[rows]), pre


@pytest.mark.parametrize("bucket_bytes,run_bytes", [(3000, None), (20000, None),
                                                    (1 << 20, None), (1 << 20, 3000),
                                                    (1 << 20, 0)])
def test_filled_buckets_hold_the_packed_buckets_bits(bucket_bytes, run_bytes, monkeypatch):
    """minite buckets are quantized in place (alignd.sync.fill): every entry equals the packing
    producer's, 2-D weights and 3-D stacks (split per expert) alike, entries back to back;
    runs of same-shape 2-D weights quantized as one stack (read in place, or viewed where
    they are per-expert views of one tensor), whatever the run's size limit."""
    from alignd.sync import fill
    from alignd.sync.buckets import ended_buckets
    from alignd.sync.fill import filled_buckets

    monkeypatch.setattr(fill, "RUN_BYTES", run_bytes)
    named = [(n, torch.cat([t, t], -1) if ".experts." in n else t)
             for n, t in W.named_weights(seed=2, experts=6)]  # K = 64: fillable
    named += [(n.replace("layers.0", "layers.1"), t) for n, t in stack_model(3).items()]
    views = torch.randn(5, 24, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    named += [(f"model.layers.2.mlp.experts.{e}.down_proj.weight", views[e]) for e in range(5)]
    filled = list(filled_buckets(named, "minite", bucket_bytes=bucket_bytes, all_linear=True))
    packed = list(ended_buckets(quantize_named(named, "minite", all_linear=True,
                                               bucket_bytes=bucket_bytes), bucket_bytes))
    got = {n: t for b, _ in filled for n, t in b.tensors()}
    want = {n: t for b, _ in packed for n, t in b.tensors()}
    assert set(got) == set(want) and all(same(got[n], want[n]) for n in want)
    assert [last for _, last in filled] == [False] * (len(filled) - 1) + [True]
    for b, _ in filled:  # SGLang's receivers rebuild the layout from names, dtypes, shapes
        assert layout([e.name for e in b.entries], [e.dtype for e in b.entries],
                      [e.shape for e in b.entries]) == b.entries
        assert b.entries[-1].end_idx == b.nbytes


def test_filled_buckets_hold_no_closed_bucket_while_one_is_in_flight(monkeypatch):
    """Each bucket is yielded before the next is allocated: while the caller holds one (in
    flight), the producer holds no other filled or packed bucket, so a refit keeps two at most
    (the one in flight and the one being filled), passed-through tensors included."""
    import gc
    import weakref

    from alignd.sync import fill

    made: list[weakref.ref] = []
    real_init, real_ended = fill._Filler.__init__, fill.ended_buckets

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(weakref.ref(self.flat))

    def ended(*a, **k):
        for b, last in real_ended(*a, **k):
            made.append(weakref.ref(b.flat))
            yield b, last

    monkeypatch.setattr(fill._Filler, "__init__", init)
    monkeypatch.setattr(fill, "ended_buckets", ended)
    g = torch.Generator().manual_seed(4)
    named = []
    for layer in range(3):
        named.append((f"model.layers.{layer}.self_attn.q_proj.weight",
                      torch.randn(64, 64, generator=g).bfloat16()))
        named.append((f"model.layers.{layer}.input_layernorm.weight", torch.randn(4000)))
        named += [(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight",
                   torch.randn(32, 64, generator=g).bfloat16()) for e in range(6)]
    count = 0
    for bucket, _ in fill.filled_buckets(named, "minite", bucket_bytes=9000):
        gc.collect()
        held = bucket.flat.untyped_storage().data_ptr()
        alive = [r() for r in made if r() is not None]
        others = [t for t in alive if t.untyped_storage().data_ptr() != held]
        assert not others, f"bucket {count}: the producer holds {len(others)} more"
        count += 1
        del bucket, alive, others
    assert count > 3


def test_a_run_of_weights_is_stacked_without_a_copy():
    """Per-expert views of one stacked parameter, back to back in memory, stack as a view of
    it; inputs elsewhere (or out of order) become a Stacked source, read in place by the
    kernels: no input is copied either way."""
    from alignd.sync.fill import _adjacent, _stacked

    from libalign.sync import Stacked

    base = torch.randn(4, 8, 64)
    viewed = _stacked([base[e] for e in range(4)])
    assert viewed.data_ptr() == base.data_ptr() and torch.equal(viewed, base)
    part = _stacked([base[e] for e in (1, 2, 3)])
    assert part.data_ptr() == base[1].data_ptr() and torch.equal(part, base[1:])
    shuffled = _stacked([base[e] for e in (0, 2, 1)])
    assert isinstance(shuffled, Stacked) and torch.equal(shuffled.stack(), base[[0, 2, 1]])
    apart = [torch.randn(8, 64) for _ in range(3)]
    got = _stacked(apart)
    assert not _adjacent(apart) and isinstance(got, Stacked)
    assert all(a is b for a, b in zip(got.tensors, apart, strict=True))


def test_filled_buckets_name_a_non_finite_tensor():
    from alignd.sync.fill import filled_buckets

    named = [(f"m.experts.{e}.down_proj.weight", torch.randn(8, 64).bfloat16()) for e in range(5)]
    named[3][1][2, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"experts\.3\.down_proj") as e:
        list(filled_buckets(named, "minite", bucket_bytes=1 << 20))
    assert e.value.tensor == "m.experts.3.down_proj.weight"
