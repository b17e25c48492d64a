"""Pins the libalign_minite quantization method (alignd.sampler.sglang_quant) against SGLang's own
layer classes on the CPU, and that alignd stays importable without SGLang.

SGLang is installed beside the venv, not into it (``./dev.sh test``: ``$VENV/sglang-cpu`` from
tests/services/sglang_cpu.txt), so the SGLang side runs in a subprocess with that folder on
its path (tests/services/sglang_quant_cpu.py). Skipped, saying why, only where that folder
does not hold an importable SGLang. Both subprocesses are background jobs (tests/background.py),
started once these tests are collected.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import background
from tests.services.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DIR = Path(os.environ.get("ALIGN_SGLANG_CPU", Path(sys.prefix) / "sglang-cpu"))
SCRIPT = ROOT / "tests" / "services" / "sglang_quant_cpu.py"


def _env(with_sglang: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MASTER_ADDR", "MASTER_PORT")}
    if with_sglang:
        env["PYTHONPATH"] = str(SGLANG_DIR)
    return env


def _sglang_gap() -> str | None:
    if (SGLANG_DIR / "sglang").is_dir():
        return None
    return f"no SGLang at {SGLANG_DIR}: ./dev.sh test installs it from tests/services/sglang_cpu.txt"


ABSENT_PROBE = ("import sys, alignd.sampler.sglang_engine, alignd.sampler.sglang_sampler, "
                "alignd.sampler.service; assert 'sglang' not in sys.modules; "
                "import importlib.util as u; assert u.find_spec('sglang') is None; print('ok')")

background.register("sglang_quant", background.Job(
    ("test_sglang_quant.py::test_minite_method",), _sglang_gap,
    lambda _folder: ([sys.executable, str(SCRIPT), free_port], _env(True))))
background.register("sglang_absent", background.Job(
    ("test_sglang_quant.py::test_alignd_sampler_imports_without_sglang",), lambda: None,
    lambda _folder: ([sys.executable, "-c", ABSENT_PROBE], _env(False)), timeout_s=300))


@pytest.fixture(scope="module")
def sglang_path() -> Path:
    """The SGLang install the CPU tests use (skip when there is none)."""
    gap = _sglang_gap()
    if gap:
        pytest.skip(gap)
    return SGLANG_DIR


@pytest.mark.slow
def test_minite_method_in_sglang_layers_equals_libalign_sampler_path(sglang_path):
    """SGLang's MergedColumnParallelLinear and FusedMoE, built on one CPU rank with
    --quantization libalign_minite and loaded with minite bits (per-row weight_scale_2) through
    SGLang's weight loaders, give libalign's nvfp4_minite sampler path bit for bit; the
    registration is idempotent, other methods' configs and a K split across ranks are refused;
    masked top-k slots (-1) add nothing; a reload of new bits serves them; the capture gives
    the same TRACE records as libalign's capture_guidance, and the routed experts per sequence,
    with the row keys read from SGLang's ForwardBatch (extend and decode batches, requests
    without a sequence id and padding rows keyed -1); and the files the ModelOpt exporter
    writes for a minite store version (expert stacks split per expert with their row scales, a
    dense gate/up pair, the libalign_minite config) load into those layers and give libalign's
    path on the store's bits. The linear layers hand the method weight_loader_v2. A staged
    refit of libalign's tiny Qwen3-MoE (quantize_named, buckets, load_refit, the model's own
    load_weights, SGLang's postprocess_weights) into SGLang's Qwen3MoeForCausalLM gives
    libalign's nvfp4_minite path bit for bit in every MoE block and in the q/k/v and o
    projections, for a first and a replacing version, the model untouched until a version's
    last bucket; under the modelopt preset SGLang's modelopt_fp4 parameters hold the streamed
    bits exactly (its forward needs CUDA). alignd's deterministic attention backends are
    SGLang's."""
    done = background.result("sglang_quant")
    tail = done.tail()
    assert done.returncode == 0, tail
    lines = {ln for ln in done.stdout.splitlines() if ln.startswith("ok ")}
    assert lines == {"ok registration", "ok linear", "ok moe forward", "ok reload",
                     "ok capture", "ok batch keys", "ok export", "ok model refit",
                     "ok modelopt refit", "ok deterministic backends"}, tail


def test_alignd_sampler_imports_without_sglang():
    """The SGLang adapter and the sampler service import in an environment without SGLang; only
    alignd.sampler.sglang_quant needs it."""
    done = background.result("sglang_absent")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.tail(2000)
