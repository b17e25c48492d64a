"""The error tree of libalign and its daemon: one class per thing that can go wrong.

Every error derives from :class:`AlignError` and carries a stable machine-readable ``code``,
so a caller catches exactly what went wrong: a wrong dtype is not a wrong shape, and
neither is a NaN. These classes are the wire contract: the numerical core raises them
in-process (``libalign.errors`` re-exports the ones it raises), the daemon raises them in
its services, the API answers them as ``{"error": {"code", "type", "message"}}``, and the
client (:func:`error_from_response`) raises the same class again from the ``code``, so
``except VersionNotFoundError`` works the same in-process and over HTTP.

A class here says *what* went wrong, never how a transport reports it: the HTTP status of
each class is the API's business (``alignd.api.errors``). The only status in this module is
the one a client *received* (``RemoteError.status``, and ``status`` on every error rebuilt
from a reply).

The input errors also derive from the builtin they refine (``ValueError`` or ``TypeError``),
and the not-found errors from ``LookupError``, so code written against plain Python
conventions keeps working.

This module imports nothing outside the standard library: the numerical core, the daemon
and a client without either import it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import Any


class AlignError(Exception):
    """Base of every libalign error."""

    code: str = "align_error"

    def to_dict(self) -> dict:
        """Wire form: the code, the class name and the message."""
        return {"code": self.code, "type": type(self).__name__, "message": str(self)}


# --- inputs: what is wrong with an argument, a tensor or a number ------------------------


class InputError(AlignError, ValueError):
    """The caller passed something libalign cannot accept."""

    code = "invalid_input"


class DTypeError(InputError, TypeError):
    """A tensor has a dtype the operation does not accept."""

    code = "invalid_dtype"


class ShapeError(InputError):
    """A tensor has the wrong rank or shape."""

    code = "invalid_shape"


class NonFiniteError(InputError):
    """A tensor holds NaN or Inf where the numerics spec refuses them.

    ``count`` is how many elements are non-finite, ``nan``/``inf`` split that count and
    ``first_indices`` lists the multi-indices of the first few offenders.
    """

    code = "non_finite"

    def __init__(
        self,
        what: str,
        count: int,
        nan: int,
        inf: int,
        first_indices: Sequence[tuple[int, ...]],
    ):
        self.count = count
        self.nan = nan
        self.inf = inf
        self.first_indices = [tuple(int(i) for i in ix) for ix in first_indices]
        shown = ", ".join(str(ix) for ix in self.first_indices)
        super().__init__(
            f"{what}: {count} non-finite element(s) ({nan} NaN, {inf} Inf), "
            f"first at {shown}"
        )


class SpecError(InputError):
    """A numerics spec is inconsistent, unknown, or cannot express the request. ``field``
    names what disagrees when one thing does (``kv.format``: a weight version made for another
    KV cache format than the sampler runs)."""

    code = "invalid_spec"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class UndefinedScaleError(InputError):
    """The chosen preset's arithmetic produces no defined scale for this input.

    Raised, for example, by the ``torchao`` and ``modelopt`` presets on an all-zero
    tensor, where those libraries divide zero by zero and emit NaN block scales.
    """

    code = "undefined_scale"


class LayoutError(InputError):
    """A packed payload, scale layout or checkpoint dict does not fit its description."""

    code = "invalid_layout"


class FramingError(LayoutError):
    """A batched guidance body does not follow its framing (``alignclient.framing``)."""

    code = "invalid_framing"


class MissingShardError(InputError):
    """A published weight version names a shard file that is not there.

    ``shard`` is the missing file name and ``tensors`` the tensors the index puts in it.
    """

    code = "missing_shard"

    def __init__(self, shard: str, tensors: Sequence[str], where: str = ""):
        self.shard = shard
        self.tensors = list(tensors)
        first = ", ".join(self.tensors[:3]) + (" ..." if len(self.tensors) > 3 else "")
        at = f" in {where}" if where else ""
        super().__init__(f"shard {shard!r}{at} is missing; it holds {len(self.tensors)} "
                         f"tensor(s): {first}")


class EventError(InputError):
    """An event on a Redis stream lacks a field or holds one that does not parse."""

    code = "invalid_event"


class PayloadTooLargeError(InputError):
    """A request body, record or value is larger than the configured limit."""

    code = "payload_too_large"

    def __init__(self, what: str, size: int, limit: int):
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"{what} is {size} bytes, more than the limit of {limit} bytes")


class MalformedBodyError(InputError):
    """A request body is not parsable at all (broken JSON), as opposed to parsable but invalid."""

    code = "malformed_body"


class GuidanceRecordError(InputError):
    """A guidance record is malformed or does not fit the activation it should guide."""

    code = "invalid_guidance"


class GuidanceChecksumError(GuidanceRecordError):
    """A guidance record's bytes do not match the checksum it carries (corrupt record)."""

    code = "guidance_checksum"


