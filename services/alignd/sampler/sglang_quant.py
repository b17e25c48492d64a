"""libalign's row-scaled NVFP4 inside an SGLang server: ``--quantization libalign_minite``.

SGLang multiplies a quantized checkpoint through a *quantization method*: a
``QuantizationConfig`` (read from the checkpoint's ``quantization_config``) hands each layer a
``LinearMethodBase`` or ``FusedMoEMethodBase``, whose ``create_weights`` declares the
parameters the weight loader fills, ``process_weights_after_loading`` prepares them, and
``apply`` runs the forward. SGLang's own ``modelopt_fp4`` keeps one fp32 ``weight_scale_2``
per weight (a scalar), so it cannot load a ``minite`` version, whose outer scale is per row.
This module is the method that can:

Checkpoint layout (what :func:`libalign.checkpoint.to_modelopt` writes with row scales)
    ``<module>.weight``          uint8 ``[N, K/2]`` packed E2M1 codes (low nibble first)
    ``<module>.weight_scale``    float8_e4m3fn ``[N, K/16]`` block scales
    ``<module>.weight_scale_2``  float32 ``[N, 1]``: each row's outer decode scale
    Experts by per-expert names (``experts.<e>.gate_proj`` ...), as for ``modelopt_fp4``.
    ``quantization_config``: ``{"quant_method": "libalign_minite", "spec": "minite",
    "exclude_modules": [...]}`` (:func:`alignd.formats.quant_configs.minite_quantization_config`,
    written by the ModelOpt exporter, :mod:`alignd.formats.modelopt_export`), with
    ``"kv_cache_quant_algo": "NVFP4"`` when the export carries per-layer K/V global scales
    (``self_attn.attn.k_scale``/``v_scale``): the attention layers then declare them, and
    SGLang's ``--kv-cache-dtype nvfp4`` reads them instead of its default 1.0.

The row scales are declared as per-channel parameters (SGLang's ``ChannelQuantScaleParameter``
for linear layers, ``FusedMoeWeightScaleSupported.CHANNEL`` for experts), so SGLang's loaders
put each row's scale beside its row, also where they fuse (q/k/v, gate/up): per-row scales
need no shared maximum across fused siblings.

Forward (:class:`MiniteLinearMethod`, :class:`MiniteMoEMethod`)
    Exactly libalign's sampler path (:data:`libalign.gemm.PATHS` ``nvfp4_minite``): the
    stored bits become :class:`libalign.gemm.ExpertWeights` once per load
    (:func:`libalign.gemm.weights_from_quantized`), activations are quantized per row by the
    spec through the kernel door, and the product runs through :func:`libalign.gemm.grouped_linear`
    (linear layers: one group) and :func:`libalign.gemm.moe_experts_forward` (experts): exact
    inner values in a bf16 (GPU) or fp32 (CPU) GEMM, fp32 epilogue, one rounding, as on Hopper.
    Outputs equal libalign's own sampler path bit for bit on the same bits and inputs.

Capture (:class:`RecordCapture`)
    Set on the config (``config.capture``), it keeps the TRACE guidance rows of the MoE
    layers' FC1/FC2 activations (:class:`libalign.guidance.GuidanceCapture`) and their routed
    experts (:class:`libalign.models.routing_replay.RoutingCapture`), keyed by the row keys the
    caller sets for each forward (:func:`libalign.guidance.row_keys`: sequence and position),
    or that :meth:`RecordCapture.watch` reads from SGLang's ``ForwardBatch`` (request ids
    mapped to sequence ids, token positions) in eager forwards.

What it refuses (:class:`alignclient.errors.ConfigError`)
    A K sharded across ranks (a row-parallel linear with tensor parallelism, or expert tensor
    parallelism): each rank would scale its part of a row by that part's maximum, which is
    not the spec. Expert parallelism, a non-SiLU or non-gated MoE, router weights applied on
    the input, K not a multiple of 16, and any spec but ``minite``.

Registration
    :func:`register` adds the method to SGLang's ``QUANTIZATION_METHODS`` registry and to the
    ``--quantization`` choices, and names :class:`MiniteLinearMethod` in
    ``sglang.srt.layers.linear.WEIGHT_LOADER_V2_SUPPORTED``: SGLang's linear layers then give
    the method's parameters their ``weight_loader_v2``, which hands each shard to the
    parameter's own loader (``ModelWeightParameter.load_merged_column_weight``,
    ``load_qkv_weight`` ...), so the packed codes and the ``[N, 1]`` row scales land beside
    their rows in fused layers as a server's ``load_weights`` loads them. An SGLang with the
    plugin framework (0.5.23, the version the tests pin, has it; 0.5.6 has not) calls it in
    every process through its general-plugin entry point group ``sglang.srt.plugins``
    (pyproject's entry point ``libalign_minite``); an older server needs a launcher that
    calls it in each process before SGLang reads its arguments (not written here).

Weight updates
    The loaded bits become libalign's prepared weights in ``process_weights_after_loading``,
    which SGLang 0.5.23 runs after ``update_weights_from_disk`` and at ``end_weight_update``
    of a weight-update session, not after ``update_weights_from_tensor`` or
    ``update_weights_from_distributed`` alone: a refit of a ``libalign_minite`` server opens
    a session (``begin_weight_update``), sends its buckets, and ends it.

Importing this module imports SGLang; nothing else in alignd imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from alignclient.errors import ConfigError, InputError
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.parameter import ChannelQuantScaleParameter, ModelWeightParameter
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.quantization.utils import is_layer_skipped
from sglang.srt.utils import set_weight_attrs

from alignd.formats.quant_configs import (
    MINITE_METHOD,
    MINITE_PATH,
    MINITE_SPEC,
    minite_quantization_config,
)
from alignd.infra.stores.guidance import GuidanceStore
from libalign import gemm
from libalign.guidance import GuidanceCapture, indexed_keys, row_keys
from libalign.kernels import ops
from libalign.models.routing_replay import RoutingCapture
from libalign.spec import PRESETS, NumericsSpec, NVFP4Tensor

NAME = MINITE_METHOD
PATH = MINITE_PATH
SPEC = MINITE_SPEC
BLOCK = 16
quantization_config = minite_quantization_config
"""The ``quantization_config`` (and ``hf_quant_config.json``) of a minite export."""


class MiniteConfig(QuantizationConfig):
    """SGLang's view of a ``minite`` checkpoint: which layers run the method."""

    def __init__(self, exclude_modules: list[str] | None = None, spec: str = SPEC,
                 kv_cache_quant_algo: str | None = None):
        super().__init__()
        self.kv_cache_quant_algo = kv_cache_quant_algo
        """set (``NVFP4``) when the export carries per-layer K/V scales: the attention layers
        then declare ``k_scale``/``v_scale`` for SGLang's loader to fill"""
        if spec != SPEC:
            raise ConfigError(f"{NAME} serves spec {SPEC!r} (path {PATH!r}), the checkpoint "
                              f"names {spec!r}")
        self.exclude_modules = list(exclude_modules or [])
        self.capture: RecordCapture | None = None

    @classmethod
    def get_name(cls) -> str:
        """The ``--quantization`` name."""
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        """Activations the method quantizes."""
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        """Ampere and later (bf16 tensor cores); libalign picks the kernel per device."""
        return 80

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        """Where SGLang finds the config besides config.json's quantization_config."""
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MiniteConfig:
        """Read :func:`quantization_config`'s dict (refusing another method's)."""
        method = config.get("quant_method", NAME)
        if method != NAME:
            raise ConfigError(f"quantization_config names quant_method {method!r}, not {NAME!r}")
        return cls(config.get("exclude_modules") or config.get("ignore"), config.get("spec", SPEC),
                   config.get("kv_cache_quant_algo"))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The minite method for linear and fused-MoE layers not excluded; SGLang's
        ``BaseKVCacheMethod`` (``k_scale``/``v_scale`` parameters) for attention when the
        export carries K/V scales; None elsewhere."""
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
        from sglang.srt.layers.radix_attention import RadixAttention

        if isinstance(layer, LinearBase):
            if is_layer_skipped(prefix, self.exclude_modules, self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            return MiniteLinearMethod(self)
        if isinstance(layer, FusedMoE):
            return MiniteMoEMethod(self)
        if self.kv_cache_quant_algo and isinstance(layer, RadixAttention):
            return BaseKVCacheMethod(self)
        return None

    def get_scaled_act_names(self) -> list[str]:
        """No activation is pre-scaled."""
        return []


# --- bits -> libalign's prepared weights -------------------------------------------------------

def _stack(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, what: str) -> NVFP4Tensor:
    """An ``[E, N, K]`` minite tensor from loaded codes, block scales and row decode scales."""
    e, n, half = codes.shape
    outer = rows.reshape(e, n).to(torch.float32)
    if not bool(torch.isfinite(outer).all()) or bool((outer <= 0).any()):
        raise ConfigError(f"{what}: weight_scale_2 must be positive and finite in every row "
                          "(was the checkpoint loaded in full?)")
    if bool(scales.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any()):
        raise ConfigError(f"{what}: weight_scale holds NaN bytes (0x7F/0xFF)")
    return NVFP4Tensor(codes, scales, outer.contiguous(), PRESETS[SPEC], (e, n, half * 2))


def prepared(q: NVFP4Tensor) -> gemm.ExpertWeights:
    """``q`` ready for the ``nvfp4_minite`` path. A server never runs a backward, so the
    straight-through operand is a zero-stride view (no dequantized copy is kept)."""
    e, n, k = q.shape
    stand_in = torch.zeros((), dtype=torch.bfloat16, device=q.codes.device).expand(e, n, k)
    return gemm.weights_from_quantized(q, PATH, weight=stand_in)


def _check_k(k: int, what: str) -> None:
    if k % BLOCK:
        raise ConfigError(f"{what}: K={k} is not a multiple of {BLOCK}; {NAME} loads packed "
                          "NVFP4 rows of whole blocks")


# --- linear layers -----------------------------------------------------------------------------

class MiniteLinearMethod(LinearMethodBase):
    """A linear layer on minite bits: ``y = x W^T`` with row-scaled activations and weights."""

    def __init__(self, quant_config: MiniteConfig):
        self.quant_config = quant_config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """Codes, block scales and per-row ``weight_scale_2`` ``[N, 1]``."""
        del output_size, params_dtype
        if input_size_per_partition != input_size:
            raise ConfigError(f"{NAME}: this layer splits K ({input_size}) across ranks "
                              f"({input_size_per_partition} here); a row's activation scale "
                              "would cover a part of its row. Run without tensor parallelism "
                              "or exclude the layer")
        _check_k(input_size_per_partition, "linear layer")
        n, k = sum(output_partition_sizes), input_size_per_partition
        loader = extra_weight_attrs.get("weight_loader")
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=loader))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=torch.empty(n, k // BLOCK, dtype=torch.float8_e4m3fn), input_dim=1,
            output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale_2", ChannelQuantScaleParameter(
            data=torch.empty(n, 1, dtype=torch.float32), output_dim=0, weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The loaded bits as a one-expert stack for libalign's GEMM."""
        q = _stack(layer.weight.data[None], layer.weight_scale.data[None],
                   layer.weight_scale_2.data[None], "linear layer")
        layer.libalign_weights = prepared(q)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., K]`` through the ``nvfp4_minite`` product (one group of all rows)."""
        w: gemm.ExpertWeights = layer.libalign_weights
        _, n, k = w.shape
        a = x.reshape(-1, k)
        out = gemm.grouped_linear(a, w, [a.shape[0]])
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], n)


# --- routed experts ----------------------------------------------------------------------------

class MiniteMoEMethod(FusedMoEMethodBase):
    """A FusedMoE layer on minite bits, run by :func:`libalign.gemm.moe_experts_forward`."""

    def __init__(self, quant_config: MiniteConfig):
        self.quant_config = quant_config
        self.moe_runner_config = None

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        """``w13_*`` (gate rows, then up) and ``w2_*``: codes, block and per-row scales."""
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported

        del params_dtype
        if getattr(layer, "moe_tp_size", 1) != 1 or getattr(layer, "moe_ep_size", 1) != 1:
            raise ConfigError(f"{NAME}: expert tensor or expert parallelism is not served (FC2's "
                              "K would be split across ranks, or expert ids would be global)")
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        _check_k(h, "experts (hidden size)")
        _check_k(i, "experts (intermediate size)")

        def param(name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str | None):
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra_weight_attrs if kind is None
                             else {**extra_weight_attrs, "quant_method": kind})

        block, channel = FusedMoeWeightScaleSupported.BLOCK.value, FusedMoeWeightScaleSupported.CHANNEL.value
        param("w13_weight", (e, 2 * i, h // 2), torch.uint8, None)
        param("w2_weight", (e, h, i // 2), torch.uint8, None)
        param("w13_weight_scale", (e, 2 * i, h // BLOCK), torch.float8_e4m3fn, block)
        param("w2_weight_scale", (e, h, i // BLOCK), torch.float8_e4m3fn, block)
        param("w13_weight_scale_2", (e, 2 * i, 1), torch.float32, channel)
        param("w2_weight_scale_2", (e, h, 1), torch.float32, channel)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The loaded bits as libalign's gate/up and down stacks."""
        layer.libalign_gate_up = prepared(_stack(layer.w13_weight.data, layer.w13_weight_scale.data,
                                                 layer.w13_weight_scale_2.data, "experts w13"))
        layer.libalign_down = prepared(_stack(layer.w2_weight.data, layer.w2_weight_scale.data,
                                              layer.w2_weight_scale_2.data, "experts w2"))

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        """No SGLang runner: :meth:`apply` runs libalign's grouped GEMM on standard top-k."""
        if moe_runner_config.activation != "silu" or not getattr(moe_runner_config, "is_gated", True):
            raise ConfigError(f"{NAME}: the experts run SiLU(gate) * up, the model asks for "
                              f"{moe_runner_config.activation!r}")
        if moe_runner_config.apply_router_weight_on_input:
            raise ConfigError(f"{NAME}: router weights are applied to the experts' outputs")
        self.moe_runner_config = moe_runner_config

    def apply(self, layer: torch.nn.Module, dispatch_output) -> StandardCombineInput:
        """Routed experts of the dispatched tokens; capture when a :class:`RecordCapture` is set."""
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        ids, weights = topk.topk_ids, topk.topk_weights
        pad = ids < 0  # masked slots (padding): expert 0 with weight 0 changes no real row
        ids = torch.where(pad, 0, ids).long()
        weights = torch.where(pad, 0, weights)
        cap = self.quant_config.capture
        hook = cap.act_hook(layer.layer_id) if cap is not None else None
        out = gemm.moe_experts_forward(x, ids, weights, layer.libalign_gate_up, layer.libalign_down,
                                       act_hook=hook)
        if cap is not None:
            cap.route(layer.layer_id, ids, weights)
        return StandardCombineInput(hidden_states=out)


