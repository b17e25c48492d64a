"""With SGLang: serve a version from SGLang servers and measure the gap (docs/engines/sglang.md).

Start each server from the model (or a first export) with untempered log-probs reported and
said to be so, and the converter with the layout SGLang loads::

    SGLANG_RETURN_ORIGINAL_LOGPROB=1 SGLANG_EXPOSE_OWN_ENV_VARS=1 \\
      python -m sglang.launch_server --model-path /models/Qwen3-30B-A3B \\
      --quantization modelopt_fp4 --api-key $KEY --enable-deterministic-inference
    ALIGN_SAMPLER_LAYOUT=modelopt ALIGN_SGLANG_MODEL_DIR=/models/Qwen3-30B-A3B alignd serve converter

The converter writes each version once as a ModelOpt NVFP4 checkpoint under
``<store>/sglang/modelopt/<version>``; the engine below loads it on every server (pause, drain,
``update_weights_from_disk``, verify, continue), generates with log-probs and scores. A
server that returns tempered log-probs, runs another quantization or model, or does not take
the version is refused with a typed error. tests/services/test_sglang_fleet.py runs this file.
"""

import os

import torch
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.weight_store import WeightStore
from alignd.integrations import Monitor
from alignd.sampler.sglang_engine import SGLangSamplerEngine

version = os.environ["ALIGN_VERSION"]
exports = ModelOptExport(WeightStore(os.environ["ALIGN_STORE_DIR"]),
                         os.environ["ALIGN_SGLANG_MODEL_DIR"])
engine = SGLangSamplerEngine(os.environ["ALIGN_SGLANG_URL"].split(","), exports,
                             api_key=os.environ.get("ALIGN_SGLANG_API_KEY"), path="nvfp4_naive")
with engine:
    info = engine.load(version)  # every server, or raise; info["failed"] names any left out
    gen = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=0.8, seed=0)
    # your learner's log-probs of the same completions go here; SGLang's own prefill stands in
    learner = engine.score(gen.sequences, gen.prompt_lens)

monitor = Monitor(sampler_path=engine.path)  # pass api=... to push the batch to the daemon
metrics = monitor.observe([torch.tensor(lp) for lp in learner],
                          [torch.tensor(lp) for lp in gen.logprobs], version=version, step=0)
print(info["servers"], gen.version_id, "train_rollout_logprob_abs_diff",
      metrics["train_rollout_logprob_abs_diff"])
monitor.close()
