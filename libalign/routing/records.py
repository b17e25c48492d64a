"""Routing records (R3): which experts the sampler's routers chose, kept per rollout.

Why record routing
------------------
In a Mixture-of-Experts layer each token goes to the ``k`` experts its router scores highest.
The learner recomputes the router on the same tokens, but with other arithmetic (another
GEMM shape, another attention kernel, NVFP4 on one side only) its scores differ slightly,
and where two experts are nearly tied the learner picks another one than the sampler did.
Such a token then runs a different sub-network on the two sides, and its log-probabilities
differ by far more than rounding. *Rollout Routing Replay* (R3) removes that part of the
gap: the sampler records its top-k expert ids for every token at every MoE layer, and the
learner routes by them (:mod:`libalign.models.routing_replay`, and for Megatron-core
:mod:`libalign.models.megatron_routing`), computing the gate weights of the forced experts
from its own router logits, so the router still learns.

What a record holds
-------------------
One record per rollout, for the tokens the sampler fed through the model: the prompt
(prefill) and every generated token except the last (drawn, but never fed), ``positions =
len(tokens) - 1`` rows in position order. Per row and MoE layer (``layers``, in order) the
``top_k`` expert ids in the router's order (highest score first):

* ``experts``: ``[positions, layers, top_k]``, one byte an id when the model has at most 256
  experts (``uint8``), else two (``int16``, up to 32768 experts);
* ``weights`` (optional): the gate weights the sampler applied, ``bfloat16``, same shape;
  the learner uses them only when asked to (``weights="record"``);
* ``num_experts``, and the weight ``version`` the sampler served, which the learner checks.

So a token costs ``layers × top_k`` bytes (Qwen3-30B-A3B: 48 × 8 = 384 bytes; the tiny demo
model 4 × 2 = 8), plus twice that with weights: small next to the ~45 KB of activation
guidance TRACE keeps a token.

Bytes
-----
:meth:`RoutingRecord.to_bytes` gives the raw little-endian arrays (ids, then weights),
row-major; :meth:`RoutingRecord.from_bytes` reads them back given the shape, checking the
byte count, the id range and that no row names an expert twice
(:class:`~libalign.errors.RoutingRecordError`). The wire form (base64 of the same bytes, with
the shape fields) is :class:`alignclient.models.RoutingWire`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from libalign.errors import RoutingMismatchError, RoutingMissingError, RoutingRecordError

#: most experts a one-byte id can name
MAX_BYTE_EXPERTS = 256
#: most experts a record can name at all (two-byte ids)
MAX_EXPERTS = 1 << 15
WEIGHT_DTYPE = torch.bfloat16


def id_dtype(num_experts: int) -> torch.dtype:
    """``uint8`` up to 256 experts, ``int16`` above (one or two bytes an id)."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise RoutingRecordError(f"num_experts must lie in [1, {MAX_EXPERTS}], got {num_experts}")
    return torch.uint8 if num_experts <= MAX_BYTE_EXPERTS else torch.int16


def id_bytes(num_experts: int) -> int:
    """Bytes an expert id takes in a record."""
    return 1 if id_dtype(num_experts) == torch.uint8 else 2


def _repeats(ids: torch.Tensor) -> bool:
    """Whether any row of ``[..., k]`` ids names an expert twice (every pair compared: for the
    small ``k`` of MoE routers this is cheaper than sorting)."""
    k = ids.shape[-1]
    if k > 16:
        s = ids.sort(dim=-1).values
        return bool((s[..., 1:] == s[..., :-1]).any())
    bad = torch.zeros(ids.shape[:-1], dtype=torch.bool, device=ids.device)
    for a in range(k):
        for b in range(a + 1, k):
            bad |= ids[..., a] == ids[..., b]
    return bool(bad.any())


def bytes_per_token(layers: int, top_k: int, num_experts: int, *, weights: bool = False) -> int:
    """Record bytes a token costs: ``layers × top_k`` ids, plus bf16 weights if kept."""
    return layers * top_k * (id_bytes(num_experts) + (2 if weights else 0))


