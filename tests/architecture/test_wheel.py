"""The package as a user installs it: wheels built from this checkout, installed into fresh virtual
environments, used outside the checkout.

* the libalign wheel installs only align-named import packages and ships the kernel sources;
  its base install (no extras) is lean and runs the native CPU kernels, compiled from the
  sources inside the wheel;
* the alignclient wheel (clients/) installs without torch and gives the sync and async clients,
  the error classes, the id rules and the wire schemas.

The wheels and environments take a minute or two to build (torch comes from the local wheel
cache): tests/architecture/wheel_envs.py builds them as a background job (tests/background.py)
while other tests run, and the tests here, run last, check them; they are marked slow, and pip
must reach the package index for small pure-Python dependencies.
"""

from __future__ import annotations

import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests import background
from tests.architecture import wheel_envs

pytestmark = pytest.mark.slow

#: What the base install must not pull in (they belong to the daemon, demo or engine extras).
NOT_IN_BASE = ("fastapi", "uvicorn", "redis", "prometheus_client", "transformers", "matplotlib",
               "fakeredis", "megatron", "sglang")

background.register("wheel_envs", background.Job(
    ("test_wheel.py::",), lambda: None,
    lambda folder: ([sys.executable, str(Path(wheel_envs.__file__)), str(folder)],
                    dict(os.environ)), timeout_s=1800, in_folder=True))


@pytest.fixture(scope="module")
def envs() -> Path:
    """The folder wheel_envs.py filled (a background job): wheels/, base/ and client/."""
    done = background.result("wheel_envs")
    assert done.returncode == 0, done.tail()
    return done.folder


@pytest.fixture(scope="module")
def wheels(envs) -> dict[str, Path]:
    """``{"libalign": wheel, "alignclient": wheel}`` built from this checkout."""
    found = {p.name.split("-")[0]: p for p in (envs / "wheels").glob("*.whl")}
    assert set(found) == {"libalign", "alignclient"}, found
    return found


def _top_level_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}


def test_wheels_install_only_align_named_packages(wheels):
    """No top-level `services` (or any other generic name): libalign, alignd, alignclient."""
    assert _top_level_names(wheels["libalign"]) == {"libalign", "alignd"}
    assert _top_level_names(wheels["alignclient"]) == {"alignclient"}
    with zipfile.ZipFile(wheels["libalign"]) as z:
        names = set(z.namelist())
    for source in ("quantize_cpu.cpp", "quantize_cpu_rows.h", "quantize_cpu_avx2.h",
                   "quantize_cpu_avx512.h", "quantize_cuda.cu", "quantize_cuda_mx.h", "nvfp4_abi.h",
                   "nvfp4_math.h"):
        assert f"libalign/csrc/{source}" in names, source


def test_base_install_runs_native_cpu_kernels_outside_the_checkout(envs, tmp_path):
    """Fresh venv, base install: lean (no daemon/demo packages) and `backend_for` a CPU BF16
    tensor is the compiled kernel built from the wheel's own sources, not the spec fallback."""
    py = wheel_envs.python_of(envs / "base")
    probe = textwrap.dedent(f"""
        import importlib.util, warnings
        warnings.simplefilter("error")          # a fallback warning fails the probe
        import torch, libalign, libalign.kernels as ops
        from libalign.spec import PRESETS, quantize, dequantize
        assert "site-packages" in libalign.__file__, libalign.__file__
        x = torch.randn(64, 64).to(torch.bfloat16)
        assert ops.backend_for(x) == "cpu", ops.backend_for(x)
        q = ops.quantize(x, PRESETS["minite"])
        assert q.bitwise_equal(quantize(x, PRESETS["minite"]))
        missing = [m for m in {NOT_IN_BASE!r} if importlib.util.find_spec(m) is not None]
        assert not missing, missing
        print("ok")
    """)
    out = wheel_envs.run([str(py), "-c", probe], cwd=tmp_path,
                         ALIGN_KERNEL_CACHE=str(tmp_path / "kcache"))
    assert out.strip().endswith("ok")
    assert list((tmp_path / "kcache").iterdir()), "no kernel was built from the wheel's sources"


def test_client_installs_without_torch(envs, tmp_path):
    """Fresh venv, only the alignclient wheel: no torch, and the clients, errors, id rules and
    schemas import and work offline."""
    py = wheel_envs.python_of(envs / "client")
    probe = textwrap.dedent("""
        import importlib.util, sys
        from alignclient import AlignClient, AsyncAlignClient
        from alignclient import errors, ids, models
        assert importlib.util.find_spec("torch") is None
        assert not any(m.split(".")[0] in {"torch", "libalign", "alignd"} for m in sys.modules)
        assert errors.error_classes()["version_not_found"] is errors.VersionNotFoundError
        assert issubclass(errors.ShapeError, ValueError)
        ids.check_version_id("run7-00042")
        try:
            ids.check_version_id("../etc")
        except errors.InputError:
            pass
        else:
            raise AssertionError("a path-like version id was accepted")
        with AlignClient("http://127.0.0.1:9", token="t", retries=0) as api:
            try:
                api.get_status()
            except errors.ApiUnreachableError:
                pass
        print("ok", AsyncAlignClient.__name__, models.__name__)
    """)
    assert wheel_envs.run([str(py), "-c", probe], cwd=tmp_path).startswith("ok")
