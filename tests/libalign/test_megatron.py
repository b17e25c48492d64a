"""Megatron-core learner glue: libalign experts in a Megatron GPT, the weight map, the engine.

Tolerances pinned here (CPU, one ``gloo`` process, megatron-core 0.16.1):

* logits of the Megatron GPT built by :func:`libalign.models.megatron.build_gpt_model`
  (``numerics="qwen3"``) equal the Hugging Face glue's **bit for bit** on every path (``bf16``,
  ``nvfp4_naive``, ``nvfp4_minite``, ``nvfp4_trace`` with and without the sampler's records),
  right-padded batches included, given the same weights;
* the expert block alone (``LibalignGroupedMLP`` between Megatron's own permute/unpermute) equals
  :func:`libalign.gemm.moe_experts_forward` bit for bit for identical inputs and routing;
* with Megatron's own norm and attention (``numerics="megatron"``) the logits differ from the
  Hugging Face model's by at most 0.05 absolute (measured over seeds 1-4: 0.003-0.016 on every
  path, one to four bf16 ulps of the largest logit, about 0.5);
* the engine's scores equal the Hugging Face engine's bit for bit before a step; one identical
  GRPO + TIS step (lr 1e-3) gives the same loss bit for bit, gradient norms within 1e-3
  relative (measured 2.4e-4: the backward passes sum in different orders), weights within
  2.5e-3 (2 * lr: Adam's first step is about ``lr * sign(g)``) and scores within 1e-2
  (measured 0.004, under 1% of how far the step itself moved them).

The Hugging Face reference keeps RoPE's inverse frequencies in fp32, as ``from_pretrained``
does (:func:`libalign.models.build_model` casts every buffer to bf16, which rounds them).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from alignclient.errors import ConfigError, SpecError
from alignd.learner.engine import TorchLearnerEngine, TrainBatch
from alignd.learner.megatron_engine import MegatronLearnerEngine

from libalign import gemm
from libalign.models import build_model, capture_guidance, generate, tiny_config, use_path
from libalign.models import megatron as mg
from libalign.models import megatron_export as mx
from libalign.models import train as train_mod
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.task import SyntheticTask
from tests.libalign.megatron_config import small_config

# These run Megatron on the CPU through libalign's CPU shims. On a host with CUDA the shimmed
# ``torch.cuda.current_device`` meets megatron-core's compiled router (torch.compile indexes
# devices by it) and fails; the ``gpu`` tests cover that host instead.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU-shim test; the gpu-marked tests cover CUDA hosts")
pytestmark = CPU_ONLY

PATHS = ("bf16", "nvfp4_naive", "nvfp4_minite", "nvfp4_trace")
TASK = SyntheticTask()
CFG = small_config()


@pytest.fixture(autouse=True)
def _shims_one_thread(megatron_world):
    with cpu_shims(), train_mod.cpu_threads(1):
        yield


def _hf(seed=1):
    model = build_model(CFG, seed=seed)
    rope = model.model.rotary_emb
    rope.inv_freq = rope.compute_default_rope_parameters(CFG)[0]
    return model


@pytest.fixture(scope="module")
def hf(megatron_world):
    return _hf()


@pytest.fixture(scope="module")
def gpt(hf, megatron_world):
    model = mg.build_gpt_model(CFG)
    mx.load_hf_into_megatron(model, hf.state_dict(), CFG)
    return model


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    return ids, mask


@pytest.mark.parametrize("path", PATHS)
def test_forward_and_backward_run_on_every_path(path):
    """A 2-layer, 8-expert top-2 Megatron GPT runs forward and backward through each path."""
    model = mg.build_gpt_model(CFG, path, seed=3)
    assert set(mg.current_paths(model).values()) == {path}
    ids, mask = _batch()
    logits = mg.gpt_logits(model, ids, mask)
    assert logits.shape == (3, 12, CFG.vocab_size) and torch.isfinite(logits).all()
    logits.float()[mask.bool()].logsumexp(-1).mean().backward()
    for ex in mg.experts_modules(model).values():
        for lin in (ex.linear_fc1, ex.linear_fc2):
            assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("path", PATHS)
def test_logits_equal_the_hf_glue_bitwise(hf, gpt, path):
    """Same weights, same path: Megatron's logits are the Hugging Face glue's, bit for bit."""
    ids, mask = _batch()
    mg.set_path(gpt, path)
    with torch.no_grad(), use_path(hf, path):
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = mg.gpt_logits(gpt, ids, mask)
    real = mask.bool()
    assert torch.equal(got[real], ref[real])


def test_finite_check_switch_reaches_every_linear_and_keeps_the_bits(gpt):
    """set_finite_check(False) reaches every expert linear; finite logits keep their bits."""
    ids, mask = _batch()
    mg.set_path(gpt, "nvfp4_minite")
    with torch.no_grad():
        checked = mg.gpt_logits(gpt, ids, mask)
    mg.set_finite_check(gpt, False)
    try:
        flags = {lin.check_finite for ex in mg.experts_modules(gpt).values()
                 for lin in (ex.linear_fc1, ex.linear_fc2)}
        with torch.no_grad():
            unchecked = mg.gpt_logits(gpt, ids, mask)
    finally:
        mg.set_finite_check(gpt, True)
    assert flags == {False}
    assert torch.equal(checked, unchecked)
    assert all(lin.check_finite for ex in mg.experts_modules(gpt).values()
               for lin in (ex.linear_fc1, ex.linear_fc2))


def test_megatron_numerics_stay_within_tolerance(hf):
    """Megatron's own RMSNorm and attention: logits within 0.05 of the Hugging Face model's."""
    model = mg.build_gpt_model(CFG, numerics="megatron")
    mx.load_hf_into_megatron(model, hf.state_dict(), CFG)
    ids, mask = _batch()
    for path in ("bf16", "nvfp4_minite"):
        mg.set_path(model, path)
        with torch.no_grad(), use_path(hf, path):
            d = (mg.gpt_logits(model, ids, mask).float() - hf(input_ids=ids, attention_mask=mask)
                 .logits.float())[mask.bool()].abs().max()
        assert 0 < d <= 0.05


@pytest.mark.parametrize("path", PATHS[:3])
def test_expert_block_equals_moe_experts_forward(gpt, path):
    """Identical inputs and routing: LibalignGroupedMLP between Megatron's permute and
    unpermute equals libalign's reference expert block bit for bit."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    ex = mg.experts_modules(gpt)[0]
    ex.set_path(path)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(40, CFG.hidden_size, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    w = torch.softmax(torch.randn(40, 2, generator=g), -1).to(torch.bfloat16)
    rmap = torch.zeros(40, 8, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(40, 8, dtype=torch.bfloat16).scatter(1, idx, w)
    # 0.19 returns two more (padding) entries
    x, p, order = permute(hidden, rmap, probs=probs, num_out_tokens=int(rmap.sum()))[:3]
    with torch.no_grad():
        y, bias = ex(x, rmap.sum(0), p)
        got = unpermute(y, order, restore_shape=hidden.shape, routing_map=rmap)
        ref = gemm.moe_experts_forward(hidden, idx, w, ex.linear_fc1.prepared(), ex.linear_fc2.prepared())
    assert bias is None and torch.equal(got, ref)


def test_exporter_round_trips(hf, gpt):
    """HF -> Megatron -> HF gives every tensor back bit for bit, in both expert layouts."""
    ref = hf.state_dict()
    out = mx.export_hf_state_dict(gpt, CFG)
    assert set(out) == set(ref)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    per = mx.export_hf_state_dict(gpt, CFG, expert_layout="per_expert")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in per
    fused = mx.fuse_experts([per], CFG.num_experts)
    assert set(fused) == set(ref) and all(torch.equal(fused[k], ref[k]) for k in ref)
    heads, groups, d = 4, 2, 16
    qkv = gpt.state_dict()["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(mx.merge_qkv(*mx.split_qkv(qkv, heads, groups, d), heads, groups, d), qkv)


def test_expert_parallel_rank_exports_global_indices(hf, megatron_world):
    """An expert-parallel rank's local expert j is global expert offset + j in the export, and
    the per-rank exports fuse back into the full stacks."""
    ref = hf.state_dict()
    shards = []
    for rank in (0, 1):
        model = mg.build_gpt_model(CFG)
        mx.load_hf_into_megatron(model, ref, CFG)
        for i, layer in mg.moe_layers(model).items():  # what rank `rank` of EP=2 would hold
            ex = layer.experts
            keep = slice(4 * rank, 4 * rank + 4)
            for lin in (ex.linear_fc1, ex.linear_fc2):
                lin.weight = torch.nn.Parameter(lin.weight.detach()[keep].clone())
            layer.num_local_experts = ex.num_local_experts = 4
            layer.local_expert_indices = list(range(4 * rank, 4 * rank + 4))
            assert mx.read_expert_stacks(ex.state_dict(), 4)[0].shape[0] == 4, i
        shard = mx.export_hf_state_dict(model, CFG, expert_layout="per_expert")
        experts = {int(k.split(".")[5]) for k in shard if ".mlp.experts." in k}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        # and loading a full checkpoint takes this rank's experts
        mx.load_hf_into_megatron(model, ref, CFG)
        assert torch.equal(model.decoder.layers[0].mlp.experts.linear_fc1.weight,
                           ref["model.layers.0.mlp.experts.gate_up_proj"][4 * rank:4 * rank + 4])
        shards.append(shard)
    fused = mx.fuse_experts(shards, CFG.num_experts)
    assert all(torch.equal(fused[k], ref[k]) for k in ref)
    with pytest.raises(Exception, match="experts"):
        mx.fuse_experts(shards[:1], CFG.num_experts)


def test_stock_sequential_mlp_model_round_trips(hf):
    """Megatron's own SequentialMLP experts (per-expert ColumnParallel/RowParallel linears) map
    to the same Hugging Face names: gate rows first in linear_fc1, as SwiGLU chunks them."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = mg.transformer_config_from_hf(CFG)
    spec = get_gpt_layer_local_spec(num_experts=8, qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=CFG.vocab_size,
                     max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=mg.rope_theta(CFG), share_embeddings_and_output_weights=False)
    model = model.bfloat16()
    ref = hf.state_dict()
    mx.load_hf_into_megatron(model, ref, CFG)
    sd = model.state_dict()
    gate_up = ref["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(sd["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"], gate_up[5])
    out = mx.export_hf_state_dict(model, CFG)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    ids = _batch()[0]
    with torch.no_grad(), use_path(hf, "bf16"):
        d = (mg.gpt_logits(model, ids).float() - hf(input_ids=ids).logits.float()).abs().max()
    assert d <= 0.05


def test_te_grouped_experts_run_the_libalign_gemm(hf):
    """TEGroupedMLP with LibalignGroupedLinear in its FC1/FC2 slots runs each path; it weights
    FC2's input by the router probability (Megatron's order), so it is close, not equal."""
    model = mg.build_gpt_model(CFG, "nvfp4_minite", experts="te_grouped")
    mx.load_hf_into_megatron(model, hf.state_dict(), CFG)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "TEGroupedMLP"
    assert set(mg.current_paths(model).values()) == {"nvfp4_minite"}
    ids, mask = _batch()
    logits = mg.gpt_logits(model, ids, mask)
    logits.float().sum().backward()
    assert model.decoder.layers[0].mlp.experts.linear_fc1.weight.grad.abs().sum() > 0
    with torch.no_grad(), use_path(hf, "nvfp4_minite"):
        ref = hf(input_ids=ids, attention_mask=mask).logits
    d = (logits.detach().float() - ref.float())[mask.bool()].abs().max()
    assert 0 < d <= 0.05


def test_paths_and_errors(gpt):
    """use_path restores the previous paths; bad paths, layers and configs are refused."""
    mg.set_path(gpt, "nvfp4_naive")
    with mg.use_path(gpt, "bf16"):
        assert set(mg.current_paths(gpt).values()) == {"bf16"}
    assert set(mg.current_paths(gpt).values()) == {"nvfp4_naive"}
    with pytest.raises(SpecError, match="unknown execution path"):
        mg.set_path(gpt, "fp8")
    with pytest.raises(SpecError, match="no libalign expert linears"):
        mg.set_path(gpt, "bf16", layers=[5])
    with pytest.raises(SpecError, match="layers \\[7\\]"), mg.use_guidance(gpt, None, layers=[7]):
        pass
    with pytest.raises(ConfigError, match="numerics"):
        mg.get_moe_layer_spec(num_experts=8, numerics="fast")
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        mg.transformer_config_from_hf(tiny_config(mlp_only_layers=[0]))
    ex = mg.experts_modules(gpt)[0]
    ex.set_path("nvfp4_trace")
    mg.set_row_keys(gpt, None)
    with mg.use_guidance(gpt, None), pytest.raises(SpecError, match="row keys"):
        mg.gpt_logits(gpt, _batch()[0])


@pytest.fixture(scope="module")
def rollout(hf):
    prompts = [p for p in TASK.prompts(2, 1) for _ in range(2)]
    with capture_guidance(hf) as cap:
        r = generate(hf, prompts, "nvfp4_minite", max_new_tokens=5, seed=3, eos_id=TASK.eos_id,
                     pad_id=TASK.pad_id)
    return r, cap.records(2)


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite", "nvfp4_trace"])
def test_engine_scores_equal_the_hf_engine(hf, rollout, path):
    """Scores (with the sampler's guidance records on nvfp4_trace) equal the HF engine's."""
    r, recs = rollout
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path, pad_id=TASK.pad_id)
    ref = TorchLearnerEngine(hf, path, pad_id=TASK.pad_id)
    guidance = recs if path == "nvfp4_trace" else None
    assert meg.score(r.sequences, r.prompt_lens, guidance) == \
        ref.score(r.sequences, r.prompt_lens, guidance)
    if path == "nvfp4_trace":
        assert meg.score(r.sequences, r.prompt_lens, guidance) != meg.score(r.sequences, r.prompt_lens)


@pytest.mark.parametrize("path", ["nvfp4_minite", "nvfp4_trace"])
def test_engine_trains_one_step_like_the_hf_engine(rollout, path):
    """One identical GRPO + TIS step on both engines: statistics agree, the exported weights
    load into Hugging Face, and the two policies' scores stay within 2e-3."""
    r, recs = rollout
    hf = _hf()
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path, lr=1e-3,
                                                   pad_id=TASK.pad_id)
    ref = TorchLearnerEngine(hf, path, lr=1e-3, pad_id=TASK.pad_id)
    samp = [t.tolist() for t in r.logprobs]
    guidance = recs if path == "nvfp4_trace" else None
    batch = TrainBatch(r.sequences, r.prompt_lens, samp, [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], guidance)
    s_meg, s_ref = meg.train_step(batch), ref.train_step(batch)
    assert s_meg["tokens"] == s_ref["tokens"] and s_meg["ratio_mean"] == s_ref["ratio_mean"]
    assert s_meg["loss"] == pytest.approx(s_ref["loss"], rel=1e-5)
    assert s_meg["grad_norm"] == pytest.approx(s_ref["grad_norm"], rel=1e-3)
    exported = meg.export_weights()
    assert set(exported) == set(hf.state_dict())
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in exported.values())
    moved = max((exported[k].float() - ref.export_weights()[k].float()).abs().max().item()
                for k in exported)
    assert moved <= 2.5e-3  # Adam's first step is lr * sign(g): a sign flip moves 2 * lr
    a = meg.score(r.sequences, r.prompt_lens, guidance)
    b = ref.score(r.sequences, r.prompt_lens, guidance)
    gap = max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))
    step = max(abs(x - y) for u, v in zip(a, samp, strict=True) for x, y in zip(u, v, strict=True))
    assert gap <= 1e-2 and gap <= 0.02 * step
    again = _hf()
    again.load_state_dict(exported)
    with use_path(again, path):
        assert again(input_ids=torch.tensor([r.sequences[0]])).logits.isfinite().all()


