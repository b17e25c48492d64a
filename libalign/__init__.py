"""libalign: the numerical core of the learner-sampler alignment daemon (torch only).

Read it bottom up; every module imports only modules listed below it (an import-linter
contract in pyproject.toml checks the order):

* :mod:`~libalign.models` – Qwen3-MoE glue: execution paths, scoring and generation, replay,
  guidance capture and use, the tiny model, Megatron-core modules and expert-parallel ranks;
* :mod:`~libalign.selfcheck`, :mod:`~libalign.report` – the spec checking itself, reports;
* :mod:`~libalign.gemm` (W4A4 expert GEMM), :mod:`~libalign.guidance` (TRACE records and
  guided rounding), :mod:`~libalign.metrics` (δ statistics, TIS, bootstrap, routing),
  :mod:`~libalign.context`, :mod:`~libalign.checkpoint` (ModelOpt / compressed-tensors dicts);
* :mod:`~libalign.gemm_triton`, :mod:`~libalign.gemm_cutlass`, :mod:`~libalign.gemm_layout` –
  the GEMM's backends and group layout;
* :mod:`~libalign.ops` – the one door to the compiled quantize kernels (``csrc/``, built by
  :mod:`~libalign._native`), bit-identical to the spec, with :func:`~libalign.ops.backends`
  saying which backend serves each device;
* :mod:`~libalign.spec` – the executable NVFP4 specification, in the kernels' fp32 operation
  order; :mod:`~libalign.numerics` its presets;
* :mod:`~libalign.rounding`, :mod:`~libalign.scale_math`, :mod:`~libalign.packing`,
  :mod:`~libalign.hadamard` – E2M1/E4M3 rounding, scale conventions, nibble and scale layouts;
* :mod:`~libalign.errors`, :mod:`~libalign.constants`, :mod:`~libalign.atomic_dir` – the core's
  error classes (the wire contract's, see :mod:`alignclient.errors`), format constants and
  directories that appear whole or not at all.
"""

__version__ = "0.1.0"
