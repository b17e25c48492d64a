"""The SGLang sampler adapter against the recorded-contract server (uvicorn on a real port)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from alignclient.errors import (
    ConfigError,
    EngineMismatchError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    GuidanceUnsupportedError,
    LayoutError,
    SpecError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from alignd.formats.convert import convert_published
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.published import write_published
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus
from alignd.infra.registry import Registry
from alignd.infra.settings import SamplerSettings
from alignd.infra.stores.rollouts import RolloutStore
from alignd.infra.work import READY, REQUESTS, RolloutRequest, RolloutsReady
from alignd.sampler.service import SamplerService
from alignd.sampler.sglang_engine import SGLangSamplerEngine, SGLangTimeouts, row_seed
from alignd.sampler.sglang_sampler import build_sglang_sampler

from libalign.gemm import get_path
from libalign.spec import PRESETS
from tests.services.api_server import serve
from tests.services.conftest import free_port, tiny_experts
from tests.services.moved_time import wait_until
from tests.services.sglang_contract import SGLangContract, check_modelopt_dir

EOS = 7
FAST = SGLangTimeouts(connect_s=1.0, control_s=5.0, generate_s=5.0, update_s=20.0,
                      retry_deadline_s=3.0, flush_deadline_s=3.0, backoff_initial_s=0.01,
                      backoff_max_s=0.05)
PROMPTS = [[1, 2, 3], [4, 5], [1, 2, 3]]
#: what /get_server_info reports of a server started with SGLANG_EXPOSE_OWN_ENV_VARS=1 and
#: SGLANG_RETURN_ORIGINAL_LOGPROB=1
ORIGINAL = {"SGLANG_EXPOSE_OWN_ENV_VARS": "1", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


@dataclass
class Rig:
    contract: SGLangContract
    engine: SGLangSamplerEngine
    exporter: ModelOptExport
    url: str
    store: Path


def sglang_weights(seed: int = 0) -> dict:
    """A tiny BF16 MoE in the per-expert names SGLang loads (no 3-D stack beside them)."""
    sd = tiny_experts(experts=2, rows=16, k=32, seed=seed)
    sd.pop("model.layers.0.mlp.experts.gate_up_proj")
    return sd


def store_version(store: Path, version_id: str, preset: str | None = None, seed: int = 0) -> None:
    """Publish and convert one version for the SGLang sampler's path (what the converter does
    with sampler_layout=modelopt: fused siblings share one outer maximum)."""
    src = write_published(store / "published", version_id, sglang_weights(seed))
    spec = PRESETS[preset] if preset else get_path("nvfp4_naive").weight_spec
    convert_published(src, WeightStore(store), version_id, spec, share_fused=True)


def model_dir(root: Path) -> Path:
    """The Hugging Face files a server starts from (weights come from published versions)."""
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
                                               "model_type": "qwen3_moe"}))
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture
def rig(tmp_path):
    """``rig(**contract_switches)``: a contract server on a port, a store with converted v1
    and v2, and an engine whose exports go to ``tmp_path/exports``."""
    store = tmp_path / "store"
    for i, v in enumerate(("v1", "v2")):
        store_version(store, v, seed=i)
    exporter = ModelOptExport(WeightStore(store), model_dir(tmp_path), tmp_path / "exports")
    with contextlib.ExitStack() as stack:
        def make(**contract_kw) -> Rig:
            contract_kw.setdefault("env_vars", ORIGINAL)  # a server set up as the README says
            contract = SGLangContract(**contract_kw)
            url = stack.enter_context(serve(contract.app))
            engine = stack.enter_context(SGLangSamplerEngine(url, exporter, eos_id=EOS,
                                                             timeouts=FAST))
            return Rig(contract, engine, exporter, url, store)

        yield make


def expected(contract: SGLangContract, prompt: list[int], seed: int, n: int,
             temperature: float = 1.0) -> tuple[list[int], list[float], bool]:
    """What the fake model generates for one row (tokens, log-probs, ended on eos)."""
    ctx, toks, lps = list(prompt), [], []
    for _ in range(n):
        t = contract.draw(ctx, seed, temperature)
        lps.append(contract.logprob(ctx, t))
        toks.append(t)
        ctx.append(t)
        if t == EOS:
            return toks, lps, True
    return toks, lps, False


def test_generate_sends_one_batched_request_and_reads_the_logprob_triples(rig):
    """One /generate: batched input_ids, per-row sampling_params (seed, stop ids), triples read."""
    r = rig()
    r.engine.load("v1")
    gen = r.engine.generate(PROMPTS, max_new_tokens=6, temperature=0.8, seed=11)
    body = next(c.body for c in r.contract.calls if c.path == "/generate")
    assert set(body) == {"rid", "input_ids", "sampling_params", "return_logprob"}
    assert body["input_ids"] == PROMPTS and body["return_logprob"] is True
    seeds = [sp["sampling_seed"] for sp in body["sampling_params"]]
    assert seeds == [row_seed(11, i) for i in range(3)] and len(set(seeds)) == 3
    assert all(sp == {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": s,
                      "stop_token_ids": [EOS]} for sp, s in zip(body["sampling_params"], seeds, strict=True))
    assert gen.version_id == "v1" and gen.prompt_lens == [3, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        toks, lps, done = expected(r.contract, prompt, seeds[i], 6, 0.8)
        assert gen.sequences[i] == prompt + toks
        assert gen.logprobs[i] == lps and gen.finished[i] == done
    assert gen.sequences[0] != gen.sequences[2]  # the same prompt twice: its own seed per row


@pytest.mark.parametrize("semantics", ["current", "legacy"])
def test_score_reads_the_completion_logprobs_at_prompt_len_minus_one(rig, semantics):
    """logprob_start_len = prompt_len - 1; both SGLang layouts give the completion's log-probs."""
    r = rig(logprob_semantics=semantics)
    r.engine.load("v1")
    gen = r.engine.generate([[9, 8, 7, 6], [3]], max_new_tokens=5, seed=1)
    seqs = [*gen.sequences, [5, 6, 7]]
    lens = [*gen.prompt_lens, 3]  # a sequence with no completion: nothing to ask
    scores = r.engine.score(seqs, lens)
    assert scores[:2] == gen.logprobs and scores[2] == []
    body = [c.body for c in r.contract.calls if c.path == "/generate"][-1]
    assert body["logprob_start_len"] == [3, 0]  # prompt_len 1: s = 0 (a null pad first)
    assert all(sp == {"max_new_tokens": 0} for sp in body["sampling_params"])
    assert body["input_ids"] == gen.sequences


