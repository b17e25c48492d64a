"""Pins the one id rule (alignclient.ids): its edges, the typed error naming what was wrong,
and safe_id, which turns configured names into heartbeat/consumer ids."""

from __future__ import annotations

import pytest
from alignclient.errors import InputError
from alignclient.ids import MAX_ID_LEN, check_id, check_rollout_id, check_version_id, safe_id


@pytest.mark.parametrize("good", ["v1", "0", "a.b_c-d", "a..b", "x" * MAX_ID_LEN])
def test_safe_ids_pass_unchanged(good):
    """Ids of the alphabet, starting with a letter or digit, up to 128 characters, pass as they are."""
    assert check_version_id(good) is good and check_rollout_id(good) is good
    assert safe_id(good, "f") == good


@pytest.mark.parametrize("bad", ["", ".hidden", "-x", "_x", "a/b", "a:b", "a b", "v1\n", "é",
                                 "x" * (MAX_ID_LEN + 1), None, 7])
def test_unsafe_ids_are_input_errors_naming_what(bad):
    """Anything else is an InputError that names the kind of id and the rule."""
    with pytest.raises(InputError, match=r"^rollout id .* must match \[A-Za-z0-9\]"):
        check_rollout_id(bad)
    with pytest.raises(InputError, match=r"^instance name "):
        check_id(bad, "instance name")


@pytest.mark.parametrize(("name", "fallback", "want"), [
    ("host.example:8000/api", "api", "host.example-8000-api"),
    ("..-_x y", "api", "x-y"),
    ("::", "converter", "converter"),
    ("", "api", "api"),
    ("é" * 200, "api", "api"),
    ("a" * 300, "api", "a" * MAX_ID_LEN),
])
def test_safe_id_makes_names_ids(name, fallback, want):
    """safe_id: outside characters become '-', leading '.', '_', '-' go, cut to 128, else the fallback."""
    got = safe_id(name, fallback)
    assert got == want and check_id(got) == got


def test_safe_id_refuses_an_unsafe_fallback():
    """The fallback must itself be an id."""
    with pytest.raises(InputError, match="fallback id"):
        safe_id("", "-bad")
