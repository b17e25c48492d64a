"""Pins how the compiled kernels are built, cached and replaced by the spec when they can't be.

The kernels are built on first use into a cache keyed by sources, flags and compiler; a
missing compiler degrades to the reference spec with one warning (same bits, slower); the
CUDA source compiles for Hopper (sm_90) and Blackwell (sm_100a) wherever an nvcc exists,
also on machines without a GPU.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from libalign.kernels import native, ops
from libalign.spec import PRESETS, quantize
from tests import background, kernel_env
from tests.libalign import native_builds


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """An empty kernel cache and no loaded libraries, restored afterwards."""
    kernel_env.setenv(monkeypatch, "ALIGN_KERNEL_CACHE", str(tmp_path / "cache"))
    native.forget()
    yield tmp_path / "cache"
    native.forget()


def test_missing_compiler_falls_back_to_spec_with_one_warning(fresh_native, monkeypatch):
    """No compiler: ops.quantize still returns the spec's bits, and warns exactly once."""
    kernel_env.setenv(monkeypatch, "CXX", "no-such-compiler-xyz")
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ops.quantize(x, PRESETS["minite"])
        second = ops.quantize(x, PRESETS["minite"])
    unavailable = [w for w in caught if "kernel is unavailable" in str(w.message)]
    assert len(unavailable) == 1 and "no-such-compiler-xyz" in str(unavailable[0].message)
    assert first.bitwise_equal(quantize(x, PRESETS["minite"])) and second.bitwise_equal(first)
    assert ops.backend_for(x) == "spec"


def test_backends_name_the_serving_kernel_or_the_build_error(fresh_native, monkeypatch):
    """ops.backends() says per device what serves quantize: the compiled kernel, or the spec
    with the build error (a fallback visible without reading warnings)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    served = ops.backends()
    assert served["cpu"].backend == "cpu" and not served["cpu"].fallback
    assert served["cpu"].reason.startswith("compiled C++ kernel")
    assert ("cuda" in served) == torch.cuda.is_available()
    native.forget()
    kernel_env.setenv(monkeypatch, "CXX", "no-such-compiler-xyz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu = ops.backends()["cpu"]
    assert cpu.backend == "spec" and cpu.fallback
    assert "compiler 'no-such-compiler-xyz' not found" in cpu.reason
    kernel_env.setenv(monkeypatch, "ALIGN_KERNELS", "spec")
    assert "ALIGN_KERNELS=spec" in ops.backends()["cpu"].reason


def test_kernel_backend_refused_when_build_impossible(fresh_native, monkeypatch):
    """backend='kernel' with no buildable kernel is a SpecError, not a silent spec run."""
    from alignclient.errors import SpecError

    kernel_env.setenv(monkeypatch, "CXX", "no-such-compiler-xyz")
    with pytest.raises(SpecError, match="kernel unavailable: compiler 'no-such-compiler-xyz'"):
        ops.quantize(torch.randn(8, 32), PRESETS["minite"], backend="kernel")


def test_cpu_build_is_cached_by_content(fresh_native):
    """A second build finds the cached library; the name changes when the flags do."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    first = native.build("cpu")
    mtime = first.stat().st_mtime_ns
    assert native.build("cpu") == first and first.stat().st_mtime_ns == mtime
    assert list(fresh_native.glob(".build-*")) == []  # no temporary left behind


def test_spec_env_disables_kernels(fresh_native, monkeypatch):
    """ALIGN_KERNELS=spec routes every call to the reference."""
    kernel_env.setenv(monkeypatch, "ALIGN_KERNELS", "spec")
    assert ops.backend_for(torch.randn(4, 32)) == "spec"


@pytest.mark.slow
def test_cuda_source_compiles_for_hopper_and_blackwell(fresh_native, monkeypatch):
    """nvcc builds csrc/quantize_cuda.cu for sm_90 and sm_100a (no GPU needed to compile;
    ``native.build`` into an empty cache, a background job started once this test is
    collected: native_builds); a later build finds it by content."""
    gap = native_builds.nvcc_gap()
    if gap:
        pytest.skip(gap)
    archs = native_builds.cuda_archs()
    kernel_env.setenv(monkeypatch, "ALIGN_CUDA_ARCHS", archs)
    flags = native.cuda_archs(shutil.which("nvcc"))
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert ("-gencode=arch=compute_100a,code=sm_100a" in flags) == ("100a" in archs)
    built = background.result("cuda")
    assert built.returncode == 0, built.tail()
    kernel_env.setenv(monkeypatch, "ALIGN_KERNEL_CACHE", str(built.folder))
    lib = native.build("cuda")
    assert lib == native_builds.built_library(built) and lib.stat().st_size > 0


def test_cpu_build_is_portable_and_keyed_without_the_host_cpu(monkeypatch):
    """The CPU library is built for plain x86-64 (no -march=native: its SIMD paths are chosen
    at run time), so the host's CPU flags do not enter its cache key unless
    ALIGN_CPU_MARCH=native asks for a host-specific build."""
    kernel_env.delenv(monkeypatch, "ALIGN_CPU_MARCH")
    src = native.CSRC / native.SOURCES["cpu"]
    cmd = native.build_command("cpu", src, src)
    assert not any(flag.startswith("-march") for flag in cmd)
    assert "-ffp-contract=off" in cmd
    key = native.cache_key("cpu", cmd)
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : some other cpu")
    assert native.cache_key("cpu", cmd) == key
    kernel_env.setenv(monkeypatch, "ALIGN_CPU_MARCH", "native")
    cmd = native.build_command("cpu", src, src)
    assert "-march=native" in cmd
    other = native.cache_key("cpu", cmd)
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : a third cpu")
    assert native.cache_key("cpu", cmd) != other


