"""The numerics spec the daemon runs, so the learner and the samplers can check they agree.

The hash is SHA-256 over the spec's canonical JSON (``NumericsSpec.to_dict()``, sorted
keys, no whitespace); ``alignclient.spec_sha256`` computes the same from a dict.
"""

from __future__ import annotations

from alignclient.errors import SpecMismatchError
from alignclient.models import SpecCheckRequest, SpecCheckResponse, SpecInfo
from fastapi import APIRouter

from alignd.api.state import State, error_responses

router = APIRouter(prefix="/v1", tags=["spec"])


@router.get("/spec", operation_id="get_spec", response_model=SpecInfo)
def get_spec(st: State) -> SpecInfo:
    """The active numerics spec, its SHA-256 and the sampler and learner paths."""
    return SpecInfo(preset=st.settings.preset, spec=st.spec, sha256=st.spec_sha256,
                    sampler_path=st.settings.sampler_path, learner_path=st.settings.learner_path)


@router.post("/spec/check", operation_id="check_spec", response_model=SpecCheckResponse,
             responses=error_responses(409, 422))
def check_spec(req: SpecCheckRequest, st: State) -> SpecCheckResponse:
    """200 if the caller's spec hash matches the daemon's, else 409 spec_mismatch."""
    if req.sha256 != st.spec_sha256:
        raise SpecMismatchError(st.spec_sha256, req.sha256)
    return SpecCheckResponse(match=True, sha256=st.spec_sha256)
