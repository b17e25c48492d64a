"""The one retry policy: jittered exponential backoff, a deadline, transient failures only.

Every component that talks over a network retries the same way: the Redis bus (and the
stores and heartbeats on it), this client, and the engine adapters (SGLang). A
:class:`RetryPolicy` says *how* to retry; the caller says *what* counts as transient,
because only the caller knows whether a failed call may be repeated (see
:func:`transient` for a call of the control API, :func:`http_transient` for any HTTP
request, and ``alignd.infra.bus`` for Redis).

What a failed call of the control API means is decided here, once: the client's own
retries and a trainer's background push both ask :func:`transient` and :func:`refused`.

* It never reached the server (connection refused, connect timeout): transient, whatever
  the call.
* The server may have run it (a timeout, a broken connection, a 5xx answer: 500 when the
  daemon failed inside, 502/504 from a gateway, 503 while Redis is away or the API is
  overloaded): transient for a retry-safe (idempotent) call, which repeating cannot apply
  twice; never for another one. Two 5xx answers say the fault lasts and are not transient:
  501 (the daemon cannot do this) and 507 (the guidance store is full and may evict nothing).
* The server refused it (a 4xx: unknown version, bad input, no token, a conflict): a
  refusal, never transient; sending it again gets the same answer.
* An answer that does not follow the contract (:class:`~alignclient.errors.BadResponseError`)
  is neither: something between client and daemon is broken, and repeating will not mend it.

How a call is retried (the loop itself is `tenacity <https://tenacity.readthedocs.io>`_'s):

* attempt ``n`` failing with a transient error, or with a result the caller asked to
  retry (``again``), waits ``min(max_s, initial_s * factor**(n-1))``, stretched by a
  random factor in ``[1 - jitter, 1 + jitter]`` so that clients that failed together do
  not come back together, and tries again;
* it gives up after ``attempts`` attempts, or once ``deadline_s`` has passed since the
  first one (the last wait is cut short so that one more attempt happens at the deadline,
  never after it), or at once when the caller's stop event is set (the wait ends early too);
* giving up raises the last error (or returns the last result) unchanged: the caller turns
  it into its own typed error (``BusUnavailableError``, ``ApiUnreachableError``,
  ``EngineUnavailableError``); an error that is not transient is raised at once.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import tenacity

from .errors import (
    AlignError,
    ApiUnreachableError,
    BadResponseError,
    BusUnavailableError,
    InputError,
    OverloadedError,
    RemoteError,
)

T = TypeVar("T")

#: HTTP statuses that say "the server may have failed for now": 500 (the daemon failed
#: inside), a gateway (502, 504), or a server without its backend or too busy (503).
#: Repeated only for a retry-safe call (:func:`transient`).
RETRY_STATUSES = frozenset({500, 502, 503, 504})
#: httpx errors raised before a request left this process: repeating it cannot do its
#: effect twice, whatever the request.
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def http_transient(error: BaseException, *, idempotent: bool) -> bool:
    """Whether an httpx error may be retried: a connection never made always; a timeout or a
    broken connection only for an idempotent request (it may have reached the server)."""
    if isinstance(error, NEVER_SENT):
        return True
    return idempotent and isinstance(error, httpx.TransportError)


def transient(error: BaseException, *, idempotent: bool) -> bool:
    """Whether a failed call of the control API may succeed if sent again (module doc).

    An httpx error: as :func:`http_transient` says. :class:`ApiUnreachableError` (the client
    gave up on the transport): for an idempotent call, or when its cause never left this
    process. An error answer: its status is one of :data:`RETRY_STATUSES` and the call is
    idempotent. An error raised in this process without a status: Redis away or overloaded,
    for an idempotent call. Anything else, a malformed answer included: not transient.
    """
    if isinstance(error, httpx.HTTPError):
        return http_transient(error, idempotent=idempotent)
    if isinstance(error, ApiUnreachableError):
        cause = error.__cause__
        return idempotent or (cause is not None and http_transient(cause, idempotent=False))
    if not isinstance(error, AlignError) or isinstance(error, BadResponseError):
        return False
    status = getattr(error, "status", None)
    if status is None and not isinstance(error, RemoteError):
        return idempotent and isinstance(error, BusUnavailableError | OverloadedError)
    return idempotent and status in RETRY_STATUSES


def refused(error: BaseException) -> bool:
    """Whether the daemon refused a call (an error answer with a 4xx status): sending it again
    gets the same answer."""
    status = getattr(error, "status", None)
    return isinstance(error, AlignError) and status is not None and 400 <= status < 500


@dataclass(frozen=True)
class RetryPolicy:
    """How to retry: backoff from ``initial_s`` by ``factor`` up to ``max_s`` with
    ``jitter``; give up after ``attempts`` attempts or ``deadline_s`` seconds (None: no limit)."""

    initial_s: float = 0.05
    max_s: float = 2.0
    factor: float = 2.0
    jitter: float = 0.2
    deadline_s: float | None = None
    attempts: int | None = None

    def __post_init__(self) -> None:
        if not (self.initial_s >= 0 and self.max_s >= 0 and self.factor >= 1
                and 0 <= self.jitter < 1):
            raise InputError(f"need initial_s, max_s >= 0, factor >= 1, 0 <= jitter < 1: {self}")
        if self.attempts is not None and self.attempts < 1:
            raise InputError(f"attempts must be >= 1 (or None), not {self.attempts}")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise InputError(f"deadline_s must be >= 0 (or None), not {self.deadline_s}")

    def wait_s(self, state: tenacity.RetryCallState) -> float:
        """The wait after a failed attempt (the ``wait`` of tenacity's loop)."""
        base = tenacity.wait_exponential(multiplier=self.initial_s, max=self.max_s,
                                         exp_base=self.factor)(state)
        wait = base * random.uniform(1 - self.jitter, 1 + self.jitter)
        if self.deadline_s is not None:
            wait = min(wait, max(0.0, self.deadline_s - (state.seconds_since_start or 0.0)))
        return wait

    def _loop_args(self, transient: Callable[[BaseException], bool],
                   again: Callable[[Any], bool] | None, stop_event: threading.Event | None,
                   on_retry: Callable[[int, float, BaseException | None], None] | None) -> dict:
        stops: list = []
        if self.attempts is not None:
            stops.append(tenacity.stop_after_attempt(self.attempts))
        if self.deadline_s is not None:
            stops.append(tenacity.stop_after_delay(self.deadline_s))
        if stop_event is not None:
            stops.append(tenacity.stop_when_event_set(stop_event))
        retry = tenacity.retry_if_exception(transient)
        if again is not None:
            retry = retry | tenacity.retry_if_result(again)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            if on_retry is not None:
                outcome = state.outcome
                error = outcome.exception() if outcome is not None and outcome.failed else None
                on_retry(state.attempt_number, state.next_action.sleep, error)

        return {
            "stop": tenacity.stop_any(*stops) if stops else tenacity.stop_never,
            "wait": self.wait_s,
            "retry": retry,
            "before_sleep": before_sleep,
            # giving up: the last error raised as it was, or the last result returned
            "retry_error_callback": lambda state: state.outcome.result(),
        }

    def call(self, fn: Callable[[], T], *, transient: Callable[[BaseException], bool],
             again: Callable[[T], bool] | None = None,
             stop_event: threading.Event | None = None,
             on_retry: Callable[[int, float, BaseException | None], None] | None = None) -> T:
        """``fn()``, retried while it raises an error ``transient`` accepts (or returns a result
        ``again`` accepts); ``stop_event`` ends the waiting and the retrying; ``on_retry(attempt,
        wait_s, error)`` runs before each wait (``error`` None for a result retried)."""
        kw = self._loop_args(transient, again, stop_event, on_retry)
        if stop_event is not None:
            kw["sleep"] = tenacity.sleep_using_event(stop_event)
        return tenacity.Retrying(**kw)(fn)

    async def acall(self, fn: Callable[[], Awaitable[T]], *,
                    transient: Callable[[BaseException], bool],
                    again: Callable[[T], bool] | None = None,
                    on_retry: Callable[[int, float, BaseException | None], None] | None = None
                    ) -> T:
        """:meth:`call` for a coroutine function; the waits are ``asyncio`` sleeps."""
        return await tenacity.AsyncRetrying(**self._loop_args(transient, again, None, on_retry))(fn)
