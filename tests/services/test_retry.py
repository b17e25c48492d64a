"""Pins the one retry policy (alignclient.retry): backoff shape, attempts, deadline, stop event,
transient-only retries, result retries, the async form, the HTTP classification and the one
classification of a failed API call (transient, refused)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from alignclient.errors import (
    ApiUnreachableError,
    BadResponseError,
    BusUnavailableError,
    InputError,
    error_from_response,
)
from alignclient.retry import RetryPolicy, http_transient, refused
from alignclient.retry import transient as api_transient


class Flaky:
    """Raises ``error`` for the first ``fails`` calls, then returns ``value``."""

    def __init__(self, fails: int, error: type[Exception] = ConnectionError, value: object = "ok"):
        self.fails, self.error, self.value = fails, error, value
        self.calls: list[float] = []

    def __call__(self):
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.fails:
            raise self.error(f"failure {len(self.calls)}")
        return self.value


def transient(e: BaseException) -> bool:
    return isinstance(e, ConnectionError)


def test_waits_grow_exponentially_with_jitter_up_to_the_cap():
    """Attempt n waits initial*factor**(n-1), capped at max_s, within ±jitter; then succeeds."""
    waits: list[tuple[int, float]] = []
    policy = RetryPolicy(initial_s=0.01, max_s=0.04, factor=2, jitter=0.2)
    fn = Flaky(4)
    assert policy.call(fn, transient=transient,
                       on_retry=lambda n, w, e: waits.append((n, w))) == "ok"
    assert [n for n, _ in waits] == [1, 2, 3, 4] and len(fn.calls) == 5
    for (_, w), base in zip(waits, [0.01, 0.02, 0.04, 0.04], strict=True):
        assert 0.8 * base <= w <= 1.2 * base


def test_gives_up_after_the_attempts_with_the_last_error():
    """attempts=3: three calls, then the third call's own error is raised unchanged."""
    fn = Flaky(10)
    with pytest.raises(ConnectionError, match="failure 3"):
        RetryPolicy(initial_s=0.001, attempts=3).call(fn, transient=transient)
    assert len(fn.calls) == 3


def test_errors_that_are_not_transient_are_raised_at_once():
    """A KeyError is not transient: one call, no wait."""
    fn = Flaky(10, error=KeyError)
    with pytest.raises(KeyError):
        RetryPolicy(initial_s=0.5).call(fn, transient=transient)
    assert len(fn.calls) == 1


def test_the_deadline_ends_retrying_with_one_attempt_at_the_deadline():
    """deadline_s=0.3 with 0.2 s waits: the last wait is cut so an attempt lands at 0.3 s."""
    fn = Flaky(10**6)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        RetryPolicy(initial_s=0.2, max_s=0.2, jitter=0, deadline_s=0.3).call(fn, transient=transient)
    elapsed = time.monotonic() - t0
    # waits never end early: the last attempt is at the deadline or after it (upper bounds
    # only catch a wait that was not cut: a loaded host may add any delay)
    assert 0.3 <= elapsed < 2.0 and len(fn.calls) == 3
    assert 0.3 - 0.01 <= fn.calls[-1] - t0 < 0.3 + 1.0


def test_a_stop_event_ends_the_wait_and_the_retrying():
    """Set during a 5 s wait, the stop event ends it: the call gives up within a moment."""
    stop = threading.Event()
    fn = Flaky(10**6)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        RetryPolicy(initial_s=5, max_s=5).call(fn, transient=transient, stop_event=stop)
    assert time.monotonic() - t0 < 1.0 and len(fn.calls) == 2


def test_results_can_be_retried_and_the_last_one_is_returned():
    """again(result): retried like an error; after the attempts, the last result comes back."""
    answers = iter([503, 503, 200])
    assert RetryPolicy(initial_s=0.001).call(lambda: next(answers), transient=transient,
                                             again=lambda r: r == 503) == 200
    seen: list[int] = []

    def always_503():
        seen.append(503)
        return 503

    assert RetryPolicy(initial_s=0.001, attempts=2).call(always_503, transient=transient,
                                                         again=lambda r: r == 503) == 503
    assert seen == [503, 503]


