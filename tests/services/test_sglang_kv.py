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


def test_sglang_sampler_takes_sglangs_own_kv_formats():
    """The SGLang sampler stands for nvfp4_minite with SGLang's FP4 KV caches and names the
    --kv-cache-dtype each needs; libalign's own KV formats and guided KV paths stay refused."""
    from alignclient.errors import ConfigError
    from alignd.sampler.sglang_sampler import kv_cache_dtype, sglang_path

    for kv, dtype in (("kv_sglang_nvfp4", "nvfp4"), ("kv_sglang_fp4_mx_block16", "fp4_mx_block16")):
        assert sglang_path(f"nvfp4_minite_{kv}") == f"nvfp4_minite_{kv}"
        assert kv_cache_dtype(f"nvfp4_minite_{kv}") == dtype
        with pytest.raises(ConfigError, match=f"nvfp4_trace_{kv}"):
            sglang_path(f"nvfp4_trace_{kv}")
    assert kv_cache_dtype("nvfp4_minite") is None
    with pytest.raises(ConfigError, match="nvfp4_minite_kv_nvfp4"):
        sglang_path("nvfp4_minite_kv_nvfp4")


def test_server_kv_cache_dtype_must_match_the_path():
    """A server whose --kv-cache-dtype is not the path's FP4 format, or an FP4 cache under a
    path without one, is an EngineMismatchError with field kv_cache_dtype."""
    from alignclient.errors import EngineMismatchError
    from alignd.sampler.sglang_server import check_kv_cache_dtype

    check_kv_cache_dtype("u", {"kv_cache_dtype": "nvfp4"}, "nvfp4_minite_kv_sglang_nvfp4")
    check_kv_cache_dtype("u", {"kv_cache_dtype": "auto"}, "nvfp4_minite")
    for info, path in (({"kv_cache_dtype": "auto"}, "nvfp4_minite_kv_sglang_nvfp4"),
                       ({"kv_cache_dtype": "fp4_mx_block16"}, "nvfp4_minite_kv_sglang_nvfp4"),
                       ({"kv_cache_dtype": "nvfp4"}, "nvfp4_minite")):
        with pytest.raises(EngineMismatchError) as err:
            check_kv_cache_dtype("u", info, path)
        assert err.value.field == "kv_cache_dtype"


def test_manifest_names_the_kv_format_and_a_disagreeing_sampler_is_refused(tmp_path):
    """kv_manifest records the KV preset, SGLang's --kv-cache-dtype and the scales with their
    source; check_kv_manifest refuses a sampler running another KV format, naming kv.format."""
    from alignclient.errors import SpecError
    from alignd.formats.convert import check_kv_manifest, kv_manifest

    from libalign.models.kv_cache import KVScales

    scales = KVScales.from_checkpoint({0: 0.02}, {0: 0.5}, 1)
    kv = kv_manifest("kv_sglang_nvfp4", scales)
    assert kv == {"format": "kv_sglang_nvfp4", "sglang_kv_cache_dtype": "nvfp4",
                  "scales": scales.to_dict()}
    assert kv_manifest("kv_nvfp4")["sglang_kv_cache_dtype"] is None and kv_manifest(None) is None
    with pytest.raises(SpecError, match="takes no k_scale"):
        kv_manifest("kv_sglang_fp4_mx_block16", scales)
    check_kv_manifest({"kv": kv}, "kv_sglang_nvfp4")
    for extra, runs in (({"kv": kv}, "kv_sglang_fp4_mx_block16"), ({}, "kv_sglang_nvfp4")):
        with pytest.raises(SpecError, match=r"field kv\.format"):
            check_kv_manifest(extra, runs)