# --- capture -----------------------------------------------------------------------------------

class RecordCapture:
    """TRACE guidance rows and routed experts of the MoE layers an SGLang forward runs.

    ``layers`` are the MoE layer ids to keep (SGLang's ``layer_id``); ``num_experts`` the
    model's. Before each forward the caller names its token rows with :meth:`set_row_keys`
    (int64 ``[tokens]``, :func:`libalign.guidance.row_keys`; -1 for padding). Afterwards
    :meth:`guidance_records` and :meth:`routing_records` give one record per sequence, in
    the formats the learner and the guidance store take.
    """

    def __init__(self, layers: list[int], num_experts: int, *, routing: bool = True,
                 routing_weights: bool = False, spec: NumericsSpec | None = None):
        self.layers = sorted(set(int(x) for x in layers))
        self.guidance = GuidanceCapture(spec or PRESETS[SPEC])
        self.routing = RoutingCapture(self.layers, num_experts, routing_weights) if routing else None
        self.keys: torch.Tensor | None = None

    def set_row_keys(self, keys: torch.Tensor) -> None:
        """Name the token rows of the next forward calls."""
        self.keys = keys.reshape(-1).to(torch.int64)

    def _token_keys(self, tokens: int, device: torch.device) -> torch.Tensor:
        if self.keys is None or self.keys.numel() != tokens:
            raise ConfigError(f"{NAME} capture: the forward has {tokens} token rows, the row keys "
                              f"set name {None if self.keys is None else self.keys.numel()}")
        return self.keys.to(device)

    def act_hook(self, layer: int):
        """The activation hook of :func:`libalign.gemm.moe_experts_forward` for ``layer``
        (None when the layer is not captured): quantize by the spec and keep the rows."""
        if layer not in self.layers:
            return None

        def hook(site, a, spec, token_of, expert_of):
            q = ops.quantize(a.detach(), spec)
            rows = a.shape[0] if expert_of is None else int(token_of.max()) + 1 if token_of.numel() else 0
            keys = self._token_keys(rows, a.device)[token_of]
            if expert_of is not None:
                keys = indexed_keys(keys, expert_of)
            self.guidance.add(layer, site, q, keys)
            return q

        return hook

    def route(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep ``layer``'s top-k expert ids (and weights) per token row."""
        if self.routing is not None and layer in self.layers:
            self.routing.add(layer, self._token_keys(ids.shape[0], ids.device), ids, weights)

    def watch(self, model: torch.nn.Module, seq_id_of: Callable[[str], int | None]):
        """Set the row keys from each forward's ``ForwardBatch`` (a forward pre-hook on SGLang's
        model, whose forward takes ``(input_ids, positions, forward_batch)``); returns the hook's
        handle. ``seq_id_of(rid)`` is the libalign sequence id of an SGLang request (None: not
        captured). Hooks run only in eager forwards: start the server with CUDA graphs off."""

        def pre(_module, args, kwargs):
            batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
            if batch is not None:
                self.set_row_keys(batch_row_keys(batch, seq_id_of))

        return model.register_forward_pre_hook(pre, with_kwargs=True)

    def guidance_records(self, bits: int) -> dict:
        """``{sequence id: GuidanceRecord}`` keeping ``bits`` low bits a code."""
        return self.guidance.records(bits)

    def routing_records(self, version: str | None = None) -> dict:
        """``{sequence id: RoutingRecord}`` of the captured layers."""
        return {} if self.routing is None else self.routing.records(version)

    def store_records(self, store: GuidanceStore, version: str, rollout_ids: Mapping[int, str],
                      *, bits: int) -> dict[str, Any]:
        """Put the guidance records of the sequences in ``rollout_ids`` (sequence id -> rollout
        id) into the guidance ``store`` under ``version`` in one transaction, keeping ``bits``
        low bits a code, and return their routing records by rollout id (routing travels with
        the rollout, :class:`alignclient.models.Rollout`'s ``routing``). Then forget what was
        captured. A sequence named but not captured is an :class:`InputError` and nothing is
        stored; captured sequences left unnamed are dropped with the rest."""
        records = self.guidance_records(bits)
        missing = sorted(set(rollout_ids) - set(records))
        if missing:
            raise InputError(f"{NAME} capture: sequences {missing[:8]} were not captured "
                             f"(captured: {sorted(records)[:8]})")
        if rollout_ids:
            store.put_many(version, {rid: records[sid].encode()
                                     for sid, rid in rollout_ids.items()})
        routing = self.routing_records(version)
        out = {rid: routing[sid] for sid, rid in rollout_ids.items() if sid in routing}
        self.clear()
        return out

    def clear(self) -> None:
        """Forget what was captured (the row keys stay)."""
        self.guidance.clear()
        if self.routing is not None:
            self.routing = RoutingCapture(self.layers, self.routing.num_experts,
                                          self.routing.keep_weights)


def batch_row_keys(batch, seq_id_of: Callable[[str], int | None]) -> torch.Tensor:
    """Row keys of an SGLang ``ForwardBatch``'s token rows: each request's sequence id
    (``seq_id_of(rid)``) and each token's position; -1 for requests without an id and for
    padding rows past the batch's tokens. Extend (prefill, mixed) batches hold
    ``extend_seq_lens_cpu`` tokens a request, decode batches one."""
    positions = batch.positions.reshape(-1)
    mode = batch.forward_mode
    if mode.is_idle():
        counts: list[int] = []
    elif mode.is_extend():
        counts = [int(c) for c in batch.extend_seq_lens_cpu]
    elif mode.is_decode():
        counts = [1] * len(batch.rids)
    else:
        raise ConfigError(f"{NAME} capture: forward mode {mode} is not served (speculative "
                          "decoding is not captured)")
    ids = [seq_id_of(rid) for rid in batch.rids]
    if len(counts) != len(ids) or sum(counts) > positions.numel():
        raise ConfigError(f"{NAME} capture: {len(ids)} requests with {sum(counts)} tokens in a "
                          f"batch of {positions.numel()} rows")
    seq = torch.full((positions.numel(),), -1, dtype=torch.int64)
    seq[:sum(counts)] = torch.repeat_interleave(
        torch.tensor([-1 if i is None else int(i) for i in ids], dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int64))
    seq = seq.to(positions.device)
    return torch.where(seq >= 0, row_keys(seq.clamp(min=0), positions), -1)


# --- registration ------------------------------------------------------------------------------

def register() -> None:
    """Make ``--quantization libalign_minite`` known to SGLang in this process, and its linear
    layers load through ``weight_loader_v2`` (idempotent)."""
    from sglang.srt.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    QUANTIZATION_METHODS.setdefault(NAME, MiniteConfig)
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
    if MiniteLinearMethod.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
        WEIGHT_LOADER_V2_SUPPORTED.append(MiniteLinearMethod.__name__)
