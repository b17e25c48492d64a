"""Pins ``alignd convert``: NVFP4 checkpoint export bits, peer round trips, configs, atomicity, memory."""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
import weakref
from pathlib import Path

import pytest
import torch
from alignclient.errors import (
    DTypeError,
    InputError,
    LayoutError,
    MissingShardError,
    NonFiniteError,
    ShapeError,
    SpecError,
)
from alignd.formats import export as ce
from alignd.formats import export_plan
from alignd.formats import hf_checkpoint as hfc
from alignd.formats import selection as sel
from alignd.tools.cli import app
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from libalign.atomic_dir import DestinationExistsError
from libalign.checkpoint import from_compressed_tensors, from_modelopt, stored_layout, to_format
from libalign.spec import PRESETS, dequantize, quantize, shared_outer_amax
from tests.libalign import inputs, peers

HIDDEN, INTER, EXPERTS, LAYERS, VOCAB, HEAD_DIM = 64, 32, 4, 2, 96, 16
SHARD_A, SHARD_B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
#: tensors placed in the other shard than the rest of their layer: gate/up pairs straddle
MOVED = {
    "model.layers.0.mlp.experts.3.up_proj.weight": SHARD_B,    # gate in A, up in B
    "model.layers.1.mlp.experts.0.gate_proj.weight": SHARD_A,  # gate in A, up in B
    "model.layers.1.mlp.experts.2.up_proj.weight": SHARD_A,    # gate in B, up in A
}
EXPERT_WEIGHTS = sorted(f"model.layers.{li}.mlp.experts.{e}.{p}.weight" for li in range(LAYERS)
                        for e in range(EXPERTS) for p in ("gate_proj", "up_proj", "down_proj"))
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def source_tensors() -> dict[str, torch.Tensor]:
    """A tiny Qwen3-MoE-like state dict (BF16); gate and up amaxes differ in every expert."""
    g = torch.Generator().manual_seed(7)

    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": 1 + w(HIDDEN),
         "lm_head.weight": w(VOCAB, HIDDEN)}
    for li in range(LAYERS):
        p = f"model.layers.{li}"
        t[f"{p}.input_layernorm.weight"] = 1 + w(HIDDEN)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + w(HIDDEN)
        t[f"{p}.self_attn.q_proj.weight"] = w(4 * HEAD_DIM, HIDDEN, scale=0.03)
        t[f"{p}.self_attn.k_proj.weight"] = w(2 * HEAD_DIM, HIDDEN, scale=0.09)
        t[f"{p}.self_attn.v_proj.weight"] = w(2 * HEAD_DIM, HIDDEN, scale=0.02)
        t[f"{p}.self_attn.o_proj.weight"] = w(HIDDEN, 4 * HEAD_DIM)
        t[f"{p}.self_attn.q_norm.weight"] = 1 + w(HEAD_DIM)
        t[f"{p}.self_attn.k_norm.weight"] = 1 + w(HEAD_DIM)
        t[f"{p}.mlp.gate.weight"] = w(EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            x = f"{p}.mlp.experts.{e}"
            t[f"{x}.gate_proj.weight"] = w(INTER, HIDDEN, scale=0.02 * (e + 1))
            t[f"{x}.up_proj.weight"] = w(INTER, HIDDEN, scale=0.07 / (e + 1))
            t[f"{x}.down_proj.weight"] = w(HIDDEN, INTER, scale=0.04)
    # tie-heavy and mixed-magnitude data, where operation orders disagree
    t["model.layers.0.mlp.experts.1.gate_proj.weight"] = inputs.tie_heavy((INTER, HIDDEN))
    t["model.layers.1.mlp.experts.3.down_proj.weight"] = inputs.mixed_magnitudes((HIDDEN, INTER))
    return t


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor],
                     config: dict | None = None) -> Path:
    """Two shards with an index, config.json, a fake tokenizer and a generation config."""
    root.mkdir(parents=True, exist_ok=True)
    where = {n: MOVED.get(n, SHARD_B if n.startswith(("model.layers.1.", "lm_head", "model.norm"))
                          else SHARD_A) for n in tensors}
    for shard in (SHARD_A, SHARD_B):
        save_file({n: t for n, t in tensors.items() if where[n] == shard}, str(root / shard),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / hfc.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": where}))
    cfg = config or {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                     "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
                     "num_experts": EXPERTS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM,
                     "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}))
    (root / "generation_config.json").write_text('{"do_sample": true}')
    (root / "original").mkdir(exist_ok=True)
    (root / "original" / "params.json").write_text('{"dim": 64}')
    return root


@pytest.fixture(scope="module")
def src_tensors() -> dict[str, torch.Tensor]:
    return source_tensors()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, src_tensors) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "qwen3-moe-tiny", src_tensors)


