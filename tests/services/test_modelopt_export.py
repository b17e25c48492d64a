"""One conversion per version: the ModelOpt export SGLang loads is the store
version's bits re-laid out, written once by the converter, from whole and sharded versions
alike; what SGLang cannot load is refused by name; retention prunes exports no sampler needs."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from alignclient.errors import LayoutError, VersionNotFoundError
from alignd.converter.main import run_converter
from alignd.formats.convert import convert_published
from alignd.formats.hf_checkpoint import MANIFEST_NAME
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.published import write_published
from alignd.formats.selection import make_select
from alignd.formats.sharded_version import Piece, write_part
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.registry import Registry
from alignd.infra.retention import Retention
from alignd.infra.settings import ConverterSettings, LearnerSettings
from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
from alignd.sync.bf16 import publish_version
from safetensors.torch import load_file

from libalign.checkpoint import from_modelopt
from libalign.gemm import get_path
from libalign.spec import PRESETS
from tests.services.conftest import tiny_experts
from tests.services.sglang_contract import check_modelopt_dir

NAIVE = get_path("nvfp4_naive").weight_spec  # one outer scale per expert: what SGLang loads
MINITE = PRESETS["minite"]  # one outer scale per row: what libalign_minite loads
EXPERTS = make_select()


def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                               "quantization_config": {"quant_method": "fp8"}}))
    (d / "tokenizer.json").write_text('{"v": 1}')
    (d / "model.safetensors").write_bytes(b"not copied")
    return d


def stacks(experts: int = 4, rows: int = 32, k: int = 64, seed: int = 0) -> dict:
    """transformers-5 fused stacks, a router, a norm and an lm_head (no per-expert names)."""
    g = torch.Generator().manual_seed(seed)
    p = "model.layers.0.mlp"
    return {f"{p}.experts.gate_up_proj": (torch.randn(experts, 2 * rows, k, generator=g)
                                          * torch.linspace(0.01, 0.1, experts)[:, None, None]
                                          ).bfloat16(),
            f"{p}.experts.down_proj": torch.randn(experts, k, rows, generator=g).bfloat16(),
            f"{p}.gate.weight": torch.randn(experts, k, generator=g).bfloat16(),
            "model.norm.weight": torch.ones(k, dtype=torch.bfloat16),
            "lm_head.weight": torch.randn(8, k, generator=g).bfloat16()}


def flat(sd: dict) -> dict:
    """tiny_experts without its 3-D stack (its per-expert names would collide with it)."""
    sd = dict(sd)
    sd.pop("model.layers.0.mlp.experts.gate_up_proj")
    return sd


def exported(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in set(index["weight_map"].values()):
        out.update(load_file(path / shard))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def test_an_export_is_the_store_bits_relaid_out(tmp_path):
    """Stacks split per expert (gate rows, then up rows, the expert's outer scale on both), raw
    tensors byte for byte, configs and the model's other files; nothing quantized again."""
    store = WeightStore(tmp_path / "store")
    store.write_version("v1", stacks(), NAIVE, select=EXPERTS)
    ex = ModelOptExport(store, model_dir(tmp_path), shard_bytes=4096)
    path = ex("v1")
    assert path == tmp_path / "store" / "sglang" / "modelopt" / "v1" and ex.exists("v1")
    assert check_modelopt_dir(path) is None
    got = exported(path)
    sv = store.read_version("v1")
    stack = sv["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(4):
        qe = stack.expert(e)
        gate = from_modelopt({k.rsplit(".", 1)[1]: v for k, v in got.items()
                              if k.startswith(f"model.layers.0.mlp.experts.{e}.gate_proj.")})
        up = from_modelopt({k.rsplit(".", 1)[1]: v for k, v in got.items()
                            if k.startswith(f"model.layers.0.mlp.experts.{e}.up_proj.")})
        assert same_bits(torch.cat([gate.codes, up.codes]), qe.codes)
        assert same_bits(torch.cat([gate.block_scales, up.block_scales]), qe.block_scales)
        assert same_bits(gate.outer_dec, qe.outer_dec.reshape(())) and same_bits(
            up.outer_dec, gate.outer_dec)
        down = sv["model.layers.0.mlp.experts.down_proj"].expert(e)
        assert same_bits(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down.codes)
    for raw in ("model.layers.0.mlp.gate.weight", "model.norm.weight", "lm_head.weight"):
        assert same_bits(got[raw], sv[raw])
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["ignore"] == ["lm_head", "model.layers.0.mlp.gate"]
    assert (path / "tokenizer.json").read_text() == '{"v": 1}'
    assert not (path / "model.safetensors").exists()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version_id"] == "v1" and manifest["tensors_converted"] == 12
    mtime = (path / "manifest.json").stat().st_mtime_ns
    assert ex("v1") == path and (path / "manifest.json").stat().st_mtime_ns == mtime  # once


def test_a_sharded_version_exports_bit_for_bit_like_the_whole_one(tmp_path):
    """An expert-parallel learner's two parts (no BF16 written) export to the same bytes as
    the version written whole."""
    sd = stacks()
    store = WeightStore(tmp_path / "store")
    store.write_version("whole", sd, NAIVE, select=EXPERTS)
    for part in (0, 1):
        items = {n: Piece(t[2 * part:2 * part + 2], 2 * part, 4) for n, t in sd.items()
                 if n.endswith("_proj")}
        if part == 0:
            items.update({n: t for n, t in sd.items() if not n.endswith("_proj")})
        write_part(store, "sharded", part, 2, items, NAIVE,
                   select=lambda name, t: name.endswith("_proj"))
    assert store.read_manifest("sharded").format_version == 2
    ex = ModelOptExport(store, model_dir(tmp_path))
    a, b = exported(ex("whole")), exported(ex("sharded"))
    assert set(a) == set(b) and all(same_bits(a[k], b[k]) for k in a)


def test_a_minite_export_is_the_store_bits_with_row_scales_for_libalign_minite(tmp_path):
    """A row-scaled minite version exports for SGLang's libalign_minite: gate/up split per
    expert with each row's own weight_scale_2 [N, 1] (read back bit for bit with the store's
    bits), no shared maximum needed between gate and up, the libalign_minite config in
    config.json and hf_quant_config.json; asked for nvfp4_naive it is refused by name, and a
    naive version asked for nvfp4_minite too."""
    store = WeightStore(tmp_path / "store")
    store.write_version("m1", stacks(), MINITE, select=EXPERTS)
    store.write_version("n1", stacks(), NAIVE, select=EXPERTS)
    ex = ModelOptExport(store, model_dir(tmp_path), shard_bytes=4096)
    with pytest.raises(LayoutError, match=r"'m1' \(minite\) is loaded by SGLang method "
                                          r"'libalign_minite'.*'nvfp4_naive'.*'modelopt_fp4'"):
        ex("m1", "nvfp4_naive")
    with pytest.raises(LayoutError, match=r"'n1' \(te_expert\).*'modelopt_fp4'.*'nvfp4_minite'"):
        ex("n1", "nvfp4_minite")
    assert not ex.path("m1").exists() and not ex.path("n1").exists()
    path = ex("m1", "nvfp4_minite")
    assert check_modelopt_dir(path, "libalign_minite") is None
    got = exported(path)
    sv = store.read_version("m1")
    for e in range(4):
        qe = sv["model.layers.0.mlp.experts.gate_up_proj"].expert(e)
        half = qe.shape[0] // 2
        for proj, rows in (("gate", slice(0, half)), ("up", slice(half, 2 * half))):
            d = {k.rsplit(".", 1)[1]: v for k, v in got.items()
                 if k.startswith(f"model.layers.0.mlp.experts.{e}.{proj}_proj.")}
            assert d["weight_scale_2"].shape == (half, 1) and d["weight_scale_2"].dtype == torch.float32
            q = from_modelopt(d, MINITE, row_scaled_ok=True)
            assert same_bits(q.codes, qe.codes[rows]) and same_bits(q.block_scales,
                                                                    qe.block_scales[rows])
            assert same_bits(q.outer_dec, qe.outer_dec[rows].to(torch.float32))
        down = sv["model.layers.0.mlp.experts.down_proj"].expert(e)
        d = {k.rsplit(".", 1)[1]: v for k, v in got.items()
             if k.startswith(f"model.layers.0.mlp.experts.{e}.down_proj.")}
        q = from_modelopt(d, MINITE, row_scaled_ok=True)
        assert same_bits(q.codes, down.codes) and same_bits(q.outer_dec, down.outer_dec.float())
    for raw in ("model.layers.0.mlp.gate.weight", "model.norm.weight", "lm_head.weight"):
        assert same_bits(got[raw], sv[raw])
    want = {"quant_method": "libalign_minite", "spec": "minite",
            "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}
    assert json.loads((path / "config.json").read_text())["quantization_config"] == want
    assert json.loads((path / "hf_quant_config.json").read_text()) == want
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["sglang_method"] == "libalign_minite" and manifest["tensors_converted"] == 12
    # gate and up quantized on their own (no shared maximum): per-row scales export as they are
    src = write_published(store.published_root, "split", flat(tiny_experts(experts=2, rows=16,
                                                                          k=32)))
    convert_published(src, store, "split", MINITE)
    assert ex("split", "nvfp4_minite") == ex.path("split")
    assert ex("m1", "nvfp4_minite") == path  # an existing export is checked from its manifest


def test_what_sglang_cannot_load_is_refused_by_name_and_nothing_is_written(tmp_path):
    """Row-scaled specs no method loads (te_row), MXFP4 and bf16 versions, fused siblings with
    different outer scales, a missing version: typed errors naming the problem; no export
    directory appears."""
    store = WeightStore(tmp_path / "store")
    ex = ModelOptExport(store, model_dir(tmp_path))
    store.write_version("rows", stacks(), PRESETS["te_row"], select=EXPERTS)
    store.write_version("mx", stacks(), PRESETS["mxfp4"], select=EXPERTS)
    store.write_version("bf16", stacks(), NAIVE, select=lambda n, t: False)
    src = write_published(store.published_root, "split", flat(tiny_experts(experts=2, rows=16,
                                                                          k=32)))
    convert_published(src, store, "split", NAIVE)  # gate and up quantized on their own
    for vid, match in (("rows", r"per row.*scalar weight_scale_2.*only the 'minite' spec"),
                       ("mx", "MXFP4"),
                       ("bf16", "no NVFP4 tensor"),
                       ("split", r"experts\.0\.gate_proj\.weight.*experts\.0\.up_proj\.weight.*"
                                 r"different outer scales")):
        with pytest.raises(LayoutError, match=match):
            ex(vid)
        assert not ex.path(vid).exists()
    with pytest.raises(VersionNotFoundError):
        ex("never")
    convert_published(src, store, "shared", NAIVE, share_fused=True)
    assert check_modelopt_dir(ex("shared")) is None  # the converter's way: one shared maximum


def test_the_converter_writes_each_version_once_in_the_layout_the_sampler_loads(
        redis_url, tmp_path):
    """sampler_layout=modelopt: versions published for nvfp4_naive and for nvfp4_minite are
    converted and exported (the minite one with row scales for libalign_minite) before they are
    announced converted, each once; one for bf16 gets no export."""
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                                 consumer_name="conv-1", block_ms=100, sampler_layout="modelopt",
                                 sglang_model_dir=model_dir(tmp_path))
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    bus.ensure_group(settings.published_stream, settings.converter_group)
    sd = flat(tiny_experts(experts=2, rows=16, k=32))
    publish_version(store.published_root, reg, bus, settings.published_stream, "v1", sd,
                    target_path="nvfp4_naive")
    publish_version(store.published_root, reg, bus, settings.published_stream, "v2", sd,
                    target_path="nvfp4_minite")
    publish_version(store.published_root, reg, bus, settings.published_stream, "v3", sd,
                    target_path="bf16")
    assert run_converter(settings, max_messages=3) == 3
    assert reg.state("v1") == reg.state("v2") == reg.state("v3") == "converted"
    ex = ModelOptExport(store, settings.sglang_model_dir)
    assert check_modelopt_dir(ex.path("v1")) is None and not ex.path("v3").exists()
    assert check_modelopt_dir(ex.path("v2"), "libalign_minite") is None
    assert sorted(ex.list()) == ["v1", "v2"]
    m2 = exported(ex.path("v2"))
    for name, q in store.iter_version("v2"):  # each stored minite tensor, bit for bit
        if not isinstance(q, torch.Tensor):
            module = name.removesuffix(".weight")
            back = from_modelopt({k: m2[f"{module}.{k}"] for k in
                                  ("weight", "weight_scale", "weight_scale_2")}, MINITE,
                                 row_scaled_ok=True)
            assert same_bits(back.codes, q.codes) and same_bits(back.outer_dec, q.outer_dec.float())
    written = {v: (ex.path(v) / "manifest.json").stat().st_mtime_ns for v in ("v1", "v2")}
    assert ex.write("v2")["sglang_method"] == "libalign_minite"  # already there: kept
    assert written == {v: (ex.path(v) / "manifest.json").stat().st_mtime_ns for v in ("v1", "v2")}
    got = exported(ex.path("v1"))
    gate, up = (got[f"model.layers.0.mlp.experts.1.{p}_proj.weight_scale_2"] for p in ("gate", "up"))
    assert same_bits(gate, up)  # siblings quantized with one maximum for SGLang's fused w13
    assert store.read_manifest("v1").extra["fused_share_outer"] is True


def test_retention_keeps_the_newest_exports_and_those_a_sampler_needs(redis_url, tmp_path):
    """retain_exports 2: older exports go, but never the one a live sampler serves nor one of
    a version on its way to a sampler (converted); an export root outside the store too."""
    settings = ConverterSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                                 consumer_name="conv-1", retain_exports=2,
                                 sglang_export_dir=tmp_path / "exports")
    bus = RedisBus.from_settings(settings)
    reg = Registry(bus, settings.key_prefix)
    store = WeightStore(settings.store_dir)
    ex = ModelOptExport(store, model_dir(tmp_path), settings.sglang_export_dir)
    vids = [f"v{i}" for i in range(6)]
    t0 = time.time() - 3600
    for i, vid in enumerate(vids):
        store.write_version(vid, stacks(seed=i), NAIVE, select=EXPERTS)
        ex(vid)
        # exports are listed by manifest time: distinct times in export order, set, not waited for
        os.utime(ex.path(vid) / MANIFEST_NAME, (t0 + i, t0 + i))
        reg.create(vid, str(store.version_path(vid)))
        states = {"v0": "converted", "v1": "serving"}.get(vid, "serving")
        for s in ("converting", "converted", "loading", "serving"):
            reg.transition(vid, s, actor="t")
            if s == states:
                break
    beat = ServiceHeartbeat(bus, "sampler", "sgl-1", 0.1, 5.0, prefix=settings.key_prefix,
                            info=lambda: {"path": "nvfp4_naive"})
    beat.set(version="v1")
    beat.beat()  # one beat, written now: the sampler is live and serves v1
    report = Retention.from_settings(settings, bus, reg, store, exports=ex).run()
    assert sorted(report.exports_pruned) == ["v2", "v3"]
    assert ex.list() == ["v0", "v1", "v4", "v5"]
    assert report.counts()["exports_pruned"] == 2


class PartsEngine:
    """A learner engine that converts its own weights as an expert-parallel one does: two
    parts of a sharded version, no BF16 written."""

    def publish_converted(self, store, version_id, spec, *, quantize=True, kv_format=None,
                          kv_scales=None):
        sd = stacks()
        for part in (0, 1):
            items = {n: Piece(t[2 * part:2 * part + 2], 2 * part, 4) for n, t in sd.items()
                     if n.endswith("_proj")}
            if part == 0:
                items.update({n: t for n, t in sd.items() if not n.endswith("_proj")})
            write_part(store, version_id, part, 2, items, spec,
                       select=lambda name, t: quantize and name.endswith("_proj"))


def test_a_learner_that_converts_its_own_parts_exports_them_before_announcing(redis_url, tmp_path):
    """sampler_layout=modelopt on the learner: a sharded version it wrote itself (no converter,
    no BF16) gets its ModelOpt export before the converted event goes out."""
    settings = LearnerSettings(redis_url=redis_url, store_dir=tmp_path / "store",
                               sampler_layout="modelopt", sglang_model_dir=model_dir(tmp_path))
    bus = RedisBus.from_settings(settings)
    loop = LearnerLoop(settings, PartsEngine(), LoopParts.build(settings, bus=bus, stores=False),
                       RolloutPlan(prompts=lambda n: [[1]] * n, reward=lambda p, c: 0.0,
                                   sampler_path="nvfp4_naive", run_id="ep"))
    vid = loop.publish(1)
    assert Registry(bus, settings.key_prefix).state(vid) == "converted"
    path = loop.exports.path(vid)
    assert check_modelopt_dir(path) is None
    assert json.loads((path / "manifest.json").read_text())["source"]["num_parts"] == 2