class GuidanceMismatchError(GuidanceRecordError):
    """Guidance records that are well formed but were made for something else: another weight
    version, a model with another layer count, KV head count or head size, another bit width
    or KV format. ``field`` names what does not match (``version``, ``layers``, ``kv_heads``,
    ``head_dim``, ``bits``, ``format``)."""

    code = "guidance_mismatch"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class GuidanceUnsupportedError(InputError):
    """Guidance records (TRACE) were asked of an engine that cannot capture them."""

    code = "guidance_unsupported"


class RoutingRecordError(InputError):
    """A malformed routing record (R3): byte length, expert id range, layer list or weights
    that do not fit what the record says it holds."""

    code = "invalid_routing"


class RoutingMismatchError(RoutingRecordError):
    """A well-formed routing record made for something else: another weight version, MoE
    layer list, top-k, expert count or token count. ``field`` names what does not match
    (``version``, ``layers``, ``top_k``, ``num_experts``, ``positions``)."""

    code = "routing_mismatch"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class RoutingMissingError(InputError):
    """Routing replay (R3) is on but a rollout carries no routing record: it is refused, never
    trained with the learner's own routing without saying so."""

    code = "routing_missing"


# --- configuration and runs --------------------------------------------------------------


class ConfigError(AlignError):
    """A setting is missing or inconsistent, or asks for something not available here."""

    code = "invalid_config"


class DistributedRunError(AlignError):
    """One or more ranks of a multi-process run failed or died without a result; the message
    names each failing rank with its error."""

    code = "distributed_run_failed"


class LoopError(AlignError):
    """A stage of the RL loop did not complete (a failed version, a sampler error, a timeout)."""

    code = "loop_error"


# --- weight versions and the weight store ------------------------------------------------


class VersionNotFoundError(AlignError, LookupError):
    """No weight version with this id exists (in the registry or in the store)."""

    code = "version_not_found"

    def __init__(self, version_id: str, where: str = "registry"):
        self.version_id = version_id
        super().__init__(f"weight version {version_id!r} not found in the {where}")


class VersionExistsError(AlignError):
    """A weight version with this id already exists and may not be created again."""

    code = "version_exists"

    def __init__(self, version_id: str, where: str = "registry"):
        self.version_id = version_id
        super().__init__(f"weight version {version_id!r} already exists in the {where}")


class StateTransitionError(AlignError):
    """A weight version cannot move from its current state to the one asked for."""

    code = "illegal_transition"

    def __init__(self, version_id: str, current: str, target: str, detail: str = ""):
        self.version_id = version_id
        self.current = current
        self.target = target
        extra = f" ({detail})" if detail else ""
        super().__init__(f"weight version {version_id!r}: {current} -> {target} is not "
                         f"allowed{extra}")


class StoreError(AlignError):
    """The weight store holds something unreadable or inconsistent."""

    code = "store_error"


class RedisFullError(StoreError):
    """Redis refused a write for lack of memory (``maxmemory`` reached under ``noeviction``);
    nothing was written. Retrying does not help until memory is freed."""

    code = "redis_full"


class ChecksumMismatchError(StoreError):
    """A stored tensor's bytes do not match the SHA-256 its manifest records."""

    code = "checksum_mismatch"

    def __init__(self, version_id: str, tensor: str, expected: str, actual: str):
        self.version_id = version_id
        self.tensor = tensor
        self.expected = expected
        self.actual = actual
        super().__init__(f"weight version {version_id!r}: tensor {tensor!r} has sha256 "
                         f"{actual[:16]}..., the manifest says {expected[:16]}...")


