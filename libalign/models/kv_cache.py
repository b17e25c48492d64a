"""FP4 KV cache: keys and values quantized on write, dequantized on read (TRACE's FP4 KV rollout).

What is stored
--------------
A decoder layer's attention writes, for every token, one key and one value row per key/value
head (``head_dim`` values each, after ``k_norm`` and the rotary embedding: what Hugging Face
hands to ``Cache.update``). :class:`FP4KVCache` keeps those rows as FP4 bits in a KV preset
(:data:`libalign.spec.presets.KV_PRESETS`):

* ``kv_nvfp4``: row-scaled NVFP4, one outer scale per head row and one E4M3 scale per 16
  values;
* ``kv_mxfp4``: MXFP4, one E8M0 scale per 32 values (``head_dim`` a multiple of 32);
* ``kv_sglang_nvfp4`` and ``kv_sglang_fp4_mx_block16``: what SGLang writes with
  ``--kv-cache-dtype nvfp4`` and ``fp4_mx_block16``, bit for bit, so a learner reproduces an
  SGLang sampler's K/V. ``kv_sglang_nvfp4`` divides by one global scale per layer for K and
  one for V: :class:`KVScales` holds them with where they came from (the checkpoint's
  ``k_scale``/``v_scale``, a calibration, or SGLang's default 1.0), and every row written in a
  layer carries that layer's scale.

A row's bits depend on that row alone (the row is the scale domain), so the cache quantizes
each token's rows once, when they are written, through :func:`libalign.kernels.quantize` (the
compiled CPU/CUDA kernels for ``kv_nvfp4``; the spec for ``kv_mxfp4``, which has no kernel
yet), keeps packed codes and scales only, and dequantizes the whole layer
(:func:`libalign.spec.dequantize`'s bits, in the model's dtype; for ``kv_nvfp4`` through
:func:`libalign.gemm.inner_values`' table gather) each time attention reads it. The
attention therefore multiplies exactly the values the spec says the FP4 cache holds. A
teacher-forced pass never reads its cache again, so its cache (:func:`full_sequence_kwargs`)
keeps the values read instead of the codes; on a CUDA GPU with Triton one fused pass then
quantizes each write and reads it back (:func:`fused_kv_read`: the same bits, guided or not).

Who uses it, and how
--------------------
The format is a property of the model instance (:func:`set_kv_format`; a sampler engine sets
it from its execution path's ``kv_spec``). The decode helpers of :mod:`libalign.models.scoring`
build their cache with :func:`new_cache` (an :class:`FP4KVCache` when a format is set, the
stock ``DynamicCache`` otherwise), and a teacher-forced full-sequence pass (the learner's
scores, its training forward) passes :func:`full_sequence_kwargs`: a fresh FP4 cache, so its
attention reads K and V quantized the same way. There the quantization is differentiable by
the straight-through estimator: forward the dequantized FP4 values, backward the identity.

Two optional companions ride on the same writes: a :class:`~libalign.guidance.GuidanceCapture`
(the sampler records each written row's bits, sites ``k`` and ``v``: :func:`capture_kv`) and
a :class:`~libalign.guidance.GuidanceTable` (the learner rounds each row as the sampler's
record says: :func:`libalign.models.kv_guided.use_kv_guidance`). Rows are named by the row
keys of the forward call (:func:`libalign.models.paths.set_row_keys`) with the head in the
index column, ``seq << 40 | pos << 16 | head + 1``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from libalign import gemm
from libalign.errors import NonFiniteError, SpecError
from libalign.gemm.triton_grouped import triton_qdq_gap, triton_qdq_rows
from libalign.guidance import (
    GuidanceCapture,
    GuidanceTable,
    RowGuide,
    guided_quantize,
    indexed_keys,
    select_layers,
)
from libalign.kernels import ops
from libalign.models.paths import decoder_layers, row_keys_of
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor, dequantize
from libalign.spec.presets import KV_PRESETS

try:
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - transformers without the layered cache API
    Cache = DynamicCache = DynamicLayer = object

_STATE = "_libalign_kv_state"
#: observer(layer, site, rows, quantized, keys): the unquantized ``[n, head_dim]`` rows of one
#: write (detached), their FP4 bits and their row keys (``kv_guided.count_kv_agreement``).
KVObserver = Callable[[int, str, torch.Tensor, NVFP4Tensor, torch.Tensor], None]


#: Where a KV format's per-layer global scales come from.
SCALE_SOURCES = ("checkpoint", "calibration", "default")


@dataclass(frozen=True)
class KVScales:
    """The global decode scales of an FP4 KV cache whose format takes them (``kv_sglang_nvfp4``):
    one per layer for K (``k``) and one for V (``v``), fp32 values, and their ``source``.

    SGLang's ``NVFP4KVCacheMethod.load_scales_from_model`` reads them from the checkpoint's
    attention ``k_scale``/``v_scale`` (1.0 for a layer without one; on SM100, where its kernels
    expect ``amax / 448``, a calibrated scale other than 1.0 is multiplied by 6):
    :meth:`from_checkpoint` picks the same values. A calibration from observed maxima takes
    ModelOpt's ``amax / (6 * 448)`` (:meth:`calibrate`); :meth:`default` is SGLang's 1.0 for
    every layer. They are part of the weight version (the manifest's ``kv_scales``).
    """

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default"

    def __post_init__(self) -> None:
        if self.source not in SCALE_SOURCES:
            raise SpecError(f"KV scales source must be one of {SCALE_SOURCES}, got {self.source!r}")
        if len(self.k) != len(self.v):
            raise SpecError(f"KV scales for {len(self.k)} layers of K and {len(self.v)} of V")
        for site, vals in (("k", self.k), ("v", self.v)):
            for layer, g in enumerate(vals):
                _check_scale(layer, site, g)

    @property
    def layers(self) -> int:
        """Layers the scales cover."""
        return len(self.k)

    def scale(self, layer: int, site: str) -> float:
        """The decode scale of ``site`` (``k``/``v``) at ``layer``."""
        if not 0 <= layer < self.layers:
            raise SpecError(f"layer {layer} k_scale/v_scale: missing (scales cover "
                            f"{self.layers} layers)")
        return (self.k if site == "k" else self.v)[layer]

    @classmethod
    def default(cls, layers: int) -> KVScales:
        """SGLang's default, 1.0 for K and V of every layer."""
        return cls((1.0,) * layers, (1.0,) * layers, "default")

    @classmethod
    def from_checkpoint(cls, k_scales: Mapping[int, float | None],
                        v_scales: Mapping[int, float | None], layers: int, *,
                        sm100: bool = False) -> KVScales:
        """The scales SGLang loads from a checkpoint's per-layer ``k_scale``/``v_scale`` (None
        or absent: 1.0; ``sm100``: a scale other than 1.0 times 6), rounded to fp32."""
        def pick(scales, layer):
            g = scales.get(layer)
            g = 1.0 if g is None else float(g)
            return _f32(g * 6.0 if sm100 and g != 1.0 else g)
        return cls(tuple(pick(k_scales, i) for i in range(layers)),
                   tuple(pick(v_scales, i) for i in range(layers)), "checkpoint")

    @classmethod
    def calibrate(cls, k_amax: Iterable[float], v_amax: Iterable[float]) -> KVScales:
        """Scales from per-layer K and V maxima: ``fl(amax / 2688)`` (ModelOpt's KV calibration;
        a zero maximum gives 1.0)."""
        def one(a):
            a = float(a)
            if not math.isfinite(a) or a < 0:
                raise SpecError(f"a calibrated K/V maximum must be finite and >= 0, got {a!r}")
            return _f32(a / 2688.0) if a > 0 else 1.0
        return cls(tuple(one(a) for a in k_amax), tuple(one(a) for a in v_amax), "calibration")

    def to_dict(self) -> dict:
        """JSON-able form (the manifest's ``kv_scales``)."""
        return {"source": self.source, "k": list(self.k), "v": list(self.v)}

    @classmethod
    def from_dict(cls, d: Mapping) -> KVScales:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(tuple(float(x) for x in d["k"]), tuple(float(x) for x in d["v"]),
                       str(d["source"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(f"unreadable KV scales {d!r} ({e})") from None


def _f32(g: float) -> float:
    return float(torch.tensor(g, dtype=torch.float32))


def _check_scale(layer: int, site: str, g) -> None:
    """A global scale must be a finite positive fp32 number with a finite reciprocal."""
    if g is None:
        raise SpecError(f"layer {layer} {site}_scale: missing")
    t = torch.tensor(float(g), dtype=torch.float32)
    if not (bool(torch.isfinite(t)) and float(t) > 0 and bool(torch.isfinite(1 / t))):
        raise NonFiniteError(f"layer {layer} {site}_scale = {g!r}", 1, int(math.isnan(float(g))),
                             int(math.isinf(float(g))), [(layer,)])


@dataclass(frozen=True)
class KVState:
    """A model's KV settings: the format, its global scales where it takes them, and what rides
    on the writes (capture, guidance)."""

    spec: NumericsSpec
    scales: KVScales | None = None
    capture: GuidanceCapture | None = None
    capture_layers: frozenset[int] = frozenset()
    guide: GuidanceTable | None = None
    observer: KVObserver | None = None


def kv_spec_of(spec: NumericsSpec | str | None) -> NumericsSpec | None:
    """A KV preset by name (or a spec, checked); None stays None. SpecError for another preset."""
    if spec is None:
        return None
    got = PRESETS.get(spec) if isinstance(spec, str) else spec
    if not isinstance(got, NumericsSpec) or got.name not in KV_PRESETS or \
            got != PRESETS[got.name]:
        raise SpecError(f"KV format must be one of {KV_PRESETS}, got {spec!r}")
    return got


def kv_state(model: nn.Module) -> KVState | None:
    """The model's KV settings (None: K and V stay in the model's dtype)."""
    return model.__dict__.get(_STATE)


def kv_format(model: nn.Module) -> NumericsSpec | None:
    """The KV preset the model's caches store K and V in, or None."""
    st = kv_state(model)
    return None if st is None else st.spec


def kv_scales_for(spec: NumericsSpec, scales: KVScales | None, layers: int) -> KVScales | None:
    """The scales a KV format writes with: ``scales`` (or :meth:`KVScales.default`) for a format
    that takes a global scale, checked to cover ``layers``; None for the others (SpecError if
    scales are given to a format that has no use for them)."""
    if spec.outer_source != "given":
        if scales is not None:
            raise SpecError(f"KV format {spec.name!r} computes its own scales; it takes no "
                            "k_scale/v_scale")
        return None
    scales = KVScales.default(layers) if scales is None else scales
    if scales.layers != layers:
        raise SpecError(f"layer {min(scales.layers, layers)} k_scale/v_scale: the scales cover "
                        f"{scales.layers} layers, the model has {layers}")
    return scales


def set_kv_format(model: nn.Module, spec: NumericsSpec | str | None,
                  scales: KVScales | None = None) -> None:
    """Store K and V as ``spec`` (a KV preset) from now on; None goes back to the model's dtype.
    ``scales``: the per-layer global scales of a format that takes them (default: 1.0)."""
    spec = kv_spec_of(spec)
    if spec is None:
        model.__dict__.pop(_STATE, None)
        return
    _check_head_dim(model, spec)
    scales = kv_scales_for(spec, scales, len(decoder_layers(model)))
    st = kv_state(model)
    model.__dict__[_STATE] = KVState(spec, scales) if st is None else \
        replace(st, spec=spec, scales=scales)


def _check_head_dim(model: nn.Module, spec: NumericsSpec) -> None:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if spec.k_remainder == "refuse" and head_dim % spec.block_size:
        raise SpecError(f"KV format {spec.name!r} needs a head size that is a multiple of "
                        f"{spec.block_size}, the model's is {head_dim}")


@contextmanager
def _with_state(model: nn.Module, **changes) -> Iterator[KVState]:
    before = kv_state(model)
    if before is None:
        raise SpecError("the model has no KV format: set_kv_format(model, 'kv_nvfp4') first")
    model.__dict__[_STATE] = replace(before, **changes)
    try:
        yield model.__dict__[_STATE]
    finally:
        after = kv_state(model)
        if after is not None:  # the format may have changed inside; only the companions go back
            model.__dict__[_STATE] = replace(after, capture=before.capture,
                                             capture_layers=before.capture_layers,
                                             guide=before.guide, observer=before.observer)


@contextmanager
def use_kv_format(model: nn.Module, spec: NumericsSpec | str | None,
                  scales: KVScales | None = None) -> Iterator[nn.Module]:
    """:func:`set_kv_format` for a ``with`` block; the previous format comes back after it."""
    before = kv_state(model)
    set_kv_format(model, spec, scales)
    try:
        yield model
    finally:
        if before is None:
            model.__dict__.pop(_STATE, None)
        else:
            model.__dict__[_STATE] = before


@contextmanager
def capture_kv(model: nn.Module, capture: GuidanceCapture,
               layers: Iterable[int] | None = None) -> Iterator[GuidanceCapture]:
    """Record every K/V row the model's FP4 caches write at ``layers`` (all by default) into
    ``capture`` (sites ``k`` and ``v``) while inside."""
    n = len(decoder_layers(model))
    chosen = select_layers(range(n)) if layers is None else sorted({int(x) for x in layers})
    bad = [x for x in chosen if not 0 <= x < n]
    if bad:
        raise SpecError(f"layers {bad} do not exist; the model has {n} layers")
    with _with_state(model, capture=capture, capture_layers=frozenset(chosen)):
        yield capture


@contextmanager
def guide_kv(model: nn.Module, table: GuidanceTable | None) -> Iterator[GuidanceTable | None]:
    """Round K/V rows as ``table``'s ``k``/``v`` records say while inside (unchecked: see
    :func:`libalign.models.kv_guided.use_kv_guidance`, which checks them first)."""
    with _with_state(model, guide=table):
        yield table


@contextmanager
def observe_kv(model: nn.Module, observer: KVObserver) -> Iterator[None]:
    """Call ``observer`` on every K/V write of the model's FP4 caches while inside."""
    with _with_state(model, observer=observer):
        yield


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized values; backward: the gradient of the unquantized ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(x: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """``read`` (the dequantized FP4 values of ``x``) forward, the identity backward: the
    gradient reaches ``x`` as if nothing was quantized (when autograd tracks ``x`` at all)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, read)
    return read


class FP4KVLayer(DynamicLayer):
    """One decoder layer's K/V as FP4 bits (module doc). Rows are ``[batch, heads, seq]``.

    ``keep_bits=False`` (a teacher-forced pass's cache, :func:`full_sequence_kwargs`) keeps the
    values read instead of the codes: the same values, and with no capture or observer asking
    for codes a CUDA GPU reads them back in one fused pass (:func:`fused_kv_read`).
    """

    is_croppable = False

    def __init__(self, model: nn.Module, layer: int, keep_bits: bool = True):
        super().__init__()
        self.model = model
        self.layer = layer
        self.length = 0
        self.keep_bits = keep_bits
        self.bits: dict[str, tuple | None] = {"k": None, "v": None}
        self.reads: dict[str, torch.Tensor | None] = {"k": None, "v": None}

    def get_seq_length(self) -> int:
        """Tokens held."""
        return self.length

    def reset(self) -> None:
        """Forget every token."""
        super().reset()
        self.length = 0
        self.bits = {"k": None, "v": None}
        self.reads = {"k": None, "v": None}

    def crop(self, tokens_to_remove: int) -> None:
        """FP4 rows cannot be cropped here (a decode never does)."""
        raise SpecError("the FP4 KV cache does not crop")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these batch rows."""
        self.bits = {s: None if b is None else tuple(None if t is None else t[indices] for t in b)
                     for s, b in self.bits.items()}
        self.reads = {s: None if r is None else r[indices] for s, r in self.reads.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search)."""
        self.batch_select_indices(beam_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Quantize the new rows, append their bits, return the layer's K and V dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        st = kv_state(self.model)
        if st is None:
            raise SpecError("the model's KV format was unset while an FP4 cache was in use")
        keys = None
        capture = st.capture if self.layer in st.capture_layers else None
        if capture is not None or st.guide is not None or st.observer is not None:
            keys = _head_row_keys(self.model, key_states)
        out = []
        for site, x in (("k", key_states), ("v", value_states)):
            b, h, t, d = x.shape
            rows = x.reshape(b * h * t, d)
            guide = None if st.guide is None else st.guide.lookup(self.layer, site, keys)
            def keep(q, site=site, rows=rows):  # the codes, where a capture or observer wants them
                if capture is not None:
                    capture.add(self.layer, site, q, keys)
                if st.observer is not None:
                    st.observer(self.layer, site, rows.detach(), q, keys)

            fused = capture is None and st.observer is None and not self.keep_bits
            value, q = read_rows(rows.detach(), st.spec, guide, x.dtype, fused=fused, on_codes=keep,
                                 outer=row_outer(st.scales, self.layer, site, rows))
            read = straight_through(x, value.reshape(b, h, t, d))
            if not self.keep_bits:  # earlier reads are held as values, without their graph
                if self.reads[site] is not None:
                    read = torch.cat([self.reads[site], read], dim=-2)
                self.reads[site] = read.detach()
                out.append(read)
                continue
            new = _grid(q, (b, h, t))
            past = self.bits[site]
            if past is not None:
                read = torch.cat([_dequantize_grid(past, st.spec, d, x.dtype), read], dim=-2)
                new = tuple(None if p is None else torch.cat([p, n], dim=2)
                            for p, n in zip(past, new, strict=True))
            self.bits[site] = new
            out.append(read)
        self.length += key_states.shape[-2]
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes of codes and scales held (what an FP4 cache costs, against 2 bytes a bf16 value;
        with ``keep_bits=False``, of the values held)."""
        held = [t for b in self.bits.values() if b is not None for t in b if t is not None]
        held += [r for r in self.reads.values() if r is not None]
        return sum(t.numel() * t.element_size() for t in held)


def _grid(q: NVFP4Tensor, lead: tuple[int, int, int]) -> tuple:
    """A quantized ``[b*h*t, d]`` as ``(codes, block scales, outer)`` shaped ``[b, h, t, ...]``."""
    outer = None if q.outer_scale is None else q.outer_scale.reshape(*lead)
    return (q.codes.reshape(*lead, -1), q.block_scales.reshape(*lead, -1), outer)


def _dequantize_grid(bits: tuple, spec: NumericsSpec, d: int, dtype: torch.dtype) -> torch.Tensor:
    codes, bs, outer = bits
    lead = tuple(codes.shape[:3])
    m = lead[0] * lead[1] * lead[2]
    q = NVFP4Tensor(codes.reshape(m, -1), bs.reshape(m, -1),
                    None if outer is None else outer.reshape(m), spec, (m, d))
    return dequantize_kv(q, dtype).reshape(*lead, d)


def dequantize_kv(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`~libalign.spec.dequantize`'s bits; ``kv_nvfp4`` (TE order ``(q * s) * dec``) takes
    the exact ``q * s`` from one table gather (:func:`libalign.gemm.inner_values`)."""
    if q.spec.is_mx or q.spec.op_order != "te":
        return dequantize(q, dtype)
    return (gemm.inner_values(q, torch.float32) * q.outer_dec.reshape(-1, 1)).to(dtype)


def row_outer(scales: KVScales | None, layer: int, site: str,
              rows: torch.Tensor) -> torch.Tensor | None:
    """The given outer scale of each of ``rows`` (the layer's global scale of ``site``), or None
    for a format that computes its own."""
    if scales is None:
        return None
    return torch.full((rows.shape[0],), scales.scale(layer, site), dtype=torch.float32,
                      device=rows.device)


def read_rows(rows: torch.Tensor, spec: NumericsSpec, guide: RowGuide | None, dtype: torch.dtype,
              *, fused: bool = True, on_codes=None,
              outer: torch.Tensor | None = None) -> tuple[torch.Tensor, NVFP4Tensor | None]:
    """``rows`` ``[n, head_dim]`` (detached) as an FP4 cache reads them back in ``dtype``:
    ``(values, codes)``. With ``fused`` (and where it serves) one pass gives the values and no
    codes (:func:`fused_kv_read`); otherwise the rows are quantized (guided by ``guide`` where
    it has records), ``on_codes(codes)`` sees them (a capture, an observer), and
    :func:`dequantize_kv` reads them: the same values either way. ``outer`` is the rows' given
    outer scale (:func:`row_outer`) under a format that takes one."""
    value = fused_kv_read(rows, spec, guide) if fused and outer is None else None
    if value is not None:
        return value, None
    q = guided_quantize(rows, spec, guide, outer_scale=outer) if guide is not None else \
        ops.quantize(rows, spec, outer_scale=outer)
    if on_codes is not None:
        on_codes(q)
    return dequantize_kv(q, dtype), q


def fused_kv_read(rows: torch.Tensor, spec: NumericsSpec, guide: RowGuide | None) -> torch.Tensor | None:
    """``rows`` ``[n, head_dim]`` as the FP4 cache reads them back, from one fused Triton pass
    (:func:`libalign.gemm.triton_grouped.triton_qdq_rows`), or None where that pass cannot serve
    (CPU, no Triton, ``kv_mxfp4``, a head size that is not a multiple of 16, fused guidance
    switched off: :func:`~libalign.gemm.triton_grouped.triton_qdq_gap`).

    With None the caller quantizes (:func:`libalign.kernels.quantize`, or
    :func:`~libalign.guidance.guided_quantize` with ``guide``) and reads with
    :func:`dequantize_kv`: the same bits, and the codes it may need (a capture, an observer).
    """
    if not rows.is_cuda or triton_qdq_gap(spec, guide, rows) is not None:
        return None
    return triton_qdq_rows(rows, spec, guide)


def _head_row_keys(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Row keys of ``x`` ``[b, h, t, d]`` in its row order: the token's key with ``head + 1``."""
    flat = row_keys_of(model)
    b, h, t, _ = x.shape
    if flat is None or flat.numel() != b * t:
        raise SpecError("KV guidance needs row keys for every forward call: run the model through "
                        "libalign.models.score_sequences / generate / KVDecode (they set them)")
    tok = flat.to(x.device).reshape(b, 1, t).expand(b, h, t)
    head = torch.arange(h, device=x.device).reshape(1, h, 1)
    return indexed_keys(tok, head).reshape(-1)


class FP4KVCache(Cache):
    """A Hugging Face ``Cache`` of :class:`FP4KVLayer` s, one per decoder layer of ``model``
    (``keep_bits``: see :class:`FP4KVLayer`)."""

    def __init__(self, model: nn.Module, keep_bits: bool = True):
        if kv_state(model) is None:
            raise SpecError("an FP4 KV cache needs a KV format: set_kv_format(model, ...) first")
        super().__init__(layers=[FP4KVLayer(model, i, keep_bits)
                                 for i in range(len(decoder_layers(model)))])

    def nbytes(self) -> int:
        """Bytes of FP4 codes and scales held over all layers."""
        return sum(layer.nbytes() for layer in self.layers)


def new_cache(model: nn.Module):
    """The cache a decode of ``model`` uses: FP4 when it has a KV format, else ``DynamicCache``."""
    return FP4KVCache(model) if kv_state(model) is not None else DynamicCache(config=model.config)


def cache_kwarg(fn) -> str:
    """The name a model's ``forward`` takes its cache under (``cache``; older: ``past_key_values``)."""
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def full_sequence_kwargs(model: nn.Module) -> dict:
    """Keyword arguments of a teacher-forced pass over whole sequences: ``use_cache=False``, or
    with a KV format a fresh FP4 cache, so attention reads K and V as the sampler's cache holds
    them (differentiable: straight-through). The cache keeps values, not codes, so on a CUDA GPU
    one fused pass quantizes and reads each write (:func:`fused_kv_read`)."""
    if kv_state(model) is None:
        return {"use_cache": False}
    return {"use_cache": True, cache_kwarg(model.forward): FP4KVCache(model, keep_bits=False)}
