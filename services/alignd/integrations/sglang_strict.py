"""Strict execution on SGLang's batch-invariant kernels, for a learner beside an SGLang sampler.

An SGLang server started with ``--enable-deterministic-inference`` replaces PyTorch's matrix
products, ``log_softmax`` and ``mean`` with the Triton kernels of
``sglang.srt.batch_invariant_ops`` (a persistent matmul with one tile configuration, row
kernels that read a row in chunks of 1024). libalign's device strict mode computes with the
same tile shapes and reduction orders in its own kernels (:mod:`libalign.strict.tensorcore`);
:class:`SGLangKernels` lets a learner call SGLang's functions themselves instead::

    from alignd.integrations.sglang_strict import SGLangKernels
    from libalign.models import strict
    strict.enable(model, kernels=SGLangKernels())

What comes from SGLang: every linear (``matmul_persistent``), each expert's product (one call
per expert; the NVFP4 epilogue ``acc * (a_dec * w_dec)`` in fp32 after it), the mean inside
RMSNorm (``mean_dim``) and the log-softmax over the vocabulary. What stays libalign's:
attention (SGLang's deterministic attention runs inside its FlashInfer, FA3 or Triton
backends, which need a server), the router (softmax, top-k with ties to the lower expert) and
the per-token sum of expert outputs. SGLang routes bf16 products through DeepGEMM when
DeepGEMM is installed (``SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM``, on by default); the
bits then are DeepGEMM's, not the Triton kernel's, and a sampler must make the same choice.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from libalign import gemm
from libalign.errors import ConfigError
from libalign.strict import attention as strict_attention

__all__ = ["SGLANG_MODULE", "SGLangKernels"]

SGLANG_MODULE = "sglang.srt.batch_invariant_ops"


class SGLangKernels:
    """The :class:`libalign.strict.device.Kernels` of SGLang's batch-invariant operations.

    ``module``: the loaded ``batch_invariant_ops`` module (default: imported from SGLang;
    :class:`~libalign.errors.ConfigError` when it does not import).
    """

    name = "sglang"

    def __init__(self, module: ModuleType | None = None):
        if module is None:
            try:
                module = importlib.import_module(SGLANG_MODULE)
            except Exception as exc:  # ImportError, or SGLang's own imports failing
                raise ConfigError(f"strict kernels 'sglang' need {SGLANG_MODULE} (pip install "
                                  f"sglang, with Triton and a GPU): {exc}") from exc
        self.bi = module

    def matmul(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``a @ w.T (+ bias)`` by SGLang's ``matmul_persistent``."""
        out_dtype = out_dtype or a.dtype
        if a.shape[0] == 0:
            return a.new_empty((0, w.shape[0]), dtype=out_dtype)
        return self.bi.matmul_persistent(a, w.t(), bias=bias, out_dtype=out_dtype)

    def grouped_matmul(self, a: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor,
                       *, out_dtype: torch.dtype, a_dec: torch.Tensor | None = None,
                       w_dec: torch.Tensor | None = None) -> torch.Tensor:
        """Each expert's rows by ``matmul_persistent``; with ``a_dec``/``w_dec`` the NVFP4
        epilogue after it (:func:`libalign.gemm.epilogue`: ``acc * (a_dec[m] * w_dec[e, n])``
        in fp32, then the rounding). Counts given as a tensor are read to the host (the
        loop over experts needs them)."""
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        parts, lo = [], 0
        for e, n in enumerate(counts):
            if n:
                rows = a[lo:lo + n]
                if a_dec is None:
                    parts.append(self.matmul(rows, w[e], out_dtype=out_dtype))
                else:
                    acc = self.matmul(rows, w[e], out_dtype=torch.float32)
                    parts.append(gemm.epilogue(acc, a_dec[lo:lo + n], w_dec[e], out_dtype))
            lo += n
        if not parts:
            return a.new_empty((0, w.shape[1]), dtype=out_dtype)
        return torch.cat(parts)

    def mean_last(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 mean over the last dimension by SGLang's ``mean_dim`` (keepdim)."""
        return self.bi.mean_dim(x, -1, keepdim=True)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """SGLang's ``log_softmax`` over the last dimension, on fp32."""
        return self.bi.log_softmax(x.float(), -1)

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scaling: float) -> torch.Tensor:
        """libalign's batch-invariant attention (SGLang's runs inside its server's backends)."""
        return strict_attention.attention(q, k, v, allowed, scaling)