def test_the_async_form_retries_the_same_way():
    """acall: the same policy for a coroutine function."""
    fn = Flaky(2)

    async def once():
        return fn()

    assert asyncio.run(RetryPolicy(initial_s=0.001).acall(once, transient=transient)) == "ok"
    assert len(fn.calls) == 3


def test_http_transient_repeats_only_what_cannot_apply_twice():
    """A connection never made is always transient; a timeout or a broken connection only for
    an idempotent request; a non-transport error never."""
    request = httpx.Request("POST", "http://x/")
    never_sent = httpx.ConnectError("refused", request=request)
    timed_out = httpx.ReadTimeout("slow", request=request)
    assert http_transient(never_sent, idempotent=False) and http_transient(never_sent, idempotent=True)
    assert http_transient(timed_out, idempotent=True) and not http_transient(timed_out, idempotent=False)
    assert not http_transient(ValueError("x"), idempotent=True)


def answer(status: int, code: str | None = None):
    """The typed error the client raises for an error answer (a foreign body without code)."""
    body = b"<html>proxy</html>" if code is None else \
        b'{"error": {"code": "%s", "type": "X", "message": "m"}}' % code.encode()
    return error_from_response(status, body, method="POST", url="http://api/v1/x")


def unreachable(cause: Exception) -> ApiUnreachableError:
    try:
        raise ApiUnreachableError("gave up") from cause
    except ApiUnreachableError as e:
        return e


REQ = httpx.Request("POST", "http://api/")


@pytest.mark.parametrize(("error", "if_idempotent", "if_not", "is_refusal"), [
    (httpx.ConnectError("refused", request=REQ), True, True, False),
    (httpx.ReadTimeout("slow", request=REQ), True, False, False),
    (unreachable(httpx.ConnectError("refused", request=REQ)), True, True, False),
    (unreachable(httpx.ReadTimeout("slow", request=REQ)), True, False, False),
    (answer(500, "internal_error"), True, False, False),
    (answer(500), True, False, False),
    (answer(502), True, False, False),
    (answer(503, "bus_unavailable"), True, False, False),
    (answer(503, "overloaded"), True, False, False),
    (answer(504, "engine_timeout"), True, False, False),
    (answer(501, "guidance_unsupported"), False, False, False),
    (answer(507, "guidance_budget"), False, False, False),
    (answer(400, "malformed_body"), False, False, True),
    (answer(401, "unauthorized"), False, False, True),
    (answer(404, "version_not_found"), False, False, True),
    (answer(409, "version_exists"), False, False, True),
    (answer(422, "invalid_input"), False, False, True),
    (BadResponseError("GET /v1/spec: sha256: Field required"), False, False, False),
    (BusUnavailableError("Redis away"), True, False, False),
    (ValueError("x"), False, False, False),
])
def test_one_classification_of_a_failed_api_call(error, if_idempotent, if_not, is_refusal):
    """transient(error, idempotent): a connection never made always; a timeout, a broken
    connection or a 500/502/503/504 answer only for a retry-safe call; 501, 507, every 4xx and
    a malformed answer never. refused(error): exactly the 4xx answers."""
    assert api_transient(error, idempotent=True) is if_idempotent
    assert api_transient(error, idempotent=False) is if_not
    assert refused(error) is is_refusal


@pytest.mark.parametrize("kw", [{"initial_s": -1}, {"factor": 0.5}, {"jitter": 1.0},
                                {"attempts": 0}, {"deadline_s": -1}])
def test_nonsense_policies_are_refused(kw):
    """Negative waits, shrinking backoff, jitter of 100 %, zero attempts: InputError."""
    with pytest.raises(InputError):
        RetryPolicy(**kw)
