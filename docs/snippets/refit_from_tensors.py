"""NVFP4 refit from a trainer's tensors (docs/engines/refit.md); tests/services/test_refit.py
runs this file. Random weights stand in for the trainer's; ``Server`` stands in for an
``sglang.Engine`` (or ``alignd.sampler.sglang_server.SGLangServer`` over HTTP) started with
``--quantization libalign_minite --custom-weight-loader alignd.sync.tensor.load_refit``."""

import torch
from alignd.formats.quant_configs import minite_quantization_config
from alignd.integrations.refit import quantize_params, verl_weights
from alignd.sync import tensor

config = minite_quantization_config(["model.layers.0.self_attn.q_proj"])  # the checkpoint's
g = torch.Generator().manual_seed(0)
hf = [(f"model.layers.0.mlp.experts.{e}.{p}.weight", torch.randn(64, 128, generator=g).bfloat16())
      for e in range(4) for p in ("gate_proj", "up_proj")]

# Miles / slime: convert_to_hf gave one Megatron parameter's tensors (linear_fc1 of expert 0)
fc1 = quantize_params(None, "decoder.layers.0.mlp.experts.linear_fc1.weight0", hf[:2], config)
print([name for name, _ in fc1][:3])

# verl: wrap the (name, tensor) generator handed to SGLang's update_weights
weights = list(verl_weights(iter(hf), config))


# the colocated transport itself: buckets by CUDA IPC (shared memory on CPU), staged on the server
class Server:
    """What the server does with each bucket: SGLang calls the custom loader in its process."""

    def __init__(self):
        self.model = Model()

    def update_weights_from_tensor(self, *, serialized_named_tensors, load_format, flush_cache,
                                   weight_version):
        tensor.load_refit(self.model, tensor.deserialize(serialized_named_tensors[0]))
        return {"success": True, "message": "ok"}


class Model(torch.nn.Module):
    quant_config = type("Config", (), {"get_name": lambda self: "libalign_minite"})()

    def __init__(self):
        super().__init__()
        self.loaded = {}

    def load_weights(self, named):
        self.loaded = dict(named)


server = Server()
report = tensor.send_tensor_refit(hf, server, version_id="step-1", spec="minite",
                                  bucket_bytes=16 << 10)
print(report.buckets, "buckets,", report.tensors, "tensors,", report.bytes, "bytes")
assert len(server.model.loaded) == len(weights) == 3 * len(hf)
