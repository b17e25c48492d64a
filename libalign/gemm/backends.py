"""Which grouped-GEMM backend serves a call: the names, what each device offers, the choice.

Backends (:data:`BACKENDS`): ``reference`` (float64 accumulation, the definition), ``torch``
(fp32 matmul of the exact inner values; CPU and any GPU), ``triton`` (the fused Hopper kernels of
:mod:`libalign.gemm.triton_grouped`), ``native`` (Blackwell FP4 tensor cores through CUTLASS,
:mod:`libalign.gemm.cutlass_grouped`) and ``auto`` (native on Blackwell, else triton on a CUDA
device that has it and can serve the call, else torch). A backend asked by name that cannot serve
the call is refused with the reason, never replaced.
"""

from __future__ import annotations

import torch

from libalign.errors import SpecError
from libalign.gemm.cutlass_grouped import native_grouped_gemm_gap
from libalign.gemm.paths import Backend, Epilogue, ExecutionPath
from libalign.gemm.triton_grouped import triton_act_gap, triton_gemm_available, triton_k_gap

BACKENDS = Backend.values()


def resolve_backend(backend: str, device: torch.device, path: ExecutionPath, k: int) -> Backend:
    """The backend that serves a call of ``k`` columns on ``device``: ``backend`` when named
    (SpecError with the reason when it cannot serve the call), else the path's, else the
    fastest that can (see the module doc)."""
    if backend not in BACKENDS:
        raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == Backend.AUTO:
        backend = path.backend
    if backend in ("triton", "native") and path.epilogue != Epilogue.DEC_PRODUCT:
        raise SpecError(f"the {backend} W4A4 backend scales by the decode-scale product; path "
                        f"{path.name!r} takes TE's epilogue {path.epilogue!r} (reference, torch)")
    if backend == "triton":
        if not triton_gemm_available(device):
            raise SpecError(f"the triton W4A4 backend needs a CUDA device with Triton, got {device}")
        gap = triton_act_gap(path.act_spec) if path.quantized else "the bf16 path"
        gap = gap or triton_k_gap(k)
        if gap is not None:
            raise SpecError(f"the triton W4A4 backend cannot serve path {path.name!r}: {gap}")
    if backend == "native":
        gap = native_grouped_gemm_gap(device) if path.quantized else "the bf16 path"
        if gap is not None:
            raise SpecError(f"the native Blackwell W4A4 backend cannot serve this call: {gap}")
    if backend != Backend.AUTO:
        return Backend(backend)
    if not path.quantized or device.type != "cuda" or path.epilogue != Epilogue.DEC_PRODUCT:
        return Backend.TORCH
    native, triton = device_kernels(device)
    if native:
        return Backend.NATIVE
    if triton and triton_k_gap(k) is None and triton_act_gap(path.act_spec) is None:
        return Backend.TRITON
    return Backend.TORCH


DEVICE_KERNELS_SEEN: dict[str, tuple[bool, bool]] = {}


def device_kernels(device: torch.device) -> tuple[bool, bool]:
    """(native Blackwell GEMM, Triton GEMM) availability per device, asked once per process."""
    key = str(device)
    if key not in DEVICE_KERNELS_SEEN:
        DEVICE_KERNELS_SEEN[key] = (native_grouped_gemm_gap(device) is None,
                                triton_gemm_available(device))
    return DEVICE_KERNELS_SEEN[key]
