"""Set or drop a kernel variable inside a test: the environment changes with ``monkeypatch``
(restored after the test) and libalign's kernel configuration is read again at its next use
(:func:`libalign.kernels.config.configure`), as a fresh process would read it."""

from __future__ import annotations

import pytest

from libalign.kernels import config


def setenv(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    config.configure(None)


def delenv(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.delenv(name, raising=False)
    config.configure(None)
