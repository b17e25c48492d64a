"""The SGLang adapter's server contract against contract servers on real
ports: API keys, pre-temperature log-probs or a typed refusal, servers that are not the version
asked for, concurrent calls with a lock only around switches, several servers (one failing),
and the workers behind an sglang-router."""

from __future__ import annotations

import contextlib
import runpy
import threading
from pathlib import Path

import pytest
from alignclient.errors import (
    EngineMismatchError,
    EngineUnavailableError,
    TemperedLogprobsError,
    UnauthorizedError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from alignd.formats.modelopt_export import ModelOptExport
from alignd.formats.weight_store import WeightStore
from alignd.sampler.sglang_engine import SGLangSamplerEngine, SGLangTimeouts, row_seed

from tests.services.api_server import serve
from tests.services.moved_time import wait_until
from tests.services.sglang_contract import SGLangContract
from tests.services.sglang_router_contract import RouterContract
from tests.services.test_sglang_engine import EOS, FAST, ORIGINAL, expected, model_dir, store_version

EXPOSED = {"SGLANG_EXPOSE_OWN_ENV_VARS": "1"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fleet(tmp_path):
    """``fleet(n, engine_kw, **contract_kw)``: n contract servers on ports, a store with v1..v3
    converted, and an engine over them; returns (contracts, urls, engine, exports)."""
    store = tmp_path / "store"
    for i, v in enumerate(("v1", "v2", "v3")):
        store_version(store, v, seed=i)
    exports = ModelOptExport(WeightStore(store), model_dir(tmp_path))
    with contextlib.ExitStack() as stack:
        def make(n: int = 1, engine_kw: dict | None = None, **contract_kw):
            contract_kw.setdefault("env_vars", ORIGINAL)
            contracts = [SGLangContract(**contract_kw) for _ in range(n)]
            urls = [stack.enter_context(serve(c.app)) for c in contracts]
            engine = stack.enter_context(SGLangSamplerEngine(
                urls if n > 1 else urls[0], exports, eos_id=EOS, timeouts=FAST,
                **(engine_kw or {})))
            return contracts, urls, engine, exports

        def router(n: int, router_kw: dict | None = None, engine_kw: dict | None = None):
            contracts = [SGLangContract(env_vars=ORIGINAL, api_key=(engine_kw or {}).get(
                "api_key")) for _ in range(n)]
            urls = [stack.enter_context(serve(c.app)) for c in contracts]
            rc = RouterContract(urls, **(router_kw or {}))
            rurl = stack.enter_context(serve(rc.app))
            engine = stack.enter_context(SGLangSamplerEngine(
                None, exports, router=rurl, eos_id=EOS, timeouts=FAST, **(engine_kw or {})))
            return contracts, urls, rc, engine

        make.router = router  # type: ignore[attr-defined]
        yield make


# --- API key ---------------------------------------------------------------------------------

def test_a_server_started_with_an_api_key_gets_it_as_a_bearer_token(fleet):
    """--api-key: without the key every call but /health is refused (UnauthorizedError naming
    the server, before any pause); with it, load, generate and score pass."""
    (c,), (url,), engine, _ = fleet(api_key="s3cret")
    with pytest.raises(UnauthorizedError, match=f"{url}.*401.*api_key"):
        engine.load("v1")
    assert [x.path for x in c.calls] == ["/get_server_info"]
    (c,), _, keyed, _ = fleet(api_key="s3cret", engine_kw={"api_key": "s3cret"})
    keyed.load("v1")
    gen = keyed.generate([[1, 2]], max_new_tokens=3, seed=4)
    assert keyed.score(gen.sequences, gen.prompt_lens) == gen.logprobs
    assert all(x.status != 401 for x in c.calls)


def test_an_admin_api_key_unlocks_the_switch_routes(fleet):
    """--api-key K --admin-api-key A: the switch's routes take only A, the others K. Without A
    the load stops at the pause (UnauthorizedError naming the admin key); with both it passes,
    and a switch route the server keeps at the normal level is asked once more with K."""
    (c,), _, engine, _ = fleet(api_key="K", admin_api_key="A", engine_kw={"api_key": "K"})
    with pytest.raises(UnauthorizedError, match=r"pause_generation.*--admin-api-key"):
        engine.load("v1")
    assert c.paused is None and c.weight_version == "default"
    (c,), _, both, _ = fleet(api_key="K", admin_api_key="A",
                             admin_routes=("/pause_generation", "/update_weights_from_disk",
                                           "/continue_generation"),
                             engine_kw={"api_key": "K", "admin_api_key": "A"})
    both.load("v1")
    assert both.generate([[1]], max_new_tokens=2).version_id == "v1" == c.weight_version
    assert [x.status for x in c.calls if x.path == "/flush_cache"] == [401, 200]


# --- log-probs and temperature ---------------------------------------------------------------

def test_original_logprobs_are_returned_at_any_temperature(fleet):
    """SGLANG_RETURN_ORIGINAL_LOGPROB=1 (reported through SGLANG_EXPOSE_OWN_ENV_VARS): at T=0.7
    the log-probs are the untempered ones, equal to what scoring gives."""
    (c,), _, engine, _ = fleet()
    engine.load("v1")
    gen = engine.generate([[3, 1]], max_new_tokens=5, temperature=0.7, seed=2)
    toks, lps, _ = expected(c, [3, 1], row_seed(2, 0), 5, 0.7)
    assert gen.sequences[0][2:] == toks and gen.logprobs[0] == lps
    assert engine.score(gen.sequences, gen.prompt_lens) == gen.logprobs


@pytest.mark.parametrize("env, why", [(EXPOSED, "returns log-probs after temperature"),
                                      (None, "does not report"),
                                      ({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, "does not report")])
def test_tempered_or_unknown_logprobs_are_refused_at_t_other_than_1(fleet, env, why):
    """A server returning tempered log-probs (or not saying) is refused at T=0.7 before any
    /generate; T=1 and T=0 (greedy) are untempered anyway and pass."""
    (c,), (url,), engine, _ = fleet(env_vars=env)
    engine.load("v1")
    with pytest.raises(TemperedLogprobsError, match=f"{url} {why}.*temperature 0.7"):
        engine.generate([[1]], max_new_tokens=2, temperature=0.7)
    assert not any(x.path == "/generate" for x in c.calls)
    for t in (1.0, 0.0):
        assert engine.generate([[1]], max_new_tokens=2, temperature=t).version_id == "v1"


def test_the_operator_can_vouch_for_or_against_original_logprobs(fleet):
    """original_logprobs=True: a server that does not expose its environment (but runs with
    the variable) is trusted; False refuses even a server that says it returns original ones."""
    (c,), _, trusted, _ = fleet(env_vars={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
                                engine_kw={"original_logprobs": True})
    trusted.load("v1")
    gen = trusted.generate([[2]], max_new_tokens=3, temperature=0.5, seed=1)
    assert gen.logprobs[0] == expected(c, [2], row_seed(1, 0), 3, 0.5)[1]
    _, _, refusing, _ = fleet(engine_kw={"original_logprobs": False})
    refusing.load("v1")
    with pytest.raises(TemperedLogprobsError, match="after temperature"):
        refusing.generate([[2]], max_new_tokens=3, temperature=0.5)


# --- a server that is not the version asked for ----------------------------------------------

def test_a_server_of_another_quantization_or_model_is_refused_before_it_is_touched(fleet, tmp_path):
    """--quantization fp8, or a model path that is neither the model dir nor an export:
    EngineMismatchError naming the field; the server was never paused."""
    (c,), (url,), engine, _ = fleet(quantization="fp8")
    with pytest.raises(EngineMismatchError, match=f"{url} runs quantization 'fp8'") as e:
        engine.load("v1")
    assert e.value.field == "quantization" and [x.path for x in c.calls] == ["/get_server_info"]
    (c,), (url,), engine, exports = fleet(
        model_path="/models/llama", engine_kw={"model_paths": (tmp_path / "model", tmp_path / "x")})
    with pytest.raises(EngineMismatchError, match="started from model '/models/llama'") as e:
        engine.load("v1")
    assert e.value.field == "model" and engine.version_id is None
    (c,), _, engine, exports = fleet(model_path=str(tmp_path / "model"),
                                     engine_kw={"model_paths": (tmp_path / "model", exports.dir)})
    engine.load("v1")
    engine.load("v2")  # the server now reports the export it loaded: under the export root
    assert c.model_path == str(exports.path("v2"))


def test_a_server_whose_version_does_not_take_is_a_weight_version_mismatch(fleet):
    """An update that leaves another weight_version: WeightVersionMismatchError (an
    EngineMismatchError with field weight_version); generation continued; old version kept."""
    (c,), _, engine, _ = fleet()
    engine.load("v1")
    c.sticky_version = True
    with pytest.raises(EngineMismatchError, match="reports weight_version 'v1'") as e:
        engine.load("v2")
    assert isinstance(e.value, WeightVersionMismatchError) and e.value.field == "weight_version"
    assert c.paused is None and engine.version_id == "v1"


# --- concurrency -----------------------------------------------------------------------------

def test_calls_run_concurrently_and_a_switch_waits_for_them(fleet):
    """No global lock: two generations run at once. A load waits for the generation in flight
    (it is not aborted and keeps v1); a generation asked while the load waits runs on v2."""
    (c,), _, engine, _ = fleet()
    engine.load("v1")
    c.delay["/generate:running"] = 0.4
    c.hold_until_in_flight = 2  # the pair's first call runs until the second has arrived
    out: dict[str, object] = {}

    def run(key, fn):
        out[key] = fn()

    pair = [threading.Thread(target=run, args=(k, lambda: engine.generate(
        [[1, 2]], max_new_tokens=2))) for k in ("a", "b")]
    for t in pair:
        t.start()
    for t in pair:
        t.join(10)
    assert c.max_in_flight == 2 and out["a"].version_id == out["b"].version_id == "v1"
    c.hold_until_in_flight = None
    c.calls.clear()
    first = threading.Thread(target=run, args=("first", lambda: engine.generate(
        [[5]], max_new_tokens=2)))
    first.start()
    wait_until(lambda: c.in_flight, "the first generation running")
    load = threading.Thread(target=run, args=("load", lambda: engine.load("v2")))
    load.start()
    # the load now waits for the first generation (the switch lock holds new calls back)
    wait_until(lambda: engine.switch.switch_waiting or not load.is_alive(), "the load waiting")
    later = threading.Thread(target=run, args=("later", lambda: engine.generate(
        [[5]], max_new_tokens=2)))
    later.start()
    for t in (first, load, later):
        t.join(10)
    assert out["first"].version_id == "v1" and out["later"].version_id == "v2"
    routes = [x.path for x in c.calls]
    assert routes.index("/generate") < routes.index("/pause_generation")
    assert routes.count("/generate") == 2 and routes[-1] == "/generate"


# --- several servers -------------------------------------------------------------------------

def test_several_servers_get_every_switch_and_share_the_calls(fleet):
    """Two servers: both switched (each checked), calls spread evenly."""
    cs, urls, engine, exports = fleet(2)
    info = engine.load("v1")
    assert info["servers"] == urls and info["failed"] == {}
    assert [c.weight_version for c in cs] == ["v1", "v1"]
    assert all(c.model_path == str(exports.path("v1")) for c in cs)
    for i in range(4):
        assert engine.generate([[i + 1]], max_new_tokens=2).version_id == "v1"
    assert [sum(x.path == "/generate" for x in c.calls) for c in cs] == [2, 2]


def test_a_server_that_fails_a_switch_leaves_rotation_until_a_later_one(fleet):
    """One server refuses v2: the load succeeds on the other (the failure named in 'failed'),
    calls go only to the server on v2; the next load switches both and the failed one rejoins.
    When every server fails, the load raises and v1 keeps serving on all."""
    cs, urls, engine, _ = fleet(2)
    engine.load("v1")
    cs[1].fail_update = "Failed to update weights: out of memory. Rolling back."
    info = engine.load("v2")
    assert info["servers"] == [urls[0]]
    assert "WeightUpdateError" in info["failed"][urls[1]] and "out of memory" in info["failed"][urls[1]]
    assert engine.version_id == "v2" and [c.weight_version for c in cs] == ["v2", "v1"]
    for c in cs:
        c.calls.clear()
    for _ in range(3):
        assert engine.generate([[1]], max_new_tokens=2).version_id == "v2"
    assert [sum(x.path == "/generate" for x in c.calls) for c in cs] == [3, 0]
    engine.load("v3")
    assert [c.weight_version for c in cs] == ["v3", "v3"]
    for _ in range(2):
        engine.generate([[1]], max_new_tokens=2)
    assert sum(x.path == "/generate" for x in cs[1].calls) >= 1
    for c in cs:
        c.fail_update = "Failed to update weights: shape mismatch. Rolling back."
    with pytest.raises(WeightUpdateError, match=r"no server could switch to 'v1'.*shape mismatch"):
        engine.load("v1")
    assert engine.version_id == "v3" and [c.weight_version for c in cs] == ["v3", "v3"]
    assert engine.generate([[1]], max_new_tokens=2).version_id == "v3"


def test_an_unreachable_server_is_unknown_until_a_switch_verifies_it(fleet):
    """A server that cannot be reached during a switch is out of rotation (its version
    unknown); the others serve; with none in rotation a call is EngineUnavailableError."""
    cs, urls, engine, _ = fleet(2)
    engine.load("v1")
    engine.timeouts = SGLangTimeouts(**{**FAST.__dict__, "retry_deadline_s": 0.3})
    cs[1].unavailable["/pause_generation"] = 10**6  # answers 503 past the retry deadline
    info = engine.load("v2")
    assert "EngineUnavailableError" in info["failed"][urls[1]]
    assert [s.version for s in engine.servers] == ["v2", "v1"]
    cs[0].unavailable["/pause_generation"] = 10**6
    cs[1].unavailable.clear()
    engine.load("v3")
    assert [s.version for s in engine.servers] == ["v2", "v3"]
    assert engine.generate([[1]], max_new_tokens=1).version_id == "v3"
    engine.servers[1].version = None  # say it went away unnoticed
    with pytest.raises(EngineUnavailableError, match="no SGLang server serves 'v3'"):
        engine.generate([[1]], max_new_tokens=1)


# --- behind sglang-router --------------------------------------------------------------------

@pytest.mark.parametrize("legacy", [True, False])
def test_workers_behind_a_router_are_switched_directly_and_called_through_it(fleet, legacy):
    """The router's worker list (/list_workers, or /workers of newer gateways) gets the switch;
    calls go through the router, which spreads them; the API key reaches router and workers."""
    cs, urls, rc, engine = fleet.router(2, {"legacy_list": legacy, "api_key": "k"},
                                        {"api_key": "k"})
    engine.load("v1")
    assert [c.weight_version for c in cs] == ["v1", "v1"]
    assert [s.url for s in engine.servers] == urls
    assert (("GET", "/workers", None) in rc.calls) is not legacy
    for i in range(4):
        assert engine.generate([[i + 1]], max_new_tokens=2).version_id == "v1"
    assert [sum(x.path == "/generate" for x in c.calls) for c in cs] == [2, 2]
    assert engine.served_version() == "v1"


def test_a_router_worker_that_fails_is_removed_from_the_router_and_added_back(fleet):
    """A worker that refuses v2 is taken out of the router (remove_worker) so no call reaches
    it; once a later switch takes on it, it is added back (add_worker)."""
    cs, urls, rc, engine = fleet.router(2)
    engine.load("v1")
    cs[1].fail_update = "Failed to update weights: disk error. Rolling back."
    info = engine.load("v2")
    assert list(info["failed"]) == [urls[1]] and rc.workers == [urls[0]]
    assert ("POST", "/remove_worker", urls[1]) in rc.calls
    for c in cs:
        c.calls.clear()
    for _ in range(3):
        assert engine.generate([[1]], max_new_tokens=2).version_id == "v2"
    assert sum(x.path == "/generate" for x in cs[1].calls) == 0
    engine.load("v3")
    assert [c.weight_version for c in cs] == ["v3", "v3"]
    assert sorted(rc.workers) == sorted(urls) and ("POST", "/add_worker", urls[1]) in rc.calls


# --- the README snippet ----------------------------------------------------------------------

def test_the_with_sglang_snippet_runs_against_two_servers(tmp_path, monkeypatch, capsys):
    """docs/snippets/with_sglang.py (the README's "With SGLang") runs as written against two
    keyed contract servers and a store whose version the converter exported."""
    store = tmp_path / "store"
    store_version(store, "v1")
    model = model_dir(tmp_path)
    ModelOptExport(WeightStore(store), model).write("v1")  # what the converter wrote
    contracts = [SGLangContract(env_vars=ORIGINAL, api_key="k") for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve(c.app)) for c in contracts]
        for k, v in {"ALIGN_VERSION": "v1", "ALIGN_STORE_DIR": str(store),
                     "ALIGN_SGLANG_MODEL_DIR": str(model), "ALIGN_SGLANG_URL": ",".join(urls),
                     "ALIGN_SGLANG_API_KEY": "k"}.items():
            monkeypatch.setenv(k, v)
        runpy.run_path(str(ROOT / "docs" / "snippets" / "with_sglang.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "train_rollout_logprob_abs_diff" in out and f"{urls} v1" in out
    assert [c.weight_version for c in contracts] == ["v1", "v1"]
    assert float(out.split()[-1]) == 0.0  # the fake scores exactly what it sampled


def test_a_mismatched_server_among_several_leaves_rotation_before_any_switch(fleet):
    """Two servers, one started with --quantization fp8: the load switches the other (the
    mismatch named in 'failed'), the fp8 one is never paused and gets no calls."""
    cs, urls, engine, _ = fleet(2)
    cs[1].quantization = "fp8"
    info = engine.load("v1")
    assert info["servers"] == [urls[0]] and "EngineMismatchError" in info["failed"][urls[1]]
    assert [x.path for x in cs[1].calls] == ["/get_server_info"]
    for _ in range(2):
        assert engine.generate([[1]], max_new_tokens=1).version_id == "v1"
    assert sum(x.path == "/generate" for x in cs[1].calls) == 0
    cs[0].quantization = "fp8"
    with pytest.raises(EngineMismatchError, match=r"no server could switch to 'v2'.*fp8") as e:
        engine.load("v2")
    assert e.value.field == "quantization" and engine.version_id == "v1"


# --- strict mode: SGLang's deterministic inference --------------------------------------------

def test_strict_mode_refuses_a_server_without_deterministic_inference(fleet):
    """deterministic=True (ALIGN_STRICT): a server that does not report
    enable_deterministic_inference, or reports an attention backend without a deterministic
    form, is refused (EngineMismatchError naming the field) before it is paused; one started
    with --enable-deterministic-inference (triton, fa4 or unnamed backend) loads and serves; without
    strict mode the flag is not asked for."""
    strict = {"deterministic": True}
    (c,), (url,), engine, _ = fleet(engine_kw=strict)
    with pytest.raises(EngineMismatchError, match=f"{url} reports "
                       "enable_deterministic_inference=False.*--enable-deterministic-inference") as e:
        engine.load("v1")
    assert e.value.field == "enable_deterministic_inference" and engine.version_id is None
    assert [x.path for x in c.calls] == ["/get_server_info"]
    (c,), _, engine, _ = fleet(engine_kw=strict, deterministic=True,
                               attention_backend="torch_native")
    with pytest.raises(EngineMismatchError, match="attention backend 'torch_native'") as e:
        engine.load("v1")
    assert e.value.field == "attention_backend" and [x.path for x in c.calls] == ["/get_server_info"]
    for backend in ("triton", "fa4", None):
        (c,), _, engine, _ = fleet(engine_kw=strict, deterministic=True, attention_backend=backend)
        engine.load("v1")
        gen = engine.generate([[1, 2]], max_new_tokens=3, seed=4)
        assert engine.version_id == "v1" and engine.score(gen.sequences, gen.prompt_lens) == gen.logprobs
    (c,), _, engine, _ = fleet()  # not strict: a non-deterministic server serves
    engine.load("v1")
    assert engine.version_id == "v1"


def test_strict_mode_with_two_servers_keeps_only_the_deterministic_one(fleet):
    """Two servers in strict mode, one without deterministic inference: it is left out of
    rotation at load (not paused), the deterministic one serves every call."""
    contracts, _, engine, _ = fleet(2, engine_kw={"deterministic": True}, deterministic=True)
    contracts[1].deterministic = False
    engine.load("v1")
    assert [x.path for x in contracts[1].calls] == ["/get_server_info"]
    gen = engine.generate([[1, 2], [3]], max_new_tokens=2, seed=1)
    assert len(gen.sequences) == 2 and all(x.path != "/generate" for x in contracts[1].calls)
