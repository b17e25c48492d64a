"""libalign: the numerical core of the learner-sampler alignment daemon (torch only).

One package or module per concept. Read it bottom up; every layer imports only layers listed
below it (an import-linter contract in pyproject.toml checks the order):

* :mod:`~libalign.models` – Qwen3-MoE glue: execution paths on a model, scoring and generation,
  teacher forcing, guidance capture and use, FP4 KV cache, routing replay, strict execution,
  the tiny model, Megatron-core modules and expert-parallel ranks;
* :mod:`~libalign.selfcheck`, :mod:`~libalign.report` – the spec checking itself, reports;
* :mod:`~libalign.gemm` (the W4A4 expert GEMM: paths, backends, autograd, MoE forward),
  :mod:`~libalign.guidance` (TRACE records and guided rounding), :mod:`~libalign.metrics`
  (δ statistics, TIS, intervals), :mod:`~libalign.strict` (batch-invariant ops),
  :mod:`~libalign.sync` (quantizing straight into a sampler's buffers),
  :mod:`~libalign.context`, :mod:`~libalign.checkpoint` (ModelOpt / compressed-tensors dicts);
* :mod:`~libalign.routing` – routing records (R3) and routing agreement;
* :mod:`~libalign.kernels` – the one door to the compiled quantize kernels (``csrc/``), their
  launches and build, and the kernels' typed configuration;
* :mod:`~libalign.spec` – the executable NVFP4/MXFP4 specification in the kernels' fp32
  operation order: constants, rounding, scale operation orders, packing, the Hadamard
  transform, presets, the reference quantizer;
* :mod:`~libalign.errors`, :mod:`~libalign.arg_checks`, :mod:`~libalign.atomic_dir` – the
  core's error classes (the wire contract's, see :mod:`alignclient.errors`), argument checks
  and directories that appear whole or not at all.
"""

__version__ = "0.1.0"

from libalign import moved as _moved

_moved.install()
