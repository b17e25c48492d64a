"""The Python client of the libalign control API: one method per route, sync and async.

Both clients share one description of each call (:class:`Call`: method, path, body,
how to read the reply, whether it may be retried), built by the methods of
:class:`_Routes`, which are named after the routes' operation ids. :class:`AlignClient`
runs a call on an ``httpx.Client`` and returns the result; :class:`AsyncAlignClient` runs
it on an ``httpx.AsyncClient`` and returns an awaitable of the same result.

Deadline. ``timeout`` bounds each socket operation (a connect, a write, a read); ``deadline_s``
bounds the whole call: every attempt, every wait between attempts, and every byte of the
answer, however slowly the server sends it (:mod:`alignclient.deadline`). A call that runs
out of time raises :class:`~alignclient.errors.ApiTimeoutError`. The default deadline is
what the timeouts and retries allowed before: ``timeout * (retries + 1) + max_backoff_s *
retries``.

Retries. A call is retried by the contract's one retry policy
(:class:`~alignclient.retry.RetryPolicy`: backoff from ``backoff_s``, doubling, at most
``max_backoff_s``, with jitter), at most ``retries`` times and within its deadline, when
:func:`alignclient.retry.transient` says the failure may pass: the API could not be reached,
or it answered 500/502/503/504 (503 is what the API says when Redis is unreachable), the
last ones only if the call is idempotent: repeating it cannot apply its effect twice. GETs,
the guidance PUT (it replaces the record), the read-only POSTs (spec check, guidance batch)
and leases are idempotent by nature; publishing a version, storing rollouts and scores
and requesting a sync are idempotent by design: publishing the same published directory
again answers the version it already made (``event_id`` None: nothing is announced twice),
a rollout id is stored at most once (the repeat answers 409 ``rollout_exists``), a score
already recorded is not counted again, and sync events are delivered at least once anyway.
A call that is not idempotent is retried only when the connection was never made (nothing
reached the server), never after a timeout or an error answer.

Token. The one ``token`` argument is sent as ``Authorization: Bearer <token>`` on every
request, reads included: the API guards its reads as well as its writes. Give a writer the
API's ``ALIGN_API_TOKEN``; a reader that must not change state (a dashboard, ``alignd
status``) may be given its ``ALIGN_READ_TOKEN`` instead, with which every read works and
every mutating call raises :class:`~alignclient.errors.ForbiddenError`. Without a token,
reads raise :class:`~alignclient.errors.UnauthorizedError` unless the API serves them
openly (``ALIGN_OPEN_READS``, or a token-less dev-mode API). ``/healthz``, ``/readyz`` and
``/metrics`` never need one.

Errors come back as the contract's classes (:mod:`alignclient.errors`), the ones the daemon
raises. A success answer whose body does not follow the contract (not JSON, a field missing
or of the wrong type) raises :class:`~alignclient.errors.BadResponseError` naming the route
and the field, never a pydantic error.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from .deadline import AsyncDeadlineTransport, DeadlineTransport, deadline_scope
from .errors import (
    AlignError,
    ApiTimeoutError,
    ApiUnreachableError,
    BadResponseError,
    InputError,
    error_from_response,
)
from .framing import MEDIA_TYPE, decode_frames
from .models import (
    DeltaSummary,
    Discrepancy,
    GuidancePutResponse,
    Health,
    LeaseResponse,
    PublishResponse,
    Ready,
    Rollout,
    RolloutIds,
    RolloutList,
    RolloutPutResponse,
    Score,
    SpecCheckResponse,
    SpecInfo,
    Status,
    SyncResponse,
    VersionDetail,
    VersionList,
)
from .retry import RetryPolicy, transient


def _seg(value: str) -> str:
    """A path segment, percent-encoded so that no id can change the path."""
    return quote(str(value), safe="")


def _dump(items: Iterable[BaseModel | Mapping[str, Any]], model: type[BaseModel]) -> list[dict]:
    """Models or plain dicts as JSON-ready dicts, validated on the way (InputError if not valid)."""
    out = []
    for i, x in enumerate(items):
        try:
            m = x if isinstance(x, model) else model.model_validate(x)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or model.__name__}: {err['msg']}"
                                 for err in e.errors())
            raise InputError(f"{model.__name__} {i}: {problems}") from e
        out.append(m.model_dump(mode="json"))
    return out


@dataclass
class Call:
    """One request and how to read its reply."""

    method: str
    path: str
    parse: Callable[[httpx.Response], Any]
    idempotent: bool
    json: Any = None
    content: bytes | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)


def _model(model: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    return lambda r: model.model_validate_json(r.content)


def _problems(e: Exception) -> str:
    """What is wrong with an answer, field by field (pydantic), or the parser's own words."""
    if isinstance(e, ValidationError):
        listed = [f"{'.'.join(map(str, err['loc'])) or e.title}: {err['msg']}"
                  for err in e.errors()[:5]]
        more = f" (and {e.error_count() - 5} more)" if e.error_count() > 5 else ""
        return "; ".join(listed) + more
    return f"{type(e).__name__}: {e}" if not isinstance(e, AlignError) else str(e)


