"""The grouped W4A4 GEMM on Blackwell's FP4 tensor cores (CUTLASS, sm_100a).

``csrc/gemm_nvfp4_sm100.cu`` (its C ABI: ``csrc/gemm_abi.h``) instantiates CUTLASS's
block-scaled grouped GEMM: the FP4 tensor core multiplies the E2M1 codes with their E4M3
block scales and accumulates in fp32, and the epilogue computes
``out = bf16(acc * (a_dec[row] * w_dec[col]))`` in fp32, :mod:`libalign.gemm`'s step 3 in
its order. No inner values are formed in memory: the operands are the NVFP4 bits themselves,
with block scales in the 128x4 swizzled layout the tensor core reads
(:func:`libalign.spec.packing.swizzle_scales`; a weight stack quantized with
``scale_layout="swizzled"`` is a :class:`libalign.kernels.GemmOperand` already).

Grouping: activation rows sorted by expert, expert ``e``'s rows
``row_offsets[e]:row_offsets[e+1]``; each expert's activation scales are swizzled on their
own and laid one after the other (:func:`grouped_activation_scales`).

The library is built by :mod:`libalign.kernels.native` (kind ``gemm_sm100``) for compute capability
10.x only, with the CUTLASS headers of the ``nvidia-cutlass`` package; it has no spec
fallback, so :func:`native_grouped_gemm_gap` says why it cannot run where it cannot.
"""

from __future__ import annotations

import ctypes
from itertools import pairwise

import torch

from libalign.errors import DTypeError, ShapeError, SpecError
from libalign.kernels import native
from libalign.spec.constants import BLOCK_SIZE
from libalign.spec.packing import swizzle_scales, swizzled_size

_GEMM_SM100 = "gemm_sm100"
_GEMM_STATUS_ARCH, _GEMM_STATUS_SHAPE, _GEMM_STATUS_CAN_IMPLEMENT = 1, 2, 3
_WDEC_SCALAR, _WDEC_PER_EXPERT, _WDEC_PER_ROW = 0, 1, 2


def native_grouped_gemm_gap(device: torch.device | str | None = None) -> str | None:
    """Why the native Blackwell grouped GEMM cannot run on ``device``, or None when it can.

    Cheap checks come first (device type, compute capability), so a CPU or a Hopper machine
    never builds the library; on a 10.x device the first call builds it (about a minute).
    """
    dev = torch.device("cuda" if device is None else device)
    if native.disabled():
        return native.DISABLED
    if dev.type != "cuda":
        return f"device {dev} is not a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 10:
        return f"compute capability {major}.{minor} (the kernel needs Blackwell, 10.x)"
    try:
        lib = native.load_or_raise(_GEMM_SM100)
    except native.KernelBuildError as exc:
        return f"the sm_100a GEMM library is unavailable: {exc}"
    with torch.cuda.device(dev):
        if not lib.nvfp4_gemm_sm100_available():
            return f"the library holds no kernel for compute capability {major}.{minor} (sm_100a only)"
    return None


def native_grouped_gemm_available(device: torch.device | str | None = None) -> bool:
    """True when :func:`native_grouped_gemm` can run on ``device`` (a CC 10.x CUDA device)."""
    return native_grouped_gemm_gap(device) is None


def grouped_activation_scales(block_scales: torch.Tensor, row_offsets) -> torch.Tensor:
    """Linear activation scales ``[M_total, K/16]`` -> the grouped layout the GEMM reads.

    Each expert's rows ``row_offsets[e]:row_offsets[e+1]`` are swizzled on their own (padded
    to 128 rows and a multiple of 4 columns, padding zero) and the experts' buffers follow
    each other; an expert without rows takes no bytes.
    """
    if block_scales.ndim != 2:
        raise ShapeError(f"block_scales must be [M_total, K/16], got {tuple(block_scales.shape)}")
    offsets = _host_offsets(row_offsets, block_scales.shape[0])
    parts = [swizzle_scales(block_scales[offsets[e]:offsets[e + 1]])
             for e in range(len(offsets) - 1)]
    return torch.cat(parts) if parts else block_scales.new_zeros(0).reshape(-1)


