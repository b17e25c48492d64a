"""One SGLang server over HTTP: its calls, retries, typed errors, and the weight switch on it.

:class:`~alignd.sampler.sglang_engine.SGLangSamplerEngine` drives one or several SGLang servers
(directly, or the workers behind an ``sglang-router``); this module is what it does to each.
The routes and answers matched are listed in :mod:`alignd.sampler.sglang_engine`'s docstring.

Authentication
    A server started with ``--api-key K`` answers 401 ``{"error": "Unauthorized"}`` to every
    route but ``/health*`` and ``/metrics`` unless the request carries ``Authorization: Bearer
    K`` (SGLang's ``add_api_key_middleware``; ``sglang-router`` checks the same header on its
    admin routes). With ``api_key`` every request carries it; a 401 is
    :class:`~alignclient.errors.UnauthorizedError` naming the server. Newer SGLang also takes
    ``--admin-api-key A``: routes it marks ``ADMIN_OPTIONAL`` (weight updates and their kin)
    then take only ``A``, ``ADMIN_FORCE`` routes answer 403 without it (``utils/auth.py``,
    ``decide_request_auth``). With ``admin_api_key`` the switch's routes (pause, flush, update,
    continue) carry ``A``; one of them that answers 401 is asked once more with ``K`` (a route
    that server keeps at the normal level); a 403 is
    :class:`~alignclient.errors.ForbiddenError`.

What the server says about itself (``GET /get_server_info``)
    The server arguments (``model_path``, ``quantization``, ``enable_deterministic_inference``,
    ``attention_backend``, ...) flattened into the answer, the
    scheduler's ``internal_states`` (one per data-parallel rank) and ``version``. A server
    started with ``SGLANG_EXPOSE_OWN_ENV_VARS=1`` adds ``env_vars`` (the ``SGLANG_*`` variables
    it declares and that are set) to each internal state (``environ.exportable_env_vars``);
    :meth:`SGLangServer.original_logprobs` reads ``SGLANG_RETURN_ORIGINAL_LOGPROB`` there with
    SGLang's own boolean rule (``EnvBool``: ``true``/``1``/``yes``/``y``, any case).

The weight switch on one server (:meth:`SGLangServer.switch`)
    ``GET /health``; ``POST /pause_generation``; ``POST /flush_cache`` until it answers 200;
    ``POST /update_weights_from_disk``; ``GET /get_model_info`` must report the version and the
    export's path; ``POST /continue_generation`` always, also after a failure; ``GET /health``.

Refits from tensors (SGLang 0.5.23's weight-update routes)
    :meth:`~SGLangServer.begin_weight_update`, :meth:`~SGLangServer.update_weights_from_tensor`,
    :meth:`~SGLangServer.init_weights_update_group`,
    :meth:`~SGLangServer.update_weights_from_distributed` and
    :meth:`~SGLangServer.end_weight_update` post SGLang's request bodies
    (``io_struct``'s ``*ReqInput``) and return its ``{"success", "message"}`` answer, so an
    :class:`SGLangServer` is the HTTP sink of :func:`alignd.sync.tensor.send_tensor_refit` and
    :func:`alignd.sync.distributed.send_distributed_refit` (their ``TensorSink`` and
    ``DistributedSink``). SGLang answers a failure with 400 and ``success: false``:
    :class:`~alignclient.errors.WeightUpdateError` with its message. SGLang prepares loaded
    weights for its GEMMs (``process_weights_after_loading``) at ``end_weight_update``, not
    after each tensor or broadcast update: a refit of a quantized server is a session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from alignclient.errors import (
    AlignError,
    EngineMismatchError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    ForbiddenError,
    UnauthorizedError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from alignclient.retry import NEVER_SENT, RetryPolicy, http_transient

from alignd.formats.modelopt_export import MODELOPT_METHOD, path_method
from alignd.formats.quant_configs import MINITE_METHOD
from libalign import gemm
from libalign.spec.presets import SGLANG_KV_DTYPES

log = logging.getLogger("alignd.sampler.sglang")

#: Quantization names a server may report that load a ModelOpt NVFP4 export (None: detected
#: from the checkpoint's ``hf_quant_config.json`` when the server started).
MODELOPT_QUANTIZATIONS = ("modelopt_fp4", "modelopt", None)
#: What a server may report, by the method that loads the sampler path's exports
#: (:func:`alignd.formats.modelopt_export.path_method`): ``libalign_minite`` only by name.
QUANTIZATIONS = {MODELOPT_METHOD: MODELOPT_QUANTIZATIONS, MINITE_METHOD: (MINITE_METHOD,)}
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
#: The attention backends SGLang runs batch-invariantly (0.5.23's
#: ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES``, ``ascend`` and ``intel_xpu`` on their own
#: hardware); a deterministic server reports one of them.
DETERMINISTIC_ATTENTION_BACKENDS = ("fa3", "fa4", "flashinfer", "triton", "ascend", "intel_xpu")
TRUE_WORDS = ("true", "1", "yes", "y")
FALSE_WORDS = ("false", "0", "no", "n")


@dataclass(frozen=True)
class SGLangTimeouts:
    """Seconds the adapter waits, per kind of call, and how long it keeps retrying."""

    connect_s: float = 5.0
    control_s: float = 30.0
    """pause, continue, flush, health, model info"""
    generate_s: float = 600.0
    update_s: float = 1800.0
    """one weight update (a large MoE reads for minutes)"""
    retry_deadline_s: float = 120.0
    """how long unreachable-or-503 is retried (a server that is still starting)"""
    flush_deadline_s: float = 120.0
    """how long ``/flush_cache`` is retried while requests drain"""
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0


#: SGLang's FP4 KV caches (``--kv-cache-dtype``) and the KV preset that reproduces each.
FP4_KV_CACHE_DTYPES = {dtype: preset for preset, dtype in SGLANG_KV_DTYPES.items()}


def check_kv_cache_dtype(url: str, info: dict[str, Any], path: str) -> None:
    """:class:`EngineMismatchError` (``field="kv_cache_dtype"``) unless the server's KV cache is
    what sampler path ``path`` says: its FP4 format (``nvfp4``, ``fp4_mx_block16``), or, for a
    path without one, not an FP4 one (the learner could not reproduce what it attends over)."""
    got = info.get("kv_cache_dtype")
    kv = gemm.get_path(path).kv_spec
    want = None if kv is None else SGLANG_KV_DTYPES.get(kv.name)
    if kv is not None and got != want:
        raise EngineMismatchError(
            f"the server at {url} runs --kv-cache-dtype {got!r}; path {path!r} stores K and V "
            f"as {kv.name}: start it with --kv-cache-dtype {want}", field="kv_cache_dtype")
    if kv is None and got in FP4_KV_CACHE_DTYPES:
        raise EngineMismatchError(
            f"the server at {url} runs an FP4 KV cache (--kv-cache-dtype {got}); path {path!r} "
            f"has none: use path nvfp4_minite_{FP4_KV_CACHE_DTYPES[got]}", field="kv_cache_dtype")


def message(r: httpx.Response) -> str:
    """SGLang's words from an error answer: ``{"message"}``, ``{"error": {"message"}}``,
    ``{"error": "..."}``, or the text."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    return str(body)[:500]


