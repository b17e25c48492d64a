"""Routing records and the dense ``[len(tokens) - 1, layers, top_k]`` form, both ways, lossless.

The dense form is what SGLang returns and slime, Miles and verl keep. Each decoder below is the
peer's own, restated line for line (none of them is importable here):

* SGLang 0.5.23 (installed beside the venv, ``.venv/sglang-cpu``):
  ``sglang/srt/managers/detokenizer_manager.py`` ``_b64_encode_per_request`` encodes
  ``pybase64.b64encode(item.numpy().tobytes())`` of the int32 ``[rows, num_hidden_layers,
  top_k]`` tensor; ``sglang/srt/state_capturer/routed_experts.py``
  ``extract_routed_experts_from_meta_info`` decodes ``np.frombuffer(b64decode(...),
  dtype=np.int32)``; ``state_capturer/base.py`` zero-fills the buffer, which only MoE layers
  write;
* slime ``slime/utils/misc.py`` ``decode_int32_meta_array`` (``torch.frombuffer(bytearray(...),
  dtype=torch.int32)``) and ``slime/utils/types.py`` (reshape to ``(len(tokens) - 1 -
  routed_experts_start_len, args.num_layers, args.moe_router_topk)``);
* Miles ``miles/rollout/generate_utils/generate_endpoint_utils.py`` ``_decode_topk_buffer``
  (``np.frombuffer(..., dtype=np.int32).reshape(num_tokens, num_layers, topk)``);
* verl ``verl/workers/rollout/sglang_rollout/async_sglang_server.py`` (SGLang's extractor, then
  ``.reshape(-1, hf_config.num_hidden_layers, hf_config.num_experts_per_tok)``).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libalign.errors import RoutingRecordError
from libalign.routing.records import (
    RoutingRecord,
    bytes_per_token,
    dense_bytes_per_token,
    id_dtype,
)


@st.composite
def records(draw, weights: bool = False):
    """A valid record: some MoE layers among ``num_layers``, distinct ids per row."""
    num_layers = draw(st.integers(1, 10))
    layers = sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1)))
    num_experts = draw(st.sampled_from([1, 2, 8, 128, 256, 257, 512]))
    k = draw(st.integers(1, min(num_experts, 8)))
    positions = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(positions, len(layers), num_experts, generator=g).argsort(-1)[..., :k]
    w = torch.rand(ids.shape, generator=g) if weights else None
    rec = RoutingRecord(ids.to(id_dtype(num_experts)), tuple(layers), num_experts, w, "v7")
    return rec, num_layers


def _sglang_encode(dense: torch.Tensor) -> str:
    """SGLang's detokenizer: base64 of the int32 tensor's bytes."""
    return base64.b64encode(dense.numpy().tobytes()).decode("utf-8")


def _slime_decode(b64: str, rows: int, num_layers: int, top_k: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(b64.encode("ascii"))),
                            dtype=torch.int32).reshape(rows, num_layers, top_k)


def _miles_decode(b64: str, rows: int, num_layers: int) -> np.ndarray:
    x = np.frombuffer(base64.b64decode(b64.encode("ascii")), dtype=np.int32)
    return x.reshape(rows, num_layers, len(x) // (rows * num_layers)) if rows else x


def _verl_decode(b64: str, num_layers: int, top_k: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64.encode("utf-8")), dtype=np.int32).reshape(
        -1, num_layers, top_k)


@settings(max_examples=60, deadline=None)
@given(records())
def test_record_to_dense_and_back_is_lossless(case):
    """record -> dense int32 -> record gives the same ids, layers, experts and version."""
    rec, num_layers = case
    dense = rec.to_dense(num_layers)
    assert dense.dtype == torch.int32 and dense.shape == (rec.positions, num_layers, rec.top_k)
    others = [i for i in range(num_layers) if i not in rec.layers]
    assert not dense[:, others].any()  # layers without a router stay zero, as in SGLang
    back = RoutingRecord.from_dense(dense, layers=rec.layers, num_experts=rec.num_experts,
                                    version="v7")
    assert torch.equal(back.experts, rec.experts) and back.experts.dtype == rec.experts.dtype
    assert (back.layers, back.num_experts, back.version) == (rec.layers, rec.num_experts, "v7")
    assert torch.equal(back.to_dense(num_layers), dense)  # and dense -> record -> dense


@settings(max_examples=60, deadline=None)
@given(records(), st.sampled_from(["int32", "uint16", "uint8"]))
def test_sglang_base64_round_trips_in_each_dtype(case, dtype):
    """to_sglang / from_sglang in int32, uint16, uint8 (uint8 refuses an id above 255)."""
    rec, num_layers = case
    if dtype == "uint8" and rec.experts.numel() and int(rec.experts.max()) > 255:
        with pytest.raises(RoutingRecordError, match="does not fit uint8"):
            rec.to_sglang(num_layers, dtype)
        return
    b64 = rec.to_sglang(num_layers, dtype)
    back = RoutingRecord.from_sglang(b64, positions=rec.positions, num_layers=num_layers,
                                     layers=rec.layers, top_k=rec.top_k,
                                     num_experts=rec.num_experts, dtype=dtype)
    assert torch.equal(back.experts, rec.experts)
    width = {"int32": 4, "uint16": 2, "uint8": 1}[dtype]
    assert len(base64.b64decode(b64)) == rec.positions * num_layers * rec.top_k * width


@settings(max_examples=40, deadline=None)
@given(records())
def test_int32_form_is_what_sglang_sends_and_the_peers_decode(case):
    """Our int32 base64 equals SGLang's encoding of the dense tensor; slime's, Miles' and verl's
    decoders read it back to our dense array, and we read SGLang's bytes back to the record."""
    rec, num_layers = case
    dense = rec.to_dense(num_layers)
    ours = rec.to_sglang(num_layers)
    assert ours == _sglang_encode(dense)
    rows, k = rec.positions, rec.top_k
    if rows:  # (torch.frombuffer refuses an empty buffer: slime never decodes zero rows)
        assert torch.equal(_slime_decode(ours, rows, num_layers, k), dense)
        assert np.array_equal(_miles_decode(ours, rows, num_layers), dense.numpy())
        assert np.array_equal(_verl_decode(ours, num_layers, k), dense.numpy())
    back = RoutingRecord.from_sglang(_sglang_encode(dense), positions=rows,
                                     num_layers=num_layers, layers=rec.layers, top_k=k,
                                     num_experts=rec.num_experts)
    assert torch.equal(back.experts, rec.experts)