# --- routing replay (R3) ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def routed(hf):
    """Rollouts sampled on nvfp4_minite with their routing records (and gate weights)."""
    from libalign.models.routing_replay import capture_routing

    prompts = [p for p in TASK.prompts(4, 2) for _ in range(2)]
    with capture_routing(hf, weights=True) as cap:
        r = generate(hf, prompts, "nvfp4_minite", max_new_tokens=6, seed=5, eos_id=TASK.eos_id,
                     pad_id=TASK.pad_id)
    return r, cap.records()


def _megatron_routing_maps(meg, r, routing):
    """Score with the engine while recording each layer's final routing map per token key."""
    seen = {}
    routers = {i: layer.router for i, layer in mg.moe_layers(meg.model).items()}
    installed = []

    def make(i, inner):
        def routing_fn(logits, *args, **kwargs):
            probs, rmap = inner(logits, *args, **kwargs)
            keys = mg.experts_modules(meg.model)[i].row_keys
            seen.setdefault(i, []).append((keys.clone(), rmap.clone()))
            return probs, rmap
        return routing_fn

    from libalign.models import megatron_routing

    real = megatron_routing.replay_routing

    def outer(model, table, **kw):
        ctx = real(model, table, **kw)

        class Both:
            def __enter__(self):
                out = ctx.__enter__()
                for i, router in routers.items():
                    installed.append((router, router.routing))
                    router.routing = make(i, router.routing)
                return out

            def __exit__(self, *exc):
                for router, before in reversed(installed):
                    router.routing = before
                installed.clear()
                return ctx.__exit__(*exc)
        return Both()

    megatron_routing.replay_routing = outer
    try:
        meg.score(r.sequences, r.prompt_lens, None, routing)
    finally:
        megatron_routing.replay_routing = real
    return seen