def env_flag(value: Any) -> bool | None:
    """SGLang's ``EnvBool`` reading of an environment value (None: unset or not a boolean)."""
    if value is None:
        return None
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


class SwitchLock:
    """A reader-writer lock that prefers writers: calls read, a weight switch writes.

    A switch waits for the calls in flight and holds back new ones while it waits, so it is
    never starved by a stream of calls and no call straddles two versions.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @property
    def switch_waiting(self) -> bool:
        """True while a switch waits for the calls in flight (new calls are held back)."""
        with self._cond:
            return bool(self._writers_waiting)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Held by one generate or score call."""
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Held by one weight switch."""
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class SGLangServer:
    """One SGLang HTTP server (or an ``sglang-router``): calls with retries and typed errors.

    ``version`` is the weight version this adapter last saw the server serve (verified after a
    switch), None when unknown; ``in_flight`` counts this adapter's requests on it.
    """

    def __init__(self, url: str, *, timeouts: SGLangTimeouts, api_key: str | None = None,
                 admin_api_key: str | None = None, client: httpx.Client | None = None):
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._api_key, self._admin_key = api_key, admin_api_key
        self._client = client or httpx.Client(base_url=self.url)
        self._own_client = client is None
        self.version: str | None = None
        self.in_flight = 0
        self.calls = 0
        self.info: dict[str, Any] = {}
        """The last ``/get_server_info`` answer."""
        self.seconds: dict[str, float] = {}
        """``drain`` and ``update`` seconds of the last switch."""
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SGLangServer({self.url!r}, version={self.version!r})"

    def close(self) -> None:
        """Close the HTTP client (when this object made it)."""
        if self._own_client:
            self._client.close()

    # --- requests -------------------------------------------------------------------------

    def retry(self, deadline_s: float) -> RetryPolicy:
        """The project's retry policy with this server's backoff and ``deadline_s``."""
        t = self.timeouts
        return RetryPolicy(initial_s=t.backoff_initial_s, max_s=t.backoff_max_s,
                           deadline_s=deadline_s)

    def request(self, method: str, route: str, body: Any = None, *, timeout: float,
                idempotent: bool, params: dict[str, str] | None = None,
                admin: bool = False) -> httpx.Response:
        """One call, retried while unreachable or 503 until the deadline (idempotent calls also
        after a timeout or a broken connection); 401 is :class:`UnauthorizedError`, 403
        :class:`ForbiddenError`. ``admin``: a route of the weight switch (see the module doc)."""
        key = self._admin_key if admin and self._admin_key else self._api_key
        r = self._send(method, route, body, timeout, idempotent, params, key)
        if r.status_code == 401 and key == self._admin_key and self._api_key not in (None, key):
            r = self._send(method, route, body, timeout, idempotent, params, self._api_key)
        if r.status_code == 401:
            raise UnauthorizedError(f"{method} {route} at {self.url} answered 401 "
                                    f"({message(r)}): the server was started with --api-key"
                                    f"{' or --admin-api-key' if admin else ''}; give the adapter "
                                    "the same key (api_key / admin_api_key, ALIGN_SGLANG_API_KEY "
                                    "/ ALIGN_SGLANG_ADMIN_API_KEY)")
        if r.status_code == 403:
            raise ForbiddenError(f"{method} {route} at {self.url} answered 403 ({message(r)}): "
                                 "the route needs the server's --admin-api-key "
                                 "(admin_api_key, ALIGN_SGLANG_ADMIN_API_KEY)")
        return r

    def _send(self, method: str, route: str, body: Any, timeout: float, idempotent: bool,
              params: dict[str, str] | None, key: str | None) -> httpx.Response:
        t = self.timeouts
        headers = {"Authorization": f"Bearer {key}"} if key else None

        def once() -> httpx.Response:
            return self._client.request(method, route, json=body, params=params, headers=headers,
                                        timeout=httpx.Timeout(timeout, connect=t.connect_s))

        try:
            r = self.retry(t.retry_deadline_s).call(
                once, transient=lambda e: http_transient(e, idempotent=idempotent),
                again=lambda r: r.status_code == 503)
        except httpx.TransportError as e:
            raise self._transport_error(method, route, timeout, e) from None
        if r.status_code == 503:
            raise EngineUnavailableError(f"{method} {route} at {self.url}: 503 (the server is "
                                         f"starting or loading) for {t.retry_deadline_s:g}s")
        return r

    def json(self, method: str, route: str, body: Any = None, *, timeout: float | None = None,
             idempotent: bool = True, params: dict[str, str] | None = None,
             admin: bool = False) -> Any:
        """A call's JSON answer (a non-200 is :class:`EngineRequestError`)."""
        r = self.request(method, route, body, idempotent=idempotent, params=params, admin=admin,
                         timeout=self.timeouts.control_s if timeout is None else timeout)
        return self.decode(r, route)

    def decode(self, r: httpx.Response, route: str, *, allow_400: bool = False) -> Any:
        """The JSON of ``r``; a status other than 200 (and 400 when allowed) or a body that is
        not JSON is :class:`EngineRequestError` with the server's words."""
        if r.status_code != 200 and not (allow_400 and r.status_code == 400):
            raise EngineRequestError(f"{r.request.method} {route} at {self.url} answered "
                                     f"{r.status_code}: {message(r)}")
        try:
            return r.json()
        except ValueError:
            if allow_400 and r.status_code == 400:
                raise EngineRequestError(f"{route} at {self.url} answered 400: "
                                         f"{message(r)}") from None
            raise EngineRequestError(f"{route} at {self.url} answered non-JSON: "
                                     f"{r.text[:200]!r}") from None

    def _transport_error(self, method: str, route: str, timeout: float,
                         e: httpx.TransportError) -> AlignError:
        """The typed error for a transport failure that was not (or no longer) retried."""
        where = f"{method} {route} at {self.url}"
        if isinstance(e, NEVER_SENT):
            return EngineUnavailableError(f"{where}: cannot connect ({e})")
        if isinstance(e, httpx.TimeoutException):
            return EngineTimeoutError(f"{where}: no answer within {timeout:g}s ({type(e).__name__})")
        return EngineUnavailableError(f"{where}: connection failed ({type(e).__name__}: {e})")

    # --- what the server says -------------------------------------------------------------

    def health(self) -> None:
        """``GET /health`` answers 200 (503 is retried while the server starts)."""
        r = self.request("GET", "/health", timeout=self.timeouts.control_s, idempotent=True)
        if r.status_code != 200:
            raise EngineRequestError(f"GET /health at {self.url} answered {r.status_code}: "
                                     f"{message(r)}")

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``."""
        info = self.json("GET", "/get_model_info")
        if not isinstance(info, dict):
            raise EngineRequestError(f"/get_model_info at {self.url} answered {info!r:.200}")
        return info

    def served_version(self) -> str | None:
        """The ``weight_version`` the server reports, or None if it reports none."""
        v = self.model_info().get("weight_version")
        return None if v is None else str(v)

    def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info`` (kept in :attr:`info`)."""
        info = self.json("GET", "/get_server_info")
        if not isinstance(info, dict):
            raise EngineRequestError(f"/get_server_info at {self.url} answered {info!r:.200}")
        self.info = info
        return info

    def original_logprobs(self, info: dict[str, Any] | None = None) -> bool | None:
        """Whether the server returns log-probs before temperature scaling: True or False as
        its ``SGLANG_RETURN_ORIGINAL_LOGPROB`` says (unset is False, SGLang's default), None
        when it does not report its environment (started without
        ``SGLANG_EXPOSE_OWN_ENV_VARS=1``, or an SGLang that cannot)."""
        info = self.info if info is None else info
        states = info.get("internal_states")
        envs = [s.get("env_vars") for s in states or [] if isinstance(s, dict)]
        envs = [e for e in envs if isinstance(e, dict)]
        if not envs:
            return None
        flags = {bool(env_flag(e.get(ORIGINAL_LOGPROB_ENV))) for e in envs}
        return flags.pop() if len(flags) == 1 else False  # ranks that disagree: not all original

    def check(self, model_paths: tuple[str, ...] = (), deterministic: bool = False,
              path: str = "nvfp4_naive") -> dict[str, Any]:
        """Refuse a server that cannot serve libalign's exports of this model for sampler path
        ``path`` (``nvfp4_naive``: ``modelopt_fp4``; ``nvfp4_minite``: ``libalign_minite``):
        :class:`EngineMismatchError` naming the mismatch (``model``, ``quantization``,
        ``kv_cache_dtype``: an FP4 KV cache other than the path's, or one the path has none of).

        ``deterministic`` (strict mode): the server must also report SGLang's deterministic
        inference (``--enable-deterministic-inference``: batch-invariant kernels, so a
        sequence's log-probs do not depend on what else is batched with it) and, if it names
        one, an attention backend that has a deterministic form; else ``field`` is
        ``enable_deterministic_inference`` or ``attention_backend``."""
        info = self.server_info()
        if deterministic:
            self.check_deterministic(info)
        quant, method = info.get("quantization"), path_method(path) or MODELOPT_METHOD
        if quant not in QUANTIZATIONS[method]:
            raise EngineMismatchError(
                f"the server at {self.url} runs quantization {quant!r}; the versions it is asked "
                f"to serve are exports for path {path!r}: start it with --quantization "
                f"{method}", field="quantization")
        check_kv_cache_dtype(self.url, info, path)
        path = info.get("model_path")
        if model_paths and path is not None and not any(
                str(path).rstrip("/") == p or str(path).startswith(p + "/") for p in model_paths):
            raise EngineMismatchError(
                f"the server at {self.url} was started from model {path!r}; this sampler serves "
                f"versions of {model_paths[0]!r} (exports under {', '.join(model_paths[1:])}): "
                "wrong server or wrong model", field="model")
        return info

    def check_deterministic(self, info: dict[str, Any]) -> None:
        """:class:`EngineMismatchError` unless ``info`` reports deterministic inference."""
        flag = info.get("enable_deterministic_inference")
        if flag is not True and env_flag(flag) is not True:
            raise EngineMismatchError(
                f"the server at {self.url} reports enable_deterministic_inference={flag!r}; strict "
                "mode needs batch-invariant sampling: start it with "
                "--enable-deterministic-inference", field="enable_deterministic_inference")
        backend = info.get("attention_backend")
        if backend is not None and backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            raise EngineMismatchError(
                f"the server at {self.url} runs attention backend {backend!r}, which has no "
                f"deterministic form; start it with --attention-backend one of "
                f"{', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}", field="attention_backend")

    # --- the weight switch ----------------------------------------------------------------

    def switch(self, version_id: str, model_path: str, *, pause_mode: str,
               load_format: str | None, seconds: dict[str, float]) -> dict[str, Any]:
        """Make this server serve ``version_id`` from ``model_path`` (the module doc's flow);
        sets :attr:`version`. ``seconds`` gets ``drain`` and ``update``."""
        seconds.clear()
        self.health()
        t1 = time.perf_counter()
        self.json("POST", "/pause_generation", {"mode": pause_mode}, admin=True)
        failure: BaseException | None = None
        try:
            self.flush_until_drained()
            seconds["drain"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            try:
                answer = self.update(version_id, model_path, load_format)
            except WeightUpdateError:
                raise  # SGLang rolled back: the old version serves
            except BaseException:
                self.version = None  # a timeout or a lost connection: unknown until checked
                raise
            seconds["update"] = time.perf_counter() - t2
            self.version = None  # the server took the update; what it serves is checked next
            info = self.model_info()
            served = info.get("weight_version")
            if served is not None and str(served) != version_id:
                raise WeightVersionMismatchError(
                    f"after updating to {version_id!r} the server at {self.url} reports "
                    f"weight_version {served!r}")
            loaded = info.get("model_path")
            if loaded is not None and str(loaded).rstrip("/") != model_path.rstrip("/"):
                raise EngineMismatchError(
                    f"after updating to {version_id!r} from {model_path} the server at "
                    f"{self.url} reports model_path {loaded!r}", field="model")
            self.version = version_id
        except BaseException as e:
            failure = e
            raise
        finally:
            self.resume(failure)
        self.health()
        return answer

    def flush_until_drained(self) -> None:
        """``POST /flush_cache`` until 200; SGLang answers 400 while requests run or wait."""
        attempts = 0

        def flush() -> httpx.Response:
            nonlocal attempts
            attempts += 1
            return self.request("POST", "/flush_cache", timeout=self.timeouts.control_s,
                                idempotent=True, admin=True)

        r = self.retry(self.timeouts.flush_deadline_s).call(
            flush, transient=lambda e: False, again=lambda r: r.status_code == 400)
        if r.status_code == 400:
            raise EngineTimeoutError(
                f"the server at {self.url} still had running or waiting requests after "
                f"{self.timeouts.flush_deadline_s:.0f}s ({attempts} /flush_cache attempts); "
                "generation was paused and is being continued")
        if r.status_code != 200:
            raise EngineRequestError(f"POST /flush_cache at {self.url} answered "
                                     f"{r.status_code}: {message(r)}")

    def update(self, version_id: str, model_path: str, load_format: str | None) -> dict:
        """``POST /update_weights_from_disk``; ``success: false`` is :class:`WeightUpdateError`
        with SGLang's message (the server rolled back: :attr:`version` stays)."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": version_id,
                                "flush_cache": True, "abort_all_requests": False}
        if load_format is not None:
            body["load_format"] = load_format
        r = self.request("POST", "/update_weights_from_disk", body,
                         timeout=self.timeouts.update_s, idempotent=False, admin=True)
        answer = self.decode(r, "/update_weights_from_disk", allow_400=True)
        if not isinstance(answer, dict) or "success" not in answer:
            raise EngineRequestError(f"/update_weights_from_disk at {self.url} answered "
                                     f"{answer!r:.200}")
        if not answer["success"]:
            raise WeightUpdateError(
                f"SGLang at {self.url} could not load version {version_id!r} from {model_path}: "
                f"{answer.get('message', '')} (it keeps serving {self.version!r})")
        return answer

    # --- weight-update sessions: refits from tensors ---------------------------------------

    def weight_route(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST route`` of SGLang's weight-update family (admin level, not retried once
        sent): its ``{"success", "message"}`` answer; ``success: false`` (SGLang answers 400)
        is :class:`WeightUpdateError` with SGLang's message, an answer of another shape
        :class:`EngineRequestError`."""
        r = self.request("POST", route, body, timeout=self.timeouts.update_s, idempotent=False,
                         admin=True)
        answer = self.decode(r, route, allow_400=True)
        if not isinstance(answer, dict) or "success" not in answer:
            raise EngineRequestError(f"{route} at {self.url} answered {answer!r:.200}")
        if not answer["success"]:
            raise WeightUpdateError(f"POST {route} at {self.url} failed: "
                                    f"{answer.get('message', '')}")
        return answer

    def begin_weight_update(self) -> dict[str, Any]:
        """``POST /begin_weight_update``: open a weight-update session (SGLang undoes any
        in-place repacking so the layers take checkpoint-format tensors again). One session
        at a time: a second is refused until :meth:`end_weight_update`."""
        return self.weight_route("/begin_weight_update", {})

    def update_weights_from_tensor(self, *, serialized_named_tensors: list[str],
                                   load_format: str | None, flush_cache: bool,
                                   weight_version: str | None) -> dict[str, Any]:
        """``POST /update_weights_from_tensor``: load one payload per tensor-parallel rank
        (base64 of SGLang's ``MultiprocessingSerializer``, :func:`alignd.sync.tensor.serialize`:
        CUDA tensors travel as IPC handles, so the server must share the sender's GPUs).
        ``weight_version`` renames what the server serves once it loaded."""
        self.version = None  # the weights change; what is served is known once checked
        return self.weight_route("/update_weights_from_tensor", {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format, "flush_cache": flush_cache,
            "abort_all_requests": False, "weight_version": weight_version})

    def init_weights_update_group(self, *, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int, group_name: str,
                                  backend: str) -> dict[str, Any]:
        """``POST /init_weights_update_group``: the server's ranks join process group
        ``group_name`` of ``world_size`` ranks at ``master_address:master_port`` (theirs from
        ``rank_offset``; the trainer joins as rank 0 meanwhile: the call returns once all
        have)."""
        return self.weight_route("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        load_format: str | None, flush_cache: bool,
                                        weight_version: str | None) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: receive the tensors ``names``
        (``dtypes``, ``shapes``) broadcast over ``group_name`` from rank 0 and load them; the
        call returns once they are loaded, so the sender broadcasts while it waits."""
        self.version = None  # the weights change; what is served is known once checked
        return self.weight_route("/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes),
            "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
            "load_format": load_format, "flush_cache": flush_cache,
            "abort_all_requests": False, "weight_version": weight_version})

    def end_weight_update(self) -> dict[str, Any]:
        """``POST /end_weight_update``: close the session; SGLang runs every layer's
        ``process_weights_after_loading`` on what was loaded (a ``libalign_minite`` or
        ``modelopt_fp4`` layer prepares its bits for the GEMM there)."""
        return self.weight_route("/end_weight_update", {})

    def resume(self, failure: BaseException | None) -> None:
        """``POST /continue_generation``; its own failure is raised unless it would hide
        ``failure``, the error of the switch it ends (then it is logged)."""
        try:
            self.json("POST", "/continue_generation", {}, admin=True)
        except AlignError as e:
            log.error("POST /continue_generation at %s failed; the server may stay paused: %s",
                      self.url, e)
            if failure is None:
                raise
