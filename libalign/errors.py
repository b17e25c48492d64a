"""One tree of typed errors for the whole project.

Every error libalign raises derives from :class:`AlignError`. Each class carries a stable
machine-readable ``code`` and the HTTP status the API maps it to (the services translate
with one helper, the client maps the code back to the class), so a caller can catch
exactly what went wrong: a wrong dtype is not a wrong shape, and neither is a NaN.

The input errors also derive from the builtin they refine (``ValueError`` or
``TypeError``), so code written against plain Python conventions keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence


class AlignError(Exception):
    """Base of every libalign error."""

    code: str = "align_error"
    http_status: int = 500

    def to_dict(self) -> dict:
        """Wire form: the code, the class name and the message."""
        return {"code": self.code, "type": type(self).__name__, "message": str(self)}


class InputError(AlignError, ValueError):
    """The caller passed something libalign cannot accept."""

    code = "invalid_input"
    http_status = 422


class DTypeError(InputError, TypeError):
    """A tensor has a dtype the operation does not accept."""

    code = "invalid_dtype"


class ShapeError(InputError):
    """A tensor has the wrong rank or shape."""

    code = "invalid_shape"


class NonFiniteError(InputError):
    """A tensor holds NaN or Inf where the numerics spec refuses them.

    ``count`` is how many elements are non-finite, ``nan``/``inf`` split that count and
    ``first_indices`` lists the multi-indices of the first few offenders.
    """

    code = "non_finite"

    def __init__(
        self,
        what: str,
        count: int,
        nan: int,
        inf: int,
        first_indices: Sequence[tuple[int, ...]],
    ):
        self.count = count
        self.nan = nan
        self.inf = inf
        self.first_indices = [tuple(int(i) for i in ix) for ix in first_indices]
        shown = ", ".join(str(ix) for ix in self.first_indices)
        super().__init__(
            f"{what}: {count} non-finite element(s) ({nan} NaN, {inf} Inf), "
            f"first at {shown}"
        )


class SpecError(InputError):
    """A numerics spec is inconsistent, unknown, or cannot express the request."""

    code = "invalid_spec"


class UndefinedScaleError(InputError):
    """The chosen preset's arithmetic produces no defined scale for this input.

    Raised, for example, by the ``torchao`` and ``modelopt`` presets on an all-zero
    tensor, where those libraries divide zero by zero and emit NaN block scales.
    """

    code = "undefined_scale"


class LayoutError(InputError):
    """A packed payload, scale layout or checkpoint dict does not fit its description."""

    code = "invalid_layout"
