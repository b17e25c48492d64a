"""Pins the weight store: layout and names, bit-exact round trip, checksums, atomicity,
the published BF16 input side and convert_published (no Redis needed)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from alignclient.errors import (
    ChecksumMismatchError,
    DTypeError,
    InputError,
    LayoutError,
    ManifestError,
    MissingShardError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignd.api.errors import status_for
from alignd.formats.convert import convert_published
from alignd.formats.hf_checkpoint import INDEX_NAME, HFCheckpoint
from alignd.formats.published import write_published
from alignd.formats.selection import is_expert_weight
from alignd.formats.weight_store import WeightStore, tensor_sha256

from libalign.atomic_dir import atomic_directory, writer_tag
from libalign.spec import PRESETS
from libalign.spec import quantize as spec_quantize

from .conftest import tiny_experts


def tensor_offset(file: Path, name: str) -> int:
    """Absolute byte offset of tensor ``name``'s data in a safetensors file."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return 8 + n + header[name]["data_offsets"][0]


def test_round_trip_is_bit_exact_with_modelopt_names(tmp_path):
    """Quantized tensors come back bit-identical to the spec; names, manifest and raws as documented."""
    store = WeightStore(tmp_path)
    sd = tiny_experts()
    spec = PRESETS["minite"]
    manifest = store.write_version("v1", sd, spec, select=is_expert_weight)
    sv = store.read_version("v1")
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    entry = manifest.tensors[name]
    assert entry.kind == "nvfp4" and entry.shape == (128, 64) and entry.dtype == "bfloat16"
    assert manifest.specs[entry.spec] == spec.to_dict() and manifest.spec_of(entry) == spec
    roles = {sn: m.role for sn, m in entry.stored.items()}
    assert roles == {name: "codes", name + "_scale": "block_scales", name + "_scale_2": "outer_scale"}
    assert entry.stored[name + "_scale_2"].shape == (128,)  # row domain: one per row
    for n, t in sd.items():
        got = sv[n]
        if is_expert_weight(n, t):
            ref = spec_quantize(t, spec)
            assert got.bitwise_equal(ref), n
            assert got.spec == spec and got.shape == tuple(t.shape)
        else:
            assert manifest.tensors[n].kind == "raw"
            assert got.dtype == t.dtype and torch.equal(got, t), n
    totals = manifest.totals
    assert totals.tensors == len(sd) and totals.raw_tensors == 3
    assert totals.source_bytes == sum(t.numel() * 2 for t in sd.values())
    assert totals.stored_bytes == sum(p.stat().st_size for p in sv.path.glob("*.safetensors"))
    assert set(manifest.timings.to_dict()) == {"read_s", "quantize_s", "write_s", "total_s"}
    assert json.loads((sv.path / "manifest.json").read_text()) == manifest.to_dict()
    assert store.list_versions() == ["v1"]


def test_shards_split_and_every_checksum_matches(tmp_path):
    """Small shard_bytes gives several files; each stored tensor's sha256 is its bytes'."""
    store = WeightStore(tmp_path)
    sd = tiny_experts(experts=3)
    manifest = store.write_version("v", sd, PRESETS["te"], select=is_expert_weight, shard_bytes=8000)
    assert manifest.totals.files > 3
    sv = store.read_version("v")
    for name, entry in manifest.tensors.items():
        item = sv[name]
        parts = {"codes": "codes", "block_scales": "block_scales", "outer_scale": "outer_scale"}
        for sn, meta in entry.stored.items():
            t = item if meta.role == "raw" else getattr(item, parts[meta.role])
            assert tensor_sha256(t) == meta.sha256, sn
    assert store.verify_version("v") == manifest


def test_flipped_byte_is_named(tmp_path):
    """One changed byte in a stored tensor raises ChecksumMismatchError naming that tensor."""
    store = WeightStore(tmp_path)
    sd = tiny_experts(experts=2)
    manifest = store.write_version("v", sd, PRESETS["minite"], select=is_expert_weight,
                                   shard_bytes=10_000)
    victim = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    owner = victim.removesuffix("_scale")
    file = store.version_path("v") / manifest.tensors[owner].file
    raw = bytearray(file.read_bytes())
    raw[tensor_offset(file, victim) + 5] ^= 0x01
    file.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError) as ei:
        store.read_version("v")
    assert ei.value.tensor == victim and victim in str(ei.value)
    with pytest.raises(ChecksumMismatchError):
        store.verify_version("v")
    store.read_version("v", verify=False)  # shapes and dtypes still fit


