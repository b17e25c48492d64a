"""Rank bodies for the Transformer-Engine-layout tests (spawned by
:func:`libalign.models.megatron_parallel.launch`, so they live in an importable module).

One body builds, on every rank, the same Megatron GPT twice from the ``--spec`` provider
(:mod:`libalign.models.megatron_spec`): once with the per-expert grouped linears the provider
puts in ``TEGroupedMLP`` and once with today's stacked :class:`LibalignGroupedLinear` in the
same slots, both holding the same weights; it runs forward and backward through each and
then one training step through Megatron-core's own machinery (``DistributedDataParallel``,
``get_megatron_optimizer``, ``get_forward_backward_func``), as Megatron's ``pretrain`` does.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import torch

from libalign.models import megatron as mg
from libalign.models import megatron_export as mx
from libalign.models import tiny_config
from libalign.models.megatron_cpu import cpu_factories, cpu_shims
from libalign.models.megatron_modules import LibalignGroupedLinear
from libalign.models.megatron_spec import make_spec
from libalign.models.train import cpu_threads

CFG_KW = dict(num_hidden_layers=2, vocab_size=48, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32)
SHARED = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)


def config():
    return tiny_config(**CFG_KW)


def transformer_config(dispatcher: str, shared: bool):
    extra = SHARED if shared else {}
    return mg.transformer_config_from_hf(config(), moe_token_dispatcher_type=dispatcher, **extra)


def build(tcfg, path: str, *, stacked: bool = False, seed: int = 0):
    """A GPTModel from the provider's spec (``stacked``: today's stack in the linear slots)."""
    from megatron.core.models.gpt import GPTModel

    block = make_spec(path, numerics="qwen3")(SimpleNamespace(transformer_impl="local"), tcfg, None)
    if stacked:
        block = copy.deepcopy(block)
        for layer in block.layer_specs:
            subs = layer.submodules.mlp.submodules.experts.submodules
            subs.linear_fc1.module = subs.linear_fc2.module = LibalignGroupedLinear
    hf = config()
    with torch.random.fork_rng(devices=[]), cpu_shims():
        torch.manual_seed(seed)
        model = GPTModel(config=tcfg, transformer_layer_spec=block, vocab_size=hf.vocab_size,
                         max_sequence_length=64, position_embedding_type="rope",
                         rotary_base=mg.rope_theta(hf), share_embeddings_and_output_weights=False)
    return model.to(dtype=tcfg.params_dtype)


def copy_weights(src, dst) -> None:
    """``dst`` takes ``src``'s weights (per-expert or stacked experts, either way)."""
    s_sd, d_sd = src.state_dict(), dst.state_dict()
    new = {k: v for k, v in s_sd.items() if k in d_sd and not k.endswith("_extra_state")}
    for i, layer in mg.moe_layers(src).items():
        pre = f"decoder.layers.{i}.mlp.experts."
        esd = {k[len(pre):]: v for k, v in s_sd.items() if k.startswith(pre)}
        fc1, fc2 = mx.read_expert_stacks(esd, layer.num_local_experts)
        dsd = {k[len(pre):]: v for k, v in d_sd.items() if k.startswith(pre)}
        new.update({pre + k: v for k, v in mx.write_expert_stacks(dsd, fc1, fc2).items()})
    missing = set(k for k in d_sd if not k.endswith("_extra_state")) - set(new)
    assert not missing, sorted(missing)[:4]
    dst.load_state_dict(new, strict=False)


def batch(seed: int = 0, b: int = 2, s: int = 10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG_KW["vocab_size"], (b, s + 1), generator=g)


def _expert_grads(model) -> dict:
    out = {}
    for i, layer in mg.moe_layers(model).items():
        for name in ("linear_fc1", "linear_fc2"):
            lin = getattr(layer.experts, name)
            if isinstance(lin, mg.LibalignGroupedLinear) and hasattr(lin, "weight"):
                g = lin.weight.grad
            else:
                g = torch.stack([w.grad for w in lin.expert_weights()])
            out[f"{i}.{name}"] = g.clone()
    return out


def _other_grads(model) -> dict:
    return {k: p.grad.clone() for k, p in model.named_parameters()
            if ".experts." not in k and p.grad is not None}


def forward_backward(model, tokens):
    ids = tokens[:, :-1]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with cpu_shims():
        logits = model(ids, pos, None)
        logits.float().square().mean().backward()
    return logits.detach()


