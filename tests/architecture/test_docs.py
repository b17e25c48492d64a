"""The documentation a user reads: the site builds without a warning, the settings page is the
generated one, the README stays a short front page whose architecture map names every package,
and every tested snippet is shown on a page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from alignd.tools.settings_table import REGENERATE, markdown

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250


def _architecture_section() -> str:
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- --8<-- [start:architecture] -->", "<!-- --8<-- [end:architecture] -->"
    assert start in text and end in text, "README.md lost its architecture section markers"
    return text[text.index(start):text.index(end)]


def test_docs_build_strict(tmp_path):
    """``mkdocs build --strict`` passes: no broken link or anchor, no page missing from the nav,
    no snippet include that points nowhere."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0 and not warnings, \
        "mkdocs build --strict failed (mkdocs-material is in the test extra):\n" + out[-4000:]
    assert (tmp_path / "site" / "operations" / "reliability" / "index.html").is_file()


def test_settings_page_is_generated():
    """docs/operations/settings.md is exactly what ``alignd config --list`` prints now."""
    page = (ROOT / "docs" / "operations" / "settings.md").read_text()
    assert page == markdown(), f"docs/operations/settings.md is out of date: run `{REGENERATE}`"


def test_readme_is_a_short_front_page():
    """README.md stays at most 250 lines; the details live in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"


def test_every_snippet_is_shown_on_a_page():
    """Each docs/snippets/*.py (run by the tests) is included by a page, so the shown code is
    the tested code."""
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for snippet in sorted((ROOT / "docs" / "snippets").glob("*.py")):
        include = f'--8<-- "docs/snippets/{snippet.name}"'
        assert include in pages, f"no page includes {snippet.name} ({include})"


def test_architecture_map_names_every_package_and_module():
    """The README's architecture map names every libalign module, every alignd and alignclient
    package or module, and every top-level folder (update the map when you add or move one)."""
    section = _architecture_section()
    names = {p.stem for p in (ROOT / "libalign").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.stem != "__init__"}
    names |= {p.name for p in (ROOT / "services" / "alignd").iterdir() if (p / "__init__.py").is_file()}
    names |= {p.stem for p in (ROOT / "clients" / "alignclient").glob("*.py") if p.stem != "__init__"}
    missing = sorted(n for n in names if not re.search(rf"`[\w./]*\b{re.escape(n)}\b[\w*/]*`", section))
    assert not missing, f"README.md's architecture section does not name: {missing}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:
        folders = {line.split("/", 1)[0] for line in tracked.stdout.splitlines()
                   if "/" in line and not line.startswith(".")}
        missing = sorted(f for f in folders if f"`{f}/" not in section)
        assert not missing, f"README.md's architecture section does not name the folders: {missing}"


def test_config_command_prints_the_page_and_masks_secrets(monkeypatch):
    """``alignd config --list`` prints the page; ``alignd config`` the ALIGN_* settings set here,
    tokens and URL passwords masked, unknown variables left out."""
    from alignd.tools.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    listed = runner.invoke(app, ["config", "--list"])
    assert listed.exit_code == 0 and listed.output == markdown()
    monkeypatch.setenv("ALIGN_API_TOKEN", "s3cret")
    monkeypatch.setenv("ALIGN_REDIS_URL", "redis://:pw@redis:6379/0")
    monkeypatch.setenv("ALIGN_NOT_A_SETTING", "1")
    shown = runner.invoke(app, ["config"])
    assert shown.exit_code == 0
    assert "ALIGN_API_TOKEN=***" in shown.output and "s3cret" not in shown.output
    assert "ALIGN_REDIS_URL=redis://:***@redis:6379/0" in shown.output
    assert "ALIGN_NOT_A_SETTING" not in shown.output
