"""Triton launches with the argument binding done once per specialization.

A ``kernel[grid](*args, **constexprs)`` call does more host work than the kernel's launch: it
binds the arguments to the signature, asks Triton's specializer about every argument (is a
pointer 16-byte aligned, is an integer 1 or a multiple of 16), builds a cache key from the
answers and the options, looks the compiled kernel up, and only then calls the launcher. On a
decode-sized call that work is most of the call (tens of microseconds, where the kernel itself
may take ten).

:class:`Launch` wraps a ``@triton.jit`` function and does that work once per *specialization*:
the first call with a given key goes through Triton's own path (which compiles if needed and
returns the compiled kernel); later calls with the same key launch that compiled kernel
directly through its public ``compiled[grid](*args)`` entry. The key is at least as fine as
Triton's own: for each tensor its dtype and whether its address is 16-byte aligned, for each
integer whether it is 1, a multiple of 16 and within 32 bits, for each host tensor descriptor
its dtype, block shape, padding and the same integer facts of its shape and strides, every
``constexpr`` value, the launch options (``num_warps``, ``num_stages``) and the device. Two
calls with one key are calls Triton would send to the same compiled kernel, so the fast path
launches exactly what ``kernel[grid]`` would have.

An argument of a kind the key does not know (anything but tensors, descriptors, ints, floats,
bools and ``None``) sends the call through Triton's path. :data:`CHECK` (tests) asks Triton on
every fast launch which compiled kernel it would have chosen and raises if it is not the one
launched.
"""

from __future__ import annotations

import functools

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    TensorDescriptor = None

__all__ = ["CHECK", "Launch", "launched"]

CHECK = False
"""When True, every fast launch also asks Triton which compiled kernel it would choose and
raises :class:`RuntimeError` if that is not the one launched (a test's switch)."""

_I32 = (-(2 ** 31), 2 ** 31)


def _int_key(v: int) -> tuple:
    return (v == 1, v % 16 == 0, _I32[0] <= v < _I32[1])


def _arg_key(v) -> tuple | None:
    """The specialization facts of one runtime argument, or None for a kind not handled."""
    if isinstance(v, torch.Tensor):
        return ("t", v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b",)
    if isinstance(v, int):
        return ("i", *_int_key(v))
    if isinstance(v, float):
        return ("f",)
    if v is None:
        return ("n",)
    if TensorDescriptor is not None and isinstance(v, TensorDescriptor):
        return ("d", v.base.dtype, tuple(v.block_shape), v.padding,
                tuple(_int_key(int(s)) for s in v.shape),
                tuple(_int_key(int(s)) for s in v.strides), v.base.data_ptr() % 16 == 0)
    return None


class Launch:
    """``Launch(kernel)[grid](*args, **kwargs)``: what ``kernel[grid](*args, **kwargs)`` does,
    with the binding cached per specialization (module docstring). Positional arguments
    first, then keywords for the rest of the signature (``constexpr`` values) and the launch
    options."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)  # None: an interpreted kernel, Triton's path
        self.names = [p.name for p in params] if params is not None else None
        self.constexpr = [p.is_constexpr for p in params] if params is not None else None
        self._compiled: dict[tuple, object] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def __len__(self) -> int:
        """The number of specializations whose compiled kernel is kept."""
        return len(self._compiled)

    def _key(self, args: tuple, kwargs: dict) -> tuple[tuple, list] | None:
        if self.names is None:
            return None
        n = len(args)
        if n > len(self.names) or any(name in kwargs for name in self.names[:n]):
            return None
        values = list(args)
        for name in self.names[n:]:
            if name not in kwargs:
                return None  # a default: Triton's path fills it in
            values.append(kwargs[name])
        facts = []
        for v, const in zip(values, self.constexpr, strict=True):
            if const:
                facts.append(("c", v))
                continue
            k = _arg_key(v)
            if k is None:
                return None
            facts.append(k)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names[n:]))
        return (torch.cuda.current_device(), tuple(facts), options), values

    def _launch(self, grid, args: tuple, kwargs: dict):
        found = None if callable(grid) else self._key(args, kwargs)
        compiled = self._compiled.get(found[0]) if found is not None else None
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if found is not None and compiled is not None:
                self._compiled[found[0]] = compiled
            return compiled
        if CHECK:
            own = self.kernel.warmup(*args, grid=grid, **kwargs)
            if own is not compiled:
                raise RuntimeError(f"{self.kernel.__name__}: the cached launch differs from "
                                   f"Triton's choice for key {found[0]}")
        g = tuple(grid) + (1,) * (3 - len(grid))
        compiled[g](*found[1])
        return compiled


@functools.cache
def launched(kernel) -> Launch:
    """The one :class:`Launch` of ``kernel`` (its cache shared by every caller)."""
    return Launch(kernel)
