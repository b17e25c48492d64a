"""Service processes slowed down where a fault test needs time to strike.

``python -m tests.services.slow_services converter DELAY_S``: the converter service, sleeping
``DELAY_S`` after each durable step of a conversion (a shard, the manifest, the commit), so a
test can kill it between two of them. ``python -m tests.services.slow_services sampler
DELAY_S``: the embedded sampler service whose every load takes ``DELAY_S`` longer, after the
registry moved the version to ``loading``. Both read their settings from ``ALIGN_*`` variables
like the real services and exit the same way (:func:`alignd.infra.service_main.run_service`).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable

from alignd.converter.main import run_converter
from alignd.infra.service_main import run_service
from alignd.infra.settings import ConverterSettings, SamplerSettings
from alignd.infra.telemetry import Metrics

log = logging.getLogger("tests.slow_services")


def sleeper(delay_s: float) -> Callable[[str], None]:
    """An ``on_step`` that sleeps ``delay_s`` after every step."""
    return lambda _label: time.sleep(delay_s)


def slowed(fn: Callable, delay_s: float) -> Callable:
    """``fn`` that first sleeps ``delay_s``."""
    @functools.wraps(fn)
    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return fn(*args, **kwargs)
    return slow


def converter(delay_s: float) -> int:
    """The converter service, ``delay_s`` slower per durable step."""
    def run(settings: ConverterSettings, stop: threading.Event) -> None:
        run_converter(settings, stop, on_step=sleeper(delay_s))
    return run_service(log, ConverterSettings, run)


def sampler(delay_s: float) -> int:
    """The embedded sampler service, ``delay_s`` slower per load."""
    # imported here: the sampler needs transformers, the converter process starts without it
    from alignd.sampler.embedded import build_sampler
    from alignd.sampler.main import run_sampler

    def run(settings: SamplerSettings, stop: threading.Event) -> None:
        metrics = Metrics()
        engine, rollouts, guidance = build_sampler(settings, metrics=metrics)
        engine.load = slowed(engine.load, delay_s)
        run_sampler(settings, engine, stop, rollouts=rollouts, guidance=guidance, metrics=metrics)
    return run_service(log, SamplerSettings, run)


if __name__ == "__main__":
    service, delay = sys.argv[1], float(sys.argv[2])
    sys.exit({"converter": converter, "sampler": sampler}[service](delay))
