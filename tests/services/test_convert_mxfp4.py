"""MXFP4 through the converter: ``alignd convert --preset mxfp4* --format compressed-tensors``
writes compressed-tensors' ``mxfp4-pack-quantized`` layout (what vLLM's and SGLang's
``CompressedTensorsW4A16Mxfp4`` load), and the weight store keeps MXFP4 versions bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from alignclient.errors import LayoutError, ShapeError, SpecError
from alignd.formats import export as ce
from alignd.formats import hf_checkpoint as hfc
from alignd.formats.weight_store import WeightStore
from alignd.tools.cli import app
from typer.testing import CliRunner

from libalign.checkpoint import from_compressed_tensors, stored_layout, to_format
from libalign.spec import PRESETS, dequantize, quantize
from tests.services.test_convert_checkpoint import (
    EXPERT_WEIGHTS,
    bits,
    load_all,
    source_tensors,
    write_checkpoint,
)

MX = ("mxfp4", "mxfp4_te")


@pytest.fixture(scope="module")
def src_tensors():
    return source_tensors()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, src_tensors):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("src") / "tiny", src_tensors)
    out = {}
    for preset in MX:
        dst = tmp_path_factory.mktemp("dst") / preset
        ce.convert_checkpoint(ckpt, dst, preset=preset, fmt="compressed-tensors", all_linear=True)
        out[preset] = dst
    return out


def _module_dict(out, name):
    module = name[: -len(".weight")]
    return {k[len(module) + 1:]: v for k, v in out.items() if k.startswith(module + ".")}


@pytest.mark.parametrize("preset", MX)
def test_read_back_bits_and_dequantize_equal_the_spec(exported, src_tensors, preset):
    out = load_all(exported[preset])
    spec = PRESETS[preset]
    converted = [n for n in src_tensors if n.endswith(".weight") and f"{n[:-7]}.weight_packed" in out]
    assert set(EXPERT_WEIGHTS) <= set(converted) and any("self_attn.o_proj" in n for n in converted)
    for name in converted:
        d = _module_dict(out, name)
        assert set(d) == {"weight_packed", "weight_scale"}, name  # no global scale
        assert d["weight_scale"].dtype == torch.uint8
        back = from_compressed_tensors(d, spec)
        want = quantize(src_tensors[name], spec)
        assert back.bitwise_equal(want), name
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(bits(dequantize(back, dtype)), bits(dequantize(want, dtype))), name


@pytest.mark.parametrize("preset", MX)
def test_compressed_tensors_reads_the_config_and_decompresses_like_the_spec(exported, preset):
    """compressed-tensors parses config.json as its MXFP4A16 scheme, expects exactly the stored
    keys, and its own MXFP4PackedCompressor.decompress gives spec.dequantize's bf16 bits."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    root = exported[preset]
    qc = json.loads((root / "config.json").read_text())["quantization_config"]
    assert qc["libalign"]["numerics_spec"] == PRESETS[preset].to_dict()
    cfg = QuantizationConfig.model_validate(qc)
    assert cfg.format == "mxfp4-pack-quantized"
    scheme = cfg.config_groups["group_0"]
    assert scheme.weights == preset_name_to_scheme("MXFP4A16", ["Linear"]).weights
    assert scheme.input_activations is None
    assert "lm_head" in cfg.ignore and "model.layers.0.mlp.gate" in cfg.ignore
    keys = set(MXFP4PackedCompressor.compression_param_names(scheme))
    out = load_all(root)
    for name in EXPERT_WEIGHTS:
        d = _module_dict(out, name)
        assert set(d) == keys, name
        theirs = MXFP4PackedCompressor.decompress(dict(d), scheme)["weight"]
        ours = dequantize(from_compressed_tensors(d, PRESETS[preset]), torch.bfloat16)
        assert theirs.dtype == torch.bfloat16 and torch.equal(bits(theirs), bits(ours)), name
    assert not (root / hfc.HF_QUANT_CONFIG).exists()


def test_manifest_names_the_mx_roles(exported):
    manifest = json.loads((exported["mxfp4"] / hfc.MANIFEST_NAME).read_text())
    roles = {r["role"] for r in manifest["tensors"] if r["preset"]}
    assert roles == {"mxfp4_codes", "mxfp4_block_scales"}
    assert manifest["outer_scale"].startswith("none")


def test_modelopt_layout_refuses_mxfp4(tmp_path, src_tensors):
    ckpt = write_checkpoint(tmp_path / "src", src_tensors)
    with pytest.raises(SpecError, match="compressed-tensors"):
        ce.convert_checkpoint(ckpt, tmp_path / "dst", preset="mxfp4", fmt="modelopt")
    assert not (tmp_path / "dst").exists()
    q = quantize(src_tensors[EXPERT_WEIGHTS[0]], PRESETS["mxfp4"])
    with pytest.raises(LayoutError, match="mxfp4-pack-quantized"):
        to_format(q, "modelopt")
    with pytest.raises(LayoutError):
        stored_layout("modelopt", (32, 64), mx=True)


def test_expert_k_not_a_multiple_of_32_is_a_shape_error(tmp_path, src_tensors):
    t = dict(src_tensors)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    t[name] = torch.randn(t[name].shape[0], 48).to(torch.bfloat16)  # a multiple of 16, not 32
    ckpt = write_checkpoint(tmp_path / "src", t)
    with pytest.raises(ShapeError, match="multiple of 32"):
        ce.convert_checkpoint(ckpt, tmp_path / "dst", preset="mxfp4", fmt="compressed-tensors")
    assert not (tmp_path / "dst").exists()


def test_cli_convert_accepts_mxfp4(tmp_path, src_tensors):
    ckpt = write_checkpoint(tmp_path / "src", src_tensors)
    dst = tmp_path / "dst"
    res = CliRunner().invoke(app, ["convert", str(ckpt), str(dst), "--preset", "mxfp4_te",
                                   "--format", "compressed-tensors", "--quiet"])
    assert res.exit_code == 0, res.output
    out = load_all(dst)
    d = _module_dict(out, EXPERT_WEIGHTS[0])
    assert from_compressed_tensors(d, PRESETS["mxfp4_te"]).bitwise_equal(
        quantize(src_tensors[EXPERT_WEIGHTS[0]], PRESETS["mxfp4_te"]))
    res = CliRunner().invoke(app, ["convert", str(ckpt), str(tmp_path / "d2"), "--preset",
                                   "mxfp4", "--quiet"])
    assert res.exit_code == 1 and "compressed-tensors" in res.output


def test_weight_store_keeps_mxfp4_versions_bit_for_bit(tmp_path, src_tensors):
    store = WeightStore(tmp_path / "store")
    spec = PRESETS["mxfp4"]
    names = EXPERT_WEIGHTS[:3]
    store.write_version("v1", [(n, src_tensors[n]) for n in names] +
                        [("model.norm.weight", src_tensors["model.norm.weight"])], spec,
                        select=lambda n, t: n in names)
    got = store.read_version("v1")
    for n in names:
        q = got[n]
        want = quantize(src_tensors[n], spec)
        assert q.spec == spec and q.outer_scale is None
        assert q.block_scales.dtype == torch.float8_e8m0fnu and q.bitwise_equal(want)
        assert torch.equal(bits(dequantize(q)), bits(dequantize(want)))
