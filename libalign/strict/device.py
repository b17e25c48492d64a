"""The two strict modes: ``device`` (tensor-core kernels) and ``portable`` (element-wise ops).

Both give row ``i`` of every operation the same bits whatever else is in the call, which is
what strict execution needs: the learner's teacher-forced log-probs equal the sampler's
decode-time ones on every token (δ = 0). They differ in what else they promise and in price:

``device`` (the default)
    On a CUDA device the batch-invariant tensor-core kernels of
    :mod:`libalign.strict.tensorcore` (no split over K, tile shapes that give a row the same
    bits, attention blocks and key chunks counted from each sequence's first key), PyTorch's
    element-wise kernels (each element computed on its own, so invariant), its row softmax
    (one warp or block per row, the reduction shaped by the row's width only) and a stable
    sort for top-k (ties to the lower index). The price of a deterministic engine; the bits
    are the device's own, and equal to a sampler that runs the same kernels (SGLang's
    batch-invariant Triton ops, :class:`Kernels` lets another set stand in). On a CPU tensor
    the ``portable`` ops serve: they are the CPU's batch-invariant implementation.
``portable``
    :mod:`libalign.strict.ops` everywhere: IEEE element-wise operations in a written-down
    order, each op the same bits on a CPU and a GPU, at the price of a K-step product loop.
    ``python -m tests.bench strict -- --device cuda`` compares a trained tiny model's
    log-probs on the GPU and the CPU (equal on every token on an H100 and an H200) and, where
    they differ, names the first module that does.

A strict op never falls back to a kernel that is not batch-invariant: asked on a device the
kernels cannot serve (a CUDA build without Triton), it raises
:class:`~libalign.errors.ConfigError` naming the op.
"""

from __future__ import annotations

from typing import Protocol

import torch

from libalign.errors import ConfigError
from libalign.strict import attention as strict_attention
from libalign.strict import ops as portable
from libalign.strict import tensorcore

__all__ = ["MODES", "DeviceOps", "Kernels", "PortableOps", "TensorCoreKernels", "op_set"]

MODES = ("device", "portable")
"""Strict modes, the default first."""


class Kernels(Protocol):
    """The batch-invariant kernels device mode calls on a CUDA tensor (the signatures of
    :mod:`libalign.strict.tensorcore`); ``name`` says whose they are."""

    name: str

    def matmul(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def grouped_matmul(self, a: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor, *,
                       out_dtype: torch.dtype, a_dec: torch.Tensor | None = None,
                       w_dec: torch.Tensor | None = None) -> torch.Tensor: ...

    def mean_last(self, x: torch.Tensor) -> torch.Tensor: ...

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scaling: float) -> torch.Tensor: ...


class TensorCoreKernels:
    """libalign's own kernels (:mod:`libalign.strict.tensorcore`)."""

    name = "libalign"
    matmul = staticmethod(tensorcore.matmul)
    grouped_matmul = staticmethod(tensorcore.grouped_matmul)
    mean_last = staticmethod(tensorcore.mean_last)
    log_softmax = staticmethod(tensorcore.log_softmax)
    attention = staticmethod(strict_attention.attention)


class PortableOps:
    """The element-wise ops of :mod:`libalign.strict.ops`, on any device."""

    mode = "portable"
    kernels = None
    linear = staticmethod(portable.linear)
    rms_norm = staticmethod(portable.rms_norm)
    softmax = staticmethod(portable.softmax)
    log_softmax = staticmethod(portable.log_softmax)
    topk_indices = staticmethod(portable.topk_indices)
    sequential_sum = staticmethod(portable.sequential_sum)
    combine_experts = staticmethod(portable.combine_experts)
    silu = staticmethod(portable.silu)
    attention = staticmethod(portable.attention)


def _stock_rms(x, weight, eps):
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


