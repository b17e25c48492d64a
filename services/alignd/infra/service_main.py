"""What every service process does around its loop: logging, its settings, signals, exit status.

A service's ``main()`` is one call, ``run_service(log, ConverterSettings, run)``:

1. log lines go to stderr (from ``INFO``, then from the settings' ``log_level``);
2. the service's settings class is read from its ``ALIGN_*`` variables; a bad value is logged
   and the process exits 2, before anything starts; so does a Redis server the start-up check
   (:func:`check_redis`) refuses: one that may evict keys, bad credentials, missing permissions;
3. SIGTERM and SIGINT set a :class:`threading.Event` that ``run`` watches, so the service
   stops taking work and stops cleanly; one that is still running ``shutdown_timeout_s``
   after the signal (a load, a generation or a checksum pass that cannot stop half-way) is
   ended by :func:`exit_after_stop` with status :data:`EXIT_CUT_OFF`, its work left for
   another instance to take over (a message not acknowledged is reclaimed);
4. ``run(settings, stop)`` builds the service and runs it; it returns the exit status (None
   means 0), and an :class:`~alignclient.errors.AlignError` escaping it is logged and exits 1
   (a :class:`~alignclient.errors.ConfigError`, such as credentials Redis refuses mid-run,
   exits 2, as at start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis
from alignclient.errors import AlignError, BusUnavailableError, ConfigError
from alignclient.retry import RetryPolicy
from pydantic import ValidationError

from alignd.infra.bus import RedisBus
from alignd.infra.redis_checks import check_server
from alignd.infra.redis_clients import text_client
from alignd.infra.settings import ServiceSettings
from libalign.kernels import config as kernel_config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

S = TypeVar("S", bound=ServiceSettings)

#: Exit status of a service cut off ``shutdown_timeout_s`` after the signal to stop.
EXIT_CUT_OFF = 3


def stop_on_signals(*, ignore: bool = False) -> threading.Event:
    """An event SIGTERM and SIGINT set (``ignore``: both are ignored and it is never set)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if ignore else (lambda *_: stop.set()))
    return stop


@contextlib.contextmanager
def exit_after_stop(stop: threading.Event, timeout_s: float, log: logging.Logger,
                    exit_fn: Callable[[int], None] = os._exit) -> Iterator[threading.Thread]:
    """While the block runs, a thread that, ``timeout_s`` after ``stop`` is set, logs that the
    service did not stop in time and ends the process (``exit_fn(EXIT_CUT_OFF)``, no clean-up:
    what it was doing stays unacknowledged, for another instance). Leaving the block ends
    the thread (a service that stopped in time never hears from it)."""
    done = threading.Event()

    def watch() -> None:
        stop.wait()
        t0 = time.monotonic()
        if done.wait(timeout_s):
            return
        log.error("still running %.1f s after the signal to stop (shutdown_timeout_s): exiting "
                  "with the work in hand left for another instance", time.monotonic() - t0)
        for handler in logging.getLogger().handlers:
            handler.flush()
        exit_fn(EXIT_CUT_OFF)

    thread = threading.Thread(target=watch, daemon=True, name="shutdown-deadline")
    thread.start()
    try:
        yield thread
    finally:
        done.set()
        stop.set()
        thread.join()


def check_redis(log: logging.Logger, settings: ServiceSettings) -> bool:
    """Whether the settings' Redis passes the start-up check (:func:`alignd.infra.redis_checks.
    check_server`; an embedded server always does); a refusal is logged as a configuration
    error naming the fix. Connection errors are retried for ``redis_retry_s``."""
    if settings.redis_url is None:
        return True
    client = text_client(settings)
    bus = RedisBus(client, retry=RetryPolicy(deadline_s=settings.redis_retry_s))
    try:
        bus.call("Redis start-up check", lambda: check_server(
            client, key_prefix=settings.key_prefix,
            allow_unverified=settings.redis_allow_unverified_policy))
        return True
    except ConfigError as e:
        log.error("configuration error: %s", e)
    except (BusUnavailableError, redis.exceptions.RedisError) as e:
        log.error("Redis start-up check failed: %s", e)
    finally:
        client.close()
    return False


def load_settings(log: logging.Logger, settings_cls: type[S]) -> S | None:
    """Logging set up and ``settings_cls`` read from the environment; None (logged as 'bad
    settings', naming each field) when they do not validate, or when their Redis fails the
    start-up check (:func:`check_redis`)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    try:
        settings = settings_cls()
    except ValidationError as e:
        log.error("bad settings: %s", e)
        return None
    logging.getLogger().setLevel(settings.log_level)
    return settings if check_redis(log, settings) else None


def run_service(log: logging.Logger, settings_cls: type[S],
                run: Callable[[S, threading.Event], int | None]) -> int:
    """The exit status of a service process whose settings are ``settings_cls`` (see module doc)."""
    settings = load_settings(log, settings_cls)
    if settings is None:
        return 2
    try:  # the kernels' configuration, read from the environment once, here at the edge
        kernel_config.configure(kernel_config.from_env())
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    stop = stop_on_signals()
    with exit_after_stop(stop, settings.shutdown_timeout_s, log):
        try:
            return run(settings, stop) or 0
        except ConfigError as e:  # e.g. credentials Redis refuses mid-run
            log.error("configuration error: %s", e)
            return 2
        except AlignError as e:
            log.error("stopped: %s", e)
            return 1
