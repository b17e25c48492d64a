"""TRACE guidance: the sampler's FP4 rounding outcomes, kept compactly for the learner.

* :mod:`~libalign.guidance.records`: what a record holds (per site and row, the low mantissa
  bits the sampler's rounding chose), its wire format, how a learner's rows find their records
  (:class:`GuidanceTable`, :class:`RowGuide`) and :func:`guided_quantize`, which rounds as the
  sampler did wherever a record exists.
* :mod:`~libalign.guidance.sizes`: the planning side, how many bytes of guidance a generated
  token costs for a model's shapes.

The daemon's guidance store (Redis, with a byte budget and a TTL) keeps these records between
the sampler and the learner.
"""

from libalign.guidance.records import (
    ACT_SITES,
    BLOCK_SIZES,
    COMPRESSIONS,
    FORMAT,
    INDEXED_SITES,
    KV_SITES,
    MAGIC,
    MAX_POSITION,
    MAX_SEQUENCE,
    SITES,
    GuidanceCapture,
    GuidanceRecord,
    GuidanceTable,
    RowGuide,
    SiteRows,
    guided_quantize,
    indexed_keys,
    key_parts,
    pack_planes,
    row_keys,
    select_layers,
    token_of_key,
    unpack_planes,
)

__all__ = [
    "ACT_SITES", "BLOCK_SIZES", "COMPRESSIONS", "FORMAT", "INDEXED_SITES", "KV_SITES", "MAGIC",
    "MAX_POSITION", "MAX_SEQUENCE", "SITES", "GuidanceCapture", "GuidanceRecord",
    "GuidanceTable", "RowGuide", "SiteRows", "guided_quantize", "indexed_keys", "key_parts",
    "pack_planes", "row_keys", "select_layers", "token_of_key", "unpack_planes",
]
