"""What every service process does around its loop: logging, its settings, signals, exit status.

A service's ``main()`` is one call, ``run_service(log, ConverterSettings, run)``:

1. log lines go to stderr (from ``INFO``, then from the settings' ``log_level``);
2. the service's settings class is read from its ``ALIGN_*`` variables; a bad value is logged
   and the process exits 2, before anything starts;
3. SIGTERM and SIGINT set a :class:`threading.Event` that ``run`` watches, so the service
   finishes the work in hand and stops cleanly;
4. ``run(settings, stop)`` builds the service and runs it; it returns the exit status (None
   means 0), and an :class:`~alignclient.errors.AlignError` escaping it is logged and exits 1.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from alignclient.errors import AlignError
from pydantic import ValidationError

from alignd.infra.settings import ServiceSettings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

S = TypeVar("S", bound=ServiceSettings)


def stop_on_signals(*, ignore: bool = False) -> threading.Event:
    """An event SIGTERM and SIGINT set (``ignore``: both are ignored and it is never set)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if ignore else (lambda *_: stop.set()))
    return stop


def load_settings(log: logging.Logger, settings_cls: type[S]) -> S | None:
    """Logging set up and ``settings_cls`` read from the environment; None (logged as 'bad
    settings', naming each field) when they do not validate."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    try:
        settings = settings_cls()
    except ValidationError as e:
        log.error("bad settings: %s", e)
        return None
    logging.getLogger().setLevel(settings.log_level)
    return settings


def run_service(log: logging.Logger, settings_cls: type[S],
                run: Callable[[S, threading.Event], int | None]) -> int:
    """The exit status of a service process whose settings are ``settings_cls`` (see module doc)."""
    settings = load_settings(log, settings_cls)
    if settings is None:
        return 2
    stop = stop_on_signals()
    try:
        return run(settings, stop) or 0
    except AlignError as e:
        log.error("stopped: %s", e)
        return 1