def train_step(model, tokens_list, lr: float = 1e-3) -> dict:
    """One step as Megatron's ``pretrain`` takes it: the model wrapped in Megatron-core's
    ``DistributedDataParallel`` (gradients in its fp32 buffers, reduced by
    ``finish_grad_sync``), ``len(tokens_list)`` micro-batches through
    ``get_forward_backward_func()`` with a ``forward_step`` and ``loss_func`` of ``pretrain``'s
    shape, then the update. Megatron's optimizer classes allocate ``device='cuda'`` tensors and
    check ``param.type() == 'torch.cuda.BFloat16Tensor'``, so the update is torch's Adam on the
    reduced ``main_grad`` (what Megatron's optimizer copies into its grads)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with cpu_shims():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            module=model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr, foreach=False)
        it = iter(tokens_list)

        def forward_step(data_iterator, m):
            tokens = next(data_iterator)
            ids, labels = tokens[:, :-1], tokens[:, 1:]
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            per_token = m(ids, pos, None, labels=labels)  # [b, s] vocab-parallel cross entropy

            def loss_func(out):
                loss = out.float().mean()
                return loss, {"lm loss": loss.detach()}
            return per_token, loss_func

        ddp.zero_grad_buffer()
        with cpu_factories():
            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=it, model=[ddp],
                num_microbatches=len(tokens_list), seq_length=tokens_list[0].shape[1] - 1,
                micro_batch_size=tokens_list[0].shape[0], forward_only=False)
        ddp.finish_grad_sync()
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
        opt.step()
    return {"loss": [float(x["lm loss"]) for x in losses],
            "grads_nonzero": sum(bool(p.main_grad.abs().sum() > 0) for p in params),
            "params": len(params)}


def expert_weights_hf(model, info) -> dict:
    """The experts as slime's weight sync names them before conversion (local index +
    ``ep_rank * num_experts // ep_size``, slime/backends/megatron_utils/update_weight/common.py)."""
    out = {}
    offset = info.ep_rank * CFG_KW["num_experts"] // info.ep_size
    for name, p in model.named_parameters():
        m = re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.(.+)\.weight(\d+)$", name)
        if m:
            out[f"module.module.decoder.layers.{m[1]}.mlp.experts.{m[2]}.weight{int(m[3]) + offset}"] = \
                p.detach().clone()
    return out


def parity_and_step(info, path: str, dispatcher: str, shared: bool):
    """Per-expert vs stacked experts on the same weights: logits and gradients of a forward/
    backward, then a Megatron training step of each; plus the slime-named expert weights."""
    out = {"tp": (info.tp_rank, info.tp_size), "ep": (info.ep_rank, info.ep_size)}
    with cpu_shims(), cpu_threads(1):
        tcfg = transformer_config(dispatcher, shared)
        per = build(tcfg, path, seed=3)
        stk = build(tcfg, path, stacked=True, seed=4)
        copy_weights(per, stk)
        tokens = batch(info.rank // info.tp_size)  # the same batch on both TP ranks
        lp, ls = forward_backward(per, tokens), forward_backward(stk, tokens)
        out["logits_equal"] = torch.equal(lp, ls)
        gp, gs = _expert_grads(per), _expert_grads(stk)
        out["expert_grads_equal"] = all(torch.equal(gp[k], gs[k]) for k in gp)
        out["expert_grads_nonzero"] = all(bool(g.abs().sum() > 0) for g in gp.values())
        op, os_ = _other_grads(per), _other_grads(stk)
        out["other_grads_equal"] = set(op) == set(os_) and all(torch.equal(op[k], os_[k]) for k in op)
        out["shared_params"] = sorted(k for k in op if "shared_experts" in k)
        out["names"] = sorted(k for k, _ in per.named_parameters() if "layers.0.mlp" in k)
        out["attrs"] = [(p.tensor_model_parallel, p.partition_dim, p.partition_stride, p.allreduce)
                        for k, p in per.named_parameters() if ".experts.linear_fc" in k][:2]
        out["hf_experts_before"] = expert_weights_hf(per, info)
        for m in (per, stk):
            m.zero_grad(set_to_none=True)
        steps = [batch(10 + info.rank // info.tp_size), batch(20 + info.rank // info.tp_size)]
        before = {k: v.clone() for k, v in per.state_dict().items() if ".experts." in k}
        out["step"] = train_step(per, steps)
        out["step_stacked"] = train_step(stk, steps)
        out["moved"] = any(not torch.equal(v, per.state_dict()[k]) for k, v in before.items())
        after_p, after_s = {}, {}
        for i, layer in mg.moe_layers(per).items():
            pre = f"decoder.layers.{i}.mlp.experts."
            n = layer.num_local_experts
            after_p[i] = mx.read_expert_stacks({k[len(pre):]: v for k, v in per.state_dict().items()
                                                if k.startswith(pre)}, n)
            after_s[i] = mx.read_expert_stacks({k[len(pre):]: v for k, v in stk.state_dict().items()
                                                if k.startswith(pre)}, n)
        out["step_experts_equal"] = all(torch.equal(a, b) for i in after_p
                                        for a, b in zip(after_p[i], after_s[i], strict=True))
        sp, ss = per.state_dict(), stk.state_dict()
        out["step_other_equal"] = all(torch.equal(sp[k], ss[k]) for k in sp
                                      if ".experts." not in k and not k.endswith("_extra_state"))
    return out
