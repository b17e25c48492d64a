"""Pins the FP4 KV cache in SGLang's two formats: the stored bits and reads under per-layer global
scales (KVScales), the sampler's K/V records replayed by the learner, and the typed errors of
missing or non-finite scales, named by layer and field, with nothing stored."""

from __future__ import annotations

import math

import pytest
import torch
from alignclient.errors import NonFiniteError, SpecError

pytest.importorskip("transformers")

from libalign import models
from libalign.guidance import GuidanceTable
from libalign.guidance.sizes import size_for_config
from libalign.models import kv_cache
from libalign.models.kv_cache import KVScales
from libalign.spec import PRESETS, dequantize, quantize
from tests.libalign.test_kv_cache import TASK, _capture

SGLANG_KV = ("kv_sglang_nvfp4", "kv_sglang_fp4_mx_block16")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer tiny Qwen3-MoE (head_dim 32, 2 KV heads)."""
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)


@pytest.mark.parametrize("kv", SGLANG_KV)
def test_cache_stores_each_layers_rows_with_its_global_scale(tiny, kv):
    """Writes are quantized row by row with the layer's K or V global scale (kv_sglang_nvfp4)
    and read back as the spec dequantizes them; the stored outer scale of every row is the
    layer's scale."""
    spec = PRESETS[kv]
    scales = KVScales((0.01, 0.02), (0.03, 0.5), "calibration") if spec.outer_source == "given" \
        else None
    g = torch.Generator().manual_seed(3)
    with kv_cache.use_kv_format(tiny, kv, scales):
        cache = kv_cache.FP4KVCache(tiny)
        for layer in (0, 1):
            k = (torch.randn(2, 2, 5, 32, generator=g) * 4).to(torch.bfloat16)
            v = torch.randn(2, 2, 5, 32, generator=g).to(torch.bfloat16)
            rk, rv = cache.update(k, v, layer)
            for site, x, got in (("k", k, rk), ("v", v, rv)):
                rows = x.reshape(-1, 32)
                kw = {} if scales is None else \
                    {"outer_scale": torch.full((20,), scales.scale(layer, site))}
                q = quantize(rows, spec, **kw)
                assert torch.equal(got, dequantize(q, torch.bfloat16).reshape(x.shape))
                stored = cache.layers[layer].bits[site]
                assert torch.equal(stored[0].reshape(20, -1), q.codes)
                if scales is not None:
                    assert bool((stored[2] == scales.scale(layer, site)).all())


@pytest.mark.parametrize("kv", SGLANG_KV)
def test_learner_follows_the_samplers_sglang_kv_codes(tiny, kv):
    """The sampler's K/V records in an SGLang format (b=1) steer the learner's teacher-forced K/V:
    every code within one grid step equals the sampler's, and fewer differ than unguided; the
    records name the format and their K/V part is what size_for_config counts."""
    r, cap = _capture(tiny, kv, 1)
    recs = cap.records(1)
    assert {rec.kv_spec for rec in recs.values()} == {kv}
    reference = GuidanceTable(cap.records(4))
    counts = {}
    with kv_cache.use_kv_format(tiny, kv):
        for mode, rr in (("rtn", None), ("guided", recs)):
            agr = models.KVAgreement()
            with models.use_kv_guidance(tiny, rr), models.count_kv_agreement(tiny, reference, agr):
                models.score_sequences(tiny, r.sequences, r.prompt_lens, "nvfp4_minite",
                                       pad_id=TASK.pad_id)
            counts[mode] = agr
    g, rtn = counts["guided"], counts["rtn"]
    assert g.total(g.near_mismatched) == 0
    assert g.total(g.mismatched) <= rtn.total(rtn.mismatched)
    size = size_for_config(tiny.config, bits=1, sites=(), kv=True, kv_spec=kv)
    assert size["kv"] == 2 * (2 * 2 * 32 * (1 / 8 + 1 / 16) + 2 * 2 * 10)  # layers, K+V heads


def test_scales_missing_or_nonfinite_are_refused_by_layer_and_field(tiny):
    """A NaN, Inf, zero or missing global scale names its layer and field (NonFiniteError /
    SpecError); scales for another layer count, or for a format that takes none, are refused;
    nothing is set on the model."""
    with pytest.raises(NonFiniteError, match="layer 1 v_scale"):
        KVScales((0.1, 0.1), (0.1, math.nan), "checkpoint")
    with pytest.raises(NonFiniteError, match="layer 0 k_scale"):
        KVScales((0.0, 0.1), (0.1, 0.1), "checkpoint")
    with pytest.raises(SpecError, match="layer 0 k_scale: missing"):
        KVScales((None, 0.1), (0.1, 0.1), "checkpoint")
    with pytest.raises(SpecError, match="layer 1 k_scale/v_scale"):
        kv_cache.set_kv_format(tiny, "kv_sglang_nvfp4", KVScales.default(1))
    with pytest.raises(SpecError, match="takes no k_scale"):
        kv_cache.set_kv_format(tiny, "kv_nvfp4", KVScales.default(2))
    assert kv_cache.kv_state(tiny) is None


def test_scales_from_checkpoint_and_calibration():
    """from_checkpoint takes SGLang's rule (1.0 where absent, x6 on SM100 unless 1.0);
    calibrate takes fl(amax / 2688); both round trip through to_dict."""
    s = KVScales.from_checkpoint({0: 0.5, 1: None}, {0: 1.0}, 2, sm100=True)
    assert s.k == (3.0, 1.0) and s.v == (1.0, 1.0) and s.source == "checkpoint"
    c = KVScales.calibrate([2688.0, 0.0], [26.88, 1.0])
    assert c.k == (1.0, 1.0) and c.v[0] == float(torch.tensor(26.88 / 2688, dtype=torch.float32))
    assert KVScales.from_dict(c.to_dict()) == c
