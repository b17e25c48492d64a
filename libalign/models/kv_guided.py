"""KV guidance (TRACE): the learner's K and V rounded as the sampler's FP4 KV cache rounded them.

Why
---
A sampler with an FP4 KV cache (:mod:`libalign.models.kv_cache`) attends over K and V values
that its cache quantized once, when each token was written, inside a cached decode. The
learner computes the same K and V in one teacher-forced pass over the whole sequence: other
GEMM shapes, other reduction orders, so its values differ in the last bits and a few of them
land on the other side of an FP4 rounding boundary. Its attention then reads other KV codes
than the sampler's did. The sampler's records (sites ``k`` and ``v`` of
:class:`~libalign.guidance.GuidanceRecord`: per written row the ``b`` low bits of every code
with the row's block and outer scales) fix that the way they fix the expert activations: the
learner normalizes its row with the sampler's scales and :func:`~libalign.guidance.guided_quantize`
picks, of the two FP4 levels around its value, the one whose low bits the sampler recorded.
Wherever the learner's value lies within one grid step of the sampler's (the sampler's level
is an end of the learner's bracket) the learner's code *is* the sampler's. Rows without a
record (a token the sampler never wrote, or padding) round to nearest with their own scales.

Checks before trusting the bits
-------------------------------
Records are refused with :class:`~libalign.errors.GuidanceMismatchError` (``field`` says which)
when they were made for another weight ``version``, a model with another number of ``layers``
or ``kv_heads`` or another ``head_dim``, at another bit width (``bits``), or in another KV
``format`` than the learner quantizes K and V in (records without K/V sections included).

Counting agreement
------------------
:class:`KVAgreement` counts, per layer and site, how many of the learner's K/V codes differ
from the sampler's full codes, over all rows and over the values within one grid step, which
is how a test (and a diagnosis) sees that the guidance took.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from libalign.errors import GuidanceMismatchError
from libalign.guidance import KV_SITES, GuidanceRecord, GuidanceTable
from libalign.models.kv_cache import guide_kv, kv_format, observe_kv
from libalign.models.paths import decoder_layers
from libalign.spec import NumericsSpec, normalized_with_scales
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import bracket_levels, e2m1_levels


def model_geometry(model: nn.Module) -> dict[str, int]:
    """``layers``, ``kv_heads`` and ``head_dim`` of a Hugging Face decoder (what records name)."""
    cfg = model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return {"layers": len(decoder_layers(model)), "kv_heads": heads, "head_dim": head_dim}


def _mismatch(sid, what: str, got, want) -> GuidanceMismatchError:
    return GuidanceMismatchError(f"guidance record of rollout {sid}: {what} {got!r}, expected "
                                 f"{want!r}", field=what)


def check_records(records: Mapping[int, GuidanceRecord], *, version: str | None = None,
                  geometry: Mapping[str, int] | None = None, bits: int | None = None,
                  kv_spec: NumericsSpec | None = None) -> None:
    """Refuse records made for something else (module doc); a ``None`` argument is not checked.

    ``geometry`` is :func:`model_geometry` of the learner's model; ``kv_spec`` its KV format
    (every record must then hold K/V sections in it).
    """
    for sid, rec in records.items():
        if version is not None and rec.meta.get("version", version) != version:
            raise _mismatch(sid, "version", rec.meta["version"], version)
        if bits is not None and rec.bits != bits:
            raise _mismatch(sid, "bits", rec.bits, bits)
        if kv_spec is not None and rec.kv_spec != kv_spec.name:
            raise _mismatch(sid, "format", rec.kv_spec, kv_spec.name)
        if geometry is None:
            continue
        for name in ("layers", "kv_heads"):
            if rec.meta.get(name, geometry[name]) != geometry[name]:
                raise _mismatch(sid, name, rec.meta[name], geometry[name])
        for (layer, site), rows in rec.sites.items():
            if not 0 <= layer < geometry["layers"]:
                raise _mismatch(sid, "layers", f"a section at layer {layer}",
                                f"layers below {geometry['layers']}")
            if site not in KV_SITES:
                continue
            if rows.k != geometry["head_dim"]:
                raise _mismatch(sid, "head_dim", rows.k, geometry["head_dim"])
            if rows.rows and int(rows.experts.max()) >= geometry["kv_heads"]:
                raise _mismatch(sid, "kv_heads", f"head {int(rows.experts.max())}",
                                f"heads below {geometry['kv_heads']}")


@contextmanager
def use_kv_guidance(model: nn.Module, records: Mapping[int, GuidanceRecord] | None, *,
                    table: GuidanceTable | None = None, version: str | None = None,
                    bits: int | None = None) -> Iterator[GuidanceTable | None]:
    """Round the model's K/V rows by the sampler's ``k``/``v`` records while inside.

    The model must have a KV format (:func:`~libalign.models.kv_cache.set_kv_format`); the
    records are checked against it and the model first (:func:`check_records`). ``table``
    is their :class:`~libalign.guidance.GuidanceTable` when the caller built one already (the
    activation guidance shares it); ``records=None`` (or empty) rounds to nearest.
    """
    spec = kv_format(model)
    if spec is None:
        raise GuidanceMismatchError("KV guidance for a model without an FP4 KV cache: set its "
                                    "KV format first", field="format")
    if records:
        check_records(records, version=version, geometry=model_geometry(model), bits=bits,
                      kv_spec=spec)
        if table is None:
            table = GuidanceTable(dict(records), next(model.parameters()).device)
    else:
        table = None
    with guide_kv(model, table):
        yield table


@dataclass
class KVAgreement:
    """Per ``(layer, site)``: the learner's K/V codes against the sampler's full codes.

    ``values``/``mismatched`` count every compared value; ``near``/``near_mismatched`` those
    whose learner value lies within one grid step of the sampler's (the sampler's level is an
    end of the learner's bracket under the sampler's scales). Codes compare by level (both
    zeros equal).
    """

    values: dict[tuple[int, str], int] = field(default_factory=dict)
    mismatched: dict[tuple[int, str], int] = field(default_factory=dict)
    near: dict[tuple[int, str], int] = field(default_factory=dict)
    near_mismatched: dict[tuple[int, str], int] = field(default_factory=dict)

    def add(self, key, values, mismatched, near, near_mismatched) -> None:
        """Accumulate one write's counts."""
        for d, v in ((self.values, values), (self.mismatched, mismatched), (self.near, near),
                     (self.near_mismatched, near_mismatched)):
            d[key] = d.get(key, 0) + int(v)

    def total(self, counts: dict[tuple[int, str], int]) -> int:
        """Sum of one of the count dicts over every layer and site."""
        return sum(counts.values())


