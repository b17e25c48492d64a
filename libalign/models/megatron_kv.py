"""FP4 KV in a Megatron-core GPT: the learner's attention reads K and V as the sampler's cache held them.

What the Hugging Face learner does
----------------------------------
A sampler with an FP4 KV cache (:mod:`libalign.models.kv_cache`) quantizes every key and value
head row (``head_dim`` values, after the QK norm and the rotary embedding) when it writes it,
and attends over the dequantized values. The embedded learner's teacher-forced pass writes a
whole sequence into a fresh FP4 cache at once: each row is quantized in the path's KV preset
(row-scaled, so a row's bits depend on that row alone), attention reads the dequantized
values, and the backward is the identity (straight-through). With the sampler's KV guidance
(sites ``k``/``v`` of its records, :mod:`libalign.models.kv_guided`) each row with a record is
rounded by :func:`~libalign.guidance.guided_quantize` with the sampler's scales and low bits.

The same in Megatron
--------------------
Megatron's attention computes the same K and V (``[s, b, groups, head_dim]``, after its QK
norm and rotary embedding) and hands them to its core-attention slot, which libalign fills
with :class:`~libalign.models.megatron_modules.SDPACoreAttention` under
``numerics="qwen3"``. :func:`use_kv` sets that module's ``kv_hook`` in every layer: each
site's rows are quantized exactly as :class:`~libalign.models.kv_cache.FP4KVLayer` quantizes
them (:func:`libalign.kernels.quantize` or the guided rounding, then
:func:`~libalign.models.kv_cache.dequantize_kv` and
:func:`~libalign.models.kv_cache.straight_through`; on a CUDA GPU with Triton, where no capture
asks for the codes, one fused pass gives the same values:
:func:`~libalign.models.kv_cache.read_rows`), and named as Hugging Face names them:
the token's row key (:func:`libalign.models.megatron.set_row_keys`) with ``head + 1`` in the
index column. Only the row order differs (``[s, b, head]`` here, ``[b, head, s]`` there),
which changes no row's bits and no lookup. Given the Hugging Face model's K and V bit for bit
(which ``numerics="qwen3"`` gives), the Megatron learner's scores are then the Hugging Face
learner's on a KV path bit for bit.

Under expert parallelism attention is replicated: each rank quantizes its own tokens' rows,
looked up in a table of every record (the same table the expert guidance uses).
``numerics="megatron"`` keeps Megatron's own core attention, which has no hook:
:func:`use_kv` refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from libalign.errors import SpecError
from libalign.guidance import GuidanceCapture, GuidanceTable
from libalign.models.kv_cache import (
    KVScales,
    kv_scales_for,
    kv_spec_of,
    read_rows,
    row_outer,
    straight_through,
)
from libalign.models.megatron_modules import SDPACoreAttention
from libalign.spec import NumericsSpec


def attention_modules(model: nn.Module) -> dict[int, SDPACoreAttention]:
    """The :class:`SDPACoreAttention` of every layer, by 0-based layer index."""
    return {m.layer: m for m in model.modules() if isinstance(m, SDPACoreAttention)}


def kv_geometry(model: nn.Module) -> dict[str, int]:
    """``layers``, ``kv_heads`` and ``head_dim`` of a Megatron GPT (what K/V records name;
    :func:`libalign.models.kv_guided.model_geometry` is the Hugging Face side's)."""
    cfg = model.config
    return {"layers": int(cfg.num_layers),
            "kv_heads": int(cfg.num_query_groups or cfg.num_attention_heads),
            "head_dim": int(cfg.kv_channels)}


def head_row_keys(tokens: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Keys of ``x`` ``[s, b, h, d]``'s rows in its order: the token's key (``tokens``, flat
    ``[s*b]``) with ``head + 1`` in the index column, -1 where the token has none."""
    s, b, h, _ = x.shape
    if tokens is None or tokens.numel() != s * b:
        raise SpecError("FP4 KV guidance needs the row keys of every token "
                        "(libalign.models.megatron.set_row_keys)")
    tok = tokens.to(x.device).reshape(s, b, 1).expand(s, b, h)
    head = torch.arange(1, h + 1, dtype=torch.int64, device=x.device).reshape(1, 1, h)
    return torch.where(tok >= 0, tok | head, tok).reshape(-1)


def quantize_heads(x: torch.Tensor, spec: NumericsSpec, layer: int, site: str,
                   table: GuidanceTable | None, tokens: torch.Tensor | None,
                   capture: GuidanceCapture | None = None,
                   scales: KVScales | None = None) -> torch.Tensor:
    """``x`` ``[s, b, h, d]`` as the FP4 cache holds it: each head row quantized in ``spec``
    (with the layer's global scale from ``scales`` where the format takes one; guided by
    ``table``'s records of ``layer``/``site`` where it has them; the bits kept in ``capture``
    if given), dequantized in ``x``'s dtype; straight-through backward."""
    d = x.shape[-1]
    rows = x.reshape(-1, d).detach()
    keys = head_row_keys(tokens, x) if table is not None or capture is not None else None
    guide = None if table is None else table.lookup(layer, site, keys)
    keep = None if capture is None else (lambda q: capture.add(layer, site, q, keys))
    read, _ = read_rows(rows, spec, guide, x.dtype, fused=capture is None, on_codes=keep,
                        outer=row_outer(scales, layer, site, rows))
    return straight_through(x, read.reshape(x.shape))


def check_kv_capable(model: nn.Module, spec: NumericsSpec | str) -> NumericsSpec:
    """The KV preset, after checking the model can quantize K/V in it (SpecError: Megatron's
    own core attention, or a head size the format cannot block)."""
    spec = kv_spec_of(spec)
    if not attention_modules(model):
        raise SpecError("FP4 KV needs libalign's core attention (build_gpt_model with "
                        "numerics='qwen3'); Megatron's own has no K/V hook")
    head_dim = kv_geometry(model)["head_dim"]
    if spec.k_remainder == "refuse" and head_dim % spec.block_size:
        raise SpecError(f"KV format {spec.name!r} needs a head size that is a multiple of "
                        f"{spec.block_size}, the model's is {head_dim}")
    return spec


@contextmanager
def use_kv(model: nn.Module, spec: NumericsSpec | str, table: GuidanceTable | None = None, *,
           capture: GuidanceCapture | None = None,
           scales: KVScales | None = None) -> Iterator[NumericsSpec]:
    """Quantize every layer's K and V in the KV preset ``spec`` while inside, rounded by
    ``table``'s ``k``/``v`` records where present (checked by the caller:
    :func:`libalign.models.kv_guided.check_records` with :func:`kv_geometry`); ``capture``
    keeps every row's bits (sites ``k``/``v``), as a sampler's capture does. ``scales``: the
    per-layer global scales of a format that takes them (``kv_sglang_nvfp4``; default 1.0)."""
    spec = check_kv_capable(model, spec)
    scales = kv_scales_for(spec, scales, kv_geometry(model)["layers"])
    mods = attention_modules(model)

    def make(m: SDPACoreAttention):
        def hook(site: str, x: torch.Tensor) -> torch.Tensor:
            return quantize_heads(x, spec, m.layer, site, table, m.row_keys, capture, scales)
        return hook

    try:
        for m in mods.values():
            m.kv_hook = make(m)
        yield spec
    finally:
        for m in mods.values():
            m.kv_hook = None
