"""Pins libalign's SGLang KV presets against SGLang's own FP4 KV-cache code on the CPU.

SGLang is installed beside the venv (see tests/services/test_sglang_quant.py), so its side runs
in a subprocess with that folder on its path (tests/services/sglang_kv_cpu.py), as a background
job (tests/background.py) started once this test is collected.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import background
from tests.services.test_sglang_quant import _env, _sglang_gap

SCRIPT = Path(__file__).with_name("sglang_kv_cpu.py")

background.register("sglang_kv", background.Job(
    ("test_sglang_kv.py::test_sglang_kv_cache_writes",), _sglang_gap,
    lambda _folder: ([sys.executable, str(SCRIPT)], _env(True)), timeout_s=600))


def test_sglang_kv_cache_writes():
    """SGLang's FP4MXBlock16KVCacheMethod (--kv-cache-dtype fp4_mx_block16; batched_quantize
    compiled, as SGLang runs it) stores, for bf16, fp16 and fp32 K/V full of exact ties, zero,
    -0.0, tiny and huge blocks, exactly kv_sglang_fp4_mx_block16's codes and exponent bytes, and
    reads back libalign's dequantized values; its cell size is libalign's bytes a token; SGLang's
    registry has both presets' --kv-cache-dtype values; NVFP4KVCacheMethod loads the per-layer
    global scales KVScales.from_checkpoint picks."""
    gap = _sglang_gap()
    if gap:
        pytest.skip(gap)
    done = background.result("sglang_kv")
    assert done.returncode == 0, done.tail()
    lines = {ln for ln in done.stdout.splitlines() if ln.startswith("ok ")}
    assert lines == {"ok block16 store", "ok cell size", "ok registry", "ok global scales"}, \
        done.tail()
