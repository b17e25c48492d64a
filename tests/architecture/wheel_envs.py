"""What tests/architecture/test_wheel.py checks, built in one go (a background job of that test,
tests/background.py): the libalign and alignclient wheels from a copy of this checkout, a fresh
virtual environment with torch and both wheels (the base install, no extras), and a fresh one
with only the alignclient wheel. Torch comes from the local wheel cache; pip must reach the
package index for small pure-Python dependencies.

Run: ``python tests/architecture/wheel_envs.py FOLDER`` (writes FOLDER/wheels, FOLDER/base,
FOLDER/client; exits non-zero, saying which command failed, when a step fails).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = os.environ.get("ALIGN_TORCH", "torch==2.13.0")


def run(cmd: list[str], cwd: Path, **env: str) -> str:
    """``cmd``'s stdout; AssertionError with its output when it fails (no PYTHONPATH leaks in)."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": "", **env})
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def python_of(venv: Path) -> Path:
    """The interpreter of the virtual environment ``venv``."""
    return venv / "bin" / "python"


def build_wheels(out: Path) -> None:
    """Both wheels into ``out``, built from a copy of the checkout (setuptools reuses an
    in-tree build/ folder, whose stale files, a module deleted since, would ride along)."""
    src = out.parent / "source" / "libalign"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".ruff_cache", ".hypothesis"))
    out.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src), str(src / "clients")], cwd=out)


def wheel(folder: Path, name: str) -> Path:
    """The ``name`` wheel (libalign or alignclient) under ``folder``."""
    (found,) = [p for p in folder.glob("*.whl") if p.name.split("-")[0] == name]
    return found


def main(folder: Path) -> int:
    wheels = folder / "wheels"
    build_wheels(wheels)
    for venv, packages in (("base", [TORCH]),
                           ("base", [wheel(wheels, "libalign"), wheel(wheels, "alignclient")]),
                           ("client", [wheel(wheels, "alignclient")])):
        if not python_of(folder / venv).exists():
            run([sys.executable, "-m", "venv", str(folder / venv)], cwd=folder)
        run([str(python_of(folder / venv)), "-m", "pip", "install", "-q", *map(str, packages)],
            cwd=folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