def test_score_refuses_logprobs_shifted_by_a_token(rig):
    """A server whose input log-probs are off by one position fails by name, not silently."""
    r = rig()
    r.engine.load("v1")
    gen = r.engine.generate([[1, 2, 3, 4]], max_new_tokens=4, seed=2)
    r.contract.shift_input_logprobs = 1
    with pytest.raises(EngineRequestError, match="not aligned"):
        r.engine.score(gen.sequences, gen.prompt_lens)


def test_load_runs_pause_drain_update_verify_continue_in_order(rig):
    """The weight-sync flow, as the server recorded it, with the export SGLang can load."""
    r = rig()
    info = r.engine.load("v1")
    assert r.contract.routes() == [
        ("GET", "/get_server_info"), ("GET", "/health"), ("POST", "/pause_generation"),
        ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk"), ("GET", "/get_model_info"),
        ("POST", "/continue_generation"), ("GET", "/health")]
    by_path = {c.path: c.body for c in r.contract.calls}
    assert by_path["/pause_generation"] == {"mode": "abort"}
    export = r.exporter.path("v1")
    assert by_path["/update_weights_from_disk"] == {
        "model_path": str(export), "weight_version": "v1", "flush_cache": True,
        "abort_all_requests": False}
    assert check_modelopt_dir(export) is None
    assert r.contract.weight_version == "v1" == r.engine.version_id
    assert info["model_path"] == str(export) and info["seconds"]["update"] >= 0
    r.engine.load("v2")
    assert r.engine.served_version() == "v2" == r.engine.version_id


