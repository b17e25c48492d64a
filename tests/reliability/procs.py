"""Process bodies the fault tests fork (through a ``forkserver`` that preloads this module,
so a converter process starts in milliseconds and can be SIGKILLed twenty times a test)."""

from __future__ import annotations

import logging

import torch
from alignd.converter.main import run_converter
from alignd.infra.settings import ConverterSettings

from tests.services.slow_services import sleeper


def converter_process(settings_kw: dict, log_path: str, step_delay_s: float = 0.0) -> None:
    """``run_converter`` forever with these settings, logging to ``log_path``, sleeping
    ``step_delay_s`` after each durable step of a conversion."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format=f"%(asctime)s {settings_kw['consumer_name']} %(levelname)s "
                               "%(name)s: %(message)s")
    torch.set_num_threads(1)
    run_converter(ConverterSettings(**settings_kw), on_step=sleeper(step_delay_s))
