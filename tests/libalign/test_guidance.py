"""Pins guidance records (bit planes, encode/decode, CRC-32, sizes), capture and lookup, and the
guided quantizer: identity on the sampler's own input, agreement under perturbation, fallbacks."""

import struct
import zlib

import numpy as np
import pytest
import torch
from alignclient.errors import (
    GuidanceChecksumError,
    GuidanceRecordError,
    NonFiniteError,
    ShapeError,
    SpecError,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from libalign.guidance import (
    GuidanceCapture,
    GuidanceRecord,
    GuidanceTable,
    RowGuide,
    SiteRows,
    guided_quantize,
    pack_planes,
    row_keys,
    select_layers,
    unpack_planes,
)
from libalign.guidance.sizes import size_per_token, trace_dims, trace_reference_size
from libalign.spec import PRESETS, normalized_with_scales, quantize
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import bracket_levels, e2m1_levels, low_bits

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = (1, 2, 3, 4)
MINITE = PRESETS["minite"]


# --- bit planes ------------------------------------------------------------------------------------

@SETTINGS
@given(arrays(np.uint8, st.tuples(st.integers(1, 5), st.integers(1, 12).map(lambda n: 8 * n)),
              elements=st.integers(0, 255)),
       st.sampled_from(BITS))
def test_planes_round_trip_keeps_the_low_bits(codes, bits):
    """unpack_planes(pack_planes(c, b)) is exactly c & (2^b - 1), flat; [b, numel/8] planes."""
    c = torch.from_numpy(codes)
    planes = pack_planes(c, bits)
    assert planes.shape == (bits, c.numel() // 8) and planes.dtype == torch.uint8
    assert torch.equal(unpack_planes(planes, c.numel()), c.reshape(-1) & ((1 << bits) - 1))


def test_plane_layout_literal():
    """Plane j holds bit j of every code, first code in the least significant bit."""
    c = torch.tensor([1, 2, 3, 0, 0, 0, 0, 0xF], dtype=torch.uint8)
    assert pack_planes(c, 4).tolist() == [[0b10000101], [0b10000110], [0b10000000], [0b10000000]]
    assert pack_planes(c, 1).tolist() == [[0b10000101]]


def test_planes_refuse_bad_bits_and_ragged_counts():
    """bits outside 1..4 -> SpecError; a count not a multiple of 8 -> ShapeError."""
    with pytest.raises(SpecError):
        pack_planes(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(SpecError):
        pack_planes(torch.zeros(8, dtype=torch.uint8), 0)
    with pytest.raises(ShapeError):
        pack_planes(torch.zeros(12, dtype=torch.uint8), 2)


# --- records ---------------------------------------------------------------------------------------

def _rows(site: str, n: int, k: int, seed: int = 0, row_scale_bits=None) -> SiteRows:
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // 16) * 16
    experts = (torch.randint(0, 64, (n,), generator=g).to(torch.int16) if site == "fc2"
               else torch.full((n,), -1, dtype=torch.int16))
    rs = (torch.rand(n, generator=g) * 10 if row_scale_bits is None
          else torch.tensor(row_scale_bits, dtype=torch.int64).to(torch.int32).view(torch.float32))
    return SiteRows(
        positions=torch.randperm(1000, generator=g)[:n].to(torch.int32),
        experts=experts,
        codes=torch.randint(0, 16, (n, kp), generator=g).to(torch.uint8),
        block_scales=torch.randint(0, 256, (n, kp // 16), generator=g).to(torch.uint8),
        row_scales=rs, k=k)


_ODD_F32 = [0x00000001, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F7FFFFF, 0x3F800001,
            0x00800000, 0xFFFFFFFF]


@st.composite
def _records(draw):
    bits = draw(st.sampled_from(BITS))
    keys = draw(st.lists(st.tuples(st.integers(0, 47), st.sampled_from(["fc1", "fc2"])),
                         min_size=1, max_size=4, unique=True))
    sites = {}
    for i, (layer, site) in enumerate(keys):
        n = draw(st.integers(0, 20))
        k = draw(st.sampled_from([16, 32, 48, 40, 7]))
        odd = draw(st.lists(st.one_of(st.sampled_from(_ODD_F32), st.integers(0, 2**32 - 1)),
                            min_size=n, max_size=n))
        sites[(layer, site)] = _rows(site, n, k, seed=draw(st.integers(0, 999)) + i,
                                     row_scale_bits=odd)
    return GuidanceRecord(bits, "minite", sites)


def _assert_decoded_equal(dec: GuidanceRecord, rec: GuidanceRecord) -> None:
    assert dec.bits == rec.bits and dec.spec == rec.spec
    assert set(dec.sites) == set(rec.sites)
    for key, rows in rec.sites.items():
        got = dec.sites[key]
        assert got.k == rows.k and got.rows == rows.rows
        assert torch.equal(got.positions, rows.positions)
        assert torch.equal(got.experts, rows.experts)
        assert torch.equal(got.block_scales, rows.block_scales)
        assert torch.equal(got.row_scales.view(torch.int32), rows.row_scales.view(torch.int32))
        assert torch.equal(got.codes, low_bits(rows.codes, rec.bits))


@SETTINGS
@given(_records(), st.sampled_from(["none", "zlib"]))
def test_record_round_trip(rec, compress):
    """decode(encode(r)) gives back positions, experts, scales (fp32 bits, NaN payloads and -0.0
    included) and the low code bits, compressed or not."""
    data = rec.encode(compress)
    assert data[:4] == b"LAGR"
    assert struct.unpack("<I", data[-4:])[0] == zlib.crc32(data[:-4])
    _assert_decoded_equal(GuidanceRecord.decode(data), rec)
    assert rec.layers == sorted({layer for layer, _ in rec.sites})


def test_record_size_follows_the_layout():
    """An uncompressed section is 4n + (2n at fc2) + 4n + n*Kp/16 + b*n*Kp/8 bytes."""
    rec = GuidanceRecord(1, "minite", {(3, "fc1"): _rows("fc1", 10, 64),
                                       (3, "fc2"): _rows("fc2", 16, 32)})
    data = rec.encode()
    (hlen,) = struct.unpack("<I", data[4:8])
    payload = (4 * 10 + 4 * 10 + 10 * 4 + 10 * 64 // 8) + (4 * 16 + 2 * 16 + 4 * 16 + 16 * 2 + 16 * 32 // 8)
    assert len(data) == 8 + hlen + payload + 4 == rec.nbytes()


def _small_record(bits=2) -> bytes:
    return GuidanceRecord(bits, "minite", {(0, "fc1"): _rows("fc1", 5, 32, 1),
                                           (1, "fc2"): _rows("fc2", 6, 48, 2)}).encode()


@pytest.mark.parametrize("compress", ["none", "zlib"])
def test_any_flipped_byte_fails_the_checksum(compress):
    """Flipping one byte after the magic (length, header, payload, CRC) raises the checksum error."""
    data = GuidanceRecord(3, "minite", {(0, "fc1"): _rows("fc1", 5, 32, 1),
                                        (1, "fc2"): _rows("fc2", 6, 48, 2)}).encode(compress)
    (hlen,) = struct.unpack("<I", data[4:8])
    g = torch.Generator().manual_seed(3)
    where = {4, 7, 8, 8 + hlen // 2, 8 + hlen - 1, 8 + hlen, len(data) - 5, len(data) - 4,
             len(data) - 1}
    where |= set(torch.randint(4, len(data), (24,), generator=g).tolist())
    for i in sorted(where):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= flip
            with pytest.raises(GuidanceChecksumError):
                GuidanceRecord.decode(bytes(bad))


def test_bad_magic_and_truncation():
    """A flipped magic byte, too few bytes or a cut record raise GuidanceRecordError."""
    data = _small_record()
    for i in range(4):
        bad = bytearray(data)
        bad[i] ^= 0x20
        with pytest.raises(GuidanceRecordError) as e:
            GuidanceRecord.decode(bytes(bad))
        assert type(e.value) is GuidanceRecordError
    for cut in (0, 3, 4, 11):
        with pytest.raises(GuidanceRecordError) as e:
            GuidanceRecord.decode(data[:cut])
        assert type(e.value) is GuidanceRecordError
    for cut in (12, len(data) // 2, len(data) - 1):
        with pytest.raises(GuidanceRecordError):  # the CRC no longer matches (a subclass)
            GuidanceRecord.decode(data[:cut])
    with pytest.raises(GuidanceRecordError):
        GuidanceRecord.decode(b"LAGR" + bytes(8))


def _resealed(data: bytes, edit) -> bytes:
    """The record with its header JSON edited and a fresh, valid CRC-32."""
    import json

    (hlen,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8:8 + hlen])
    edit(header)
    h = json.dumps(header, separators=(",", ":")).encode()
    body = b"LAGR" + struct.pack("<I", len(h)) + h + data[8 + hlen:-4]
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("edit", [
    lambda h: h.update(bits=5),
    lambda h: h.update(format=2),
    lambda h: h.update(compress="lz4"),
    lambda h: h["sections"][0].update(rows=6),
    lambda h: h["sections"][0].update(nbytes=h["sections"][0]["nbytes"] + 1),
    lambda h: h["sections"].pop(),
    lambda h: h["sections"][0].update(kp=40),
    lambda h: h.pop("bits"),
])
def test_checksummed_but_inconsistent_headers_are_refused(edit):
    """A valid CRC over a wrong header (bits=5, unknown format, sizes that do not add up) raises
    GuidanceRecordError, never a bare exception."""
    with pytest.raises(GuidanceRecordError) as e:
        GuidanceRecord.decode(_resealed(_small_record(), edit))
    assert type(e.value) is GuidanceRecordError


def test_checksummed_but_undeflatable_payload_is_refused():
    """A valid CRC over a zlib section that does not inflate raises GuidanceRecordError."""
    data = GuidanceRecord(2, "minite", {(0, "fc1"): _rows("fc1", 5, 32, 1)}).encode("zlib")
    (hlen,) = struct.unpack("<I", data[4:8])
    body = bytearray(data[:-4])
    body[8 + hlen + 2] ^= 0xFF
    bad = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    with pytest.raises(GuidanceRecordError) as e:
        GuidanceRecord.decode(bad)
    assert type(e.value) is GuidanceRecordError


def test_record_refuses_bad_bits_and_compression():
    """GuidanceRecord(bits=5) and encode(compress='lz4') raise SpecError."""
    with pytest.raises(SpecError):
        GuidanceRecord(5, "minite")
    with pytest.raises(SpecError):
        GuidanceRecord(0, "minite")
    with pytest.raises(SpecError):
        GuidanceRecord(2, "minite").encode("lz4")


def _replace(rows: SiteRows, **kw) -> SiteRows:
    d = {f: getattr(rows, f) for f in ("positions", "experts", "codes", "block_scales",
                                       "row_scales", "k")}
    d.update(kw)
    return SiteRows(**d)


@pytest.mark.parametrize("change", [
    {"codes": torch.zeros(4, 32, dtype=torch.uint8)},     # 4 rows of codes for 5 rows
    {"codes": torch.zeros(5, 24, dtype=torch.uint8)},     # K not padded to 16
    {"codes": torch.zeros(5 * 32, dtype=torch.uint8)},    # not 2-D
    {"block_scales": torch.zeros(5, 1, dtype=torch.uint8)},
    {"row_scales": torch.zeros(4)},
    {"experts": torch.zeros(6, dtype=torch.int16)},
    {"k": 33},
    {"k": 0},
])
def test_rows_that_do_not_fit_are_refused(change):
    """SiteRows whose codes, scales or experts disagree with the row count raise
    GuidanceRecordError when they enter a record."""
    rows = _replace(_rows("fc1", 5, 32), **change)
    with pytest.raises(GuidanceRecordError):
        GuidanceRecord(2, "minite", {(0, "fc1"): rows})


def test_unknown_site_is_refused():
    """Only fc1 and fc2 are sites."""
    with pytest.raises(GuidanceRecordError):
        GuidanceRecord(2, "minite", {(0, "attn"): _rows("fc1", 2, 16)})


# --- sizes -----------------------------------------------------------------------------------------

def test_one_bit_records_are_a_third_of_full_ones():
    """Codes + block scales: 1.5 bits a value at b=1 vs 4.5 at b=4 (hidden 2048, moe 768, top 8)."""
    kw = dict(hidden=2048, moe_intermediate=768, top_k=8, layers=40)
    one, full = size_per_token(bits=1, **kw), size_per_token(bits=4, **kw)
    values = 40 * (2048 + 8 * 768)
    assert one["code_bits"] + one["block_scales"] == values * 1.5 / 8
    assert full["code_bits"] + full["block_scales"] == values * 4.5 / 8
    assert 3 * (one["code_bits"] + one["block_scales"]) == full["code_bits"] + full["block_scales"]
    assert one["row_scales"] == full["row_scales"] == 40 * 9 * 4
    assert one["index"] == 40 * (4 + 6 * 8)
    assert one["kv"] == 0
    assert one["total"] == sum(v for k, v in one.items() if k != "total")


def test_size_per_token_by_site_and_refusals():
    """Sites count separately; unknown sites and bad bits raise SpecError."""
    kw = dict(hidden=2048, moe_intermediate=768, top_k=8, layers=2, bits=4)
    fc1 = size_per_token(sites=("fc1",), **kw)
    fc2 = size_per_token(sites=("fc2",), **kw)
    both = size_per_token(**kw)
    for part in ("code_bits", "block_scales", "row_scales", "index", "total"):
        assert fc1[part] + fc2[part] == both[part]
    bare = size_per_token(row_scale=False, index=False, **kw)
    assert bare["row_scales"] == bare["index"] == 0
    with pytest.raises(SpecError):
        size_per_token(sites=("fc3",), **kw)
    with pytest.raises(SpecError):
        size_per_token(hidden=1, moe_intermediate=1, top_k=1, layers=1, bits=5)


def test_trace_reference_sizes():
    """TRACE's accounting: 46,080 B (45 KiB) activation, 5,760 B (~5.6 KiB) KV a token, and about
    51 TB (between 50 and 52 TiB) an RL step of 4096 trajectories x 256 Ki tokens."""
    ref = trace_reference_size()
    assert ref["activation_bytes"] == 46_080 == 45 * 1024
    assert ref["kv_bytes"] == 5_760
    assert 5.6 <= ref["kv_bytes"] / 1024 < 5.7
    assert ref["per_token_bytes"] == 46_080 + 5_760
    assert ref["per_step_bytes"] == 51_840 * 256 * 1024 * 4096
    assert 50 < ref["per_step_bytes"] / 2**40 < 52
    assert trace_reference_size(bits=1)["activation_bytes"] * 3 == ref["activation_bytes"]
    # the same accounting from a config: D1 = hidden, D2 = kv heads x head_dim, the MoE layers
    dims = trace_dims({"num_hidden_layers": 41, "mlp_only_layers": [0], "hidden_size": 2048,
                       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128})
    assert dims == {"hidden": 2048, "kv_values": 256, "layers": 40}
    assert trace_reference_size(**dims) == ref
    qwen = trace_dims({"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128})
    assert trace_reference_size(**qwen)["per_token_bytes"] == 48 * (2048 + 512) * 9 // 16


# --- layer selection -------------------------------------------------------------------------------

def test_select_layers():
    """All layers sorted, the last n, more than there are is all; 0 or negative is refused."""
    assert select_layers([5, 1, 3, 7]) == [1, 3, 5, 7]
    assert select_layers([5, 1, 3, 7], last=2) == [5, 7]
    assert select_layers([5, 1, 3, 7], last=1) == [7]
    assert select_layers([5, 1, 3, 7], last=10) == [1, 3, 5, 7]
    for bad in (0, -1, -4, 1.5):
        with pytest.raises(SpecError):
            select_layers([5, 1, 3, 7], last=bad)


# --- guided quantization ---------------------------------------------------------------------------

def _x(t=12, k=64, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 2, t).unsqueeze(-1)
    return x.to(dtype)


def _own_guide(q, bits, present=None) -> RowGuide:
    t = q.codes.shape[0]
    present = torch.ones(t, dtype=torch.bool) if present is None else present
    return RowGuide(bits, present, torch.arange(t), low_bits(unpack_nibbles(q.codes), bits),
                    q.block_scales.view(torch.uint8), q.outer_scale)


@pytest.mark.parametrize("k", [64, 40, 16])
@pytest.mark.parametrize("bits", BITS)
def test_sampler_input_reproduces_its_own_bits(bits, k):
    """Guided by records of quantize(x) itself, guided_quantize(x) is bitwise quantize(x)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(k=k, seed=bits, dtype=dtype)
        q = quantize(x, MINITE)
        g = guided_quantize(x, MINITE, _own_guide(q, bits))
        assert g.bitwise_equal(q)
        assert g.shape == q.shape


def test_no_guide_is_plain_quantize():
    """guide=None is quantize(x)."""
    x = _x()
    assert guided_quantize(x, MINITE, None).bitwise_equal(quantize(x, MINITE))


@pytest.mark.parametrize("bits", BITS)
def test_perturbed_learner_follows_the_sampler(bits):
    """The learner's input is the sampler's plus small noise: guided codes agree with the sampler's
    more often than the learner's RTN, every sampler code inside the learner's bracket (under the
    sampler's scales) is reproduced, and the scales are the sampler's."""
    xs = _x(t=32, k=64, seed=11)
    g = torch.Generator().manual_seed(12)
    xl = xs * (1 + 0.02 * torch.randn(xs.shape, generator=g))
    qs = quantize(xs, MINITE)
    cs = unpack_nibbles(qs.codes)
    rtn = unpack_nibbles(quantize(xl, MINITE).codes)
    guided = guided_quantize(xl, MINITE, _own_guide(qs, bits))
    cg = unpack_nibbles(guided.codes)
    agree_rtn, agree_guided = int((rtn == cs).sum()), int((cg == cs).sum())
    assert agree_rtn < cs.numel()  # the noise does flip codes
    assert agree_guided > agree_rtn
    assert torch.equal(guided.block_scales.view(torch.uint8), qs.block_scales.view(torch.uint8))
    assert torch.equal(guided.outer_scale.view(torch.int32), qs.outer_scale.view(torch.int32))
    z = normalized_with_scales(xl, qs.block_scales, qs.outer_scale, MINITE).flatten(-2)
    lower, upper = bracket_levels(z)
    s_lv = e2m1_levels(cs)
    inside = (s_lv >= lower) & (s_lv <= upper)
    assert bool(inside.float().mean() > 0.95)
    assert torch.equal(e2m1_levels(cg)[inside], s_lv[inside])
    assert bool(((e2m1_levels(cg) == lower) | (e2m1_levels(cg) == upper)).all())


def test_rows_without_records_are_the_learners_own():
    """present False rows are bitwise the learner's RTN rows (own scales); others are guided."""
    xs = _x(t=10, seed=3)
    xl = xs + 0.01 * _x(t=10, seed=4)
    qs, ql = quantize(xs, MINITE), quantize(xl, MINITE)
    present = torch.tensor([True, False] * 5)
    g = guided_quantize(xl, MINITE, _own_guide(qs, 4, present))
    off = ~present
    assert torch.equal(g.codes[off], ql.codes[off])
    assert torch.equal(g.block_scales[off].view(torch.uint8), ql.block_scales[off].view(torch.uint8))
    assert torch.equal(g.outer_scale[off].view(torch.int32), ql.outer_scale[off].view(torch.int32))
    assert torch.equal(g.block_scales[present].view(torch.uint8),
                       qs.block_scales[present].view(torch.uint8))
    none = guided_quantize(xl, MINITE, _own_guide(qs, 4, torch.zeros(10, dtype=torch.bool)))
    assert none.bitwise_equal(ql)


def test_guide_index_selects_record_rows():
    """index maps activation rows to record rows: a reversed record with reversed index works."""
    x = _x(t=6, seed=9)
    q = quantize(x, MINITE)
    fwd = _own_guide(q, 2)
    rev = RowGuide(2, fwd.present, torch.arange(5, -1, -1), fwd.low.flip(0),
                   fwd.block_scales.flip(0), fwd.row_scales.flip(0))
    assert guided_quantize(x, MINITE, rev).bitwise_equal(q)


def test_guided_quantize_refusals():
    """Other record width -> GuidanceRecordError; a tensor-scaled spec -> SpecError; NaN ->
    NonFiniteError; a present mask of the wrong length -> ShapeError."""
    x = _x(t=4, k=64)
    q = quantize(x, MINITE)
    wide = quantize(_x(t=4, k=80), MINITE)
    with pytest.raises(GuidanceRecordError):
        guided_quantize(x, MINITE, _own_guide(wide, 2))
    with pytest.raises(SpecError):
        guided_quantize(x, PRESETS["te"], _own_guide(q, 2))
    bad = x.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        guided_quantize(bad, MINITE, _own_guide(q, 2))
    with pytest.raises(ShapeError):
        guided_quantize(x, MINITE, _own_guide(q, 2, torch.ones(3, dtype=torch.bool)))


# --- capture and lookup ----------------------------------------------------------------------------

def _forward_calls():
    """Two 'forward calls' over sequences 3 and 8, rows in no particular order, some padding."""
    seq1 = torch.tensor([3, 3, 8, 8, 3, 0])
    pos1 = torch.tensor([5, 2, 7, 0, 9, 0])
    keys1 = row_keys(seq1, pos1)
    keys1[5] = -1                                   # padding
    seq2 = torch.tensor([8, 3, 8, 3])
    pos2 = torch.tensor([3, 1, 1, 4])
    keys2 = row_keys(seq2, pos2)
    keys2[2] = -1
    return [(_x(t=6, k=48, seed=21), keys1), (_x(t=4, k=48, seed=22), keys2)]


def _capture(calls, layers=(4,)):
    cap = GuidanceCapture(MINITE)
    for x, keys in calls:
        for layer in layers:
            cap.add(layer, "fc1", quantize(x, MINITE), keys)
    return cap


@pytest.mark.parametrize("bits", BITS)
def test_capture_records_and_table_lookup(bits):
    """Captured rows become one record per sequence (positions sorted, padding dropped) that
    survive encoding; the table finds every captured key with its low bits and scales and marks
    padding and unknown keys absent; guided quantization of the same inputs is bitwise quantize."""
    calls = _forward_calls()
    recs = _capture(calls).records(bits)
    assert sorted(recs) == [3, 8]
    assert recs[3].sites[(4, "fc1")].positions.tolist() == [1, 2, 4, 5, 9]
    assert recs[8].sites[(4, "fc1")].positions.tolist() == [0, 3, 7]
    for rec in recs.values():
        assert rec.bits == bits and rec.spec == "minite" and rec.layers == [4]
        assert bool((rec.sites[(4, "fc1")].experts == -1).all())
    decoded = {sid: GuidanceRecord.decode(r.encode("zlib")) for sid, r in recs.items()}
    for sid in recs:
        _assert_decoded_equal(decoded[sid], recs[sid])
    table = GuidanceTable(decoded)
    assert table.bits == bits
    for x, keys in calls:
        q = quantize(x, MINITE)
        guide = table.lookup(4, "fc1", keys)
        assert torch.equal(guide.present, keys >= 0)
        p = guide.present
        idx = guide.index[p]
        assert torch.equal(guide.low[idx], low_bits(unpack_nibbles(q.codes), bits)[p])
        assert torch.equal(guide.block_scales[idx], q.block_scales.view(torch.uint8)[p])
        assert torch.equal(guide.row_scales[idx].view(torch.int32), q.outer_scale[p].view(torch.int32))
        assert guided_quantize(x, MINITE, guide).bitwise_equal(q)
    unknown = torch.cat([row_keys(torch.tensor([3, 8, 5, 3]), torch.tensor([3, 1, 2, 10])),
                         torch.tensor([-1, 0, 2**62])])
    assert not bool(table.lookup(4, "fc1", unknown).present.any())
    assert table.lookup(5, "fc1", unknown) is None       # a layer with no records
    assert table.lookup(4, "fc2", unknown) is None       # a site with no records


def test_capture_fc2_keys_with_experts():
    """fc2 rows keyed by (sequence, position, expert) are recorded with their experts and found."""
    cap = GuidanceCapture(MINITE)
    x = _x(t=6, k=32, seed=5)
    keys = row_keys(torch.tensor([1, 1, 1, 2, 1, 1]), torch.tensor([4, 4, 0, 4, 6, 2]),
                    torch.tensor([7, 2, 7, 7, 0, 63]))
    cap.add(9, "fc2", quantize(x, MINITE), keys)
    recs = cap.records(4)
    rows = recs[1].sites[(9, "fc2")]  # odd row counts: row scales start at 6n bytes
    assert list(zip(rows.positions.tolist(), rows.experts.tolist(), strict=True)) == \
        [(0, 7), (2, 63), (4, 2), (4, 7), (6, 0)]
    assert recs[2].sites[(9, "fc2")].experts.tolist() == [7]
    table = GuidanceTable({s: GuidanceRecord.decode(r.encode()) for s, r in recs.items()})
    guide = table.lookup(9, "fc2", keys)
    assert bool(guide.present.all())
    assert guided_quantize(x, MINITE, guide).bitwise_equal(quantize(x, MINITE))
    other = row_keys(torch.tensor([1]), torch.tensor([4]), torch.tensor([3]))  # expert not routed
    assert not bool(table.lookup(9, "fc2", other).present.any())


def test_capture_layer_filter_and_clear():
    """records(bits, layers=...) keeps the named layers; clear() forgets everything."""
    cap = _capture(_forward_calls(), layers=(1, 2, 6))
    assert cap.records(2, layers=[2, 6])[3].layers == [2, 6]
    assert cap.records(2)[8].layers == [1, 2, 6]
    cap.clear()
    assert cap.records(2) == {}


def test_capture_refuses_tensor_scaled_activations():
    """Records need row scales: a tensor-scaled quantization is refused with SpecError."""
    cap = GuidanceCapture(PRESETS["te"])
    x = _x(t=2, k=32)
    with pytest.raises(SpecError):
        cap.add(0, "fc1", quantize(x, PRESETS["te"]), row_keys(0, torch.arange(2)))


def test_table_refuses_mixed_bits_and_empty_table_finds_nothing():
    """Records of different bits in one table raise GuidanceRecordError; no records -> None."""
    cap = _capture(_forward_calls())
    mixed = {3: cap.records(1)[3], 8: cap.records(4)[8]}
    with pytest.raises(GuidanceRecordError):
        GuidanceTable(mixed)
    empty = GuidanceTable({})
    assert empty.lookup(4, "fc1", torch.tensor([0, -1])) is None
    with pytest.raises(GuidanceRecordError):
        GuidanceTable({-1: cap.records(2)[3]})


def test_encode_many_is_each_encode():
    """Several encodings at once are byte for byte the single encodings."""
    rec = GuidanceRecord(3, "minite", {(0, "fc1"): _rows("fc1", 5, 32, 1),
                                       (1, "fc2"): _rows("fc2", 7, 48, 2)})
    both = rec.encode_many(("none", "zlib", "none"))
    assert set(both) == {"none", "zlib"}
    assert both["none"] == rec.encode() and both["zlib"] == rec.encode("zlib")
    _assert_decoded_equal(GuidanceRecord.decode(both["zlib"]), rec)
    with pytest.raises(SpecError):
        rec.encode_many(("lz4",))
