"""Announcing a version: the registry record and the event, built in one place.

Every way a version enters the daemon ends here. A BF16 version for the converter is
*published*: its directory is registered and a ``published`` event goes to the converter's
stream in one Redis transaction (:func:`announce_published`). An NVFP4 version made by the
converter, or by the learner itself, is *converted*: a ``converted`` event, built by
:func:`converted_event` from the store's manifest, tells the samplers to load it
(:func:`announce_converted` walks the registry through the converter's states first, for a
version no converter touched).

A published directory has an identity (``publish_id`` in its index, see
:mod:`alignd.formats.published`): registering the same directory again answers the version it
already made, with no second event, so a publish whose answer was lost may be sent again.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from alignclient.errors import VersionExistsError

from alignd.formats.manifest import Manifest
from alignd.formats.published import PUBLISH_ID_KEY, publish_id
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.events import ConvertedEvent, PublishedEvent
from alignd.infra.registry import Registry, VersionRecord


class Announced(NamedTuple):
    """What :func:`announce_published` did: the record, the event, and the event's stream id
    (None when the same directory was registered before and nothing new was announced)."""

    record: VersionRecord
    event: PublishedEvent
    event_id: str | None


def announce_published(registry: Registry, stream: str, path: Path, version_id: str, *,
                       target_path: str | None = None, meta: dict[str, str] | None = None,
                       actor: str = "learner") -> Announced:
    """Register the published directory ``path`` as ``version_id`` and put its ``published``
    event on ``stream`` (one transaction).

    The same directory registered again (same identity, path and target) answers the existing
    record and no new event, unless that version failed (then, as for any other registration of
    a taken id, VersionExistsError: a failed version is retried, ``POST .../{id}:retry``).
    """
    identity = publish_id(path)
    event = PublishedEvent(version_id=version_id, path=str(path), target_path=target_path)
    meta = dict(meta or {})
    if target_path:
        meta.setdefault("target_path", target_path)
    if identity is not None:
        meta[PUBLISH_ID_KEY] = identity
    try:
        rec, event_id = registry.create_and_announce(version_id, str(path), stream,
                                                     event.to_fields(), actor=actor,
                                                     meta=meta or None)
    except VersionExistsError:
        rec = registry.get(version_id)
        if (identity is None or rec.meta.get(PUBLISH_ID_KEY) != identity or rec.path != str(path)
                or rec.meta.get("target_path") != meta.get("target_path")
                or rec.state == "failed"):  # a failed version is retried, not re-published
            raise
        return Announced(rec, event, None)
    return Announced(rec, event, event_id)


def announce_retry(registry: Registry, stream: str, version_id: str, *,
                   actor: str = "api") -> Announced:
    """Move the failed ``version_id`` back to ``published`` and put a new ``published`` event on
    ``stream`` (one transaction), for the converter to take it again; a version that is not
    ``failed`` is refused (StateTransitionError)."""
    rec = registry.get(version_id)
    event = PublishedEvent(version_id=version_id, path=rec.path,
                           target_path=rec.meta.get("target_path"))
    rec, event_id = registry.retry_and_announce(
        version_id, stream, event.to_fields(), actor=actor,
        reason=f"retried by an operator (was: {rec.reason})")
    return Announced(rec, event, event_id)


def converted_event(store: WeightStore, version_id: str, preset: str, *,
                    manifest: Manifest | None = None,
                    target_path: str | None = None) -> ConvertedEvent:
    """The ``converted`` event of a committed store version (its manifest read if not given)."""
    manifest = manifest if manifest is not None else store.read_manifest(version_id)
    return ConvertedEvent(version_id=version_id, path=str(store.version_path(version_id)),
                          preset=preset, tensors=manifest.totals.tensors,
                          stored_bytes=manifest.totals.stored_bytes,
                          target_path=target_path)


def announce_converted(registry: Registry, bus: RedisBus, stream: str, store: WeightStore,
                       version_id: str, preset: str, *, target_path: str | None = None,
                       actor: str = "learner") -> Manifest:
    """Register a version the learner converted itself and tell the samplers to load it.

    The registry walks the usual states (``published`` -> ``converting`` -> ``converted``, each
    with its time, so stage timings read the same as for the converter service), then a
    ``converted`` event goes to ``stream``. Nothing reaches the converter's stream: there is
    nothing left to convert. The version must already be committed (checksums verified here).
    ``preset`` names the spec it was converted with, as the converter's events do. Returns the
    verified manifest.
    """
    manifest = store.verify_version(version_id)
    registry.create(version_id, str(store.version_path(version_id)), actor=actor,
                    meta={"target_path": target_path, "parts": manifest.num_parts or 1})
    registry.transition(version_id, "converting", actor=actor)
    registry.transition(version_id, "converted", actor=actor, expect_owner=actor)
    bus.publish(stream, converted_event(store, version_id, preset, manifest=manifest,
                                        target_path=target_path).to_fields())
    return manifest


class RefitStages:
    """The registry states of a version refit from tensors (:mod:`alignd.sync.refit`), walked as
    for a converter-made version, so staleness and ``libalign_sync_stage_seconds`` read the
    same: ``published`` and ``converting`` when the refit starts (:meth:`begin`), ``converted``
    and ``loading`` once every bucket is quantized and packed (:meth:`produced`), ``serving``
    once the server confirmed the last (:meth:`serving`), ``failed`` with the reason otherwise
    (:meth:`failed`); the ``convert`` stage is then the conversion, ``load`` the transfer of
    what was left and the server's load. The record's path is
    ``refit:<transport>``: no store directory holds the version."""

    def __init__(self, registry: Registry, version_id: str, transport: str, *,
                 actor: str = "learner", meta: dict[str, str] | None = None):
        self.registry, self.version_id, self.actor = registry, version_id, actor
        self.transport, self.meta = transport, dict(meta or {})

    @property
    def path(self) -> str:
        """The record's path."""
        return f"refit:{self.transport}"

    def begin(self) -> None:
        """Register the version and mark it converting (VersionExistsError if the id is taken)."""
        self.registry.create(self.version_id, self.path, actor=self.actor,
                             meta={"transport": self.transport, **self.meta})
        self.registry.transition(self.version_id, "converting", actor=self.actor)

    def produced(self) -> None:
        """Every bucket quantized and packed (the last still on its way): ``converted``, then
        ``loading``."""
        for state in ("converted", "loading"):
            self.registry.transition(self.version_id, state, actor=self.actor)

    def serving(self) -> None:
        """The server confirmed the last bucket: ``serving``."""
        self.registry.transition(self.version_id, "serving", actor=self.actor)

    def failed(self, reason: str) -> None:
        """Mark the version failed with ``reason`` (a version never begun is left alone)."""
        self.registry.transition(self.version_id, "failed", actor=self.actor,
                                 reason=reason or "refit failed")
