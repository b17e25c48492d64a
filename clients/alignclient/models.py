"""Wire models of the libalign control API, shared by the server and this client.

The API (``services/alignd/api``) declares its request and response bodies with these pydantic
models and the client parses replies into them, so both sides validate the same shapes
and a field added here appears on both. This module imports nothing from ``services``
(the client is installed without the daemon) and nothing heavier than pydantic.

Ids. Version ids, rollout ids, consumer names and execution path names become Redis key
parts and directory names, so they follow the id rule of :mod:`alignclient.ids`
(:data:`~alignclient.ids.ID_PATTERN`), the one the daemon checks them with. A path name is
also at most :data:`MAX_PATH_LEN` characters and never ``other`` (:data:`OTHER_PATH`), the name
of the aggregate the daemon reports the pairs past its cap under.

Log-probabilities are finite and at most :data:`LOGPROB_MAX` (a probability cannot exceed
1; rounding may push a certain token a hair above 0), as ``libalign.metrics`` requires.

Poison limits. What a request stores must be servable again by every read, so values are
bounded where they are stored more narrowly than JSON allows: log-probs and rewards lie
within ±:data:`FLOAT32_MAX` (δ is stored as float32, where a larger finite float64 becomes
inf); token ids and ``prompt_len`` are JSON integers (``"3"``, ``true`` and ``3.0`` are
refused, not coerced); a free-form ``meta`` nests at most :data:`MAX_META_DEPTH` deep and
serializes to at most :data:`MAX_META_BYTES` (a deeper one once stored broke every reader's
serializer); a lease lasts :data:`MIN_LEASE_TTL_S` to :data:`MAX_LEASE_TTL_S`.

Errors travel as ``{"error": {"code", "type", "message"}}`` (:class:`ErrorResponse`), the
code naming a class of :mod:`alignclient.errors`.
"""

from __future__ import annotations

import array
import base64
import binascii
import hashlib
import json
import numbers
import sys
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_serializer,
    model_validator,
)

from .ids import ID_PATTERN

#: Largest log-probability accepted (libalign.metrics.LOGPROB_TOLERANCE).
LOGPROB_MAX = 1e-6
#: Most tokens (prompt and completion) of one rollout.
MAX_ROLLOUT_TOKENS = 1 << 18
#: Most rollouts, scores or guidance ids in one request.
MAX_BATCH = 4096
#: States of a weight version, in the order a version moves through them (``retired``: no
#: longer served, pruned with its store directories after the retention time).
VERSION_STATES = ("published", "converting", "converted", "loading", "serving", "failed",
                  "retired")

#: Largest magnitude of a log-prob or reward: float32's largest finite value as numpy prints
#: it (every float64 up to it rounds to a finite float32).
FLOAT32_MAX = 3.4028235e38
#: Deepest nesting of a free-form ``meta`` object (the object itself is depth 1).
MAX_META_DEPTH = 32
#: Largest ``meta``, serialized as compact JSON (bytes of UTF-8).
MAX_META_BYTES = 64 * 1024
#: Shortest and longest guidance lease (seconds).
MIN_LEASE_TTL_S = 0.001
MAX_LEASE_TTL_S = 86_400.0


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0, ``{}`` or ``[]`` is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list | tuple):
            children = v
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children)
    return deepest


