"""Pins sharded versions: parts written by several ranks read back bit-identical to the
unsharded conversion, the version is invisible until its last part, concurrent commits
agree, bad parts are refused by name, and a rank SIGKILLed mid-part never shows a torn
version and can simply be run again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from alignclient.errors import (
    InputError,
    ManifestError,
    NonFiniteError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignd.formats.manifest import Manifest, PartInfo
from alignd.formats.sharded_version import (
    Piece,
    commit_version,
    part_dir_name,
    part_status,
    staging_path,
    write_part,
)
from alignd.formats.weight_store import WeightStore, scalar_outer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libalign.atomic_dir import TMP_PREFIX
from libalign.spec import PRESETS, NVFP4Tensor, shared_outer_amax

REPO = Path(__file__).resolve().parents[2]

SPECS = {
    "row": PRESETS["minite"],
    "expert": PRESETS["torchao"],
    "tensor": PRESETS["modelopt"],
    "none": PRESETS["minite"].replace(name="minite_none", outer_domain="none"),
}
RAW = ("model.norm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
ROUTER = "model.layers.0.mlp.gate.weight"
#: sliced by every rank along dim 0; the other tensors are written whole by part 0
PIECED = (GATE_UP, DOWN, O_PROJ, ROUTER)


def select(name: str, t: torch.Tensor) -> bool:
    """Quantize everything but the norm, the embedding and the router."""
    return name not in RAW


def make_state(experts: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small BF16 expert stacks [E, 2I, H] / [E, H, I] (each expert its own magnitude) and raws."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor([0.01 * (e + 1) for e in range(experts)]).reshape(-1, 1, 1)
    return {
        "model.embed_tokens.weight": torch.randn(20, 64, generator=g).to(torch.bfloat16),
        GATE_UP: (torch.randn(experts, 32, 64, generator=g) * mag).to(torch.bfloat16),
        DOWN: (torch.randn(experts, 64, 16, generator=g) * mag).to(torch.bfloat16),
        O_PROJ: torch.randn(48, 64, generator=g).to(torch.bfloat16),
        ROUTER: torch.randn(experts, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
    }


def even_cuts(total: int, n: int) -> list[int]:
    """Boundaries [0, ..., total] of n near-equal slices."""
    return [total * i // n for i in range(n + 1)]


def split(state: dict[str, torch.Tensor], spec, n: int,
          cuts: dict[str, list[int]] | None = None) -> list[dict[str, object]]:
    """Each rank's input: its Piece of every PIECED tensor (none if its slice is empty);
    part 0 also holds the whole tensors. Scalar-outer pieces carry the whole tensor's amax,
    as an all-reduce across ranks would give them."""
    parts: list[dict[str, object]] = [{} for _ in range(n)]
    for name, t in state.items():
        if name not in PIECED:
            parts[0][name] = t
            continue
        c = (cuts or {}).get(name) or even_cuts(t.shape[0], n)
        amax = (shared_outer_amax([t], spec)
                if select(name, t) and scalar_outer(spec, t.ndim) else None)
        for i in range(n):
            if c[i + 1] > c[i]:
                parts[i][name] = Piece(t[c[i]:c[i + 1]], c[i], t.shape[0], amax)
    return parts


def assert_same_bits(got, ref, name: str) -> None:
    """NVFP4 tensors: codes, block scales, outer scale, shape and spec equal bit for bit."""
    if isinstance(ref, NVFP4Tensor):
        assert isinstance(got, NVFP4Tensor), name
        assert torch.equal(got.codes, ref.codes), name
        assert torch.equal(got.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8)), name
        assert (got.outer_scale is None) == (ref.outer_scale is None), name
        if ref.outer_scale is not None:
            assert got.outer_scale.shape == ref.outer_scale.shape, name
            assert torch.equal(got.outer_scale.view(torch.int32), ref.outer_scale.view(torch.int32)), name
        assert got.shape == ref.shape and got.spec == ref.spec, name
    else:
        assert got.dtype == ref.dtype and torch.equal(got, ref), name


def assert_version_equal(store: WeightStore, vid: str, ref: dict) -> None:
    sv = store.read_version(vid)
    assert list(sv.tensors) == list(ref) or set(sv.tensors) == set(ref)
    for name, r in ref.items():
        assert_same_bits(sv[name], r, name)


def reference(store: WeightStore, state, spec) -> dict:
    """The unsharded conversion, read back."""
    store.write_version("ref", state, spec, select=select)
    return store.read_version("ref").tensors


def no_staging_leftovers(store: WeightStore) -> None:
    assert not [p for p in store.versions_root.iterdir() if p.name.startswith(TMP_PREFIX)]


@pytest.mark.parametrize("domain", list(SPECS))
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_read_back_is_bit_identical_to_unsharded(tmp_path, domain, n):
    """row / expert / tensor (amax given) / none: N parts, written in reverse order, read
    back equal to write_version of the whole tensors; pieces recorded and tiled."""
    store = WeightStore(tmp_path)
    spec, state = SPECS[domain], make_state()
    ref = reference(store, state, spec)
    parts = split(state, spec, n)
    results = {i: write_part(store, "v", i, n, parts[i], spec, select=select, shard_bytes=3000)
               for i in reversed(range(n))}
    assert [results[i].committed for i in range(n)] == [True] + [False] * (n - 1)
    assert_version_equal(store, "v", ref)
    m = store.read_manifest("v")
    assert m.format_version == 2 and m.num_parts == n and len(m.parts) == n
    assert [p.start for p in m.tensors[GATE_UP].pieces] == even_cuts(6, n)[:-1]
    assert m.tensors[GATE_UP].shape == (6, 32, 64) and m.tensors["model.norm.weight"].file
    assert all(f.startswith("part-") for f in m.files)
    assert m.totals.source_bytes == sum(t.numel() * 2 for t in state.values())
    assert m.totals.stored_bytes == sum(r.stored_bytes for r in results.values())
    assert results[0].version_manifest == m
    store.verify_version("v")
    assert store.list_versions() == ["ref", "v"]
    no_staging_leftovers(store)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), domain=st.sampled_from(["row", "tensor", "expert"]), n=st.integers(2, 3))
def test_any_split_points_give_the_same_bits(data, domain, n):
    """Random cut points (empty slices included: that rank holds no piece) change nothing."""
    spec, state = SPECS[domain], make_state(seed=3)
    cuts = {}
    for name in PIECED:
        total = state[name].shape[0]
        inner = sorted(data.draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
        cuts[name] = [0, *inner, total]
    with tempfile.TemporaryDirectory() as d:
        store = WeightStore(d)
        ref = reference(store, state, spec)
        for i, p in enumerate(split(state, spec, n, cuts)):
            write_part(store, "v", i, n, p, spec, select=select)
        assert_version_equal(store, "v", ref)


def test_invisible_until_the_last_part_and_sweep_spares_young_staging(tmp_path):
    """Parts 0..N-2 written: not listed, has_version False, read raises, status names the
    missing part, a sweep keeps the young staging dir; after the last part: visible."""
    store = WeightStore(tmp_path)
    spec, state = SPECS["row"], make_state()
    parts = split(state, spec, 3)
    for i in (0, 1):
        r = write_part(store, "v", i, 3, parts[i], spec, select=select)
        assert not r.committed and r.version_manifest is None
        assert r.manifest.part == PartInfo(index=i, num_parts=3) and r.seconds > 0
        assert r.source_bytes > 0 and r.stored_bytes > 0
    assert store.list_versions() == [] and not store.has_version("v")
    with pytest.raises(VersionNotFoundError):
        store.read_version("v")
    assert part_status(store, "v", 3) == {"present": [0, 1], "missing": [2], "committed": False}
    assert commit_version(store, "v", 3) is None
    with pytest.raises(VersionExistsError, match="part 1 of 3"):
        write_part(store, "v", 1, 3, parts[1], spec, select=select)
    assert store.sweep(min_age_s=600) == [] and staging_path(store, "v", 3).is_dir()
    r = write_part(store, "v", 2, 3, parts[2], spec, select=select)
    assert r.committed and store.list_versions() == ["v"] and store.has_version("v")
    assert part_status(store, "v", 3) == {"present": [0, 1, 2], "missing": [], "committed": True}
    assert commit_version(store, "v", 3) == store.read_manifest("v") == r.version_manifest
    with pytest.raises(VersionExistsError):
        write_part(store, "v", 0, 3, parts[0], spec, select=select)
    no_staging_leftovers(store)


def test_stale_staging_is_swept(tmp_path):
    """A staging dir of ranks that never finished goes with an old enough sweep."""
    store = WeightStore(tmp_path)
    write_part(store, "v", 0, 2, {"a": torch.ones(16, 16)}, SPECS["row"])
    staging = staging_path(store, "v", 2)
    assert store.sweep(min_age_s=0) == [staging] and not staging.exists()


def test_concurrent_commits_agree(tmp_path):
    """Two threads commit at once (10 rounds): same manifest, one version, no staging or
    temporary manifest left; two ranks finishing at once through write_part as well."""
    store = WeightStore(tmp_path)
    spec, state = SPECS["row"], make_state(experts=4)
    parts = split(state, spec, 2)
    for k in range(10):
        vid = f"v{k}"
        for i in range(2):
            write_part(store, vid, i, 2, parts[i], spec, select=select, commit=False)
        barrier, out = threading.Barrier(2), [None, None]

        def commit(j: int, vid: str = vid, barrier: threading.Barrier = barrier,
                   out: list = out) -> None:
            barrier.wait()
            out[j] = commit_version(store, vid, 2)

        threads = [threading.Thread(target=commit, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out[0] is not None and out[0] == out[1] == store.read_manifest(vid)
        assert sorted(os.listdir(store.version_path(vid))) == [
            "manifest.json", part_dir_name(0, 2), part_dir_name(1, 2)]
    barrier, res = threading.Barrier(2), [None, None]

    def rank(i: int) -> None:
        barrier.wait()
        res[i] = write_part(store, "both", i, 2, parts[i], spec, select=select)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert any(r.committed for r in res)
    assert store.list_versions() == ["both"] + [f"v{k}" for k in range(10)]
    assert_version_equal(store, "both", reference(store, state, spec))
    no_staging_leftovers(store)


def assert_nothing_torn(store: WeightStore, vid: str, n: int) -> None:
    """Not visible; any part dir present is complete; no hidden leftovers in staging."""
    assert store.list_versions() == [] and not store.has_version(vid)
    with pytest.raises(VersionNotFoundError):
        store.read_version(vid)
    staging = staging_path(store, vid, n)
    if staging.exists():
        for p in staging.iterdir():
            assert not p.name.startswith("."), p
            assert (p / "manifest.json").is_file(), p


def test_refused_pieces_and_parts_name_the_problem(tmp_path):
    """Piece without outer_amax under the tensor domain, gap, overlap, whole tensor twice,
    differing specs, bad part indices, NaN in a piece: typed errors naming the tensor or
    part, and nothing visible or half-written afterwards."""
    t = torch.randn(6, 32, 64).to(torch.bfloat16)
    row, ten = SPECS["row"], SPECS["tensor"]

    def two_parts(vid, p0, p1, spec0=row, spec1=row):
        store = WeightStore(tmp_path / vid)
        write_part(store, vid, 0, 2, p0, spec0)
        try:
            write_part(store, vid, 1, 2, p1, spec1)
        finally:
            assert_nothing_torn(store, vid, 2)

    store = WeightStore(tmp_path / "amax")
    with pytest.raises(InputError, match="'x' is a Piece without outer_amax"):
        write_part(store, "a", 0, 2, {"x": Piece(t[:3], 0, 6)}, ten)
    assert_nothing_torn(store, "a", 2)
    with pytest.raises(ManifestError, match=r"'x'.*gap at row 2"):
        two_parts("gap", {"x": Piece(t[:2], 0, 6)}, {"x": Piece(t[3:], 3, 6)})
    with pytest.raises(ManifestError, match=r"'x'.*overlap"):
        two_parts("overlap", {"x": Piece(t[:4], 0, 6)}, {"x": Piece(t[3:], 3, 6)})
    with pytest.raises(ManifestError, match=r"'x'.*end at row 5"):
        two_parts("short", {"x": Piece(t[:3], 0, 6)}, {"x": Piece(t[3:5], 3, 6)})
    with pytest.raises(ManifestError, match=r"'w' is written by part 1 and by part 0"):
        two_parts("twice", {"w": t}, {"w": t})
    with pytest.raises(ManifestError, match=r"'x'.*whole tensor in part 0 and a piece"):
        two_parts("mixed", {"x": t}, {"x": Piece(t[3:], 3, 6)})
    with pytest.raises(ManifestError, match=r"'x'.*differs"):
        two_parts("specs", {"x": Piece(t[:3], 0, 6)}, {"x": Piece(t[3:], 3, 6)}, row, SPECS["expert"])
    store = WeightStore(tmp_path / "idx")
    for part, n in ((2, 2), (-1, 2), (0, 0), (True, 2)):
        with pytest.raises(InputError, match="version 'i'"):
            write_part(store, "i", part, n, {"w": t}, row)
    with pytest.raises(InputError, match=r"rows \[4, 7\) do not fit"):
        write_part(store, "i", 0, 2, {"x": Piece(t[:3], 4, 6)}, row)
    assert_nothing_torn(store, "i", 2)
    bad = t.clone()
    bad[4, 1, 2] = float("nan")
    store = WeightStore(tmp_path / "nan")
    with pytest.raises(NonFiniteError) as ei:
        write_part(store, "n", 1, 2, {"ok": t, "x": Piece(bad[3:], 3, 6)}, row, shard_bytes=100)
    assert ei.value.tensor == "x" and "'x'" in str(ei.value)
    assert_nothing_torn(store, "n", 2)
    assert part_status(store, "n", 2)["present"] == []


CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import safetensors.torch
    from libalign.spec import PRESETS
    from alignd.formats.sharded_version import Piece, write_part
    from alignd.formats.weight_store import WeightStore
    root, vid, part, n, inputs, meta, kill = sys.argv[1:8]
    tensors = safetensors.torch.load_file(inputs)
    meta = json.loads(meta)
    items = {k: Piece(t, *meta["pieces"][k]) if k in meta["pieces"] else t
             for k, t in tensors.items()}

    def on_step(what):
        if kill == "1" and what.startswith("shard "):
            os.kill(os.getpid(), signal.SIGKILL)

    r = write_part(WeightStore(root), vid, int(part), int(n), items, PRESETS["minite"],
                   select=lambda name, t: name not in meta["raw"], shard_bytes=2000,
                   on_step=on_step)
    print(json.dumps({"committed": r.committed}))
""")