def _host_offsets(row_offsets, total: int) -> list[int]:
    """``row_offsets`` as a checked host list: 0, non-decreasing, ending at ``total``."""
    offs = [int(v) for v in (row_offsets.tolist() if isinstance(row_offsets, torch.Tensor)
                             else row_offsets)]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != total:
        raise ShapeError(f"row_offsets must run from 0 to {total} over E+1 >= 2 entries, got "
                         f"{offs[:4]}{' ...' if len(offs) > 4 else ''} (length {len(offs)})")
    if any(b < a for a, b in pairwise(offs)):
        raise ShapeError("row_offsets must be non-decreasing")
    return offs


def native_grouped_gemm(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_dec: torch.Tensor,
    row_offsets,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_dec: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = bf16(acc[r] * (a_dec[r] * w_dec[e]))`` for the rows ``r`` of each expert ``e``.

    The W4A4 grouped GEMM on Blackwell's FP4 tensor cores (CUTLASS, sm_100a):
    ``acc[r, n] = sum_k a[r, k] * w[e, n, k]`` over NVFP4 operands, then the fp32 epilogue.

    - ``a_codes`` uint8 ``[M_total, K/2]``: activation rows sorted by expert.
    - ``a_scales`` flat E4M3 (or uint8) block scales in the grouped swizzled layout of
      :func:`grouped_activation_scales`.
    - ``a_dec`` fp32 decode scales, ``[M_total]`` (per row) or one value.
    - ``row_offsets`` ``E + 1`` row offsets (0, non-decreasing, ``M_total``): a sequence or
      a CPU tensor (checked, copied to the device), or a CUDA int32 tensor (used as it is,
      with no synchronisation; then ``a_scales`` must hold the worst case,
      ``(M_total + 127 * E)`` padded rows).
    - ``w_codes`` uint8 ``[E, N, K/2]``, ``w_scales`` flat ``E`` swizzled ``[N, K/16]``
      matrices (a 3-D :class:`~libalign.kernels.GemmOperand`'s ``block_scales``).
    - ``w_dec`` fp32 ``[E, N]`` (per output row of each expert), ``[E]`` or one value.

    K must be a multiple of 32 and N of 8. Returns (or fills) bf16 ``[M_total, N]``.
    Raises :class:`~libalign.errors.ShapeError` / ``DTypeError`` for operands that do not
    fit, and :class:`~libalign.errors.SpecError` where no native kernel can run (not a
    CC 10.x CUDA device, no CUTLASS headers or nvcc; the message says which).
    """
    u8 = (torch.uint8, torch.float8_e4m3fn)
    for name, t, ndim in (("a_codes", a_codes, 2), ("w_codes", w_codes, 3)):
        if t.dtype != torch.uint8:
            raise DTypeError(f"{name} must be uint8 packed E2M1 codes, got {t.dtype}")
        if t.ndim != ndim:
            raise ShapeError(f"{name} must have {ndim} dimensions, got {tuple(t.shape)}")
    for name, t in (("a_scales", a_scales), ("w_scales", w_scales)):
        if t.dtype not in u8:
            raise DTypeError(f"{name} must be float8_e4m3fn or uint8, got {t.dtype}")
    for name, t in (("a_dec", a_dec), ("w_dec", w_dec)):
        if t.dtype != torch.float32:
            raise DTypeError(f"{name} must be float32 decode scales, got {t.dtype}")
    m, k = a_codes.shape[0], a_codes.shape[1] * 2
    e, n = w_codes.shape[0], w_codes.shape[1]
    if w_codes.shape[2] * 2 != k:
        raise ShapeError(f"activations have K={k}, weights K={w_codes.shape[2] * 2}")
    if e < 1 or k % 32 or n % 8 or k == 0 or n == 0:
        raise ShapeError(f"the native GEMM needs E >= 1, K a multiple of 32 and N of 8; got "
                         f"E={e}, N={n}, K={k}")
    if max(m, n, k) >= 2**31:
        raise ShapeError(f"M={m}, N={n}, K={k}: each must stay below 2**31")
    if a_dec.numel() == 1:
        a_per_row = 0
    elif a_dec.numel() == m and a_dec.ndim in (1, 2) and a_dec.shape[0] == m:
        a_per_row = 1
    else:
        raise ShapeError(f"a_dec must be [M_total]={m} or one value, got {tuple(a_dec.shape)}")
    if tuple(w_dec.shape) == (e, n):
        w_mode = _WDEC_PER_ROW
    elif w_dec.numel() == 1:
        w_mode = _WDEC_SCALAR
    elif tuple(w_dec.shape) == (e,):
        w_mode = _WDEC_PER_EXPERT
    else:
        raise ShapeError(f"w_dec must be [E, N]=({e}, {n}), [E] or one value, "
                         f"got {tuple(w_dec.shape)}")
    cols = -(-(k // BLOCK_SIZE) // 4) * 4
    if w_scales.numel() < e * swizzled_size(n, k // BLOCK_SIZE):
        raise ShapeError(f"w_scales has {w_scales.numel()} bytes, {e} swizzled [{n}, "
                         f"{k // BLOCK_SIZE}] matrices need {e * swizzled_size(n, k // BLOCK_SIZE)}")
    on_device = isinstance(row_offsets, torch.Tensor) and row_offsets.device.type == "cuda"
    offs: list[int] = []
    if on_device:
        if row_offsets.dtype != torch.int32 or tuple(row_offsets.shape) != (e + 1,):
            raise ShapeError(f"CUDA row_offsets must be int32 [E+1]=[{e + 1}], got "
                             f"{row_offsets.dtype} {tuple(row_offsets.shape)}")
        need_rows = m + 127 * e
    else:
        offs = _host_offsets(row_offsets, m)
        if len(offs) != e + 1:
            raise ShapeError(f"row_offsets has {len(offs)} entries, the weights have E={e}")
        need_rows = sum(-(-(b - a) // 128) * 128 for a, b in pairwise(offs))
    if a_scales.numel() < need_rows * cols:
        raise ShapeError(f"a_scales has {a_scales.numel()} bytes, the grouped layout needs "
                         f"{need_rows * cols}")
    dev = a_codes.device
    others = (a_scales, a_dec, w_codes, w_scales, w_dec) + ((row_offsets,) if on_device else ())
    if any(t.device != dev for t in others):
        raise ShapeError("all operands must be on one device")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n)
                            or out.device != dev or not out.is_contiguous()):
        raise ShapeError(f"out must be a contiguous bf16 [{m}, {n}] tensor on {dev}")

    gap = native_grouped_gemm_gap(dev)
    if gap is not None:
        raise SpecError(f"no native grouped GEMM serves this call: {gap}")
    lib = native.load_or_raise(_GEMM_SM100)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    if m == 0:
        return out
    offsets = row_offsets if on_device else torch.tensor(offs, dtype=torch.int32).to(dev)
    keep = [t.contiguous() for t in (a_codes, a_scales, a_dec, w_codes, w_scales, w_dec)]
    args = native.GemmSm100Args(experts=e, n=n, k=k, a_dec_per_row=a_per_row,
                                 w_dec_mode=w_mode, reserved=0)
    args.row_offsets = offsets.data_ptr()
    args.a_codes, args.a_scales, args.a_dec = (t.data_ptr() for t in keep[:3])
    args.w_codes, args.w_scales, args.w_dec = (t.data_ptr() for t in keep[3:])
    args.out = out.data_ptr()
    with torch.cuda.device(dev):
        size = ctypes.c_size_t(0)
        status = lib.nvfp4_gemm_sm100_workspace_size(ctypes.byref(args), ctypes.byref(size))
        workspace = torch.empty(size.value, dtype=torch.uint8, device=dev) if status == 0 else None
        if status == 0:  # the caching allocator reuses it only in this stream's order
            stream = torch.cuda.current_stream(dev).cuda_stream
            status = lib.nvfp4_grouped_gemm_sm100(ctypes.byref(args), workspace.data_ptr(),
                                                  size.value, stream)
    if status:
        text = lib.nvfp4_gemm_sm100_status_string(status).decode()
        if status in (_GEMM_STATUS_SHAPE, _GEMM_STATUS_CAN_IMPLEMENT):
            raise ShapeError(f"the native grouped GEMM refused its operands: {text}")
        if status == _GEMM_STATUS_ARCH:
            raise SpecError(f"no native grouped GEMM serves this call: {text}")
        raise RuntimeError(f"the native grouped GEMM failed (status {status}): {text}")
    return out