def check_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` if it nests at most MAX_META_DEPTH deep and serializes to MAX_META_BYTES at most."""
    depth = json_depth(meta)
    if depth > MAX_META_DEPTH:
        raise ValueError(f"meta nests {depth} levels deep; at most {MAX_META_DEPTH} "
                         "(MAX_META_DEPTH) are accepted")
    try:
        size = len(json.dumps(meta, separators=(",", ":"), allow_nan=False).encode())
    except ValueError as e:
        raise ValueError("meta holds NaN or Infinity, which JSON cannot carry") from e
    if size > MAX_META_BYTES:
        raise ValueError(f"meta serializes to {size} bytes; at most {MAX_META_BYTES} "
                         "(MAX_META_BYTES) are accepted")
    return meta


def strict_int(value: Any) -> Any:
    """``value`` if it is an integer; a string, boolean or float is refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"must be an integer, not {type(value).__name__} {value!r:.40}")
    return int(value)


SafeId = Annotated[str, Field(pattern=ID_PATTERN)]

#: Longest execution path name a rollout or score may carry (characters).
MAX_PATH_LEN = 64
#: The learner and sampler path of the aggregate pair: the daemon records every (learner
#: path, sampler path) pair past its cap (``ALIGN_MAX_PATH_PAIRS``) as ``other``/``other``, so
#: no writer may name a path so.
OTHER_PATH = "other"


def check_path_name(name: str) -> str:
    """``name`` unless it is :data:`OTHER_PATH`, the name reserved for the aggregate pair."""
    if name == OTHER_PATH:
        raise ValueError(f"path {OTHER_PATH!r} is reserved: it names the aggregate of the path "
                         "pairs past the daemon's cap")
    return name


#: An execution path name: the id rule, at most :data:`MAX_PATH_LEN` characters, not ``other``.
PathName = Annotated[str, Field(pattern=ID_PATTERN, max_length=MAX_PATH_LEN),
                     AfterValidator(check_path_name)]
LogProb = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=LOGPROB_MAX)]
Reward = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
StrictInt = Annotated[int, BeforeValidator(strict_int)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 31)]
#: A free-form JSON object within the meta limits.
Meta = Annotated[dict[str, Any], AfterValidator(check_meta)]
VersionState = Literal["published", "converting", "converted", "loading", "serving", "failed",
                       "retired"]


class Wire(BaseModel):
    """Base of every wire model: unknown fields are refused, values are not coerced from text."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Reply(BaseModel):
    """Base of response models: unknown fields are ignored, so a newer server stays readable."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# --- errors and health ------------------------------------------------------------------


class ErrorBody(Reply):
    """A typed error: ``code`` names an alignclient.errors class, ``type`` its class name."""

    code: str
    type: str
    message: str


class ErrorResponse(Reply):
    """The body of every error response."""

    error: ErrorBody


class Health(Reply):
    """Liveness of the API process."""

    status: str = "ok"


class Ready(Reply):
    """Readiness: Redis answers."""

    status: str
    redis: bool


# --- versions ---------------------------------------------------------------------------


class PublishRequest(Wire):
    """Register a BF16 version the learner already wrote to the weight store's published dir."""

    version_id: SafeId
    meta: Meta = Field(default_factory=dict, description=(
        f"free-form JSON object, at most {MAX_META_DEPTH} levels deep and {MAX_META_BYTES} "
        "bytes serialized"))
    target_path: SafeId | None = Field(
        None, description="sampler execution path to convert for (None: the converter preset)")


class VersionInfo(Reply):
    """A weight version as the registry holds it."""

    version_id: str
    state: VersionState
    path: str
    reason: str = ""
    owner: str = ""
    created_at: float
    updated_at: float
    meta: dict[str, Any] = Field(default_factory=dict)


class HistoryEntry(Reply):
    """One state change of a version (server time)."""

    from_state: str
    to_state: str
    at: float
    reason: str = ""
    actor: str = ""


class VersionDetail(Reply):
    """A version's record and every state change it went through."""

    version: VersionInfo
    history: list[HistoryEntry]


class VersionList(Reply):
    """Versions, oldest first: one page, the newest ``limit`` before the cursor asked for."""

    versions: list[VersionInfo]
    next_before: str | None = Field(None, description="cursor of the next (older) page: pass "
                                    "it as ``before``; None once this page reaches the oldest")


class PublishResponse(Reply):
    """The registered version and the id of its ``published`` event."""

    version: VersionInfo
    stream: str
    event_id: str | None = Field(description=(
        "stream id of the published event; None when the call repeated the registration of "
        "the same published directory, which answers the version it made and announces "
        "nothing again"))


class SyncRequest(Wire):
    """Ask the samplers to load a converted version."""

    version_id: SafeId


class SyncResponse(Reply):
    """The ``sync`` event put on the sync stream."""

    version_id: str
    state: VersionState
    stream: str
    event_id: str
    requested_at: float


# --- rollouts, scores, discrepancy ------------------------------------------------------


#: Most MoE layers a routing record names.
MAX_ROUTING_LAYERS = 1024
#: Most experts a routing record's ids can name (two bytes an id above 256).
MAX_ROUTING_EXPERTS = 1 << 15


def _b64(text: str | None, what: str) -> bytes | None:
    """The bytes of standard base64 ``text`` (None stays None); ValueError if it is not base64."""
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not standard base64") from None


class RoutingWire(Wire):
    """The sampler's routing of one rollout (R3), compact: the top-k expert ids of every token
    it fed (prompt and completion but the last token) at every MoE layer, as base64 of the
    raw little-endian array ``[positions, len(layers), top_k]`` (one byte an id up to 256
    experts, two above: ``libalign.routing.records``), optionally the gate weights (bf16)."""

    layers: list[StrictInt] = Field(min_length=1, max_length=MAX_ROUTING_LAYERS,
                                    description="MoE layer indices, increasing")
    top_k: StrictInt = Field(ge=1, le=MAX_ROUTING_EXPERTS)
    num_experts: StrictInt = Field(ge=1, le=MAX_ROUTING_EXPERTS)
    experts: str = Field(description="base64 of the expert ids, row-major")
    weights: str | None = Field(None, description="base64 of the gate weights, same shape")
    weights_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="the weights' dtype: bf16 (Hugging Face sampler) or fp32 "
        "(a Megatron-core router in fp32)")
    version_id: SafeId | None = Field(None, description="weight version the sampler routed with")

    @property
    def id_bytes(self) -> int:
        """Bytes an expert id takes: 1 up to 256 experts, else 2."""
        return 1 if self.num_experts <= 256 else 2

    @property
    def positions(self) -> int:
        """Tokens the record covers (from the base64 length: no decoding)."""
        n = len(self.experts) // 4 * 3 - self.experts[-2:].count("=")
        return n // (len(self.layers) * self.top_k * self.id_bytes)

    def raw(self) -> tuple[bytes, bytes | None]:
        """``(ids, weights)`` as bytes (weights None when not kept)."""
        return _b64(self.experts, "experts") or b"", _b64(self.weights, "weights")

    @model_validator(mode="after")
    def _shape(self) -> RoutingWire:
        """Layers increasing, top_k ≤ num_experts, whole rows of ids in range, weights to match."""
        if any(x < 0 for x in self.layers) or any(
                b <= a for a, b in zip(self.layers, self.layers[1:], strict=False)):
            raise ValueError(f"layers must be non-negative and increasing, got {self.layers[:8]}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        ids, weights = self.raw()
        row = len(self.layers) * self.top_k
        if len(ids) % (row * self.id_bytes):
            raise ValueError(f"experts holds {len(ids)} bytes, not whole tokens of {row} ids of "
                             f"{self.id_bytes} byte(s)")
        if ids:
            if self.id_bytes == 1:
                lo, hi = 0, max(ids)
            else:
                arr = array.array("h", ids)
                if sys.byteorder == "big":
                    arr.byteswap()
                lo, hi = min(arr), max(arr)
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"expert ids must lie in [0, {self.num_experts}), got {lo}..{hi}")
        size = 2 if self.weights_dtype == "bfloat16" else 4
        if weights is not None and len(weights) != size * len(ids) // self.id_bytes:
            raise ValueError(f"weights holds {len(weights)} bytes; {len(ids) // self.id_bytes} "
                             f"{self.weights_dtype} weights need {size} bytes each")
        return self


class Rollout(Wire):
    """One generated sequence as the sampler saw it: tokens and the sampler's log-probs."""

    rollout_id: SafeId
    prompt_len: StrictInt = Field(ge=1, lt=MAX_ROLLOUT_TOKENS)
    tokens: list[TokenId] = Field(max_length=MAX_ROLLOUT_TOKENS)
    logprobs: list[LogProb] = Field(
        description="sampler log-probability of each completion token (tokens after the prompt)")
    reward: Reward | None = None
    path: PathName = Field(description="execution path the sampler ran")
    guidance: bool = Field(False, description="a guidance record was stored for this rollout")
    routing: RoutingWire | None = Field(None, description="the sampler's expert choices (R3)")

    @model_serializer(mode="wrap")
    def _without_absent_routing(self, handler):
        """A rollout without routing serializes without the field, as before it existed, so
        older readers (which refuse unknown fields) keep reading what newer writers store."""
        data = handler(self)
        if isinstance(data, dict) and data.get("routing") is None:
            data.pop("routing", None)
        return data

    @model_validator(mode="after")
    def _lengths(self) -> Rollout:
        """At least one completion token, one log-prob per completion token, and routing (if
        any) for every token but the last."""
        if len(self.tokens) <= self.prompt_len:
            raise ValueError(f"tokens has {len(self.tokens)} entries; it must be longer than "
                             f"prompt_len={self.prompt_len} (at least one completion token)")
        want = len(self.tokens) - self.prompt_len
        if len(self.logprobs) != want:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries; the "
                             f"{len(self.tokens)} tokens after a prompt of {self.prompt_len} "
                             f"need {want}")
        if self.routing is not None and self.routing.positions != len(self.tokens) - 1:
            raise ValueError(f"routing covers {self.routing.positions} tokens; the "
                             f"{len(self.tokens)} tokens need {len(self.tokens) - 1} (all but "
                             "the last)")
        return self

    @property
    def completion_tokens(self) -> int:
        """Tokens after the prompt (those with a log-prob)."""
        return len(self.tokens) - self.prompt_len


class Score(Wire):
    """The learner's log-probs of one stored rollout's completion tokens."""

    rollout_id: SafeId
    logprobs: list[LogProb] = Field(min_length=1, max_length=MAX_ROLLOUT_TOKENS)
    path: PathName = Field(description="execution path the learner ran")


class RolloutBatch(Wire):
    """Rollouts to store for one version (all or none)."""

    rollouts: list[Rollout] = Field(min_length=1, max_length=MAX_BATCH)


class RolloutPutResponse(Reply):
    """How many rollouts and completion tokens were stored."""

    version_id: str
    stored: int
    tokens: int
    dropped: int = Field(0, description="rollouts not stored: their version is more than "
                         "max_version_diff versions older than the newest (stale_rollouts=drop)")


class RolloutIds(Reply):
    """Ids of the rollouts stored for a version, sorted."""

    version_id: str
    rollout_ids: list[str]


class RolloutList(Reply):
    """Full rollouts of a version."""

    version_id: str
    rollouts: list[Rollout]


class ScoreBatch(Wire):
    """Learner scores to pair with stored rollouts."""

    scores: list[Score] = Field(min_length=1, max_length=MAX_BATCH)


class DeltaStats(Reply):
    """Statistics of δ = log p_learner − log p_sampler (nats); all None when count is 0."""

    count: int = 0
    mean: float | None = None
    mean_abs: float | None = None
    p50_abs: float | None = None
    p90_abs: float | None = None
    p99_abs: float | None = None
    max_abs: float | None = None
    clip_low: float = 0.8
    clip_high: float = 1.28
    clip_potential: float | None = None
    below: float | None = None
    above: float | None = None
    tis_cap: float = 2.0
    tis_truncated_fraction: float | None = None
    k3_kl: float | None = None


class PathDiscrepancy(Reply):
    """The statistics of one (learner path, sampler path) pair."""

    learner_path: str
    sampler_path: str
    stats: DeltaStats


class DeltaSummary(Reply):
    """What one score batch added: its own δ statistics, overall and per path pair."""

    version_id: str
    rollouts: int
    tokens: int
    duplicates: int = Field(0, description="scores already recorded earlier (not counted again)")
    stats: DeltaStats
    by_path: list[PathDiscrepancy] = Field(default_factory=list)


class Discrepancy(Reply):
    """δ statistics over the last ``window_tokens`` scored tokens."""

    version_id: str | None = Field(None, description="the version asked for (None: recent ones)")
    versions: list[str] = Field(default_factory=list, description="versions the window covers")
    window_tokens: int
    stats: DeltaStats
    by_path: list[PathDiscrepancy] = Field(default_factory=list)


# --- guidance ---------------------------------------------------------------------------


class GuidancePutResponse(Reply):
    """One stored guidance record and the store's total afterwards."""

    version_id: str
    rollout_id: str
    bytes: int
    total_bytes: int
    evicted: list[str] = Field(default_factory=list, description="versions evicted to make room")


class GuidanceBatchRequest(Wire):
    """Rollout ids whose guidance records to fetch in one response."""

    rollout_ids: list[SafeId] = Field(min_length=1, max_length=MAX_BATCH)
    missing: Literal["raise", "skip"] = "raise"


class LeaseRequest(Wire):
    """Protect a version's guidance from budget eviction for ``ttl_s`` seconds."""

    consumer: SafeId
    ttl_s: float = Field(ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S, allow_inf_nan=False)


class LeaseResponse(Reply):
    """A lease taken (``held`` True) or released (``held`` False: was it held)."""

    version_id: str
    consumer: str
    ttl_s: float | None = None
    held: bool


# --- spec -------------------------------------------------------------------------------


class SpecInfo(Reply):
    """The numerics spec the daemon runs and the execution paths of both sides."""

    preset: str
    spec: dict[str, Any]
    sha256: str
    sampler_path: str
    learner_path: str


class SpecCheckRequest(Wire):
    """A caller's spec hash to compare with the daemon's."""

    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class SpecCheckResponse(Reply):
    """The hashes agree."""

    match: bool
    sha256: str


# --- status -----------------------------------------------------------------------------


class ServiceStatus(Reply):
    """One service instance's last heartbeat."""

    service: str
    name: str
    up: bool
    age_s: float | None = None
    state: str = ""
    version: str = ""
    info: dict[str, Any] = Field(default_factory=dict)


class GuidanceSummary(Reply):
    """Guidance store totals."""

    versions: int = 0
    rollouts: int = 0
    stored_bytes: int = 0
    budget_bytes: int | None = None
    budget_used_ratio: float | None = None
    leased_versions: list[str] = Field(default_factory=list)


class Status(Reply):
    """Everything the status page shows, in one reply."""

    time: float
    versions_by_state: dict[str, int]
    latest: dict[str, str | None] = Field(description="newest version id in each state")
    weight_version_lag: int
    versions_total: int | None = Field(None, description="versions the registry holds")
    versions_counted: int | None = Field(
        None, description="newest versions that versions_by_state, latest and the lag cover")
    services: list[ServiceStatus]
    discrepancy: Discrepancy
    guidance: GuidanceSummary


def spec_sha256(spec: dict[str, Any]) -> str:
    """SHA-256 of a numerics spec dict's canonical JSON (sorted keys, no whitespace).

    The daemon hashes ``NumericsSpec.to_dict()`` this way (``GET /v1/spec``); a learner or
    sampler hashes its own spec the same way and sends it to ``POST /v1/spec/check``.
    """
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