def test_cpu_kernel_env_forces_a_path_or_refuses(fresh_native, monkeypatch):
    """ALIGN_CPU_KERNEL picks the CPU kernel's path at first load; an unknown path (or one
    the CPU lacks) is a ConfigError naming the setting, not a silent fallback."""
    from alignclient.errors import ConfigError

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    kernel_env.setenv(monkeypatch, "ALIGN_CPU_KERNEL", "scalar")
    assert ops.cpu_kernel_path() == "scalar"
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    assert ops.quantize(x, PRESETS["minite"]).bitwise_equal(quantize(x, PRESETS["minite"]))
    native.forget()
    kernel_env.setenv(monkeypatch, "ALIGN_CPU_KERNEL", "sse2")
    with pytest.raises(ConfigError, match="ALIGN_CPU_KERNEL=sse2: unknown CPU kernel path"):
        ops.quantize(x, PRESETS["minite"])
    native.forget()
    kernel_env.delenv(monkeypatch, "ALIGN_CPU_KERNEL")
    assert ops.cpu_kernel_path() == ops.cpu_kernel_paths()[0]


def test_cpu_library_keeps_wide_instructions_in_their_paths():
    """What makes the one library safe on an AVX2-only (or SSE-only) host: AVX-512 registers
    appear only in the avx512 path's functions, and no AVX instruction at all outside the
    SIMD paths (the shared code and the scalar path are plain x86-64)."""
    objdump = shutil.which("objdump")
    if objdump is None or shutil.which("g++") is None:
        pytest.skip("objdump or g++ not installed")
    if os.environ.get("ALIGN_CPU_MARCH", "").strip():
        pytest.skip("ALIGN_CPU_MARCH asks for a host-specific build")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(native.build("cpu"))],
                          capture_output=True, text=True, check=True).stdout
    where, seen = "", {"avx512": set(), "avx2": set(), "other": set()}
    for line in text.splitlines():
        if line.endswith(">:"):
            where = ("avx512" if "nv_avx512::" in line else "avx2" if "nv_avx2::" in line
                     else "other")
        elif line.startswith(" ") and "\t" in line:
            seen[where].add((line.split("\t")[1].split() or [""])[0])  # the mnemonic
            if re.search(r"%zmm|%k[0-7]", line):
                assert where == "avx512", f"AVX-512 register outside the avx512 path: {line}"
            if re.search(r"%ymm", line):
                assert where != "other", f"AVX register outside the SIMD paths: {line}"
    assert any(op.startswith("vcvtph2ps") for op in seen["avx2"])  # the paths are there
    assert seen["avx512"], "no avx512 path functions found"
    assert not {op for op in seen["other"] if op.startswith("v")}, "VEX code in shared code"


PROBE = Path(__file__).with_name("cpu_paths_probe.cpp")


@pytest.mark.parametrize("cpu, paths", [
    pytest.param(None, None, id="this-cpu"),
    pytest.param("Haswell", ("scalar", "avx2"), id="emulated-avx2-only"),
    pytest.param("Nehalem", ("scalar",), id="emulated-sse4-only"),
])
def test_cpu_library_picks_and_runs_its_paths_on_other_cpus(cpu, paths, tmp_path):
    """The built CPU library, linked into a small probe (cpu_paths_probe.cpp), detects the
    paths of the CPU it runs on and gives the scalar path's bits on every SIMD path it
    supports: here, and under qemu-x86_64 emulating an AVX2-only CPU (Haswell: the AVX2
    path runs where AVX-512 does not exist) and one without AVX (Nehalem: scalar only)."""
    gxx = shutil.which("g++")
    if gxx is None or platform.machine() != "x86_64":
        pytest.skip("needs g++ on x86-64")
    if cpu is not None and shutil.which("qemu-x86_64") is None:
        pytest.skip("qemu-x86_64 not installed (Debian/Ubuntu: apt-get install qemu-user)")
    lib = native.build("cpu")
    probe = tmp_path / "probe"
    subprocess.run([gxx, "-O2", "-std=c++17", f"-I{native.CSRC}", str(PROBE), str(lib),
                    f"-Wl,-rpath,{lib.parent}", "-o", str(probe)], check=True, capture_output=True)
    cmd = [str(probe)] if cpu is None else ["qemu-x86_64", "-cpu", cpu, str(probe)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    mask = int(run.stdout.split()[1])  # "paths <mask> best <path>"
    found = tuple(name for i, name in enumerate(native.CPU_PATHS) if mask >> i & 1)
    assert found == (paths or tuple(reversed(ops.cpu_kernel_paths())))
    compared = int(run.stdout.split("compared ")[1].split()[0])
    assert compared == 108 * (len(found) - 1)  # 108 configurations per SIMD path