def test_a_failed_update_keeps_the_old_version_serving(rig):
    """success: false -> WeightUpdateError with SGLang's message; continue still sent; v1 serves."""
    r = rig()
    r.engine.load("v1")
    r.contract.calls.clear()
    r.contract.fail_update = "Failed to update weights: shape mismatch. Rolling back."
    with pytest.raises(WeightUpdateError, match=r"shape mismatch.*keeps serving 'v1'"):
        r.engine.load("v2")
    assert ("POST", "/continue_generation") in r.contract.routes()
    assert r.contract.paused is None
    assert r.engine.version_id == "v1" == r.contract.weight_version
    assert r.engine.generate([[1, 2]], max_new_tokens=2).version_id == "v1"


def test_an_export_the_server_cannot_load_is_a_failed_update(rig, tmp_path):
    """The contract checks the ModelOpt layout: a directory without it is refused by SGLang."""
    r = rig()
    bad = tmp_path / "not-modelopt"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    r.engine.exporter = lambda v, path: bad
    with pytest.raises(WeightUpdateError, match=r"hf_quant_config\.json"):
        r.engine.load("v1")
    assert r.engine.version_id is None


def test_503_while_the_server_starts_is_retried_until_it_answers(rig):
    """/health 503 while starting and 503s on /generate are retried; past the deadline: typed.
    (The server answers its first two health checks 503: a count, not a time window, so the
    host's speed cannot skip them.)"""
    r = rig()
    r.contract.unavailable["/health"] = 2
    r.engine.load("v1")
    assert ("GET", "/health", 503) in r.contract.routes(with_status=True)
    r.contract.unavailable["/generate"] = 2
    assert r.engine.generate([[1]], max_new_tokens=2).sequences[0][:1] == [1]
    assert [c.status for c in r.contract.calls if c.path == "/generate"] == [503, 503, 200]
    r.contract.unavailable["/generate"] = 10**6
    r.engine.timeouts = SGLangTimeouts(**{**FAST.__dict__, "retry_deadline_s": 0.2})
    with pytest.raises(EngineUnavailableError, match="503"):
        r.engine.generate([[1]], max_new_tokens=2)


def test_timeouts_and_unreachable_servers_are_typed(rig, tmp_path):
    """A slow /generate -> EngineTimeoutError, sent once (not retried: the server saw one
    arrive, and one answered once its delay ran out); no server -> EngineUnavailableError."""
    r = rig()
    r.engine.load("v1")
    r.contract.delay["/generate"] = 1.0
    r.engine.timeouts = SGLangTimeouts(**{**FAST.__dict__, "generate_s": 0.2})
    with pytest.raises(EngineTimeoutError, match=r"no answer within 0\.2s"):
        r.engine.generate([[1]], max_new_tokens=2)
    assert r.contract.arrived["/generate"] == 1  # never sent twice
    wait_until(lambda: any(c.path == "/generate" for c in r.contract.calls), "the slow call")
    assert sum(c.path == "/generate" for c in r.contract.calls) == 1
    nowhere = SGLangSamplerEngine(f"http://127.0.0.1:{free_port()}", r.exporter,
                                  timeouts=SGLangTimeouts(**{**FAST.__dict__,
                                                             "retry_deadline_s": 0.2}))
    with nowhere, pytest.raises(EngineUnavailableError, match="cannot connect"):
        nowhere.load("v1")


