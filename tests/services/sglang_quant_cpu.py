"""SGLang's own layers on the CPU with libalign's minite method, against libalign's sampler path.

Run by tests/services/test_sglang_quant.py in a subprocess whose path holds the SGLang
install of tests/services/sglang_cpu.txt; prints one ``ok <check>`` line per check passed.

What it builds: a single-rank parallel state through SGLang's public functions
(``runtime_context.publish`` of ``ServerArgs``, ``init_distributed_environment`` and
``initialize_model_parallel`` on gloo), a ``MergedColumnParallelLinear`` (gate/up of a dense
MLP) and a ``FusedMoE`` whose quantization method is the one ``--quantization
libalign_minite`` selects; loads ``minite`` bits (libalign.checkpoint.to_modelopt with row
scales, per expert and per projection as the ModelOpt export names them) through SGLang's
weight loaders, runs the forward, and compares with libalign's sampler path on the same bits:
the tiny Qwen3-MoE's experts with the path ``nvfp4_minite`` and the bits installed
(libalign.models.paths), and libalign.gemm.grouped_linear for the linear layer. Last, the
same layers loaded from the files the ModelOpt exporter writes for a row-scaled version
(alignd.formats.modelopt_export: a weight-store version of minite expert stacks and a dense
gate/up pair, with its config.json read through SGLang's registry), against libalign's path on
the store's bits. Then a refit into SGLang's own Qwen3MoeForCausalLM (libalign's tiny model's
sizes): libalign's Hugging Face tensors streamed by alignd.sync.stream.quantize_named into
staged refit buckets (alignd.sync.tensor.send_tensor_refit), each deserialized and handed to
alignd.sync.tensor.load_refit as SGLang's update_weights_from_tensor does with a custom loader,
the version applied through the model's own load_weights, the layers prepared by SGLang's
DefaultModelLoader.postprocess_weights as its end_weight_update does; compared layer by layer
(MoE blocks, q/k/v and o projections) with libalign's nvfp4_minite path, and for the
tensor-scaled modelopt preset loaded into SGLang's modelopt_fp4 layers, parameter by parameter
with the streamed bits. Last, alignd's deterministic attention backends against SGLang's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

# torchvision 0.28's Python code registers fake kernels for two of its C++ ops without checking
# that its C++ library loaded, which a PyPI (CUDA) torchvision cannot on a CPU torch; SGLang
# imports torchvision on the way to its layers. Declaring the two schemas lets it import; no
# torchvision op is called here.
_tv = torch.library.Library("torchvision", "FRAGMENT")
_tv.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_tv.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

# SGLang's RotaryEmbedding imports its fallback rotary kernel from vllm when it is built on a
# host that is neither CUDA nor its CPU engine (which needs sgl_kernel); building SGLang's
# Qwen3-MoE model class here needs that import to succeed. No attention runs in these checks,
# so the stand-in only raises.
_vllm, _vllm_ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")


def _no_rotary_kernel(*_args, **_kwargs):
    raise NotImplementedError("no attention runs in these checks")


_vllm_ops.rotary_embedding = _no_rotary_kernel
_vllm._custom_ops = _vllm_ops
sys.modules.setdefault("vllm", _vllm)
sys.modules.setdefault("vllm._custom_ops", _vllm_ops)

# the caller's port, never an inherited one (a pytest process that ran the Megatron tests
# carries their MASTER_PORT, which may be taken by now)
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = sys.argv[1] if len(sys.argv) > 1 else "29741"

from alignclient.errors import InputError  # noqa: E402
from alignd.formats.modelopt_export import ModelOptExport  # noqa: E402
from alignd.formats.selection import make_select  # noqa: E402
from alignd.formats.weight_store import WeightStore  # noqa: E402
from alignd.infra.redis_clients import binary_client, reset_embedded  # noqa: E402
from alignd.infra.settings import GuidanceStoreSettings  # noqa: E402
from alignd.infra.stores.guidance import GuidanceStore  # noqa: E402
from alignd.sampler import sglang_quant as sq  # noqa: E402
from alignd.sampler.sglang_server import DETERMINISTIC_ATTENTION_BACKENDS  # noqa: E402
from alignd.sync.stream import quantize_named  # noqa: E402
from alignd.sync.tensor import deserialize, load_refit, receiver_for, send_tensor_refit  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt.distributed.parallel_state import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from sglang.srt.layers.linear import MergedColumnParallelLinear  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import initialize_moe_config  # noqa: E402
from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config  # noqa: E402
from sglang.srt.layers.quantization.modelopt_quant import (  # noqa: E402
    ModelOptFp4Config,
    ModelOptFp4LinearMethod,
    ModelOptNvFp4FusedMoEMethod,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: E402
from sglang.srt.model_loader.utils import set_default_torch_dtype  # noqa: E402
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.server_args import (  # noqa: E402
    DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
    QUANTIZATION_CHOICES,
    ServerArgs,
)

from libalign import gemm  # noqa: E402
from libalign.checkpoint import to_modelopt  # noqa: E402
from libalign.guidance import row_keys  # noqa: E402
from libalign.kernels import ops  # noqa: E402
from libalign.models import paths  # noqa: E402
from libalign.models.config import build_model, tiny_config  # noqa: E402
from libalign.models.guided import capture_guidance  # noqa: E402
from libalign.spec import PRESETS  # noqa: E402

MINITE = PRESETS["minite"]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
        if b.dtype == torch.bfloat16 else b)


def publish_args(**kw) -> None:
    """Publish one CPU rank's server arguments (``kw`` added) and the MoE flags they set."""
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu", **kw),
            role="test", ranks=SpawnRanks(world_rank=0))
    initialize_moe_config()


