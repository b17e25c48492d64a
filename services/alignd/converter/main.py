"""The converter service's top-level loop: ``python -m alignd.converter.main``.

It joins the converter consumer group on the ``published`` stream and, until stopped: takes
over messages that a dead consumer left pending (``XAUTOCLAIM``, on start and then every
half ``claim_idle_ms``), reads new ones (``XREADGROUP``), and hands each to
:class:`~alignd.converter.worker.ConverterWorker`, which acks it when its outcome is
recorded. On start and then every ``sweep_interval_s`` it sweeps the store's hidden
``.tmp-*`` leftovers of killed writers (older than ``sweep_stale_s``, writer gone). Every
``retention_interval_s`` (the first an interval after it starts) it runs the run's retention
pass (:mod:`alignd.infra.retention`: versions no sampler serves retired, old retired ones
pruned with their store directories, old ModelOpt exports pruned, dead stream consumers and
groups removed); a pass that
fails is logged, never fatal, and the next one finishes its work.
Configuration is :class:`~alignd.infra.settings.ConverterSettings` (``ALIGN_*`` variables).
SIGTERM or SIGINT stop it: a conversion in progress is abandoned before its next tensor and
left pending, for the next converter to reclaim and redo (see
:mod:`alignd.converter.worker`), and whatever cannot stop half-way is cut off
``shutdown_timeout_s`` after the signal (:func:`~alignd.infra.service_main.run_service`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from alignclient.errors import BusUnavailableError
from alignclient.ids import safe_id

from alignd.converter.worker import ConverterWorker
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.liveness import ServiceHeartbeat
from alignd.infra.registry import Registry
from alignd.infra.retention import Retention, RetentionReport
from alignd.infra.service_main import run_service
from alignd.infra.settings import ConverterSettings
from alignd.infra.telemetry import Metrics, serve_metrics_for

log = logging.getLogger("alignd.converter")


def run_converter(settings: ConverterSettings, stop_event: threading.Event | None = None,
                  max_messages: int | None = None, *, metrics: Metrics | None = None,
                  on_step: Callable[[str], None] | None = None) -> int:
    """Consume ``published`` events until stopped (or ``max_messages``); return how many.

    ``on_step`` is told each durable step of a conversion (see
    :class:`~alignd.converter.worker.ConverterWorker`).
    """
    stop = stop_event if stop_event is not None else threading.Event()
    metrics = metrics if metrics is not None else Metrics()
    bus = RedisBus.from_settings(settings, stop_event=stop,
                                 on_retry=lambda _what, _e: metrics.redis_retries.inc())
    store = WeightStore(settings.store_dir)
    sweep(store, settings.sweep_stale_s)
    registry = Registry(bus, settings.key_prefix)
    worker = ConverterWorker(settings, bus, registry, store, metrics, on_step=on_step, stop=stop)
    retention = Retention.from_settings(settings, bus, registry, store, metrics,
                                        exports=worker.exports)
    beat = ServiceHeartbeat(bus, "converter", safe_id(settings.consumer_name, "converter"),
                            settings.service_heartbeat_s, settings.service_heartbeat_ttl_s,
                            prefix=settings.key_prefix,
                            info=lambda: {"preset": settings.preset}).start()
    stop_metrics = serve_metrics_for(settings, metrics)
    stream, group, me = settings.published_stream, settings.converter_group, settings.consumer_name
    claim_every_s = settings.claim_idle_ms / 2000
    handled, next_claim = 0, 0.0
    next_sweep = time.monotonic() + settings.sweep_interval_s
    next_retention = time.monotonic() + settings.retention_interval_s
    log.info("converter %s: %s -> %s, preset %s, store %s", me, stream, settings.converted_stream,
             settings.preset, settings.store_dir)
    try:
        bus.ensure_group(stream, group)
        while not stop.is_set() and (max_messages is None or handled < max_messages):
            msgs = []
            now = time.monotonic()
            if now >= next_sweep:  # leftovers of writers killed while we run
                sweep(store, settings.sweep_stale_s)
                next_sweep = now + settings.sweep_interval_s
            if now >= next_retention:  # what no sampler serves any more, dead consumers
                retain(retention)
                next_retention = time.monotonic() + settings.retention_interval_s
            if now >= next_claim:
                msgs = bus.reclaim(stream, group, me, min_idle_ms=settings.claim_idle_ms, limit=1)
                metrics.messages_reclaimed.inc(len(msgs))
                # keep claiming at once while there is a backlog of abandoned messages
                next_claim = now if msgs else now + claim_every_s
            if not msgs:
                wait_ms = max(1, min(settings.block_ms, int((next_claim - now) * 1000)))
                msgs = bus.read(stream, group, me, count=1, block_ms=wait_ms)
            for m in msgs:
                if stop.is_set() or (max_messages is not None and handled >= max_messages):
                    break  # unhandled messages stay pending and are reclaimed later
                outcome = worker.handle(m)
                handled += 1
                log.debug("message %s (%s delivery %d): %s", m.id,
                          "reclaimed" if m.reclaimed else "new", m.deliveries, outcome)
    except BusUnavailableError:
        if not stop.is_set():
            raise
    finally:
        beat.stop()
        stop_metrics()
    return handled


def sweep(store: WeightStore, min_age_s: float) -> list[Path]:
    """Remove the store's ``.tmp-*`` leftovers older than ``min_age_s`` whose writers are gone
    (:meth:`WeightStore.sweep`); a sweep that fails is logged, never fatal."""
    try:
        removed = store.sweep(min_age_s)
    except OSError as e:
        log.warning("sweeping %s failed: %s", store.root, e)
        return []
    if removed:
        log.info("swept %d leftover(s): %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def retain(retention: Retention) -> RetentionReport | None:
    """One retention pass; one that fails is logged, never fatal (Redis unreachable for good
    is: the loop's own next call says so)."""
    try:
        return retention.run()
    except BusUnavailableError:
        raise
    except Exception as e:  # a failing disk, an odd reply: the next pass tries again
        log.warning("retention pass failed: %s", e, exc_info=True)
        return None


def serve(settings: ConverterSettings, stop: threading.Event) -> None:
    """The converter process's work: :func:`run_converter` until ``stop``."""
    run_converter(settings, stop)


def main() -> int:
    """Entry point: settings from the environment, the loop until a signal, exit status."""
    return run_service(log, ConverterSettings, serve)


if __name__ == "__main__":
    sys.exit(main())