def test_flush_cache_is_retried_while_requests_drain(rig):
    """A request in flight when the load starts ends aborted; a flush while it drains is refused
    (400) and retried, and succeeds once it drained. The request runs until the first flush is
    refused (no race with the host's speed)."""
    r = rig()
    r.engine.load("v1")
    r.contract.delay["/generate:running"] = 60.0
    r.contract.drain_after_refused_flushes = 1
    other = {}

    def another_client():
        other["answer"] = httpx.post(f"{r.url}/generate", json={
            "input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 2}],
            "return_logprob": True}, timeout=10).json()

    t = threading.Thread(target=another_client)
    t.start()
    while r.contract.in_flight == 0:
        time.sleep(0.005)
    r.contract.calls.clear()
    r.engine.load("v2")
    t.join(30)
    flushes = [c.status for c in r.contract.calls if c.path == "/flush_cache"]
    assert flushes[-1] == 200 and 400 in flushes
    assert other["answer"][0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert r.engine.version_id == "v2"


def test_requests_that_never_drain_time_the_load_out_and_generation_continues(rig):
    """flush refused past its deadline: EngineTimeoutError, continue sent, old version kept."""
    r = rig()
    r.engine.load("v1")
    r.contract.busy_flushes = 10**6
    r.engine.timeouts = SGLangTimeouts(**{**FAST.__dict__, "flush_deadline_s": 0.2})
    r.contract.calls.clear()
    with pytest.raises(EngineTimeoutError, match="running or waiting requests"):
        r.engine.load("v2")
    assert r.contract.routes()[-1] == ("POST", "/continue_generation")
    assert ("POST", "/update_weights_from_disk") not in r.contract.routes()
    assert r.engine.version_id == "v1" and r.contract.paused is None


def test_every_result_is_stamped_with_the_served_weight_version(rig):
    """meta_info.weight_version stamps results; a version switched behind our back is refused."""
    r = rig()
    with pytest.raises(SpecError, match="not loaded"):
        r.engine.generate([[1]], max_new_tokens=1)
    r.engine.load("v2")
    assert r.engine.generate([[1]], max_new_tokens=1).version_id == "v2"
    r.contract.weight_version = "someone-else"
    with pytest.raises(WeightVersionMismatchError, match="someone-else"):
        r.engine.generate([[1]], max_new_tokens=1)
    with pytest.raises(WeightVersionMismatchError):
        r.engine.score([[1, 2]], [1])
    r.engine.strict_version = False
    assert r.engine.generate([[1]], max_new_tokens=1).version_id == "someone-else"


def test_guidance_and_row_scaled_exports_are_refused_by_name(rig, tmp_path):
    """No guidance records from SGLang over HTTP; a row-scaled minite version asked of a
    sampler of path nvfp4_naive (modelopt_fp4 servers) fails by name before any server is
    touched, and nothing is exported."""
    r = rig()
    r.engine.load("v1")
    with pytest.raises(GuidanceUnsupportedError, match="cannot capture guidance"):
        r.engine.generate([[1]], max_new_tokens=1, guidance_bits=2)
    store_version(r.store, "v-minite", preset="minite")
    r.contract.calls.clear()
    with pytest.raises(LayoutError, match=r"'v-minite' \(minite\) is loaded by SGLang method "
                                          r"'libalign_minite'; this sampler's path 'nvfp4_naive'"):
        r.engine.load("v-minite")
    assert r.contract.calls == [] and r.engine.version_id == "v1"
    assert not r.exporter.exists("v-minite")


def test_a_minite_sampler_loads_minite_versions_on_libalign_minite_servers_only(tmp_path):
    """Path nvfp4_minite: a server reporting quantization libalign_minite loads the version's
    row-scaled export (the contract checks that method's layout: per-row weight_scale_2) and
    serves it; a server reporting modelopt_fp4 is refused by name (EngineMismatchError, field
    quantization) before it is paused; a naive version is refused before any server is asked."""
    store = tmp_path / "store"
    for i, v in enumerate(("m1", "m2")):
        store_version(store, v, preset="minite", seed=i)
    store_version(store, "n1")
    exports = ModelOptExport(WeightStore(store), model_dir(tmp_path), tmp_path / "exports")
    minite, stock = (SGLangContract(env_vars=ORIGINAL, quantization=q)
                     for q in ("libalign_minite", "modelopt_fp4"))
    with serve(minite.app) as url, serve(stock.app) as stock_url, \
            SGLangSamplerEngine(url, exports, path="nvfp4_minite", eos_id=EOS,
                                timeouts=FAST) as engine, \
            SGLangSamplerEngine(stock_url, exports, path="nvfp4_minite", eos_id=EOS,
                                timeouts=FAST) as wrong:
        info = engine.load("m1")
        export = exports.path("m1")
        assert info["model_path"] == str(export) and minite.weight_version == "m1"
        assert check_modelopt_dir(export, "libalign_minite") is None
        assert check_modelopt_dir(export) is not None  # modelopt_fp4 could not load it
        gen = engine.generate([[1, 2]], max_new_tokens=3, seed=1)
        assert gen.version_id == "m1" and engine.score(gen.sequences, gen.prompt_lens) == gen.logprobs
        engine.load("m2")
        assert engine.served_version() == "m2"
        minite.calls.clear()
        with pytest.raises(LayoutError, match=r"'n1' \(te_expert\).*'modelopt_fp4'.*'nvfp4_minite'"):
            engine.load("n1")
        assert minite.calls == [] and engine.version_id == "m2" and not exports.exists("n1")
        with pytest.raises(EngineMismatchError, match=f"{stock_url} runs quantization "
                           r"'modelopt_fp4'.*'nvfp4_minite'.*--quantization libalign_minite") as e:
            wrong.load("m2")
        assert e.value.field == "quantization" and wrong.version_id is None
        assert [c.path for c in stock.calls] == ["/get_server_info"]


def test_the_contract_validates_fields_like_sglang_and_stricter(rig):
    """Unknown top-level fields: 400 here (SGLang ignores them); unknown sampling keys: 500."""
    r = rig()
    ok = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 1}]}
    assert httpx.post(f"{r.url}/generate", json=ok).status_code == 200
    typo = httpx.post(f"{r.url}/generate", json={**ok, "return_logprobs": True})
    assert typo.status_code == 400 and "return_logprobs" in typo.json()["message"]
    assert httpx.post(f"{r.url}/generate", json={**ok, "sampling_params": [{"seed": 1}]}
                      ).status_code == 500
    bad = httpx.post(f"{r.url}/generate", json={**ok, "sampling_params": [{"temperature": -1}]})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    assert httpx.post(f"{r.url}/update_weights_from_disk", json={}).status_code == 400
    r.contract.strict = False
    assert httpx.post(f"{r.url}/generate", json={**ok, "return_logprobs": True}).status_code == 200


