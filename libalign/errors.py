"""The errors the numerical core raises, and why they live in the wire contract.

libalign refuses bad input with typed errors, so a caller can catch exactly what went
wrong: a wrong dtype (:class:`DTypeError`) is not a wrong shape (:class:`ShapeError`), and
neither is a NaN (:class:`NonFiniteError`, which also says how many and where). Each class
has a stable ``code``; the input errors also derive from the builtin they refine
(``ValueError`` or ``TypeError``), so code written against plain Python conventions keeps
working.

The core's errors are the contract's classes, so one class is raised in-process and by
the client. They are defined once, in ``alignclient.errors`` (the wire contract, a
standard-library-only module that ships without torch), and this module re-exports the
ones the core itself raises. A ``ShapeError`` raised by :func:`libalign.spec.quantize` in a
trainer and a ``ShapeError`` the daemon answered over HTTP and the client raised again are
the same class; ``except libalign.errors.ShapeError`` catches both.

What the core does *not* know: the service errors (versions, stores, the API), and how any
error is reported over a transport. The HTTP status of each class lives with the API
(``alignd.api.errors``).

The classes the core raises::

    AlignError                        base of every error
    ├── InputError (ValueError)       an argument libalign cannot accept
    │   ├── DTypeError (TypeError)    a tensor's dtype
    │   ├── ShapeError                a tensor's rank or shape
    │   ├── NonFiniteError            NaN/Inf where the spec refuses them
    │   ├── SpecError                 a numerics spec that is inconsistent or unknown
    │   ├── UndefinedScaleError       a preset's arithmetic gives no scale for this input
    │   ├── LayoutError               a packed payload or scale layout that does not fit
    │   ├── GuidanceRecordError       a malformed guidance record
    │   │   ├── GuidanceChecksumError its bytes do not match its checksum
    │   │   └── GuidanceMismatchError records made for another version, model, bit width or format
    │   ├── RoutingRecordError        a malformed routing record (R3)
    │   │   └── RoutingMismatchError  a routing record made for another version, layers, top-k, experts
    │   └── RoutingMissingError       routing replay is on and a rollout has no routing record
    ├── ConfigError                   a setting missing, inconsistent or unavailable here
    └── DistributedRunError           ranks of a multi-process run failed
"""

from __future__ import annotations

from alignclient.errors import (
    AlignError,
    ConfigError,
    DistributedRunError,
    DTypeError,
    GuidanceChecksumError,
    GuidanceMismatchError,
    GuidanceRecordError,
    InputError,
    LayoutError,
    NonFiniteError,
    RoutingMismatchError,
    RoutingMissingError,
    RoutingRecordError,
    ShapeError,
    SpecError,
    UndefinedScaleError,
)

__all__ = [
    "AlignError",
    "ConfigError",
    "DTypeError",
    "DistributedRunError",
    "GuidanceChecksumError",
    "GuidanceMismatchError",
    "GuidanceRecordError",
    "InputError",
    "LayoutError",
    "NonFiniteError",
    "RoutingMismatchError",
    "RoutingMissingError",
    "RoutingRecordError",
    "ShapeError",
    "SpecError",
    "UndefinedScaleError",
]
