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
from pathlib import Path

import uvicorn
from alignclient.errors import ConfigError

from alignd.api.app import create_app
from alignd.api.server import build_server
from alignd.converter.main import run_converter
from alignd.infra.redis_clients import embedded_name
from alignd.infra.settings import AllInOneSettings, ApiSettings
from alignd.infra.telemetry import Metrics
from alignd.sampler.engine import SamplerEngine
from alignd.sampler.main import run_sampler

#: Seconds the API gets to bind its port before the caller goes on without it.
API_START_S = 10.0
#: Seconds the service threads get to stop once told to.
STOP_S = 60.0


class ThreadsLeftRunningError(RuntimeError):
    """Threads a run started were still running when it ended (named in the message)."""


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` in all for ``threads``; ThreadsLeftRunningError naming those
    still alive after it."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise ThreadsLeftRunningError(f"thread(s) {', '.join(alive)} still running "
                                      f"{timeout_s:g} s after they were told to stop")


#: (Redis URL or embedded name, key prefix) -> (store directory, how many ServiceThreads use it)
_namespaces: dict[tuple[str, str], tuple[Path, int]] = {}
_namespaces_lock = threading.Lock()


def _claim(settings: AllInOneSettings) -> tuple[str, str]:
    """Take the settings' Redis namespace for their store; ConfigError if another
    :class:`ServiceThreads` of this process serves another store in it."""
    key = (embedded_name(settings.redis_url) or settings.redis_url or "", settings.key_prefix)
    store = Path(settings.store_dir).resolve()
    with _namespaces_lock:
        held, users = _namespaces.get(key, (store, 0))
        if held != store:
            where = f"embedded Redis {key[0]!r}" if embedded_name(settings.redis_url) else \
                "this Redis"
            raise ConfigError(
                f"key prefix {key[1]!r} on the {where} already serves the weight store {held} "
                f"in this process; a second run with store {store} would take its events and "
                "versions: give it its own namespace (alignd.infra.redis_clients.run_namespace, "
                "ALIGN_REDIS_URL=embedded://NAME or another ALIGN_KEY_PREFIX)")
        _namespaces[key] = (store, users + 1)
    return key


def _release(key: tuple[str, str]) -> None:
    with _namespaces_lock:
        store, users = _namespaces[key]
        if users > 1:
            _namespaces[key] = (store, users - 1)
        else:
            del _namespaces[key]


class ServiceThreads:
    """The converter and a sampler (serving with ``engine``) as daemon threads, until closed.

    Two instances in one process that share a Redis namespace (URL or embedded server, and
    key prefix) must share the weight store too: they are then one deployment with two
    converters and two samplers. One on another store is refused (ConfigError), never
    cross-wired: give each run its own namespace with
    :func:`~alignd.infra.redis_clients.run_namespace`.
    """

    def __init__(self, settings: AllInOneSettings, engine: SamplerEngine, *, rollouts,
                 guidance=None, metrics: Metrics | None = None,
                 stop: threading.Event | None = None):
        self.stop = stop if stop is not None else threading.Event()
        self._key = _claim(settings)
        self.threads = [
            threading.Thread(target=run_converter, args=(settings, self.stop),
                             kwargs=dict(metrics=metrics), name="converter", daemon=True),
            threading.Thread(target=run_sampler, args=(settings, engine, self.stop),
                             kwargs=dict(rollouts=rollouts, guidance=guidance, metrics=metrics),
                             name="sampler", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def close(self, timeout_s: float = STOP_S) -> None:
        """Stop the threads and wait for them (ThreadsLeftRunningError if they outlive
        ``timeout_s``); the namespace is released either way."""
        self.stop.set()
        try:
            join_all(self.threads, timeout_s)
        finally:
            if self._key is not None:
                _release(self._key)
                self._key = None

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
                join_all([self.thread], STOP_S)
