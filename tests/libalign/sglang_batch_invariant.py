"""Load SGLang's ``batch_invariant_ops.py`` from its installed wheel, without SGLang's runtime.

The file imports three helpers from ``sglang.srt`` (the DeepGEMM switch, ``is_npu``, a few
environment and device utilities) whose modules pull in SGLang's server stack. On a machine
with only torch and Triton those imports fail, so this loader executes the file itself under a
private module name with those three modules standing in (DeepGEMM off, not an NPU, the
device's SM count), taking them out of ``sys.modules`` afterwards. The kernels and their launch
parameters are SGLang's own, read from the wheel (SGLang 0.5.23 unpacked beside the venv by
``./dev.sh test``: ``.venv/sglang-cpu/sglang/srt/batch_invariant_ops/batch_invariant_ops.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

REL = Path("sglang/srt/batch_invariant_ops/batch_invariant_ops.py")
ROOT = Path(__file__).resolve().parents[2]


def source_path() -> Path | None:
    """Where SGLang's file is: beside the venv, or in an installed SGLang."""
    for base in (ROOT / ".venv" / "sglang-cpu", *map(Path, sys.path)):
        if (base / REL).is_file():
            return base / REL
    return None


def _stubs() -> dict[str, types.ModuleType]:
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def env_flag(name, default="false"):
        return os.environ.get(name, default).lower() in ("1", "true", "yes", "on")

    def sms():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def calc_diff(x, y):
        x, y = x.double(), y.double()
        return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-30))

    return {
        "sglang": module("sglang", __path__=[]),
        "sglang.srt": module("sglang.srt", __path__=[]),
        "sglang.srt.layers": module("sglang.srt.layers", __path__=[]),
        "sglang.srt.layers.deep_gemm_wrapper": module("sglang.srt.layers.deep_gemm_wrapper",
                                                      __path__=[]),
        "sglang.srt.layers.deep_gemm_wrapper.configurer": module(
            "sglang.srt.layers.deep_gemm_wrapper.configurer", ENABLE_JIT_DEEPGEMM=False),
        "sglang.srt.utils": module("sglang.srt.utils", __path__=[], is_npu=lambda: False),
        "sglang.srt.utils.common": module(
            "sglang.srt.utils.common", calc_diff=calc_diff, get_bool_env_var=env_flag,
            get_device_core_count=sms, get_dispatch_device_backend=lambda: "cuda"),
    }


def load() -> types.ModuleType | None:
    """SGLang's batch-invariant ops module, or None when the file or Triton is missing."""
    path = source_path()
    if path is None or importlib.util.find_spec("triton") is None:
        return None
    spec = importlib.util.spec_from_file_location("sglang_batch_invariant_ops", path)
    mod = importlib.util.module_from_spec(spec)
    stubs = {k: v for k, v in _stubs().items() if k not in sys.modules}
    sys.modules.update(stubs)
    try:
        spec.loader.exec_module(mod)
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    return mod
