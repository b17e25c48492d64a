"""TRACE on a Hugging Face Qwen3-MoE model: the sampler captures guidance, the learner consumes it.

Sampler side
------------
:func:`capture_guidance` attaches an activation hook to the chosen MoE layers: every expert
activation the sampler's quantized path rounds (the FC1 input once per token, the FC2 input
once per token and expert) is quantized as usual and kept, keyed by the sequence id and
position the scoring and decoding helpers name (:func:`libalign.models.paths.set_row_keys`).
:meth:`libalign.guidance.GuidanceCapture.records` then turns what was kept into one compact
record per rollout.

Learner side
------------
:func:`use_guidance` attaches a hook that rounds each activation row with the sampler's scales
and guided rounding where a record exists for that (sequence, position, expert), and to
nearest with its own scales elsewhere (a token routed to an expert the sampler did not pick
has no FC2 record). Run the layers on ``nvfp4_trace`` (or any row-scaled path) while it is
attached. Given the sampler's full codes as ``reference`` it also counts, per layer and
site, how many codes differ between the two sides before guidance (the learner's own
round-to-nearest) and after.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from libalign.errors import SpecError
from libalign.guidance import (
    ACT_SITES,
    GuidanceCapture,
    GuidanceTable,
    guided_quantize,
    indexed_keys,
)
from libalign.kernels import ops
from libalign.models.paths import moe_layer_indices, row_keys_of, set_activation_hook
from libalign.spec import PRESETS, NumericsSpec
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import canonical_zero


def _keys(model: nn.Module, a: torch.Tensor, token_of: torch.Tensor,
          expert_of: torch.Tensor | None) -> torch.Tensor:
    """Row keys of an activation: its tokens' keys (plus the expert at fc2)."""
    flat = row_keys_of(model)
    rows = a.shape[0] if expert_of is None else (int(token_of.max()) + 1 if token_of.numel() else 0)
    if flat is None or (flat.numel() != rows if expert_of is None else flat.numel() < rows):
        raise SpecError("guidance needs row keys for every forward call: run the model through "
                        "libalign.models.score_sequences / generate / KVDecode (they set them)")
    keys = flat[token_of]
    if expert_of is not None:
        keys = indexed_keys(keys, expert_of)
    return keys


def _layers(model: nn.Module, layers: Iterable[int] | None) -> list[int]:
    moe = moe_layer_indices(model)
    chosen = moe if layers is None else sorted(set(int(x) for x in layers))
    bad = [x for x in chosen if x not in moe]
    if bad:
        raise SpecError(f"layers {bad} have no routed experts; MoE layers: {moe}")
    return chosen


@contextmanager
def _hooked(model: nn.Module, layers: list[int], hook) -> Iterator[None]:
    """``hook`` quantizes the expert activations of ``layers`` while inside."""
    for layer in layers:
        set_activation_hook(model, layer, hook)
    try:
        yield
    finally:
        for layer in layers:
            set_activation_hook(model, layer, None)


@contextmanager
def capture_guidance(model: nn.Module, layers: Iterable[int] | None = None,
                     spec: NumericsSpec | None = None) -> Iterator[GuidanceCapture]:
    """Record the sampler's activation quantization at the given MoE layers while inside."""
    chosen = _layers(model, layers)
    cap = GuidanceCapture(spec or PRESETS["minite"])

    def hook(layer, site, a, spec, token_of, expert_of):
        q = ops.quantize(a.detach(), spec)
        cap.add(layer, site, q, _keys(model, a, token_of, expert_of))
        return q

    with _hooked(model, chosen, hook):
        yield cap


@dataclass
class CodeAgreement:
    """Per ``(layer, site)``: how many of the learner's codes differ from the sampler's.

    Counted over the rows that have a sampler record (``rows_with_record`` of ``rows`` real,
    non-padding rows); codes are compared by value (both zeros equal).
    """

    values: dict[tuple[int, str], int] = field(default_factory=dict)
    mismatched: dict[tuple[int, str], int] = field(default_factory=dict)
    rows: dict[tuple[int, str], int] = field(default_factory=dict)
    rows_with_record: dict[tuple[int, str], int] = field(default_factory=dict)

    def add(self, key, values, mismatched, rows, with_record) -> None:
        """Accumulate one call's counts."""
        for d, v in ((self.values, values), (self.mismatched, mismatched), (self.rows, rows),
                     (self.rows_with_record, with_record)):
            d[key] = d.get(key, 0) + int(v)

    def share(self, key) -> float | None:
        """Share of compared codes that differ at ``key`` (None: nothing compared)."""
        n = self.values.get(key, 0)
        return self.mismatched[key] / n if n else None

    def table(self) -> list[dict]:
        """One row per layer and site: values compared, mismatch share, rows with a record."""
        return [{"layer": k[0], "site": k[1], "values": self.values[k],
                 "mismatch": self.share(k),
                 "rows_with_record": (self.rows_with_record[k] / self.rows[k]
                                      if self.rows[k] else None)} for k in sorted(self.values)]


@contextmanager
def use_guidance(model: nn.Module, table: GuidanceTable | None,
                 layers: Iterable[int] | None = None, *, reference: GuidanceTable | None = None,
                 agreement: CodeAgreement | None = None) -> Iterator[GuidanceTable | None]:
    """Round the learner's expert activations by ``table``'s records while inside.

    ``table=None`` rounds to nearest (no guidance) but still counts, which gives the
    "before guidance" side of a comparison. With ``reference`` (the sampler's records at 4
    bits, i.e. its full codes) and ``agreement``, the hook counts code mismatches.
    """
    if table is None and reference is None:
        raise SpecError("use_guidance needs a guidance table, or a reference to count against")
    sites = (table or reference).sites  # K/V sites are the KV cache's (kv_guided)
    chosen = _layers(model, layers if layers is not None else
                     sorted({x for x, s in sites if s in ACT_SITES}))

    def hook(layer, site, a, spec, token_of, expert_of):
        keys = _keys(model, a, token_of, expert_of)
        guide = None if table is None else table.lookup(layer, site, keys)
        q = guided_quantize(a.detach(), spec, guide)
        if agreement is not None and reference is not None:
            _count(agreement, layer, site, q, keys, reference.lookup(layer, site, keys))
        return q

    with _hooked(model, chosen, hook):
        yield table


def _count(agreement: CodeAgreement, layer, site, q, keys, ref) -> None:
    real = int((keys >= 0).sum())
    if ref is None:
        agreement.add((layer, site), 0, 0, real, 0)
        return
    rows = torch.nonzero(ref.present).squeeze(-1)
    sampler = canonical_zero(ref.low[ref.index[rows]])
    mine = canonical_zero(unpack_nibbles(q.codes[rows]))
    k = sampler.shape[-1]
    agreement.add((layer, site), sampler.numel(), (mine[:, :k] != sampler).sum(), real,
                  rows.numel())