@pytest.mark.parametrize("mode", ["recompute", "record"])
def test_megatron_replay_routes_every_token_as_the_sampler_did(hf, routed, mode):
    """Under R3 every token with a record goes, at every layer, to the sampler's experts; the
    disagreement before forcing is counted and is not zero on the bf16 learner (so it can fail)."""
    from libalign.guidance import row_keys

    r, recs = routed
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "bf16",
                                                   pad_id=TASK.pad_id, routing_replay=mode)
    seen = _megatron_routing_maps(meg, r, recs)
    assert meg.routing_stats.disagreement > 0
    want = {}
    for sid, rec in recs.items():
        for p in range(rec.positions):
            want[int(row_keys(sid, torch.tensor(p)))] = rec.experts[p].long()
    checked = 0
    for i, calls in seen.items():
        for keys, rmap in calls:
            for row, k in enumerate(keys.tolist()):
                if k in want:
                    got = torch.nonzero(rmap[row]).squeeze(-1)
                    assert torch.equal(got, want[k][i].sort().values), (i, k)
                    checked += 1
    assert checked == sum(rec.positions for rec in recs.values()) * CFG.num_hidden_layers


def test_megatron_replay_matches_the_hf_engine(hf, routed):
    """R3 on both engines: the same disagreement counts, and scores that agree (bitwise where
    no token is forced, within bf16 rounding of the gate weights otherwise)."""
    r, recs = routed
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "bf16",
                                                   pad_id=TASK.pad_id, routing_replay="recompute")
    ref = TorchLearnerEngine(hf, "bf16", pad_id=TASK.pad_id, routing_replay="recompute")
    a = meg.score(r.sequences, r.prompt_lens, None, recs)
    b = ref.score(r.sequences, r.prompt_lens, None, recs)
    assert meg.routing_stats.decisions == ref.routing_stats.decisions
    assert meg.routing_stats.differ == ref.routing_stats.differ
    gap = max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))
    assert gap <= 1e-2


