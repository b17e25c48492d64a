"""Rank bodies for the multi-process expert-parallel tests (spawned by
:func:`libalign.models.megatron_parallel.launch`, so they live in an importable module)."""

from __future__ import annotations

import os

import torch

from libalign.models import megatron as mg
from libalign.models import megatron_export as mx
from libalign.models import tiny_config
from libalign.models.megatron_cpu import cpu_shims
from libalign.models.megatron_parallel import NO_MULTICAST_ENV
from libalign.models.train import cpu_threads

CFG_KW = dict(num_hidden_layers=2, vocab_size=48, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32)


def config():
    return tiny_config(**CFG_KW)


def forward_backward(info, hf_sd, batches, path="bf16", publish=()):
    """Load ``hf_sd`` into an expert-parallel GPT; run this rank's batch (all batches stacked
    when the world is one process) forward and backward; export; publish sharded versions
    (``publish``: ``(store root, version id, spec)`` triples)."""
    cfg = config()
    with cpu_shims(enabled=info.device.type == "cpu"), cpu_threads(1):
        model = mg.build_gpt_model(cfg, path, device=info.device)
        mx.load_hf_into_megatron(model, hf_sd, cfg)
        if info.world_size == 1:
            ids = torch.cat([b[0] for b in batches])
            mask = torch.cat([b[1] for b in batches])
        else:
            ids, mask = batches[info.rank]
        ids, mask = ids.to(info.device), mask.to(info.device)
        logits = mg.gpt_logits(model, ids, mask)
        logits.float()[mask.bool()].logsumexp(-1).sum().backward()
        grads = {}
        for i, layer in mg.moe_layers(model).items():
            ex = layer.experts
            grads[i] = (int(layer.local_expert_indices[0]), ex.linear_fc1.weight.grad.cpu(),
                        ex.linear_fc2.weight.grad.cpu())
        out = {"rank": info.rank, "ep_rank": info.ep_rank, "ep_size": info.ep_size,
               "logits": logits.detach().cpu(), "expert_grads": grads,
               "fused": mx.export_hf_state_dict(model, cfg),
               "local": mx.export_hf_state_dict(model, cfg, expert_layout="local",
                                                device="cpu"),
               "ranges": mx.local_expert_ranges(model),
               "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}
        if publish:
            from alignd.formats.weight_store import WeightStore
            from alignd.sync.sharded import publish_sharded

            out["published"] = {}
            for root, vid, spec in publish:
                res = publish_sharded(model, cfg, WeightStore(root), vid, spec, shard_bytes=1 << 14)
                out["published"][vid] = res.committed
    return out


def forward_backward_then_train(info, hf_sd, batches, runs, train_path):
    """:func:`forward_backward` for each ``(path, publish)`` of ``runs``, then
    :func:`train_one_step` on ``train_path``, each on a fresh model, in one launch (a launch
    costs seconds of imports per rank)."""
    return {"forward_backward": {path: forward_backward(info, hf_sd, batches, path, publish)
                                 for path, publish in runs},
            "train": train_one_step(info, hf_sd, train_path)}


def fail_on_rank_one(info):
    """Rank 1 raises; rank 0 returns."""
    if info.rank == 1:
        raise ValueError("rank one says no")
    return info.rank


def synthetic_batch(n: int = 8, seed: int = 0):
    """A GRPO batch of ``n`` rollouts in groups of two (no generation needed)."""
    from alignd.learner.engine import TrainBatch

    cfg = config()
    g = torch.Generator().manual_seed(seed)
    seqs, plens, samp = [], [], []
    for i in range(n):
        length = 8 + i % 3
        seqs.append(torch.randint(1, cfg.vocab_size, (length,), generator=g).tolist())
        plens.append(3)
        samp.append((-1.5 + 0.5 * torch.rand(length - 3, generator=g)).tolist())
    rewards = [float(i % 2) for i in range(n)]
    return TrainBatch(seqs, plens, samp, rewards, [i // 2 for i in range(n)])


def _rank_share(batch, rank: int, world: int):
    from alignd.learner.engine import TrainBatch

    per = len(batch.sequences) // world
    sl = slice(rank * per, (rank + 1) * per)
    return TrainBatch(batch.sequences[sl], batch.prompt_lens[sl], batch.sampler_logprobs[sl],
                      batch.rewards[sl], batch.groups[sl])


def train_one_step(info, hf_sd, path="bf16", shares=None, batch_size=8, publish=None):
    """One GRPO + TIS step of the Megatron engine on this rank's share of the batch; the
    stats, the exported weights after it, and (with ``shares``) uneven shares to refuse;
    ``publish`` ``(store root, version id)`` then writes this rank's part (minite)."""
    from alignd.learner.engine import TrainBatch
    from alignd.learner.megatron_engine import MegatronLearnerEngine

    cfg = config()
    batch = synthetic_batch()
    with cpu_shims(enabled=info.device.type == "cpu"), cpu_threads(1):
        eng = MegatronLearnerEngine.from_hf_state_dict(hf_sd, cfg, path, device="cpu", lr=1e-3,
                                                       batch_size=batch_size)
        if shares is not None:
            lo = sum(shares[:info.rank])
            sl = slice(lo, lo + shares[info.rank])
            share = TrainBatch(batch.sequences[sl], batch.prompt_lens[sl],
                               batch.sampler_logprobs[sl], batch.rewards[sl], batch.groups[sl])
        else:
            share = _rank_share(batch, info.rank, info.world_size)
        stats = eng.train_step(share)
        out = {"stats": stats, "weights": eng.export_weights(), "place": None}
        if publish is not None:
            from alignd.formats.weight_store import WeightStore
            from alignd.sync.sharded import expert_parallel_place, publish_sharded

            out["place"] = expert_parallel_place()[:2] + expert_parallel_place()[3:]
            res = publish_sharded(eng.model, config(), WeightStore(publish[0]), publish[1],
                                  "minite")
            out["published"] = None if res is None else res.committed
        return out
