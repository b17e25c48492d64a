"""Pins the error contract: one tree in alignclient.errors, statuses only in the API's table,
the core's door re-exporting exactly what the core raises, and the round trip
API answer -> client error giving back the same class."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import alignclient.errors as E
import pytest
from alignd.api.errors import HTTP_STATUS, error_response, status_for

import libalign
import libalign.errors as core_errors

#: The statuses the API answered before the table moved out of the classes (one per code).
STATUS_BY_CODE = {
    "align_error": 500, "bus_unavailable": 503, "checksum_mismatch": 500, "invalid_config": 500,
    "invalid_dtype": 422, "distributed_run_failed": 500, "engine_request_failed": 502,
    "engine_timeout": 504, "engine_unavailable": 503, "invalid_event": 422, "forbidden": 403,
    "guidance_budget": 507, "redis_full": 507, "guidance_checksum": 422, "guidance_evicted": 410,
    "guidance_not_found": 404, "invalid_guidance": 422, "guidance_mismatch": 422,
    "guidance_unsupported": 501,
    "invalid_input": 422, "internal_error": 500, "invalid_layout": 422, "malformed_body": 400,
    "invalid_manifest": 500, "method_not_allowed": 405, "missing_shard": 422, "non_finite": 422,
    "payload_too_large": 413, "rollout_exists": 409, "rollout_not_found": 404,
    "route_not_found": 404, "invalid_shape": 422, "invalid_spec": 422, "spec_mismatch": 409,
    "illegal_transition": 409, "store_error": 500, "unauthorized": 401, "undefined_scale": 422,
    "version_exists": 409, "version_not_found": 404, "weight_update_failed": 502,
    "weight_version_mismatch": 409, "loop_error": 502, "invalid_framing": 422,
    "remote_error": 500, "api_unreachable": 503, "overloaded": 503,
    "api_timeout": 504, "bad_response": 502,
    "stale_rollout": 409, "engine_mismatch": 409, "tempered_logprobs": 500,
    "invalid_routing": 422, "routing_mismatch": 422, "routing_missing": 422,
}

CLASSES = E.error_classes()


def test_every_class_answers_its_status():
    """The API's table gives every class of the contract the status it always had."""
    assert set(CLASSES) == set(STATUS_BY_CODE)
    assert {code: status_for(cls) for code, cls in CLASSES.items()} == STATUS_BY_CODE
    assert set(HTTP_STATUS) <= set(CLASSES.values())


def test_no_class_carries_a_status():
    """Statuses live with the API: no contract class has an http_status attribute."""
    assert [c.__name__ for c in CLASSES.values() if hasattr(c, "http_status")] == []


def test_remote_errors_keep_the_status_they_came_with():
    """A RemoteError passed on answers the status it was received with."""
    assert status_for(E.RemoteError("x", status=418, code="teapot")) == 418
    assert status_for(E.RemoteError("x")) == 500


@pytest.mark.parametrize("code", sorted(STATUS_BY_CODE))
def test_an_answer_comes_back_as_its_class(code):
    """error_response's body, read by the client, raises the very class with its status."""
    cls = CLASSES[code]
    err = cls.__new__(cls)
    Exception.__init__(err, f"a {code}")
    resp = error_response(err)
    back = E.error_from_response(resp.status_code, resp.body, method="GET", url="http://x/")
    assert type(back) is cls and str(back) == f"a {code}"
    assert back.status == STATUS_BY_CODE[code] and back.code == code
    assert json.loads(resp.body)["error"] == {"code": code, "type": cls.__name__,
                                              "message": f"a {code}"}


def test_the_core_door_reexports_what_the_core_raises():
    """libalign.errors holds the contract's classes, exactly those libalign imports to raise."""
    raised: set[str] = set()
    root = Path(libalign.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                    (node.level and node.module == "errors")
                    or node.module in ("libalign.errors", "alignclient.errors")):
                raised.update(a.name for a in node.names)
    assert raised == set(core_errors.__all__) - {"AlignError"}
    for name in core_errors.__all__:
        assert getattr(core_errors, name) is getattr(E, name)


def test_the_contract_imports_no_third_party_module():
    """alignclient.errors (and alignclient itself) load neither httpx, pydantic, torch nor libalign."""
    code = ("import sys, alignclient, alignclient.errors; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('httpx', 'pydantic', 'torch', 'numpy', 'libalign', 'alignd', 'stamina', "
            "'tenacity')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
