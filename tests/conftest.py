"""Suite-wide pytest configuration: GPU tests are skipped without CUDA; the tests that wait for
a background job (tests/background.py) run last, and their jobs start once they are collected."""

import pytest
import torch

from libalign.kernels import config as kernel_config
from tests import background


def pytest_collection_modifyitems(config, items):
    waiting = [item for item in items if background.waits(item.nodeid)]
    items[:] = [item for item in items if not background.waits(item.nodeid)] + waiting
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        background.start_for(item.nodeid for item in session.items)


def pytest_unconfigure(config):
    background.stop()


@pytest.fixture(scope="module")
def one_thread():
    """One torch CPU thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny matrices gain nothing from threads, and spinning OpenMP workers crawl on shared cores."""
    from libalign.models.train import cpu_threads

    with cpu_threads(1):
        yield


@pytest.fixture(scope="module")
def megatron_world():
    """One ``gloo`` process and Megatron's model-parallel state for a module, reusing the state
    a sibling module left open (Megatron keeps it process-wide)."""
    from megatron.core import parallel_state

    from libalign.models.megatron_cpu import single_process_group

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with single_process_group("gloo"):
        yield


@pytest.fixture(autouse=True)
def _kernel_config_read_again():
    """After each test, libalign's kernel configuration is read from the (restored)
    environment at its next use: a test that changed it leaves nothing behind."""
    yield
    kernel_config.configure(None)
