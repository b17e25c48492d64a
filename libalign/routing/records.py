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
* ``weights`` (optional): the gate weights the router applied, same shape, slot for slot
  with the ids, in ``bfloat16`` (what the Hugging Face sampler hands its experts) or
  ``float32`` (what a Megatron-core router computes with ``moe_router_dtype=fp32``: kept
  as computed, so a replay with ``weights="record"`` gives the experts the very bits the
  recording router gave them); the learner uses them only when asked to;
* ``num_experts``, and the weight ``version`` the sampler served, which the learner checks.

So a token costs ``layers × top_k`` bytes (Qwen3-30B-A3B: 48 × 8 = 384 bytes; the tiny demo
model 4 × 2 = 8), plus two or four bytes an id with weights: small next to the ~45 KB of
activation guidance TRACE keeps a token.

The dense form (SGLang, slime, Miles, verl)
-------------------------------------------
SGLang (``--enable-return-routed-experts``, ``return_routed_experts`` in a request) returns
``meta_info.routed_experts``: base64 of a flat little-endian array that reshapes to
``[len(tokens) - 1, num_hidden_layers, top_k]``, one row per decoder layer *including*
layers without a router (their rows stay zero: SGLang's capture buffer is zero-filled and
only MoE layers write it), ids in the router's slot order, ``int32`` (SGLang 0.5.23;
an ``SGLANG_ROUTED_EXPERTS_DTYPE`` of ``uint16`` or ``uint8`` narrows it, announced as
``meta_info.routed_experts_dtype``). slime, Miles and verl keep exactly that array, as
``int32``. :meth:`RoutingRecord.to_dense` writes it (zeros in the layers the record does
not name) and :meth:`RoutingRecord.from_dense` reads it back, keeping the MoE ``layers``
only and refusing a row of a dense layer that is not all zeros (it would be dropped), so
the two forms convert both ways without loss; :meth:`RoutingRecord.from_sglang` and
:meth:`RoutingRecord.to_sglang` add the base64 and the dtype. Weights have no dense form:
SGLang does not return them.

Bytes
-----
:meth:`RoutingRecord.to_bytes` gives the raw little-endian arrays (ids, then weights),
row-major; :meth:`RoutingRecord.from_bytes` reads them back given the shape, checking the
byte count, the id range and that no row names an expert twice
(:class:`~libalign.errors.RoutingRecordError`). The wire form (base64 of the same bytes, with
the shape fields) is :class:`alignclient.models.RoutingWire`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from libalign.errors import RoutingMismatchError, RoutingMissingError, RoutingRecordError

#: most experts a one-byte id can name
MAX_BYTE_EXPERTS = 256
#: most experts a record can name at all (two-byte ids)
MAX_EXPERTS = 1 << 15
#: the weights' dtype by default (what the Hugging Face sampler applies)
WEIGHT_DTYPE = torch.bfloat16
#: the dtypes a record's gate weights may have, by wire name
WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: the dtypes of SGLang's dense ``routed_experts`` (int32; uint16/uint8 when narrowed)
DENSE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("<u1")}


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


def bytes_per_token(layers: int, top_k: int, num_experts: int, *, weights: bool = False,
                    weight_bytes: int = 2) -> int:
    """Record bytes a token costs: ``layers × top_k`` ids, plus weights if kept (2 bytes a
    weight in bf16, 4 in fp32)."""
    return layers * top_k * (id_bytes(num_experts) + (weight_bytes if weights else 0))


def dense_bytes_per_token(num_layers: int, top_k: int, dtype: str = "int32") -> int:
    """Bytes a token costs in the dense form SGLang returns and slime, Miles and verl keep:
    every decoder layer, ``top_k`` ids of ``dtype`` each."""
    return num_layers * top_k * _dense_dtype(dtype).itemsize