class ManifestError(StoreError):
    """A stored version's manifest is missing, unparsable or disagrees with its files.
    ``field`` names the manifest field that is missing or malformed, when one is
    (``totals.tensors``, ``tensors['w'].stored['w_scale'].sha256``)."""

    code = "invalid_manifest"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class WeightUpdateError(StoreError):
    """A serving engine could not load a weight version (it keeps serving the old one).

    A store error because it is a property of the version's files as the engine reads them
    (a missing shard, a tensor of the wrong shape): the sampler marks the version failed
    with the engine's message, as it does for a version that fails verification.
    """

    code = "weight_update_failed"


class SpecMismatchError(AlignError):
    """The caller's numerics spec hash differs from the one the daemon runs with."""

    code = "spec_mismatch"

    def __init__(self, server_sha256: str, client_sha256: str):
        self.server_sha256 = server_sha256
        self.client_sha256 = client_sha256
        super().__init__(f"numerics spec mismatch: the daemon runs sha256 {server_sha256}, the "
                         f"caller has {client_sha256}")


# --- Redis: the bus and the stores on it -------------------------------------------------


class BusUnavailableError(AlignError):
    """Redis could not be reached within the retry budget."""

    code = "bus_unavailable"


class GuidanceNotFoundError(AlignError, LookupError):
    """The guidance store holds no record for this weight version (or this rollout)."""

    code = "guidance_not_found"

    def __init__(self, version_id: str, rollout_id: str | None = None, detail: str = ""):
        self.version_id = version_id
        self.rollout_id = rollout_id
        what = (f"rollout {rollout_id!r} of weight version {version_id!r}" if rollout_id
                is not None else f"weight version {version_id!r}")
        super().__init__(f"no guidance for {what}" + (f" ({detail})" if detail else ""))


class GuidanceEvictedError(GuidanceNotFoundError):
    """The version's guidance existed but was evicted (budget or TTL); the message says why."""

    code = "guidance_evicted"


class GuidanceBudgetError(AlignError):
    """A put would exceed the guidance store's byte budget and nothing may be evicted."""

    code = "guidance_budget"


class RolloutExistsError(AlignError):
    """A rollout with this id is already stored for the weight version; rollouts are write-once."""

    code = "rollout_exists"

    def __init__(self, version_id: str, rollout_ids: Sequence[str]):
        self.version_id = version_id
        self.rollout_ids = list(rollout_ids)
        shown = ", ".join(repr(r) for r in self.rollout_ids[:5])
        more = f" and {len(self.rollout_ids) - 5} more" if len(self.rollout_ids) > 5 else ""
        super().__init__(f"weight version {version_id!r} already holds rollout(s) {shown}{more}; "
                         "nothing of this batch was stored")


class RolloutNotFoundError(AlignError, LookupError):
    """No rollout with this id is stored for the weight version (never put, or expired)."""

    code = "rollout_not_found"

    def __init__(self, version_id: str, rollout_id: str):
        self.version_id = version_id
        self.rollout_id = rollout_id
        super().__init__(f"rollout {rollout_id!r} of weight version {version_id!r} not found "
                         "(never stored, or expired)")


class StaleRolloutError(AlignError):
    """Rollouts of a weight version more than ``max_version_diff`` versions older than the
    current one were refused (``stale_rollouts = "refuse"``)."""

    code = "stale_rollout"

    def __init__(self, version_id: str, current_version: str, distance: int, max_version_diff: int):
        self.version_id = version_id
        self.current_version = current_version
        self.distance = distance
        self.max_version_diff = max_version_diff
        super().__init__(f"rollouts of weight version {version_id!r} are {distance} versions older "
                         f"than the current version {current_version!r}; max_version_diff is "
                         f"{max_version_diff}")


# --- the control API ---------------------------------------------------------------------


class UnauthorizedError(AlignError):
    """A mutating request came without a bearer token."""

    code = "unauthorized"


class ForbiddenError(AlignError):
    """A mutating request came with a bearer token that is not the configured one."""

    code = "forbidden"


class RouteNotFoundError(AlignError, LookupError):
    """No API route has this path."""

    code = "route_not_found"


class MethodNotAllowedError(AlignError):
    """The API route exists but does not accept this HTTP method."""

    code = "method_not_allowed"


class InternalError(AlignError):
    """Something failed inside the daemon that no more specific error describes."""

    code = "internal_error"


class OverloadedError(AlignError):
    """The API is busy with as many requests of this kind as it admits at once, and this one
    waited its turn too long; retry after the reply's ``Retry-After`` seconds."""

    code = "overloaded"


# --- serving engines (SGLang) ------------------------------------------------------------