def test_megatron_replay_refuses_bad_records(hf, routed):
    """Missing records under R3 and records of another top-k are refused by type and field."""
    from alignclient.errors import RoutingMismatchError, RoutingMissingError

    from libalign.routing.records import RoutingRecord

    r, recs = routed
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "bf16",
                                                   pad_id=TASK.pad_id, routing_replay="recompute")
    with pytest.raises(RoutingMissingError):
        meg.score(r.sequences, r.prompt_lens)
    bad = {i: RoutingRecord(rec.experts[..., :1].contiguous(), rec.layers, rec.num_experts)
           for i, rec in recs.items()}
    with pytest.raises(RoutingMismatchError) as e:
        meg.score(r.sequences, r.prompt_lens, None, bad)
    assert e.value.field == "top_k"


def test_megatron_trains_under_r3_like_the_hf_engine(routed):
    """One GRPO step with R3 on both engines: the same routing counts and loss, and the router
    weights move (gate weights of the forced experts come from the learner's own logits)."""
    r, recs = routed
    hf = _hf()
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "bf16", lr=1e-3,
                                                   pad_id=TASK.pad_id, routing_replay="recompute")
    ref = TorchLearnerEngine(hf, "bf16", lr=1e-3, pad_id=TASK.pad_id, routing_replay="recompute")
    samp = [t.tolist() for t in r.logprobs]
    n = len(r.sequences)
    batch = TrainBatch(r.sequences, r.prompt_lens, samp, [float(i % 2) for i in range(n)],
                       [i // 2 for i in range(n)], routing=recs)
    router = next(iter(mg.moe_layers(meg.model).values())).router.weight.detach().clone()
    s_meg, s_ref = meg.train_step(batch), ref.train_step(batch)
    assert meg.routing_stats.decisions == ref.routing_stats.decisions
    assert meg.routing_stats.total > 0
    assert s_meg["loss"] == pytest.approx(s_ref["loss"], rel=1e-3)
    after = next(iter(mg.moe_layers(meg.model).values())).router.weight
    assert not torch.equal(router, after)


# --- FP4 KV cache in Megatron's attention -----------------------------------------------------

@pytest.fixture(scope="module")
def kv_rollout(hf):
    """Rollouts sampled through an FP4 (kv_nvfp4) cache on nvfp4_minite, with the activation
    and K/V records (1 bit)."""
    from libalign.models import capture_kv, use_kv_format

    prompts = [p for p in TASK.prompts(2, 1) for _ in range(2)]
    with use_kv_format(hf, "kv_nvfp4"), capture_guidance(hf) as cap, capture_kv(hf, cap):
        r = generate(hf, prompts, "nvfp4_minite", max_new_tokens=5, seed=3, eos_id=TASK.eos_id,
                     pad_id=TASK.pad_id)
    return r, cap.records(1)


@pytest.mark.parametrize("path", ["nvfp4_minite_kv_nvfp4", "nvfp4_trace_kv_nvfp4"])
def test_engine_kv_paths_score_like_the_hf_engine(hf, kv_rollout, path):
    """FP4 K/V in Megatron's attention (libalign.models.megatron_kv): the engine's scores equal
    the HF engine's bit for bit on the KV paths (with the sampler's activation and K/V records
    on the trace path), and the quantization is not a no-op: other scores than without FP4 K/V,
    and, guided, other scores than unguided."""
    r, recs = kv_rollout
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path, pad_id=TASK.pad_id)
    ref = TorchLearnerEngine(hf, path, pad_id=TASK.pad_id)
    guidance = recs if "trace" in path else None
    got = meg.score(r.sequences, r.prompt_lens, guidance)
    assert got == ref.score(r.sequences, r.prompt_lens, guidance)
    if guidance is None:
        plain = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "nvfp4_minite",
                                                         pad_id=TASK.pad_id)
        assert got != plain.score(r.sequences, r.prompt_lens)
    else:
        assert got != meg.score(r.sequences, r.prompt_lens)


