"""Prometheus config, recording rules, alerts and the Grafana dashboard, checked with the real tools.

Static checks run ``promtool`` (check config, check rules, the rule unit tests) and read the
dashboard: fixed uid and title, every panel on the provisioned data source, every metric a
query names defined in :mod:`alignd.infra.telemetry` (or recorded by a rule).

The integration test runs the services in this process, each on its own metrics registry
as in a deployment, over a private redis-server: the control API (uvicorn thread), the
converter and a sampler (threads serving ``/metrics`` on ``metrics_port``) and the learner's
real entry point (``alignd.learner.main.main``, two steps). A real ``prometheus`` built from
``deploy/prometheus/prometheus.yml`` (same jobs and rule files, loopback targets, 1 s scrape
and evaluation intervals) scrapes them; then every dashboard query (Grafana's macros
substituted) and every recording rule must return finite data, every rule must evaluate
without error, and every service's exposition must pass ``promtool check metrics``.

Missing ``promtool``/``prometheus`` skip these tests with the reason outside CI; in CI they
fail (``./dev.sh test`` installs the Debian package ``prometheus``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from alignd.converter.main import run_converter
from alignd.infra.settings import AllInOneSettings
from alignd.infra.telemetry import Metrics
from prometheus_client.parser import text_string_to_metric_families

from tests.services.conftest import REDIS_SERVER, RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "rules" / "libalign.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules" / "libalign_test.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "libalign.json"
DS_UID = "libalign-prometheus"
#: What the test puts in place of Grafana's macros (a 1 s scrape makes 1m plenty).
MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
JOBS = ("api", "converter", "sampler", "learner", "prometheus")
TOKEN = "monitoring-token-0123456789"

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")


def _needs_tools() -> None:
    """Skip without promtool/prometheus, except in CI, where that is a set-up failure."""
    if PROMTOOL and PROMETHEUS:
        return
    if os.environ.get("CI"):
        pytest.fail("promtool/prometheus are missing in CI; ./dev.sh test installs the Debian "
                    "package prometheus")
    pytest.skip("promtool/prometheus are not installed (./dev.sh test installs the Debian "
                "package prometheus)")


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _targets(dash: dict) -> list[tuple[dict, dict]]:
    """(panel, target) of every query, rows' nested panels included."""
    out = []
    for p in dash["panels"]:
        for q in [p, *p.get("panels", [])]:
            out += [(q, t) for t in q.get("targets", [])]
    return out


def _substitute(expr: str) -> str:
    for macro, value in MACROS.items():
        expr = expr.replace(macro, value)
    assert "$" not in expr, f"an unknown Grafana variable is left in {expr!r}"
    return expr


