"""Guidance records over HTTP: raw bytes in, raw bytes out, a binary framing for batches.

Uploads are ``application/octet-stream`` bodies read chunk by chunk (the front door
refuses them past ``max_guidance_body_bytes`` while they arrive); the store itself
(:class:`~alignd.infra.stores.guidance.GuidanceStore`) applies its record limit, byte
budget, TTL and leases. A batched fetch answers in the framing of
:mod:`alignclient.framing`.
"""

from __future__ import annotations

from typing import Annotated

from alignclient.errors import InputError
from alignclient.framing import MEDIA_TYPE, iter_frames
from alignclient.models import (
    GuidanceBatchRequest,
    GuidancePutResponse,
    LeaseRequest,
    LeaseResponse,
)
from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from alignd.api.middleware import streamed_body
from alignd.api.state import BEARER, KnownVersion, State, error_responses

router = APIRouter(prefix="/v1/guidance", tags=["guidance"])
ERRORS = error_responses(401, 403, 404, 410, 413, 422, 503, 507)
BINARY = {"content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}


async def read_body(request: Request) -> bytearray:
    """The request's whole body, read chunk by chunk; exactly as long as a Content-Length."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
        return buf
    buf = bytearray(int(declared))  # filled in place: no second copy of a large record
    view, off = memoryview(buf), 0
    async for chunk in request.stream():
        if off + len(chunk) > len(buf):
            raise InputError(f"body is longer than its Content-Length of {len(buf)} bytes")
        view[off : off + len(chunk)] = chunk
        off += len(chunk)
    view.release()
    if off != len(buf):
        raise InputError(f"body ended after {off} of {len(buf)} declared bytes")
    return buf


@router.put("/{version_id}/{rollout_id}", operation_id="put_guidance",
            response_model=GuidancePutResponse, responses=ERRORS, dependencies=BEARER,
            openapi_extra={"requestBody": {"required": True, **BINARY}})
@streamed_body
async def put_guidance(version_id: str, rollout_id: str, request: Request, st: State,
                       _known: KnownVersion) -> GuidancePutResponse:
    """Store one rollout's guidance record (octet-stream body), replacing any previous one."""
    buf = await read_body(request)
    res = await run_in_threadpool(st.guidance.put, version_id, rollout_id, buf)
    return GuidancePutResponse(version_id=version_id, rollout_id=rollout_id, bytes=res.bytes,
                               total_bytes=res.total_bytes,
                               evicted=[e.version for e in res.evicted])


@router.get("/{version_id}/{rollout_id}", operation_id="get_guidance", response_class=Response,
            responses={200: BINARY, **ERRORS})
def get_guidance(version_id: str, rollout_id: str, st: State) -> Response:
    """One rollout's guidance record as octet-stream."""
    return Response(st.guidance.get(version_id, rollout_id), media_type=MEDIA_TYPE)


@router.post("/{version_id}:batch", operation_id="get_guidance_batch", response_class=Response,
             responses={200: BINARY, **ERRORS})
def get_guidance_batch(version_id: str, req: GuidanceBatchRequest,
                       st: State) -> StreamingResponse:
    """Many rollouts' records in one length-prefixed binary body (alignclient.framing)."""
    records = st.guidance.get_many(version_id, req.rollout_ids, missing=req.missing)
    pieces = list(iter_frames(records))
    size = sum(len(p) for p in pieces)
    return StreamingResponse(iter(pieces), media_type=MEDIA_TYPE,
                             headers={"Content-Length": str(size)})


@router.post("/{version_id}/lease", operation_id="acquire_guidance_lease",
             response_model=LeaseResponse, responses=ERRORS, dependencies=BEARER)
def acquire_guidance_lease(version_id: str, req: LeaseRequest,
                           st: State) -> LeaseResponse:
    """Protect a version's guidance from budget eviction for ``ttl_s`` (renewable)."""
    st.guidance.acquire(version_id, req.consumer, req.ttl_s)
    return LeaseResponse(version_id=version_id, consumer=req.consumer, ttl_s=req.ttl_s, held=True)


@router.delete("/{version_id}/lease", operation_id="release_guidance_lease",
               response_model=LeaseResponse, responses=ERRORS, dependencies=BEARER)
def release_guidance_lease(version_id: str, st: State,
                           consumer: Annotated[str, Query(min_length=1)]) -> LeaseResponse:
    """Drop a consumer's lease; ``held`` says whether it still had one."""
    held = st.guidance.release(version_id, consumer)
    return LeaseResponse(version_id=version_id, consumer=consumer, held=held)
