"""Strict execution in the Megatron-core learner: its log-probs are the embedded strict
sampler's bit for bit (atol = 0), on the CPU and, marked ``gpu``, on CUDA; the layouts it
cannot make batch-invariant are refused by name.

Both sides hold the same weights; the Hugging Face model keeps RoPE's inverse frequencies in
fp32, as ``from_pretrained`` does and Megatron's rotary embedding does (see
``tests/libalign/test_megatron.py``).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from alignclient.errors import ConfigError, SpecError
from alignd.learner.engine import TorchLearnerEngine
from alignd.learner.megatron_engine import MegatronLearnerEngine

from libalign.models import build_model, capture_guidance, generate, strict, use_path
from libalign.models import megatron as mg
from libalign.models import megatron_export as mx
from libalign.models import megatron_strict as ms
from libalign.models import train as train_mod
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.task import SyntheticTask
from tests.libalign.megatron_config import small_config

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU-shim test; the gpu-marked test covers CUDA hosts")
TASK = SyntheticTask()
CFG = small_config()


@pytest.fixture
def cpu(megatron_world):
    with cpu_shims(), train_mod.cpu_threads(1):
        yield


def _hf(device="cpu"):
    model = build_model(CFG, seed=1)
    rope = model.model.rotary_emb
    rope.inv_freq = rope.compute_default_rope_parameters(CFG)[0]
    return model.to(device)


def _gpt(hf, device="cpu", **kwargs):
    model = mg.build_gpt_model(CFG, device=device, **kwargs)
    mx.load_hf_into_megatron(model, hf.state_dict(), CFG)
    return model


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    return ids.to(device), mask.to(device)


def _assert_logits_equal(hf, gpt, path, device="cpu"):
    ids, mask = _batch(device)
    mg.set_path(gpt, path)
    with torch.no_grad(), use_path(hf, path), strict.use_strict(hf), ms.use_strict(gpt):
        assert ms.is_strict(gpt) and strict.is_strict(gpt)  # log_softmax_for answers strict
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = mg.gpt_logits(gpt, ids, mask)
        lp_ref = strict.log_softmax_for(hf)(ref.float())
        lp_got = strict.log_softmax_for(gpt)(got.float())
    real = mask.bool()
    assert torch.equal(got[real], ref[real])
    assert torch.equal(lp_got[real], lp_ref[real])


@CPU_ONLY
@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_strict_logits_equal_the_embedded_strict_model_bitwise(cpu, path):
    """Same weights, right-padded batch: strict Megatron logits and log-probs equal the strict
    Hugging Face model's with atol = 0; after use_strict the stock forwards are back (the
    stock logits' bits again)."""
    hf = _hf()
    gpt = _gpt(hf)
    ids, mask = _batch()
    mg.set_path(gpt, path)
    with torch.no_grad():
        stock = mg.gpt_logits(gpt, ids, mask)
    _assert_logits_equal(hf, gpt, path)
    assert not ms.is_strict(gpt)
    with torch.no_grad():
        assert torch.equal(mg.gpt_logits(gpt, ids, mask), stock)


@CPU_ONLY
def test_strict_engine_scores_as_the_strict_sampler_decodes(cpu):
    """MegatronLearnerEngine(strict=True) on nvfp4_minite: its scores are the strict sampler's
    KV-cached decode log-probs on every token (left-padded decode, right-padded scoring), for
    a sampler built by build_model (RoPE inverse frequencies in bf16, handed to the engine)."""
    hf = build_model(CFG, seed=1)
    engine = MegatronLearnerEngine.from_hf_state_dict(
        hf.state_dict(), CFG, "nvfp4_minite", strict=True, pad_id=TASK.pad_id, batch_size=5,
        device="cpu", rope_inv_freq=hf.model.rotary_emb.inv_freq)
    assert ms.is_strict(engine.model)
    with strict.use_strict(hf):
        r = generate(hf, TASK.prompts(6, seed=3), "nvfp4_minite", max_new_tokens=5,
                     batch_size=4, eos_id=TASK.eos_id, pad_id=TASK.pad_id, seed=2)
    assert engine.score(r.sequences, r.prompt_lens) == [t.tolist() for t in r.logprobs]


