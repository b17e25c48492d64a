"""Settings of the libalign services, one class per service, read from ``ALIGN_*`` variables.

Every field maps to an environment variable with the ``ALIGN_`` prefix (``store_dir`` is
``ALIGN_STORE_DIR``), so a container is configured without code. A service builds its class
once, when it starts (:func:`alignd.infra.service_main.run_service`): a bad value stops it
there with a message naming the field, before it touches Redis or the store.

Each class holds what its service reads and nothing else; the classes share parts:

=============================  ===============================================================
:class:`ServiceSettings`       every service: Redis, key prefix, event streams, weight store,
                               liveness heartbeats, ``/metrics``, log level
:class:`GuidanceStoreSettings` + the guidance store's budget, TTL and chunking (the services
                               that read or write guidance: sampler, learner, API)
:class:`DeliverySettings`      + at-least-once delivery timing (the consumers that take over
                               abandoned messages: converter, sampler)
:class:`ExportSettings`        + where the ModelOpt exports SGLang samplers load live, and the
                               model directory they are completed from (converter, sampler)
:class:`LayoutSettings`        + the layout written for the samplers (converter, learner)
:class:`ConverterSettings`     + the conversion: preset, device, shard size, consumer group,
                               retention
:class:`SamplerSettings`       + the sampler's engine (embedded torch or SGLang servers)
:class:`LearnerSettings`       + the learner's path and device, what it asks samplers for
:class:`ApiSettings`           + the control API: token, body limits, the status window; where
                               it listens is :class:`ApiAddress` (also what ``alignd status``
                               reads to find it)
:class:`AllInOneSettings`      every service in one process (``alignd up``, the demo)
=============================  ===============================================================

One variable means the same to every service that reads it (``ALIGN_PRESET`` to the
converter, the learner and the API), so a field several classes hold is declared once, as a
type (:data:`Preset`, :data:`SamplerPath`, :data:`LearnerPath`, :data:`ConsumerName`).

Isolation: every Redis key and stream a service owns starts with ``key_prefix``; the stream
fields default to ``<key_prefix>:events:<name>`` and take an explicit name (say
``ALIGN_PUBLISHED_STREAM``) as an override. Two daemons with different prefixes on one
Redis therefore never see each other's versions, events or consumer groups.

Bounded streams: every ``XADD`` the daemon does caps its stream at about ``stream_maxlen``
entries (``MAXLEN ~ N``: Redis trims whole macro-nodes, so a stream may run somewhat past N,
never without bound). Trimming drops the oldest entries whether or not a consumer group has
acknowledged them, so the rule is: N must exceed the largest backlog any group may hold (the
default, 10,000, is far above the handful of versions or rollout requests in flight). An entry
trimmed while still pending is not lost silently: :meth:`RedisBus.reclaim
<alignd.infra.bus.RedisBus.reclaim>` sees it deleted and acks it away.

Delivery timing, in short: a consumer that is working on a message refreshes it every
``heartbeat_ms``; a message nobody refreshed for ``claim_idle_ms`` is taken over
(``XAUTOCLAIM``) by a live consumer. ``heartbeat_ms`` must therefore be well below
``claim_idle_ms``. The ``guidance_*`` fields configure the guidance store (see
:mod:`alignd.infra.stores.guidance`).
"""

from __future__ import annotations

import itertools
import os
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from alignd.infra.events import DEFAULT_KEY_PREFIX, event_stream
from alignd.infra.keyspace import hash_tag, is_cluster_url, tagged_prefix
from libalign.spec import PRESETS

#: Default cap of every event and work stream's length (``ALIGN_STREAM_MAXLEN``).
DEFAULT_STREAM_MAXLEN = 10_000
#: Default number of (learner path, sampler path) pairs kept apart (``ALIGN_MAX_PATH_PAIRS``).
DEFAULT_MAX_PATH_PAIRS = 64

#: ``cpu``, ``cuda`` or ``cuda:N``: where a service runs its torch work.
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


_instances = itertools.count(1)


def default_process_name() -> str:
    """Host name and process id, then a count of the settings made in this process after the
    first: unique per service instance (two instances in one process never share a consumer
    name or a heartbeat), stable in its logs."""
    n = next(_instances)
    return f"{socket.gethostname()}-{os.getpid()}" + (f"-{n}" if n > 1 else "")


