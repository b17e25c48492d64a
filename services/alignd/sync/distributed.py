"""Disaggregated refit: buckets broadcast from the trainer to SGLang's ranks over a process group.

SGLang's ``update_weights_from_distributed`` protocol, as slime and verl drive it:

1. **Group set-up**, once: the server joins a process group of ``world_size`` ranks (the
   trainer's sending rank 0 and the server's ranks from ``rank_offset``) on
   ``init_weights_update_group(master_address, master_port, rank_offset, world_size,
   group_name, backend)``; the trainer joins the same group as rank 0 with its framework's
   helper. :class:`DistributedSink` is the server's side of that call.
2. **Per bucket**: the trainer tells the server the bucket's ``names``, ``dtypes`` and
   ``shapes`` (``load_format="flattened_bucket"``), and broadcasts the bucket's buffer from
   rank 0 while the server receives it; the server rebuilds the tensors from the names,
   dtypes and shapes alone, which is why buckets are laid out back to back, widest dtype
   first (:mod:`alignd.sync.buckets`). The request returns once the server loaded the bucket,
   so :func:`send_distributed_refit` makes it on a thread and broadcasts on the caller's.

A libalign receiver (:func:`receive_distributed`, with a
:class:`~alignd.sync.receive.RefitReceiver`) takes a header too: with ``header=True`` the
request lists :data:`~alignd.sync.buckets.HEADER_NAME` first and the header tensor is broadcast
before the buffer, so the version is staged and applied whole. A stock SGLang server loads
each bucket as it arrives (``header=False``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from alignclient.errors import LayoutError

from alignd.sync.announce import RefitStages
from alignd.sync.buckets import HEADER_NAME, Bucket, RefitHeader, layout
from alignd.sync.receive import RefitReceiver
from alignd.sync.refit import RefitReport, check_ok, run_refit, weight_update_session
from alignd.sync.stream import DEFAULT_BUCKET_BYTES
from alignd.sync.tensor import FLATTENED, quantization_of
from libalign.spec import NumericsSpec

#: The ``load_format`` of a bucket with a header, for a libalign receiver.
STAGED = "libalign_staged"


class DistributedSink(Protocol):
    """The server's side of the protocol (an ``sglang.Engine``, an HTTP client, a test)."""

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        load_format: str | None, flush_cache: bool,
                                        weight_version: str | None) -> object:
        """Receive one broadcast bucket and load it."""


def send_distributed_refit(named: Iterable[tuple[str, torch.Tensor]], sink: DistributedSink, *,
                           version_id: str, group: dist.ProcessGroup | None = None,
                           group_name: str = "weight_update_group",
                           spec: NumericsSpec | str | None = "minite", header: bool = False,
                           model: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                           all_linear: bool = False,
                           device: torch.device | str | None = None,
                           stages: RefitStages | None = None) -> RefitReport:
    """Refit the server behind ``sink`` over ``group`` (this process is its rank 0), bucket by
    bucket; ``header`` for a libalign receiver (module doc)."""

    def send(bucket: Bucket, h: RefitHeader) -> None:
        e = bucket.entries
        names = [x.name for x in e]
        dtypes = [str(x.dtype).removeprefix("torch.") for x in e]
        shapes = [list(x.shape) for x in e]
        head = None
        if header:
            head = h.to_tensor(bucket.flat.device)
            names, dtypes, shapes = ([HEADER_NAME, *names], ["uint8", *dtypes],
                                     [[head.numel()], *shapes])
        answer: list = []

        def request() -> None:
            try:
                answer.append(sink.update_weights_from_distributed(
                    names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                    load_format=STAGED if header else FLATTENED, flush_cache=h.last,
                    weight_version=version_id if h.last else None))
            except BaseException as err:  # re-raised below, in the sending thread
                answer.append(err)

        t = threading.Thread(target=request, name="refit-request", daemon=True)
        t.start()
        if head is not None:
            dist.broadcast(head, src=0, group=group)
        dist.broadcast(bucket.flat, src=0, group=group)
        t.join()
        if answer and isinstance(answer[0], BaseException):
            raise answer[0]
        check_ok(answer[0] if answer else None, f"bucket {h.bucket} of {version_id!r}")

    with weight_update_session(sink):
        return run_refit(named, send, version_id=version_id, spec=spec,
                         bucket_bytes=bucket_bytes, all_linear=all_linear, model=model,
                         quantization=quantization_of(spec), device=device, stages=stages,
                         header_entries=False)


def receive_distributed(receiver: RefitReceiver, *, names: Sequence[str],
                        dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        group: dist.ProcessGroup | None = None, src: int = 0,
                        device: torch.device | str = "cpu") -> str | None:
    """The libalign side of one bucket with a header: receive the header and the buffer by
    broadcast from ``src`` and hand them to ``receiver``; returns what it returns."""
    if not names or names[0] != HEADER_NAME:
        raise LayoutError(f"a staged bucket lists {HEADER_NAME!r} first, got {list(names)[:2]}")
    head = torch.empty(int(shapes[0][0]), dtype=torch.uint8, device=device)
    dist.broadcast(head, src=src, group=group)
    entries = layout(names[1:], dtypes[1:], shapes[1:])
    bucket = Bucket.empty(entries, device)
    dist.broadcast(bucket.flat, src=src, group=group)
    return receiver.receive_bucket(RefitHeader.from_tensor(head), bucket)