def test_rank_killed_mid_part_never_tears_the_version(tmp_path):
    """Two rank processes; rank 1 SIGKILLs itself right after its first shard. A reader
    polling all along never sees a torn version; rank 0's part is intact; the version is
    invisible until rank 1 runs again, then commits bit-identical to the unsharded one."""
    store = WeightStore(tmp_path / "store")
    spec, state = SPECS["row"], make_state()
    ref = reference(WeightStore(tmp_path / "refstore"), state, spec)
    parts = split(state, spec, 2)
    procs = []
    for i, p in enumerate(parts):
        inputs = tmp_path / f"part{i}.safetensors"
        safetensors.torch.save_file(
            {k: (v.tensor if isinstance(v, Piece) else v).contiguous() for k, v in p.items()}, inputs)
        meta = {"raw": list(RAW),
                "pieces": {k: [v.start, v.total] for k, v in p.items() if isinstance(v, Piece)}}
        procs.append([sys.executable, "-c", CHILD, str(store.root), "v", str(i), "2", str(inputs),
                      json.dumps(meta), "1" if i == 1 else "0"])

    stop, seen, problems = threading.Event(), [], []

    def reader() -> None:
        while True:
            last = stop.is_set()  # one more poll after stop, so the final state is seen
            try:
                listed = store.list_versions()
                if listed not in ([], ["v"]):
                    problems.append(f"listed {listed}")
                if listed:
                    sv = store.read_version("v")
                    for name, r in ref.items():
                        assert_same_bits(sv[name], r, name)
                    seen.append(True)
            except Exception as e:  # any failure here is a torn read
                problems.append(repr(e))
            if last:
                return

    th = threading.Thread(target=reader)
    th.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        running = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for cmd in procs]
        outs = [p.communicate(timeout=120) for p in running]
        assert running[0].returncode == 0, outs[0][1][-3000:]
        assert running[1].returncode == -signal.SIGKILL, outs[1][1][-3000:]
        assert json.loads(outs[0][0]) == {"committed": False}
        assert store.list_versions() == [] and not store.has_version("v")
        assert part_status(store, "v", 2) == {"present": [0], "missing": [1], "committed": False}
        staging = staging_path(store, "v", 2)
        leftovers = [p for p in staging.iterdir() if p.name.startswith(TMP_PREFIX)]
        assert len(leftovers) == 1 and list(leftovers[0].glob("nvfp4-*.safetensors"))
        assert not (leftovers[0] / "manifest.json").exists()
        part0 = staging / part_dir_name(0, 2)
        m0 = Manifest.from_dict(json.loads((part0 / "manifest.json").read_text()))
        assert len(m0.files) >= 3
        for fname, expected in WeightStore._by_file(m0).items():
            store._load_file("v", part0, fname, expected, verify=True)
        # rank 1 runs again
        r = write_part(store, "v", 1, 2, parts[1], spec, select=select, shard_bytes=2000)
        assert r.committed
    finally:
        stop.set()
        th.join(60)
    assert not problems, problems[:5]
    assert seen  # the reader saw the committed version at least once
    assert store.list_versions() == ["v"]
    assert_version_equal(store, "v", ref)
    assert not [p for p in store.version_path("v").iterdir() if p.name.startswith(".")]
    no_staging_leftovers(store)


