"""Routing records (R3) from SGLang servers: what to ask for, and how the answer becomes a record.

What was matched (SGLang 0.5.23, read for this module)
    ``srt/arg_groups/fields/exec_.py``: the server flag ``--enable-return-routed-experts``
    (``enable_return_routed_experts``, False by default; ``GET /get_server_info`` reports it
    among the server arguments). ``srt/managers/io_struct.py``: ``GenerateReqInput`` fields
    ``return_routed_experts`` (bool) and ``routed_experts_start_len`` (the first position
    returned, 0 by default: the whole sequence). A request that asks without the server flag
    is answered *without* the field: no capturer exists, nothing fails.
    ``srt/state_capturer/routed_experts.py`` and ``base.py``: one int32 row per token and per
    decoder layer (``num_hidden_layers``: dense layers included, left zero), ``top_k``
    (``num_experts_per_tok``) ids each, logical expert ids (captured before the EPLB
    physical mapping), fused shared experts cut off; ``get_topk`` returns positions
    ``[start_len, seqlen - 1)``, so a whole rollout's answer has ``len(tokens) - 1`` rows.
    ``srt/managers/detokenizer_manager.py`` (``_b64_encode_per_request``) and
    ``tokenizer_manager.py``: ``meta_info.routed_experts`` is base64 of the tensor's raw
    bytes. A server patched to narrow the wire (``SGLANG_ROUTED_EXPERTS_DTYPE`` = ``uint16``
    or ``uint8``, sgl-project/sglang#31219) says so in ``meta_info.routed_experts_dtype``.

How the adapter uses it
    :class:`SGLangRouting` is the model's routing geometry (from its ``config.json``:
    :func:`libalign.routing.records.config_geometry`). With it,
    :meth:`~alignd.sampler.sglang_engine.SGLangSamplerEngine.generate` ``(routing=True)`` adds
    ``return_routed_experts: true`` to the request and reads each answer with
    :func:`routing_record` into a :class:`~libalign.routing.records.RoutingRecord` of the MoE
    layers only (:meth:`~libalign.routing.records.RoutingRecord.from_sglang`), stamped with
    the served weight version. An answer without the field is
    :class:`~alignclient.errors.EngineMismatchError` (``field="enable_return_routed_experts"``:
    the server runs without the flag); a malformed one (not base64, a byte count that does not
    fit ``len(tokens) - 1`` rows of the geometry in the dtype, ids out of range or repeated, ids
    in a layer without a router) is :class:`~alignclient.errors.RoutingRecordError` naming the
    request and the fault. SGLang returns no gate weights: its records replay with
    ``weights="recompute"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignclient.errors import EngineMismatchError, RoutingRecordError

from libalign.routing.records import DENSE_DTYPES, RoutingRecord, config_geometry

#: The request field that asks a server for routed experts.
REQUEST_FIELD = "return_routed_experts"
#: The server argument (``GET /get_server_info``) that says it can answer.
SERVER_FLAG = "enable_return_routed_experts"


@dataclass(frozen=True)
class SGLangRouting:
    """The routing geometry the servers' model has, as SGLang lays it out."""

    num_layers: int
    """decoder layers (``num_hidden_layers``): rows per token in SGLang's answer"""
    layers: tuple[int, ...]
    """the MoE layers among them (what a record keeps)"""
    top_k: int
    num_experts: int
    dtype: str | None = None
    """the servers' wire dtype when they narrow it without saying so in ``meta_info``
    (None: ``meta_info.routed_experts_dtype``, else int32)"""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DENSE_DTYPES:
            raise RoutingRecordError(f"routed experts dtype {self.dtype!r} is not one of "
                                     f"{sorted(DENSE_DTYPES)}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | Path,
                    dtype: str | None = None) -> SGLangRouting | None:
        """The geometry of a Hugging Face config (a mapping, or a model directory or
        ``config.json`` path); None for a model without experts."""
        if not isinstance(config, Mapping):
            path = Path(config)
            config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        geo = config_geometry(config)
        if geo is None:
            return None
        return cls(geo["num_layers"], tuple(geo["layers"]), geo["top_k"], geo["num_experts"],
                   dtype)


def routing_record(meta: Mapping[str, Any], rid: str, tokens: list[int],
                   routing: SGLangRouting, version: str | None) -> RoutingRecord:
    """The record of one answer's ``meta_info`` for the sequence ``tokens`` (prompt and
    completion), or the typed error naming what is wrong (module docstring)."""
    payload = meta.get("routed_experts")
    if payload is None:
        raise EngineMismatchError(
            f"request {rid}: the server answered without meta_info.routed_experts: start it "
            "with --enable-return-routed-experts to record routing (R3)", field=SERVER_FLAG)
    said = meta.get("routed_experts_dtype")
    if said is not None and routing.dtype is not None and said != routing.dtype:
        raise RoutingRecordError(f"request {rid}: the server sent routed experts as {said!r}; "
                                 f"this sampler was told {routing.dtype!r}")
    dtype = said or routing.dtype or "int32"
    try:
        return RoutingRecord.from_sglang(payload, positions=len(tokens) - 1,
                                         num_layers=routing.num_layers, layers=routing.layers,
                                         top_k=routing.top_k, num_experts=routing.num_experts,
                                         dtype=str(dtype), version=version)
    except RoutingRecordError as e:
        raise RoutingRecordError(f"request {rid}: {e}") from None