class EngineUnavailableError(AlignError):
    """A serving engine (an SGLang server) could not be reached, or kept answering 503
    (still loading), within the adapter's retry deadline."""

    code = "engine_unavailable"


class EngineTimeoutError(EngineUnavailableError):
    """A serving engine took a request but did not answer within the request's timeout
    (or a condition it waits for, such as its requests draining, did not come in time)."""

    code = "engine_timeout"


class EngineRequestError(AlignError):
    """A serving engine refused a request, aborted it, or answered in a shape the adapter
    does not understand; the message carries the engine's own words."""

    code = "engine_request_failed"


class EngineMismatchError(AlignError):
    """A serving engine is not the one the version asked for: another model, another
    quantization, or (:class:`WeightVersionMismatchError`) another weight version. ``field``
    names what does not match (``model``, ``quantization``, ``weight_version``)."""

    code = "engine_mismatch"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class WeightVersionMismatchError(EngineMismatchError):
    """A serving engine reports a weight version other than the one the adapter loaded
    (another controller switched it, or an update did not take)."""

    code = "weight_version_mismatch"
    field = "weight_version"

    def __init__(self, message: str, *, field: str | None = "weight_version"):
        super().__init__(message, field=field)


class TemperedLogprobsError(ConfigError):
    """A serving engine would report log-probs after temperature scaling (SGLang without
    ``SGLANG_RETURN_ORIGINAL_LOGPROB``), or cannot tell, for a call at a temperature other
    than 1: the execution gap against a learner's untempered log-probs would be biased."""

    code = "tempered_logprobs"


# --- what a client sees ------------------------------------------------------------------


class RemoteError(AlignError):
    """An error reply whose code names no known error class (or a reply that is not JSON).

    ``status`` is the HTTP status the reply came with; ``code`` the code it named
    (``http_<status>`` for a body that is not the API's).
    """

    code = "remote_error"
    status: int | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        if code is not None:
            self.code = code


class ApiUnreachableError(RemoteError):
    """The API could not be reached (connection refused, timeout) within the call's retries."""

    code = "api_unreachable"


class ApiTimeoutError(ApiUnreachableError):
    """The call's total deadline passed before the API answered in full: however the time went
    (a slow connect, a server that answers a byte at a time, retries), the call ends at it."""

    code = "api_timeout"


class BadResponseError(RemoteError):
    """The API answered with a success status but a body that does not follow the contract
    (not JSON, a field missing or of the wrong type, broken framing); the message names the
    route and the field. ``status`` is None: the reply's success status is not an error's."""

    code = "bad_response"


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def error_classes() -> dict[str, type[AlignError]]:
    """``code -> class`` for every error class of this module (first one wins)."""
    table: dict[str, type[AlignError]] = {AlignError.code: AlignError}
    for cls in _subclasses(AlignError):
        if cls.__module__ == __name__:
            table.setdefault(cls.code, cls)
    return table


_CLASSES = error_classes()


def rebuild(code: str, message: str, *, status: int, context: dict[str, Any] | None = None
            ) -> AlignError:
    """An instance of the class for ``code`` carrying ``message`` and the received ``status``.

    The class's ``__init__`` is not called (the reply carries only the message); attributes
    it would set from its arguments (``version_id``, ``rollout_id``) are filled in from
    ``context`` when the call knew them, and are otherwise absent.
    """
    cls = _CLASSES.get(code)
    if cls is None:
        return RemoteError(f"{code}: {message}", status=status, code=code)
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.status = status
    params = inspect.signature(cls.__init__).parameters
    for k, v in (context or {}).items():
        if k in params and v is not None:
            setattr(err, k, v)
    return err


def error_from_response(status: int, body: bytes, *, method: str = "", url: str = "",
                        context: dict[str, Any] | None = None) -> AlignError:
    """The typed error for an error reply (``RemoteError`` if the body is not the API's).

    The instance carries the server's message (``str(e)``), the HTTP status (``e.status``)
    and the request it answered (``e.method``, ``e.url``).
    """
    try:
        e = json.loads(body)["error"]
        code, message = str(e["code"]), str(e["message"])
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode(errors="replace")
        err: AlignError = RemoteError(f"HTTP {status} from {method} {url}: {text}", status=status,
                                      code=f"http_{status}")
    else:
        err = rebuild(code, message, status=status, context=context)
    err.method, err.url = method, url
    return err
