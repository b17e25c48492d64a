"""Pins the FP4 KV cache and KV guidance: the KV presets' bits, the cache's stored bits and reads
bitwise against the spec (both presets, prefill and decode writes), the straight-through
backward, K/V records (round trip, sizes), the learner's K/V codes equal to the sampler's
within one grid step, and records for another version/layer count/head count/head size/bit
width/format refused by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from alignclient.errors import GuidanceMismatchError, GuidanceRecordError, SpecError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from libalign import models
from libalign.guidance import GuidanceCapture, GuidanceRecord, GuidanceTable
from libalign.guidance.sizes import size_for_config, size_per_token, trace_reference_size
from libalign.kernels import ops
from libalign.models import kv_cache
from libalign.spec import PRESETS, dequantize, quantize

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KV = ("kv_nvfp4", "kv_mxfp4")
TASK = models.SyntheticTask()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer tiny Qwen3-MoE (head_dim 32, 2 KV heads)."""
    return models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)


# --- presets and the cache against the spec ----------------------------------------------------

@pytest.mark.parametrize(("kv", "base"), [("kv_nvfp4", "minite"), ("kv_mxfp4", "mxfp4")])
def test_kv_presets_are_their_base_formats_bits(kv, base):
    """kv_nvfp4 quantizes as minite (row-scaled NVFP4), kv_mxfp4 as mxfp4, through ops = spec."""
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    got = ops.quantize(x, PRESETS[kv])
    assert got.bitwise_equal(quantize(x, PRESETS[kv]))
    assert torch.equal(got.codes, quantize(x, PRESETS[base]).codes)
    assert torch.equal(got.block_scales.view(torch.uint8),
                       quantize(x, PRESETS[base]).block_scales.view(torch.uint8))


@SETTINGS
@given(st.sampled_from(KV), st.integers(1, 3), st.integers(1, 3), st.lists(st.integers(1, 5),
       min_size=1, max_size=3), st.sampled_from([torch.bfloat16, torch.float32]),
       st.integers(0, 999))
