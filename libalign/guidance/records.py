"""Guidance records: the sampler's FP4 rounding outcomes, kept compactly for the learner.

What is recorded
----------------
TRACE steers the learner's activation rounding towards the codes the sampler produced
(:func:`libalign.spec.rounding.round_e2m1_guided`). The sampler therefore keeps, at each captured
*site* of each selected MoE layer, for every row it quantized:

* ``fc1``: the expert input of a token (the hidden state entering the routed experts; one row
  per token, shared by its top-k experts, since row scales make its bits independent of
  which expert reads it);
* ``fc2``: the input of the down projection, one row per (token, routed expert);
* ``k`` and ``v`` (an FP4 KV cache, :mod:`libalign.models.kv_cache`): the keys and values a
  token writes, one row per (token, key/value head), in the cache's KV format;

and for each row: the ``b`` low bits of every E2M1 code (``b`` = 1, 2, 3 or 4), the E4M3
block-scale bytes (one per 16 values) and the fp32 outer row scale (in the spec's stored
convention), plus the row's position in its sequence and, for ``fc2``, its expert (for ``k``/``v``, its
head). With
the sampler's scales in hand the learner normalizes its own values exactly as the sampler
did; the low bits then tell it which end of its FP4 bracket the sampler chose.

Sizes
-----
Per value a record costs ``b`` bits plus 8/16 bits of block scale: 1.5 bits at ``b = 1``,
4.5 bits at ``b = 4`` (the full code), so a ``b = 1`` record is a third of a full one.
Per row add 4 bytes of row scale and 4 (6 for ``fc2``, ``k``, ``v``) bytes of index.
:mod:`libalign.guidance.sizes` computes the bytes per generated token for a model and
reproduces TRACE's accounting.

Layout of one encoded record (one rollout)
------------------------------------------
``b"LAGR" | u32 header length | header (JSON, utf-8) | sections | u32 CRC-32``, little-endian.
The header names the format, ``bits``, the spec, the compression and, per section (one
``(layer, site)``), its row count, K (logical and padded to 16) and byte length; a record
with K/V sections also names their format (``kv_spec``), and a sampler may add what the
record was made for (``meta``: weight ``version``, the model's ``layers`` and ``kv_heads``),
which a learner checks before it trusts the bits. A section
holds ``positions`` (int32), ``experts`` (int16, the head at ``k``/``v``; not at ``fc1``),
row scales (fp32), block
scales (``rows × K/16`` bytes) and ``bits`` bit planes: plane ``j`` holds bit ``j`` of every
code, eight codes per byte, first code in the least significant bit. With ``zlib``
compression each section is deflated on its own. The CRC-32 covers every byte before it;
a mismatch raises :class:`~libalign.errors.GuidanceChecksumError`.

Encoding and decoding run on the tensors' device (CPU or GPU); only the final bytes move.

MXFP4
-----
An MXFP4 spec (``mxfp4*`` presets) records the same way: its block scales are E8M0 bytes,
one per 32 values (``rows × K/32``), and having no outer scale it stores 1.0 as every row
scale. A section's byte count fixes its scale count, so the format needs no new field;
:func:`guided_quantize` refuses records whose block size is not its spec's.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from libalign.errors import (
    GuidanceChecksumError,
    GuidanceMismatchError,
    GuidanceRecordError,
    ShapeError,
    SpecError,
)
from libalign.kernels import quantize  # the kernel door (the spec where no kernel serves)
from libalign.spec import (
    PRESETS,
    NumericsSpec,
    NVFP4Tensor,
    check_finite,
    check_input,
    normalized_with_scales,
)
from libalign.spec.constants import BLOCK_SIZE
from libalign.spec.packing import pack_nibbles, unpack_nibbles
from libalign.spec.rounding import GUIDE_BITS, low_bits, round_e2m1_guided

BLOCK_SIZES = (BLOCK_SIZE, 32)  # NVFP4 (E4M3 scales), MXFP4 (E8M0 scales)


def _block_sizes(spec: str) -> tuple[int, ...]:
    """The block size a record of this preset must have (either, for a spec of another name)."""
    return (PRESETS[spec].block_size,) if spec in PRESETS else BLOCK_SIZES

ACT_SITES = ("fc1", "fc2")  # expert activations (libalign.models.guided)
KV_SITES = ("k", "v")  # keys and values written to an FP4 KV cache (libalign.models.kv_cache)
SITES = ACT_SITES + KV_SITES
#: sites with several rows a token, told apart by the int16 ``experts`` column (expert, head)
INDEXED_SITES = ("fc2", "k", "v")
COMPRESSIONS = ("none", "zlib")
MAGIC = b"LAGR"
FORMAT = 1
_U32 = struct.Struct("<I")

# a row's key: sequence id, position and (expert + 1, 0 for fc1) packed in one int64
_POS_SHIFT, _SEQ_SHIFT = 16, 40
MAX_POSITION = (1 << (_SEQ_SHIFT - _POS_SHIFT)) - 1
MAX_SEQUENCE = (1 << (63 - _SEQ_SHIFT)) - 1


def row_keys(seq: torch.Tensor | int, pos: torch.Tensor, expert: torch.Tensor | None = None):
    """int64 keys of rows: ``seq << 40 | pos << 16 | expert + 1`` (``0`` in the low bits for fc1)."""
    k = (torch.as_tensor(seq, dtype=torch.int64, device=pos.device) << _SEQ_SHIFT) | \
        (pos.to(torch.int64) << _POS_SHIFT)
    return k if expert is None else k | (expert.to(torch.int64) + 1)


def token_of_key(keys: torch.Tensor) -> torch.Tensor:
    """The token part (sequence and position) of row keys."""
    return keys & ~((1 << _POS_SHIFT) - 1)


def key_parts(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence id, position)`` of row keys (int64 each)."""
    return keys >> _SEQ_SHIFT, (keys >> _POS_SHIFT) & MAX_POSITION


