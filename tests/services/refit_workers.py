"""Rank bodies of the distributed refit test (spawned by libalign.models.megatron_parallel.launch).

Rank 0 is the trainer: it refits with :func:`alignd.sync.distributed.send_distributed_refit`.
Rank 1 stands where SGLang's scheduler sits: it takes each request (names, dtypes, shapes) and
receives the broadcast bucket into a :class:`~alignd.sync.receive.RefitReceiver`. The requests
and answers travel on a second gloo group (what HTTP carries between the two in production),
the buckets on the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def named_weights(seed: int = 0, experts: int = 4) -> list[tuple[str, torch.Tensor]]:
    """A small Qwen3-MoE-named set: experts (gate/up/down), a router and a norm."""
    g = torch.Generator().manual_seed(seed)
    out = [("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16)),
           ("model.layers.0.mlp.gate.weight", torch.randn(experts, 64, generator=g).bfloat16())]
    for e in range(experts):
        for p, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            w = torch.randn(*shape, generator=g) * (e + 1)
            out.append((f"model.layers.0.mlp.experts.{e}.{p}.weight", w.bfloat16()))
    return out


class _ControlSink:
    """Rank 0's view of the server: the request to rank 1 and its answer, on ``control``."""

    def __init__(self, control):
        self.control = control

    def update_weights_from_distributed(self, **request):
        dist.broadcast_object_list([request], src=0, group=self.control)
        answer = [None]
        dist.broadcast_object_list(answer, src=1, group=self.control)
        return answer[0]


def refit_ranks(info, spec: str, bucket_bytes: int, versions: int):
    from alignd.sync.distributed import receive_distributed, send_distributed_refit
    from alignd.sync.receive import RefitReceiver

    control = dist.new_group([0, 1], backend="gloo")
    if info.rank == 0:
        reports = []
        for v in range(versions):
            r = send_distributed_refit(named_weights(seed=v), _ControlSink(control),
                                       version_id=f"v{v}", spec=spec, header=True,
                                       bucket_bytes=bucket_bytes)
            reports.append((r.buckets, r.tensors, r.digest))
        return reports
    applied: list[list[tuple[str, torch.Tensor]]] = []
    receiver = RefitReceiver(lambda named: applied.append([(n, t.clone()) for n, t in named]),
                             quantization="libalign_minite" if spec == "minite" else None)
    done = 0
    while done < versions:
        req = [None]
        dist.broadcast_object_list(req, src=0, group=control)
        r = req[0]
        try:
            got = receive_distributed(receiver, names=r["names"], dtypes=r["dtypes"],
                                      shapes=r["shapes"])
            answer = (True, f"applied {got}" if got else "staged")
        except Exception as e:  # the server answers failures; the trainer raises them
            answer, got = (False, f"{type(e).__name__}: {e}"), None
        dist.broadcast_object_list([answer], src=1, group=control)
        done += got is not None
    return applied
