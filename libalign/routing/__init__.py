"""Routing replay (R3): which experts the sampler's routers chose, and how the learner agrees.

Under NVFP4 a learner's router can pick other experts than the sampler's for the same token;
replaying the sampler's choice removes that share of the gap. The concept has three parts:

* :mod:`~libalign.routing.records`: a rollout's routing record (expert ids per token, MoE
  layer and slot, optionally the gate weights), compact and versioned.
* :mod:`~libalign.routing.agreement`: how two paths' top-k choices agree at a layer.
* replay itself wraps a model's routers, so it lives with the model glue:
  :mod:`libalign.models.routing_replay` (Hugging Face Qwen3-MoE: record, replay, measure) and
  :mod:`libalign.models.megatron_routing` (the same on a Megatron-core GPT).
"""

from libalign.routing.agreement import (
    RoutingAgreement,
    routing_agreement,
    routing_agreement_by_layer,
)
from libalign.routing.records import RoutingRecord

__all__ = ["RoutingAgreement", "RoutingRecord", "routing_agreement", "routing_agreement_by_layer"]
