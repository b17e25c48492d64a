"""Pins the typed weight-store manifest (alignd.formats.manifest): the file format is unchanged,
so versions written before it still load and verify, and a malformed manifest is a
ManifestError naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from alignclient.errors import ManifestError
from alignd.formats.manifest import Manifest, TensorEntry, Totals
from alignd.formats.sharded_version import Piece, write_part
from alignd.formats.weight_store import WeightStore

from libalign.spec import PRESETS, NVFP4Tensor

#: A store holding ``whole`` (minite, two shards, a raw tensor) and ``sharded`` (te, two parts,
#: a dim-0 pieced stack), written by :func:`write_fixture` with the code before Manifest
#: (commit 597e167), when manifests were built as dicts.
STORED = Path(__file__).parent / "stored_versions"
STACK = "model.layers.0.mlp.experts.gate_up_proj"


def pattern(*shape: int, k: int = 0) -> torch.Tensor:
    """Exact bf16 values, no RNG: multiples of 1/4 in [-2.75, 2.75]."""
    n = torch.arange(torch.Size(shape).numel())
    return (((n * 7 + k) % 23 - 11).float() / 4).reshape(shape).to(torch.bfloat16)


def quant(name: str, t: torch.Tensor) -> bool:
    return t.ndim >= 2


def write_fixture(store: WeightStore) -> None:
    """The writes that made :data:`STORED`."""
    store.write_version("whole", {STACK: pattern(2, 32, 32, k=1),
                                  "model.layers.0.mlp.experts.down_proj": pattern(2, 32, 32, k=2),
                                  "model.norm.weight": pattern(32, k=3)},
                        PRESETS["minite"], select=quant, shard_bytes=1500,
                        source={"kind": "fixture"}, extra={"all_linear": False})
    stack = pattern(4, 32, 32, k=4)
    amax = stack.float().abs().amax()
    write_part(store, "sharded", 0, 2, {STACK: Piece(stack[:2], 0, 4, amax),
                                       "model.norm.weight": pattern(32, k=5)},
               PRESETS["te"], select=quant, source={"kind": "fixture", "rank": 0})
    write_part(store, "sharded", 1, 2, {STACK: Piece(stack[2:], 2, 4, amax),
                                       "model.layers.1.mlp.experts.down_proj": pattern(2, 32, 32, k=6)},
               PRESETS["te"], select=quant, shard_bytes=1200, source={"kind": "fixture", "rank": 1})


@pytest.fixture
def old_store(tmp_path: Path) -> WeightStore:
    """A copy of the stored versions (readers must not need to write next to them)."""
    shutil.copytree(STORED, tmp_path / "old")
    return WeightStore(tmp_path / "old")


def without_times(d: dict) -> dict:
    """A manifest dict less what differs between two writes of the same tensors."""
    d = {k: v for k, v in d.items() if k not in ("created_at", "timings")}
    if "parts" in d:
        d["parts"] = [{k: v for k, v in p.items() if k not in ("created_at", "timings")}
                      for p in d["parts"]]
    return d


def test_manifests_written_before_round_trip_exactly():
    """Every manifest.json the dict-building code wrote (whole, merged sharded, each part's) reads
    as a Manifest whose to_dict() is the same dict, serialized to the same bytes."""
    paths = sorted(STORED.rglob("manifest.json"))
    assert len(paths) == 4
    for p in paths:
        text = p.read_text()
        raw = json.loads(text)
        m = Manifest.from_dict(raw)
        assert m.to_dict() == raw, p
        assert json.dumps(m.to_dict(), indent=1) == text, p
        assert Manifest.from_dict(m.to_dict()) == m
    merged = Manifest.from_dict(json.loads((STORED / "nvfp4/sharded/manifest.json").read_text()))
    assert merged.format_version == 2 and merged.num_parts == 2 and len(merged.parts or ()) == 2
    entry = merged.tensors[STACK]
    assert entry.shape == (4, 32, 32) and [(p.start, p.stop) for p in entry.pieces or ()] == \
        [(0, 2), (2, 4)]
    assert merged.totals == Totals.of(merged.tensors, merged.files)


def test_versions_written_before_verify_and_read_as_written_now(old_store, tmp_path):
    """The stored versions verify (every checksum) and read, streamed or whole, as the same bits
    that today's writer stores for the same tensors, with the same manifest up to the times."""
    assert old_store.list_versions() == ["sharded", "whole"]
    new = WeightStore(tmp_path / "new")
    write_fixture(new)
    for vid in ("whole", "sharded"):
        m = old_store.verify_version(vid)
        assert m == old_store.read_manifest(vid) and m.version_id == vid
        assert without_times(m.to_dict()) == without_times(new.read_manifest(vid).to_dict())
        old, now = old_store.read_version(vid), new.read_version(vid)
        streamed = dict(old_store.iter_version(vid))
        assert list(old.tensors) == list(now.tensors) == list(streamed)
        for name, got in old.tensors.items():
            for other in (now[name], streamed[name]):
                if isinstance(got, NVFP4Tensor):
                    assert isinstance(other, NVFP4Tensor) and got.spec == other.spec
                    assert got.shape == other.shape
                    assert torch.equal(got.codes, other.codes)
                    assert torch.equal(got.block_scales.view(torch.uint8),
                                       other.block_scales.view(torch.uint8))
                    assert torch.equal(got.outer_scale.view(torch.int32),
                                       other.outer_scale.view(torch.int32))
                else:
                    assert torch.equal(got.view(torch.int16), other.view(torch.int16))


def test_written_manifest_is_the_file(tmp_path):
    """What write_version and write_part return is what manifest.json holds, byte for byte,
    and what read_manifest gives back."""
    store = WeightStore(tmp_path)
    write_fixture(store)
    for vid in ("whole", "sharded"):
        text = (store.version_path(vid) / "manifest.json").read_text()
        m = store.read_manifest(vid)
        assert json.dumps(m.to_dict(), indent=1) == text
        assert isinstance(m.tensors["model.norm.weight"], TensorEntry)
        assert m.tensors["model.norm.weight"].kind == "raw"
        assert m.spec_of(m.tensors["model.norm.weight"]) is None
        assert m.spec_of(m.tensors[STACK]) == (PRESETS["minite"] if vid == "whole"
                                               else PRESETS["te"])


def _edit(d: dict, path: list, value=None, *, delete: bool = False) -> None:
    for k in path[:-1]:
        d = d[k]
    if delete:
        del d[path[-1]]
    else:
        d[path[-1]] = value


@pytest.mark.parametrize("vid, path, value, field", [
    ("whole", ["totals", "tensors"], None, "totals.tensors"),
    ("whole", ["totals", "stored_bytes"], "12", "totals.stored_bytes"),
    ("whole", ["tensors", STACK, "stored", STACK, "sha256"], 5,
     f"tensors[{STACK!r}].stored[{STACK!r}].sha256"),
    ("whole", ["tensors", STACK, "kind"], "fp8", f"tensors[{STACK!r}].kind"),
    ("whole", ["tensors", STACK, "spec"], "nope", f"tensors[{STACK!r}].spec"),
    ("whole", ["tensors", STACK, "shape"], [2, "32", 32], f"tensors[{STACK!r}].shape[1]"),
    ("whole", ["tensors", "model.norm.weight", "file"], None, "tensors['model.norm.weight'].file"),
    ("whole", ["files", "nvfp4-00001.safetensors", "bytes"], True,
     "files['nvfp4-00001.safetensors'].bytes"),
    ("whole", ["timings"], [], "timings"),
    ("whole", ["specs"], None, "specs"),
    ("sharded", ["tensors", STACK, "pieces", 1, "start"], None, f"tensors[{STACK!r}].pieces[1].start"),
    ("sharded", ["tensors", STACK, "pieces"], [], f"tensors[{STACK!r}].pieces"),
    ("sharded", ["parts", 0, "totals", "files"], 1.5, "parts[0].totals.files"),
])
def test_malformed_manifest_names_the_field(old_store, vid, path, value, field):
    """A missing field or one of the wrong type is a ManifestError whose ``field`` (and message)
    names it; nothing of the version is read."""
    file = old_store.version_path(vid) / "manifest.json"
    raw = json.loads(file.read_text())
    _edit(raw, path, value, delete=value is None)
    file.write_text(json.dumps(raw, indent=1))
    for read in (old_store.read_manifest, old_store.verify_version, old_store.read_version):
        with pytest.raises(ManifestError) as ei:
            read(vid)
        assert ei.value.field == field and field in str(ei.value) and repr(vid) in str(ei.value)
    with pytest.raises(ManifestError, match="not a libalign-nvfp4 manifest of this version"):
        file.write_text(json.dumps({**raw, "version_id": "other"}))
        old_store.read_manifest(vid)