_EXPORTS: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def export(tmp_path_factory, ckpt):
    """Convert once per (preset, format, all_linear) and reuse the result."""
    def get(preset: str, fmt: str = "modelopt", all_linear: bool = False) -> Path:
        key = (preset, fmt, all_linear)
        if key not in _EXPORTS:
            dst = tmp_path_factory.mktemp("dst") / f"{preset}-{fmt}-{all_linear}"
            ce.convert_checkpoint(ckpt, dst, preset=preset, fmt=fmt, all_linear=all_linear)
            _EXPORTS[key] = dst
        return _EXPORTS[key]
    return get


def load_all(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported checkpoint, through its index and safetensors."""
    index = json.loads((root / hfc.INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(root / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert index["weight_map"][name] == shard
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def shared_amax(src: dict[str, torch.Tensor], name: str, preset: str, all_linear: bool = False):
    """What the converter must pass as outer_amax for ``name`` (None: its own maximum)."""
    spec = PRESETS[preset]
    if spec.outer_domain == "row":
        return None
    module, proj = name[: -len(".weight")].rsplit(".", 1)
    if proj in ("gate_proj", "up_proj"):
        sibs = ("gate_proj", "up_proj")
    elif proj in ("q_proj", "k_proj", "v_proj") and all_linear:
        sibs = ("q_proj", "k_proj", "v_proj")
    else:
        return None
    return shared_outer_amax([src[f"{module}.{s}.weight"] for s in sibs], spec)


@pytest.mark.parametrize("preset,fmt", [("minite", "modelopt"), ("modelopt", "modelopt"),
                                        ("te", "compressed-tensors")])
def test_stored_layout_predicts_to_format(preset, fmt):
    """The shard header the converter writes up front matches what to_format produces."""
    q = quantize(inputs.randn((48, 128)), PRESETS[preset])
    row = PRESETS[preset].outer_domain == "row"
    got = {k: (tuple(v.shape), v.dtype) for k, v in to_format(q, fmt, row_scaled_ok=True).items()}
    assert got == stored_layout(fmt, (48, 128), row)


def test_row_scaled_needs_asking_for():
    """A per-row weight_scale_2 is written and read only with row_scaled_ok; CT refuses it."""
    q = quantize(inputs.randn((48, 128)), PRESETS["minite"])
    with pytest.raises(LayoutError, match="row"):
        to_format(q, "modelopt")
    with pytest.raises(LayoutError, match="row"):
        to_format(q, "compressed-tensors", row_scaled_ok=True)
    d = to_format(q, "modelopt", row_scaled_ok=True)
    with pytest.raises(ShapeError, match="one value"):
        from_modelopt(d)
    back = from_modelopt(d, PRESETS["minite"], row_scaled_ok=True)
    assert back.spec.outer_domain == "row" and back.bitwise_equal(q.__class__(
        q.codes, q.block_scales, q.outer_dec, back.spec, q.shape))


def test_selection_names():
    """Which names are expert weights, never quantized, or fused siblings."""
    assert sel.is_expert_weight("model.layers.3.mlp.experts.17.down_proj.weight")
    assert sel.is_expert_weight("model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert not sel.is_expert_weight("model.layers.3.mlp.shared_expert.gate_proj.weight")
    assert not sel.is_expert_weight("model.layers.3.mlp.experts.17.down_proj.bias")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.0.block_sparse_moe.router.weight"):
        assert sel.is_never_quantized(name), name
    assert not sel.is_never_quantized("model.layers.0.mlp.gate_proj.weight")
    names = ["a.experts.0.w1.weight", "a.experts.0.w3.weight", "a.experts.0.w2.weight",
             "m.self_attn.q_proj.weight", "m.self_attn.k_proj.weight", "m.self_attn.v_proj.weight"]
    assert sel.fused_groups(names) == {"a.experts.0:gate_up": names[:2], "m.self_attn:qkv": sorted(names[3:])}


def test_single_file_checkpoint(tmp_path, src_tensors):
    """A checkpoint without an index (one model.safetensors) converts and gains an index."""
    src = tmp_path / "src"
    src.mkdir()
    save_file(src_tensors, str(src / hfc.SINGLE_NAME), metadata={"format": "pt"})
    (src / "config.json").write_text('{"model_type": "qwen3_moe"}')
    dst = tmp_path / "dst"
    ce.convert_checkpoint(src, dst, preset="compressed_tensors", fmt="compressed-tensors")
    index = json.loads((dst / hfc.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {hfc.SINGLE_NAME}
    out = load_all(dst)
    name = "model.layers.1.mlp.experts.2.down_proj"
    q = quantize(src_tensors[f"{name}.weight"], PRESETS["compressed_tensors"])
    assert torch.equal(out[f"{name}.weight_packed"], q.codes)


def test_refuses_already_quantized_source(tmp_path, src_tensors):
    """A source whose config.json already has a quantization_config is refused, nothing written."""
    src = write_checkpoint(tmp_path / "src", src_tensors,
                           config={"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(LayoutError, match="quantization_config"):
        ce.convert_checkpoint(src, tmp_path / "out" / "dst")
    _assert_nothing_at(tmp_path / "out" / "dst")


def test_fixture_has_pairs_straddling_shards(ckpt):
    """The tiny checkpoint puts some gate/up pairs in different shards (both directions)."""
    plan = export_plan.plan_export(ckpt, "modelopt")
    assert len(plan.straddling) == 3
    assert plan.converted == EXPERT_WEIGHTS


COMBOS = [("minite", "modelopt"), ("modelopt", "modelopt"), ("te", "modelopt"),
          ("torchao", "modelopt"), ("compressed_tensors", "compressed-tensors"),
          ("modelopt", "compressed-tensors")]


@pytest.mark.parametrize("preset,fmt", COMBOS)
def test_every_stored_byte_is_the_spec(export, src_tensors, preset, fmt):
    """Codes, block-scale bytes and outer-scale bits equal libalign.spec.quantize; the rest is copied."""
    out = load_all(export(preset, fmt))
    spec = PRESETS[preset]
    expected_names = set()
    for name, x in src_tensors.items():
        if name in EXPERT_WEIGHTS:
            q = quantize(x, spec, outer_amax=shared_amax(src_tensors, name, preset))
            module = name[: -len(".weight")]
            for key, want in to_format(q, fmt, row_scaled_ok=True).items():
                got = out[f"{module}.{key}"]
                assert got.dtype == want.dtype and got.shape == want.shape, (module, key)
                assert torch.equal(bits(got), bits(want)), (module, key)
                expected_names.add(f"{module}.{key}")
        else:
            assert out[name].dtype == x.dtype and torch.equal(bits(out[name]), bits(x)), name
            expected_names.add(name)
    assert set(out) == expected_names


@pytest.mark.parametrize("preset", ["modelopt", "te", "torchao"])
def test_gate_and_up_share_one_weight_scale_2(export, src_tensors, preset):
    """Every expert's gate and up carry bit-identical weight_scale_2, also across shards."""
    out = load_all(export(preset))
    spec = PRESETS[preset]
    for li in range(LAYERS):
        for e in range(EXPERTS):
            m = f"model.layers.{li}.mlp.experts.{e}"
            gate, up = out[f"{m}.gate_proj.weight_scale_2"], out[f"{m}.up_proj.weight_scale_2"]
            assert gate.shape == () and torch.equal(bits(gate), bits(up)), m
            # sharing is not a no-op: gate and up alone would get different scales; the
            # shared one is the larger (the scale of the pair's larger amax)
            own = [quantize(src_tensors[f"{m}.{p}.weight"], spec).outer_dec.reshape(())
                   for p in ("gate_proj", "up_proj")]
            assert not torch.equal(bits(own[0]), bits(own[1])), m
            assert torch.equal(bits(gate), bits(max(own, key=float))), m


def test_minite_stores_one_decode_scale_per_row(export, src_tensors):
    """Row-scaled minite: weight_scale_2 is fp32 [N, 1], each row's own decode scale."""
    out = load_all(export("minite"))
    for name in EXPERT_WEIGHTS:
        module = name[: -len(".weight")]
        s2 = out[f"{module}.weight_scale_2"]
        q = quantize(src_tensors[name], PRESETS["minite"])
        assert s2.shape == (src_tensors[name].shape[0], 1) and s2.dtype == torch.float32
        assert torch.equal(bits(s2), bits(q.outer_dec))
    cfg = json.loads((export("minite") / "config.json").read_text())["quantization_config"]
    assert cfg["libalign"]["outer_scale"] == "per_row"
    assert "expect a scalar" in cfg["libalign"]["weight_scale_2_layout"]
    manifest = json.loads((export("minite") / hfc.MANIFEST_NAME).read_text())
    assert manifest["outer_scale"] == "per_row"
    assert any("expect a scalar" in n for n in manifest["notes"])


def _modelopt_dict(out, module):
    return {k: out[f"{module}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}


def modelopt_dequantize(d: dict[str, torch.Tensor], shape, dtype) -> torch.Tensor:
    """ModelOpt's own NVFP4QTensor.dequantize, given weight_scale_2 as stored (scalar or [N, 1])."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt = NVFP4QTensor(torch.Size(shape), dtype, d["weight"].clone())
    return qt.dequantize(dtype=dtype, scale=d["weight_scale"], double_scale=d["weight_scale_2"],
                         block_sizes={-1: 16})


@pytest.mark.parametrize("preset", ["modelopt", "minite", "te", "torchao"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modelopt_dequantizes_the_export_like_the_spec(export, src_tensors, preset, dtype):
    """ModelOpt's own NVFP4QTensor.dequantize of each exported weight equals libalign.spec.dequantize."""
    out = load_all(export(preset))
    for name in EXPERT_WEIGHTS:
        module = name[: -len(".weight")]
        d = _modelopt_dict(out, module)
        theirs = modelopt_dequantize(d, tuple(src_tensors[name].shape), dtype)
        if preset != "minite":  # the suite's adapter (scalar scale) agrees
            assert torch.equal(bits(theirs), bits(peers.modelopt_dequantize(
                d["weight"], d["weight_scale"].view(torch.uint8), d["weight_scale_2"],
                tuple(src_tensors[name].shape), dtype)))
        # the stored bits read back under ModelOpt's dequantization order
        ours = dequantize(from_modelopt(d, row_scaled_ok=True), dtype)
        assert theirs.dtype == dtype and torch.equal(bits(theirs), bits(ours)), name
        if preset == "modelopt":  # and directly: the spec's quantize -> dequantize
            q = quantize(src_tensors[name], PRESETS["modelopt"],
                         outer_amax=shared_amax(src_tensors, name, "modelopt"))
            assert torch.equal(bits(theirs), bits(dequantize(q, dtype))), name


@pytest.mark.parametrize("preset", ["compressed_tensors", "modelopt"])
def test_compressed_tensors_decompresses_the_export_like_the_spec(export, src_tensors, preset):
    """compressed-tensors' own NVFP4PackedCompressor.decompress equals libalign.spec.dequantize (bf16)."""
    out = load_all(export(preset, "compressed-tensors"))
    for name in EXPERT_WEIGHTS:
        module = name[: -len(".weight")]
        d = {k: out[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = peers.compressed_tensors_dequantize(d["weight_packed"], d["weight_scale"].view(torch.uint8),
                                                     d["weight_global_scale"])
        ours = dequantize(from_compressed_tensors(d), torch.bfloat16)
        assert theirs.dtype == torch.bfloat16 and torch.equal(bits(theirs), bits(ours)), name
        if preset == "compressed_tensors":
            q = quantize(src_tensors[name], PRESETS["compressed_tensors"],
                         outer_amax=shared_amax(src_tensors, name, preset))
            assert torch.equal(bits(theirs), bits(dequantize(q, torch.bfloat16))), name


def test_modelopt_config_is_what_modelopt_writes(export):
    """config.json's quantization_config is ModelOpt's own conversion of hf_quant_config.json."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    root = export("modelopt")
    hf = json.loads((root / hfc.HF_QUANT_CONFIG).read_text())
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["group_size"] == 16
    qc = json.loads((root / "config.json").read_text())["quantization_config"]
    note = qc.pop("libalign")
    assert qc == convert_hf_quant_config_format(hf)
    assert qc["quant_method"] == "modelopt"
    excluded = set(hf["quantization"]["exclude_modules"])
    want = {"lm_head"} | {f"model.layers.{li}.{m}" for li in range(LAYERS)
                          for m in ["mlp.gate", *(f"self_attn.{a}" for a in ATTN)]}
    assert excluded == want
    assert note["preset"] == "modelopt" and note["numerics_spec"] == PRESETS["modelopt"].to_dict()
    assert not any(k.endswith(".input_scale") for k in load_all(root))


def test_compressed_tensors_config_parses_as_nvfp4_weights(export):
    """compressed-tensors parses the config as its NVFP4A16 scheme and expects exactly our keys."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    root = export("compressed_tensors", "compressed-tensors")
    qc = json.loads((root / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    assert cfg.format == "nvfp4-pack-quantized" and cfg.quant_method == "compressed-tensors"
    scheme = cfg.config_groups["group_0"]
    assert scheme.weights == preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    assert scheme.input_activations is None
    assert "lm_head" in cfg.ignore and "model.layers.0.mlp.gate" in cfg.ignore
    keys = set(NVFP4PackedCompressor.compression_param_names(scheme))
    out = load_all(root)
    for name in EXPERT_WEIGHTS:
        module = name[: -len(".weight")]
        assert {k[len(module) + 1:] for k in out if k.startswith(module + ".")} == keys


def _raw_sha256(path: Path) -> dict[str, str]:
    """SHA-256 of every tensor's byte range, from the safetensors header read by hand."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: hashlib.sha256(data[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]]).hexdigest()
            for k, v in header.items()}


def test_index_manifest_and_copied_files(export, ckpt, src_tensors):
    """Index, manifest checksums/totals/timings and non-weight files describe the export exactly."""
    root = export("modelopt")
    out = load_all(root)
    index = json.loads((root / hfc.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    manifest = json.loads((root / hfc.MANIFEST_NAME).read_text())
    raw = {**_raw_sha256(root / SHARD_A), **_raw_sha256(root / SHARD_B)}
    assert {r["name"] for r in manifest["tensors"]} == set(out) == set(raw)
    for r in manifest["tensors"]:
        assert r["sha256"] == raw[r["name"]] == hashlib.sha256(bits(out[r["name"]]).numpy()).hexdigest()
        assert r["shape"] == list(out[r["name"]].shape) and r["shard"] == index["weight_map"][r["name"]]
        assert r["preset"] == (None if r["role"] == "copied" else "modelopt")
    totals = manifest["totals"]
    assert totals["tensors_converted"] == len(EXPERT_WEIGHTS)
    assert totals["tensors_copied"] == len(src_tensors) - len(EXPERT_WEIGHTS)
    assert totals["bytes_in"] == sum(t.numel() * t.element_size() for t in src_tensors.values())
    assert totals["bytes_out"] == index["metadata"]["total_size"]
    assert totals["bytes_out"] < totals["bytes_in"]
    assert {"plan", "read", "quantize", "write", "files", "total"} <= set(manifest["timings_seconds"])
    assert all(v >= 0 for v in manifest["timings_seconds"].values())
    for c in manifest["converted"]:
        m, proj = c["source"].rsplit(".", 2)[0], c["source"].split(".")[-2]
        if proj in ("gate_proj", "up_proj"):
            other = "up_proj" if proj == "gate_proj" else "gate_proj"
            assert c["outer_shared_with"] == [f"{m}.{other}.weight"]
    copied = {"tokenizer.json", "generation_config.json", "original/params.json"}
    for f in copied:
        assert (root / f).read_bytes() == (ckpt / f).read_bytes()
    assert {f["path"] for f in manifest["files_copied"]} == copied
    assert set(manifest["files_skipped"]) == {SHARD_A, SHARD_B, hfc.INDEX_NAME, "config.json"}
    cfg_in = json.loads((ckpt / "config.json").read_text())
    cfg_out = json.loads((root / "config.json").read_text())
    assert {k: v for k, v in cfg_out.items() if k != "quantization_config"} == cfg_in


def test_all_linear_converts_attention_and_fuses_qkv(export, src_tensors):
    """--all-linear converts q/k/v/o (q/k/v share one scale) and keeps embeddings, lm_head, norms, router."""
    root = export("modelopt", "modelopt", True)
    out = load_all(root)
    manifest = json.loads((root / hfc.MANIFEST_NAME).read_text())
    converted = {c["source"] for c in manifest["converted"]}
    attn = {f"model.layers.{li}.self_attn.{a}.weight" for li in range(LAYERS) for a in ATTN}
    assert converted == set(EXPERT_WEIGHTS) | attn
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight"):
        assert torch.equal(bits(out[name]), bits(src_tensors[name])), name
    hf = json.loads((root / hfc.HF_QUANT_CONFIG).read_text())
    assert set(hf["quantization"]["exclude_modules"]) == {"lm_head", "model.layers.0.mlp.gate",
                                                          "model.layers.1.mlp.gate"}
    for li in range(LAYERS):
        p = f"model.layers.{li}.self_attn"
        s = [out[f"{p}.{a}.weight_scale_2"] for a in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(bits(s[0]), bits(s[1])) and torch.equal(bits(s[0]), bits(s[2]))
        for a in ATTN:
            name = f"{p}.{a}.weight"
            q = quantize(src_tensors[name], PRESETS["modelopt"],
                         outer_amax=shared_amax(src_tensors, name, "modelopt", all_linear=True))
            assert torch.equal(bits(out[f"{p}.{a}.weight"]), bits(q.codes)), name
            assert torch.equal(bits(out[f"{p}.{a}.weight_scale_2"]), bits(q.outer_dec)), name


def _assert_nothing_at(dst: Path) -> None:
    assert not dst.exists()
    if dst.parent.exists():
        assert not [p for p in dst.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("bad", ["model.layers.1.mlp.experts.3.down_proj.weight",   # late, shard B
                                 "model.layers.1.mlp.experts.0.up_proj.weight"])    # straddling pair
def test_nan_in_one_expert_leaves_nothing(tmp_path, src_tensors, bad):
    """A NaN weight raises NonFiniteError naming the tensor, and DST never appears."""
    t = dict(src_tensors)
    t[bad] = t[bad].clone()
    t[bad][3, 5] = float("nan")
    src = write_checkpoint(tmp_path / "src", t)
    dst = tmp_path / "out" / "dst"
    with pytest.raises(NonFiniteError, match=bad.replace(".", r"\.")):
        ce.convert_checkpoint(src, dst, preset="modelopt")
    _assert_nothing_at(dst)


def test_missing_shard_and_wrong_dtype_leave_nothing(tmp_path, src_tensors):
    """A missing or escaping shard in the index, or an integer expert weight, fails before DST appears."""
    src = write_checkpoint(tmp_path / "src", src_tensors)
    (src / SHARD_B).unlink()
    dst = tmp_path / "out" / "dst"
    with pytest.raises(MissingShardError, match=SHARD_B):
        ce.convert_checkpoint(src, dst)
    _assert_nothing_at(dst)

    index = json.loads((src / hfc.INDEX_NAME).read_text())
    index["weight_map"] = {n: "../" + SHARD_A for n in index["weight_map"]}
    (src / hfc.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(LayoutError, match="relative"):
        ce.convert_checkpoint(src, dst)
    _assert_nothing_at(dst)

    t = dict(src_tensors)
    bad = "model.layers.0.mlp.experts.2.down_proj.weight"
    t[bad] = t[bad].to(torch.int8)
    src2 = write_checkpoint(tmp_path / "src2", t)
    with pytest.raises(DTypeError, match=bad.replace(".", r"\.")):
        ce.convert_checkpoint(src2, dst)
    _assert_nothing_at(dst)


def test_refuses_existing_dst_unless_overwrite(tmp_path, ckpt):
    """An existing DST is kept unless overwrite is asked for; then it is replaced whole."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "marker").write_text("keep")
    with pytest.raises(DestinationExistsError):
        ce.convert_checkpoint(ckpt, dst, preset="modelopt")
    assert (dst / "marker").read_text() == "keep"
    ce.convert_checkpoint(ckpt, dst, preset="modelopt", overwrite=True)
    assert not (dst / "marker").exists() and (dst / hfc.MANIFEST_NAME).is_file()


def test_refuses_dst_inside_src_and_row_scaled_compressed_tensors(tmp_path, ckpt):
    """DST inside SRC (which --overwrite could destroy) and minite + compressed-tensors are refused."""
    with pytest.raises(InputError, match="outside"):
        ce.convert_checkpoint(ckpt, ckpt / "nvfp4", overwrite=True)
    with pytest.raises(SpecError, match="row"):
        ce.convert_checkpoint(ckpt, tmp_path / "dst", preset="minite", fmt="compressed-tensors")
    _assert_nothing_at(tmp_path / "dst")


class _Tracker:
    """Counts bytes of source tensors alive at once, and the order of reads and shard closes."""

    def __init__(self, monkeypatch):
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.events: list[tuple[str, str, str]] = []
        real_open, real_close = ce.safe_open, hfc.ShardWriter.close
        tracker = self

        class Handle:
            def __init__(self, path, **kw):
                self._cm = real_open(path, **kw)
                self._shard = Path(path).name

            def __enter__(self):
                self._f = self._cm.__enter__()
                return self

            def __exit__(self, *exc):
                return self._cm.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def get_tensor(self, name):
                t = self._f.get_tensor(name)
                n = t.numel() * t.element_size()
                tracker.live += n
                tracker.peak = max(tracker.peak, tracker.live)
                tracker.largest = max(tracker.largest, n)
                weakref.finalize(t, tracker._free, n)
                tracker.events.append(("read", self._shard, name))
                return t

        def close(writer):
            tracker.events.append(("closed", writer.path.name, ""))
            return real_close(writer)

        monkeypatch.setattr(ce, "safe_open", Handle)
        monkeypatch.setattr(hfc.ShardWriter, "close", close)

    def _free(self, n):
        self.live -= n


def test_memory_is_bounded_by_one_fused_group_not_a_shard(tmp_path, ckpt, src_tensors, monkeypatch):
    """At most one gate/up pair of source tensors is alive at once; shard A is closed before B is read."""
    tr = _Tracker(monkeypatch)
    ce.convert_checkpoint(ckpt, tmp_path / "out" / "dst", preset="modelopt")
    pair = 2 * INTER * HIDDEN * 2
    where = json.loads((ckpt / hfc.INDEX_NAME).read_text())["weight_map"]
    shard_a = sum(t.numel() * t.element_size() for n, t in src_tensors.items() if where[n] == SHARD_A)
    assert tr.largest == VOCAB * HIDDEN * 2  # the tracker sees real reads
    assert tr.peak <= max(pair, tr.largest) < shard_a / 4
    assert tr.live == 0
    plan = export_plan.plan_export(ckpt, "modelopt")
    prescanned = [n for k in plan.straddling for n in plan.groups[k]]
    reads = [e for e in tr.events if e[0] == "read"]
    assert [e[2] for e in reads[:len(prescanned)]] == prescanned
    rest = reads[len(prescanned):]
    assert sorted(e[2] for e in rest) == sorted(src_tensors)  # every tensor read exactly once
    closed_a = tr.events.index(("closed", SHARD_A, ""))
    assert {e[1] for e in tr.events[len(prescanned):closed_a]} == {SHARD_A}
    assert {e[1] for e in tr.events[closed_a + 1:] if e[0] == "read"} == {SHARD_B}


def test_progress_reports_every_byte(tmp_path, ckpt):
    """The progress callback rises monotonically to its total."""
    seen: list[tuple[int, int]] = []
    ce.convert_checkpoint(ckpt, tmp_path / "dst", preset="torchao",
                          progress=lambda done, total, what: seen.append((done, total)))
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))


runner = CliRunner()


def test_cli_convert_success_and_one_line_failures(tmp_path, ckpt, src_tensors):
    """alignd convert exits 0 on success; on failure it exits 1 with one clear line and no DST."""
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["convert", str(ckpt), str(dst), "--preset", "modelopt", "--quiet"])
    assert res.exit_code == 0, res.output
    assert (dst / hfc.MANIFEST_NAME).is_file() and res.output == ""
    assert json.loads((dst / hfc.MANIFEST_NAME).read_text())["preset"] == "modelopt"

    res = runner.invoke(app, ["convert", str(ckpt), str(dst)])
    assert res.exit_code == 1 and "--overwrite" in res.output
    assert len(res.output.strip().splitlines()) == 1

    res = runner.invoke(app, ["convert", str(ckpt), str(dst), "--overwrite", "--format",
                              "compressed-tensors", "--preset", "compressed_tensors"])
    assert res.exit_code == 0, res.output
    assert "weight_packed" in json.dumps(json.loads((dst / hfc.INDEX_NAME).read_text()))

    t = dict(src_tensors)
    bad = "model.layers.0.mlp.experts.0.gate_proj.weight"
    t[bad] = t[bad].clone()
    t[bad][0, 0] = float("inf")
    src = write_checkpoint(tmp_path / "bad", t)
    res = runner.invoke(app, ["convert", str(src), str(tmp_path / "dst2")])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "NonFiniteError" in lines[0] and bad in lines[0]
    _assert_nothing_at(tmp_path / "dst2")