def test_sampler_service_serves_a_rollout_request_through_sglang(rig, redis_url, tmp_path):
    """The sampler loop, a real redis-server, the SGLang engine: load, roll out, store, announce."""
    r = rig()
    settings = SamplerSettings(redis_url=redis_url, store_dir=r.store, sampler_name="sgl-1",
                               block_ms=50)
    bus = RedisBus.from_settings(settings)
    registry = Registry(bus, settings.key_prefix)
    registry.create("v1", str(r.store / "published" / "v1"))
    for state in ("converting", "converted"):
        registry.transition("v1", state, actor="test")
    rollouts = RolloutStore(redis.Redis.from_url(redis_url), settings.key_prefix)
    svc = SamplerService(settings, r.engine, bus, rollouts=rollouts)
    svc.setup()
    assert r.engine.version_id == "v1" == r.contract.weight_version
    assert registry.state("v1") == "serving"
    req = RolloutRequest(request_id="req-1", version_id="v1", prompts=json.dumps([[1, 2], [3]]),
                         samples_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=5)
    bus.publish(REQUESTS, req.to_fields())
    svc.bus.ensure_group(READY, "test")
    deadline = time.monotonic() + 10
    while not svc.step(block_ms=50) and time.monotonic() < deadline:
        pass
    [msg] = bus.read(READY, "test", "t", count=10, block_ms=100)
    ready = RolloutsReady.from_fields(msg.fields)
    assert ready.error is None and ready.sampler == "sgl-1" and len(ready.ids()) == 4
    stored = rollouts.get_rollouts("v1", ready.ids())
    prompts = [[1, 2], [1, 2], [3], [3]]
    for i, (ro, prompt) in enumerate(zip(stored, prompts, strict=True)):
        toks, lps, _ = expected(r.contract, prompt, row_seed(5, i), 4)
        assert ro.tokens == prompt + toks and ro.prompt_len == len(prompt)
        assert ro.logprobs == pytest.approx(lps) and ro.path == "nvfp4_naive"
    guided = RolloutRequest(request_id="req-2", version_id="v1", prompts=json.dumps([[1]]),
                            max_new_tokens=2, guidance_bits=2)
    bus.publish(REQUESTS, guided.to_fields())
    while not svc.step(block_ms=50) and time.monotonic() < deadline:
        pass
    [msg] = bus.read(READY, "test", "t", count=10, block_ms=100)
    assert "GuidanceUnsupportedError" in RolloutsReady.from_fields(msg.fields).error


