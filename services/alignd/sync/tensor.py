"""Colocated refit: buckets handed to an SGLang server on the same GPUs, by CUDA IPC.

SGLang's ``update_weights_from_tensor`` takes ``serialized_named_tensors``: one payload per
tensor-parallel rank, each pickled by ``ForkingPickler`` (torch's reductions turn a CUDA
tensor into an IPC handle, a CPU tensor into shared memory; nothing is copied) and, over HTTP,
base64-encoded (SGLang's ``MultiprocessingSerializer(output_str=True)``). :func:`serialize` is
that encoding. A bucket travels in one of two forms:

Staged (default; ``load_format`` :data:`LOADER`)
    ``[(HEADER_NAME, header), (BUFFER_NAME, buffer)]``: the server hands them to
    :func:`load_refit`, which the server names with ``--custom-weight-loader
    alignd.sync.tensor.load_refit``. It stages the version with a
    :class:`~alignd.sync.receive.RefitReceiver` per model and calls the model's
    ``load_weights`` once, with every tensor, after the last bucket verified: the old weights
    serve until then.
``flattened_bucket``
    ``{"flattened_tensor": buffer, "metadata": entries}``: SGLang's own handling, each bucket
    loaded as it arrives (no custom loader needed; no staging).

Either way the sender keeps a bucket alive until the server's answer, and builds the next one
meanwhile (:func:`alignd.sync.refit.run_refit`), inside SGLang's weight-update session
(``begin_weight_update`` ... ``end_weight_update``, :func:`alignd.sync.refit.weight_update_session`):
SGLang loads tensors only inside one, and prepares the loaded layers for their GEMMs
(``process_weights_after_loading``) when it ends. The sink is anything with SGLang's method
(:class:`TensorSink`): an ``sglang.Engine`` in the trainer's process, or an HTTP client.
"""

from __future__ import annotations

import base64
import io
import weakref
from collections.abc import Iterable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler
from alignclient.errors import LayoutError

from alignd.formats.convert import resolve_spec
from alignd.formats.modelopt_export import sglang_method
from alignd.sync.announce import RefitStages
from alignd.sync.buckets import BUFFER_NAME, HEADER_NAME, Bucket, RefitHeader
from alignd.sync.receive import RefitReceiver
from alignd.sync.refit import RefitReport, check_ok, run_refit, weight_update_session
from alignd.sync.stream import DEFAULT_BUCKET_BYTES
from libalign.spec import NumericsSpec

#: The ``--custom-weight-loader`` (and ``load_format``) of a staged refit.
LOADER = "alignd.sync.tensor.load_refit"
FLATTENED = "flattened_bucket"


def serialize(obj: Any) -> str:
    """``obj`` pickled by ForkingPickler and base64-encoded, as SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def deserialize(data: str | bytes) -> Any:
    """What :func:`serialize` encoded (trusted input only: this unpickles)."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    return ForkingPickler.loads(raw)


class TensorSink(Protocol):
    """SGLang's ``update_weights_from_tensor`` (``Engine`` or HTTP); answers ``(ok, message)``
    or ``{"success": ..., "message": ...}``, or raises."""

    def update_weights_from_tensor(self, *, serialized_named_tensors: list[str],
                                   load_format: str | None, flush_cache: bool,
                                   weight_version: str | None) -> object:
        """Load one bucket."""


def quantization_of(spec: NumericsSpec | str | None) -> str:
    """The SGLang method a refit under ``spec`` is for (``bf16`` for none)."""
    return "bf16" if spec is None else (sglang_method(resolve_spec(spec)) or "unknown")


def bucket_payload(bucket: Bucket, header: RefitHeader, staged: bool) -> Any:
    """What one bucket sends: staged named tensors, or SGLang's flattened-bucket dict."""
    if staged:
        return [(HEADER_NAME, header.to_tensor(bucket.flat.device)), (BUFFER_NAME, bucket.flat)]
    return bucket.sglang_payload()


def send_tensor_refit(named: Iterable[tuple[str, torch.Tensor]], sink: TensorSink, *,
                      version_id: str, spec: NumericsSpec | str | None = "minite",
                      staged: bool = True, tp_size: int = 1, model: str | None = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, all_linear: bool = False,
                      device: torch.device | str | None = None,
                      stages: RefitStages | None = None) -> RefitReport:
    """Refit ``sink`` with version ``version_id`` of ``named`` (quantized under ``spec``; None
    sends them unchanged), one bucket per call. The last call flushes the server's cache
    and names the version (``weight_version``)."""
    quant = quantization_of(spec)

    def send(bucket: Bucket, header: RefitHeader) -> None:
        payload = serialize(bucket_payload(bucket, header, staged))
        answer = sink.update_weights_from_tensor(
            serialized_named_tensors=[payload] * tp_size,
            load_format=LOADER if staged else FLATTENED, flush_cache=header.last,
            weight_version=version_id if header.last else None)
        check_ok(answer, f"bucket {header.bucket} of {version_id!r}")

    with weight_update_session(sink):
        return run_refit(named, send, version_id=version_id, spec=spec,
                         bucket_bytes=bucket_bytes, all_linear=all_linear, model=model,
                         quantization=quant, device=device, header_entries=staged,
                         stages=stages)


# --- the server side ----------------------------------------------------------------------------

_receivers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def served_quantization(model: torch.nn.Module) -> str:
    """The quantization method an SGLang model was built with (``bf16`` for none): its
    ``quant_config``'s name."""
    qc = getattr(model, "quant_config", None)
    return qc.get_name() if qc is not None else "bf16"


def receiver_for(model: torch.nn.Module, **kw: Any) -> RefitReceiver:
    """The receiver that stages refits of ``model`` (made on first use; ``kw`` go to it)."""
    r = _receivers.get(model)
    if r is None:
        r = RefitReceiver(lambda named: model.load_weights(named),
                          quantization=served_quantization(model), **kw)
        _receivers[model] = r
    return r


def load_refit(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader for staged refits: one bucket into ``model``'s receiver
    (the model loads the version when its last bucket verified)."""
    if not named_tensors or named_tensors[0][0] != HEADER_NAME:
        raise LayoutError(f"{LOADER} takes refit buckets ({HEADER_NAME!r} first); use "
                          "load_format=None for plain named tensors")
    receiver_for(model).receive_named(list(named_tensors))
