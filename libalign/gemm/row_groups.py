"""Rows grouped by expert: the layout every grouped GEMM backend reads.

A mixture-of-experts layer multiplies each expert's rows of a token-permuted activation
matrix by that expert's weights. Rows arrive sorted by expert, ``counts[e]`` of them for
expert ``e`` (zero allowed). A GEMM kernel works in tiles of 64 or 128 rows, and a tile must
not straddle two experts (it reads one expert's weights), so :class:`GroupLayout` pads each
expert's rows up to a multiple of ``pad_to``. Padding rows are zero, which changes no outer
maximum (a zero row quantizes to zero codes), so padding never shows in a result:
:meth:`GroupLayout.pad` scatters the real rows into the padded layout and
:meth:`GroupLayout.unpad` gathers them back.

Example: counts ``(3, 0, 130)`` padded to 128 gives padded counts ``(128, 0, 256)``; rows
0-2 stay at 0-2, rows 3-132 move to 128-257, and the tiles of 128 rows belong to experts
``[0, 2, 2]`` (:meth:`GroupLayout.tile_expert`).

:mod:`libalign.gemm` (the definition and the dispatcher), :mod:`libalign.gemm.triton_grouped` and
:mod:`libalign.gemm.cutlass_grouped` (the GPU backends) all read this one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from libalign.errors import ShapeError, SpecError

PAD_CHOICES = (1, 64, 128)


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """Rows sorted by expert, ``counts[e]`` of them for expert ``e``, padded per expert.

    ``padded_counts[e]`` rounds ``counts[e]`` up to ``pad_to``; :meth:`row_map` maps each
    unpadded row to its position in the padded layout; ``tile_expert`` gives the expert of
    each ``pad_to`` row tile (what a GEMM kernel reads to pick the weights of a tile).
    """

    counts: tuple[int, ...]
    pad_to: int
    padded_counts: tuple[int, ...]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def experts(self) -> int:
        """Number of experts (groups)."""
        return len(self.counts)

    @property
    def total(self) -> int:
        """Unpadded rows."""
        return sum(self.counts)

    @property
    def padded_total(self) -> int:
        """Rows after padding."""
        return sum(self.padded_counts)

    def offsets(self, padded: bool = True) -> list[int]:
        """Start row of each expert (``E + 1`` entries, the last is the total)."""
        out, acc = [0], 0
        for c in self.padded_counts if padded else self.counts:
            acc += c
            out.append(acc)
        return out

    def tile_expert(self, tile: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 expert index of each ``tile``-row tile of the padded layout."""
        if self.pad_to % tile and tile % self.pad_to:
            raise ShapeError(f"tile {tile} and padding {self.pad_to} do not nest")
        if tile > self.pad_to:
            raise ShapeError(f"tile {tile} is larger than the padding {self.pad_to}")
        key = (tile, str(device))
        hit = self._cache.get(key)
        if hit is None:
            per = torch.tensor([c // tile for c in self.padded_counts], dtype=torch.int64)
            hit = _to_device(torch.repeat_interleave(torch.arange(self.experts, dtype=torch.int32),
                                                     per), device)
            self._cache[key] = hit
        return hit

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[total, ...]`` in the padded layout, padding rows zero."""
        if x.shape[0] != self.total:
            raise ShapeError(f"layout holds {self.total} rows, tensor has {x.shape[0]}")
        if self.padded_total == self.total:
            return x
        out = x.new_zeros((self.padded_total, *x.shape[1:]))
        out[self.row_map(x.device)] = x
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """The rows of a padded-layout tensor that belong to real tokens."""
        if self.padded_total == self.total:
            return y
        return y[self.row_map(y.device)]

    def source_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 unpadded row of each padded-layout row, -1 for padding, on ``device``
        (cached): what a kernel that gathers rows into the padded layout reads
        (:func:`libalign.gemm.triton_kernels.act_qdq`'s ``src_rows``)."""
        key = ("sources", str(device))
        if key not in self._cache:
            out = torch.full((self.padded_total,), -1, dtype=torch.int32, device=device)
            out[self.row_map(device)] = torch.arange(self.total, dtype=torch.int32, device=device)
            self._cache[key] = out
        return self._cache[key]

    def row_map(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 position in the padded layout of each unpadded row, on ``device`` (cached).

        Built where it is used from the per-expert shifts (a copy of ``E`` numbers, not of
        ``total``), and only when padding moves rows: a layout padded to 1 never builds it.
        """
        key = ("rows", str(device))
        if key not in self._cache:
            ct = torch.tensor(self.counts, dtype=torch.int64)
            pt = torch.tensor(self.padded_counts, dtype=torch.int64)
            shift = (pt.cumsum(0) - pt) - (ct.cumsum(0) - ct)  # padded start minus unpadded start
            shift, ct = _to_device(shift, device), _to_device(ct, device)
            self._cache[key] = torch.arange(self.total, device=device) + torch.repeat_interleave(
                shift, ct, output_size=self.total)
        return self._cache[key]


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a small host tensor) on ``device``, queued without waiting for the device.

    A blocking copy to a GPU waits for everything queued before it, so each GEMM call that
    built a layout would drain the stream. The source is pageable host memory, which the
    driver stages before the call returns, so the host tensor may be freed right after.
    """
    return t.to(device, non_blocking=torch.device(device).type == "cuda")


def group_layout(counts: torch.Tensor | list[int] | tuple[int, ...], pad_to: int = 1) -> GroupLayout:
    """The :class:`GroupLayout` of rows sorted by expert with these per-expert counts."""
    if pad_to not in PAD_CHOICES:
        raise SpecError(f"pad_to must be one of {PAD_CHOICES}, got {pad_to}")
    c = [int(v) for v in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if not c or any(v < 0 for v in c):
        raise ShapeError(f"counts must be a non-empty list of non-negative ints, got {c[:8]}")
    padded = [-(-v // pad_to) * pad_to for v in c]
    return GroupLayout(tuple(c), pad_to, tuple(padded))