def known_preset(name: str) -> str:
    """``name`` if :data:`libalign.spec.PRESETS` defines it; ValueError listing them otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return name


def prefixed_stream(name: str) -> Callable[[dict[str, Any]], str]:
    """Default factory of a stream field: the stream ``name`` under the validated key prefix,
    so ``ALIGN_KEY_PREFIX`` alone separates two daemons sharing a Redis."""

    def default(data: dict[str, Any]) -> str:
        return event_stream(data.get("key_prefix", DEFAULT_KEY_PREFIX), name)

    default.__qualname__ = default.__name__ = f"{name}_stream_of_key_prefix"
    return default


# --- fields several services read, declared once ----------------------------------------------

Preset = Annotated[str, AfterValidator(known_preset),
                   Field("minite", description="numerics preset conversion quantizes with")]
SamplerPath = Annotated[str, Field("nvfp4_minite", description="execution path the sampler runs")]
LearnerPath = Annotated[str, Field("bf16", description="execution path the learner runs")]
ConsumerName = Annotated[str, Field(default_factory=default_process_name,
                                    description="this process's name in consumer groups and "
                                    "heartbeats")]
Device = Annotated[str, Field(pattern=DEVICE_PATTERN)]
MaxVersionDiff = Annotated[int | None, Field(
    None, ge=0, description="a rollout whose version is more than this many versions older than "
    "the newest (registry creation order) is dropped or refused (None: no bound; TRACE uses 3)")]
Strict = Annotated[bool, Field(
    False, description="strict execution: the embedded engines run libalign's "
    "batch-invariant ops (libalign.models.strict), so the learner reproduces the sampler's "
    "log-probs bit for bit; an SGLang sampler requires servers started with "
    "--enable-deterministic-inference")]
StrictOps = Annotated[Literal["device", "portable"], Field(
    "device", description="the strict mode's op set: device (batch-invariant tensor-core kernels "
    "on a GPU, the portable ops on a CPU) or portable (IEEE element-wise ops, the same bits on "
    "CPU and GPU, slower); both sides of a strict run use the same one")]
MaxPathPairs = Annotated[int, Field(
    DEFAULT_MAX_PATH_PAIRS, ge=1, le=1_024, description="(learner path, sampler path) pairs the "
    "discrepancy keeps apart, the first ones scored across all versions; scores of any further "
    "pair are recorded under the pair other/other, so /v1/status and /metrics hold at most this "
    "many pairs plus one")]
StaleRollouts = Annotated[Literal["drop", "refuse"], Field(
    "drop", description="what happens to a rollout beyond max_version_diff: drop it (counted in "
    "libalign_rollouts_stale_total) or refuse it with stale_rollout (HTTP 409)")]


#: The TRACE paper's run, as ``trace_paper`` fills it in: records on the latter half of the
#: MoE layers, one bit a value (b = 1), token-level TIS capped at 5, rollouts at most 3 versions
#: stale, routing replay (R3) recomputing gate weights over the sampler's experts.
TRACE_PAPER_DEFAULTS: dict[str, Any] = {
    "guidance_last_layers": "half", "guidance_bits": 1, "tis_cap": 5.0, "tis_level": "token",
    "max_version_diff": 3, "routing_replay": "recompute",
}


class AlignSettings(BaseSettings):
    """Read from ``ALIGN_<FIELD>`` variables; immutable; an unknown keyword is an error."""

    model_config = SettingsConfigDict(env_prefix="ALIGN_", extra="forbid", frozen=True)


class TracePaperProfile(AlignSettings):
    """``trace_paper``: the TRACE paper's defaults as one switch (:data:`TRACE_PAPER_DEFAULTS`).

    A profile, not a mode: it fills those of the fields this class has that were not set
    (by keyword or ``ALIGN_*`` variable; a None counts as unset); a field set explicitly keeps
    its value."""

    trace_paper: bool = Field(False, description="the TRACE paper's defaults for fields left "
                              "unset: guidance on the latter half of the MoE layers, 1 bit, "
                              "token TIS cap 5, max_version_diff 3, routing_replay recompute")

    @model_validator(mode="before")
    @classmethod
    def _fill_trace_paper(cls, data: Any) -> Any:
        if not isinstance(data, dict) or str(data.get("trace_paper", "")).lower() not in (
                "true", "1", "yes", "on"):
            return data
        fill = {k: v for k, v in TRACE_PAPER_DEFAULTS.items()
                if k in cls.model_fields and data.get(k) is None}
        return {**data, **fill}


class ServiceSettings(TracePaperProfile):
    """What every service reads: where Redis and the store are, the streams, liveness, metrics."""

    redis_url: str | None = Field(
        None, description="redis://host:port/db, redis+cluster://host:port[,host:port...] (a "
        "Redis Cluster) or redis+sentinel://host:port[,host:port...]/master-name (rediss+ for "
        "TLS, user:password@ before the hosts); None selects the embedded single-process "
        "default, embedded://NAME another in-process server of that name")
    redis_wait_replicas: int = Field(
        0, ge=0, description="after each registry write and guidance put, WAIT until this many "
        "replicas acknowledged it (0: do not wait); one acknowledged by fewer within "
        "redis_wait_timeout_ms is logged and counted in libalign_redis_unreplicated_writes_total")
    redis_wait_timeout_ms: int = Field(1_000, gt=0,
                                       description="longest WAIT for redis_wait_replicas")
    redis_retry_s: float | None = Field(
        None, description="give up on an unreachable Redis after this long (None: retry forever)")
    redis_allow_unverified_policy: bool = Field(
        False, description="start even when the Redis server's maxmemory-policy can be read "
        "neither by CONFIG GET nor by INFO (logged as a warning, counted in "
        "libalign_redis_policy_unverified_total); any policy but noeviction is refused")
    block_ms: int = Field(1_000, gt=0, description="longest wait of one blocking stream read")
    key_prefix: str = Field(DEFAULT_KEY_PREFIX, min_length=1,
                            description="prefix of every Redis key and stream the daemon owns; "
                            "on a cluster it gets a hash tag ({libalign}) unless it has one")
    store_dir: Path = Field(Path("align-store"), description="root of the weight store directory")
    published_stream: str = Field(default_factory=prefixed_stream("published"), min_length=1,
                                  description="learner -> converter (default "
                                  "<key_prefix>:events:published)")
    converted_stream: str = Field(default_factory=prefixed_stream("converted"), min_length=1,
                                  description="converter -> samplers (default "
                                  "<key_prefix>:events:converted)")
    stream_maxlen: int = Field(DEFAULT_STREAM_MAXLEN, ge=100,
                               description="every XADD trims its stream to about this many "
                               "entries (MAXLEN ~); must exceed any group's backlog")
    service_heartbeat_s: float = Field(2.0, gt=0, description="period of a service's heartbeat")
    service_heartbeat_ttl_s: float = Field(10.0, gt=0,
                                           description="a heartbeat older than this means down")
    shutdown_timeout_s: float = Field(
        15.0, gt=0, description="longest time from SIGTERM or SIGINT to exit: work still in "
        "hand then is left to another instance (a conversion is reclaimed and redone, a "
        "rollout request reclaimed); the API waits this long for requests in flight")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve /metrics (0: any)")
    metrics_addr: str = Field("0.0.0.0", description="address the metrics server binds")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="lowest level of the log lines a service writes to stderr")

    @model_validator(mode="before")
    @classmethod
    def _tag_prefix_on_cluster(cls, data: Any) -> Any:
        """On a Redis Cluster the key prefix carries a hash tag, so every key and stream
        named under it shares one slot (see :mod:`alignd.infra.keyspace`)."""
        if isinstance(data, dict) and is_cluster_url(data.get("redis_url")):
            data = {**data, "key_prefix": tagged_prefix(data.get("key_prefix")
                                                        or DEFAULT_KEY_PREFIX)}
        return data

    @model_validator(mode="after")
    def _streams_in_prefix_slot(self) -> ServiceSettings:
        """On a cluster, a stream named apart from the prefix must share its hash tag: the
        registry writes a version and its event in one transaction."""
        if is_cluster_url(self.redis_url):
            for name in ("published_stream", "converted_stream"):
                if hash_tag(getattr(self, name)) != hash_tag(self.key_prefix):
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} must carry the key prefix's hash tag "
                        f"{{{hash_tag(self.key_prefix)}}} on a Redis Cluster")
        return self


class GuidanceStoreSettings(ServiceSettings):
    """A service that reads or writes guidance records: the store's limits."""

    guidance_budget_bytes: int | None = Field(
        4 << 30, gt=0, description="payload bytes the guidance store may hold (None: no limit)")
    guidance_ttl_s: float | None = Field(
        86_400.0, gt=0, description="a version's guidance expires this long after its first put")
    guidance_chunk_bytes: int = Field(8 << 20, gt=0, le=512 << 20,
                                      description="records are split into Redis values this large")
    guidance_max_record_bytes: int = Field(256 << 20, gt=0,
                                           description="largest guidance record accepted")
    guidance_on_in_use: Literal["evict", "refuse"] = Field(
        "evict", description="budget full and only leased versions left: evict them (loudly) or "
        "refuse")
    guidance_shards: int = Field(
        default_factory=lambda data: 16 if is_cluster_url(data.get("redis_url")) else 1,
        ge=1, le=1_024, description="guidance shards, each a slot of its own with an equal part "
        "of the budget (default: 1 on one server or Sentinel, 16 on a cluster); changing it "
        "strands the versions already stored until their TTL")