def indexed_keys(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token keys with a row index in the low bits (``index + 1``: an expert at fc2, a KV
    head); padding rows (-1) stay -1."""
    return torch.where(keys >= 0, keys | (index.to(torch.int64) + 1), keys)


def select_layers(moe_layers: Sequence[int], last: int | str | None = None) -> list[int]:
    """The MoE layers whose sites are recorded: all (``last=None``), the last ``last``, or
    ``"half"``: the latter half, as TRACE records (of an odd count, the larger half)."""
    layers = sorted(int(x) for x in moe_layers)
    if last is None:
        return layers
    if last == "half":
        return layers[len(layers) // 2:]
    if not isinstance(last, int) or last < 1:
        raise SpecError(f"last must be a positive number of layers, got {last!r}")
    return layers[-last:]


# --- bit planes -------------------------------------------------------------------------------

_WEIGHTS: dict[str, torch.Tensor] = {}


def _bit_weights(device) -> torch.Tensor:
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = (1 << torch.arange(8, dtype=torch.int32, device=device)).to(torch.uint8)
    return _WEIGHTS[key]


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits`` planes of uint8 codes (any shape, numel a multiple of 8): ``[bits, numel/8]``."""
    if bits not in GUIDE_BITS:
        raise SpecError(f"guidance keeps 1, 2, 3 or 4 bits per value, got {bits!r}")
    if codes.numel() % 8:
        raise ShapeError(f"bit planes pack 8 codes a byte; {codes.numel()} codes do not divide")
    if codes.device.type == "cpu":  # numpy's packbits: one C pass per plane
        c = codes.reshape(-1).contiguous().numpy()
        return torch.from_numpy(np.stack([np.packbits((c >> j) & 1, bitorder="little")
                                          for j in range(bits)]))
    flat = codes.reshape(-1, 8)
    w = _bit_weights(codes.device)
    planes = torch.empty((bits, flat.shape[0]), dtype=torch.uint8, device=codes.device)
    for j in range(bits):
        bit = (flat >> j) & 1 if j else flat & 1
        planes[j] = (bit * w).sum(-1, dtype=torch.int32).to(torch.uint8)
    return planes


def unpack_planes(planes: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: flat uint8 codes (only the stored low bits set)."""
    bits = planes.shape[0]
    if planes.device.type == "cpu":
        p = planes.contiguous().numpy()
        out = np.unpackbits(p[0], count=numel, bitorder="little")
        for j in range(1, bits):
            out |= np.unpackbits(p[j], count=numel, bitorder="little") << j
        return torch.from_numpy(out)
    w = _bit_weights(planes.device)
    out = torch.zeros(planes.shape[1] * 8, dtype=torch.uint8, device=planes.device)
    for j in range(bits):
        b = ((planes[j].unsqueeze(-1) & w) != 0).reshape(-1).to(torch.uint8)
        out |= b << j if j else b
    return out[:numel]


# --- one site's rows --------------------------------------------------------------------------

@dataclass
class SiteRows:
    """The recorded rows of one site of one layer.

    ``codes`` ``[n, Kp]`` uint8 holds full E2M1 codes on the capture side and only the
    record's low bits after decoding; ``block_scales`` ``[n, Kp/16]`` E4M3 bytes (uint8);
    ``row_scales`` ``[n]`` fp32 in the spec's stored convention; ``positions`` ``[n]`` int32;
    ``experts`` ``[n]`` int16 (-1 at ``fc1``); ``k`` the logical row length.
    """

    positions: torch.Tensor
    experts: torch.Tensor
    codes: torch.Tensor
    block_scales: torch.Tensor
    row_scales: torch.Tensor
    k: int

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.positions.shape[0])

    def to(self, device) -> SiteRows:
        """The same rows on another device."""
        return SiteRows(self.positions.to(device), self.experts.to(device), self.codes.to(device),
                        self.block_scales.to(device), self.row_scales.to(device), self.k)


def _section_bytes(rows: SiteRows, site: str, bits: int) -> list[bytes]:
    parts = [rows.positions.to(torch.int32).cpu().numpy().tobytes()]
    if site in INDEXED_SITES:
        parts.append(rows.experts.to(torch.int16).cpu().numpy().tobytes())
    parts.append(rows.row_scales.to(torch.float32).cpu().numpy().tobytes())
    parts.append(rows.block_scales.contiguous().cpu().numpy().tobytes())
    parts.append(pack_planes(low_bits(rows.codes, bits), bits).cpu().numpy().tobytes())
    return parts


@dataclass
class GuidanceRecord:
    """The guidance of one rollout: ``sites[(layer, site)]`` rows at ``bits`` bits a value.

    ``spec`` is the activations' preset, ``kv_spec`` the K/V sections' (None without them);
    ``meta`` what the record was made for (``version``, ``layers``, ``kv_heads``; see
    :func:`libalign.models.kv_guided.check_records`).
    """

    bits: int
    spec: str
    sites: dict[tuple[int, str], SiteRows] = field(default_factory=dict)
    kv_spec: str | None = None
    meta: dict[str, str | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bits not in GUIDE_BITS:
            raise SpecError(f"guidance keeps 1, 2, 3 or 4 bits per value, got {self.bits!r}")
        for (layer, site), rows in self.sites.items():
            spec = self.kv_spec if site in KV_SITES else self.spec
            _check_rows(layer, site, rows, BLOCK_SIZES if spec is None else _block_sizes(spec))

    @property
    def layers(self) -> list[int]:
        """The recorded layers, sorted."""
        return sorted({layer for layer, _ in self.sites})

    def encode(self, compress: str = "none", level: int = 1) -> bytes:
        """The record as bytes (see the module doc), with its CRC-32 at the end."""
        return self.encode_many((compress,), level)[compress]

    def encode_many(self, compressions: Sequence[str], level: int = 1) -> dict[str, bytes]:
        """The record in several encodings at once (``{compress: bytes}``): the bit planes
        are laid out once and then stored raw or compressed."""
        bad = [c for c in compressions if c not in COMPRESSIONS]
        if bad:
            raise SpecError(f"compress must be one of {COMPRESSIONS}, got {bad[0]!r}")
        planes = [(layer, site, rows, b"".join(_section_bytes(rows, site, self.bits)))
                  for (layer, site), rows in sorted(self.sites.items())]
        out: dict[str, bytes] = {}
        for compress in dict.fromkeys(compressions):
            sections, blobs = [], []
            for layer, site, rows, raw in planes:
                data = zlib.compress(raw, level) if compress == "zlib" else raw
                sections.append({"layer": layer, "site": site, "rows": rows.rows, "k": rows.k,
                                 "kp": int(rows.codes.shape[-1]), "raw": len(raw),
                                 "nbytes": len(data)})
                blobs.append(data)
            head = {"format": FORMAT, "bits": self.bits, "spec": self.spec, "compress": compress,
                    "sections": sections}
            head.update({k: v for k, v in (("kv_spec", self.kv_spec), ("meta", self.meta)) if v})
            header = json.dumps(head, separators=(",", ":")).encode()
            body = b"".join([MAGIC, _U32.pack(len(header)), header, *blobs])
            out[compress] = body + _U32.pack(zlib.crc32(body))
        return out

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, device: torch.device | str = "cpu",
               *, what: str = "guidance record") -> GuidanceRecord:
        """Parse and verify encoded bytes; codes come back as the record's low bits."""
        buf = memoryview(data)
        if len(buf) < 12 or bytes(buf[:4]) != MAGIC:
            raise GuidanceRecordError(f"{what}: not a guidance record (bad magic or too short)")
        (crc,) = _U32.unpack(buf[-4:])
        if zlib.crc32(buf[:-4]) != crc:
            raise GuidanceChecksumError(f"{what}: CRC-32 mismatch, the record is corrupt")
        (hlen,) = _U32.unpack(buf[4:8])
        try:
            header = json.loads(bytes(buf[8:8 + hlen]))
            bits, spec, compress = int(header["bits"]), str(header["spec"]), header["compress"]
            sections = header["sections"]
            kv_spec = None if header.get("kv_spec") is None else str(header["kv_spec"])
            meta = dict(header.get("meta") or {})
        except (ValueError, KeyError, TypeError) as e:
            raise GuidanceRecordError(f"{what}: unreadable header ({e})") from None
        if header.get("format") != FORMAT:
            raise GuidanceRecordError(f"{what}: format {header.get('format')!r}, this build "
                                      f"reads {FORMAT}")
        if bits not in GUIDE_BITS or compress not in COMPRESSIONS:
            raise GuidanceRecordError(f"{what}: bits={bits!r} compress={compress!r} unsupported")
        off, end = 8 + hlen, len(buf) - 4
        rec = cls(bits, spec, kv_spec=kv_spec, meta=meta)
        for s in sections:
            try:
                layer, site, n, k, kp = int(s["layer"]), s["site"], int(s["rows"]), int(s["k"]), \
                    int(s["kp"])
                nbytes, raw_len = int(s["nbytes"]), int(s["raw"])
            except (KeyError, TypeError, ValueError) as e:
                raise GuidanceRecordError(f"{what}: bad section entry {s!r} ({e})") from None
            if off + nbytes > end:
                raise GuidanceRecordError(f"{what}: section {layer}/{site} runs past the end")
            chunk = buf[off:off + nbytes]
            off += nbytes
            try:
                raw = zlib.decompress(chunk) if compress == "zlib" else chunk
            except zlib.error as e:
                raise GuidanceRecordError(f"{what}: section {layer}/{site} does not inflate "
                                          f"({e})") from None
            if site not in SITES:
                raise GuidanceRecordError(f"{what}: unknown site {site!r}; sites are {SITES}")
            sizes = _block_sizes(kv_spec) if site in KV_SITES and kv_spec else _block_sizes(spec)
            rec.sites[(layer, site)] = _parse_section(raw, site, n, k, kp, bits, raw_len, device,
                                                      f"{what} section {layer}/{site}", sizes)
        if off != end:
            raise GuidanceRecordError(f"{what}: {end - off} trailing bytes after the sections")
        return rec

    def nbytes(self) -> int:
        """Uncompressed encoded size."""
        return len(self.encode())


def _check_rows(layer, site, rows: SiteRows, sizes: tuple[int, ...] = BLOCK_SIZES) -> None:
    if site not in SITES:
        raise GuidanceRecordError(f"unknown site {site!r}; sites are {SITES}")
    n, kp = rows.rows, int(rows.codes.shape[-1]) if rows.codes.ndim == 2 else -1
    if kp < 0 or rows.codes.shape[0] != n or kp % BLOCK_SIZE or not 0 < rows.k <= kp:
        raise GuidanceRecordError(f"layer {layer} {site}: codes {tuple(rows.codes.shape)} do not "
                                  f"fit {n} rows of K={rows.k}")
    fits = any(tuple(rows.block_scales.shape) == (n, kp // b) and kp % b == 0 for b in sizes)
    if not fits or rows.row_scales.shape != (n,) or rows.experts.shape != (n,):
        raise GuidanceRecordError(f"layer {layer} {site}: scales or experts do not fit {n} rows")


def _parse_section(raw, site, n, k, kp, bits, raw_len, device, what,
                   block_sizes=BLOCK_SIZES) -> SiteRows:
    if n < 0 or kp % BLOCK_SIZE or not 0 < k <= kp:
        raise GuidanceRecordError(f"{what}: rows={n} k={k} kp={kp} are inconsistent")
    fixed = [4 * n] + ([2 * n] if site in INDEXED_SITES else []) + [4 * n]
    scale_bytes = len(raw) - sum(fixed) - bits * n * kp // 8  # one byte per block: 16 or 32
    nb = next((kp // b for b in block_sizes if kp % b == 0 and n * (kp // b) == scale_bytes),
              kp // block_sizes[0])
    sizes = [*fixed, n * nb, bits * n * kp // 8]
    if len(raw) != sum(sizes) or len(raw) != raw_len:
        raise GuidanceRecordError(f"{what}: {len(raw)} bytes, expected {sum(sizes)}")
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else \
        torch.empty(0, dtype=torch.uint8)
    t = t.to(device)
    parts, o = [], 0
    for sz in sizes:
        parts.append(t[o:o + sz])
        o += sz
    pos = parts[0].view(torch.int32)
    if site in INDEXED_SITES:
        experts = parts[1].view(torch.int16)
        rest = parts[2:]
    else:
        experts = torch.full((n,), -1, dtype=torch.int16, device=t.device)
        rest = parts[1:]
    row_scales = rest[0].clone().view(torch.float32)  # at fc2 it starts at 6n bytes: realign
    block_scales = rest[1].reshape(n, nb)
    codes = unpack_planes(rest[2].reshape(bits, -1), n * kp).reshape(n, kp)
    return SiteRows(pos, experts, codes, block_scales, row_scales, k)


# --- capture (sampler side) -------------------------------------------------------------------

def _row_scales(q: NVFP4Tensor) -> torch.Tensor:
    if q.spec.is_mx:  # no outer scale: every row records 1.0
        return torch.ones(q.codes.shape[:-1], dtype=torch.float32, device=q.codes.device).reshape(-1)
    if q.spec.outer_domain != "row" or q.outer_scale is None:
        raise SpecError("guidance records need row-scaled activations (outer domain 'row'), "
                        f"got {q.spec.outer_domain!r}")
    return q.outer_scale.reshape(-1).to(torch.float32)


class GuidanceCapture:
    """Collects the sampler's quantized rows per ``(layer, site)`` across forward calls.

    ``spec`` names the activations' preset in the records; K/V rows (sites ``k``, ``v``) carry
    their own (``kv_spec``, taken from the first K/V rows added).
    """

    def __init__(self, spec: NumericsSpec):
        self.spec = spec
        self.kv_spec: str | None = None
        self._parts: dict[tuple[int, str], list[tuple]] = {}

    def add(self, layer: int, site: str, q: NVFP4Tensor, keys: torch.Tensor) -> None:
        """Keep the rows of ``q`` whose key is not negative (padding has key -1)."""
        if site in KV_SITES:
            if self.kv_spec not in (None, q.spec.name):
                raise SpecError(f"K/V rows in {q.spec.name!r} and {self.kv_spec!r} in one capture")
            self.kv_spec = q.spec.name
        keep = keys >= 0
        codes = unpack_nibbles(q.codes)
        rs = _row_scales(q)
        bs = q.block_scales.view(torch.uint8)
        self._parts.setdefault((layer, site), []).append(
            (keys[keep], codes[keep], bs[keep], rs[keep], q.k))

    def clear(self) -> None:
        """Forget everything captured so far."""
        self._parts.clear()

    def pooled(self) -> dict[tuple[int, str], tuple[torch.Tensor, SiteRows]]:
        """Per site, all captured rows sorted by key: ``(keys, rows)`` with full codes."""
        out = {}
        for site_key, parts in self._parts.items():
            keys = torch.cat([p[0] for p in parts])
            order = torch.argsort(keys)
            keys = keys[order]
            rows = SiteRows(key_parts(keys)[1].to(torch.int32),
                            ((keys & 0xFFFF) - 1).to(torch.int16),
                            torch.cat([p[1] for p in parts])[order],
                            torch.cat([p[2] for p in parts])[order],
                            torch.cat([p[3] for p in parts])[order], parts[0][4])
            out[site_key] = (keys, rows)
        return out

    def records(self, bits: int, layers: Iterable[int] | None = None) -> dict[int, GuidanceRecord]:
        """One :class:`GuidanceRecord` per sequence id, keeping ``bits`` bits a value."""
        wanted = None if layers is None else set(layers)
        out: dict[int, GuidanceRecord] = {}
        for (layer, site), (keys, rows) in self.pooled().items():
            if wanted is not None and layer not in wanted:
                continue
            seqs = key_parts(keys)[0]
            ids, counts = torch.unique_consecutive(seqs, return_counts=True)
            lo = 0
            for sid, c in zip(ids.tolist(), counts.tolist(), strict=True):
                sl = slice(lo, lo + c)
                lo += c
                rec = out.setdefault(sid, GuidanceRecord(bits, self.spec.name,
                                                         kv_spec=self.kv_spec))
                rec.sites[(layer, site)] = SiteRows(
                    rows.positions[sl], rows.experts[sl], low_bits(rows.codes[sl], bits),
                    rows.block_scales[sl], rows.row_scales[sl], rows.k)
        return out


# --- lookup and guided quantization (learner side) --------------------------------------------

@dataclass
class RowGuide:
    """Guidance aligned to the rows of one activation: what :func:`guided_quantize` consumes.

    ``present`` ``[T]`` marks rows with a record; for those, ``index`` points into the
    site's ``low`` ``[n, Kp]`` bits, ``block_scales`` ``[n, Kp/16]`` and ``row_scales`` ``[n]``.
    """

    bits: int
    present: torch.Tensor
    index: torch.Tensor
    low: torch.Tensor
    block_scales: torch.Tensor
    row_scales: torch.Tensor


class GuidanceTable:
    """Decoded records of many sequences, indexed for lookup by row key on one device."""

    def __init__(self, records: Mapping[int, GuidanceRecord], device: torch.device | str = "cpu"):
        bits = {r.bits for r in records.values()}
        if len(bits) > 1:
            raise GuidanceMismatchError(f"records mix {sorted(bits)} bits a value", field="bits")
        self.bits = bits.pop() if bits else 4
        specs = {r.spec for r in records.values()}
        self.spec_names = specs
        per_site: dict[tuple[int, str], list[tuple[int, SiteRows]]] = {}
        for sid, rec in records.items():
            if not 0 <= sid <= MAX_SEQUENCE:
                raise GuidanceRecordError(f"sequence id {sid} outside [0, {MAX_SEQUENCE}]")
            for site_key, rows in rec.sites.items():
                per_site.setdefault(site_key, []).append((sid, rows))
        # one concatenation, one move and one key computation per site (not per sequence)
        dev = torch.device(device)
        self.sites: dict[tuple[int, str], tuple[torch.Tensor, SiteRows]] = {}
        for site_key, parts in per_site.items():
            fields = {}
            for f in ("positions", "experts", "codes", "block_scales", "row_scales"):
                ts = [getattr(p[1], f) for p in parts]
                if len({t.device for t in ts}) > 1:
                    ts = [t.to(dev) for t in ts]
                fields[f] = torch.cat(ts).to(dev)
            sids = torch.repeat_interleave(
                torch.tensor([p[0] for p in parts], dtype=torch.int64),
                torch.tensor([p[1].rows for p in parts], dtype=torch.int64)).to(dev)
            exp = fields["experts"] if site_key[1] in INDEXED_SITES else None
            keys = row_keys(sids, fields["positions"], exp)
            order = torch.argsort(keys)
            rows = SiteRows(*(fields[f][order] for f in ("positions", "experts", "codes",
                                                          "block_scales", "row_scales")),
                            parts[0][1].k)
            self.sites[site_key] = (keys[order], rows)

    def lookup(self, layer: int, site: str, keys: torch.Tensor) -> RowGuide | None:
        """Guidance for rows with these keys (-1: none), or None when the site has no records."""
        hit = self.sites.get((layer, site))
        if hit is None:
            return None
        table, rows = hit
        if table.numel() == 0:
            return None
        idx = torch.searchsorted(table, keys).clamp_(max=table.numel() - 1)
        present = (table[idx] == keys) & (keys >= 0)
        return RowGuide(self.bits, present, idx, rows.codes, rows.block_scales, rows.row_scales)


def guided_quantize(x: torch.Tensor, spec: NumericsSpec, guide: RowGuide | None, *,
                    outer_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Row-scaled NVFP4 (or MXFP4) of ``x`` ``[T, K]``: guided by the sampler's records where present,
    the spec's own round-to-nearest (own scales) elsewhere.

    Guided rows take the sampler's block and row scales and :func:`round_e2m1_guided` codes of
    ``x`` normalized by them; with the sampler's own input this reproduces its bits exactly.
    ``outer_scale`` ``[T]`` is the rows' given outer scale under a spec that takes one (a KV
    cache's per-layer global scale); unguided rows are quantized with it.
    """
    if guide is None:
        return quantize(x, spec, outer_scale=outer_scale)
    check_input(x, spec)  # the whole input, as quantize(x) would (dtype, shape, NaN/Inf)
    if spec.nonfinite == "raise":
        check_finite(x)
    if spec.outer_domain != "row" and not spec.is_mx:
        raise SpecError(f"guided rounding needs row-scaled activations, spec {spec.name!r} has "
                        f"outer domain {spec.outer_domain!r}")
    if x.ndim != 2 or guide.present.shape != (x.shape[0],):
        raise ShapeError(f"guidance for {tuple(guide.present.shape)} rows, activations "
                         f"{tuple(x.shape)}")
    size = spec.block_size
    kp = -(-x.shape[-1] // size) * size
    if guide.low.shape[-1] != kp:
        raise GuidanceRecordError(f"records hold rows of {guide.low.shape[-1]} values, the "
                                  f"activations {kp} (K={x.shape[-1]} padded to {size})")
    if guide.block_scales.shape[-1] * size != kp:
        raise GuidanceRecordError(f"records hold {guide.block_scales.shape[-1]} block scales a "
                                  f"row, spec {spec.name!r} needs {kp // size} (one per {size})")
    rows = torch.nonzero(guide.present).squeeze(-1)
    if rows.numel() == 0:
        return quantize(x, spec, outer_scale=outer_scale)
    # rows are independent under a row-scaled (or MX) spec: the unguided rows are quantized alone
    # (same bits as within the whole tensor), the guided ones never go through round-to-nearest
    others = torch.nonzero(~guide.present).squeeze(-1)
    t = x.shape[0]
    out_codes = torch.empty((t, kp // 2), dtype=torch.uint8, device=x.device)
    out_bs = torch.empty((t, kp // size), dtype=torch.uint8, device=x.device)
    out_rs = torch.empty((t,), dtype=torch.float32, device=x.device)
    if others.numel():
        own = quantize(x[others], spec,
                       outer_scale=None if outer_scale is None else outer_scale[others])
        out_codes[others] = own.codes
        out_bs[others] = own.block_scales.view(torch.uint8)
        out_rs[others] = 1.0 if spec.is_mx else own.outer_scale.to(torch.float32)
    src = guide.index[rows]
    bs = guide.block_scales[src]
    rs = guide.row_scales[src]
    z = normalized_with_scales(x[rows], bs, None if spec.is_mx else rs, spec).flatten(-2)
    codes = round_e2m1_guided(z, guide.low[src], guide.bits, signed_zero=spec.signed_zero,
                              ties=spec.e2m1_ties)
    out_codes[rows] = pack_nibbles(codes)
    out_bs[rows] = bs
    out_rs[rows] = rs.to(torch.float32)
    if spec.is_mx:
        return NVFP4Tensor(out_codes, out_bs.view(torch.float8_e8m0fnu), None, spec, tuple(x.shape))
    return NVFP4Tensor(out_codes, out_bs.view(torch.float8_e4m3fn), out_rs, spec, tuple(x.shape))
