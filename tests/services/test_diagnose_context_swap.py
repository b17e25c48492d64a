"""Pins the paper's FC1 context swap on the tiny model: row-scaled target rows keep every bit
under companion swaps and padding, the per-tensor-with-RHT reference does not, hashes are
stable across runs."""

import random

import pytest
import torch
from alignclient.errors import ShapeError
from alignd.tools.diagnose.context_swap import (
    PER_TENSOR_RHT,
    fc1_context_swap,
    fc1_context_table,
    gemm_context_swap,
)

from libalign import models

PATHS = ["bf16", "nvfp4_minite", "nvfp4_modelopt_pertoken", "nvfp4_naive"]


@pytest.fixture(scope="module")
def tiny_swap():
    model = models.build_model(models.tiny_config(), seed=0)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 15) for _ in range(n)] for n in (12, 20, 30, 44, 60)]
    kw = dict(batch_size=4, pad_id=0, backend="torch")
    return fc1_context_swap(model, seqs, PATHS, **kw), fc1_context_swap(model, seqs, PATHS, **kw)


def test_row_scaled_targets_bitwise_invariant_per_tensor_rht_changes(tiny_swap):
    rep, _ = tiny_swap
    assert rep["paths"] == ["nvfp4_minite", "nvfp4_modelopt_pertoken", "nvfp4_naive", PER_TENSOR_RHT]
    assert rep["weight_shape"] == [128, 128] and rep["input_shape"] == [128, 128]
    assert rep["independent"]["nvfp4_minite"] and rep["independent"]["nvfp4_modelopt_pertoken"]
    assert not rep["independent"][PER_TENSOR_RHT]
    for case in rep["cases"]:
        for c in case["paths"][PER_TENSOR_RHT]["cases"]:
            if c["context"] == "padded":  # zero companions move the shared amax down
                assert not c["output_equal"] and not c["payload_equal"]
        for c in case["paths"]["nvfp4_minite"]["cases"]:
            assert c["identical"] and c["companions"] + c["padding"] == 120
            assert len(c["row_factors"]) == 8


def test_hashes_stable_and_table_renders(tiny_swap):
    a, b = tiny_swap
    assert a == b
    assert len({c["payload_sha256"] for case in a["cases"]
                for c in case["paths"]["nvfp4_minite"]["cases"]}) == len(a["cases"])
    assert fc1_context_table(a).row_count == len(a["cases"]) * len(a["paths"]) * 4


def test_gemm_context_swap_refuses_bad_shapes():
    x = torch.randn(20, 32)
    with pytest.raises(ShapeError):
        gemm_context_swap(x, torch.randn(5, 16), torch.randn(8, 32), "nvfp4_minite")
    with pytest.raises(ShapeError):
        gemm_context_swap(x[:4], torch.randn(5, 32), torch.randn(8, 32), "nvfp4_minite")
    with pytest.raises(ShapeError):
        gemm_context_swap(x, torch.randn(5, 32), torch.randn(8, 32), "bf16")
