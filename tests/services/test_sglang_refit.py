"""SGLangServer's weight-update session routes (SGLang 0.5.23) against the recorded-contract
server: the HTTP sink of alignd.sync's tensor and distributed refits."""

from __future__ import annotations

import inspect

import pytest
from alignclient.errors import UnauthorizedError, WeightUpdateError
from alignd.sampler.sglang_server import SGLangServer
from alignd.sync.buckets import BUFFER_NAME, HEADER_NAME, RefitHeader
from alignd.sync.distributed import DistributedSink
from alignd.sync.tensor import LOADER, TensorSink, deserialize, send_tensor_refit

from tests.services.test_sglang_engine import FAST, rig, sglang_weights  # noqa: F401 (rig: fixture)

SESSION = ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]


def server_for(r, **kw) -> SGLangServer:
    return SGLangServer(r.url, timeouts=FAST, **kw)


def test_the_methods_take_the_sink_protocols_arguments():
    """update_weights_from_tensor and update_weights_from_distributed take exactly the keyword
    arguments alignd.sync's TensorSink and DistributedSink call them with."""
    for method, protocol in ((SGLangServer.update_weights_from_tensor, TensorSink),
                             (SGLangServer.update_weights_from_distributed, DistributedSink)):
        mine = inspect.signature(method).parameters
        theirs = inspect.signature(getattr(protocol, method.__name__)).parameters
        assert list(mine) == list(theirs), (method.__name__, list(mine), list(theirs))
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in mine.items()
                   if n != "self")


def test_a_staged_tensor_refit_over_http_is_one_session(rig):  # noqa: F811
    """send_tensor_refit opens the session itself: begin_weight_update, one
    /update_weights_from_tensor per bucket (SGLang's body: one base64 payload per rank, the
    custom loader, flush_cache and weight_version on the last bucket only), end_weight_update:
    each answers SGLang's dict, the admin key goes with every call, and the server serves the
    version named."""
    r = rig(api_key="K", admin_api_key="A")
    server = server_for(r, api_key="K", admin_api_key="A")
    report = send_tensor_refit(sglang_weights().items(), server, version_id="v9",
                               spec="minite", bucket_bytes=1 << 10)
    assert report.buckets >= 3
    calls = r.contract.calls
    assert [c.path for c in calls] == (SESSION[:1] + SESSION[1:2] * report.buckets
                                       + SESSION[2:])
    assert all(c.status == 200 for c in calls) and not r.contract.session_open
    updates = [c.body for c in calls if c.path == SESSION[1]]
    for i, body in enumerate(updates):
        last = i == len(updates) - 1
        assert body == {"serialized_named_tensors": body["serialized_named_tensors"],
                        "load_format": LOADER, "flush_cache": last,
                        "abort_all_requests": False, "weight_version": "v9" if last else None}
        assert len(body["serialized_named_tensors"]) == 1
    named = deserialize(updates[-1]["serialized_named_tensors"][0])
    assert [n for n, _ in named] == [HEADER_NAME, BUFFER_NAME]
    header = RefitHeader.from_tensor(named[0][1])
    assert header.version_id == "v9" and header.last and header.tensors == report.tensors
    assert r.contract.weight_version == "v9"


def test_distributed_routes_post_sglangs_bodies(rig):  # noqa: F811
    """init_weights_update_group and update_weights_from_distributed post
    InitWeightsUpdateGroupReqInput's and UpdateWeightsFromDistributedReqInput's fields; a
    named version is served once the update answers."""
    r = rig()
    server = server_for(r)
    answer = server.init_weights_update_group(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=2,
        group_name="refit", backend="nccl")
    assert answer["success"] is True
    answer = server.update_weights_from_distributed(
        names=["a.weight", "a.weight_scale"], dtypes=["uint8", "float8_e4m3fn"],
        shapes=[[4, 8], [4, 1]], group_name="refit", load_format="flattened_bucket",
        flush_cache=True, weight_version="v3")
    assert answer["success"] is True and "Weight version updated to v3" in answer["message"]
    init, update = (c.body for c in r.contract.calls)
    assert init == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                    "world_size": 2, "group_name": "refit", "backend": "nccl"}
    assert update == {"names": ["a.weight", "a.weight_scale"],
                      "dtypes": ["uint8", "float8_e4m3fn"], "shapes": [[4, 8], [4, 1]],
                      "group_name": "refit", "load_format": "flattened_bucket",
                      "flush_cache": True, "abort_all_requests": False, "weight_version": "v3"}
    assert r.contract.weight_version == "v3"


def test_a_refused_update_is_a_weight_update_error_with_sglangs_message(rig):  # noqa: F811
    """SGLang's 400 with success false, on every route: WeightUpdateError carrying its message
    (a second open session, an end without one, a failed load that keeps the old version, a
    group not joined); a refit whose bucket fails stops there and raises it."""
    r = rig()
    server = server_for(r)
    server.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="session is already open"):
        server.begin_weight_update()
    server.end_weight_update()
    with pytest.raises(WeightUpdateError, match="no weight-update session is open"):
        server.end_weight_update()
    r.contract.fail_weight_route[SESSION[1]] = "Failed to update weights: out of memory"
    with pytest.raises(WeightUpdateError, match=f"{r.url} failed: .*out of memory"):
        send_tensor_refit(sglang_weights().items(), server, version_id="v5", spec="minite",
                          bucket_bytes=1 << 10)
    assert [c.status for c in r.contract.calls if c.path == SESSION[1]] == [400]
    assert r.contract.weight_version == "default"
    with pytest.raises(WeightUpdateError, match="group 'nowhere' is not initialized"):
        server.update_weights_from_distributed(
            names=["x"], dtypes=["uint8"], shapes=[[1]], group_name="nowhere",
            load_format=None, flush_cache=False, weight_version=None)


def test_session_routes_are_admin_routes_and_503_is_retried(rig):  # noqa: F811
    """With --admin-api-key the session routes take only that key (a client without it gets
    UnauthorizedError); a 503 while the server starts is retried."""
    r = rig(api_key="K", admin_api_key="A")
    with pytest.raises(UnauthorizedError, match="/begin_weight_update"):
        server_for(r, api_key="K").begin_weight_update()
    r.contract.unavailable["/begin_weight_update"] = 2
    assert server_for(r, api_key="K", admin_api_key="A").begin_weight_update()["success"]
    assert [c.status for c in r.contract.calls][-3:] == [503, 503, 200]
