"""The inner and outer parts of an NVFP4 operand, and the product's defining reference.

Step 1 of the W4A4 product (see :mod:`libalign.gemm`) multiplies each E2M1 code by its block's
E4M3 scale: :func:`inner_values` (one gather per code byte from :func:`inner_table`, exact in
bf16 and fp32). Step 3 scales the fp32 accumulator once by both rows' outer decode scales
(:func:`row_decode_scales`, :func:`epilogue`), or as the path's peer does (TE forms its
``alpha`` from the stored maxima; :class:`~libalign.gemm.paths.Epilogue`).
:func:`w4a4_reference` puts the three steps together with a float64 accumulator: the
product every backend is measured against.
"""

from __future__ import annotations

import torch

from libalign.errors import DTypeError, ShapeError
from libalign.gemm.backends import device_kernels
from libalign.gemm.paths import Epilogue, ExecutionPath
from libalign.gemm.triton_grouped import triton_inner_values
from libalign.spec import NVFP4Tensor
from libalign.spec.packing import unpack_nibbles
from libalign.spec.rounding import e2m1_code_values, e4m3_bits_to_float

_INNER_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def inner_table(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The inner values of every (E4M3 scale byte, code byte) pair: ``[65536, 2]`` of ``dtype``.

    Row ``(s << 8) | b`` holds ``fl32(code * scale)`` of byte ``b``'s two E2M1 codes (low
    nibble first) under scale byte ``s``, cast to ``dtype`` (exact: at most 6 significant
    bits between 2^-10 and 2688). Built once per device and dtype (256 KiB in bf16)."""
    key = (str(device), dtype)
    table = _INNER_TABLES.get(key)
    if table is None:
        vals = e2m1_code_values(unpack_nibbles(torch.arange(256, dtype=torch.uint8).reshape(256, 1)))
        scales = e4m3_bits_to_float(torch.arange(256, dtype=torch.uint8))
        table = (vals[None] * scales[:, None, None]).reshape(65536, 2).to(dtype).to(device)
        _INNER_TABLES[key] = table
    return table


def inner_values(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * s`` per element (step 1): exact in fp32 and bf16; logical shape, K unpadded.

    The bits of the field-by-field decode (:func:`~libalign.spec.rounding.e2m1_code_values` times
    :func:`~libalign.spec.rounding.e4m3_bits_to_float`) from one gather per code byte in
    :func:`inner_table` (index ``scale byte << 8 | code byte``, each byte's two values one
    word), or in bf16 on a Triton GPU one Triton pass (reads the bits once, writes bf16)."""
    scales = q.block_scales
    if scales.dtype == torch.float8_e8m0fnu or q.codes.shape[-1] * 2 != scales.shape[-1] * 16:
        raise DTypeError(f"inner_values decodes NVFP4 (E4M3 scales per 16 values); spec "
                         f"{q.spec.name!r} has {scales.dtype} scales per {q.spec.block_size}")
    fast = triton_inner_values(q.codes, scales) if dtype == torch.bfloat16 and q.codes.is_cuda \
        and device_kernels(q.codes.device)[1] else None
    if fast is not None:
        return fast[..., : q.k]
    lead = q.codes.shape[:-1]
    nb = scales.shape[-1]
    shifted = scales.view(torch.uint8).to(torch.int32).unsqueeze(-1) << 8
    idx = torch.add(q.codes.reshape(*lead, nb, 8), shifted).reshape(-1)
    table = inner_table(q.codes.device, dtype)
    word = {2: torch.int32, 4: torch.int64}.get(table.element_size())
    if word is not None:  # each byte's pair as one word: a plain 1-D gather
        out = table.view(word).reshape(-1).index_select(0, idx).view(dtype)
    else:
        out = table.index_select(0, idx)
    return out.reshape(*lead, nb * 16)[..., : q.k]


def row_decode_scales(q: NVFP4Tensor) -> torch.Tensor:
    """The fp32 outer decode scale of every row of ``q``, shape ``q.shape[:-1]``."""
    rows = q.shape[:-1]
    dec = q.outer_dec
    dom = q.spec.outer_domain
    if q.outer_scale is None or dom == "tensor":
        return dec.reshape(()).expand(rows).contiguous()
    if dom == "expert":
        return dec.reshape(-1, *([1] * (len(rows) - 1))).expand(rows).contiguous()
    return dec.reshape(rows)


def row_epilogue_scales(q: NVFP4Tensor, path: ExecutionPath | None = None) -> torch.Tensor:
    """What the path's epilogue reads of every row of ``q`` (shape ``q.shape[:-1]``): the outer
    decode scales (:func:`row_decode_scales`), or for TE's epilogues the stored maxima."""
    if path is None or path.epilogue == Epilogue.DEC_PRODUCT:
        return row_decode_scales(q)
    rows = q.shape[:-1]
    amax = q.outer_scale.float()  # the path requires outer convention 'amax'
    dom = q.spec.outer_domain
    if dom == "tensor":
        return amax.reshape(()).expand(rows).contiguous()
    if dom == "expert":
        return amax.reshape(-1, *([1] * (len(rows) - 1))).expand(rows).contiguous()
    return amax.reshape(rows)


def te_factor(path: ExecutionPath) -> torch.Tensor:
    """TE's ``factor_inv = 1.0f / (6 * 6 * E_A * E_B)`` (fp32, left to right, exact product)."""
    e_w, e_a = path.weight_spec.e4m3_max, path.act_spec.e4m3_max
    prod = torch.tensor(6.0, dtype=torch.float32) * 6.0 * e_w * e_a
    return torch.reciprocal(prod)


def epilogue(acc: torch.Tensor, a_dec: torch.Tensor, w_dec: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16, path: ExecutionPath | None = None) -> torch.Tensor:
    """Step 3 for an fp32 ``acc`` ``[M, N]`` under the path's :class:`Epilogue`:
    ``dtype(fl(acc * fl(a_dec[m] * w_dec[n])))`` by default; TE's from the maxima the path's
    :func:`row_epilogue_scales` gives (see :class:`~libalign.gemm.paths.Epilogue`)."""
    a = a_dec.float().reshape(-1, 1)
    w = w_dec.float().reshape(1, -1)
    kind = Epilogue.DEC_PRODUCT if path is None else path.epilogue
    if kind == Epilogue.DEC_PRODUCT:
        return (acc * (a * w)).to(dtype)
    factor = te_factor(path).to(acc.device)
    if kind == Epilogue.TE_ALPHA:
        return (acc * ((w * a) * factor)).to(dtype)
    return ((acc * factor) * (a * w)).to(dtype)  # TE_ROW


def w4a4_reference(a: NVFP4Tensor, w: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16,
                   path: ExecutionPath | None = None):
    """The defining product of two 2-D NVFP4 operands ``[M, K]`` and ``[N, K]``.

    Accumulates the exact products in float64 and rounds the sum once to fp32, so the result
    does not depend on an addition order (for the ranges NVFP4 operands span, float64 holds
    the sums exactly or within one float64 ulp, far below the fp32 rounding that follows).
    """
    if len(a.shape) != 2 or len(w.shape) != 2 or a.k != w.k:
        raise ShapeError(f"w4a4_reference needs [M, K] x [N, K], got {a.shape} and {w.shape}")
    acc = (inner_values(a, torch.float64) @ inner_values(w, torch.float64).T).float()
    return epilogue(acc, row_epilogue_scales(a, path), row_epilogue_scales(w, path), dtype, path)


def inner_dtype(device: torch.device) -> torch.dtype:
    """The dtype inner values are kept in on ``device``: bf16 on a GPU (what its tensor cores
    read), fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