@pytest.fixture
def two_ranks(monkeypatch):
    """publish_sharded on two expert-parallel ranks in this process: ``place[0]`` is the
    rank that calls next; its items are its share of :func:`make_state` (no Megatron model)."""
    from alignd.sync import sharded

    place = [0]
    parts = split(make_state(), PRESETS["minite"], 2)
    monkeypatch.setattr(sharded, "expert_parallel_place", lambda: (place[0], 2, None, True))
    monkeypatch.setattr(sharded, "local_items",
                        lambda model, cfg, spec, *, ep_rank, group=None: iter(
                            parts[ep_rank].items()))
    return place


class ShardedEngine:
    """A learner engine converting its own weights as the expert-parallel one does: every
    rank's :func:`~alignd.sync.sharded.publish_sharded`, with what the loop passes."""

    path = "bf16"

    def __init__(self, place):
        self.place = place

    def publish_converted(self, store, version_id, spec, *, quantize=True, kv_format=None,
                          kv_scales=None):
        from alignd.sync.sharded import publish_sharded

        for rank in (1, 0):
            self.place[0] = rank
            publish_sharded(None, None, store, version_id, spec, quantize=quantize,
                            device="cpu", kv_format=kv_format, kv_scales=kv_scales)


def test_sharded_version_names_the_samplers_kv_format(redis_url, tmp_path, two_ranks):
    """A learner publishing sharded versions for an SGLang KV sampler path writes the same
    extra["kv"] as the converter (kv_manifest: format, --kv-cache-dtype, the kv_scales_file
    scales), which a KV sampler's check accepts; scales given to a format that takes none are
    refused before any part is written."""
    from alignclient.errors import SpecError
    from alignd.formats.convert import check_kv_manifest, kv_manifest
    from alignd.infra.bus import RedisBus
    from alignd.infra.settings import LearnerSettings
    from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
    from alignd.sync.sharded import publish_sharded

    from libalign.models.kv_cache import KVScales

    scales = KVScales((0.0123, 0.0371), (0.3, 0.17), "calibration")
    scales_file = tmp_path / "kv_scales.json"
    scales_file.write_text(json.dumps(scales.to_dict()))
    store = WeightStore(tmp_path / "store")
    loops = {}
    for path in ("nvfp4_minite_kv_sglang_nvfp4", "nvfp4_minite_kv_sglang_fp4_mx_block16",
                 "nvfp4_minite"):
        settings = LearnerSettings(redis_url=redis_url, store_dir=store.root,
                                   sampler_path=path, kv_scales_file=scales_file)
        bus = RedisBus.from_settings(settings)
        loops[path] = LearnerLoop(settings, ShardedEngine(two_ranks),
                                  LoopParts.build(settings, bus=bus, stores=False),
                                  RolloutPlan(prompts=lambda n: [[1]] * n,
                                              reward=lambda p, c: 0.0, sampler_path=path,
                                              run_id=path))
    kv = {path: store.read_manifest(loop.publish(1)).extra.get("kv")
          for path, loop in loops.items()}
    assert kv["nvfp4_minite_kv_sglang_nvfp4"] == kv_manifest("kv_sglang_nvfp4", scales)
    assert kv["nvfp4_minite_kv_sglang_fp4_mx_block16"] == kv_manifest("kv_sglang_fp4_mx_block16")
    assert kv["nvfp4_minite"] is None
    extra = store.read_manifest("nvfp4_minite_kv_sglang_nvfp4-00001").extra
    assert extra["quantized"] and check_kv_manifest(extra, "kv_sglang_nvfp4") == scales
    with pytest.raises(SpecError, match="takes no k_scale"):
        publish_sharded(None, None, store, "bad", PRESETS["minite"], device="cpu",
                        kv_format="kv_sglang_fp4_mx_block16", kv_scales=scales)
    assert not store.has_version("bad") and not staging_path(store, "bad", 2).exists()