@settings(max_examples=40, deadline=None)
@given(records(weights=True), st.sampled_from([torch.bfloat16, torch.float32]))
def test_weights_bytes_round_trip_in_bf16_and_fp32(case, dtype):
    """Raw bytes keep bf16 and fp32 gate weights bit for bit (fp32: a Megatron router's own)."""
    rec, _ = case
    rec = RoutingRecord(rec.experts, rec.layers, rec.num_experts, rec.weights.to(dtype))
    ids, w = rec.to_bytes()
    back = RoutingRecord.from_bytes(ids, positions=rec.positions, layers=rec.layers,
                                    top_k=rec.top_k, num_experts=rec.num_experts, weights=w,
                                    weights_dtype=rec.weights_dtype)
    assert back.weights.dtype == dtype
    assert torch.equal(back.weights.view(torch.uint8), rec.weights.view(torch.uint8))
    assert rec.nbytes() == len(ids) + len(w)


def test_sizes_at_qwen3_30b_a3b():
    """48 layers, all MoE, top-8 of 128 experts: 384 B a token as a record, 1536 B as int32."""
    assert bytes_per_token(48, 8, 128) == 384
    assert bytes_per_token(48, 8, 128, weights=True, weight_bytes=4) == 384 * 5
    assert dense_bytes_per_token(48, 8) == 1536
    assert dense_bytes_per_token(48, 8, "uint8") == 384


def _b64(arr) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()


GEO = dict(positions=3, num_layers=4, layers=(1, 3), top_k=2, num_experts=8)


def _dense() -> np.ndarray:
    d = np.zeros((3, 4, 2), dtype=np.int32)
    d[:, 1] = [[0, 1], [2, 3], [4, 5]]
    d[:, 3] = [[7, 6], [5, 4], [3, 2]]
    return d


@pytest.mark.parametrize("payload, kw, match", [
    ("not base64!", {}, "not standard base64"),
    (_b64(_dense()[:2]), {}, "holds 64 bytes.*need 96"),
    (_b64(_dense()), {"dtype": "uint16"}, "holds 96 bytes.*uint16.*need 48"),
    (_b64(_dense()), {"dtype": "int64"}, "dtype 'int64' is not one of"),
    (_b64(np.where(_dense() == 7, 9, _dense())), {}, r"must lie in \[0, 8\), got 0\.\.9"),
    (_b64(np.where(_dense() == 7, -1, _dense())), {}, r"got -1\.\.6"),
    (_b64(np.where(_dense() == 6, 7, _dense())), {}, "names the same expert twice"),
    (_b64(_dense() + np.eye(4, 2, dtype=np.int32)[None]), {}, "at layer 0 .*not a MoE layer"),
])
def test_bad_sglang_payloads_raise_naming_the_fault(payload, kw, match):
    """Wrong length, wrong dtype, out-of-range or repeated ids, garbage base64, ids in a layer
    the record does not keep: RoutingRecordError saying which."""
    with pytest.raises(RoutingRecordError, match=match):
        RoutingRecord.from_sglang(payload, **GEO, **kw)


def test_dense_inputs_of_the_wrong_kind_are_refused():
    """Float or 2-D arrays, layers the array lacks, and a record too wide for num_layers."""
    with pytest.raises(RoutingRecordError, match="integer"):
        RoutingRecord.from_dense(np.zeros((2, 4, 2), np.float32), layers=(1,), num_experts=8)
    with pytest.raises(RoutingRecordError, match="integer"):
        RoutingRecord.from_dense(torch.zeros(2, 4, dtype=torch.int32), layers=(1,), num_experts=8)
    with pytest.raises(RoutingRecordError, match="do not lie"):
        RoutingRecord.from_dense(_dense(), layers=(1, 4), num_experts=8)
    rec = RoutingRecord.from_sglang(_b64(_dense()), **GEO)
    assert rec.experts.tolist()[0] == [[0, 1], [7, 6]]  # slot order kept
    with pytest.raises(RoutingRecordError, match="num_layers 3"):
        rec.to_dense(3)
