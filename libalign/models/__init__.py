"""MoE model glue: stock Hugging Face Qwen3-MoE models run through libalign's execution paths.

The alignment question is asked of a real model: given one parameter version, how far apart
are the log-probabilities a learner computes and those a sampler reported, and where in the
network does the difference arise? This package supplies the pieces to ask it on any
``Qwen3MoeForCausalLM`` (a real checkpoint loads unchanged; nothing here subclasses it):

* :mod:`~libalign.models.config` – a tiny Qwen3-MoE config, a Qwen3-30B-A3B-shaped one, and
  a seeded random initializer;
* :mod:`~libalign.models.task` – a synthetic verifiable task (reversed-sum addition) and
  :mod:`~libalign.models.train` – a cached, CPU-trainable tiny model, so activations are a
  trained model's;
* :mod:`~libalign.models.paths` – the per-instance expert-forward swap that puts an
  :class:`~libalign.gemm.ExecutionPath` (``bf16``, ``nvfp4_naive``, ``nvfp4_minite``) under
  chosen layers;
* :mod:`~libalign.models.capture` – per-layer activation capture (residual stream, routing,
  FC1/FC2 outputs in token order) and forced routing;
* :mod:`~libalign.models.guided` – TRACE: the sampler captures guidance records, the learner
  rounds by them (``nvfp4_trace``);
* :mod:`~libalign.models.kv_cache` – the FP4 KV cache (K and V quantized on write, dequantized
  on read) and :mod:`~libalign.models.kv_guided` – KV guidance: the learner's K and V rounded
  as the sampler's cache rounded them;
* :mod:`~libalign.models.routing_replay` – routing replay (R3): the sampler records its top-k
  expert ids per token and MoE layer, the learner routes as recorded
  (:mod:`~libalign.models.megatron_routing` on Megatron-core);
* :mod:`~libalign.models.scoring` – the learner (teacher-forced scores), the sampler (KV-cache
  decoding that reports log-probs as it goes) and single-layer replay for the 2×2 input/path
  swap;
* :mod:`~libalign.models.strict` – strict execution: every shape-dependent op of the model
  replaced by one batch-invariant form (:mod:`libalign.strict.ops`), shared by decode and
  scoring, so the learner reproduces the sampler's log-probs bit for bit (δ = 0)
  (``with strict.use_strict(model): ...``).

Typical use::

    model, task = trained_tiny_model()
    prompts = task.prompts(32, seed=0)
    rollout = generate(model, prompts, "nvfp4_naive", max_new_tokens=8)    # sampler
    learner = score_sequences(model, rollout.sequences, rollout.prompt_lens, "bf16")
    deltas = [l - s for l, s in zip(learner, rollout.logprobs)]              # δ per token
"""

from libalign.models.capture import capture, force_routing, to_token_order
from libalign.models.config import build_model, qwen3_30b_a3b_shaped_config, tiny_config
from libalign.models.guided import CodeAgreement, capture_guidance, use_guidance
from libalign.models.kv_cache import FP4KVCache, capture_kv, kv_format, set_kv_format, use_kv_format
from libalign.models.kv_guided import (
    KVAgreement,
    check_records,
    count_kv_agreement,
    model_geometry,
    use_kv_guidance,
)
from libalign.models.paths import (
    add_observer,
    clear_weight_cache,
    current_paths,
    decoder_layers,
    experts_module,
    install_prepared_weights,
    moe_layer_indices,
    prepared_weights,
    reset_paths,
    set_path,
    use_path,
)
from libalign.models.routing_replay import (
    RoutingCapture,
    RoutingStats,
    RoutingTable,
    capture_routing,
    replay_routing,
    routing_geometry,
)
from libalign.models.scoring import (
    GenerationResult,
    generate,
    replay_layer,
    replay_moe,
    score_sequences,
)
from libalign.models.task import SyntheticTask
from libalign.models.train import (
    DEFAULT_STEPS,
    cache_root,
    checkpoint_dir,
    cpu_threads,
    heldout_accuracy,
    train_model,
    trained_tiny_model,
    training_report,
    write_dir_atomically,
)

__all__ = [
    "DEFAULT_STEPS",
    "CodeAgreement",
    "FP4KVCache",
    "GenerationResult",
    "KVAgreement",
    "RoutingCapture",
    "RoutingStats",
    "RoutingTable",
    "SyntheticTask",
    "add_observer",
    "build_model",
    "cache_root",
    "capture",
    "capture_guidance",
    "capture_kv",
    "capture_routing",
    "check_records",
    "checkpoint_dir",
    "clear_weight_cache",
    "count_kv_agreement",
    "cpu_threads",
    "current_paths",
    "decoder_layers",
    "experts_module",
    "force_routing",
    "generate",
    "heldout_accuracy",
    "install_prepared_weights",
    "kv_format",
    "model_geometry",
    "moe_layer_indices",
    "prepared_weights",
    "qwen3_30b_a3b_shaped_config",
    "replay_layer",
    "replay_moe",
    "replay_routing",
    "reset_paths",
    "routing_geometry",
    "score_sequences",
    "set_kv_format",
    "set_path",
    "tiny_config",
    "to_token_order",
    "train_model",
    "trained_tiny_model",
    "training_report",
    "use_guidance",
    "use_kv_format",
    "use_kv_guidance",
    "use_path",
    "write_dir_atomically",
]
