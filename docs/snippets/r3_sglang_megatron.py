"""R3 from SGLang into a Megatron-core learner (docs/concepts/routing-replay.md).

Servers started with ``--enable-return-routed-experts`` answer a ``/generate`` that carries
``"return_routed_experts": true`` with ``meta_info.routed_experts``: base64 of int32
``[len(tokens) - 1, num_hidden_layers, top_k]``. ``records_from_sglang`` turns each answer into
a routing record of the MoE layers (``to_dense`` gives slime's and verl's int32 array back);
``replay`` runs a stock Megatron-core GPT (any expert module) with its routers forced to the
records, at the ``TopKRouter``'s top-k slot. tests/libalign/test_megatron_router_replay.py
runs this file.
"""

import torch

from libalign.guidance import row_keys
from libalign.models import megatron_routing
from libalign.models.routing_replay import RoutingTable
from libalign.routing.records import RoutingRecord, config_geometry


def records_from_sglang(answers: list[dict], sequences: list[list[int]],
                        hf_config: dict) -> dict[int, RoutingRecord]:
    """One record per rollout from SGLang's ``/generate`` answers (``meta_info`` each)."""
    geo = config_geometry(hf_config)  # num_layers, MoE layers, top_k, num_experts
    return {i: RoutingRecord.from_sglang(
        a["meta_info"]["routed_experts"], positions=len(seq) - 1,
        num_layers=geo["num_layers"], layers=geo["layers"], top_k=geo["top_k"],
        num_experts=geo["num_experts"],
        dtype=a["meta_info"].get("routed_experts_dtype", "int32"),
        version=a["meta_info"].get("weight_version"))
        for i, (a, seq) in enumerate(zip(answers, sequences, strict=True))}


def replay(model, input_ids: torch.Tensor, records: dict[int, RoutingRecord],
           weights: str = "recompute"):
    """Logits of ``input_ids`` ``[b, s]`` (row ``i`` is rollout ``i``) with every router
    forced to the records; returns them and the routing disagreement before forcing."""
    b, s = input_ids.shape
    keys = row_keys(torch.arange(b)[:, None], torch.arange(s).expand(b, s))
    megatron_routing.set_router_keys(model, keys.T)  # Megatron's [s, b] token order
    try:
        with megatron_routing.replay_routing(model, RoutingTable(records),
                                             weights=weights) as stats:
            pos = torch.arange(s).expand(b, s)
            logits = model(input_ids=input_ids, position_ids=pos, attention_mask=None)
    finally:
        megatron_routing.set_router_keys(model, None)
    return logits, stats.disagreement
