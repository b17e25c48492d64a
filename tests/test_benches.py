"""Benchmarks run at a tiny size on the CPU: they finish, and what they print and write holds
every figure with a sane value. No timing is asserted (speed goals are the benchmarks' own
output, measured against a baseline in the same run)."""

from __future__ import annotations

import json

import pytest

from tests.bench import bench_refit


def test_refit_bench_reports_both_refits(tmp_path, capsys):
    """The refit bench, two experts and 4 MiB buckets: both refits reach the server process
    intact, the NVFP4 one moves fewer bytes, and every figure and goal is reported."""
    out = tmp_path / "refit.json"
    status = bench_refit.main(["--device", "cpu", "--layers", "1", "--experts", "2",
                               "--bucket-mb", "4", "--repeats", "1", "--json", str(out)])
    assert status == 0
    res = json.loads(out.read_text())
    assert res["layers"] == 1 and res["experts"] == 2 and res["bucket_bytes"] == 4 << 20
    bf16, nvfp4 = res["refits"]["bf16"], res["refits"]["nvfp4"]
    for r in (bf16, nvfp4):
        assert r["wall_s"] > 0 and r["produce_s"] > 0 and r["send_s"] > 0
        assert r["buckets"] >= 2 and r["tensors"] > 0
        assert r["scaled_48_layers_s"] > r["per_layer_s"]
        assert r["peak_extra_buckets"] is None  # measured on a GPU only
    # 9 attention/norm/router tensors and 3 expert projections x 2 experts; NVFP4 splits each
    # projection into codes, block scales and row scales
    assert bf16["tensors"] == 9 + 6 and nvfp4["tensors"] == 9 + 18
    assert 0 < nvfp4["bytes"] < bf16["bytes"]
    assert res["bytes_ratio"] == nvfp4["bytes"] / bf16["bytes"]
    assert res["ratio"] > 0 and res["ratio_paired"] > 0
    assert all(res["checks"].values()) and res["ok"]
    assert set(res["goals"]) == {"nvfp4_over_bf16_time", "peak_extra_buckets"}
    printed = capsys.readouterr().out
    assert "NVFP4/BF16 refit time" in printed and "goals (not asserted)" in printed


def test_redis_cluster_bench_reports_both_topologies(tmp_path, capsys):
    """``python -m tests.bench redis_cluster`` at a tiny size (2 versions of 2 records of 4 KiB,
    4 shards, each node capped at 4 MB): one node and a 3-master cluster both put, read back
    and fill until Redis refuses; every figure is there and positive, and the run's servers and
    working directory are gone after it."""
    from tests.bench.__main__ import run
    from tests.services.conftest import REDIS_SERVER
    from tests.services.redis_topologies import REDIS_CLI

    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed")
    status = run(["redis_cluster"], ["--versions", "2", "--rollouts", "2", "--record-bytes",
                                     "4096", "--fill-bytes", "65536", "--shards", "4",
                                     "--maxmemory", "4mb", "--repeats", "1",
                                     "--out", str(tmp_path)])
    assert status == 0
    res = json.loads((tmp_path / "bench_redis_cluster.json").read_text())
    assert res["masters"] == 3 and res["shards"] == 4 and res["maxmemory_per_node"] == "4mb"
    for topo in ("one_node", "cluster"):
        r = res[topo]
        assert r["put_MBps"] > 0 and r["get_MBps"] > 0 and r["bytes"] == 2 * 2 * 4096
        assert r["capacity_bytes"] > 0 and r["capacity_bytes"] % (2 * 65536) == 0
    assert res["ratio_capacity"] == res["cluster"]["capacity_bytes"] / \
        res["one_node"]["capacity_bytes"]
    assert res["ratio_put"] > 0 and res["ratio_get"] > 0
    printed = capsys.readouterr().out
    assert "cluster / one node" in printed and "bench_redis_cluster: ok" in printed
