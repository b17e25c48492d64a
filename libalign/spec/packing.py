"""Nibble packing of E2M1 codes and the two block-scale layouts.

Nibbles
    Two 4-bit codes share a byte; the element at the even index goes in the low nibble:
    ``byte = code[2i] | code[2i+1] << 4``. Every public NVFP4 producer agrees on this
    (and the PTX converter ``cvt.rn.satfinite.e2m1x2.f32 d, hi, lo`` is called with the
    odd element first for the same result).

Linear scale layout
    One E4M3 byte per 16-element block, ``[..., M, K/16]`` row-major (MXFP4: one E8M0
    byte per 32 elements, ``[..., M, K/32]``): what checkpoints store and what the spec
    produces.

128x4 swizzled layout
    What cuBLAS / CUTLASS block-scaled GEMMs read. The ``[M, K/16]`` matrix is zero-padded
    to ``[ceil(M/128)*128, ceil(K16/4)*4]`` and cut into 128x4 tiles stored tile-row-major,
    each tile as 512 contiguous bytes. Inside a tile, row ``r`` and column ``c`` sit at
    ``(r % 32) * 16 + (r // 32) * 4 + c``: the 128 rows are split into 4 groups of 32 and
    interleaved so that one 16-byte chunk holds rows r, r+32, r+64, r+96 for all 4 columns.
    For a 3-D stack each expert's matrix is padded and swizzled on its own (what grouped
    GEMMs expect), and the experts' buffers are concatenated. MXFP4's E8M0 scales use the
    same 128x4 layout (cuBLAS block scaling, torchao ``to_blocked``); only bytes move.
"""

from __future__ import annotations

import torch

from libalign.errors import DTypeError, LayoutError, ShapeError
from libalign.spec.constants import SWIZZLE_COLS, SWIZZLE_ROWS


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., K]`` (uint8, each < 16, K even) -> packed bytes ``[..., K/2]``."""
    if codes.dtype != torch.uint8:
        raise DTypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ShapeError(f"last dimension must be even to pack nibbles, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., K/2]`` -> E2M1 codes ``[..., K]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed codes must be uint8, got {packed.dtype}")
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the padded 128x4 layout of one ``[rows, cols]`` scale matrix."""
    return (-(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS) * (-(-cols // SWIZZLE_COLS) * SWIZZLE_COLS)


def _as_bytes(scales: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    if scales.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8):
        return scales.view(torch.uint8), scales.dtype
    raise DTypeError(f"block scales must be float8_e4m3fn, float8_e8m0fnu or uint8, "
                     f"got {scales.dtype}")


def _swizzle_2d(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    rt, ct = -(-rows // SWIZZLE_ROWS), -(-cols // SWIZZLE_COLS)
    padded = s.new_zeros((rt * SWIZZLE_ROWS, ct * SWIZZLE_COLS))
    padded[:rows, :cols] = s
    # [rt, 4 groups, 32 rows, ct, 4 cols] -> [rt, ct, 32 rows, 4 groups, 4 cols]
    tiles = padded.view(rt, 4, 32, ct, SWIZZLE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def _unswizzle_2d(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    rt, ct = -(-rows // SWIZZLE_ROWS), -(-cols // SWIZZLE_COLS)
    tiles = flat.view(rt, ct, 32, 4, SWIZZLE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rt * SWIZZLE_ROWS, ct * SWIZZLE_COLS)[:rows, :cols]


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, K16]`` or ``[E, M, K16]`` scales -> flat 128x4-swizzled buffer.

    Padding bytes are zero. A 3-D stack is swizzled expert by expert and concatenated.
    """
    raw, dtype = _as_bytes(scales)
    if raw.ndim == 2:
        out = _swizzle_2d(raw)
    elif raw.ndim == 3:
        parts = [_swizzle_2d(raw[e]) for e in range(raw.shape[0])]
        out = torch.cat(parts) if parts else raw.new_zeros(0)
    else:
        raise ShapeError(f"scales must be 2-D or 3-D, got shape {tuple(scales.shape)}")
    return out.view(dtype)


def unswizzle_scales(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: flat buffer -> linear scales of ``shape``."""
    raw, dtype = _as_bytes(flat)
    raw = raw.reshape(-1)
    if len(shape) == 2:
        rows, cols = shape
        experts = None
    elif len(shape) == 3:
        experts, rows, cols = shape
    else:
        raise ShapeError(f"shape must have 2 or 3 dimensions, got {shape}")
    per = swizzled_size(rows, cols)
    want = per * (1 if experts is None else experts)
    if raw.numel() != want:
        raise LayoutError(
            f"swizzled buffer has {raw.numel()} bytes, layout of {shape} needs {want}"
        )
    if experts is None:
        out = _unswizzle_2d(raw, rows, cols)
    else:
        out = torch.stack([_unswizzle_2d(raw[e * per : (e + 1) * per], rows, cols)
                           for e in range(experts)]) if experts else raw.new_zeros(shape)
    return out.contiguous().view(dtype)