def test_engine_writes_kv_with_the_given_scales(hf, kv_rollout):
    """MegatronLearnerEngine(kv_scales=) on SGLang's NVFP4 KV path scores as the HF engine with
    the same scales, bit for bit; scales other than powers of two change the scores against
    the default 1.0 (so the scales reach the hook)."""
    from libalign.models.kv_cache import KVScales

    r, _recs = kv_rollout
    path = "nvfp4_minite_kv_sglang_nvfp4"
    scales = KVScales((0.0123, 0.0371), (0.3, 0.17), "calibration")
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path, pad_id=TASK.pad_id,
                                                   kv_scales=scales)
    ref = TorchLearnerEngine(hf, path, pad_id=TASK.pad_id, kv_scales=scales)
    got = meg.score(r.sequences, r.prompt_lens)
    assert meg.kv_scales == scales and got == ref.score(r.sequences, r.prompt_lens)
    default = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path,
                                                       pad_id=TASK.pad_id)
    assert got != default.score(r.sequences, r.prompt_lens)


def test_engine_kv_path_trains_like_the_hf_engine(kv_rollout):
    """One GRPO step on nvfp4_trace_kv_nvfp4 with the K/V records on both engines: the same
    loss, gradient norm within 1e-3 (straight-through K/V backward on both sides)."""
    r, recs = kv_rollout
    hf = _hf()
    path = "nvfp4_trace_kv_nvfp4"
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, path, lr=1e-3,
                                                   pad_id=TASK.pad_id)
    ref = TorchLearnerEngine(hf, path, lr=1e-3, pad_id=TASK.pad_id)
    samp = [t.tolist() for t in r.logprobs]
    batch = TrainBatch(r.sequences, r.prompt_lens, samp, [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], recs)
    s_meg, s_ref = meg.train_step(batch), ref.train_step(batch)
    assert s_meg["tokens"] == s_ref["tokens"] and s_meg["ratio_mean"] == s_ref["ratio_mean"]
    assert s_meg["loss"] == pytest.approx(s_ref["loss"], rel=1e-5)
    assert s_meg["grad_norm"] == pytest.approx(s_ref["grad_norm"], rel=1e-3)


