"""Pins the native Blackwell grouped NVFP4 GEMM as far as a machine without a Blackwell GPU can.

csrc/gemm_nvfp4_sm100.cu compiles with nvcc for sm_100a against the CUTLASS headers, its
library loads and answers through the C ABI (no device: 'unavailable', shape and
architecture status codes, the struct mirror's size); compiled for another arch (sm_90) or
as a stub it answers 'unsupported architecture' instead of failing to build. In Python,
the availability check says False on a CPU (without building anything), the call raises
SpecError there and ShapeError/DTypeError for operands that do not fit, and the grouped
activation-scale layout is each expert's 128x4 swizzle, one after the other. The kernel
itself has never run: no Blackwell device exists in this project.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
from alignclient.errors import DTypeError, ShapeError, SpecError

from libalign.gemm import cutlass_grouped
from libalign.kernels import native
from libalign.spec.packing import swizzle_scales, swizzled_size, unswizzle_scales
from tests import background, kernel_env
from tests.libalign import native_builds

ARCH, SHAPE = 1, 2  # NV_GEMM_ERR_ARCH, NV_GEMM_ERR_SHAPE in csrc/gemm_abi.h


def _headers_or_skip() -> native.CutlassHeaders:
    gap = native_builds.cutlass_gap()
    if gap:
        pytest.skip(gap)
    return native.find_cutlass()


def _nvcc_sm100_or_skip() -> None:
    gap = native_builds.nvcc_sm100_gap()
    if gap:
        pytest.skip(gap)


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """An empty kernel cache and no loaded libraries, restored afterwards."""
    kernel_env.setenv(monkeypatch, "ALIGN_KERNEL_CACHE", str(tmp_path / "cache"))
    native.forget()
    yield tmp_path / "cache"
    native.forget()


def _valid_args(**over) -> native.GemmSm100Args:
    a = native.GemmSm100Args(experts=2, n=64, k=128, a_dec_per_row=1, w_dec_mode=2)
    for f in ("row_offsets", "a_codes", "a_scales", "a_dec", "w_codes", "w_scales", "w_dec",
              "out"):
        setattr(a, f, 4096)  # never dereferenced: every path below refuses first
    for k, v in over.items():
        setattr(a, k, v)
    return a


def _check_abi_without_device(lib: ctypes.CDLL) -> None:
    """What the library answers on a machine where no sm_100a kernel can run."""
    assert lib.nvfp4_gemm_sm100_args_size() == ctypes.sizeof(native.GemmSm100Args)
    assert lib.nvfp4_gemm_sm100_available() == 0
    size = ctypes.c_size_t(123)
    assert lib.nvfp4_gemm_sm100_workspace_size(ctypes.byref(_valid_args()), ctypes.byref(size)) == ARCH
    assert size.value == 0
    assert lib.nvfp4_grouped_gemm_sm100(ctypes.byref(_valid_args()), None, 0, None) == ARCH
    assert b"unsupported architecture" in lib.nvfp4_gemm_sm100_status_string(ARCH)


def _load_variant(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    native.declare(lib, "gemm_sm100")
    return lib


# ---- the build (slow: CUTLASS template instantiation) -------------------------------------

# (their nvcc runs are background jobs, started once these tests are collected: native_builds)

@pytest.mark.slow
def test_sm100a_library_compiles_with_cutlass_and_answers_without_a_device(fresh_native,
                                                                           monkeypatch):
    """nvcc builds the CUTLASS grouped GEMM for sm_100a (``native.build`` into an empty
    cache); a later build finds it by content; the library loads and says 'no device'."""
    _nvcc_sm100_or_skip()
    headers = _headers_or_skip()
    cmd = native.build_command("gemm_sm100", Path("x.cu"), Path("x.so"))
    assert "-gencode=arch=compute_100a,code=sm_100a" in cmd
    assert f"-I{headers.include}" in cmd and f"-I{headers.util_include}" in cmd
    built = background.result("gemm_sm100")
    assert built.returncode == 0, built.tail()
    print(f"gemm_sm100 build: {built.seconds:.1f} s (CUTLASS {'.'.join(map(str, headers.version))})")
    kernel_env.setenv(monkeypatch, "ALIGN_KERNEL_CACHE", str(built.folder))
    path = native.build("gemm_sm100")
    assert path == native_builds.built_library(built) and path.stat().st_size > 0  # by content
    lib = native.load_or_raise("gemm_sm100")
    _check_abi_without_device(lib)
    bad_k = _valid_args(k=48)  # K not a multiple of 32
    assert lib.nvfp4_grouped_gemm_sm100(ctypes.byref(bad_k), None, 0, None) == SHAPE
    no_out = _valid_args(out=None)
    assert lib.nvfp4_grouped_gemm_sm100(ctypes.byref(no_out), None, 0, None) == SHAPE


@pytest.mark.slow
def test_other_arch_build_compiles_to_an_architecture_error():
    """Built for sm_90, the same source compiles (empty kernel body) and answers 'unsupported'."""
    _nvcc_sm100_or_skip()
    _headers_or_skip()
    built = background.result("gemm_sm100_for_sm90")
    assert built.returncode == 0, built.tail()
    _check_abi_without_device(_load_variant(built.folder / "libvariant.so"))


def test_stub_build_answers_unsupported_architecture(tmp_path):
    """-DALIGN_GEMM_SM100_STUB (what a pre-12.8 toolkit gets) exports the same ABI, all 'unsupported'."""
    _nvcc_sm100_or_skip()
    _headers_or_skip()
    out = tmp_path / "libvariant.so"
    cmd = native_builds.variant_command(out, "-gencode=arch=compute_100a,code=sm_100a",
                                        "-DALIGN_GEMM_SM100_STUB")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_abi_without_device(_load_variant(out))


# ---- finding the headers ------------------------------------------------------------------

def test_cutlass_dir_env_must_hold_headers(tmp_path, monkeypatch):
    """A wrong ALIGN_CUTLASS_DIR is a KernelBuildError naming it, not a silent fallback."""
    kernel_env.setenv(monkeypatch, native.CUTLASS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(native.KernelBuildError, match=r"ALIGN_CUTLASS_DIR=.*nowhere"):
        native.find_cutlass()


def test_missing_cutlass_package_says_how_to_get_it(monkeypatch):
    """No env var and no nvidia-cutlass: the error names the package and the env var."""
    kernel_env.delenv(monkeypatch, native.CUTLASS_ENV)
    monkeypatch.setattr(native, "cutlass_package_root", lambda: None)
    with pytest.raises(native.KernelBuildError, match=r"nvidia-cutlass.*ALIGN_CUTLASS_DIR"):
        native.find_cutlass()


def test_cutlass_dir_env_accepts_a_source_tree(monkeypatch):
    """ALIGN_CUTLASS_DIR may name the package folder or its source/ tree; the version is read."""
    headers = _headers_or_skip()
    for root in (headers.root, headers.root.parent):
        kernel_env.setenv(monkeypatch, native.CUTLASS_ENV, str(root))
        found = native.find_cutlass()
        assert found.include == headers.include and found.version >= (*native.CUTLASS_MIN_VERSION, 0)


def test_too_old_cutlass_is_refused(tmp_path, monkeypatch):
    """A CUTLASS older than MIN_VERSION is a KernelBuildError, before any compile."""
    inc = tmp_path / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("")
    (inc / "cute" / "tensor.hpp").write_text("")
    (inc / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 3\n#define CUTLASS_MINOR 5\n#define CUTLASS_PATCH 0\n")
    util = tmp_path / "tools" / "util" / "include" / "cutlass" / "util"
    util.mkdir(parents=True)
    (util / "packed_stride.hpp").write_text("")
    kernel_env.setenv(monkeypatch, native.CUTLASS_ENV, str(tmp_path))
    with pytest.raises(native.KernelBuildError, match=r"3\.5\.0 .* too old"):
        native.find_cutlass()


def test_strict_load_refuses_when_kernels_disabled(fresh_native, monkeypatch):
    """ALIGN_KERNELS=spec: load_or_raise raises instead of building."""
    kernel_env.setenv(monkeypatch, "ALIGN_KERNELS", "spec")
    with pytest.raises(native.KernelBuildError, match="ALIGN_KERNELS=spec"):
        native.load_or_raise("gemm_sm100")
    assert not fresh_native.exists()


# ---- the cutlass_grouped API on a machine without Blackwell ------------------------------------------

def _operands(counts=(3, 0, 130), n=16, k=64, device="cpu"):
    """Valid operands (random bits) for experts with ``counts`` rows each."""
    g = torch.Generator().manual_seed(0)
    m, e, k16 = sum(counts), len(counts), k // 16
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    a_lin = torch.randint(0, 127, (m, k16), generator=g, dtype=torch.uint8)
    w_lin = torch.randint(0, 127, (e, n, k16), generator=g, dtype=torch.uint8)
    return dict(
        a_codes=torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8),
        a_scales=cutlass_grouped.grouped_activation_scales(a_lin.view(torch.float8_e4m3fn), offsets),
        a_dec=torch.rand(m, generator=g),
        row_offsets=offsets,
        w_codes=torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8),
        w_scales=swizzle_scales(w_lin.view(torch.float8_e4m3fn)),
        w_dec=torch.rand(e, n, generator=g),
    )


def test_unavailable_on_cpu_without_building(fresh_native):
    """On a CPU device (or with no CUDA at all) the answer is False, and nothing is built."""
    assert cutlass_grouped.native_grouped_gemm_available("cpu") is False
    assert "not a CUDA device" in cutlass_grouped.native_grouped_gemm_gap("cpu")
    if not torch.cuda.is_available():
        assert cutlass_grouped.native_grouped_gemm_available() is False
        assert cutlass_grouped.native_grouped_gemm_gap("cuda") == "no CUDA device is visible"
    elif torch.cuda.get_device_capability()[0] != 10:
        assert cutlass_grouped.native_grouped_gemm_available("cuda") is False
    assert not native.attempted("gemm_sm100") and not fresh_native.exists()


def test_call_on_cpu_raises_spec_error():
    """Well-formed operands on a device without the kernel: SpecError saying why."""
    with pytest.raises(SpecError, match="no native grouped GEMM serves this call: device cpu"):
        cutlass_grouped.native_grouped_gemm(**_operands())


@pytest.mark.parametrize("change, error, match", [
    (lambda o: o.update(w_codes=o["w_codes"][:, :12]), ShapeError, "N of 8"),
    (lambda o: o.update(a_codes=o["a_codes"][:, :8], w_codes=o["w_codes"][..., :8]),
     ShapeError, "K a multiple of 32"),
    (lambda o: o.update(w_codes=o["w_codes"][..., :16]), ShapeError, "K=64, weights K=32"),
    (lambda o: o.update(a_dec=o["a_dec"][:5]), ShapeError, "a_dec must be"),
    (lambda o: o.update(w_dec=o["w_dec"][:, :3]), ShapeError, "w_dec must be"),
    (lambda o: o.update(a_scales=o["a_scales"][:-1]), ShapeError, "a_scales has"),
    (lambda o: o.update(w_scales=o["w_scales"][:100]), ShapeError, "w_scales has"),
    (lambda o: o.update(row_offsets=[0, 3, 2, 133]), ShapeError, "non-decreasing"),
    (lambda o: o.update(row_offsets=[0, 3, 133]), ShapeError, "entries, the weights have E=3"),
    (lambda o: o.update(row_offsets=[0, 3, 3, 99]), ShapeError, "from 0 to 133"),
    (lambda o: o.update(a_codes=o["a_codes"].to(torch.int8)), DTypeError, "a_codes must be uint8"),
    (lambda o: o.update(w_dec=o["w_dec"].double()), DTypeError, "w_dec must be float32"),
    (lambda o: o.update(a_scales=o["a_scales"].float()), DTypeError, "a_scales must be"),
])
def test_bad_operands_raise_typed_errors(change, error, match):
    """Operands that do not fit are refused before any device question, with the reason."""
    operands = _operands()
    change(operands)
    with pytest.raises(error, match=match):
        cutlass_grouped.native_grouped_gemm(**operands)


def test_scalar_and_per_expert_decode_scales_are_accepted():
    """a_dec as one value and w_dec as [E] or one value pass validation (then: no device)."""
    operands = _operands()
    for a_dec, w_dec in ((torch.ones(1), torch.ones(3)), (torch.ones(()), torch.ones(1))):
        operands.update(a_dec=a_dec, w_dec=w_dec)
        with pytest.raises(SpecError):
            cutlass_grouped.native_grouped_gemm(**operands)


def test_grouped_activation_scales_are_per_expert_swizzles_back_to_back():
    """Expert e's bytes start at sum_{j<e} ceil(M_j/128)*128 * ceil(K16/4)*4; empty experts take none."""
    counts, k16 = (3, 0, 130, 128), 6
    offsets = [0, 3, 3, 133, 261]
    lin = torch.randint(0, 127, (sum(counts), k16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    flat = cutlass_grouped.grouped_activation_scales(lin, torch.tensor(offsets))
    cols = -(-k16 // 4) * 4
    assert flat.dtype == torch.float8_e4m3fn
    assert flat.numel() == sum(-(-c // 128) * 128 for c in counts) * cols
    at = 0
    for e, c in enumerate(counts):
        size = swizzled_size(c, k16)
        part = flat[at:at + size]
        assert torch.equal(unswizzle_scales(part, (c, k16)).view(torch.uint8),
                           lin[offsets[e]:offsets[e + 1]].view(torch.uint8))
        at += size
    assert at == flat.numel()
