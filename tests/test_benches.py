"""Benchmarks run at a tiny size on the CPU: they finish, and what they print and write holds
every figure with a sane value. No timing is asserted (speed goals are the benchmarks' own
output, measured against a baseline in the same run)."""

from __future__ import annotations

import json

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