class DeliverySettings(ServiceSettings):
    """A consumer that refreshes the message it works on and takes over abandoned ones."""

    heartbeat_ms: int = Field(5_000, gt=0, description="refresh period of an in-flight message")
    claim_idle_ms: int = Field(60_000, gt=0, description="idle time after which others reclaim")

    @model_validator(mode="after")
    def _heartbeat_below_claim(self) -> DeliverySettings:
        """A busy consumer must refresh its message before others may reclaim it."""
        if self.heartbeat_ms * 2 > self.claim_idle_ms:
            raise ValueError(f"heartbeat_ms={self.heartbeat_ms} must be at most half of "
                             f"claim_idle_ms={self.claim_idle_ms}")
        return self


class ExportSettings(ServiceSettings):
    """A service that writes or reads the ModelOpt NVFP4 exports SGLang samplers load."""

    sglang_model_dir: Path | None = Field(None, description="the SGLang servers' base checkpoint "
                                          "(config, tokenizer) that exports are completed from")
    sglang_export_dir: Path | None = Field(None, description="where ModelOpt NVFP4 exports for "
                                           "SGLang are written (default <store>/sglang)")


class LayoutSettings(ExportSettings):
    """A service that writes versions for the samplers (converter, a learner converting its
    own): in which layout, and with which K/V global scales."""

    sampler_layout: Literal["store", "modelopt"] = Field(
        "store", description="what is written for the samplers: the store version (store: the "
        "embedded torch samplers load it) or also, once per version, the ModelOpt NVFP4 export "
        "SGLang samplers load (modelopt; needs sglang_model_dir)")
    kv_scales_file: Path | None = Field(
        None, description="JSON of the per-layer K/V global scales ({source, k, v}) written into "
        "the manifest (and the ModelOpt export's k_scale/v_scale) of versions for a sampler path "
        "whose KV format takes them (nvfp4_minite_kv_sglang_nvfp4), and that a learner on such a "
        "KV path writes K/V with; unset: SGLang's default 1.0")

    @model_validator(mode="after")
    def _export_needs_model_dir(self) -> LayoutSettings:
        """A ModelOpt export is completed from the servers' model directory."""
        if self.sampler_layout == "modelopt" and self.sglang_model_dir is None:
            raise ValueError("sampler_layout=modelopt needs sglang_model_dir (ALIGN_SGLANG_MODEL_DIR"
                             "): the Hugging Face directory the SGLang servers started from")
        return self


