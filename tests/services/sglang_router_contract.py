"""A recorded-contract ``sglang-router``: its worker-list API in front of contract servers.

Replays the routes of sgl-project/sglang's router (``sgl-router/src/server.rs``, the admin
routes ``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers`` answering
``{"urls": [...]}``; newer gateways also ``GET /workers`` answering ``{"workers": [{"url"}]}``),
checked by ``--api-key`` like the servers (Bearer). ``/generate`` goes to the workers in turn
(round robin) and ``/get_model_info``/``/get_server_info``/``/health`` to the first; answers
are the worker's. ``legacy_list=False`` answers ``/list_workers`` with 404 (a gateway that has
only ``/workers``). ``calls`` records ``(method, path, url query)``.
"""

from __future__ import annotations

import itertools

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


class RouterContract:
    """The app and its worker list; ``app`` is what uvicorn serves."""

    def __init__(self, workers: list[str], *, api_key: str | None = None,
                 legacy_list: bool = True):
        self.workers = list(workers)
        self.api_key = api_key
        self.legacy_list = legacy_list
        self.calls: list[tuple[str, str, str | None]] = []
        self._turn = itertools.count()
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def authentication(request: Request, call_next):
            self.calls.append((request.method, request.url.path, request.query_params.get("url")))
            if self.api_key and not request.url.path.startswith("/health") and (
                    request.headers.get("Authorization") != f"Bearer {self.api_key}"):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        @app.get("/list_workers")
        async def list_workers() -> Response:
            if not self.legacy_list:
                return Response(status_code=404)
            return JSONResponse({"urls": self.workers})

        @app.get("/workers")
        async def workers() -> Response:
            return JSONResponse({"workers": [{"url": u, "model_id": "m"} for u in self.workers],
                                 "total": len(self.workers)})

        @app.post("/add_worker")
        async def add_worker(url: str) -> Response:
            if url not in self.workers:
                self.workers.append(url)
            return JSONResponse({"message": f"Successfully added worker: {url}"})

        @app.post("/remove_worker")
        async def remove_worker(url: str) -> Response:
            if url in self.workers:
                self.workers.remove(url)
            return JSONResponse({"message": f"Successfully removed worker: {url}"})

        @app.api_route("/{route:path}", methods=["GET", "POST"])
        async def proxy(route: str, request: Request) -> Response:
            if not self.workers:
                return JSONResponse({"error": "No available workers"}, status_code=503)
            if route == "generate":
                worker = self.workers[next(self._turn) % len(self.workers)]
            else:
                worker = self.workers[0]
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.request(request.method, f"{worker}/{route}",
                                         content=await request.body(), headers={
                                             **headers, "content-type": "application/json"})
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))

        return app
