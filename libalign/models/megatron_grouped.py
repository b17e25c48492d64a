"""libalign's expert GEMM in Transformer Engine's grouped-linear slot: one parameter per expert.

Why another grouped linear
--------------------------
:class:`~libalign.models.megatron_modules.LibalignGroupedLinear` keeps an expert block as one
``[E, N, K]`` stack (the Hugging Face layout). The trainers built on Megatron-core that people
run (slime, Miles) expect what Megatron's Transformer Engine spec builds instead:
``TEGroupedMLP`` whose ``linear_fc1``/``linear_fc2`` are ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``, each holding **one parameter per local expert**, named
``weight0 .. weight{E-1}`` (``[N, K]`` each). Their weight-sync code matches
``mlp.experts.linear_fc1.weight(\\d+)``, adds the rank's expert offset, and their
``megatron_to_hf`` converters split ``linear_fc1.weight{e}`` into ``gate_proj``/``up_proj``
of expert ``e``; their gather asks every parameter for ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``. Distributed checkpoints name each expert's weight
by its global index (``sharded_state_dict``).

:class:`LibalignTEGroupedLinear` is that module with libalign's GEMM inside: built with
``TEGroupedLinear``'s signature (``num_gemms, input_size, output_size, *, parallel_mode,
config, init_method, bias, skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection``),
called as ``linear(x, m_splits) -> (out, None)``, parameters ``weight{i}`` with the tensor-
parallel attributes Transformer Engine sets, ``sharded_state_dict`` with Transformer Engine's
keys and offsets. :class:`LibalignColumnGroupedLinear` and :class:`LibalignRowGroupedLinear`
fill the ``TEColumnParallelGroupedLinear`` and ``TERowParallelGroupedLinear`` slots.

The same bits as the stack
--------------------------
The forward stacks the per-expert parameters into ``[E, N, K]`` (``torch.stack``: a copy of
the local expert weights per call) and calls the parent's forward, so every path, backend,
guided-rounding hook and finite check behaves exactly as in the stacked module; the backward
of ``torch.stack`` hands each ``weight{i}`` its slice of the stack's gradient. Outputs and
gradients equal the stacked module's bit for bit (the tests pin it). A quantized path's
weights are quantized once per weight version: the cache is keyed by every expert
parameter's storage pointer and autograd version.

What is not supported
---------------------
Expert tensor parallelism (``expert_tensor_parallel_size > 1``): a row-parallel FC2 would
quantize a slice of each activation row, and NVFP4's row scale would then see part of the
row (the sampler sees all of it), so the layout is refused with a
:class:`~libalign.errors.ConfigError` naming the option. Dense tensor parallelism (attention,
shared experts) is Megatron's own and unaffected. Biases are refused as in the stacked module.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

try:
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("libalign.models.megatron_grouped needs megatron-core: pip install "
                      "'libalign[megatron]'") from e

from libalign import gemm
from libalign.errors import ConfigError
from libalign.models.megatron_modules import LibalignGroupedLinear, PathLike

PARALLEL_MODES = ("column", "row", None)


def _pg_size(group) -> int:
    return 1 if group is None else int(group.size())


def _pg_rank(group) -> int:
    return 0 if group is None else int(group.rank())


def _groups(pg_collection):
    """``(expt_tp, ep, expt_dp)`` of a process-group collection (Megatron's own when None)."""
    if pg_collection is None:
        from megatron.core import parallel_state
        if not parallel_state.model_parallel_is_initialized():
            return None, None, None
        from megatron.core.process_groups_config import ProcessGroupCollection
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return (getattr(pg_collection, "expt_tp", None), getattr(pg_collection, "ep", None),
            getattr(pg_collection, "expt_dp", None))


def check_expert_tensor_parallel(size: int) -> None:
    """Refuse expert tensor parallelism (module docstring) by the option's name."""
    if int(size) != 1:
        raise ConfigError(
            f"libalign's expert GEMM needs expert_tensor_parallel_size=1 "
            f"(--expert-tensor-parallel-size 1), got {size}: a row-parallel FC2 would quantize "
            "part of each activation row; keep tensor parallelism for the dense layers")


class LibalignTEGroupedLinear(LibalignGroupedLinear):
    """``TEGroupedLinear``'s interface (per-expert ``weight{i}``) over libalign's grouped GEMM.

    ``path``/``backend`` as in :class:`LibalignGroupedLinear`; every helper that steers those
    (``set_path``, ``use_path``, ``set_finite_check``, ``clear_weight_cache``) finds this
    module too, since it is one.
    """

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *,
                 parallel_mode: str | None = None, config: TransformerConfig,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 is_expert: bool = True, tp_comm_buffer_name: str | None = None,
                 pg_collection=None, path: PathLike = "bf16", backend: str = "auto", **_unused):
        MegatronModule.__init__(self, config=config)  # not the parent's: it builds a stack
        if parallel_mode not in PARALLEL_MODES:
            raise ConfigError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
        if bias:
            raise ConfigError("libalign's grouped linear has no bias (--disable-bias-linear, "
                              "add_bias_linear=False)")
        if not is_expert:
            raise ConfigError("a grouped linear holds experts (is_expert=True)")
        tp, ep, edp = _groups(pg_collection)
        etp = int(getattr(config, "expert_tensor_parallel_size", 1) or 1)
        check_expert_tensor_parallel(max(_pg_size(tp), etp))
        self.expt_tp_group, self.ep_group, self.expt_dp_group = tp, ep, edp
        self.num_gemms = self.num_local_experts = num_gemms
        self.input_size, self.output_size = input_size, output_size
        self.parallel_mode = parallel_mode
        self.path = gemm.get_path(path)
        self.backend = backend
        self.check_finite = True
        self._prepared: dict[str, tuple] = {}
        device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.device("cuda", torch.cuda.current_device())
        ep_size = max(_pg_size(ep), int(config.expert_model_parallel_size))
        for i in range(num_gemms):
            master = torch.empty((output_size, input_size), dtype=torch.float32)
            if config.perform_initialization and init_method is not None:
                init_method(master)
            w = nn.Parameter(master.to(device=device, dtype=config.params_dtype))
            # what Transformer Engine's GroupedLinear sets on each weight (and slime reads)
            set_tensor_model_parallel_attributes(w, True, 1 if parallel_mode == "row" else 0, 1)
            # Megatron's DDP reduces expert gradients over the expert-data-parallel group only
            w.allreduce = not ep_size > 1
            self.register_parameter(f"weight{i}", w)

    def expert_weights(self) -> list[nn.Parameter]:
        """``[weight0, .., weight{E-1}]``."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def stacked_weight(self) -> torch.Tensor:
        """The experts as one ``[E, N, K]`` stack (differentiable into each ``weight{i}``)."""
        return torch.stack(self.expert_weights())

    def prepared(self, path: PathLike | None = None) -> gemm.ExpertWeights:
        """The stack prepared for ``path`` (default: the current one); quantized once per
        weight version, the live stack attached for the backward pass."""
        p = self.path if path is None else gemm.get_path(path)
        weights = self.expert_weights()
        live = torch.stack(weights)
        if not p.quantized:
            return gemm.ExpertWeights(p, live)
        sig = tuple((w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape)) for w in weights)
        hit = self._prepared.get(p.name)
        if hit is None or hit[0] != sig or hit[2].path is not p:
            # the entry keeps the storages alive, so equal pointers mean the same storages
            hit = (sig, [w.detach() for w in weights], gemm.prepare_weights(live.detach(), p))
            self._prepared[p.name] = hit
        return dataclasses.replace(hit[2], weight=live)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Each ``weight{i}`` as a sharded tensor of global expert ``ep_rank * E_local + i``
        (Transformer Engine's keys and offsets; no ``_extra_state``: there is no FP8 state)."""
        from megatron.core import parallel_state

        metadata = dict(metadata or {})
        if "dp_cp_group" not in metadata:
            metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        singleton = metadata.get("singleton_local_shards", False)
        n_global = _pg_size(self.ep_group) * self.num_gemms
        offset = _pg_rank(self.ep_group) * self.num_gemms
        ep_axis = len(sharded_offsets)
        tp_axis = 1 if self.parallel_mode == "row" else 0
        out = {}
        for i in range(self.num_gemms):
            g = offset + i
            if singleton:
                expert_prefix, offsets = f"{g}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, g, n_global))
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}")}, "", {f"{i}.weight": tp_axis},
                offsets, tp_group=self.expt_tp_group, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
        edp = _pg_rank(self.expt_dp_group)  # replicas along expert data parallelism
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], edp)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_gemms}, in={self.input_size}, out={self.output_size}, "
                f"parallel_mode={self.parallel_mode}, path={self.path.name}")


class LibalignColumnGroupedLinear(LibalignTEGroupedLinear):
    """The ``TEColumnParallelGroupedLinear`` slot (FC1)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
        kwargs.pop("parallel_mode", None)
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class LibalignRowGroupedLinear(LibalignTEGroupedLinear):
    """The ``TERowParallelGroupedLinear`` slot (FC2)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs):
        kwargs.pop("parallel_mode", None)
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)