class ConverterSettings(DeliverySettings, LayoutSettings):
    """The converter: published BF16 versions in, NVFP4 store versions out."""

    preset: Preset
    retain_exports: int = Field(3, ge=1, description="newest ModelOpt exports kept by the "
                                "retention pass, besides those of versions a live sampler serves "
                                "or that are on their way to a sampler")
    consumer_name: ConsumerName
    converter_group: str = Field("converter", description="consumer group of the converters "
                                 "(on the key prefix's published stream: one per run)")
    max_deliveries: int = Field(5, ge=1, description="deliveries before a version is failed")
    convert_all_linear: bool = Field(False, description="also quantize every 2-D linear weight")
    store_shard_bytes: int = Field(1 << 30, gt=0, description="largest output safetensors shard")
    converter_device: Device = Field("cpu", description="where the converter quantizes")
    sweep_stale_s: float = Field(3_600.0, ge=0, description="age of .tmp-* leftovers to delete")
    sweep_interval_s: float = Field(600.0, gt=0, description="period of the .tmp-* leftover "
                                    "sweep while the converter runs (it also sweeps on start)")
    # retention: the converter is the run's janitor
    retain_versions: int = Field(3, ge=1, description="newest versions kept with their store "
                                 "directories, besides any version a live sampler serves")
    retired_ttl_s: float = Field(3_600.0, ge=0, description="time a retired version keeps its "
                                 "record and store directories before it is pruned (and a "
                                 "failed one stays failed, to be retried, before it is retired)")
    retention_interval_s: float = Field(60.0, gt=0, description="period of the retention pass "
                                        "(retire, prune, dead consumers) while the converter runs")
    dead_consumer_idle_ms: int = Field(3_600_000, gt=0, description="a stream consumer idle this "
                                       "long with nothing pending is removed from its group")
    held_version_grace_s: float = Field(
        600.0, gt=0, description="a version a sampler served or was loading is kept in use this "
        "long after that sampler's last heartbeat unless it stopped cleanly (a paused or cut-off "
        "sampler keeps its version); must exceed service_heartbeat_ttl_s")

    @model_validator(mode="after")
    def _grace_beyond_heartbeat(self) -> ConverterSettings:
        """A sampler that missed a few beats must still hold its versions."""
        if self.held_version_grace_s <= self.service_heartbeat_ttl_s:
            raise ValueError(f"held_version_grace_s={self.held_version_grace_s} must exceed "
                             f"service_heartbeat_ttl_s={self.service_heartbeat_ttl_s}")
        return self