class DeviceOps:
    """Device mode: ``kernels`` (default libalign's tensor-core kernels) on CUDA tensors,
    :class:`PortableOps` on CPU tensors. Every op is differentiable: the strict forward, the
    stock formula's backward (:func:`libalign.strict.ops.strict_forward`)."""

    mode = "device"

    def __init__(self, kernels: Kernels | None = None):
        self.kernels = TensorCoreKernels() if kernels is None else kernels

    def _on_device(self, op: str, x: torch.Tensor) -> bool:
        if x.device.type == "cpu":
            return False
        tensorcore.require(op, x)
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` rounded once to ``x``'s dtype."""
        if not self._on_device("linear", x):
            return portable.linear(x, weight, bias)
        portable.check_linear(x, weight)

        def values(x_, w_, b_=None):
            out = self.kernels.matmul(x_.reshape(-1, x_.shape[-1]), w_, b_, x_.dtype)
            return out.reshape(*x_.shape[:-1], w_.shape[0])

        args = (x, weight) if bias is None else (x, weight, bias)
        return portable.strict_forward(values, torch.nn.functional.linear, *args)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3's RMSNorm, ``weight * (x * rsqrt(mean(x**2) + eps))`` with the products and the
        rounding to ``x``'s dtype in Hugging Face's order and the mean a batch-invariant kernel."""
        if not self._on_device("rms_norm", x):
            return portable.rms_norm(x, weight, eps)

        if eps > 0:
            def values(x_, w_):
                return tensorcore.rms_norm(x_, w_, eps, self.kernels.mean_last)
        else:
            def values(x_, w_):
                xf = x_.float()
                var = self.kernels.mean_last(xf * xf)
                return w_ * (xf * torch.rsqrt(var + eps)).to(x_.dtype)

        return portable.strict_forward(values, lambda x_, w_: _stock_rms(x_, w_, eps), x, weight)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 softmax over the last dimension (PyTorch's row kernel on a GPU)."""
        if not self._on_device("softmax", x):
            return portable.softmax(x)
        return torch.softmax(x.float(), -1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax over the last dimension."""
        if not self._on_device("log_softmax", x):
            return portable.log_softmax(x)
        return portable.strict_forward(self.kernels.log_softmax,
                                       lambda x_: torch.log_softmax(x_.float(), -1), x)

    def topk_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the ``k`` largest entries per row, largest first, ties to the lower index."""
        if not self._on_device("topk", scores):
            return portable.topk_indices(scores, k)
        portable.check_topk(k, scores.shape[-1])
        return torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., :k]

    def sequential_sum(self, x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
        """Left-to-right sum (element-wise additions: the same on every device; one launch on a
        GPU, :func:`libalign.strict.tensorcore.sequential_sum`)."""
        if not self._on_device("sequential_sum", x):
            return portable.sequential_sum(x, dim, keepdim)
        d = dim if dim >= 0 else x.ndim + dim

        def values(x_):
            out = tensorcore.sequential_sum(x_, d)
            return out.unsqueeze(d) if keepdim else out

        return portable.strict_forward(values, lambda x_: portable.sequential_sum(x_, d, keepdim),
                                       x)

    def combine_experts(self, y: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """A MoE layer's weighted sum of each token's expert rows, in slot order (one launch
        on a GPU: :func:`libalign.strict.tensorcore.combine_rows`, the portable form's bits)."""
        if not self._on_device("combine", y):
            return portable.combine_experts(y, slot_of, weights, out_dtype)
        fn = lambda y_, w_: tensorcore.combine_rows(y_, slot_of, w_, out_dtype)  # noqa: E731
        stock = lambda y_, w_: portable.combine_experts(y_, slot_of, w_, out_dtype)  # noqa: E731
        return portable.strict_forward(fn, stock, y, weights)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU in ``x``'s dtype (PyTorch's element-wise kernel on a GPU)."""
        if not self._on_device("silu", x):
            return portable.silu(x)
        return torch.nn.functional.silu(x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scaling: float) -> torch.Tensor:
        """Masked softmax attention, the shapes of :func:`libalign.strict.ops.attention`."""
        if not self._on_device("attention", q):
            return portable.attention(q, k, v, allowed, scaling)
        fn = lambda q_, k_, v_: self.kernels.attention(q_, k_, v_, allowed, scaling)  # noqa: E731
        stock = lambda q_, k_, v_: portable.attention_stock(q_, k_, v_, allowed, scaling)  # noqa: E731
        return portable.strict_forward(fn, stock, q, k, v)


def op_set(mode: str = "device", kernels: Kernels | None = None) -> DeviceOps | PortableOps:
    """The op set of a strict mode (:data:`MODES`); ``kernels`` only for ``device``."""
    if mode == "portable":
        if kernels is not None:
            raise ConfigError("portable strict mode runs no device kernels; kernels= is for "
                              "mode='device'")
        return PortableOps()
    if mode == "device":
        return DeviceOps(kernels)
    raise ConfigError(f"strict mode {mode!r}: choose one of {', '.join(MODES)}")
