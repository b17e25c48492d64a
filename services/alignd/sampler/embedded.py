"""The embedded sampler as a service builds it: tiny Qwen3-MoE, torch engine, stores on Redis."""

from __future__ import annotations

from alignd.formats.weight_store import WeightStore
from alignd.infra.redis_clients import binary_client
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.telemetry import Metrics
from alignd.sampler.engine import TorchSamplerEngine
from libalign import models


def build_sampler(settings: SamplerSettings, *, metrics: Metrics | None = None):
    """``(engine, rollouts, guidance)`` for ``settings`` (the model's weights come from loads)."""
    task = models.SyntheticTask()
    model = models.build_model(models.tiny_config(vocab_size=task.vocab_size), seed=0)
    model = model.to(settings.sampler_device)
    engine = TorchSamplerEngine(model, WeightStore(settings.store_dir), settings.sampler_path,
                                eos_id=task.eos_id, pad_id=task.pad_id,
                                guidance_last_layers=settings.guidance_last_layers,
                                strict=settings.strict,
                                strict_ops=settings.strict_ops)
    rollouts = RolloutStore(binary_client(settings), settings.key_prefix, metrics=metrics)
    guidance = GuidanceStore.from_settings(settings, metrics=metrics)
    return engine, rollouts, guidance