def test_build_sglang_sampler_from_settings(tmp_path, caplog):
    """The factory: a naive-path engine over the servers listed (comma-separated) with the
    settings' keys, loading exports under the store and writing one from the store version,
    with a warning, only when nobody exported it; nvfp4_minite accepted (its exporter refusing
    a naive version), guided and bf16 paths refused."""
    settings = SamplerSettings(store_dir=tmp_path / "store", sampler_path="nvfp4_naive",
                               sglang_api_key="k", sglang_original_logprobs=True)
    engine, rollouts, guidance = build_sglang_sampler(
        settings, "http://sglang-0:30000, http://sglang-1:30000", model_dir=model_dir(tmp_path),
        eos_id=EOS)
    with engine:
        assert engine.path == "nvfp4_naive" and engine.eos_id == EOS and guidance is None
        assert [s.url for s in engine.servers] == ["http://sglang-0:30000", "http://sglang-1:30000"]
        assert engine.api_key == "k" and engine.original_logprobs is True
        assert engine.exporter.path("v1") == tmp_path / "store" / "sglang" / "modelopt" / "v1"
        assert engine.model_paths == (str(tmp_path / "model"),
                                      str(tmp_path / "store" / "sglang" / "modelopt"))
        assert isinstance(rollouts, RolloutStore)
        store_version(tmp_path / "store", "v1")
        assert check_modelopt_dir(engine.exporter("v1")) is None
        assert "has no ModelOpt export" in caplog.text
        caplog.clear()
        engine.exporter("v1")
        assert "has no ModelOpt export" not in caplog.text
    minite, _, _ = build_sglang_sampler(
        SamplerSettings(store_dir=tmp_path / "store", sampler_path="nvfp4_minite"),
        "http://sglang:30000", model_dir=tmp_path / "model")
    with minite:
        assert minite.path == "nvfp4_minite"
        with pytest.raises(LayoutError, match=r"'v1' \(te_expert\).*'nvfp4_minite'"):
            minite.exporter("v1", minite.path)  # a naive version: refused before any server
    for refused in ("nvfp4_trace", "bf16"):
        with pytest.raises(ConfigError, match=f"path '{refused}'.*nvfp4_naive, nvfp4_minite"):
            build_sglang_sampler(SamplerSettings(store_dir=tmp_path / "store",
                                                 sampler_path=refused),
                                 "http://sglang:30000", model_dir=tmp_path / "model")
    with pytest.raises(ConfigError, match="sglang_model_dir"):
        build_sglang_sampler(settings, "http://sglang:30000")