@dataclass
class RoutingRecord:
    """The sampler's routing of one rollout (module docstring)."""

    experts: torch.Tensor
    """``[positions, len(layers), top_k]`` expert ids (uint8 or int16)"""
    layers: tuple[int, ...]
    num_experts: int
    weights: torch.Tensor | None = None
    """``[positions, len(layers), top_k]`` gate weights (bf16), or None"""
    version: str | None = None

    def __post_init__(self) -> None:
        self.layers = tuple(int(x) for x in self.layers)
        self.check()

    @property
    def positions(self) -> int:
        """Tokens the record covers (``len(tokens) - 1`` of its rollout)."""
        return int(self.experts.shape[0])

    @property
    def top_k(self) -> int:
        """Experts a token per layer."""
        return int(self.experts.shape[2])

    def check(self) -> None:
        """RoutingRecordError naming the first thing that does not fit."""
        e = self.experts
        if not isinstance(e, torch.Tensor) or e.dim() != 3:
            raise RoutingRecordError("experts must be a [positions, layers, top_k] tensor, got "
                                     f"{getattr(e, 'shape', type(e).__name__)}")
        if e.dtype != id_dtype(self.num_experts):
            raise RoutingRecordError(f"experts must be {id_dtype(self.num_experts)} for "
                                     f"{self.num_experts} experts, got {e.dtype}")
        if not self.layers or len(set(self.layers)) != len(self.layers) or \
                list(self.layers) != sorted(self.layers) or self.layers[0] < 0:
            raise RoutingRecordError(f"layers must be distinct non-negative layer indices in "
                                     f"order, got {list(self.layers)}")
        if e.shape[1] != len(self.layers) or not 1 <= e.shape[2] <= self.num_experts:
            raise RoutingRecordError(f"experts has shape {tuple(e.shape)} for {len(self.layers)} "
                                     f"layers and {self.num_experts} experts")
        if e.numel():
            lo, hi = int(e.min()), int(e.max())
            if lo < 0 or hi >= self.num_experts:
                raise RoutingRecordError(f"expert ids must lie in [0, {self.num_experts}), got "
                                         f"{lo}..{hi}")
            if _repeats(e):
                raise RoutingRecordError("a row names the same expert twice")
        w = self.weights
        if w is not None and (not isinstance(w, torch.Tensor) or w.shape != e.shape
                              or w.dtype != WEIGHT_DTYPE or not bool(torch.isfinite(w).all())):
            raise RoutingRecordError(f"weights must be finite {WEIGHT_DTYPE} of shape "
                                     f"{tuple(e.shape)}, got {getattr(w, 'dtype', None)} "
                                     f"{tuple(getattr(w, 'shape', ()))}")

    def nbytes(self) -> int:
        """Bytes of ids and weights (what :meth:`to_bytes` returns)."""
        return self.experts.numel() * self.experts.element_size() + (
            0 if self.weights is None else self.weights.numel() * 2)

    def to_bytes(self) -> tuple[bytes, bytes | None]:
        """``(ids, weights)``: the raw little-endian arrays, row-major (weights None if absent)."""
        ids = self.experts.detach().cpu().contiguous().numpy().astype(
            "<u1" if self.experts.dtype == torch.uint8 else "<i2", copy=False).tobytes()
        w = None if self.weights is None else \
            self.weights.detach().cpu().contiguous().view(torch.int16).numpy().astype(
                "<i2", copy=False).tobytes()
        return ids, w

    @classmethod
    def from_bytes(cls, ids: bytes, *, positions: int, layers: Sequence[int], top_k: int,
                   num_experts: int, weights: bytes | None = None,
                   version: str | None = None) -> RoutingRecord:
        """The record of :meth:`to_bytes`' arrays, checked (RoutingRecordError)."""
        dt = id_dtype(num_experts)
        shape = (positions, len(layers), top_k)
        n = positions * len(layers) * top_k
        width = 1 if dt == torch.uint8 else 2
        if positions < 0 or len(ids) != n * width:
            raise RoutingRecordError(f"routing ids hold {len(ids)} bytes; {shape} at {width} "
                                     f"byte(s) an id need {n * width}")
        arr = np.frombuffer(ids, dtype="<u1" if width == 1 else "<i2").astype(
            np.uint8 if width == 1 else np.int16)
        experts = torch.from_numpy(arr.copy()).reshape(shape)
        w = None
        if weights is not None:
            if len(weights) != 2 * n:
                raise RoutingRecordError(f"routing weights hold {len(weights)} bytes; {shape} "
                                         f"bf16 weights need {2 * n}")
            w16 = np.frombuffer(weights, dtype="<i2").astype(np.int16)
            w = torch.from_numpy(w16.copy()).view(WEIGHT_DTYPE).reshape(shape)
        return cls(experts, tuple(layers), num_experts, w, version)


def check_routing(records: Mapping[int, RoutingRecord | None], *, positions: Mapping[int, int],
                  layers: Sequence[int], top_k: int, num_experts: int,
                  version: str | None = None) -> None:
    """Refuse records made for something else, naming the mismatch.

    ``positions`` maps every sequence that must have a record to its token count minus one: a
    sequence without a record raises :class:`~libalign.errors.RoutingMissingError`; a record
    for another weight ``version`` (when both name one), MoE ``layers`` list, ``top_k``,
    ``num_experts`` or token count raises :class:`~libalign.errors.RoutingMismatchError`
    with that ``field``.
    """
    want_layers = tuple(int(x) for x in layers)
    for sid, n in positions.items():
        rec = records.get(sid)
        if rec is None:
            raise RoutingMissingError(f"sequence {sid} has no routing record; routing replay "
                                      "needs one for every rollout")
        checks = (("version", rec.version, version), ("layers", rec.layers, want_layers),
                  ("top_k", rec.top_k, top_k), ("num_experts", rec.num_experts, num_experts),
                  ("positions", rec.positions, n))
        for field, got, want in checks:
            if field == "version" and (got is None or want is None):
                continue
            if got != want:
                what = list(got) if field == "layers" else got
                expect = list(want) if field == "layers" else want
                raise RoutingMismatchError(f"sequence {sid}: routing record made for {field} "
                                           f"{what!r}, the learner needs {expect!r}", field=field)
