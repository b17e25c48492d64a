"""The sampler service: ``python -m alignd.sampler.main`` (or ``alignd serve sampler``).

Built from :class:`~alignd.infra.settings.SamplerSettings`: the engine
(``ALIGN_SAMPLER_ENGINE``: the embedded torch one, :mod:`alignd.sampler.embedded`, or an SGLang
server, :mod:`alignd.sampler.sglang_sampler`) with its rollout and guidance stores, then a
:class:`~alignd.sampler.service.SamplerService` polled until SIGTERM or SIGINT, beating as
service ``sampler`` and serving ``/metrics`` when ``ALIGN_METRICS_PORT`` is set. On a signal
it takes no new work; a load or a generation in progress is cut off after
``ALIGN_SHUTDOWN_TIMEOUT_S`` (:func:`~alignd.infra.service_main.run_service`), its request
left pending for another sampler to reclaim.
"""

from __future__ import annotations

import logging
import sys
import threading

from alignclient.errors import BusUnavailableError

from alignd.infra.bus import RedisBus
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.service_main import run_service
from alignd.infra.settings import SamplerSettings
from alignd.infra.telemetry import Metrics, serve_metrics_for
from alignd.sampler.embedded import build_sampler
from alignd.sampler.engine import SamplerEngine
from alignd.sampler.service import SamplerService
from alignd.sampler.sglang_sampler import build_sglang_sampler

log = logging.getLogger("alignd.sampler")


def run_sampler(settings: SamplerSettings, engine: SamplerEngine, stop: threading.Event, *,
                rollouts, guidance=None, metrics: Metrics | None = None,
                bus: RedisBus | None = None) -> None:
    """Serve with ``engine`` until ``stop`` is set."""
    bus = bus or RedisBus.from_settings(settings, stop_event=stop)
    svc = SamplerService(settings, engine, bus, rollouts=rollouts, guidance=guidance,
                         metrics=metrics, stop=stop)
    svc.heartbeat = ServiceHeartbeat(bus, "sampler", settings.sampler_name,
                                     settings.service_heartbeat_s, settings.service_heartbeat_ttl_s,
                                     info=lambda: {"path": engine.path},
                                     prefix=settings.key_prefix).start()
    stop_metrics = serve_metrics_for(settings, svc.metrics)
    try:
        svc.setup()
        while not stop.is_set():
            svc.step()
    except BusUnavailableError:
        if not stop.is_set():
            raise
    finally:
        svc.heartbeat.stop()
        stop_metrics()


def serve(settings: SamplerSettings, stop: threading.Event) -> None:
    """The sampler process's work: its engine and stores from ``settings``, served until ``stop``."""
    metrics = Metrics()
    build = build_sglang_sampler if settings.sampler_engine == "sglang" else build_sampler
    engine, rollouts, guidance = build(settings, metrics=metrics)
    run_sampler(settings, engine, stop, rollouts=rollouts, guidance=guidance, metrics=metrics)


def main() -> int:  # pragma: no cover - exercised by the integration test as a process
    """Entry point: settings from the environment, the loop until a signal, exit status."""
    return run_service(log, SamplerSettings, serve)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