@CPU_ONLY
def test_strict_engine_with_guidance_scores_as_the_strict_embedded_engine(cpu):
    """nvfp4_trace with a (stock) sampler's guidance records: the strict Megatron engine's
    scores equal the strict embedded engine's (rows named by their tokens' keys, FC2 rows by
    expert too), and the records change them (the stock decode rounded some rows otherwise)."""
    sampler = build_model(CFG, seed=1)
    prompts = [p for p in TASK.prompts(2, 1) for _ in range(2)]
    with capture_guidance(sampler) as cap:
        r = generate(sampler, prompts, "nvfp4_minite", max_new_tokens=5, seed=3,
                     eos_id=TASK.eos_id, pad_id=TASK.pad_id)
    recs = cap.records(2)
    meg = MegatronLearnerEngine.from_hf_state_dict(
        sampler.state_dict(), CFG, "nvfp4_trace", strict=True, pad_id=TASK.pad_id,
        device="cpu", rope_inv_freq=sampler.model.rotary_emb.inv_freq)
    ref = TorchLearnerEngine(build_model(CFG, seed=1), "nvfp4_trace", strict=True,
                             pad_id=TASK.pad_id)
    got = meg.score(r.sequences, r.prompt_lens, recs)
    assert got == ref.score(r.sequences, r.prompt_lens, recs)
    assert got != meg.score(r.sequences, r.prompt_lens)


@CPU_ONLY
def test_strict_megatron_refuses_what_it_cannot_honour(cpu):
    """Typed errors naming the option: nvfp4_naive (SpecError: per-tensor activation scale),
    routing replay, Megatron's own norm and attention, te_grouped experts, and tensor- or
    expert-parallel layouts (ConfigError)."""
    hf = _hf()
    with pytest.raises(SpecError, match="nvfp4_naive"):
        MegatronLearnerEngine(_gpt(hf), CFG, "nvfp4_naive", strict=True)
    with pytest.raises(ConfigError, match="routing_replay"):
        MegatronLearnerEngine(_gpt(hf), CFG, "bf16", strict=True, routing_replay="recompute")
    with pytest.raises(ConfigError, match="numerics='megatron'"):
        ms.enable(mg.build_gpt_model(CFG, numerics="megatron", device="cpu"))
    with pytest.raises(ConfigError, match="experts=TEGroupedMLP"):
        ms.enable(mg.build_gpt_model(CFG, experts="te_grouped", device="cpu"))
    for option in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        cfg = types.SimpleNamespace(**{option: 2})
        with pytest.raises(ConfigError, match=f"{option}=2"):
            ms.check_config(cfg)
    gpt = _gpt(hf)
    with pytest.raises(SpecError, match="nvfp4_naive"), torch.no_grad(), ms.use_strict(gpt), \
            mg.use_path(gpt, "nvfp4_naive"):
        mg.gpt_logits(gpt, *_batch())


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_strict_logits_equal_the_embedded_strict_model_bitwise_on_cuda(megatron_world, path):
    """On CUDA (the strict ops' Triton K-ordered product on both sides): the same equality."""
    hf = _hf("cuda")
    gpt = _gpt(hf, "cuda")
    _assert_logits_equal(hf, gpt, path, "cuda")


@CPU_ONLY
def test_per_expert_weights_are_strict_too_and_gradients_reach_every_parameter(cpu):
    """expert_weights="per_expert" (Transformer Engine's names) gives the same strict bits; the
    strict forward's backward (the stock one) reaches every parameter of the stock backward,
    within 5% of its gradients (the forwards differ by bf16 roundings), twice in a row."""
    hf = _hf()
    gpt = _gpt(hf, expert_weights="per_expert")
    _assert_logits_equal(hf, gpt, "bf16")
    ids, mask = _batch()
    grads = []
    for on in (False, True):
        gpt.zero_grad(set_to_none=True)
        with ms.use_strict(gpt, on):
            for _ in range(2):
                mg.gpt_logits(gpt, ids, mask).float()[mask.bool()].logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in gpt.named_parameters() if p.grad is not None})
    stock, got = grads
    assert stock.keys() == got.keys() and len(got) == len(list(gpt.parameters()))
    for n, g in got.items():
        assert (g - stock[n]).abs().max() <= 0.05 * stock[n].abs().max(), n
