"""Wire schemas of the events on the Redis streams.

A stream entry is a flat map of strings, so each event is a small pydantic model that
turns into such a map (:meth:`Event.to_fields`) and is parsed back with validation
(:meth:`Event.from_fields`); a malformed entry raises :class:`EventError` rather than a
``KeyError`` deep inside a handler. Events carry ids and paths, never tensor bytes:
weights live in the weight store directory.

Version ids follow the contract's id rule (:mod:`alignclient.ids`): they become
directory names and Redis key parts.

Streams: every stream is named under the key prefix, ``<key_prefix>:events:<name>``
(:func:`event_stream`), so two daemons with different prefixes share a Redis without taking
each other's events (their consumer groups live on their own streams). ``published`` and
``converted`` events travel on the streams that settings name (by default
``event_stream(key_prefix, "published")`` and ``"converted"``); ``sync`` requests (the
control API asks samplers to load a version) travel on :func:`sync_stream` of the key prefix,
``<key_prefix>:events:sync`` (:data:`SYNC_STREAM` with the default prefix); rollout work
travels on the streams of :mod:`alignd.infra.work`. Each sampler reads ``converted`` in a
group of its own (:func:`sampler_group`).
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar

from alignclient.errors import EventError
from alignclient.ids import check_version_id
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

#: The key prefix a daemon uses unless ``ALIGN_KEY_PREFIX`` says otherwise.
DEFAULT_KEY_PREFIX = "libalign"


def event_stream(key_prefix: str, name: str) -> str:
    """Name of the event stream ``name`` under a key prefix: ``<key_prefix>:events:<name>``."""
    return f"{key_prefix}:events:{name}"


#: Consumer groups named with this prefix belong to one sampler instance each
#: (:func:`sampler_group`); the retention pass destroys one once its sampler is gone.
SAMPLER_GROUP_PREFIX = "sampler-"


def sampler_group(sampler_name: str) -> str:
    """The consumer group of one sampler on the converted stream (every sampler sees every
    converted version): ``sampler-<name>``. A sampler restarted under the same name
    (``ALIGN_SAMPLER_NAME``) reuses it; one under a new name (the default, host and pid)
    leaves the old group behind for retention to destroy."""
    return f"{SAMPLER_GROUP_PREFIX}{sampler_name}"


#: The stream of sync requests under the default key prefix ``libalign``.
SYNC_STREAM = event_stream(DEFAULT_KEY_PREFIX, "sync")


def sync_stream(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """Name of the sync-request stream for a key prefix (``SYNC_STREAM`` for the default)."""
    return event_stream(key_prefix, "sync")


VersionId = Annotated[str, AfterValidator(check_version_id)]


class Event(BaseModel):
    """Base of the stream events: string-map conversion with typed errors."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    kind: ClassVar[str] = "event"

    def to_fields(self) -> dict[str, str]:
        """Flat string map for XADD, with the event kind."""
        d = {k: str(v) for k, v in self.model_dump().items() if v is not None}
        d["event"] = self.kind
        return d

    @classmethod
    def from_fields(cls, fields: dict[str, str]):
        """Parse a stream entry; raise EventError naming what is wrong."""
        kind = fields.get("event", cls.kind)
        if kind != cls.kind:
            raise EventError(f"expected a {cls.kind!r} event, got {kind!r}")
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                 for err in e.errors())
            raise EventError(f"malformed {cls.kind} event {fields!r}: {problems}") from e


class PublishedEvent(Event):
    """The learner wrote a BF16 version under ``path``; convert it."""

    kind: ClassVar[str] = "published"
    version_id: VersionId
    path: str
    published_at: float = Field(default_factory=time.time)
    #: convert for this execution path's weight spec (``bf16``: store unquantized); None: the
    #: converter's configured preset
    target_path: str | None = None


class ConvertedEvent(Event):
    """An NVFP4 version is complete and verified in the weight store; load it."""

    kind: ClassVar[str] = "converted"
    version_id: VersionId
    path: str
    preset: str
    tensors: int
    stored_bytes: int
    converted_at: float = Field(default_factory=time.time)
    target_path: str | None = None


class SyncEvent(Event):
    """Samplers: load ``version_id`` (already converted) and serve it."""

    kind: ClassVar[str] = "sync"
    version_id: VersionId
    requested_at: float = Field(default_factory=time.time)
