"""Pins localization against the sampler's own KV-cached decode: same-path pairs are measured,
a site the decode reproduces bit for bit reports a residual of exactly 0."""

import random

import pytest
from alignd.tools.diagnose.conditions import Condition
from alignd.tools.diagnose.decode_localize import decode_capture, localize_decode

from libalign import models


@pytest.fixture(scope="module")
def tiny():
    return models.build_model(models.tiny_config(), seed=0)


def _seqs():
    rng = random.Random(1)
    return [[rng.randrange(3, 15) for _ in range(n)] for n in (9, 14)], [4, 6]


def test_same_path_pairs_are_measured(tiny):
    seqs, plens = _seqs()
    conds = [Condition("bf16", "bf16"), Condition("nvfp4_minite", "nvfp4_minite"),
             Condition("bf16", "nvfp4_minite")]
    rows = localize_decode(tiny, seqs, plens, conds, layers=[0, 3], pad_id=0, backend="torch")
    assert {(r["condition"], r["layer"]) for r in rows} == {(c.name, x) for c in conds for x in (0, 3)}
    for r in rows:
        for site, key in (("hidden_in", "hidden_in_rel_l2"), ("moe_out", "moe_out_rel_l2")):
            assert (r[key] == 0.0) == r["bitwise"][site]
    first = {r["condition"]: r for r in rows if r["layer"] == 0}
    # the layer-0 input is the embedding: the decode reproduces it on every path
    assert first["bf16/bf16"]["bitwise"]["hidden_in"] and first["bf16/bf16"]["hidden_in_rel_l2"] == 0.0
    assert first["bf16/nvfp4_minite"]["fc1_rel_l2"] > 0


def test_decode_capture_covers_all_fed_tokens(tiny):
    seqs, plens = _seqs()
    cap = decode_capture(tiny, seqs[1], plens[1], "bf16", [0], pad_id=0, backend="torch")
    k = tiny.config.num_experts_per_tok
    assert cap[0]["hidden_in"].shape[0] == len(seqs[1]) - 1
    assert cap[0]["fc1_out"].shape[0] == (len(seqs[1]) - 1) * k