_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _metric_names(expr: str) -> set[str]:
    """Names in a PromQL expression that are libalign metrics, recorded series or ``up``."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values are not names
    return {n for n in _IDENT.findall(bare) if n.startswith(("libalign_", "libalign:")) or n == "up"}


def _exported_names() -> set[str]:
    """Every sample name the services can export (from telemetry's one registry)."""
    names: set[str] = set()
    for fam in Metrics().registry.collect():
        if fam.type == "counter":
            names |= {f"{fam.name}_total", f"{fam.name}_created"}
        elif fam.type == "histogram":
            names |= {f"{fam.name}_{s}" for s in ("bucket", "sum", "count", "created")}
        else:
            names.add(fam.name)
    return names


# --- static checks -------------------------------------------------------------------------

def test_promtool_check_config():
    """prometheus.yml is valid for promtool and its rule files resolve and load."""
    _needs_tools()
    r = _promtool("check", "config", str(PROM_CONFIG.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout + r.stderr


def test_scrape_config_covers_the_services():
    """Jobs api (static, /metrics), converter, sampler (incl. sampler-cpu) and learner by DNS."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    assert cfg["global"]["scrape_interval"] == "15s"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    assert jobs["api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert jobs["api"].get("metrics_path", "/metrics") == "/metrics"
    for job, names, port in (("converter", {"converter"}, 9101),
                             ("sampler", {"sampler", "sampler-cpu"}, 9102),
                             ("learner", {"learner"}, 9103)):
        (sd,) = jobs[job]["dns_sd_configs"]
        assert set(sd["names"]) == names and sd["port"] == port and sd["type"] == "A"
    # the unit-test file beside the rules is not a rule file: it must not be loaded
    assert [(PROM_CONFIG.parent / f).resolve() for f in cfg["rule_files"]] == [RULES]


def test_promtool_check_rules():
    """The rule file passes promtool's checks."""
    _needs_tools()
    r = _promtool("check", "rules", str(RULES.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests():
    """promtool test rules: every case in libalign_test.yml passes."""
    _needs_tools()
    r = _promtool("test", "rules", str(RULE_TESTS.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rule_unit_tests_cover_every_alert():
    """Each alert has a firing and a quiet case; recording rules are tested too."""
    rules = _rules()
    alerts = {r["alert"] for r in rules if "alert" in r}
    records = {r["record"] for r in rules if "record" in r}
    firing: set[str] = set()
    quiet: set[str] = set()
    tested_exprs = []
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for a in case.get("alert_rule_test", []):
            (firing if a.get("exp_alerts") else quiet).add(a["alertname"])
        tested_exprs += [e["expr"] for e in case.get("promql_expr_test", [])]
    assert firing == alerts, f"alerts without a firing case: {alerts - firing}"
    assert quiet == alerts, f"alerts without a quiet case: {alerts - quiet}"
    tested_records = {n for e in tested_exprs for n in _metric_names(e)} & records
    assert len(tested_records) >= 4, tested_records
    for r in rules:
        if "alert" in r:
            assert r.get("for") and r["labels"]["severity"] in ("warning", "critical")
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_dashboard_and_provisioning():
    """Fixed uid and title; every panel and query on the provisioned Prometheus uid."""
    dash = _dashboard()
    assert dash["uid"] == "libalign-main" and dash["title"] == "libalign"
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (src,) = ds["datasources"]
    assert src["uid"] == DS_UID and src["type"] == "prometheus"
    assert src["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "libalign.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert p["targets"], p["title"]
    for p, t in _targets(dash):
        assert t["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert t["expr"].strip(), p["title"]
    titles = " | ".join(p["title"] for p in panels)
    for want in ("P99 |δ|", "Mean |δ|", "Clip potential", "TIS truncated", "Sync latency",
                 "Conversion GB/s", "Weight-version lag", "Guidance store bytes",
                 "Guidance hit ratio", "Services"):
        assert want in titles, want
    exprs = " ".join(t["expr"] for _, t in _targets(dash))
    assert "$__rate_interval" in exprs and "$__interval" in exprs
    assert "libalign_sync_stage_seconds_bucket" in exprs


def test_queries_use_only_exported_metrics():
    """Every name in a dashboard query or rule is exported by telemetry or recorded by a rule."""
    rules = _rules()
    known = _exported_names() | {r["record"] for r in rules if "record" in r} | {"up"}
    used = {(p["title"], n) for p, t in _targets(_dashboard()) for n in _metric_names(t["expr"])}
    used |= {(r.get("record") or r["alert"], n) for r in rules for n in _metric_names(r["expr"])}
    unknown = sorted((where, n) for where, n in used if n not in known)
    assert not unknown, unknown
    assert len({n for _, n in used}) >= 20


# --- integration: live services, a real prometheus ----------------------------------------

class Prometheus:
    """A prometheus process on loopback over a temporary data directory."""

    def __init__(self, workdir: Path, config: dict, port: int):
        self.port, self.workdir = port, workdir
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.tail()
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def tail(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _wait(what: str, cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _sample_sum(text: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_live_services_feed_every_query(tmp_path, monkeypatch):
    """Real prometheus over live services: every dashboard query and recording rule has data."""
    _needs_tools()
    pytest.importorskip("transformers")
    # the learner, the sampler and the model zoo import transformers: only past the skip
    from alignd.learner import main as learner_main
    from alignd.learner.loop import LearnerLoop
    from alignd.sampler.embedded import build_sampler
    from alignd.sampler.main import run_sampler
    from alignd.tools.in_process import ApiThread

    from libalign import models
    from libalign.models.train import cpu_threads

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (./dev.sh test installs it)")

    ports = {job: free_port() for job in JOBS}
    redis_srv = RedisServer(tmp_path / "redis")
    redis_srv.start()
    base = dict(redis_url=redis_srv.url, store_dir=tmp_path / "store", sampler_path="nvfp4_minite",
                learner_path="nvfp4_trace", block_ms=50, service_heartbeat_s=0.5,
                service_heartbeat_ttl_s=5, metrics_addr="127.0.0.1")
    stop = threading.Event()
    threads: list[threading.Thread] = []
    prom = api = None
    texts: dict[str, str] = {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with cpu_threads(1):
            # converter and sampler: their service loops, each with its own registry and server
            conv = AllInOneSettings(**base, consumer_name="converter-1", metrics_port=ports["converter"])
            samp = AllInOneSettings(**base, sampler_name="sampler-1", metrics_port=ports["sampler"])
            samp_metrics = Metrics()
            engine, rollouts, guidance = build_sampler(samp, metrics=samp_metrics)
            threads = [
                threading.Thread(target=run_converter, args=(conv, stop),
                                 kwargs=dict(metrics=Metrics()), daemon=True),
                threading.Thread(target=run_sampler, args=(samp, engine, stop),
                                 kwargs=dict(rollouts=rollouts, guidance=guidance,
                                             metrics=samp_metrics), daemon=True)]
            for t in threads:
                t.start()
            api_settings = AllInOneSettings(**base, api_token=TOKEN, api_port=ports["api"],
                                            consumer_name="api-1")
            api = ApiThread(api_settings, Metrics())
            assert api.__enter__() is not None, "the API did not start"

            # prometheus: the repository's config, its jobs pointed at loopback
            cfg = yaml.safe_load(PROM_CONFIG.read_text())
            cfg["global"].update(scrape_interval="1s", scrape_timeout="1s",
                                 evaluation_interval="1s")
            cfg["rule_files"] = [str((PROM_CONFIG.parent / f).resolve()) for f in cfg["rule_files"]]
            for job in cfg["scrape_configs"]:
                for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
                    del job[key]
                job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
            (tmp_path / "prom").mkdir()
            prom = Prometheus(tmp_path / "prom", cfg, ports["prometheus"])

            def up(job: str) -> bool:
                return prom.value(f'up{{job="{job}"}}') == 1.0

            _wait("api, converter and sampler scraped", lambda: all(
                up(j) for j in ("api", "converter", "sampler", "prometheus")), 30)
            bus_client = redis.Redis.from_url(redis_srv.url, decode_responses=True)
            _wait("the sampler's consumer groups", lambda: bus_client.exists(conv.converted_stream)
                  and any(g["name"] == "sampler-sampler-1"
                          for g in bus_client.xinfo_groups(conv.converted_stream)))
            bus_client.close()

            # the learner's own entry point; each step waits until prometheus has seen it
            def fast_model(**_kw):
                task = models.SyntheticTask()
                return models.build_model(models.tiny_config(vocab_size=task.vocab_size), seed=0), task

            monkeypatch.setattr(models, "trained_tiny_model", fast_model)
            iteration = LearnerLoop.iteration
            learner_url = f"http://127.0.0.1:{ports['learner']}/metrics"

            def paced(self, step):
                r = iteration(self, step)
                texts["learner"] = httpx.get(learner_url, timeout=5).text
                scored = _sample_sum(texts["learner"], "libalign_logprob_abs_delta_count")
                assert scored > 0
                _wait("the learner's scores in prometheus", lambda: prom.value(
                    'sum(libalign_logprob_abs_delta_count{job="learner"})') == scored)
                _wait("the sync observed by the API", lambda: (prom.value(
                    'sum(libalign_sync_stage_seconds_count{job="api",stage="total"})') or 0)
                    >= step + 1)
                return r

            monkeypatch.setattr(LearnerLoop, "iteration", paced)
            for k, v in {"REDIS_URL": redis_srv.url, "STORE_DIR": str(tmp_path / "store"),
                         "SAMPLER_PATH": "nvfp4_minite", "LEARNER_PATH": "nvfp4_trace",
                         "METRICS_PORT": str(ports["learner"]), "METRICS_ADDR": "127.0.0.1",
                         "BLOCK_MS": "50", "SERVICE_HEARTBEAT_S": "0.5",
                         "SERVICE_HEARTBEAT_TTL_S": "5"}.items():
                monkeypatch.setenv(f"ALIGN_{k}", v)
            assert learner_main.main(["--steps", "2", "--prompts-per-step", "2",
                                      "--samples-per-prompt", "2", "--run-id", "mon"]) == 0

            for job in ("api", "converter", "sampler"):
                texts[job] = httpx.get(f"http://127.0.0.1:{ports[job]}/metrics", timeout=10).text

            # every dashboard query and every recording rule: finite data
            dash = _dashboard()
            queries = {f"{p['title']} [{t['refId']}]": (_substitute(t["expr"]), t.get("legendFormat", ""))
                       for p, t in _targets(dash)}
            for r in _rules():
                if "record" in r:
                    queries[r["record"]] = (r["expr"], "")
                    queries[f"{r['record']} (recorded)"] = (r["record"], "")
            results: dict[str, list[dict]] = {}

            def all_finite() -> bool:
                for name, (expr, _legend) in queries.items():
                    if name not in results or not _finite(results[name]):
                        results[name] = prom.query(expr)
                return all(_finite(res) for res in results.values())

            try:
                _wait("finite data from every query", all_finite, 20)
            except AssertionError:
                empty = {n: queries[n][0] for n, res in results.items() if not _finite(res)}
                raise AssertionError(f"queries without finite data: {empty}") from None
            for name, (_expr, legend) in queries.items():
                for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                    assert all(label in s["metric"] for s in results[name]), (name, label)

            # what the run did, as the dashboard shows it
            assert prom.value('max by (service) (libalign_service_up{job="api",service="sampler"})') == 1
            assert prom.value("libalign:guidance_hit_ratio:rate5m") == 1.0
            assert prom.value("libalign:conversion_bytes_per_second:rate5m") > 0
            p99 = prom.query("libalign:logprob_abs_delta:p99_5m")
            assert {(s["metric"]["learner_path"], s["metric"]["sampler_path"]) for s in p99} == {
                ("nvfp4_trace", "nvfp4_minite")}
            assert prom.value('max(libalign_weight_version_lag{job="api"})') == 0

            # every rule evaluates without error
            groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
            evaluated = [r for g in groups for r in g["rules"]]
            assert len(evaluated) == len(_rules())
            assert all(r["health"] == "ok" for r in evaluated), [
                (r["name"], r.get("lastError")) for r in evaluated if r["health"] != "ok"]

        # the expositions themselves pass promtool's lint
        assert set(texts) == {"api", "converter", "sampler", "learner"}
        for job, text in texts.items():
            r = _promtool("check", "metrics", stdin=text)
            assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), (job, r.stdout + r.stderr)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        stop.set()
        for t in threads:
            t.join(10)
        if api is not None:
            api.__exit__(None, None, None)
        if prom is not None:
            prom.stop()
        redis_srv.stop()
