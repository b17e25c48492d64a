"""Pins the services' settings and start-up: one class per service holding what it reads, the
same variable meaning the same to every service, the documented ``ALIGN_*`` variables, and what
a service process does with bad settings, failures and signals (exit 2, exit 1, a clean stop)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from alignclient.errors import ConfigError, LoopError
from alignd.infra import settings as settings_mod
from alignd.infra.bus import RedisBus
from alignd.infra.service_main import run_service
from alignd.infra.settings import (
    DEFAULT_STREAM_MAXLEN,
    AllInOneSettings,
    ApiAddress,
    ApiSettings,
    ConverterSettings,
    DeliverySettings,
    GuidanceStoreSettings,
    LearnerSettings,
    SamplerSettings,
    ServiceSettings,
)
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
SERVICE_CLASSES = (ServiceSettings, GuidanceStoreSettings, DeliverySettings, ConverterSettings,
                   SamplerSettings, LearnerSettings, ApiAddress, ApiSettings)


@pytest.fixture
def clean_env(monkeypatch):
    """No ALIGN_* variable of the host leaks into the settings built here."""
    for key in [k for k in os.environ if k.startswith("ALIGN_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def own_signals():
    """Restore SIGTERM/SIGINT handlers and the root log level that run_service sets."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    level = logging.getLogger().level
    yield
    for s, h in handlers.items():
        signal.signal(s, h)
    logging.getLogger().setLevel(level)


def test_settings_from_environment(monkeypatch, tmp_path):
    """ALIGN_* variables configure Settings; bad presets and timings are refused."""
    monkeypatch.setenv("ALIGN_REDIS_URL", "redis://h:1/2")
    monkeypatch.setenv("ALIGN_STORE_DIR", str(tmp_path))
    monkeypatch.setenv("ALIGN_PRESET", "te")
    monkeypatch.setenv("ALIGN_CLAIM_IDLE_MS", "4000")
    monkeypatch.setenv("ALIGN_HEARTBEAT_MS", "1000")
    s = ConverterSettings()
    assert (s.redis_url, s.store_dir, s.preset, s.claim_idle_ms) == ("redis://h:1/2", tmp_path, "te", 4000)
    monkeypatch.setenv("ALIGN_PRESET", "fp8")
    with pytest.raises(ValueError, match="unknown preset"):
        ConverterSettings()
    monkeypatch.setenv("ALIGN_PRESET", "minite")
    monkeypatch.setenv("ALIGN_HEARTBEAT_MS", "3000")
    with pytest.raises(ValueError, match="heartbeat_ms"):
        ConverterSettings()


def test_a_service_class_refuses_what_its_service_does_not_read(clean_env):
    """A field of another service is an error in a service's class (not silently dropped),
    and the union of all services accepts every one of them."""
    for cls, foreign in ((ConverterSettings, {"api_token": "t"}),
                         (ConverterSettings, {"sampler_device": "cuda"}),
                         (SamplerSettings, {"converter_device": "cuda"}),
                         (LearnerSettings, {"max_deliveries": 3}),
                         (ApiSettings, {"store_shard_bytes": 1 << 20}),
                         (ServiceSettings, {"guidance_budget_bytes": 1000})):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            cls(**foreign)
        AllInOneSettings(**foreign)
    for cls in SERVICE_CLASSES:
        assert set(cls.model_fields) <= set(AllInOneSettings.model_fields), cls


def test_a_variable_means_the_same_to_every_service(clean_env):
    """A field several classes hold has one type, default and validation everywhere, so
    ``ALIGN_PRESET`` (say) cannot mean one thing to the converter and another to the API."""
    seen: dict[str, tuple[type, tuple]] = {}
    for cls in (*SERVICE_CLASSES, AllInOneSettings):
        for name, f in cls.model_fields.items():
            sig = (f.annotation, f.default, f.default_factory, repr(f.metadata))
            if name in seen:
                assert seen[name][1] == sig, f"{name}: {seen[name][0].__name__} vs {cls.__name__}"
            else:
                seen[name] = (cls, sig)
    for cls in (ConverterSettings, LearnerSettings, ApiSettings, AllInOneSettings):
        with pytest.raises(ValidationError, match="unknown preset"):
            cls(preset="fp8")


def test_validated_at_start(clean_env, monkeypatch):
    """Devices, engines, guidance policies, the sampler layout (modelopt needs the model
    directory) and log levels are checked when the class is built, each error naming its
    field."""
    for cls, bad in ((ConverterSettings, {"converter_device": "gpu"}),
                     (SamplerSettings, {"sampler_engine": "vllm"}),
                     (ConverterSettings, {"sampler_layout": "gguf"}),
                     (ConverterSettings, {"sampler_layout": "modelopt"}),
                     (LearnerSettings, {"guidance_bits": 9}),
                     (GuidanceStoreSettings, {"guidance_on_in_use": "drop"}),
                     (ServiceSettings, {"log_level": "LOUD"}),
                     (ServiceSettings, {"stream_maxlen": 99})):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            cls(**bad)
    monkeypatch.setenv("ALIGN_SAMPLER_DEVICE", "cuda:1")
    monkeypatch.setenv("ALIGN_SGLANG_ORIGINAL_LOGPROBS", "true")
    s = SamplerSettings()
    assert (s.sampler_device, s.sglang_original_logprobs) == ("cuda:1", True)
    assert s.stream_maxlen == DEFAULT_STREAM_MAXLEN == 10_000
    monkeypatch.setenv("ALIGN_STREAM_MAXLEN", "500")
    assert RedisBus.from_settings(ServiceSettings()).stream_maxlen == 500