def test_missing_or_foreign_files_are_manifest_errors(tmp_path):
    """A deleted shard or an unreadable manifest raises ManifestError; unknown ids 404."""
    store = WeightStore(tmp_path)
    m = store.write_version("v", tiny_experts(experts=2), PRESETS["minite"], select=is_expert_weight,
                            shard_bytes=10_000)
    (store.version_path("v") / next(iter(m.files))).unlink()
    with pytest.raises(ManifestError, match="missing"):
        store.verify_version("v")
    (store.version_path("v") / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError):
        store.read_version("v")
    with pytest.raises(VersionNotFoundError):
        store.read_version("nope")


def test_failed_write_leaves_nothing(tmp_path):
    """An error half-way through (here a NaN in the 5th tensor) leaves no version and no temp dir."""
    store = WeightStore(tmp_path)
    sd = tiny_experts(experts=2)
    names = list(sd)
    sd[names[4]] = sd[names[4]].clone()
    sd[names[4]][0, 3] = float("inf")
    with pytest.raises(InputError, match=names[4]):
        store.write_version("v", sd, PRESETS["minite"], select=is_expert_weight, shard_bytes=4000)
    assert store.list_versions() == [] and list(store.versions_root.iterdir()) == []


def test_killed_writer_leaves_only_hidden_leftovers(tmp_path):
    """A writer process killed after two shards leaves a .tmp-* dir the store never lists."""
    code = textwrap.dedent(f"""
        import os, signal
        from libalign.spec import PRESETS
        from alignd.formats.weight_store import WeightStore
        from alignd.formats.selection import is_expert_weight
        from tests.services.conftest import tiny_experts
        steps = []
        def on_step(label):
            steps.append(label)
            if len(steps) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        WeightStore({str(tmp_path)!r}).write_version(
            "v", tiny_experts(), PRESETS["minite"], select=is_expert_weight,
            shard_bytes=8000, on_step=on_step)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], timeout=60)
    assert proc.returncode == -9
    store = WeightStore(tmp_path)
    leftovers = list(store.versions_root.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-v.")
    assert len(list(leftovers[0].glob("*.safetensors"))) >= 2
    assert store.list_versions() == [] and not store.has_version("v")
    with pytest.raises(VersionNotFoundError):
        store.read_version("v")
    assert store.sweep(min_age_s=0) == leftovers and not leftovers[0].exists()


def test_sweep_takes_leftovers_of_gone_writers_only(tmp_path):
    """An old ``.tmp-*`` goes when its writer is gone (exited, or its pid now another process);
    a live writer keeps its directory however old; a young leftover stays."""
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to tell live writers")
    store = WeightStore(tmp_path)
    root = store.versions_root
    gone = subprocess.run([sys.executable, "-c", "from libalign.atomic_dir import writer_tag; "
                           "print(writer_tag())"], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()
    pid, start = writer_tag().split("-")
    dead = root / f".tmp-a.{gone}.0123abcd"
    reused = root / f".tmp-b.{pid}-{int(start) + 1}.0123abcd"  # our pid, another start time
    anonymous = root / ".tmp-parts-c-of-2"  # no writer in the name: the age rule alone
    young = root / f".tmp-d.{gone}.4567abcd"
    old = time.time() - 7200
    for d in (dead, reused, anonymous, young):
        d.mkdir(parents=True)
    for d in (dead, reused, anonymous):
        os.utime(d, (old, old))
    with atomic_directory(root / "e") as live:
        assert live.name.startswith(f".tmp-e.{writer_tag()}.")
        (live / "x").write_bytes(b"1")
        os.utime(live, (old, old))
        removed = store.sweep(min_age_s=3600)
        assert sorted(removed) == sorted([dead, reused, anonymous])
        assert not any(p.exists() for p in removed) and live.is_dir() and young.is_dir()
    assert (root / "e" / "x").read_bytes() == b"1"


def test_exists_overwrite_and_delete(tmp_path):
    """Writing an existing id needs overwrite; delete removes it; bad ids are refused."""
    store = WeightStore(tmp_path)
    sd = {"a.experts.0.up_proj.weight": torch.randn(16, 32)}
    store.write_version("v", sd, PRESETS["minite"])
    with pytest.raises(VersionExistsError) as ei:
        store.write_version("v", sd, PRESETS["te"])
    assert status_for(ei.value) == 409
    m = store.write_version("v", sd, PRESETS["te"], overwrite=True)
    assert "te" in m.specs and store.read_version("v").manifest == m
    store.delete_version("v")
    assert store.list_versions() == [] and list(store.versions_root.iterdir()) == []
    with pytest.raises(VersionNotFoundError):
        store.delete_version("v")
    for bad in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(InputError):
            store.write_version(bad, sd, PRESETS["minite"])


def test_stored_name_clash_is_refused(tmp_path):
    """A raw tensor named like another tensor's block scales is a layout error."""
    store = WeightStore(tmp_path)
    sd = {"x.weight": torch.randn(16, 32), "x.weight_scale": torch.randn(4)}
    with pytest.raises(LayoutError, match=r"x\.weight_scale"):
        store.write_version("v", sd, PRESETS["minite"], select=lambda n, t: t.ndim == 2)


def test_published_round_trip_and_missing_shard(tmp_path):
    """Published shards read back equal; a missing shard names itself and its tensors."""
    sd = tiny_experts(experts=2)
    path = write_published(tmp_path / "published", "v1", sd, shard_bytes=20_000)
    pub = HFCheckpoint(path)
    assert len(pub.shards()) > 2 and pub.total_bytes == sum(t.numel() * 2 for t in sd.values())
    got = dict(pub.iter_tensors())
    assert list(got) != [] and all(torch.equal(got[n], sd[n]) for n in sd) and set(got) == set(sd)
    assert not any(p.name.startswith(".tmp-") for p in path.parent.iterdir())
    with pytest.raises(VersionExistsError):
        write_published(tmp_path / "published", "v1", sd)
    shard, names = list(pub.shards().items())[1]
    (path / shard).unlink()
    with pytest.raises(MissingShardError) as ei:
        HFCheckpoint(path).check_shards()
    assert ei.value.shard == shard and ei.value.tensors == names and names[0] in str(ei.value)


def test_index_naming_an_absent_tensor(tmp_path):
    """An index that puts a tensor in a shard that lacks it raises LayoutError naming it."""
    path = write_published(tmp_path, "v", {"a.weight": torch.ones(2, 16)})
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"]["b.weight"] = index["weight_map"]["a.weight"]
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(LayoutError, match=r"b\.weight"):
        list(HFCheckpoint(path).iter_tensors())


def test_convert_published_selection_and_dtype(tmp_path):
    """all_linear also quantizes q_proj (not router or norm); an int expert weight is refused by name."""
    store = WeightStore(tmp_path / "store")
    sd = tiny_experts(experts=2)
    src = write_published(store.published_root, "v", sd)
    kinds = {n: e.kind for n, e in convert_published(src, store, "v", "minite").tensors.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "raw"
    m = convert_published(src, store, "v-all", "minite", all_linear=True)
    kinds = {n: e.kind for n, e in m.tensors.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "nvfp4"
    assert kinds["model.layers.0.mlp.gate.weight"] == "raw"
    assert kinds["model.layers.0.input_layernorm.weight"] == "raw"
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == "nvfp4"
    bad = dict(sd)
    bad["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.ones(64, 128, dtype=torch.int32)
    src = write_published(store.published_root, "bad", bad)
    with pytest.raises(DTypeError, match=r"experts\.1\.gate_proj\.weight") as ei:
        convert_published(src, store, "bad", PRESETS["minite"])
    assert ei.value.tensor == "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert "bad" not in store.list_versions()


def test_unreadable_published_input(tmp_path):
    """A truncated shard, a missing directory and a directory without index are LayoutErrors."""
    path = write_published(tmp_path, "v", tiny_experts(experts=2), shard_bytes=20_000)
    shard = next(iter(HFCheckpoint(path).shards()))
    (path / shard).write_bytes((path / shard).read_bytes()[:100])
    with pytest.raises(LayoutError, match=shard):
        list(HFCheckpoint(path).iter_tensors())
    with pytest.raises(LayoutError, match="does not exist"):
        HFCheckpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match="neither"):
        HFCheckpoint(tmp_path / "empty")


@pytest.mark.gpu
def test_quantizing_on_cuda_stores_the_same_bits(tmp_path):
    """device='cuda' runs the GPU kernel; the stored version equals the CPU one bit for bit."""
    tensors = tiny_experts()
    cpu = WeightStore(tmp_path / "a")
    gpu = WeightStore(tmp_path / "b")
    cpu.write_version("v1", tensors, PRESETS["minite"], select=is_expert_weight)
    gpu.write_version("v1", tensors, PRESETS["minite"], select=is_expert_weight, device="cuda")
    a, b = cpu.read_version("v1"), gpu.read_version("v1")
    for name in tensors:
        if is_expert_weight(name, tensors[name]):
            assert b[name].bitwise_equal(a[name]), name
            assert b[name].bitwise_equal(spec_quantize(tensors[name], PRESETS["minite"]))