def _getter(config):
    return (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else \
        (lambda k, d=None: getattr(config, k, d))


def config_moe_layers(config) -> list[int]:
    """The MoE layers of a Hugging Face config (a mapping or an object): every one of its
    ``num_hidden_layers`` but those in ``mlp_only_layers``, the first
    ``first_k_dense_replace``, and those off the ``decoder_sparse_step``."""
    get = _getter(config)
    dense = set(get("mlp_only_layers", None) or [])
    first = int(get("first_k_dense_replace", 0) or 0)
    step = int(get("decoder_sparse_step", 1) or 1)
    return [i for i in range(int(get("num_hidden_layers")))
            if i not in dense and i >= first and (i + 1) % step == 0]


def config_geometry(config) -> dict | None:
    """The routing geometry of a Hugging Face MoE config: ``num_layers``
    (``num_hidden_layers``), the MoE ``layers`` (:func:`config_moe_layers`), ``top_k``
    (``num_experts_per_tok``) and ``num_experts`` (``num_experts`` or ``n_routed_experts``);
    None for a config without experts."""
    get = _getter(config)
    experts = int(get("num_experts", 0) or get("n_routed_experts", 0) or 0)
    if not experts or not get("num_experts_per_tok"):
        return None
    return {"num_layers": int(get("num_hidden_layers")), "layers": config_moe_layers(config),
            "top_k": int(get("num_experts_per_tok")), "num_experts": experts}


def _dense_dtype(name: str) -> np.dtype:
    if name not in DENSE_DTYPES:
        raise RoutingRecordError(f"routed experts dtype {name!r} is not one of "
                                 f"{sorted(DENSE_DTYPES)}")
    return DENSE_DTYPES[name]


def _weight_code(dtype: torch.dtype) -> str:
    return "<i2" if dtype == torch.bfloat16 else "<f4"


@dataclass
class RoutingRecord:
    """The sampler's routing of one rollout (module docstring)."""

    experts: torch.Tensor
    """``[positions, len(layers), top_k]`` expert ids (uint8 or int16)"""
    layers: tuple[int, ...]
    num_experts: int
    weights: torch.Tensor | None = None
    """``[positions, len(layers), top_k]`` gate weights (bf16 or fp32), or None"""
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
                              or w.dtype not in WEIGHT_DTYPES.values()
                              or not bool(torch.isfinite(w).all())):
            raise RoutingRecordError(f"weights must be finite bfloat16 or float32 of shape "
                                     f"{tuple(e.shape)}, got {getattr(w, 'dtype', None)} "
                                     f"{tuple(getattr(w, 'shape', ()))}")

    @property
    def weights_dtype(self) -> str | None:
        """The weights' dtype by wire name (``bfloat16``, ``float32``), None without weights."""
        if self.weights is None:
            return None
        return next(k for k, v in WEIGHT_DTYPES.items() if v == self.weights.dtype)

    def nbytes(self) -> int:
        """Bytes of ids and weights (what :meth:`to_bytes` returns)."""
        return self.experts.numel() * self.experts.element_size() + (
            0 if self.weights is None else self.weights.numel() * self.weights.element_size())

    def to_bytes(self) -> tuple[bytes, bytes | None]:
        """``(ids, weights)``: the raw little-endian arrays, row-major (weights None if absent)."""
        ids = self.experts.detach().cpu().contiguous().numpy().astype(
            "<u1" if self.experts.dtype == torch.uint8 else "<i2", copy=False).tobytes()
        w = None
        if self.weights is not None:
            t = self.weights.detach().cpu().contiguous()
            bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            w = bits.numpy().astype(_weight_code(t.dtype), copy=False).tobytes()
        return ids, w

    @classmethod
    def from_bytes(cls, ids: bytes, *, positions: int, layers: Sequence[int], top_k: int,
                   num_experts: int, weights: bytes | None = None,
                   version: str | None = None,
                   weights_dtype: str = "bfloat16") -> RoutingRecord:
        """The record of :meth:`to_bytes`' arrays, checked (RoutingRecordError);
        ``weights_dtype`` names the weights' dtype (``bfloat16`` or ``float32``)."""
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
            if weights_dtype not in WEIGHT_DTYPES:
                raise RoutingRecordError(f"routing weights dtype {weights_dtype!r} is not one "
                                         f"of {sorted(WEIGHT_DTYPES)}")
            wt = WEIGHT_DTYPES[weights_dtype]
            size = 2 if wt == torch.bfloat16 else 4
            if len(weights) != size * n:
                raise RoutingRecordError(f"routing weights hold {len(weights)} bytes; {shape} "
                                         f"{weights_dtype} weights need {size * n}")
            code = _weight_code(wt)
            arr_w = np.frombuffer(weights, dtype=code).astype(code[1:])
            t = torch.from_numpy(arr_w.copy())
            w = (t.view(torch.bfloat16) if wt == torch.bfloat16 else t).reshape(shape)
        return cls(experts, tuple(layers), num_experts, w, version)

    # --- the dense form (SGLang, slime, Miles, verl) ---------------------------------------

    def to_dense(self, num_layers: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``[positions, num_layers, top_k]`` ids of every decoder layer, as SGLang returns
        them and slime, Miles and verl keep them: the record's layers in their rows, zeros in
        the others (layers without a router)."""
        if num_layers <= self.layers[-1]:
            raise RoutingRecordError(f"num_layers {num_layers} does not hold the record's MoE "
                                     f"layer {self.layers[-1]}")
        out = torch.zeros(self.positions, num_layers, self.top_k, dtype=dtype)
        out[:, list(self.layers)] = self.experts.to(dtype)
        return out

    @classmethod
    def from_dense(cls, dense: torch.Tensor | np.ndarray, *, layers: Sequence[int],
                   num_experts: int, version: str | None = None) -> RoutingRecord:
        """The record of a dense ``[positions, num_layers, top_k]`` id array (any integer
        dtype), keeping the MoE ``layers``. RoutingRecordError if the array is not 3-D
        integers, names a layer it does not have, holds an id outside ``[0, num_experts)`` or
        a repeated id in a MoE layer's row, or a non-zero id in a layer that is not in
        ``layers`` (which the record would drop: the conversion would lose it)."""
        if isinstance(dense, np.ndarray):
            dense = np.ascontiguousarray(dense)
            t = torch.from_numpy(dense if dense.flags.writeable else dense.copy())
        else:
            t = dense.detach().cpu()
        if t.dim() != 3 or t.dtype.is_floating_point or t.dtype.is_complex \
                or t.dtype == torch.bool:
            raise RoutingRecordError(f"routed experts must be an integer [positions, layers, "
                                     f"top_k] array, got {t.dtype} {tuple(t.shape)}")
        want = [int(x) for x in layers]
        if not want or min(want) < 0 or max(want) >= t.shape[1]:
            raise RoutingRecordError(f"MoE layers {want} do not lie in the dense form's "
                                     f"{t.shape[1]} layers")
        wide = t.long() if t.dtype != torch.uint8 else t.to(torch.int16)
        others = [i for i in range(t.shape[1]) if i not in set(want)]
        if others and t.numel():
            bad = wide[:, others].ne(0).flatten(1).any(1)
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                lay = others[int(wide[row, others].ne(0).flatten(1).any(1).nonzero()[0])]
                raise RoutingRecordError(f"routed experts name experts at layer {lay} (token "
                                         f"{row}), which is not a MoE layer of {want}: the "
                                         "record would drop them")
        ids = wide[:, want]
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_experts:
                raise RoutingRecordError(f"expert ids must lie in [0, {num_experts}), got "
                                         f"{lo}..{hi}")
        return cls(ids.to(id_dtype(num_experts)).contiguous(), tuple(want), num_experts,
                   None, version)

    def to_sglang(self, num_layers: int, dtype: str = "int32") -> str:
        """The base64 ``meta_info.routed_experts`` SGLang would return for this routing (the
        dense form in ``dtype``: ``int32``, ``uint16`` or ``uint8``)."""
        dt = _dense_dtype(dtype)
        if self.experts.numel() and int(self.experts.max()) > np.iinfo(dt).max:
            raise RoutingRecordError(f"expert id {int(self.experts.max())} does not fit {dtype}")
        arr = self.to_dense(num_layers, torch.int32).numpy().astype(dt)
        return base64.b64encode(arr.tobytes()).decode("ascii")

    @classmethod
    def from_sglang(cls, routed_experts: str, *, positions: int, num_layers: int,
                    layers: Sequence[int], top_k: int, num_experts: int,
                    dtype: str = "int32", version: str | None = None) -> RoutingRecord:
        """The record of SGLang's ``meta_info.routed_experts``: base64 of ``[positions,
        num_layers, top_k]`` ids in ``dtype`` (``meta_info.routed_experts_dtype`` when the
        server announces one, else ``int32``), ``positions = len(tokens) - 1``.
        RoutingRecordError naming the fault: not base64, a byte count that does not fit the
        shape and dtype, and what :meth:`from_dense` refuses."""
        dt = _dense_dtype(dtype)
        if not isinstance(routed_experts, str):
            raise RoutingRecordError(f"routed_experts must be a base64 string, got "
                                     f"{type(routed_experts).__name__}")
        try:
            raw = base64.b64decode(routed_experts, validate=True)
        except (binascii.Error, ValueError):
            raise RoutingRecordError("routed_experts is not standard base64 "
                                     f"({routed_experts[:16]!r}...)") from None
        shape = (positions, num_layers, top_k)
        need = positions * num_layers * top_k * dt.itemsize
        if positions < 0 or len(raw) != need:
            raise RoutingRecordError(f"routed_experts holds {len(raw)} bytes; {list(shape)} "
                                     f"{dtype} ids (len(tokens) - 1 = {positions} rows) need "
                                     f"{need}: wrong dtype, layer count or token count")
        arr = np.frombuffer(raw, dtype=dt).reshape(shape)
        return cls.from_dense(arr, layers=layers, num_experts=num_experts, version=version)


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
