"""A Megatron GPT built as slime builds it with ``--spec libalign.models.megatron_spec
nvfp4_minite`` (docs/engines/slime.md). tests/libalign/test_megatron_te.py runs this file.

slime's model provider (slime/backends/megatron_utils/model_provider.py) does, for
``--spec MODULE NAME``: ``spec = import_module((MODULE, NAME))``, then
``spec(args, config, vp_stage)``, then ``GPTModel(config, transformer_layer_spec=...)``.
The lines below do the same on one CPU process with a tiny Qwen3-MoE config.
"""

from types import SimpleNamespace

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import import_module

from libalign.models import megatron as mg
from libalign.models import tiny_config
from libalign.models.megatron_cpu import cpu_shims, single_process_group

hf = tiny_config(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
with single_process_group(), cpu_shims():
    config = mg.transformer_config_from_hf(hf, moe_token_dispatcher_type="alltoall")
    args = SimpleNamespace(transformer_impl="local")      # slime's parsed arguments

    spec_fn = import_module(("libalign.models.megatron_spec", "nvfp4_minite"))  # --spec ...
    model = GPTModel(config=config, transformer_layer_spec=spec_fn(args, config, None),
                     vocab_size=hf.vocab_size, max_sequence_length=64,
                     position_embedding_type="rope")

    names = [n for n, _ in model.named_parameters() if "layers.0.mlp.experts" in n]
    print(names[0], "...", names[-1])   # linear_fc1.weight0 ... linear_fc2.weight7
    ids = torch.randint(0, hf.vocab_size, (1, 8))
    logits = model(ids, torch.arange(8)[None], None)
    print(tuple(logits.shape), mg.current_paths(model))
