"""Pins the status page: headless Chromium loads it from the running API and its script renders.

``--dump-dom`` prints the DOM after the page's JavaScript ran (``--virtual-time-budget``
lets its timers and fetches finish), so the assertions see what a user sees: tables
filled from ``/v1/status``, chart legends from ``/v1/discrepancy``, the refresh counter.
The API has a token, so its data routes need it: the page gets it in the URL fragment
(``/#token=...``), or shows its prompt (``data-auth`` ``needed``/``rejected``) and no data.
Skipped only where Chromium is missing outside CI (``./dev.sh test`` installs it); in CI
a missing Chromium fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from alignd.api.app import create_app
from fastapi.testclient import TestClient

from tests.services.api_server import TOKEN, api_settings, publish_files, serve

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("chromium is not installed; ./dev.sh test installs it")
pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="chromium is not installed (./dev.sh test installs it)")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READ_TOKEN = "status-page-read-token-5e2f"


def with_token(url: str, token: str = TOKEN) -> str:
    """The status page's URL carrying ``token`` in its fragment (never sent to the server)."""
    return f"{url}/#token={token}"


def chromium(*args: str, tmp) -> str:
    """Run headless Chromium with a private profile; its stdout."""
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
           "--virtual-time-budget=5000", "--window-size=1280,1600", *args]
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium refuses to sandbox as root
    out = subprocess.run(cmd, capture_output=True, timeout=60, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def without_script(dom: str) -> str:
    """The DOM without the page's script, whose source contains the messages it renders."""
    return re.sub(r"<script>.*?</script>", "", dom, flags=re.S)


def rendered(dom: str) -> int:
    m = re.search(r'<body[^>]*data-rendered="(\d+)"', dom)
    assert m, dom[:500]
    return int(m.group(1))


def test_page_renders_with_zero_data(redis_url, tmp_path):
    """An empty daemon: the script runs, tables say so, charts say 'no data yet', no error shown."""
    app = create_app(api_settings(redis_url, tmp_path / "store"))
    with serve(app) as url:
        dom = without_script(chromium("--dump-dom", with_token(url), tmp=tmp_path))
    assert rendered(dom) >= 1
    assert "no versions yet" not in dom  # the states are listed with zero counts
    assert re.search(r"<td>published</td><td class=\"num\">0</td>", dom)
    assert 'id="error"></span>' in dom
    assert dom.count("no data yet") >= 2
    assert re.search(r"<td>api</td>", dom)  # the API's own heartbeat


def test_page_renders_versions_services_and_discrepancy(redis_url, tmp_path):
    """With data: versions by state, services, per-path series in the legends, guidance bytes."""
    store = tmp_path / "store"
    publish_files(store, "v1")
    app = create_app(api_settings(redis_url, store))
    with TestClient(app) as http:
        assert http.post("/v1/versions", json={"version_id": "v1"}, headers=AUTH).status_code == 201
        r = {"rollout_id": "r0", "prompt_len": 2, "tokens": [1, 2, 3, 4, 5],
             "logprobs": [-1.0, -2.0, -0.5], "path": "nvfp4_minite"}
        assert http.post("/v1/versions/v1/rollouts", json={"rollouts": [r]},
                         headers=AUTH).status_code == 201
        s = {"rollout_id": "r0", "logprobs": [-1.01, -1.5, -0.5], "path": "bf16"}
        assert http.post("/v1/versions/v1/scores", json={"scores": [s]}, headers=AUTH).status_code == 200
        assert http.put("/v1/guidance/v1/r0", content=b"g" * 2048, headers=AUTH).status_code == 200
    app = create_app(api_settings(redis_url, store))
    with serve(app) as url:
        dom = without_script(chromium("--dump-dom", with_token(url), tmp=tmp_path))
        shot = tmp_path / "status.png"
        chromium(f"--screenshot={shot}", with_token(url), tmp=tmp_path)
    assert rendered(dom) >= 1
    assert re.search(r"<td>published</td><td class=\"num\">1</td><td>v1</td>", dom)
    assert 'data-series="bf16/nvfp4_minite p99"' in dom
    assert 'data-series="bf16/nvfp4_minite mean"' in dom
    assert 'data-series="bf16/nvfp4_minite clip"' in dom
    assert "2.0 KiB" in dom and "3 / 4096" in dom
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def auth_state(dom: str) -> str:
    m = re.search(r'<body[^>]*data-auth="(\w+)"', dom)
    assert m, dom[:500]
    return m.group(1)


def prompt_shown(dom: str) -> bool:
    m = re.search(r'<form id="auth"[^>]*>', dom)
    assert m, dom[:500]
    return "hidden" not in m.group(0)


def test_page_asks_for_the_token_and_shows_data_once_given(redis_url, tmp_path):
    """Token configured: without one the prompt and no data; a wrong one is 'rejected'; the
    read token (or the API token) in the fragment shows the data and no prompt."""
    store = tmp_path / "store"
    publish_files(store, "v1")
    app = create_app(api_settings(redis_url, store, read_token=READ_TOKEN))
    with TestClient(app) as http:
        assert http.post("/v1/versions", json={"version_id": "v1"}, headers=AUTH).status_code == 201
    app = create_app(api_settings(redis_url, store, read_token=READ_TOKEN))
    with serve(app) as url:
        bare = without_script(chromium("--dump-dom", url + "/", tmp=tmp_path))
        wrong = without_script(chromium("--dump-dom", with_token(url, "not-the-token"),
                                        tmp=tmp_path / "wrong"))
        read = without_script(chromium("--dump-dom", with_token(url, READ_TOKEN),
                                       tmp=tmp_path / "read"))
        api = without_script(chromium("--dump-dom", with_token(url), tmp=tmp_path / "api"))
    assert auth_state(bare) == "needed" and prompt_shown(bare) and rendered(bare) == 0
    assert "needs a token" in bare and "<td>v1</td>" not in bare
    assert auth_state(wrong) == "rejected" and prompt_shown(wrong) and rendered(wrong) == 0
    assert "did not accept this token" in wrong and "<td>v1</td>" not in wrong
    for dom in (read, api):
        assert auth_state(dom) == "sent" and not prompt_shown(dom) and rendered(dom) >= 1
        assert re.search(r"<td>published</td><td class=\"num\">1</td><td>v1</td>", dom)
        assert 'id="error"></span>' in dom
        assert READ_TOKEN not in dom and TOKEN not in dom