def setup() -> None:
    publish_args()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")


def check_registration() -> sq.MiniteConfig:
    sq.register()
    sq.register()  # idempotent
    assert get_quantization_config(sq.NAME) is sq.MiniteConfig
    assert QUANTIZATION_CHOICES.count(sq.NAME) == 1 and sq.NAME in QUANTIZATION_METHODS
    cfg = sq.MiniteConfig.from_config(sq.quantization_config(["lm_head"]))
    assert cfg.get_name() == sq.NAME and cfg.exclude_modules == ["lm_head"]
    for bad in ({"quant_method": "modelopt_fp4"}, {"quant_method": sq.NAME, "spec": "modelopt"}):
        try:
            sq.MiniteConfig.from_config(bad)
        except sq.ConfigError:
            continue
        raise AssertionError(f"accepted {bad}")
    print("ok registration")
    return cfg


def check_linear(cfg: sq.MiniteConfig) -> None:
    torch.manual_seed(0)
    k, n = 96, 48
    layer = MergedColumnParallelLinear(k, [n, n], bias=False, params_dtype=torch.bfloat16,
                                       quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")
    assert isinstance(layer.quant_method, sq.MiniteLinearMethod)
    assert layer.weight_scale_2.shape == (2 * n, 1)
    for name in ("weight", "weight_scale", "weight_scale_2"):  # what register() asks SGLang for
        assert getattr(layer, name).weight_loader == layer.weight_loader_v2, name
    w = torch.randn(2 * n, k).to(torch.bfloat16) * torch.logspace(-3, 1, 2 * n).reshape(-1, 1).bfloat16()
    q = ops.quantize(w, MINITE)
    for shard, rows in ((0, slice(0, n)), (1, slice(n, 2 * n))):  # gate, then up, as a model loads
        part = to_modelopt(gemm.take_rows(q, torch.arange(2 * n)[rows]), row_scaled_ok=True)
        for name, t in part.items():  # as a model's load_weights calls it
            param = getattr(layer, name)
            param.weight_loader(param, t, shard)
    layer.quant_method.process_weights_after_loading(layer)
    x = (torch.randn(2, 5, k) * torch.logspace(-2, 2, 5).reshape(1, 5, 1)).to(torch.bfloat16)
    x[0, 1] = 0  # an all-zero row
    got, _ = layer(x)
    q3 = gemm.take_rows(q, torch.arange(2 * n))
    ref_w = gemm.weights_from_quantized(
        type(q3)(q3.codes[None], q3.block_scales[None], q3.outer_scale[None], MINITE, (1, 2 * n, k)),
        "nvfp4_minite")
    a = x.reshape(-1, k)
    want = gemm.grouped_linear(a, ref_w, [a.shape[0]]).reshape(2, 5, 2 * n)
    assert bits_equal(got, want), (got - want).abs().max()
    rel = ((got.float() - (x.float() @ w.float().T)).norm() / (x.float() @ w.float().T).norm()).item()
    assert rel < 0.25, rel  # the quantized product is near the bf16 one (a wiring check)
    try:  # what a row-parallel layer on one of two ranks asks for: half of K
        sq.MiniteLinearMethod(cfg).create_weights(torch.nn.Module(), k // 2, [n], k, n,
                                                  torch.bfloat16)
    except sq.ConfigError as e:
        assert "splits K" in str(e)
    else:
        raise AssertionError("a K split across ranks was accepted")
    print("ok linear")


def moe_checkpoint(ex: torch.nn.Module) -> tuple[dict, object, object]:
    """The experts' minite bits as the ModelOpt export names them, and the two stacks."""
    qgu = ops.quantize(ex.gate_up_proj.detach(), MINITE)
    qd = ops.quantize(ex.down_proj.detach(), MINITE)
    e, two_i, _ = qgu.shape
    ckpt = {}
    for x in range(e):
        gu, d = qgu.expert(x), qd.expert(x)
        for name, rows in (("gate_proj", slice(0, two_i // 2)), ("up_proj", slice(two_i // 2, two_i))):
            part = to_modelopt(gemm.take_rows(gu, torch.arange(two_i)[rows]), row_scaled_ok=True)
            ckpt.update({f"experts.{x}.{name}.{k}": t for k, t in part.items()})
        ckpt.update({f"experts.{x}.down_proj.{k}": t
                     for k, t in to_modelopt(d, row_scaled_ok=True).items()})
    return ckpt, qgu, qd


def load_moe(layer: FusedMoE, ckpt: dict, num_experts: int) -> None:
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=num_experts)
    params = dict(layer.named_parameters())
    loaded = 0
    for name, tensor in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            pname = name.replace(weight_name, param_name)
            param = params[pname.removeprefix("experts.")]
            param.weight_loader(param, tensor, pname, shard_id=shard_id, expert_id=expert_id)
            loaded += 1
            break
    assert loaded == len(ckpt), (loaded, len(ckpt))
    layer.quant_method.process_weights_after_loading(layer)


def check_moe(cfg: sq.MiniteConfig) -> None:
    config = tiny_config()
    model = build_model(config, seed=3)
    layer_id = paths.moe_layer_indices(model)[0]
    ex = paths.experts_module(model, layer_id)
    e, two_i, h = ex.gate_up_proj.shape
    top_k = config.num_experts_per_tok
    ckpt, qgu, qd = moe_checkpoint(ex)

    moe = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=two_i // 2, layer_id=layer_id,
                   top_k=top_k, params_dtype=torch.bfloat16, quant_config=cfg,
                   prefix=f"model.layers.{layer_id}.mlp.experts")
    assert isinstance(moe.quant_method, sq.MiniteMoEMethod)
    assert moe.w13_weight_scale_2.shape == (e, two_i, 1)
    load_moe(moe, ckpt, e)
    assert torch.equal(moe.w13_weight.data, qgu.codes) and torch.equal(moe.w2_weight.data, qd.codes)
    assert torch.equal(moe.w13_weight_scale_2.data.reshape(e, two_i), qgu.outer_dec)

    # libalign's sampler path on the same bits (what the embedded sampler loads)
    paths.install_prepared_weights(ex, "nvfp4_minite", "gate_up_proj",
                                   gemm.weights_from_quantized(qgu, "nvfp4_minite"))
    paths.install_prepared_weights(ex, "nvfp4_minite", "down_proj",
                                   gemm.weights_from_quantized(qd, "nvfp4_minite"))
    paths.set_path(model, "nvfp4_minite")

    torch.manual_seed(1)
    tokens = 23
    x = (torch.randn(tokens, h) * torch.logspace(-2, 1, tokens).reshape(-1, 1)).to(torch.bfloat16)
    x[4] = 0
    logits = torch.randn(tokens, e)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ids[:, 0] = torch.where(torch.arange(tokens) < 3, 0, ids[:, 0])  # crowd expert 0 a little
    ids[:3, 1] = 1
    topk = StandardTopKOutput(topk_weights=w, topk_ids=ids.to(torch.int32), router_logits=logits)
    got = moe(x, topk)
    want = ex(x, ids, w)
    assert bits_equal(got, want), (got.float() - want.float()).abs().max()
    direct = moe.quant_method.apply(moe, type("Dispatched", (), {"hidden_states": x,
                                                                  "topk_output": topk})())
    assert bits_equal(direct.hidden_states, want)
    with paths.use_path(model, "nvfp4_naive"):  # the comparison sees a recipe change
        assert not bits_equal(got, ex(x, ids, w))
    # masked slots (topk id -1, as padded batches carry) add nothing: expert 0 at weight 0
    ids_pad = ids.clone()
    ids_pad[5, 1] = -1
    padded = moe(x, StandardTopKOutput(topk_weights=w, topk_ids=ids_pad.to(torch.int32),
                                       router_logits=logits))
    w_pad = w.clone()
    w_pad[5, 1] = 0
    assert bits_equal(padded, ex(x, torch.where(ids_pad < 0, 0, ids_pad), w_pad))
    print("ok moe forward")

    # a weight update reloads the parameters and prepares them again (update_weights_from_disk)
    with torch.no_grad():
        ex.gate_up_proj.mul_(-0.5)
        ex.down_proj.mul_(2.0)
    ckpt2, qgu2, qd2 = moe_checkpoint(ex)
    load_moe(moe, ckpt2, e)
    paths.install_prepared_weights(ex, "nvfp4_minite", "gate_up_proj",
                                   gemm.weights_from_quantized(qgu2, "nvfp4_minite"))
    paths.install_prepared_weights(ex, "nvfp4_minite", "down_proj",
                                   gemm.weights_from_quantized(qd2, "nvfp4_minite"))
    reloaded = moe(x, topk)
    assert bits_equal(reloaded, ex(x, ids, w)) and not bits_equal(reloaded, got)
    got = reloaded
    print("ok reload")

    # capture: guidance rows and routed experts, against libalign's own capture on that path
    seqs = torch.tensor([7] * 10 + [9] * 13)
    pos = torch.cat([torch.arange(10), torch.arange(13)])
    keys = row_keys(seqs, pos)
    cap = sq.RecordCapture([layer_id], e)
    cfg.capture = cap
    server_model = ServerModel(moe)  # what SGLang's model forward receives: ids, positions, batch
    handle = cap.watch(server_model, lambda rid: int(rid.removeprefix("r")))
    got_c = server_model(torch.zeros(tokens, dtype=torch.long), pos,
                         forward_batch(ForwardMode.EXTEND, ["r7", "r9"], pos, [10, 13]), x, topk)
    handle.remove()
    cfg.capture = None
    assert torch.equal(cap.keys, keys)
    assert bits_equal(got_c, got), "capture changed the output"
    paths.set_row_keys(model, keys.reshape(1, -1))
    with capture_guidance(model, [layer_id]) as ref:
        ex(x, ids, w)
    mine, theirs = cap.guidance_records(4), ref.records(4)
    assert sorted(mine) == sorted(theirs) == [7, 9]
    for sid in mine:
        assert mine[sid].encode() == theirs[sid].encode(), sid
    routing = cap.routing_records("v1")
    assert sorted(routing) == [7, 9]
    assert torch.equal(routing[9].experts[:, 0].long(), ids[10:].long())
    assert routing[7].version == "v1"
    # into the guidance store (the embedded one): the same bytes, routing back by rollout id
    reset_embedded()
    store = GuidanceStore(binary_client(GuidanceStoreSettings(redis_url=None)), prefix="t")
    try:
        cap.store_records(store, "v1", {7: "r7", 8: "r8"}, bits=4)
        raise AssertionError("a sequence that was not captured must be refused")
    except InputError as e:
        assert "[8]" in str(e)
    assert not store.get_many("v1", ["r7"], missing="skip")
    back = cap.store_records(store, "v1", {7: "r7", 9: "r9"}, bits=4)
    assert store.get("v1", "r9") == theirs[9].encode() and store.get("v1", "r7") == theirs[7].encode()
    assert sorted(back) == ["r7", "r9"] and torch.equal(back["r9"].experts, routing[9].experts)
    assert cap.guidance_records(4) == {} and cap.routing_records("v1") == {}
    reset_embedded()
    print("ok capture")


class ServerModel(torch.nn.Module):
    """Stands where SGLang's model sits: forward(input_ids, positions, forward_batch, ...)."""

    def __init__(self, moe: FusedMoE):
        super().__init__()
        self.moe = moe

    def forward(self, input_ids, positions, forward_batch, hidden, topk):
        return self.moe(hidden, topk)


def forward_batch(mode, rids, positions, extend_lens=None) -> ForwardBatch:
    n = positions.numel()
    return ForwardBatch(forward_mode=mode, batch_size=len(rids), input_ids=torch.zeros(n, dtype=torch.long),
                        req_pool_indices=torch.arange(len(rids)), seq_lens=torch.ones(len(rids)),
                        out_cache_loc=torch.arange(n), seq_lens_sum=n, positions=positions,
                        extend_seq_lens_cpu=extend_lens, rids=rids)


def check_batch_keys() -> None:
    seq_of = {"a": 3, "b": 5}.get  # "c" has no sequence id: not captured
    pos = torch.tensor([4, 0, 1, 2, 7, 0])
    keys = sq.batch_row_keys(forward_batch(ForwardMode.EXTEND, ["a", "b", "c"], pos, [1, 3, 1]), seq_of)
    want = torch.cat([row_keys(3, pos[:1]), row_keys(5, pos[1:4]), torch.tensor([-1, -1])])
    assert torch.equal(keys, want), (keys, want)
    pos = torch.tensor([9, 12, 0])  # two decoding requests and one padding row
    keys = sq.batch_row_keys(forward_batch(ForwardMode.DECODE, ["b", "a"], pos), seq_of)
    assert torch.equal(keys, torch.stack([row_keys(5, pos[0]), row_keys(3, pos[1]),
                                          torch.tensor(-1)]))
    print("ok batch keys")


def check_export() -> None:
    """A minite store version, exported by ModelOptExport, loaded from its files into SGLang's
    layers with the config the files name: libalign's nvfp4_minite path on the store's bits."""
    config = tiny_config()
    model = build_model(config, seed=5)
    layer_id = paths.moe_layer_indices(model)[0]
    ex = paths.experts_module(model, layer_id)
    e, two_i, h = ex.gate_up_proj.shape
    pre = f"model.layers.{layer_id}.mlp"
    g = torch.Generator().manual_seed(6)
    dense = {f"{pre}.shared.{p}.weight": (torch.randn(48, h, generator=g) * s).bfloat16()
             for p, s in (("gate_proj", 0.02), ("up_proj", 3.0))}  # scales far apart
    sd = {f"{pre}.experts.gate_up_proj": ex.gate_up_proj.detach().clone(),
          f"{pre}.experts.down_proj": ex.down_proj.detach().clone(),
          f"{pre}.gate.weight": torch.randn(e, h, generator=g).bfloat16(),
          "lm_head.weight": torch.randn(8, h, generator=g).bfloat16(), **dense}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model").mkdir()
        (Path(tmp) / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
        store = WeightStore(Path(tmp) / "store")
        store.write_version("m1", sd, MINITE, select=make_select(all_linear=True))
        out = ModelOptExport(store, Path(tmp) / "model")("m1", sq.PATH)
        files = {}
        for shard in set(json.loads((out / "model.safetensors.index.json").read_text())
                         ["weight_map"].values()):
            files.update(load_file(out / shard))
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc == json.loads((out / "hf_quant_config.json").read_text())
        sv = store.read_version("m1")
        qgu, qd = sv[f"{pre}.experts.gate_up_proj"], sv[f"{pre}.experts.down_proj"]
        qg, qu = (sv[f"{pre}.shared.{p}.weight"] for p in ("gate_proj", "up_proj"))
    cfg = get_quantization_config(qc["quant_method"]).from_config(qc)
    assert isinstance(cfg, sq.MiniteConfig) and f"{pre}.gate" in cfg.exclude_modules

    moe = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=two_i // 2, layer_id=layer_id,
                   top_k=config.num_experts_per_tok, params_dtype=torch.bfloat16,
                   quant_config=cfg, prefix=f"{pre}.experts")
    ckpt = {k.removeprefix(f"{pre}."): t for k, t in files.items() if k.startswith(f"{pre}.experts.")}
    assert len(ckpt) == 3 * 3 * e  # gate, up, down of each expert: weight, scale, scale_2
    load_moe(moe, ckpt, e)
    assert torch.equal(moe.w13_weight_scale_2.data.reshape(e, two_i), qgu.outer_dec.float())
    paths.install_prepared_weights(ex, sq.PATH, "gate_up_proj", gemm.weights_from_quantized(qgu, sq.PATH))
    paths.install_prepared_weights(ex, sq.PATH, "down_proj", gemm.weights_from_quantized(qd, sq.PATH))
    paths.set_path(model, sq.PATH)
    torch.manual_seed(7)
    tokens = 19
    x = (torch.randn(tokens, h) * torch.logspace(-2, 1, tokens).reshape(-1, 1)).to(torch.bfloat16)
    logits = torch.randn(tokens, e)
    w, ids = torch.topk(torch.softmax(logits, -1), config.num_experts_per_tok, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    got = moe(x, StandardTopKOutput(topk_weights=w, topk_ids=ids.to(torch.int32), router_logits=logits))
    assert bits_equal(got, ex(x, ids, w)), (got.float() - ex(x, ids, w).float()).abs().max()

    n = qg.shape[0]
    layer = MergedColumnParallelLinear(h, [n, n], bias=False, params_dtype=torch.bfloat16,
                                       quant_config=cfg, prefix=f"{pre}.shared.gate_up_proj")
    assert isinstance(layer.quant_method, sq.MiniteLinearMethod)
    for shard, proj in enumerate(("gate_proj", "up_proj")):
        for key in ("weight", "weight_scale", "weight_scale_2"):
            param = getattr(layer, key)
            param.weight_loader(param, files[f"{pre}.shared.{proj}.{key}"], shard)
    layer.quant_method.process_weights_after_loading(layer)
    a = x[:7]
    cat = type(qg)(torch.cat([qg.codes, qu.codes])[None], torch.cat([qg.block_scales, qu.block_scales])[None],
                   torch.cat([qg.outer_scale, qu.outer_scale])[None], MINITE, (1, 2 * n, h))
    want = gemm.grouped_linear(a, gemm.weights_from_quantized(cat, sq.PATH), [a.shape[0]])
    got_l, _ = layer(a)
    assert bits_equal(got_l, want), (got_l.float() - want.float()).abs().max()
    print("ok export")


# --- a refit into SGLang's own model class ------------------------------------------------------

CPU = torch.device("cpu")


def sglang_model(config, quant_config) -> Qwen3MoeForCausalLM:
    """SGLang's Qwen3-MoE model class for ``config``, built as its loader builds it: bf16
    parameters, the model's packed-module names given to the quantization config."""
    quant_config.update_packed_modules_mapping(dict(Qwen3MoeForCausalLM.packed_modules_mapping))
    with set_default_torch_dtype(torch.bfloat16):
        return Qwen3MoeForCausalLM(config, quant_config=quant_config)


class InProcessServer:
    """What an SGLang server does with a weight-update session, on one model in this process:
    ``begin_weight_update`` and ``end_weight_update`` run SGLang's loader steps
    (``DefaultModelLoader.restore_weights_before_loading`` / ``postprocess_weights``, which
    call each layer's ``process_weights_after_loading``), and ``update_weights_from_tensor``
    with the custom loader deserializes the rank's payload and calls the loader, as SGLang's
    ``WeightUpdater`` does. ``postprocess``: False where the method's step needs CUDA."""

    def __init__(self, model: torch.nn.Module, postprocess: bool = True):
        self.model, self.postprocess = model, postprocess
        self.calls: list[tuple] = []

    def begin_weight_update(self) -> dict:
        DefaultModelLoader.restore_weights_before_loading(self.model, CPU)
        return {"success": True, "message": ""}

    def update_weights_from_tensor(self, *, serialized_named_tensors, load_format, flush_cache,
                                   weight_version) -> dict:
        assert load_format == "alignd.sync.tensor.load_refit", load_format
        self.calls.append((flush_cache, weight_version))
        load_refit(self.model, deserialize(serialized_named_tensors[0]))
        return {"success": True, "message": "Success"}

    def end_weight_update(self) -> dict:
        if self.postprocess:
            DefaultModelLoader.postprocess_weights(self.model, CPU)
        return {"success": True, "message": ""}


def refit(server: InProcessServer, ref: torch.nn.Module, version: str, spec: str) -> None:
    """One staged refit of ``ref``'s Hugging Face tensors (every linear layer quantized) in
    buckets small enough that a version takes several; the model is untouched until the last."""
    first = next(p for n, p in server.model.named_parameters() if n.endswith("w13_weight"))
    before = first.detach().clone()
    seen: list[bool] = []
    inner = server.update_weights_from_tensor

    def watching(**kw):
        seen.append(torch.equal(first, before))
        return inner(**kw)

    server.update_weights_from_tensor = watching
    server.begin_weight_update()
    report = send_tensor_refit(list(ref.state_dict().items()), server, version_id=version,
                               spec=spec, all_linear=True, bucket_bytes=64 << 10)
    server.end_weight_update()
    assert report.buckets >= 4 and all(seen), (report.buckets, seen)
    assert server.calls[-1] == (True, version) and server.calls[-2] == (False, None)
    assert receiver_for(server.model).applied[-1] == version


def check_model_refit(cfg_dict: dict) -> None:
    """libalign's tiny Qwen3-MoE streamed by quantize_named("minite") in refit buckets into
    SGLang's Qwen3MoeForCausalLM (built with libalign_minite) through the model's own
    load_weights (the staged receiver's apply): every MoE block (router, top-k, experts) and
    the fused q/k/v and o projections give libalign's nvfp4_minite sampler path on the same
    inputs bit for bit, for a first version and for the next one that replaces it. Layer by
    layer, not the full model's forward: attention does not run here (SGLang's rotary
    embedding would call vllm's kernel on this host, and its attention backends read the KV
    pools of a running scheduler)."""
    config = tiny_config()
    ref = build_model(config, seed=11)
    model = sglang_model(config, sq.MiniteConfig.from_config(cfg_dict))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, sq.MiniteLinearMethod)
    server = InProcessServer(model)
    refit(server, ref, "v1", "minite")
    paths.set_path(ref, sq.PATH)

    torch.manual_seed(12)
    tokens, h = 21, config.hidden_size
    x = (torch.randn(tokens, h) * torch.logspace(-2, 1, tokens).reshape(-1, 1)).to(torch.bfloat16)
    x[3] = 0

    def same_as_libalign(what: str) -> None:
        with torch.no_grad():
            for i, (mine, theirs) in enumerate(zip(model.model.layers, ref.model.layers, strict=True)):
                got, want = mine.mlp(x), theirs.mlp(x[None]).reshape(tokens, h)
                assert bits_equal(got, want), (what, i, (got.float() - want.float()).abs().max())
                att = theirs.self_attn
                qkv = ops.quantize(torch.cat([att.q_proj.weight, att.k_proj.weight,
                                              att.v_proj.weight]), MINITE)
                for layer, q in ((mine.self_attn.qkv_proj, qkv),
                                 (mine.self_attn.o_proj, ops.quantize(att.o_proj.weight, MINITE))):
                    assert torch.equal(layer.weight.data, q.codes), (what, i)
                    n, k = q.shape
                    w = gemm.weights_from_quantized(type(q)(
                        q.codes[None], q.block_scales[None], q.outer_scale[None], MINITE,
                        (1, n, k)), sq.PATH)
                    got_l, _ = layer(x)
                    assert bits_equal(got_l, gemm.grouped_linear(x, w, [tokens])), (what, i)

    same_as_libalign("v1")
    with torch.no_grad():
        v1 = model.model.layers[0].mlp(x)  # the next version: new weights replace the old ones whole
        for name, p in ref.named_parameters():
            if name.endswith(("experts.gate_up_proj", "q_proj.weight")):
                p.mul_(-0.5)
    paths.clear_weight_cache(ref)
    refit(server, ref, "v2", "minite")
    same_as_libalign("v2")
    with torch.no_grad():
        assert not bits_equal(model.model.layers[0].mlp(x), v1)
    print("ok model refit")


def check_modelopt_refit() -> None:
    """The same refit under the tensor-scaled ``modelopt`` preset into SGLang's own
    ``modelopt_fp4`` method (ModelOptFp4LinearMethod, ModelOptNvFp4FusedMoEMethod; SGLang
    builds its MoE method on this host only with the marlin MoE runner): every parameter the
    stream names holds the streamed bits exactly, fused siblings side by side (q/k/v rows,
    gate/up rows, and their per-sibling ``weight_scale_2``). Not its forward, nor
    process_weights_after_loading: both need SGLang's CUDA kernels (its dense FP4 GEMM, the
    marlin repack)."""
    publish_args(moe_runner_backend="marlin")
    config = tiny_config()
    ref = build_model(config, seed=13)
    qc = ModelOptFp4Config.from_config({"quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": ["lm_head"]}})
    model = sglang_model(config, qc)
    layer0 = model.model.layers[0]
    assert isinstance(layer0.self_attn.qkv_proj.quant_method, ModelOptFp4LinearMethod)
    assert isinstance(layer0.mlp.experts.quant_method, ModelOptNvFp4FusedMoEMethod)
    refit(InProcessServer(model, postprocess=False), ref, "m1", "modelopt")
    streamed = dict(quantize_named(ref.state_dict().items(), "modelopt", all_linear=True))
    params = {n: p.data for n, p in model.named_parameters()}
    checked = 0
    for i in range(config.num_hidden_layers):
        att = f"model.layers.{i}.self_attn"
        for key in ("weight", "weight_scale"):
            assert bits_equal(params[f"{att}.qkv_proj.{key}"], torch.cat(
                [streamed[f"{att}.{p}.{key}"] for p in ("q_proj", "k_proj", "v_proj")])), (i, key)
            assert bits_equal(params[f"{att}.o_proj.{key}"], streamed[f"{att}.o_proj.{key}"])
        assert torch.equal(params[f"{att}.qkv_proj.weight_scale_2"], torch.stack(
            [streamed[f"{att}.{p}.weight_scale_2"] for p in ("q_proj", "k_proj", "v_proj")]))
        assert torch.equal(params[f"{att}.o_proj.weight_scale_2"].reshape(()),
                           streamed[f"{att}.o_proj.weight_scale_2"])
        ex = f"model.layers.{i}.mlp.experts"
        for e in range(config.num_experts):
            gate, up, down = (f"{ex}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
            for key in ("weight", "weight_scale"):
                assert bits_equal(params[f"{ex}.w13_{key}"][e], torch.cat(
                    [streamed[f"{gate}.{key}"], streamed[f"{up}.{key}"]])), (i, e, key)
                assert bits_equal(params[f"{ex}.w2_{key}"][e], streamed[f"{down}.{key}"])
            assert torch.equal(params[f"{ex}.w13_weight_scale_2"][e], torch.stack(
                [streamed[f"{gate}.weight_scale_2"], streamed[f"{up}.weight_scale_2"]]).reshape(2))
            assert torch.equal(params[f"{ex}.w2_weight_scale_2"][e].reshape(()),
                               streamed[f"{down}.weight_scale_2"].reshape(()))
            checked += 1
    assert checked == config.num_hidden_layers * config.num_experts
    print("ok modelopt refit")


def check_deterministic_backends() -> None:
    """alignd's list of deterministic attention backends is SGLang's."""
    assert set(DETERMINISTIC_ATTENTION_BACKENDS) == set(DETERMINISTIC_ATTENTION_BACKEND_CHOICES), \
        (DETERMINISTIC_ATTENTION_BACKENDS, DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
    print("ok deterministic backends")


def main() -> None:
    setup()
    cfg = check_registration()
    check_linear(cfg)
    check_moe(cfg)
    check_batch_keys()
    check_export()
    check_model_refit(sq.quantization_config(["lm_head"]))
    check_modelopt_refit()  # last: it publishes other server arguments
    check_deterministic_backends()


if __name__ == "__main__":
    main()
