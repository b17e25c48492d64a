"""What every service's ``main()`` does first: logging, settings from the environment, signals.

A service process logs to stderr, reads :class:`~alignd.infra.settings.Settings` from its
``ALIGN_*`` variables (a bad value is logged and the process exits 2, before anything
starts), and turns SIGTERM and SIGINT into a :class:`threading.Event` its loop watches, so it
finishes the work in hand and stops cleanly.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from pydantic import ValidationError

from alignd.infra.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def start_service(log: logging.Logger) -> tuple[Settings, threading.Event] | None:
    """``(settings, stop)`` for a service process, or None after logging bad settings."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    try:
        settings = Settings()
    except ValidationError as e:
        log.error("bad settings: %s", e)
        return None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return settings, stop