@contextmanager
def count_kv_agreement(model: nn.Module, reference: GuidanceTable,
                       agreement: KVAgreement) -> Iterator[KVAgreement]:
    """Count, while inside, the model's K/V codes against ``reference`` (the sampler's records
    at 4 bits, i.e. its full codes) into ``agreement``."""
    spec = kv_format(model)

    def observe(layer: int, site: str, rows: torch.Tensor, q, keys: torch.Tensor) -> None:
        ref = reference.lookup(layer, site, keys)
        if ref is None or not bool(ref.present.any()):
            return
        hit = torch.nonzero(ref.present).squeeze(-1)
        src = ref.index[hit]
        k = rows.shape[-1]
        sampler = e2m1_levels(ref.low[src][:, :k])
        mine = e2m1_levels(unpack_nibbles(q.codes[hit])[:, :k])
        z = normalized_with_scales(rows[hit], ref.block_scales[src],
                                   None if spec.is_mx else ref.row_scales[src],
                                   spec).flatten(-2)[:, :k]
        lower, upper = bracket_levels(z)
        near = (sampler >= lower) & (sampler <= upper)
        differ = mine != sampler
        agreement.add((layer, site), sampler.numel(), differ.sum(), near.sum(),
                      (differ & near).sum())

    with observe_kv(model, observe):
        yield agreement
