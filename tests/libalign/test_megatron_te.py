"""The Megatron learner in the layout slime and Miles run: per-expert grouped linears
(``TEGroupedLinear``'s interface), the ``--spec`` provider, alltoall, shared experts, TP = 2.

Pinned here (CPU, ``gloo``, megatron-core 0.16.1):

* the per-expert linears (:mod:`libalign.models.megatron_grouped`) give today's stacked
  :class:`~libalign.models.megatron_modules.LibalignGroupedLinear`'s logits and gradients
  **bit for bit** on every path, in both experts modules, under the allgather and alltoall
  dispatchers;
* on two ranks at tensor parallelism 2 and expert parallelism 2 with shared experts and the
  alltoall dispatcher, the same holds, and one training step through Megatron-core's
  ``DistributedDataParallel`` and ``get_forward_backward_func()`` leaves both models with the
  same weights bit for bit;
* renamed and cut as slime's and Miles' converter (``megatron_to_hf/qwen3moe.py``) does, written
  out as a table in ``tests/libalign/qwen3moe_name_table.py``, the provider's model is the
  Hugging Face checkpoint it was loaded from, bit for bit, and libalign's per-expert export
  gives exactly those names and tensors;
* distributed-checkpoint keys and global offsets are those of Megatron's own
  ``SequentialMLP`` (which ``TEGroupedMLP``'s are interchangeable with).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from alignclient.errors import ConfigError

from libalign.models import build_model
from libalign.models import megatron as mg
from libalign.models import megatron_export as mx
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.megatron_parallel import launch
from libalign.models.megatron_spec import check_config, make_spec
from libalign.models.train import cpu_threads
from tests.libalign import qwen3moe_name_table as names
from tests.libalign import te_workers as W

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU-shim test; the gpu-marked tests cover CUDA hosts")
pytestmark = CPU_ONLY
ROOT = Path(__file__).resolve().parents[2]
PATHS = ("bf16", "nvfp4_naive", "nvfp4_minite", "nvfp4_trace")


@pytest.fixture(autouse=True)
def _shims(megatron_world):
    with cpu_shims(), cpu_threads(1):
        yield


@pytest.fixture(scope="module")
def hf_sd(megatron_world):
    return {k: v.detach().clone() for k, v in build_model(W.config(), seed=1).state_dict().items()}


def _run(hf_sd, path, experts, dispatcher, expert_weights):
    model = mg.build_gpt_model(W.config(), path, experts=experts, expert_weights=expert_weights,
                               moe_token_dispatcher_type=dispatcher)
    mx.load_hf_into_megatron(model, hf_sd, W.config())
    ids = W.batch(5, b=3, s=11)[:, :-1]
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    logits = mg.gpt_logits(model, ids, mask)
    logits.float()[mask.bool()].logsumexp(-1).sum().backward()
    return logits.detach(), W._expert_grads(model)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("experts", "dispatcher"), [("libalign", "allgather"),
                                                     ("te_grouped", "alltoall")])
def test_per_expert_linears_are_todays_stack_bitwise(hf_sd, path, experts, dispatcher):
    """Same weights, same batch: logits and every expert gradient equal (atol=0)."""
    ref_logits, ref_grads = _run(hf_sd, path, experts, dispatcher, "stack")
    logits, grads = _run(hf_sd, path, experts, dispatcher, "per_expert")
    assert torch.equal(logits, ref_logits)
    assert set(grads) == set(ref_grads)
    for k, g in grads.items():
        assert g.abs().sum() > 0 and torch.equal(g, ref_grads[k]), k


def test_slime_converter_gives_back_the_checkpoint(hf_sd):
    """The provider's model, loaded from a Hugging Face checkpoint, renamed and cut as slime's /
    Miles' ``convert_qwen3moe_to_hf`` does (the table in qwen3moe_name_table.py; experts per
    expert: ``linear_fc1.weight{e}`` -> gate/up of ``e``), is that checkpoint bit for bit, and
    libalign's ``per_expert`` export holds exactly those names and tensors. The local spec's
    ``input_layernorm`` is renamed to the Transformer Engine name the converter knows
    (``self_attention.linear_qkv.layer_norm_weight``, the same tensor). Slicing moves no bits,
    so every comparison is ``torch.equal``."""
    cfg = W.config()
    tcfg = mg.transformer_config_from_hf(cfg)
    model = W.build(tcfg, "nvfp4_minite")
    mx.load_hf_into_megatron(model, hf_sd, cfg)
    got = {}
    for name, p in model.named_parameters():
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        got.update(names.to_hf(name, p.detach(), heads=cfg.num_attention_heads,
                               groups=cfg.num_key_value_heads, head_dim=cfg.head_dim))
    assert {"model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
            "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate.weight",
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(got)
    want = mx.fuse_experts([got], cfg.num_experts)
    assert set(want) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(want[k], v), k
    ours = mx.export_hf_state_dict(model, cfg, expert_layout="per_expert")
    assert set(ours) == set(got) and all(torch.equal(ours[k], got[k]) for k in got)


def test_name_table_cuts_qkv_and_fc1_as_slime_does():
    """The table's cuts on a labelled tensor: fc1's first half of rows is gate, its second up;
    a 4-head, 2-group qkv holds per group two query heads, one key, one value; names carry the
    layer and the global expert index."""
    fc1 = torch.arange(8.0).reshape(4, 2)
    out = names.to_hf("decoder.layers.5.mlp.experts.linear_fc1.weight7", fc1, heads=4, groups=2,
                      head_dim=1)
    assert list(out) == ["model.layers.5.mlp.experts.7.gate_proj.weight",
                         "model.layers.5.mlp.experts.7.up_proj.weight"]
    assert out["model.layers.5.mlp.experts.7.up_proj.weight"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    rows = ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]
    qkv = torch.arange(8.0).unsqueeze(-1)
    out = names.to_hf("decoder.layers.2.self_attention.linear_qkv.weight", qkv, heads=4, groups=2,
                      head_dim=1)
    got = {k.split(".")[-2]: [rows[int(x)] for x in v.reshape(-1).tolist()] for k, v in out.items()}
    assert got == {"q_proj": ["q0", "q1", "q2", "q3"], "k_proj": ["k0", "k1"], "v_proj": ["v0", "v1"]}
    assert names.hf_names("decoder.layers.1.mlp.shared_experts.gate_weight") == (
        "model.layers.1.mlp.shared_expert_gate.weight",)
    assert names.hf_names("decoder.layers.1.pre_mlp_layernorm.weight") == (
        "model.layers.1.post_attention_layernorm.weight",)


def test_sharded_state_dict_is_megatrons_sequential_layout(megatron_world):
    """Distributed-checkpoint keys, global shapes and offsets of the experts equal those of
    Megatron's own ``SequentialMLP`` (TE's grouped layout is interchangeable with it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    tcfg = mg.transformer_config_from_hf(W.config())
    ours = W.build(tcfg, "bf16")
    seq = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_decoder_block_spec(
        tcfg, use_transformer_engine=False), vocab_size=W.config().vocab_size,
        max_sequence_length=64, position_embedding_type="rope")

    def experts(model):
        out = {}
        for k, v in model.sharded_state_dict().items():
            if ".experts." in k and not k.endswith("_extra_state"):
                out[k] = (v.key, tuple(getattr(v, "global_shape", v.data.shape)),
                          tuple(getattr(v, "global_offset", ())))
        return out
    a, b = experts(ours), experts(seq)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"  # layer and expert: offsets
    assert len(a) == 2 * 2 * 8
    assert {v for v in a.values()} == {v for v in b.values()}, (sorted(a.items())[:2],
                                                                sorted(b.items())[:2])
    assert any(v[0] == key for v in a.values())


