"""What a sampler engine does, and the embedded one: a Hugging Face Qwen3-MoE in PyTorch.

The protocol
------------
A sampler engine serves one weight version at a time. It can

* :meth:`~SamplerEngine.load` a converted version from the weight store: the store's bits
  are checked against the manifest's SHA-256s *before* anything changes, generation is
  paused (calls in flight finish, new ones wait), the weights are switched, generation
  resumes; a version that fails verification leaves the old one serving;
* :meth:`~SamplerEngine.generate` completions for prompts, reporting the log-prob it
  assigned to every token it drew and, on request, the guidance records of its activation
  rounding (TRACE) and, on request, the routing records of its MoE layers (the top-k expert
  ids of every token it fed, :mod:`libalign.routing.records`, for routing replay, R3);
* :meth:`~SamplerEngine.score` given sequences the way it decodes (KV cache, teacher-forced).

:class:`TorchSamplerEngine` implements it on a Hugging Face model through
:mod:`libalign.models`: the experts run the engine's execution path, and for a quantized path
the GEMMs multiply exactly the codes the converter stored (installed with
:func:`libalign.models.install_prepared_weights`, never re-quantized). A version must have
been converted for the engine's path (its weight spec), or loading refuses it with a
:class:`~alignclient.errors.SpecError`. A path with a KV format (``nvfp4_minite_kv_nvfp4``,
``nvfp4_minite_kv_mxfp4``, SGLang's ``nvfp4_minite_kv_sglang_nvfp4`` and
``nvfp4_minite_kv_sglang_fp4_mx_block16``) stores K and V as FP4 bits
(:mod:`libalign.models.kv_cache`) and, when guidance is asked for, records them too (sites
``k``, ``v`` of the last ``guidance_last_layers`` decoder layers). The version's manifest must
name that KV format (``extra["kv"]``, :func:`alignd.formats.convert.check_kv_manifest`: a
:class:`~alignclient.errors.SpecError` with ``field="kv.format"`` otherwise, nothing loaded),
and the cache writes with the per-layer global scales it names, where the format takes them.
Every record names the weight version and the model's layer and KV-head counts it was made
with, which the learner checks. The SGLang adapter (:mod:`alignd.sampler.sglang_engine`)
implements the same protocol over HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from alignclient.errors import ManifestError, ShapeError, SpecError
from torch import nn

from alignd.formats.convert import check_kv_manifest
from alignd.formats.weight_store import WeightStore
from libalign import gemm, models
from libalign.guidance import GuidanceRecord, select_layers
from libalign.models import strict as strict_mode
from libalign.models.kv_cache import KVScales, kv_scales_for
from libalign.models.routing_replay import capture_routing
from libalign.models.teacher_forcing import replay_decode
from libalign.routing.records import RoutingRecord
from libalign.spec import NVFP4Tensor


@dataclass
class Generation:
    """Completions of one :meth:`SamplerEngine.generate` call, in prompt order."""

    version_id: str | None
    sequences: list[list[int]]
    prompt_lens: list[int]
    logprobs: list[list[float]]
    finished: list[bool]
    guidance: dict[int, GuidanceRecord] = field(default_factory=dict)
    """Record per prompt index (only when guidance was asked for)."""
    routing: dict[int, RoutingRecord] = field(default_factory=dict)
    """Routing record per prompt index (only when routing was asked for)."""


class SamplerEngine(Protocol):
    """Load a version, generate with log-probs (and guidance), score sequences."""

    path: str

    @property
    def version_id(self) -> str | None:
        """The version being served (None before the first load)."""

    def load(self, version_id: str) -> dict:
        """Verify, pause, switch to ``version_id``, resume; returns what was loaded."""

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, seed: int = 0,
                 guidance_bits: int | None = None) -> Generation:
        """Sample completions; with ``guidance_bits``, also the guidance records."""

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Teacher-forced log-probs of the completion tokens, as this engine decodes them."""


@runtime_checkable
class RecordsRouting(Protocol):
    """A sampler engine that records each rollout's routing: ``generate(..., routing=True)``
    fills :attr:`Generation.routing` (what a learner's routing replay needs)."""

    records_routing: bool
    """True: the engine takes ``routing=True`` in :meth:`SamplerEngine.generate`"""


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, attr = name.rpartition(".")
    return model.get_submodule(mod_name), attr


