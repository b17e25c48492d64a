"""Pins the client's total deadline (alignclient.deadline), its typed error for answers that do
not follow the contract, and which error answers it retries: a server dripping its answer a
byte at a time cannot hold a call past the deadline (status line and headers or body, sync and
async, retries included); a malformed success answer raises BadResponseError naming the route
and the field, never pydantic's error, and is not retried; a 500 is retried for a retry-safe
call only, a 4xx never."""

from __future__ import annotations

import asyncio
import json
import time

import alignclient.errors as E
import httpx
import pytest
from alignclient import AlignClient, AsyncAlignClient
from pydantic import ValidationError

from tests.services.faulty_servers import DRIP_BODY, Drip

#: Generous bound for a call whose deadline is 1 s, on a loaded 2-core host.
BOUND_S = 5.0


@pytest.mark.parametrize("mode", ["head", "body"])
def test_a_dripping_answer_ends_at_the_calls_deadline(mode):
    """One byte every 0.2 s never trips the 2 s per-read timeout and would take over 20 s in
    all; with deadline_s=1 the call raises ApiTimeoutError within 5 s, whether the status line
    and headers drip or only the body."""
    with Drip(mode) as drip, AlignClient(drip.url, timeout=2.0, retries=0, deadline_s=1.0) as c:
        assert drip.drip_s > 20
        t0 = time.monotonic()
        with pytest.raises(E.ApiTimeoutError, match="deadline of 1 s"):
            c.get_spec()
        took = time.monotonic() - t0
    assert 0.9 <= took < BOUND_S, took


def test_the_async_client_keeps_the_same_deadline():
    """AsyncAlignClient against the dripping server: ApiTimeoutError within 5 s."""
    async def call() -> float:
        async with AsyncAlignClient(drip.url, timeout=2.0, retries=0, deadline_s=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(E.ApiTimeoutError):
                await c.get_spec()
            return time.monotonic() - t0

    with Drip("head") as drip:
        took = asyncio.run(call())
    assert 0.9 <= took < BOUND_S, took


def test_retries_share_the_one_deadline():
    """Five retries allowed, each attempt dripping: the call still ends within 5 s of a 1 s
    deadline, having started at most two attempts."""
    with Drip("body") as drip, AlignClient(drip.url, timeout=2.0, retries=5, backoff_s=0.01,
                                           deadline_s=1.0) as c:
        t0 = time.monotonic()
        with pytest.raises(E.ApiTimeoutError):
            c.get_spec()
        took = time.monotonic() - t0
        assert 1 <= drip.accepted <= 2
    assert took < BOUND_S, took


def test_a_prompt_answer_is_not_cut_by_the_deadline():
    """The deadline transport serves a normal answer: the dripping server at 0 s per byte."""
    with Drip("head", interval_s=0.0) as drip, AlignClient(drip.url, retries=0,
                                                           deadline_s=5.0) as c:
        assert c.get_spec().preset == "minite"


def mock(answers: list[tuple[int, bytes]]) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering ``answers`` in order (the last one again when they run out)."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status, body = answers[min(len(seen), len(answers)) - 1]
        return httpx.Response(status, content=body)

    return httpx.MockTransport(handle), seen


@pytest.mark.parametrize(("body", "field"), [
    (b"<html>gateway says hello</html>", "json"),
    (b'{"preset": 7, "spec": {}, "sampler_path": "a", "learner_path": "b"}', "sha256"),
    (b'{"preset": 7, "spec": {}, "sha256": "x", "sampler_path": "a", "learner_path": "b"}',
     "preset"),
])
def test_a_malformed_answer_is_a_bad_response_error(body, field):
    """200 with a body that is not JSON, lacks a field or holds one of the wrong type:
    BadResponseError naming GET /v1/spec and the field, not pydantic's ValidationError, and
    not retried (one request though three retries are allowed)."""
    transport, seen = mock([(200, body)])
    with AlignClient("http://api", retries=3, transport=transport) as c, \
            pytest.raises(E.BadResponseError) as ei:
        c.get_spec()
    assert not isinstance(ei.value, ValidationError) and isinstance(ei.value.__cause__, ValueError)
    assert "GET /v1/spec" in str(ei.value) and field in str(ei.value).lower()
    assert ei.value.code == "bad_response" and ei.value.status is None and len(seen) == 1


def test_a_malformed_guidance_batch_is_a_bad_response_error():
    """A guidance batch whose framing is broken: BadResponseError naming the route."""
    transport, _ = mock([(200, b"\x00\x01 not frames")])
    with AlignClient("http://api", retries=0, transport=transport) as c, \
            pytest.raises(E.BadResponseError, match=r"POST /v1/guidance/v1:batch"):
        c.get_guidance_batch("v1", ["r1"])


INTERNAL = json.dumps({"error": {"code": "internal_error", "type": "InternalError",
                                 "message": "boom"}}).encode()
EXISTS = json.dumps({"error": {"code": "version_exists", "type": "VersionExistsError",
                               "message": "taken"}}).encode()


def test_a_500_is_retried_for_retry_safe_calls_only():
    """500 then 200: a GET succeeds on its second request; a call that is not idempotent
    (retry_version) raises InternalError after one request; a 409 refusal is never retried."""
    transport, seen = mock([(500, INTERNAL), (200, DRIP_BODY)])
    with AlignClient("http://api", retries=3, backoff_s=0.001, transport=transport) as c:
        assert c.get_spec().preset == "minite" and len(seen) == 2
    transport, seen = mock([(500, INTERNAL), (202, b"{}")])
    with AlignClient("http://api", retries=3, backoff_s=0.001, transport=transport) as c, \
            pytest.raises(E.InternalError) as ei:
        c.retry_version("v1")
    assert ei.value.status == 500 and len(seen) == 1
    transport, seen = mock([(409, EXISTS), (201, b"{}")])
    with AlignClient("http://api", retries=3, backoff_s=0.001, transport=transport) as c, \
            pytest.raises(E.VersionExistsError):
        c.publish_version("v1")
    assert len(seen) == 1


def test_nonsense_timeouts_are_refused():
    """timeout or deadline_s of 0 or less: InputError before anything is sent."""
    with pytest.raises(E.InputError, match="timeout"):
        AlignClient("http://api", timeout=0)
    with pytest.raises(E.InputError, match="deadline_s"):
        AlignClient("http://api", deadline_s=-1)
    with AlignClient("http://api", timeout=2, retries=3, max_backoff_s=1) as c:
        assert c.deadline_s == 2 * 4 + 1 * 3  # the default: what timeouts and retries allowed