class SamplerSettings(DeliverySettings, GuidanceStoreSettings, ExportSettings):
    """A sampler: loads converted versions, answers rollout requests, records guidance."""

    sampler_name: ConsumerName
    sampler_path: SamplerPath
    sampler_device: Device = Field("cpu", description="device of the embedded sampler engine")
    strict: Strict
    strict_ops: StrictOps
    sampler_engine: Literal["torch", "sglang"] = Field(
        "torch", description="sampler engine: the embedded torch one or an SGLang server over HTTP")
    guidance_last_layers: int | Literal["half"] | None = Field(
        None, description="record only the last N MoE layers, N >= 1 (half: the latter half; "
        "None: all)")

    @model_validator(mode="after")
    def _positive_last_layers(self) -> SamplerSettings:
        n = self.guidance_last_layers
        if isinstance(n, int) and n < 1:
            raise ValueError(f"guidance_last_layers must be at least 1, 'half' or unset, got {n}")
        return self
    sglang_url: str | None = Field(None, description="base URL of the SGLang server to drive, "
                                   "or several separated by commas (calls spread, weight "
                                   "switches go to all)")
    sglang_router_url: str | None = Field(None, description="an sglang-router's URL instead: calls "
                                          "go through it, weight switches to its workers")
    sglang_api_key: str | None = Field(None, description="the servers' --api-key (sent as "
                                       "Authorization: Bearer)")
    sglang_admin_api_key: str | None = Field(None, description="the servers' --admin-api-key "
                                             "(sent on the weight-switch routes)")
    sglang_original_logprobs: bool | None = Field(
        None, description="true: every server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (for "
        "servers that do not report their environment); None: ask each server")
    sglang_eos_id: int | None = Field(None, ge=0, description="stop token id for SGLang sampling")
    sglang_load_format: str | None = Field(None, description="load_format of "
                                           "/update_weights_from_disk (None: the server's)")


class LearnerSettings(GuidanceStoreSettings, LayoutSettings):
    """The learner: trains on one path, publishes versions for the samplers' path."""

    preset: Preset
    learner_path: LearnerPath
    learner_device: Device = Field("cpu", description="device of the embedded learner engine")
    strict: Strict
    strict_ops: StrictOps
    sampler_path: SamplerPath
    guidance_bits: int = Field(1, ge=1, le=4, description="bits a value kept in guidance records")
    # the objective (alignd.learner.engine)
    tis_cap: float = Field(2.0, gt=0, allow_inf_nan=False, description="truncated importance "
                           "sampling cap C of min(pi_learner / p_sampler, C) (TRACE uses 5)")
    tis_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="TIS weight per token, per sequence (product of ratios) or per "
        "sequence from the geometric mean of its ratios")
    ppo_clip_eps: float | None = Field(None, gt=0, lt=1, description="clip the policy-update "
                                       "ratio pi_theta / pi_old to [1-eps, 1+eps] (PPO; None: "
                                       "no clipping, e.g. 0.2)")
    ppo_epochs: int = Field(1, ge=1, le=64, description="optimizer steps on each rollout batch; "
                            "after the first the policy ratio leaves 1 and ppo_clip_eps binds")
    max_version_diff: MaxVersionDiff
    stale_rollouts: StaleRollouts
    max_path_pairs: MaxPathPairs
    routing_replay: Literal["off", "measure", "recompute", "record"] = Field(
        "off", description="routing replay (R3): recompute routes every token to the experts "
        "the sampler recorded, gate weights from the learner's router logits; record also "
        "takes the sampler's gate weights; measure only counts the routing disagreement; a "
        "rollout without a routing record is refused (libalign_rollouts_unreplayed_total)")