def test_engine_kv_paths_refuse_what_they_cannot_do(hf, rollout):
    """Records without K/V sections on a KV-guided path are refused by field (format), as the HF
    engine refuses them; Megatron's own core attention (numerics='megatron') has no K/V hook,
    and kv_mxfp4 cannot block a head of 16 values, so those are refused when the engine is
    built."""
    from alignclient.errors import GuidanceMismatchError

    r, recs = rollout
    meg = MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "nvfp4_trace_kv_nvfp4",
                                                   pad_id=TASK.pad_id)
    with pytest.raises(GuidanceMismatchError) as e:
        meg.score(r.sequences, r.prompt_lens, recs)
    assert e.value.field == "format"
    with pytest.raises(ConfigError, match="core attention"):
        MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "nvfp4_minite_kv_nvfp4",
                                                 numerics="megatron", pad_id=TASK.pad_id)
    with pytest.raises(ConfigError, match="multiple of 32"):
        MegatronLearnerEngine.from_hf_state_dict(hf.state_dict(), CFG, "nvfp4_minite_kv_mxfp4",
                                                 pad_id=TASK.pad_id)


def test_megatron_kv_rows_are_the_hf_cache_rows(hf, gpt, kv_rollout):
    """K/V rows captured from Megatron's attention (megatron_kv.use_kv(capture=)) in a
    teacher-forced nvfp4_minite pass are the Hugging Face FP4 cache's rows of the same pass:
    the same row keys (token and head), codes, block scales and row scales, at every layer."""
    from libalign.guidance import GuidanceCapture
    from libalign.models import capture_kv, megatron_kv, score_sequences, use_kv_format
    from libalign.models.scoring import right_padded_batch
    from libalign.spec import PRESETS

    r, _recs = kv_rollout
    cap_hf, cap_meg = GuidanceCapture(PRESETS["minite"]), GuidanceCapture(PRESETS["minite"])
    with use_kv_format(hf, "kv_nvfp4"), capture_kv(hf, cap_hf):
        score_sequences(hf, r.sequences, r.prompt_lens, "nvfp4_minite", pad_id=TASK.pad_id)
    ids, mask, keys = right_padded_batch(r.sequences, range(len(r.sequences)), TASK.pad_id,
                                         torch.device("cpu"))
    mg.set_row_keys(gpt, keys.T)
    try:
        with torch.no_grad(), mg.use_path(gpt, "nvfp4_minite"), \
                megatron_kv.use_kv(gpt, "kv_nvfp4", capture=cap_meg):
            mg.gpt_logits(gpt, ids, mask)
    finally:
        mg.set_row_keys(gpt, None)
    a, b = cap_hf.pooled(), cap_meg.pooled()
    assert set(a) == set(b) == {(layer, s) for layer in range(2) for s in ("k", "v")}
    for site, (keys_a, rows_a) in a.items():
        keys_b, rows_b = b[site]
        assert keys_a.numel() > 0 and torch.equal(keys_a, keys_b), site
        for field in ("codes", "block_scales", "row_scales"):
            assert torch.equal(getattr(rows_a, field), getattr(rows_b, field)), (site, field)


