"""Suite-wide pytest configuration: GPU tests are skipped without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch CPU thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny matrices gain nothing from threads, and spinning OpenMP workers crawl on shared cores."""
    from libalign.models.train import cpu_threads

    with cpu_threads(1):
        yield
