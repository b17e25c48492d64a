"""The id rule: what a version id, rollout id, consumer or instance name may look like.

Ids become Redis key parts (``libalign:version:<id>``), directory names of the weight store
(``versions/<id>/``) and path segments of the API, so they are restricted to one safe
alphabet: an ASCII letter or digit, then up to 127 letters, digits, ``.``, ``_`` or ``-``.
No ``/`` (a path), no ``:`` (the key separator), no leading dot (``..``, hidden files), no
spaces or anything a shell would read.

:data:`ID_PATTERN` is the rule anchored for schema validators (pydantic's ``pattern``,
FastAPI's ``Query(pattern=...)``); :data:`ID_RE` is the same rule compiled, to be used
with ``fullmatch``. :func:`check_id` and its two named forms raise
:class:`~alignclient.errors.InputError` naming what was wrong, and :func:`safe_id` makes a
free-form name (a host name, a configured consumer name) into an id.

The server, the stores and the client all take the rule from here (standard library only).
"""

from __future__ import annotations

import re

from .errors import InputError

#: Longest id, in characters (the ``{0,127}`` below).
MAX_ID_LEN = 128
#: The rule, unanchored: use with ``fullmatch``.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The rule anchored, for schema validators that search (pydantic, FastAPI).
ID_PATTERN = f"^{ID_RE.pattern}$"

_OUTSIDE = re.compile(r"[^A-Za-z0-9._-]")


def is_safe_id(value: object) -> bool:
    """Whether ``value`` is a string that follows the id rule."""
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


def check_id(value: object, what: str = "id") -> str:
    """``value`` if it follows the id rule, else InputError naming ``what`` and the rule."""
    if not is_safe_id(value):
        raise InputError(f"{what} {value!r} must match {ID_RE.pattern}")
    return value  # type: ignore[return-value]


def check_version_id(version_id: object) -> str:
    """``version_id`` if it is a safe directory name and key part, else InputError."""
    return check_id(version_id, "version id")


def check_rollout_id(rollout_id: object) -> str:
    """``rollout_id`` if it is a safe key part, else InputError."""
    return check_id(rollout_id, "rollout id")


def safe_id(name: str, fallback: str) -> str:
    """``name`` made an id: characters outside the alphabet become ``-``, leading ``.``,
    ``_`` and ``-`` are dropped, the rest is cut to :data:`MAX_ID_LEN`; ``fallback`` (an
    id) if nothing is left."""
    cut = _OUTSIDE.sub("-", name).lstrip("._-")[:MAX_ID_LEN]
    return cut or check_id(fallback, "fallback id")
