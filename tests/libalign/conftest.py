"""tests/libalign: the slow nvcc builds of the build tests start in the background as soon as
those tests are collected (tests/libalign/native_builds.py)."""

from tests.libalign import native_builds


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        native_builds.start_for(item.nodeid for item in session.items)


def pytest_unconfigure(config):
    native_builds.stop()