class ApiAddress(AlignSettings):
    """Where the control API listens, and where clients and services reach it."""

    api_host: str = Field("127.0.0.1", description="address the REST control API binds")
    api_port: int = Field(8000, ge=0, le=65535, description="port of the REST control API (0: any)")
    api_url: str | None = Field(None, description="where clients and services reach the API "
                                "(default http://<api_host>:<api_port>)")

    @property
    def resolved_api_url(self) -> str:
        """The API's base URL as clients should use it."""
        if self.api_url:
            return self.api_url.rstrip("/")
        host = "127.0.0.1" if self.api_host in ("0.0.0.0", "::") else self.api_host
        return f"http://{host}:{self.api_port}"


class ApiSettings(GuidanceStoreSettings, ApiAddress):
    """The control API: its door (token, body limits) and what its routes report."""

    api_token: str | None = Field(None, description="bearer token every mutating route requires")
    # reads
    read_token: str | None = Field(None, description="bearer token the read routes accept besides "
                                   "api_token (rollouts, guidance, versions, status)")
    open_reads: bool = Field(False, description="serve the read routes without a token "
                             "(healthz, readyz, metrics and the page itself are always open)")
    # overload
    api_header_timeout_s: float = Field(10.0, gt=0, description="time a connection has to send a "
                                        "whole request head before it is closed")
    api_keep_alive_s: float = Field(5.0, gt=0, description="idle time of a kept-alive connection "
                                    "before it is closed")
    api_max_connections: int = Field(1_000, ge=1, description="open connections served at once; "
                                     "beyond it new requests are answered 503")
    api_backlog: int = Field(2_048, ge=1, description="listen backlog of the API socket (at most "
                             "a fifth of the open-files limit)")
    heavy_read_concurrency: int = Field(8, ge=1, description="heavy reads (status, versions, "
                                        "rollouts, guidance) run at once; health never waits on them")
    status_cache_s: float = Field(1.0, ge=0, description="age up to which /v1/status and the "
                                  "metrics' cluster gauges reuse one computed answer (0: never)")
    dev_mode: bool = Field(False, description="allow running the API without a token (local use)")
    max_body_bytes: int = Field(16 << 20, gt=0, description="largest JSON request body accepted")
    max_guidance_body_bytes: int = Field(256 << 20, gt=0,
                                         description="largest guidance record upload accepted")
    discrepancy_window_tokens: int = Field(
        65_536, gt=0, description="tokens the status and metrics discrepancy statistics cover")
    status_versions: int = Field(100, ge=1, le=10_000, description="newest versions /v1/status "
                                 "counts per state (its cost is this page, not the history)")
    consumer_name: ConsumerName
    preset: Preset
    sampler_path: SamplerPath
    learner_path: LearnerPath
    max_version_diff: MaxVersionDiff
    stale_rollouts: StaleRollouts
    max_path_pairs: MaxPathPairs


class AllInOneSettings(ApiSettings, ConverterSettings, SamplerSettings, LearnerSettings):
    """Every service in one process (``alignd up``, the demo): the union of their settings."""


def __getattr__(name: str):
    """``Settings``, the one class every service once shared, is :class:`AllInOneSettings`."""
    if name == "Settings":
        warnings.warn("alignd.infra.settings.Settings is deprecated: use the service's own class "
                      "(ConverterSettings, SamplerSettings, LearnerSettings, ApiSettings) or "
                      "AllInOneSettings", DeprecationWarning, stacklevel=2)
        return AllInOneSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