class TorchSamplerEngine:
    """The embedded sampler: a Hugging Face Qwen3-MoE running one execution path."""

    records_routing: ClassVar[bool] = True

    def __init__(self, model: nn.Module, store: WeightStore, path: str = "nvfp4_minite", *,
                 batch_size: int = 64, eos_id: int | None = None, pad_id: int = 0,
                 guidance_last_layers: int | None = None, strict: bool = False,
                 strict_ops: str = "device"):
        self.path = (strict_mode.check_path(path) if strict else gemm.get_path(path)).name
        self.model = model.eval()
        self.store = store
        self.batch_size = batch_size
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.guidance_layers = select_layers(models.moe_layer_indices(model), guidance_last_layers)
        self.geometry = models.model_geometry(model)
        self.kv_guidance_layers = select_layers(range(self.geometry["layers"]),
                                                guidance_last_layers)
        self._lock = threading.Lock()  # held by a generation; a load waits for it (pause)
        self._version: str | None = None
        models.set_path(self.model, self.path)
        self.strict = strict
        """Strict execution (:mod:`libalign.models.strict`): batch-invariant ops throughout, so
        a learner in strict mode reproduces this sampler's log-probs bit for bit; ``strict_ops``
        picks the strict mode (:data:`libalign.strict.device.MODES`)."""
        if strict:
            strict_mode.enable(self.model, strict_ops)
        models.set_kv_format(self.model, gemm.get_path(self.path).kv_spec)

    @property
    def version_id(self) -> str | None:
        """The version being served."""
        return self._version

    @property
    def device(self) -> torch.device:
        """Where the model lives."""
        return next(self.model.parameters()).device

    # --- loading --------------------------------------------------------------------------

    def _prepare(self, version_id: str) -> tuple[dict[str, torch.Tensor], dict[str, NVFP4Tensor],
                                                 KVScales | None]:
        """Read and verify a version; check it fits the model and the path, its KV format
        included (no state changes). Returns its tensors and the K/V scales to write with."""
        sv = self.store.read_version(version_id, verify=True)
        params = dict(self.model.named_parameters())
        p = gemm.get_path(self.path)
        kv = p.kv_spec
        scales = check_kv_manifest(sv.manifest.extra, None if kv is None else kv.name)
        if kv is not None:  # scales that do not cover the model's layers: refused here
            scales = kv_scales_for(kv, scales, self.geometry["layers"])
        dense: dict[str, torch.Tensor] = {}
        quantized: dict[str, NVFP4Tensor] = {}
        for name, item in sv.tensors.items():
            if name not in params:
                raise ManifestError(f"version {version_id!r}: tensor {name!r} is not a parameter "
                                    "of the served model")
            want = tuple(params[name].shape)
            if isinstance(item, NVFP4Tensor):
                if not p.quantized:
                    raise SpecError(f"version {version_id!r} holds NVFP4 bits ({item.spec.name}) "
                                    f"but this sampler runs {self.path}: convert it for bf16")
                if item.spec.to_dict() != p.weight_spec.to_dict():
                    raise SpecError(f"version {version_id!r} was converted with spec "
                                    f"{item.spec.name!r}; path {self.path} needs "
                                    f"{p.weight_spec.name!r}")
                quantized[name] = item
                value = item.dequantize(torch.float32)
            else:
                value = item
            if tuple(value.shape) != want:
                raise ShapeError(f"version {version_id!r}: {name} has shape {tuple(value.shape)}, "
                                 f"the model's parameter {want}")
            dense[name] = value
        missing = set(params) - set(dense)
        if missing:
            raise ManifestError(f"version {version_id!r} lacks {len(missing)} parameters, e.g. "
                                f"{sorted(missing)[:3]}")
        return dense, quantized, scales

    def load(self, version_id: str) -> dict:
        """Verify ``version_id`` against its manifest, pause generation, switch, resume."""
        dense, quantized, scales = self._prepare(version_id)
        dev = self.device
        with self._lock, torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in dense.items():
                params[name].copy_(value.to(dev, params[name].dtype))
            for name, q in quantized.items():
                module, attr = _owner(self.model, name)
                weights = gemm.weights_from_quantized(q.to(dev), self.path, params[name].detach())
                models.install_prepared_weights(module, self.path, attr, weights)
            models.set_kv_format(self.model, gemm.get_path(self.path).kv_spec, scales)
            self._version = version_id
        return {"version_id": version_id, "tensors": len(dense), "quantized": len(quantized)}

    # --- serving --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, seed: int = 0,
                 guidance_bits: int | None = None, routing: bool = False) -> Generation:
        """Sample completions with the served version (and capture guidance and routing
        records if asked)."""
        with self._lock, (capture_routing(self.model) if routing else nullcontext()) as route:
            if self._version is None:
                raise SpecError("the sampler has not loaded a version yet")
            kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                      batch_size=self.batch_size, eos_id=self.eos_id, pad_id=self.pad_id)
            if guidance_bits is None:
                r = models.generate(self.model, prompts, None, **kw)
                recs: dict[int, GuidanceRecord] = {}
            else:
                spec = gemm.get_path(self.path).act_spec
                with models.capture_guidance(self.model, self.guidance_layers, spec) as cap, \
                        (models.capture_kv(self.model, cap, self.kv_guidance_layers)
                         if models.kv_format(self.model) is not None else nullcontext()):
                    r = models.generate(self.model, prompts, None, **kw)
                recs = cap.records(guidance_bits)
                for rec in recs.values():
                    rec.meta.update(version=self._version, layers=self.geometry["layers"],
                                    kv_heads=self.geometry["kv_heads"])
            return Generation(self._version, r.sequences, r.prompt_lens,
                              [t.tolist() for t in r.logprobs], r.finished, recs,
                              route.records(self._version) if routing else {})

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Teacher-forced KV decode of given tokens (what this sampler reports for them)."""
        with self._lock:
            out = replay_decode(self.model, sequences, prompt_lens, self.path,
                                batch_size=self.batch_size, pad_id=self.pad_id, backend="auto")
        return [t.tolist() for t in out]