class _Routes(abc.ABC):
    """The routes as :class:`Call`\\ s; subclasses decide how a call runs (``_do``)."""

    def __init__(self, base_url: str, token: str | None, timeout: float, retries: int,
                 backoff_s: float, max_backoff_s: float, deadline_s: float | None):
        if retries < 0:
            raise InputError(f"retries must be >= 0, not {retries}")
        if not timeout > 0:
            raise InputError(f"timeout must be > 0 seconds, not {timeout}")
        if deadline_s is None:
            deadline_s = timeout * (retries + 1) + max_backoff_s * retries
        if not deadline_s > 0:
            raise InputError(f"deadline_s must be > 0 seconds (or None), not {deadline_s}")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = float(timeout)
        self.deadline_s = float(deadline_s)
        self.retry = RetryPolicy(initial_s=backoff_s, max_s=max_backoff_s, attempts=retries + 1,
                                 deadline_s=self.deadline_s)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout)

    @abc.abstractmethod
    def _do(self, call: Call) -> Any:
        """Run one call: blocking in :class:`AlignClient`, a coroutine in :class:`AsyncAlignClient`."""

    @staticmethod
    def _transient(call: Call) -> Callable[[BaseException], bool]:
        """What :attr:`retry` repeats for ``call``: :func:`alignclient.retry.transient`."""
        return lambda e: transient(e, idempotent=call.idempotent)

    def _attempt_timeout(self, deadline: float) -> httpx.Timeout:
        """The per-operation timeout of one attempt, never past the call's deadline."""
        return httpx.Timeout(max(1e-3, min(self.timeout_s, deadline - time.monotonic())))

    def _finish(self, call: Call, resp: httpx.Response) -> Any:
        """The parsed answer, or the typed error it carries (BadResponseError if unparsable)."""
        if not resp.is_success:
            raise error_from_response(resp.status_code, resp.content, method=call.method,
                                      url=str(resp.request.url), context=call.context)
        try:
            return call.parse(resp)
        except ValueError as e:  # pydantic's ValidationError, FramingError, a bad encoding
            err = BadResponseError(f"{call.method} {call.path} answered {resp.status_code} with "
                                   f"a body that does not follow the contract: {_problems(e)}")
            err.method, err.url = call.method, str(resp.request.url)
            raise err from e

    def _unreachable(self, call: Call, e: Exception, attempts: int,
                     deadline: float) -> ApiUnreachableError:
        where = f"{call.method} {self.base_url}{call.path}"
        if time.monotonic() >= deadline - 1e-3:
            err: ApiUnreachableError = ApiTimeoutError(
                f"{where}: no complete answer within the call's deadline of {self.deadline_s:g} s "
                f"({type(e).__name__}: {e}; after {attempts} attempt(s))")
        else:
            err = ApiUnreachableError(f"{where}: {type(e).__name__}: {e} "
                                      f"(after {attempts} attempt(s))")
        err.method, err.url = call.method, self.base_url + call.path
        return err

    # --- health ---------------------------------------------------------------------------

    def healthz(self) -> Health:
        """The API process is alive."""
        return self._do(Call("GET", "/healthz", _model(Health), True))

    def readyz(self) -> Ready:
        """Redis answers (raises BusUnavailableError if not)."""
        return self._do(Call("GET", "/readyz", _model(Ready), True))

    def metrics(self) -> str:
        """Prometheus exposition text."""
        return self._do(Call("GET", "/metrics", lambda r: r.text, True))

    def status_page(self) -> str:
        """The HTML status page."""
        return self._do(Call("GET", "/", lambda r: r.text, True))

    def get_status(self) -> Status:
        """Versions per state, services, discrepancy and guidance totals."""
        return self._do(Call("GET", "/v1/status", _model(Status), True))

    # --- versions -------------------------------------------------------------------------

    def publish_version(self, version_id: str, meta: Mapping[str, Any] | None = None,
                        target_path: str | None = None) -> PublishResponse:
        """Register a BF16 version already written to the published store."""
        body = {"version_id": version_id, "meta": dict(meta or {}), "target_path": target_path}
        return self._do(Call("POST", "/v1/versions", _model(PublishResponse), True, json=body,
                             context={"version_id": version_id}))

    def list_versions(self, state: str | None = None, limit: int = 100,
                      before: str | None = None) -> VersionList:
        """Versions, oldest first (the newest ``limit`` created before version ``before``),
        optionally in one state; the reply's ``next_before`` is the next page's ``before``."""
        params = {"limit": limit, **({"state": state} if state else {}),
                  **({"before": before} if before else {})}
        return self._do(Call("GET", "/v1/versions", _model(VersionList), True, params=params))

    def get_version(self, version_id: str) -> VersionDetail:
        """A version's record and state history."""
        return self._do(Call("GET", f"/v1/versions/{_seg(version_id)}", _model(VersionDetail), True,
                             context={"version_id": version_id}))

    def sync_version(self, version_id: str) -> SyncResponse:
        """Ask the samplers to load a converted version."""
        return self._do(Call("POST", "/v1/sync", _model(SyncResponse), True,
                             json={"version_id": version_id}, context={"version_id": version_id}))

    def retry_version(self, version_id: str) -> PublishResponse:
        """Move a failed version back to published and announce it again, for the converter."""
        return self._do(Call("POST", f"/v1/versions/{_seg(version_id)}:retry",
                             _model(PublishResponse), False, context={"version_id": version_id}))

    # --- rollouts, scores, discrepancy ----------------------------------------------------

    def put_rollouts(self, version_id: str,
                     rollouts: Sequence[Rollout | Mapping[str, Any]]) -> RolloutPutResponse:
        """Store rollouts of a version, all or none."""
        body = {"rollouts": _dump(rollouts, Rollout)}
        return self._do(Call("POST", f"/v1/versions/{_seg(version_id)}/rollouts",
                             _model(RolloutPutResponse), True, json=body,
                             context={"version_id": version_id}))

    def get_rollouts(self, version_id: str,
                     ids: Sequence[str] | None = None) -> RolloutIds | RolloutList:
        """The version's rollout ids, or (with ``ids``) those rollouts."""
        params = None if ids is None else {"ids": ",".join(ids)}
        model = RolloutIds if ids is None else RolloutList
        return self._do(Call("GET", f"/v1/versions/{_seg(version_id)}/rollouts", _model(model),
                             True, params=params, context={"version_id": version_id}))

    def put_scores(self, version_id: str,
                   scores: Sequence[Score | Mapping[str, Any]]) -> DeltaSummary:
        """Learner log-probs of stored rollouts; the batch's δ statistics."""
        body = {"scores": _dump(scores, Score)}
        return self._do(Call("POST", f"/v1/versions/{_seg(version_id)}/scores",
                             _model(DeltaSummary), True, json=body,
                             context={"version_id": version_id}))

    def get_discrepancy(self, version: str | None = None,
                        window_tokens: int | None = None) -> Discrepancy:
        """δ statistics over the last ``window_tokens`` tokens."""
        params = {k: v for k, v in (("version", version), ("window_tokens", window_tokens))
                  if v is not None}
        return self._do(Call("GET", "/v1/discrepancy", _model(Discrepancy), True, params=params,
                             context={"version_id": version}))

    # --- guidance -------------------------------------------------------------------------

    def put_guidance(self, version_id: str, rollout_id: str,
                     record: bytes | bytearray | memoryview) -> GuidancePutResponse:
        """Store one rollout's guidance record (replaces any previous one)."""
        return self._do(Call("PUT", f"/v1/guidance/{_seg(version_id)}/{_seg(rollout_id)}",
                             _model(GuidancePutResponse), True, content=bytes(record),
                             headers={"Content-Type": MEDIA_TYPE},
                             context={"version_id": version_id, "rollout_id": rollout_id}))

    def get_guidance(self, version_id: str, rollout_id: str) -> bytes:
        """One rollout's guidance record."""
        return self._do(Call("GET", f"/v1/guidance/{_seg(version_id)}/{_seg(rollout_id)}",
                             lambda r: r.content, True,
                             context={"version_id": version_id, "rollout_id": rollout_id}))

    def get_guidance_batch(self, version_id: str, rollout_ids: Sequence[str],
                           missing: str = "raise") -> dict[str, bytes]:
        """Many records in one reply (``missing="skip"`` leaves absent ones out)."""
        body = {"rollout_ids": list(rollout_ids), "missing": missing}
        return self._do(Call("POST", f"/v1/guidance/{_seg(version_id)}:batch",
                             lambda r: decode_frames(r.content), True, json=body,
                             context={"version_id": version_id}))

    def acquire_guidance_lease(self, version_id: str, consumer: str,
                               ttl_s: float) -> LeaseResponse:
        """Protect a version's guidance from budget eviction for ``ttl_s`` (renewable)."""
        return self._do(Call("POST", f"/v1/guidance/{_seg(version_id)}/lease",
                             _model(LeaseResponse), True,
                             json={"consumer": consumer, "ttl_s": ttl_s},
                             context={"version_id": version_id}))

    def release_guidance_lease(self, version_id: str, consumer: str) -> LeaseResponse:
        """Drop a lease; ``held`` says whether it was still held."""
        return self._do(Call("DELETE", f"/v1/guidance/{_seg(version_id)}/lease",
                             _model(LeaseResponse), True, params={"consumer": consumer},
                             context={"version_id": version_id}))

    # --- spec -----------------------------------------------------------------------------

    def get_spec(self) -> SpecInfo:
        """The daemon's numerics spec, its hash and the two sides' paths."""
        return self._do(Call("GET", "/v1/spec", _model(SpecInfo), True))

    def check_spec(self, sha256: str) -> SpecCheckResponse:
        """Compare a spec hash with the daemon's (raises SpecMismatchError if they differ)."""
        return self._do(Call("POST", "/v1/spec/check", _model(SpecCheckResponse), True,
                             json={"sha256": sha256}))