def test_documented_variables_are_read(clean_env):
    """Every ALIGN_* variable the README and docs/ document is a settings field, is read by
    libalign itself (kernels, caches) or is interpolated by the compose file
    (``${ALIGN_BIND_ADDR...}``), and the settings ones reach their field."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    documented = set(re.findall(r"\bALIGN_[A-Z][A-Z_]*[A-Z]\b", "\n".join(p.read_text() for p in docs)))
    assert "ALIGN_REDIS_URL" in documented
    fields = set(AllInOneSettings.model_fields)
    core = "\n".join(p.read_text() for p in (ROOT / "libalign").rglob("*.py"))
    compose = (ROOT / "docker-compose.yml").read_text()
    for var in sorted(documented):
        name = var.removeprefix("ALIGN_").lower()
        assert name in fields or f'"{var}"' in core or "${" + var in compose, \
            f"{var} is documented but nothing reads it"


def test_streams_follow_the_key_prefix_unless_named(clean_env, monkeypatch):
    """The event streams are derived from ``key_prefix`` (the default prefix keeps the old
    names), an explicit stream name overrides that, and an empty prefix is refused."""
    default = AllInOneSettings()
    assert (default.published_stream, default.converted_stream) == (
        "libalign:events:published", "libalign:events:converted")
    run_a = ConverterSettings(key_prefix="runA")
    assert (run_a.published_stream, run_a.converted_stream) == (
        "runA:events:published", "runA:events:converted")
    monkeypatch.setenv("ALIGN_KEY_PREFIX", "runB")
    monkeypatch.setenv("ALIGN_CONVERTED_STREAM", "shared:converted")
    for s in (SamplerSettings(), ConverterSettings(), ApiSettings(), AllInOneSettings()):
        assert (s.published_stream, s.converted_stream) == ("runB:events:published",
                                                            "shared:converted"), type(s)
    assert ServiceSettings(published_stream="p").published_stream == "p"
    with pytest.raises(ValidationError, match="key_prefix"):
        ServiceSettings(key_prefix="")


def test_resolved_api_url(clean_env):
    """Clients reach a wildcard-bound API on loopback; ALIGN_API_URL wins when set."""
    assert ApiAddress(api_host="0.0.0.0", api_port=9000).resolved_api_url == "http://127.0.0.1:9000"
    assert ApiAddress(api_url="http://api:8000/").resolved_api_url == "http://api:8000"
    assert ApiSettings(api_host="10.0.0.2").resolved_api_url == "http://10.0.0.2:8000"


def test_the_old_single_class_name_warns(clean_env):
    """``Settings`` still imports, with a DeprecationWarning naming the classes to use."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls = settings_mod.Settings
    assert cls is AllInOneSettings
    assert any(issubclass(w.category, DeprecationWarning) and "ConverterSettings" in str(w.message)
               for w in caught)
    with pytest.raises(AttributeError):
        settings_mod.NoSuchSettings  # noqa: B018


# --- what a service process does around its loop --------------------------------------------

def test_run_service_bad_settings_exit_2(clean_env, own_signals, monkeypatch, caplog):
    """A bad variable is logged naming the field and the process exits 2 before ``run``."""
    monkeypatch.setenv("ALIGN_CONVERTER_DEVICE", "gpu")
    ran = []
    with caplog.at_level(logging.ERROR):
        status = run_service(logging.getLogger("t"), ConverterSettings, lambda s, stop: ran.append(s))
    assert status == 2 and ran == []
    assert "bad settings" in caplog.text and "converter_device" in caplog.text


def test_run_service_status_errors_and_log_level(clean_env, own_signals, monkeypatch, caplog):
    """``run``'s status is the exit status (None: 0); an AlignError is logged and exits 1, a
    ConfigError (a configuration error found while running) exits 2; ALIGN_LOG_LEVEL sets the
    level."""
    log = logging.getLogger("t")
    monkeypatch.setenv("ALIGN_LOG_LEVEL", "WARNING")
    got = []
    assert run_service(log, ServiceSettings, lambda s, stop: got.append(s.log_level)) == 0
    assert got == ["WARNING"] and logging.getLogger().level == logging.WARNING
    assert run_service(log, ServiceSettings, lambda s, stop: 3) == 3

    def misconfigured(settings, stop):
        raise ConfigError("no engine here")

    def fail(settings, stop):
        raise LoopError("the loop stopped")

    with caplog.at_level(logging.ERROR):
        assert run_service(log, ServiceSettings, misconfigured) == 2
        assert run_service(log, ServiceSettings, fail) == 1
    assert "configuration error: no engine here" in caplog.text and "the loop stopped" in caplog.text


def test_run_service_stops_on_sigterm(clean_env, own_signals):
    """SIGTERM sets the event ``run`` watches: the loop finishes and the process exits 0."""
    def run(settings, stop):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        return None

    assert run_service(logging.getLogger("t"), ServiceSettings, run) == 0


def test_api_process_exits_2_on_bad_settings():
    """``python -m alignd.api.main`` with an unusable setting logs 'bad settings' naming the
    variable and exits 2 (as the other services do), instead of a traceback."""
    env = {**os.environ, "ALIGN_API_PORT": "not-a-port", "ALIGN_DEV_MODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "alignd.api.main"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad settings" in proc.stderr and "api_port" in proc.stderr
    assert "Traceback" not in proc.stderr
