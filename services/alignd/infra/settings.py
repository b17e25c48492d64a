"""Settings of every libalign service, read from ``ALIGN_*`` environment variables.

One flat :class:`Settings` object configures the daemon: where Redis is, where the weight
store lives, which numerics preset conversion uses, the names of the streams and consumer
groups that carry events, and the timing knobs of at-least-once delivery. Every field
maps to an environment variable with the ``ALIGN_`` prefix (``store_dir`` is
``ALIGN_STORE_DIR``), so a container is configured without code.

Delivery timing, in short: a consumer that is working on a message refreshes it every
``heartbeat_ms``; a message nobody refreshed for ``claim_idle_ms`` is taken over
(``XAUTOCLAIM``) by a live consumer. ``heartbeat_ms`` must therefore be well below
``claim_idle_ms``.

The ``guidance_*`` fields configure the guidance store (budget, TTL, chunking, what to
do when only versions in use are left to evict); see ``services/alignd/infra/stores/guidance.py``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from libalign.spec import PRESETS


def _default_consumer() -> str:
    """Host name and process id: unique per running process, stable in its logs."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    """Configuration of the libalign services (environment prefix ``ALIGN_``)."""

    model_config = SettingsConfigDict(env_prefix="ALIGN_", extra="ignore", frozen=True)

    redis_url: str | None = Field(
        None, description="redis://host:port/db; None selects the embedded single-process default")
    store_dir: Path = Field(Path("align-store"), description="root of the weight store directory")
    preset: str = Field("minite", description="numerics preset conversion quantizes with")
    key_prefix: str = Field("libalign", description="prefix of every Redis key the daemon owns")

    published_stream: str = Field("libalign:events:published", description="learner -> converter")
    converted_stream: str = Field("libalign:events:converted", description="converter -> samplers")
    converter_group: str = Field("converter", description="consumer group of the converters")
    consumer_name: str = Field(default_factory=_default_consumer, description="this consumer")

    heartbeat_ms: int = Field(5_000, gt=0, description="refresh period of an in-flight message")
    claim_idle_ms: int = Field(60_000, gt=0, description="idle time after which others reclaim")
    block_ms: int = Field(1_000, gt=0, description="longest wait of one XREADGROUP")
    max_deliveries: int = Field(5, ge=1, description="deliveries before a version is failed")
    redis_retry_s: float | None = Field(
        None, description="give up on an unreachable Redis after this long (None: retry forever)")

    convert_all_linear: bool = Field(False, description="also quantize every 2-D linear weight")
    store_shard_bytes: int = Field(1 << 30, gt=0, description="largest output safetensors shard")
    converter_device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                                  description="where the converter quantizes (cpu or cuda[:N])")
    sweep_stale_s: float = Field(3_600.0, ge=0, description="age of .tmp-* leftovers to delete")

    guidance_budget_bytes: int | None = Field(
        4 << 30, gt=0, description="payload bytes the guidance store may hold (None: no limit)")
    guidance_ttl_s: float | None = Field(
        86_400.0, gt=0, description="a version's guidance expires this long after its first put")
    guidance_chunk_bytes: int = Field(8 << 20, gt=0, le=512 << 20,
                                      description="records are split into Redis values this large")
    guidance_max_record_bytes: int = Field(256 << 20, gt=0,
                                           description="largest guidance record accepted")
    guidance_on_in_use: str = Field(
        "evict", pattern=r"^(evict|refuse)$",
        description="budget full and only leased versions left: evict them (loudly) or refuse")

    # --- control API -----------------------------------------------------------------------
    api_host: str = Field("127.0.0.1", description="address the REST control API binds")
    api_port: int = Field(8000, ge=0, le=65535, description="port of the REST control API (0: any)")
    api_url: str | None = Field(None, description="where clients and services reach the API "
                                "(default http://<api_host>:<api_port>)")
    api_token: str | None = Field(None, description="bearer token every mutating route requires")
    dev_mode: bool = Field(False, description="allow running the API without a token (local use)")
    max_body_bytes: int = Field(16 << 20, gt=0, description="largest JSON request body accepted")
    max_guidance_body_bytes: int = Field(256 << 20, gt=0,
                                         description="largest guidance record upload accepted")

    # --- services' liveness and the sampler/learner engines ------------------------------------
    service_heartbeat_s: float = Field(2.0, gt=0, description="period of a service's heartbeat")
    service_heartbeat_ttl_s: float = Field(10.0, gt=0,
                                           description="a heartbeat older than this means down")
    sampler_name: str = Field(default_factory=_default_consumer, description="this sampler")
    sampler_path: str = Field("nvfp4_minite", description="execution path the sampler runs")
    sampler_device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                                description="device of the embedded sampler engine")
    sampler_engine: str = Field("torch", pattern=r"^(torch|sglang)$",
                                description="sampler engine: the embedded torch one or an SGLang "
                                "server over HTTP")
    sglang_url: str | None = Field(None, description="base URL of the SGLang server to drive")
    sglang_model_dir: Path | None = Field(None, description="the server's base checkpoint "
                                          "(config, tokenizer) that exports are completed from")
    sglang_export_dir: Path | None = Field(None, description="where ModelOpt NVFP4 exports for "
                                           "SGLang are written (default <store>/sglang)")
    sglang_preset: str = Field("modelopt", description="numerics preset of the SGLang export")
    sglang_eos_id: int | None = Field(None, ge=0, description="stop token id for SGLang sampling")
    sglang_load_format: str | None = Field(None, description="load_format of "
                                           "/update_weights_from_disk (None: the server's)")
    learner_path: str = Field("bf16", description="execution path the learner runs")
    learner_device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                                description="device of the embedded learner engine")
    guidance_bits: int = Field(1, ge=1, le=4, description="bits a value kept in guidance records")
    guidance_last_layers: int | None = Field(None, ge=1,
                                             description="record only the last N MoE layers")
    discrepancy_window_tokens: int = Field(
        65_536, gt=0, description="tokens the status and metrics discrepancy statistics cover")

    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve /metrics (0: any)")
    metrics_addr: str = Field("0.0.0.0", description="address the metrics server binds")

    test_step_delay_s: float = Field(
        0.0, ge=0, description="test hook: sleep after each durable step of a conversion "
        "and after a sampler moves a version to loading")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        """Refuse a preset name libalign.spec does not define."""
        if v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {sorted(PRESETS)}")
        return v

    @property
    def resolved_api_url(self) -> str:
        """The API's base URL as clients should use it."""
        if self.api_url:
            return self.api_url.rstrip("/")
        host = "127.0.0.1" if self.api_host in ("0.0.0.0", "::") else self.api_host
        return f"http://{host}:{self.api_port}"

    @model_validator(mode="after")
    def _heartbeat_below_claim(self) -> Settings:
        """A busy consumer must refresh its message before others may reclaim it."""
        if self.heartbeat_ms * 2 > self.claim_idle_ms:
            raise ValueError(f"heartbeat_ms={self.heartbeat_ms} must be at most half of "
                             f"claim_idle_ms={self.claim_idle_ms}")
        return self