def test_cache_stores_and_reads_the_spec_bits(kv, b, h, writes, dtype, seed):
    """Each write is quantized row by row (one row = one token of one head) exactly as the spec
    does; a read returns every row written so far, dequantized by the spec, in write order."""
    model = models.build_model(models.tiny_config(num_hidden_layers=1), seed=0)
    spec = PRESETS[kv]
    g = torch.Generator().manual_seed(seed)
    with kv_cache.use_kv_format(model, kv):
        cache = kv_cache.FP4KVCache(model)
        ks, vs = [], []
        for t in writes:
            k = (torch.randn(b, h, t, 32, generator=g) * 4).to(dtype)
            v = (torch.randn(b, h, t, 32, generator=g)).to(dtype)
            ks.append(k)
            vs.append(v)
            rk, rv = cache.update(k, v, 0)
            for got, parts in ((rk, ks), (rv, vs)):
                full = torch.cat(parts, dim=2)
                rows = full.reshape(-1, 32)  # [b, h, t] rows: each is its own scale domain
                ref = dequantize(quantize(rows, spec), dtype).reshape(full.shape)
                assert got.dtype == dtype and torch.equal(got, ref)
        assert cache.get_seq_length() == sum(writes)
        codes = cache.layers[0].bits["k"][0]
        want = torch.cat([quantize(k.reshape(-1, 32), spec).codes.reshape(b, h, k.shape[2], 16)
                          for k in ks], dim=2)
        assert torch.equal(codes, want)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cache_reads_are_the_spec_dequantization(kv, dtype):
    """dequantize_kv (kv_nvfp4: one table gather, then the row's decode scale) is
    spec.dequantize bit for bit, on zero rows, tiny and huge rows, -0.0 and odd head sizes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(-1)
    x[0] = 0.0
    x[1, ::3] = -0.0
    x[2] = torch.finfo(torch.float16).max / 7
    for rows in (x, x[:, :48]) if kv == "kv_nvfp4" else (x,):
        q = quantize(rows.to(torch.float32), PRESETS[kv])
        got = kv_cache.dequantize_kv(q, dtype)
        assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got,
                           dequantize(q, dtype).view(torch.uint8) if dtype != torch.float32
                           else dequantize(q, dtype))


def test_straight_through_backward():
    """With autograd, the read is the FP4 values forward and the identity backward."""
    model = models.build_model(models.tiny_config(num_hidden_layers=1), seed=0)
    with kv_cache.use_kv_format(model, "kv_nvfp4"):
        k = torch.randn(1, 2, 5, 32, requires_grad=True)
        v = torch.randn(1, 2, 5, 32, requires_grad=True)
        rk, rv = kv_cache.FP4KVCache(model).update(k, v, 0)
        w = torch.randn_like(rk)
        (rk * w + rv).sum().backward()
    assert torch.equal(k.grad, w) and torch.equal(v.grad, torch.ones_like(v))
    assert torch.equal(rk.detach(), dequantize(quantize(k.detach().reshape(-1, 32),
                                                        PRESETS["kv_nvfp4"])).reshape(k.shape))


def test_decode_reads_the_fp4_cache_and_formats_are_checked(tiny):
    """A KV format changes the sampler's log-probs (its attention reads FP4 K/V); without one the
    stock cache serves; a non-KV preset or a head size MXFP4 cannot block is refused."""
    prompts = TASK.prompts(3, 0)
    kw = dict(max_new_tokens=4, eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    plain = models.generate(tiny, prompts, "bf16", **kw)
    with kv_cache.use_kv_format(tiny, "kv_nvfp4"):
        fp4 = models.generate(tiny, prompts, "bf16", **kw)
    again = models.generate(tiny, prompts, "bf16", **kw)
    assert [t.tolist() for t in again.logprobs] == [t.tolist() for t in plain.logprobs]
    assert any(not torch.equal(a, b) for a, b in zip(fp4.logprobs, plain.logprobs, strict=True))
    assert models.kv_format(tiny) is None
    with pytest.raises(SpecError, match="KV format"):
        models.set_kv_format(tiny, "minite")
    odd = models.build_model(models.tiny_config(num_hidden_layers=1, head_dim=48), seed=0)
    with pytest.raises(SpecError, match="multiple of 32"):
        models.set_kv_format(odd, "kv_mxfp4")


# --- records ------------------------------------------------------------------------------------

def _capture(model, kv, bits, prompts=None, path="nvfp4_minite"):
    prompts = prompts or TASK.prompts(6, 2)
    cap = GuidanceCapture(PRESETS["minite"])
    with kv_cache.use_kv_format(model, kv), kv_cache.capture_kv(model, cap):
        r = models.generate(model, prompts, path, max_new_tokens=6, eos_id=TASK.eos_id,
                            pad_id=TASK.pad_id)
    return r, cap


@pytest.mark.parametrize("kv", KV)
def test_kv_records_round_trip_with_their_format(tiny, kv):
    """K/V sections (one row per token and head, head in the index column) encode and decode
    bit for bit with the record's kv_spec and meta; the rows are the spec's bits of what the
    cache wrote."""
    r, cap = _capture(tiny, kv, 1)
    recs = cap.records(1)
    rec = recs[0]
    rec.meta.update(version="v7", layers=2, kv_heads=2)
    assert rec.kv_spec == kv and {s for _, s in rec.sites} == {"k", "v"}
    rows = rec.sites[(1, "v")]
    tokens = len(r.sequences[0]) - 1  # the last token is never fed back
    assert rows.rows == 2 * tokens and set(rows.experts.tolist()) == {0, 1}
    assert rows.block_scales.shape[-1] == 32 // PRESETS[kv].block_size
    for compress in ("none", "zlib"):
        dec = GuidanceRecord.decode(rec.encode(compress))
        assert dec.kv_spec == kv and dec.meta == {"version": "v7", "layers": 2, "kv_heads": 2}
        for key, want in rec.sites.items():
            got = dec.sites[key]
            for f in ("positions", "experts", "codes", "block_scales"):
                assert torch.equal(getattr(got, f), getattr(want, f))
            assert torch.equal(got.row_scales.view(torch.int32), want.row_scales.view(torch.int32))


def test_kv_sizes_count_the_records_as_encoded(tiny):
    """size_per_token's kv part is what an uncompressed record's K/V sections hold per token;
    b=1 codes + scales are a third of b=4's; TRACE's reference is unchanged."""
    r, cap = _capture(tiny, "kv_nvfp4", 1)
    for bits in (1, 4):
        rec = cap.records(bits)[0]
        tokens = len(r.sequences[0]) - 1
        size = size_for_config(tiny.config, bits=bits, sites=(), kv=True)
        data = rec.encode()
        (hlen,) = struct.unpack("<I", data[4:8])
        body = sum(s["raw"] for s in json.loads(data[8:8 + hlen])["sections"])
        assert body == size["kv"] * tokens
    one = size_per_token(hidden=0, moe_intermediate=0, top_k=0, layers=40, bits=1, sites=(),
                         kv_values=256, row_scale=False, index=False)
    full = size_per_token(hidden=0, moe_intermediate=0, top_k=0, layers=40, bits=4, sites=(),
                          kv_values=256, row_scale=False, index=False)
    assert 3 * one["kv"] == full["kv"] == trace_reference_size()["kv_bytes"]
    mx = size_for_config(tiny.config, bits=4, sites=(), kv=True, kv_spec="kv_mxfp4")
    nv = size_for_config(tiny.config, bits=4, sites=(), kv=True)
    assert nv["kv"] - mx["kv"] == 2 * 2 * 2 * 32 * (1 / 16 - 1 / 32)  # half the scale bytes
    with pytest.raises(SpecError):
        size_for_config(tiny.config, bits=1, kv=True, kv_spec="kv_fp3")


# --- the learner follows the sampler ------------------------------------------------------------

@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("bits", [1, 4])
def test_learner_kv_codes_equal_the_samplers_within_one_grid_step(tiny, kv, bits):
    """Scoring the sampler's rollouts teacher-forced, with the sampler's K/V records the
    learner's K/V codes equal the sampler's wherever its value lies within one grid step of the
    sampler's (the sampler's level is an end of its bracket under the sampler's scales); that is
    nearly every value, and fewer codes differ than when it rounds to nearest."""
    r, cap = _capture(tiny, kv, bits)
    reference = GuidanceTable(cap.records(4))
    counts = {}
    with kv_cache.use_kv_format(tiny, kv):
        for mode, recs in (("rtn", None), ("guided", cap.records(bits))):
            agr = models.KVAgreement()
            with models.use_kv_guidance(tiny, recs), \
                    models.count_kv_agreement(tiny, reference, agr):
                models.score_sequences(tiny, r.sequences, r.prompt_lens, "nvfp4_minite",
                                       pad_id=TASK.pad_id)
            counts[mode] = agr
    g, rtn = counts["guided"], counts["rtn"]
    assert set(g.values) == {(layer, s) for layer in (0, 1) for s in ("k", "v")}
    assert g.total(g.near_mismatched) == 0
    assert g.total(g.near) > 0.95 * g.total(g.values)
    assert rtn.total(rtn.mismatched) > 0  # the learner's own K/V do differ
    assert g.total(g.mismatched) < rtn.total(rtn.mismatched)


# --- bad input ----------------------------------------------------------------------------------

def test_records_made_for_something_else_are_refused_by_name(tiny):
    """Another version, layer count, KV head count, head size, bit width or KV format: a
    GuidanceMismatchError whose field names the mismatch."""
    _, cap = _capture(tiny, "kv_nvfp4", 1)
    geo = models.model_geometry(tiny)

    def recs(**meta):
        out = cap.records(1)
        for rec in out.values():
            rec.meta.update(version="v1", layers=2, kv_heads=2)
            rec.meta.update(meta)
        return out

    ok = recs()
    models.check_records(ok, version="v1", geometry=geo, bits=1, kv_spec=PRESETS["kv_nvfp4"])
    cases = [
        (dict(version="v1"), dict(version="v2"), "version"),
        (dict(layers=3), {}, "layers"),
        (dict(kv_heads=4), {}, "kv_heads"),
        ({}, dict(bits=2), "bits"),
        ({}, dict(kv_spec=PRESETS["kv_mxfp4"]), "format"),
    ]
    for meta, check, name in cases:
        kw = dict(version="v1", geometry=geo, bits=1, kv_spec=PRESETS["kv_nvfp4"]) | check
        with pytest.raises(GuidanceMismatchError, match=name) as e:
            models.check_records(recs(**meta), **kw)
        assert e.value.field == name and isinstance(e.value, GuidanceRecordError)
    other = models.build_model(models.tiny_config(num_hidden_layers=2, head_dim=64), seed=0)
    with pytest.raises(GuidanceMismatchError) as e:
        models.check_records(recs(), geometry=models.model_geometry(other))
    assert e.value.field == "head_dim"
    deeper = recs()
    deeper[0].sites[(5, "k")] = deeper[0].sites[(1, "k")]
    with pytest.raises(GuidanceMismatchError) as e:
        models.check_records(deeper, geometry=geo)
    assert e.value.field == "layers"
    with kv_cache.use_kv_format(tiny, "kv_mxfp4"), pytest.raises(GuidanceMismatchError) as e, \
            models.use_kv_guidance(tiny, ok):
        pass
    assert e.value.field == "format"
    with pytest.raises(GuidanceMismatchError, match="without an FP4 KV cache"), \
            models.use_kv_guidance(tiny, ok):
        pass
    mixed = recs()
    mixed[1] = cap.records(2)[1]
    with pytest.raises(GuidanceMismatchError) as e:
        GuidanceTable(mixed)
    assert e.value.field == "bits"


@pytest.mark.parametrize("kv", KV)
def test_strict_mode_with_an_fp4_cache_scores_the_decode_bit_for_bit(kv):
    """Strict execution composes with the FP4 cache: its batch-invariant attention reads the
    dequantized K/V, the learner's full-sequence pass quantizes the same K/V rows to the same
    bits, so scores equal the decode's log-probs exactly, without any records."""
    from libalign.models import strict

    model = models.build_model(models.tiny_config(), seed=5)
    prompts = [[1, 3, 4, 5], [1, 6, 7], [1, 8, 9, 10, 11, 12]]
    with strict.use_strict(model), kv_cache.use_kv_format(model, kv):
        r = models.generate(model, prompts, "nvfp4_minite", max_new_tokens=6, seed=1,
                            batch_size=3, eos_id=2, pad_id=0)
        s = models.score_sequences(model, r.sequences, r.prompt_lens, "nvfp4_minite",
                                   batch_size=2, pad_id=0)
    with strict.use_strict(model):  # the same tokens through bf16 K/V score otherwise
        bf16_kv = models.score_sequences(model, r.sequences, r.prompt_lens, "nvfp4_minite",
                                         batch_size=2, pad_id=0)
    assert all(torch.equal(a, b) for a, b in zip(s, r.logprobs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(bf16_kv, r.logprobs, strict=True))