def test_megatron_kv_hook_writes_with_the_versions_scales(hf, gpt, kv_rollout):
    """megatron_kv.use_kv(scales=) quantizes every layer's K and V rows in SGLang's NVFP4 KV
    format as the Hugging Face FP4 cache does with the same KVScales: the same keys, codes,
    block scales and row scales, each row carrying its layer's own K or V global scale. Scales
    that do not cover the model's layers, or scales given to a format that computes its own
    (kv_sglang_fp4_mx_block16), are refused by name."""
    from libalign.guidance import GuidanceCapture
    from libalign.models import capture_kv, megatron_kv, score_sequences, use_kv_format
    from libalign.models.kv_cache import KVScales
    from libalign.models.scoring import right_padded_batch
    from libalign.spec import PRESETS

    r, _recs = kv_rollout
    kv = "kv_sglang_nvfp4"
    scales = KVScales((0.0078125, 0.03125), (0.25, 0.0625), "calibration")
    cap_hf, cap_meg = GuidanceCapture(PRESETS["minite"]), GuidanceCapture(PRESETS["minite"])
    with use_kv_format(hf, kv, scales), capture_kv(hf, cap_hf):
        score_sequences(hf, r.sequences, r.prompt_lens, "nvfp4_minite", pad_id=TASK.pad_id)
    ids, mask, keys = right_padded_batch(r.sequences, range(len(r.sequences)), TASK.pad_id,
                                         torch.device("cpu"))
    mg.set_row_keys(gpt, keys.T)
    try:
        with torch.no_grad(), mg.use_path(gpt, "nvfp4_minite"), \
                megatron_kv.use_kv(gpt, kv, capture=cap_meg, scales=scales):
            mg.gpt_logits(gpt, ids, mask)
    finally:
        mg.set_row_keys(gpt, None)
    a, b = cap_hf.pooled(), cap_meg.pooled()
    assert set(a) == set(b) == {(layer, s) for layer in range(2) for s in ("k", "v")}
    for (layer, site), (keys_a, rows_a) in a.items():
        keys_b, rows_b = b[(layer, site)]
        assert keys_a.numel() > 0 and torch.equal(keys_a, keys_b)
        for field in ("codes", "block_scales", "row_scales"):
            assert torch.equal(getattr(rows_a, field), getattr(rows_b, field)), (layer, site)
        assert torch.all(rows_b.row_scales == scales.scale(layer, site))
    with pytest.raises(SpecError, match="layer 1 k_scale/v_scale"), \
            megatron_kv.use_kv(gpt, kv, scales=KVScales.default(1)):
        pass
    with pytest.raises(SpecError, match="takes no k_scale"), \
            megatron_kv.use_kv(gpt, "kv_sglang_fp4_mx_block16", scales=KVScales.default(2)):
        pass
