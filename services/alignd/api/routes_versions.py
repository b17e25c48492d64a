"""Weight versions: publish, list, inspect, and ask samplers to load one.

Publishing is atomic: the registry record and the ``published`` event are written by one
Redis transaction. The version key is ``WATCH``\\ ed, then ``MULTI`` queues the registry's
own create script and the ``XADD``, and ``EXEC`` runs both back to back or, if anything
touched the version key in between (a concurrent publish of the same id), neither, and
the call answers 409. A client or connection that dies before ``EXEC`` leaves nothing:
the server drops an unfinished ``MULTI``. Redis does not roll back a queued command that
fails when it runs, so the one way the ``XADD`` could fail then, the stream's key
holding another type, is checked before the transaction (and answered 500
``invalid_config``). So no failure leaves a record without its event or an event
without its record. One ambiguity remains, as with any remote write: if the reply to a
successful ``EXEC`` is lost and the call is retried, the retry finds the version already
there.

Publishing is therefore idempotent on the directory: the version's record keeps the published
directory's identity (:func:`alignd.formats.published.publish_id`, written into its index when
the directory was made; kept in the record's meta, left out of the version's wire form), and a
publish of an existing id whose directory is still that same directory, with the same
``target_path``, answers 200 with the version it made (``event_id`` None: nothing is announced
twice). A publish of an existing id from another directory (the
version was published from other weights, or its directory was removed and written again)
answers 409 ``version_exists``; so does one from a directory without an identity.

Listing is paged and costs the page, not the history: ``GET /v1/versions?limit=&before=``
answers the newest ``limit`` versions created before version ``before`` and the next page's
cursor, ``next_before``.

A ``failed`` version is retried (``POST /v1/versions/{id}:retry``) the same way: the move
``failed -> published`` and a new ``published`` event in one transaction, 409 for a version in
any other state.
"""

from __future__ import annotations

from typing import Annotated

from alignclient.errors import StateTransitionError, VersionNotFoundError
from alignclient.ids import ID_PATTERN
from alignclient.models import (
    HistoryEntry,
    PublishRequest,
    PublishResponse,
    SyncRequest,
    SyncResponse,
    VersionDetail,
    VersionInfo,
    VersionList,
)
from fastapi import APIRouter, Query, Response

from alignd.api.state import BEARER, KnownVersion, State, error_responses
from alignd.formats.hf_checkpoint import HFCheckpoint
from alignd.formats.published import PUBLISH_ID_KEY
from alignd.formats.weight_store import WeightStore
from alignd.infra.events import SyncEvent, sync_stream
from alignd.infra.registry import STATES, VersionRecord
from alignd.sync.announce import announce_published, announce_retry

router = APIRouter(prefix="/v1", tags=["versions"])
ERRORS = error_responses(401, 403, 404, 409, 413, 422, 503)
STATE_PATTERN = f"^({'|'.join(STATES)})$"
#: States from which samplers may load a version.
SYNCABLE = ("converted", "loading", "serving")


def version_info(rec: VersionRecord) -> VersionInfo:
    """The wire form of a registry record (its meta as the publisher gave it: without the
    published directory's identity, which the registry keeps for repeated publishes)."""
    meta = {k: v for k, v in rec.meta.items() if k != PUBLISH_ID_KEY}
    return VersionInfo(version_id=rec.version_id, state=rec.state, path=rec.path,
                       reason=rec.reason, owner=rec.owner, created_at=rec.created_at,
                       updated_at=rec.updated_at, meta=meta)


@router.post("/versions", operation_id="publish_version", response_model=PublishResponse,
             status_code=201, responses=ERRORS, dependencies=BEARER)
def publish_version(req: PublishRequest, st: State, response: Response) -> PublishResponse:
    """Register a BF16 version already written to the published store and announce it."""
    path = WeightStore(st.settings.store_dir).published_path(req.version_id)
    if not path.is_dir():
        raise VersionNotFoundError(req.version_id, f"published store ({path})")
    HFCheckpoint(path).check_shards()  # LayoutError / MissingShardError: 422
    rec, _, event_id = announce_published(st.registry, st.settings.published_stream, path,
                                          req.version_id, target_path=req.target_path,
                                          meta=dict(req.meta), actor="api")
    if event_id is None:
        response.status_code = 200  # the same directory again: the version it already made
    return PublishResponse(version=version_info(rec), stream=st.settings.published_stream,
                           event_id=event_id)


@router.post("/versions/{version_id}:retry", operation_id="retry_version",
             response_model=PublishResponse, status_code=202, responses=ERRORS,
             dependencies=BEARER)
def retry_version(version_id: str, st: State) -> PublishResponse:
    """Move a failed version back to published and announce it again, for the converter."""
    rec, _, event_id = announce_retry(st.registry, st.settings.published_stream, version_id,
                                      actor="api")
    return PublishResponse(version=version_info(rec), stream=st.settings.published_stream,
                           event_id=event_id)


@router.get("/versions", operation_id="list_versions", response_model=VersionList,
            responses=ERRORS)
def list_versions(st: State,
                  state: Annotated[str | None, Query(pattern=STATE_PATTERN)] = None,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
                  before: Annotated[str | None, Query(pattern=ID_PATTERN)] = None) -> VersionList:
    """A page of versions, oldest first: the newest ``limit`` created before ``before``."""
    page = st.registry.page(limit, before=before, state=state)
    return VersionList(versions=[version_info(r) for r in page.records],
                       next_before=page.next_before)


@router.get("/versions/{version_id}", operation_id="get_version", response_model=VersionDetail,
            responses=ERRORS)
def get_version(version_id: str, st: State, rec: KnownVersion) -> VersionDetail:
    """One version's record and its state history."""
    hist = [HistoryEntry(from_state=h.from_state, to_state=h.to_state, at=h.at, reason=h.reason,
                         actor=h.actor) for h in st.registry.history(version_id)]
    return VersionDetail(version=version_info(rec), history=hist)


@router.post("/sync", operation_id="sync_version", response_model=SyncResponse, status_code=202,
             responses=ERRORS, dependencies=BEARER)
def sync_version(req: SyncRequest, st: State) -> SyncResponse:
    """Ask the samplers to load a converted version (a ``sync`` event)."""
    rec = st.registry.get(req.version_id)
    if rec.state not in SYNCABLE:
        raise StateTransitionError(req.version_id, rec.state, "loading",
                                   "samplers load only a converted version")
    event = SyncEvent(version_id=req.version_id)
    stream = sync_stream(st.settings.key_prefix)
    event_id = st.bus.publish(stream, event.to_fields())
    return SyncResponse(version_id=req.version_id, state=rec.state, stream=stream,
                        event_id=event_id, requested_at=event.requested_at)