class AlignClient(_Routes):
    """Synchronous client (``httpx.Client``); use as a context manager or call ``close()``."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0,
                 retries: int = 3, *, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 deadline_s: float | None = None, transport: httpx.BaseTransport | None = None):
        super().__init__(base_url, token, timeout, retries, backoff_s, max_backoff_s, deadline_s)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers,
                                  timeout=self._timeout,
                                  transport=transport if transport is not None
                                  else DeadlineTransport())

    def _do(self, call: Call) -> Any:
        attempts = 0
        deadline = time.monotonic() + self.deadline_s

        def once() -> Any:
            nonlocal attempts
            attempts += 1
            resp = self._http.request(call.method, call.path, json=call.json,
                                      content=call.content, params=call.params,
                                      headers=call.headers,
                                      timeout=self._attempt_timeout(deadline))
            return self._finish(call, resp)

        try:
            with deadline_scope(deadline):
                return self.retry.call(once, transient=self._transient(call))
        except httpx.TransportError as e:
            raise self._unreachable(call, e, attempts, deadline) from e

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> AlignClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncAlignClient(_Routes):
    """Asynchronous client (``httpx.AsyncClient``): the same methods, each awaitable."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0,
                 retries: int = 3, *, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 deadline_s: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(base_url, token, timeout, retries, backoff_s, max_backoff_s, deadline_s)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                       timeout=self._timeout,
                                       transport=transport if transport is not None
                                       else AsyncDeadlineTransport())

    async def _do(self, call: Call) -> Any:  # type: ignore[override]
        attempts = 0
        deadline = time.monotonic() + self.deadline_s

        async def once() -> Any:
            nonlocal attempts
            attempts += 1
            resp = await self._http.request(call.method, call.path, json=call.json,
                                            content=call.content, params=call.params,
                                            headers=call.headers,
                                            timeout=self._attempt_timeout(deadline))
            return self._finish(call, resp)

        try:
            with deadline_scope(deadline):
                return await self.retry.acall(once, transient=self._transient(call))
        except httpx.TransportError as e:
            raise self._unreachable(call, e, attempts, deadline) from e

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAlignClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
