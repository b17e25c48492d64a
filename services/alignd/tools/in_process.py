"""Services as threads of one process: what ``alignd up`` and ``alignd demo`` run.

On the embedded default (no ``ALIGN_REDIS_URL``) the in-process Redis is shared only by the
threads of one process, so the converter, a sampler and the control API run side by side
here: :class:`ServiceThreads` starts the converter and a sampler loop as daemon threads that
one event stops, :class:`ApiThread` serves the API with uvicorn on a thread (for the status
page and ``/metrics`` while the demo runs). The learner loop stays in the caller's thread.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from alignd.api.app import create_app
from alignd.api.server import build_server
from alignd.converter.main import run_converter
from alignd.infra.settings import AllInOneSettings, ApiSettings
from alignd.infra.telemetry import Metrics
from alignd.sampler.engine import SamplerEngine
from alignd.sampler.main import run_sampler

#: Seconds the API gets to bind its port before the caller goes on without it.
API_START_S = 10.0


class ServiceThreads:
    """The converter and a sampler (serving with ``engine``) as daemon threads, until closed."""

    def __init__(self, settings: AllInOneSettings, engine: SamplerEngine, *, rollouts,
                 guidance=None, metrics: Metrics | None = None,
                 stop: threading.Event | None = None):
        self.stop = stop if stop is not None else threading.Event()
        self.threads = [
            threading.Thread(target=run_converter, args=(settings, self.stop),
                             kwargs=dict(metrics=metrics), name="converter", daemon=True),
            threading.Thread(target=run_sampler, args=(settings, engine, self.stop),
                             kwargs=dict(rollouts=rollouts, guidance=guidance, metrics=metrics),
                             name="sampler", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the threads and wait for them."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)

    def __enter__(self) -> ServiceThreads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ApiThread:
    """The control API for ``settings`` on 127.0.0.1:``api_port``, served from a thread.

    As a context manager it gives the API's base URL, or None when ``enabled`` is False or
    the API could not start (its port taken): the caller goes on without it.
    """

    def __init__(self, settings: ApiSettings, metrics: Metrics | None = None, *,
                 enabled: bool = True):
        self.settings, self.metrics, self.enabled = settings, metrics, enabled
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> str | None:
        if not self.enabled:
            return None
        app = create_app(self.settings, metrics=self.metrics)
        self.server = build_server(app, self.settings, host="127.0.0.1", log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + API_START_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            return None
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
            if self.thread is not None:
                self.thread.join(10)