def test_unsupported_layouts_are_refused_by_option_name(megatron_world):
    """flex without DeepEP kernels (always on a CPU), expert tensor parallelism and biases
    raise ConfigError naming the option to change."""
    tcfg = mg.transformer_config_from_hf(W.config())
    flex = SimpleNamespace(**{**vars(tcfg), "moe_token_dispatcher_type": "flex"})
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type flex"):
        check_config(flex)
    etp = SimpleNamespace(**{**vars(tcfg), "expert_tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 1"):
        check_config(etp)
    with pytest.raises(ConfigError, match="--disable-bias-linear"):
        check_config(SimpleNamespace(**{**vars(tcfg), "add_bias_linear": True}))
    sp = SimpleNamespace(**{**vars(tcfg), "sequence_parallel": True})
    with pytest.raises(ConfigError, match="numerics='qwen3'"):
        make_spec("bf16")(SimpleNamespace(transformer_impl="local"), sp, None)


@pytest.fixture(scope="module")
def tp2_ep2():
    """Two ranks, TP 2 x EP 2 (experts not tensor-split), shared experts, alltoall, one launch."""
    return launch(W.parity_and_step, 2, args=("nvfp4_minite", "alltoall", True),
                  expert_model_parallel_size=2, tensor_model_parallel_size=2, backend="gloo",
                  timeout_s=300)


def test_tp2_ep2_per_expert_equals_stack_and_trains_in_megatrons_step(tp2_ep2):
    """On each rank: forward logits and all gradients (experts, shared experts, attention)
    equal bitwise; Megatron's DDP + schedule step gives the same losses and weights bitwise;
    the weights moved and every parameter got a gradient."""
    assert [r["tp"] for r in tp2_ep2] == [(0, 2), (1, 2)]
    assert [r["ep"] for r in tp2_ep2] == [(0, 2), (1, 2)]
    for r in tp2_ep2:
        assert r["logits_equal"] and r["expert_grads_equal"] and r["expert_grads_nonzero"]
        assert r["other_grads_equal"]
        assert r["step"]["loss"] == r["step_stacked"]["loss"]
        assert r["step"]["grads_nonzero"] == r["step"]["params"]
        assert r["moved"] and r["step_experts_equal"] and r["step_other_equal"]


def test_tp2_ep2_names_attributes_and_shared_experts_are_what_slime_reads(tp2_ep2):
    """Per-expert ``weight{i}`` names with Transformer Engine's tensor-parallel attributes
    (what slime's ``all_gather_param`` asserts), shared experts with their gate, and each
    rank's experts renamed by slime's offset rule cover global experts 0..7 once."""
    for r in tp2_ep2:
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in r["names"]
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight4" not in r["names"]
        assert r["attrs"] == [(True, 0, 1, False)] * 2
        assert "decoder.layers.1.mlp.shared_experts.gate_weight" in r["shared_params"]
    experts = {}
    for r in tp2_ep2:
        for name in r["hf_experts_before"]:
            for k in names.hf_names(name.removeprefix("module.module.")):
                experts[k] = experts.get(k, 0) + 1
    want = {f"model.layers.{i}.mlp.experts.{e}.{w}.weight" for i in range(2) for e in range(8)
            for w in ("gate_proj", "up_proj", "down_proj")}
    assert set(experts) == want and set(experts.values()) == {1}


def test_the_docs_spec_snippet_runs():
    """docs/snippets/megatron_spec.py (docs/engines/slime.md) builds the model as slime's
    provider does and runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "snippets" / "megatron_spec.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "linear_fc1.weight0 ... decoder.layers.0.mlp.experts.linear_fc2.weight7" in out.stdout
    assert "'nvfp4_minite'" in out.stdout
