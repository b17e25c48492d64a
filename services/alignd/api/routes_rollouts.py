"""Rollouts (sampler side), scores (learner side) and the discrepancy they measure."""

from __future__ import annotations

from typing import Annotated

from alignclient.errors import InputError
from alignclient.ids import ID_PATTERN, check_rollout_id
from alignclient.models import (
    MAX_BATCH,
    DeltaSummary,
    Discrepancy,
    RolloutBatch,
    RolloutIds,
    RolloutList,
    RolloutPutResponse,
    ScoreBatch,
)
from fastapi import APIRouter, Query

from alignd.api.state import BEARER, KnownVersion, State, error_responses

router = APIRouter(prefix="/v1", tags=["rollouts"])
ERRORS = error_responses(401, 403, 404, 409, 413, 422, 503)
#: Largest discrepancy window one request may ask for.
MAX_WINDOW_TOKENS = 1 << 24

IdsQuery = Annotated[str | None, Query(description="comma-separated rollout ids: return those")]
WindowQuery = Annotated[int | None, Query(ge=1, le=MAX_WINDOW_TOKENS)]
VersionQuery = Annotated[str | None, Query(pattern=ID_PATTERN)]


def rollout_ids(ids: str) -> list[str]:
    """The rollout ids of a comma-separated ``ids`` query, each checked (422 if bad)."""
    wanted = [i for i in ids.split(",") if i]
    if not wanted or len(wanted) > MAX_BATCH:
        raise InputError(f"ids must name 1 to {MAX_BATCH} rollouts, got {len(wanted)}")
    for rollout_id in wanted:
        check_rollout_id(rollout_id)
    return wanted


@router.post("/versions/{version_id}/rollouts", operation_id="put_rollouts",
             response_model=RolloutPutResponse, status_code=201, responses=ERRORS,
             dependencies=BEARER, response_model_exclude_defaults=True)
def put_rollouts(version_id: str, batch: RolloutBatch, st: State,
                 _known: KnownVersion) -> RolloutPutResponse:
    """Store a batch of rollouts of a version, all or none (409 if an id exists or it is stale)."""
    if not st.staleness.admit(version_id, rollouts=len(batch.rollouts)):
        return RolloutPutResponse(version_id=version_id, stored=0, tokens=0,
                                  dropped=len(batch.rollouts))
    tokens = st.rollouts.put_rollouts(version_id, batch.rollouts)
    return RolloutPutResponse(version_id=version_id, stored=len(batch.rollouts), tokens=tokens)


@router.get("/versions/{version_id}/rollouts", operation_id="get_rollouts",
            response_model=RolloutIds | RolloutList, responses=ERRORS)
def get_rollouts(version_id: str, st: State, _known: KnownVersion,
                 ids: IdsQuery = None) -> RolloutIds | RolloutList:
    """The version's rollout ids, or the full rollouts named by ``ids``."""
    if ids is None:
        return RolloutIds(version_id=version_id, rollout_ids=st.rollouts.list_rollout_ids(version_id))
    return RolloutList(version_id=version_id,
                       rollouts=st.rollouts.get_rollouts(version_id, rollout_ids(ids)))


@router.post("/versions/{version_id}/scores", operation_id="put_scores",
             response_model=DeltaSummary, responses=ERRORS, dependencies=BEARER)
def put_scores(version_id: str, batch: ScoreBatch, st: State,
               _known: KnownVersion) -> DeltaSummary:
    """Pair learner log-probs with stored rollouts; the batch's δ statistics."""
    return st.rollouts.put_scores(version_id, batch.scores)


@router.get("/discrepancy", operation_id="get_discrepancy", response_model=Discrepancy,
            responses=ERRORS)
def get_discrepancy(st: State, version: VersionQuery = None,
                    window_tokens: WindowQuery = None) -> Discrepancy:
    """δ statistics over the last ``window_tokens`` scored tokens (of one version or recent ones)."""
    if version is not None:
        st.registry.get(version)  # 404 version_not_found if unknown
    window = window_tokens or st.settings.discrepancy_window_tokens
    return st.rollouts.discrepancy(version, window)
