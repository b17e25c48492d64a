"""Sharded publish: every expert-parallel rank converts its own experts where they live.

A learner with expert parallelism ``P`` holds each MoE layer's ``E`` experts spread over ``P``
ranks (GPUs). Gathering them to one place before conversion moves every expert weight over the
interconnect and serializes the quantization on one device. Here each rank instead quantizes
its own slice ``[E/P, N, K]`` of every expert stack on its own device (the fused BF16->NVFP4
kernel behind :func:`libalign.kernels.quantize`) and writes it as one *part* of the version
(:func:`alignd.formats.sharded_version.write_part`); the dense tensors (embeddings, attention,
norms, routers), replicated on every rank, are written once, by expert-parallel rank 0. The
version becomes visible to samplers only when the last part lands and one merged manifest is
renamed into place, so a rank killed mid-write leaves no torn version; running that rank again
completes it.

Bits: with the ``row`` or ``expert`` outer domain (libalign's row-scaled default, torchao's per
expert) every expert's rows quantize independently, so the parts are bit-identical to
converting the gathered stacks in one go. The ``tensor`` domain has one outer scale per whole
stack: the ranks all-reduce their local maxima (``MAX`` over the expert-parallel group) before
quantizing, which gives the same scale the whole stack would.

The merged manifest says what the converter's would: besides the numerics, the KV cache format
the samplers run and its per-layer K/V global scales (``extra["kv"]``,
:func:`alignd.formats.convert.kv_manifest`), which a sampler with an FP4 KV cache checks before
it loads the version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from alignd.formats.convert import kv_manifest, resolve_spec
from alignd.formats.selection import make_select
from alignd.formats.sharded_version import PartResult, Piece, write_part
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, WeightStore
from libalign import spec as spec_mod
from libalign.models.kv_cache import KVScales
from libalign.spec import NumericsSpec


def expert_parallel_place() -> tuple[int, int, object | None, bool]:
    """``(ep_rank, ep_size, ep_group, writer)`` of this process from Megatron's parallel state.

    ``writer`` is False on expert-data-parallel replicas (ranks holding the same experts as a
    lower rank): only the first copy of each slice is written. Without an initialized
    parallel state (one process, no group) this is ``(0, 1, None, True)``.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None, True
    rank, size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    group = ps.get_expert_model_parallel_group() if size > 1 else None
    edp = getattr(ps, "get_expert_data_parallel_rank", None)
    writer = True if edp is None else int(edp()) == 0
    return int(rank), int(size), group, writer


def _global_amax(t: torch.Tensor, spec: NumericsSpec, group) -> torch.Tensor:
    """The whole stack's tensor-domain outer maximum from this rank's slice (all-reduce MAX)."""
    amax = spec_mod.shared_outer_amax([t], spec).to(torch.float32)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def local_items(model: nn.Module, hf_config, spec: NumericsSpec, *, ep_rank: int, group=None,
                ) -> Iterator[tuple[str, torch.Tensor | Piece]]:
    """What this rank writes: its expert slices as :class:`Piece` objects, and (rank 0 only)
    every dense tensor, in the Hugging Face names a sampler loads."""
    # imported here: megatron_export pulls in megatron-core, an optional engine the RL loop
    # (which imports this module) does not need
    from libalign.models.megatron_export import (
        export_hf_state_dict,
        local_expert_ranges,
        local_expert_stacks,
    )

    # the slices stay where the model holds them, so the quantization runs on their device;
    # only rank 0 exports (copies) the dense tensors, which it alone writes
    ranges = local_expert_ranges(model)
    for name, t in local_expert_stacks(model).items():
        start, total = ranges[name]
        amax = _global_amax(t, spec, group) if spec.outer_domain == "tensor" else None
        yield name, Piece(t, start, total, outer_amax=amax)
    if ep_rank == 0:
        yield from export_hf_state_dict(model, hf_config, expert_layout="none",
                                        device=None).items()


def publish_sharded(model: nn.Module, hf_config, store: WeightStore, version_id: str,
                    spec: NumericsSpec | str = "minite", *, all_linear: bool = False,
                    quantize: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    device: str | None = None, on_step: Callable[[str], None] | None = None,
                    extra: dict[str, Any] | None = None, kv_format: str | None = None,
                    kv_scales: KVScales | None = None) -> PartResult | None:
    """Convert and write this rank's part of ``version_id``; every expert-parallel rank calls it.

    Returns the part's result (``committed`` is True on the rank whose part completed the
    version), or None on an expert-data-parallel replica, which writes nothing. ``device``
    defaults to the experts' device. ``quantize=False`` stores every tensor as it is (a
    version for a bf16 sampler). Collective only for the ``tensor`` outer domain (the
    all-reduced maxima); otherwise ranks may call it at different times. ``kv_format`` (and
    ``kv_scales``) name the KV cache the sampler runs, in the manifest's ``extra["kv"]``
    (:func:`~alignd.formats.convert.kv_manifest`, as the converter writes it), so a sampler
    with an FP4 KV cache loads the version; every rank passes the same.
    """
    spec = resolve_spec(spec)
    kv = kv_manifest(kv_format, kv_scales)  # refused before anything is written
    ep_rank, ep_size, group, writer = expert_parallel_place()
    if not writer:
        return None
    if device is None:
        device = str(next(model.parameters()).device)
    items = local_items(model, hf_config, spec, ep_rank=ep_rank, group=group)
    select = make_select(all_linear) if quantize else (lambda name, t: False)
    return write_part(store, version_id, ep_rank, ep_size, items, spec, select=select,
                      shard_bytes=shard_bytes, device=device, on_step=on_step,
                      source={"kind": "megatron", "ep_size": ep_size},
                      extra={"all_linear": all_linear, "quantized": quantize, **(extra or {}),
                             **({} if kv is None else {"kv": kv})})
