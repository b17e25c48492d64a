"""Batch-invariant operations: one result per row, whatever else is in the call.

* :mod:`~libalign.strict.ops`: the operations strict execution runs (matmul in a fixed
  K order, softmax, log_softmax, norms), each giving row ``i`` the same bits alone or in a batch.
* :mod:`~libalign.strict.triton_matmul`: the K-ordered product as one Triton kernel on a GPU.
* :mod:`~libalign.strict.tensorcore`: batch-invariant tensor-core kernels (no split over K,
  row reductions in fixed chunks, element-wise passes with PyTorch's bits).
* :mod:`~libalign.strict.attention`: batch-invariant attention (key blocks from the first
  visible key, chunks folded in order).
* :mod:`~libalign.strict.device`: the two strict modes as op sets, ``device`` (those kernels on
  a GPU) and ``portable`` (:mod:`~libalign.strict.ops` everywhere).

:mod:`libalign.models.strict` puts them into a Qwen3-MoE model.
"""
