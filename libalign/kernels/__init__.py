"""The compiled quantize kernels: one door, its launch machinery, and how they are built.

* :mod:`~libalign.kernels.ops`: the door. Every caller quantizes through :func:`quantize` /
  :func:`quantize_many`; the door picks the kernel that serves a spec on a device (CPU SIMD
  path, CUDA variant) or falls back to the spec where none does, and the result is the same bits.
* :mod:`~libalign.kernels.calls`: parameter blocks, output allocation and launches.
* :mod:`~libalign.kernels.native`: building and loading the C++/CUDA sources of ``csrc/``
  on first use, and the CPU path chosen at run time (AVX-512, AVX2 or scalar).
* :mod:`~libalign.kernels.config`: the one typed configuration of kernels and fused passes,
  read from the environment once.

``from libalign.kernels import quantize`` (or ``from libalign.kernels import ops``).
"""

from libalign.kernels.ops import (
    BACKENDS,
    CUDA_KERNEL_VARIANTS,
    SCALE_LAYOUTS,
    DeviceBackend,
    GemmOperand,
    as_gemm_operand,
    backend_for,
    backends,
    cpu_kernel_path,
    cpu_kernel_paths,
    cuda_kernel_variant,
    kernel_gap,
    quantize,
    quantize_many,
    set_cpu_kernel_path,
)

__all__ = [
    "BACKENDS", "CUDA_KERNEL_VARIANTS", "SCALE_LAYOUTS", "DeviceBackend", "GemmOperand",
    "as_gemm_operand", "backend_for", "backends", "cpu_kernel_path", "cpu_kernel_paths",
    "cuda_kernel_variant", "kernel_gap", "quantize", "quantize_many", "set_cpu_kernel_path",
]
