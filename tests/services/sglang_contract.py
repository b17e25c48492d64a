"""A recorded-contract SGLang server: SGLang's HTTP shapes with a deterministic fake model.

The SGLang adapter (``services/alignd/sampler/sglang_engine.py``) is tested against this app served by
uvicorn on a real port, never a mock transport, so every request crosses HTTP and JSON as it
would against a real server. It replays the request and answer shapes of these sources of
sgl-project/sglang (https://github.com/sgl-project/sglang):

* ``python/sglang/srt/entrypoints/http_server.py`` @ ``0025436eab0556737d615b36a4dd3e1e26e82f3d``
  (routes, status codes, the answers of update/pause/continue/flush, ``get_model_info``,
  ``/health`` answering 503 while starting, validation errors as 400 ``ErrorResponse``
  ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``,
  ``ValueError`` in ``/generate`` as 400 ``{"error": {"message"}}``);
* ``python/sglang/srt/managers/io_struct.py`` @ ``001067fffe33427bee0ed2f007fb7551a1d76b44``
  (``GenerateReqInput``: batch or single ``input_ids``, per-row ``sampling_params`` /
  ``rid`` / ``logprob_start_len``, rid uniqueness and count checks;
  ``UpdateWeightFromDiskReqInput``, ``PauseGenerationReqInput.mode``,
  ``ContinueGenerationReqInput``);
* ``python/sglang/srt/sampling/sampling_params.py`` @ ``00c17cafcb9e289d5ca97c50e44ada54e4fd5b03``
  (the accepted keys; ``SamplingParams(**d)`` raises ``TypeError`` on an unknown key, which
  ``/generate`` does not catch: a 500; ``verify`` raises ``ValueError``: a 400);
* ``python/sglang/srt/managers/scheduler_output_processor_mixin.py`` @
  ``004ec010d0292427acff6a0003fd5fd4c91fb356`` (``input_token_logprobs``: ``[None] +`` values
  for positions ``logprob_start_len .. L-1``; ``logprob_semantics="legacy"`` replays the older
  scheduler, ``L - s - 1`` entries for ``s+1 .. L-1`` and a null pad only when ``s == 0``);
* ``python/sglang/srt/layers/quantization/modelopt_quant.py`` @
  ``003ca3e5152c94c92d88fd43d5eb58e55201e895`` (what ``update_weights_from_disk`` checks of a
  ModelOpt NVFP4 directory here: ``hf_quant_config.json`` with ``quant_algo`` NVFP4, a
  ``group_size``, non-empty ``exclude_modules``; uint8 ``weight``, float8 ``weight_scale``,
  scalar fp32 ``weight_scale_2``); a server reporting ``libalign_minite``
  (``alignd.sampler.sglang_quant``) checks that method's layout instead: the flat config with
  ``quant_method`` libalign_minite and spec minite, fp32 ``weight_scale_2`` ``[N, 1]``.

Unknown fields
    SGLang ignores unknown top-level fields (``GenerateReqInput`` is a dataclass and pydantic
    ignores extra fields of dataclasses; the weight-update inputs are structs that do the
    same). That would hide a misspelt field, so by default (``strict=True``) this server
    rejects them with a 400 naming the field; ``strict=False`` behaves like SGLang.

The fake model
    The log-prob of token ``t`` after context ``c`` under weight version ``v`` is a fixed hash
    of ``(v, c, t)`` mapped into ``[-4.05, -0.05)``; sampling draws a token from a hash of
    ``(v, c, sampling_seed)`` (of ``(v, c)`` at temperature 0). So generation and teacher
    forcing agree exactly, a new version changes every log-prob, and the same seed repeats.

Switches (plain attributes, set by a test between calls)
    ``starting_s``: ``/health`` answers 503 for this long after start; ``unavailable``:
    route -> how many next calls answer 503; ``delay``: route -> seconds a call waits before
    answering (timeouts); ``fail_update``: the next update answers ``{"success": false,
    "message": ...}`` and keeps the old weights; ``busy_flushes``: how many next
    ``/flush_cache`` calls answer 400 (requests still in flight); ``shift_input_logprobs``:
    shift ``input_token_logprobs`` by this many positions (an off-by-one server);
    ``sticky_version``: updates keep the old ``weight_version``. ``max_in_flight`` is the most
    ``/generate`` calls that ran at once. ``calls`` records every request in order:
    ``(method, path, body, status)``, once answered; ``arrived`` counts the requests per
    route as they arrive (before any ``delay``).

Server set-up (constructor arguments)
    ``api_key``: SGLang's ``--api-key`` (``add_api_key_middleware``: 401 ``{"error":
    "Unauthorized"}`` without ``Authorization: Bearer <key>``, except ``/health*`` and
    ``/metrics``); ``admin_api_key``: ``--admin-api-key``, the only key ``admin_routes``
    (ADMIN_OPTIONAL) take when it is set (``utils/auth.py``, ``decide_request_auth``);
    ``quantization``: what ``/get_server_info`` reports (``--quantization``);
    ``routed_experts``: ``--enable-return-routed-experts`` (a dict: ``num_layers``, MoE
    ``layers``, ``top_k``, ``num_experts``, and ``dtype``, the server's
    ``SGLANG_ROUTED_EXPERTS_DTYPE``, announced as ``meta_info.routed_experts_dtype`` when other
    than int32): a request with ``return_routed_experts`` gets ``meta_info.routed_experts``,
    base64 of ``[len(tokens) - 1, num_layers, top_k]`` ids, zero in layers without a router
    (``state_capturer/routed_experts.py`` and ``base.py``, ``detokenizer_manager.py`` of SGLang
    0.5.23); without it the field is absent, as in SGLang. The fake router's choice for a token
    is a hash of ``(version, context, layer)`` (:meth:`SGLangContract.route`);
    ``corrupt_routed_experts``: a string sent instead of the payload;
    ``deterministic`` and ``attention_backend``: what it reports of
    ``--enable-deterministic-inference`` and ``--attention-backend`` (the backend is left out
    of the answer when None); ``env_vars``:
    the server's ``SGLANG_*`` environment. ``/get_server_info`` lists it in
    ``internal_states[0].env_vars`` only when ``SGLANG_EXPOSE_OWN_ENV_VARS`` is true
    (``environ.exportable_env_vars``, ``scheduler``'s ``_add_env_vars``), and sampled tokens'
    log-probs are tempered (``lp / T``, a stand-in for ``log_softmax(z / T)``) at a temperature
    other than 0 or 1 unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is true
    (``layers/sampler.py``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import safe_open

#: GenerateReqInput's fields (io_struct.py @ 001067ff), typed below only where the adapter uses them.
GENERATE_FIELDS = {
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data",
    "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs",
    "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream", "log_metrics",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_router_hint", "routing_key",
    "conversation_id", "http_worker_ipc", "background", "require_reasoning",
    "max_thinking_tokens", "priority", "extra_key", "no_logs", "custom_labels", "return_bytes",
    "return_entropy", "return_prompt_token_ids", "external_trace_header", "received_time",
    "cache_salt",
}
#: SamplingParams' API fields (sampling_params.py @ 00c17caf).
SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}


#: Routes this contract treats as ADMIN_OPTIONAL (--admin-api-key alone unlocks them).
ADMIN_ROUTES = ("/pause_generation", "/flush_cache", "/update_weights_from_disk",
                "/continue_generation", "/begin_weight_update", "/end_weight_update",
                "/update_weights_from_tensor", "/update_weights_from_distributed",
                "/init_weights_update_group")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateBody(_Lenient):
    """The typed part of ``GenerateReqInput``."""

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False


class UpdateFromDiskBody(_Lenient):
    """``UpdateWeightFromDiskReqInput`` (io_struct.py @ 001067ff)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None
    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseBody(_Lenient):
    """``PauseGenerationReqInput``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None
    http_worker_ipc: str | None = None


class ContinueBody(_Lenient):
    """``ContinueGenerationReqInput``."""

    torch_empty_cache: bool = True
    rid: str | None = None
    http_worker_ipc: str | None = None


class BeginWeightUpdateBody(_Lenient):
    """``BeginWeightUpdateReqInput`` (SGLang 0.5.23)."""

    selector: Literal["target", "draft", "all"] = "all"
    rid: str | None = None
    http_worker_ipc: str | None = None


class EndWeightUpdateBody(_Lenient):
    """``EndWeightUpdateReqInput``."""

    rid: str | None = None
    http_worker_ipc: str | None = None


class UpdateFromTensorBody(_Lenient):
    """``UpdateWeightsFromTensorReqInput``: over HTTP each payload is base64."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    rid: str | None = None
    http_worker_ipc: str | None = None


class UpdateFromDistributedBody(_Lenient):
    """``UpdateWeightsFromDistributedReqInput``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    rid: str | None = None
    http_worker_ipc: str | None = None


class InitGroupBody(_Lenient):
    """``InitWeightsUpdateGroupReqInput``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    rid: str | None = None
    http_worker_ipc: str | None = None


@dataclass
class Call:
    """One request the server answered."""

    method: str
    path: str
    body: Any
    status: int


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class SGLangContract:
    """The app and its state; ``app`` is what uvicorn serves."""

    def __init__(self, *, vocab_size: int = 64, weight_version: str = "default",
                 model_path: str = "/models/base", strict: bool = True,
                 logprob_semantics: Literal["current", "legacy"] = "current",
                 api_key: str | None = None, quantization: str | None = "modelopt_fp4",
                 env_vars: dict[str, str] | None = None, admin_api_key: str | None = None,
                 admin_routes: tuple[str, ...] = ADMIN_ROUTES, deterministic: bool = False,
                 attention_backend: str | None = None, routed_experts: dict | None = None):
        self.api_key = api_key
        self.routed_experts = routed_experts
        self.corrupt_routed_experts: str | None = None
        self.deterministic = deterministic
        self.attention_backend = attention_backend
        self.admin_api_key = admin_api_key
        self.admin_routes = admin_routes
        self.quantization = quantization
        self.env_vars = env_vars
        self.vocab_size = vocab_size
        self.weight_version = weight_version
        self.model_path = model_path
        self.strict = strict
        self.logprob_semantics = logprob_semantics
        self.started = time.monotonic()
        self.starting_s = 0.0
        self.unavailable: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.fail_update: str | None = None
        self.busy_flushes = 0
        self.shift_input_logprobs = 0
        self.paused: str | None = None  # the pause mode, or None
        self.sticky_version = False  # an update that does not take the weight_version asked
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted_epoch = 0  # bumped by an abort pause; requests of an older epoch abort
        # an aborted request keeps running until this many flushes were refused (None: its
        # whole ``/generate:running`` delay), so a test sees a flush refused while it drains
        self.drain_after_refused_flushes: int | None = None
        # a running request also stays until this many run at once (None: no such wait), so a
        # test sees concurrency without racing the host's speed
        self.hold_until_in_flight: int | None = None
        self.refused_flushes = 0
        # weight-update sessions: whether one is open, the groups joined, and the next answer
        # of a route made to fail (path -> SGLang's message)
        self.session_open = False
        self.groups: dict[str, int] = {}
        self.fail_weight_route: dict[str, str] = {}
        self.calls: list[Call] = []
        self.arrived: Counter[str] = Counter()
        self.app = self._build()

    # --- the fake model -----------------------------------------------------------------

    def logprob(self, context: list[int], token: int, version: str | None = None) -> float:
        """log p(token | context) under ``version`` (the served one by default)."""
        v = self.weight_version if version is None else version
        return -0.05 - (_h("lp", v, tuple(context), token) % 4000) / 1000.0

    def route(self, context: list[int], layer: int) -> list[int]:
        """The fake router's top-k ids (in slot order) for the last token of ``context``."""
        re = self.routed_experts or {}
        experts = range(int(re["num_experts"]))
        key = (self.weight_version, tuple(context), layer)
        return sorted(experts, key=lambda e: _h("route", *key, e))[:int(re["top_k"])]

    def routed_payload(self, tokens: list[int]) -> dict[str, str]:
        """``meta_info``'s ``routed_experts`` (and ``routed_experts_dtype``) for a sequence."""
        import numpy as np

        re = self.routed_experts or {}
        dtype = re.get("dtype") or "int32"
        dense = np.zeros((len(tokens) - 1, int(re["num_layers"]), int(re["top_k"])), np.int32)
        for j in range(len(tokens) - 1):
            for layer in re["layers"]:
                dense[j, layer] = self.route(tokens[:j + 1], layer)
        out = {"routed_experts": self.corrupt_routed_experts or base64.b64encode(
            dense.astype(dtype).tobytes()).decode("utf-8")}
        if dtype != "int32":
            out["routed_experts_dtype"] = dtype
        return out

    def original_logprobs(self) -> bool:
        """Whether this server reports untempered log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB)."""
        return str((self.env_vars or {}).get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")).lower() in (
            "true", "1", "yes", "y")

    def sampled_logprob(self, context: list[int], token: int, temperature: float) -> float:
        """The log-prob ``/generate`` reports for a sampled token: tempered at T not in {0, 1}
        unless the server returns original log-probs (a stand-in for log_softmax(z / T))."""
        lp = self.logprob(context, token)
        if temperature in (0.0, 1.0) or self.original_logprobs():
            return lp
        return lp / temperature

    def draw(self, context: list[int], seed: int | None, temperature: float) -> int:
        """The token sampled after ``context``."""
        if temperature == 0:
            return _h("greedy", self.weight_version, tuple(context)) % self.vocab_size
        return _h("draw", self.weight_version, tuple(context), seed) % self.vocab_size

    # --- helpers ------------------------------------------------------------------------

    def routes(self, *, with_status: bool = False) -> list:
        """``(method, path)`` of every recorded call (with the status if asked)."""
        return [(c.method, c.path, c.status) if with_status else (c.method, c.path)
                for c in self.calls]

    def _record(self, request: Request, body: Any, status: int) -> None:
        self.calls.append(Call(request.method, request.url.path, body, status))

    async def _gate(self, request: Request, body: Any) -> Response | None:
        path = request.url.path
        self.arrived[path] += 1
        if self.unavailable.get(path, 0) > 0:
            self.unavailable[path] -= 1
            self._record(request, body, 503)
            return Response(status_code=503)
        if self.delay.get(path):
            await asyncio.sleep(self.delay[path])
        return None

    @staticmethod
    async def _body(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return "<not json>"

    def _bad_request(self, request: Request, body: Any, message: str) -> JSONResponse:
        """How SGLang answers a request that fails validation (400, not FastAPI's 422)."""
        self._record(request, body, 400)
        return JSONResponse({"object": "error", "message": message, "type": "Bad Request",
                             "param": None, "code": 400}, status_code=400)

    def _value_error(self, request: Request, body: Any, message: str) -> JSONResponse:
        """``_create_error_response(ValueError)`` of ``/generate``."""
        self._record(request, body, 400)
        return JSONResponse({"error": {"message": message}}, status_code=400)

    def _validate(self, request: Request, body: Any, model: type[BaseModel],
                  known: set[str] | None = None) -> BaseModel | JSONResponse:
        data = {} if body is None else body
        if not isinstance(data, dict):
            return self._bad_request(request, body, "the body must be a JSON object")
        if self.strict:
            unknown = sorted(set(data) - (known or set(model.model_fields)))
            if unknown:
                return self._bad_request(request, body, f"unknown field(s) {unknown} (SGLang "
                                         "would ignore them; this contract rejects them)")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            return self._bad_request(request, body, str(e))

    # --- the routes ---------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def authentication(request: Request, call_next):
            """SGLang's decide_request_auth: Bearer api_key on normal routes; admin_api_key
            alone on ADMIN_OPTIONAL routes when it is set; /health* and /metrics open."""
            path = request.url.path
            if request.method == "OPTIONS" or path.startswith(("/health", "/metrics")):
                return await call_next(request)
            key = (self.admin_api_key if path in self.admin_routes and self.admin_api_key
                   else self.api_key)
            if key is not None and request.headers.get("Authorization") != "Bearer " + key:
                self._record(request, None, 401)
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def get_server_info(request: Request) -> Response:
            if (gated := await self._gate(request, None)) is not None:
                return gated
            self._record(request, None, 200)
            state: dict[str, Any] = {"dp_rank": 0, "weight_version": self.weight_version}
            env = self.env_vars or {}
            if str(env.get("SGLANG_EXPOSE_OWN_ENV_VARS", "")).lower() in ("true", "1", "yes", "y"):
                state["env_vars"] = dict(env)  # environ.exportable_env_vars()
            info = {"model_path": self.model_path, "tokenizer_path": self.model_path,
                    "quantization": self.quantization,
                    "enable_deterministic_inference": self.deterministic,
                    "enable_return_routed_experts": self.routed_experts is not None,
                    "internal_states": [state], "version": "0.5.6"}
            if self.attention_backend is not None:
                info["attention_backend"] = self.attention_backend
            return JSONResponse(info)

        @app.get("/health")
        @app.get("/health_generate")
        async def health(request: Request) -> Response:
            if (gated := await self._gate(request, None)) is not None:
                return gated
            status = 503 if time.monotonic() - self.started < self.starting_s else 200
            self._record(request, None, status)
            return Response(status_code=status)

        @app.get("/get_model_info")
        async def get_model_info(request: Request) -> Response:
            if (gated := await self._gate(request, None)) is not None:
                return gated
            self._record(request, None, 200)
            return JSONResponse({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                 "is_generation": True, "preferred_sampling_params": None,
                                 "weight_version": self.weight_version})

        @app.get("/get_weight_version")
        async def get_weight_version(request: Request) -> Response:
            self._record(request, None, 200)
            return JSONResponse({"weight_version": self.weight_version})

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request) -> Response:
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return gated
            ok = self.in_flight == 0 and self.busy_flushes == 0
            if self.busy_flushes > 0:
                self.busy_flushes -= 1
            status = 200 if ok else 400
            self.refused_flushes += status == 400
            self._record(request, body, status)
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n",
                status_code=status)

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> Response:
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return gated
            parsed = self._validate(request, body, PauseBody)
            if isinstance(parsed, JSONResponse):
                return parsed
            self.paused = parsed.mode
            if parsed.mode == "abort":
                self.aborted_epoch += 1
            self._record(request, body, 200)
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

        @app.post("/continue_generation")
        async def continue_generation(request: Request) -> Response:
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return gated
            parsed = self._validate(request, body, ContinueBody)
            if isinstance(parsed, JSONResponse):
                return parsed
            self.paused = None
            self._record(request, body, 200)
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> Response:
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return gated
            parsed = self._validate(request, body, UpdateFromDiskBody)
            if isinstance(parsed, JSONResponse):
                return parsed
            while self.in_flight and not self.paused:  # the writer lock waits for readers
                await asyncio.sleep(0.01)
            if self.fail_update is not None:
                message, self.fail_update = self.fail_update, None
                ok = False
            else:
                problem = check_modelopt_dir(Path(parsed.model_path), self.quantization)
                ok = problem is None
                message = ("Succeeded to update model weights." if ok
                           else f"Failed to get weights iterator: {problem}.")
            if ok:
                self.model_path = parsed.model_path
                if parsed.weight_version is not None and not self.sticky_version:
                    self.weight_version = parsed.weight_version
                    message += f" Weight version updated to {parsed.weight_version}."
            self._record(request, body, 200 if ok else 400)
            return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0},
                                status_code=200 if ok else 400)

        def weight_answer(request: Request, body: Any, ok: bool, message: str) -> Response:
            if ok and request.url.path in self.fail_weight_route:
                ok, message = False, self.fail_weight_route.pop(request.url.path)
            self._record(request, body, 200 if ok else 400)
            return JSONResponse({"success": ok, "message": message},
                                status_code=200 if ok else 400)

        async def weight_body(request: Request, model: type[BaseModel]):
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return body, gated
            return body, self._validate(request, body, model)

        @app.post("/begin_weight_update")
        async def begin_weight_update(request: Request) -> Response:
            body, parsed = await weight_body(request, BeginWeightUpdateBody)
            if isinstance(parsed, Response):
                return parsed
            if self.session_open:  # scheduler_components/weight_updater.py's words
                return weight_answer(request, body, False, "a weight-update session is "
                                     "already open; call end_weight_update() first")
            self.session_open = True
            return weight_answer(request, body, True, "Success")

        @app.post("/end_weight_update")
        async def end_weight_update(request: Request) -> Response:
            body, parsed = await weight_body(request, EndWeightUpdateBody)
            if isinstance(parsed, Response):
                return parsed
            if not self.session_open:
                return weight_answer(request, body, False, "no weight-update session is "
                                     "open; call begin_weight_update() first")
            self.session_open = False
            return weight_answer(request, body, True, "Success")

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(request: Request) -> Response:
            body, parsed = await weight_body(request, UpdateFromTensorBody)
            if isinstance(parsed, Response):
                return parsed
            try:
                for payload in parsed.serialized_named_tensors:
                    base64.b64decode(payload, validate=True)
            except ValueError as e:
                return self._bad_request(request, body, f"serialized_named_tensors: {e}")
            return weight_answer(request, body, True, self._weight_loaded(
                request.url.path, parsed, "Success"))

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request) -> Response:
            body, parsed = await weight_body(request, InitGroupBody)
            if isinstance(parsed, Response):
                return parsed
            self.groups[parsed.group_name] = parsed.world_size
            return weight_answer(request, body, True, "Succeeded to initialize custom "
                                 "process group.")

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request) -> Response:
            body, parsed = await weight_body(request, UpdateFromDistributedBody)
            if isinstance(parsed, Response):
                return parsed
            if not len(parsed.names) == len(parsed.dtypes) == len(parsed.shapes):
                return self._bad_request(request, body, "names, dtypes and shapes differ in "
                                         "length")
            if parsed.group_name not in self.groups:
                return weight_answer(request, body, False, "Failed to update parameter "
                                     f"online: group {parsed.group_name!r} is not initialized")
            return weight_answer(request, body, True, self._weight_loaded(
                request.url.path, parsed, "Succeeded to update parameter online."))

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Response:
            body = await self._body(request)
            if (gated := await self._gate(request, body)) is not None:
                return gated
            parsed = self._validate(request, body, GenerateBody, GENERATE_FIELDS)
            if isinstance(parsed, JSONResponse):
                return parsed
            return await self._generate(request, body, parsed)

        return app

    def _weight_loaded(self, path: str, parsed: Any, message: str) -> str:
        """A tensor or distributed update that loads (unless made to fail): the version named,
        as the tokenizer manager's ``_update_weight_version_if_provided``."""
        if parsed.weight_version is not None and path not in self.fail_weight_route:
            self.weight_version = parsed.weight_version
            message += f" Weight version updated to {parsed.weight_version}."
        return message

    async def _generate(self, request: Request, body: Any, req: GenerateBody) -> Response:
        if req.input_ids is None:
            return self._value_error(request, body, "Either text, input_ids or input_embeds "
                                     "should be provided.")
        if len(req.input_ids) == 0:
            return self._value_error(request, body, "input_ids cannot be empty.")
        single = isinstance(req.input_ids[0], int)
        rows: list[list[int]] = [req.input_ids] if single else req.input_ids  # type: ignore[list-item]
        n = len(rows)

        def per_row(value: Any, default: Any, name: str) -> list | str:
            if value is None:
                return [default] * n
            if isinstance(value, list):
                if len(value) != n:
                    return f"The length of {name} ({len(value)}) should equal the batch size ({n})."
                return value
            return [value] * n

        rids = per_row(req.rid, None, "rid")
        if isinstance(req.rid, str) and not single:
            rids = [f"{req.rid}_{i}" for i in range(n)]
        params = per_row(req.sampling_params, {}, "sampling_params")
        want_lp = per_row(req.return_logprob, False, "return_logprob")
        starts = per_row(req.logprob_start_len, -1, "logprob_start_len")
        for v in (rids, params, want_lp, starts):
            if isinstance(v, str):
                return self._value_error(request, body, v)
        rids = [r if r is not None else f"rid-{i}-{time.monotonic_ns()}" for i, r in enumerate(rids)]
        if len(set(rids)) != len(rids):
            return self._value_error(request, body, f"Duplicate request IDs detected within the "
                                     f"request: {sorted({r for r in rids if rids.count(r) > 1})}")
        for sp in params:
            unknown = sorted(set(sp) - SAMPLING_FIELDS)
            if unknown:  # SamplingParams(**d): a TypeError the route does not catch
                self._record(request, body, 500)
                return PlainTextResponse("Internal Server Error", status_code=500)
            problem = verify_sampling(sp, self.vocab_size)
            if problem:
                return self._value_error(request, body, problem)
        for row, s in zip(rows, starts, strict=True):
            if s is not None and s >= len(row):
                return self._value_error(request, body, f"logprob_start_len ({s}) is superior or "
                                         f"equal to the length of the input ({len(row)})")

        while self.paused:  # new requests wait while generation is paused
            await asyncio.sleep(0.01)
        epoch = self.aborted_epoch
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._run_for(self.delay.get("/generate:running", 0.0), epoch)
        finally:
            self.in_flight -= 1
        aborted = self.aborted_epoch != epoch
        out = []
        for rid, row, sp, lp_on, s in zip(rids, rows, params, want_lp, starts, strict=True):
            out.append(self._one(rid, row, sp, bool(lp_on), s, req.return_text_in_logprobs,
                                 aborted))
            if req.return_routed_experts and self.routed_experts and not aborted:
                out[-1]["meta_info"].update(self.routed_payload(row + out[-1]["output_ids"]))
        self._record(request, body, 200)
        return JSONResponse(out[0] if single else out)

    async def _run_for(self, seconds: float, epoch: int) -> None:
        """A running request's time on the server: ``seconds``, or, aborted (an abort pause
        after it started) with ``drain_after_refused_flushes`` set, until that many flushes
        have been refused."""
        loop = asyncio.get_running_loop()
        hold_end = loop.time() + 30.0
        while self.hold_until_in_flight is not None and self.max_in_flight < \
                self.hold_until_in_flight and loop.time() < hold_end:
            await asyncio.sleep(0.005)
        end = loop.time() + seconds
        while loop.time() < end:
            if (self.drain_after_refused_flushes is not None and self.aborted_epoch != epoch
                    and self.refused_flushes >= self.drain_after_refused_flushes):
                return
            await asyncio.sleep(min(0.005, max(0.0, end - loop.time())))

    def _one(self, rid: str, row: list[int], sp: dict, lp_on: bool, start: int | None,
             with_text: bool, aborted: bool) -> dict:
        max_new = sp.get("max_new_tokens", 128)
        temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
        seed = sp.get("sampling_seed")
        stops = set(sp.get("stop_token_ids") or [])
        ctx = list(row)
        out_tokens: list[int] = []
        out_lps: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        if aborted:
            finish = {"type": "abort", "message": "Abort in waiting queue"}
        else:
            for _ in range(max_new):
                t = self.draw(ctx, seed, temperature)
                out_lps.append(self.sampled_logprob(ctx, t, temperature))
                out_tokens.append(t)
                ctx.append(t)
                if t in stops:
                    finish = {"type": "stop", "matched": t}
                    break

        def text(t: int) -> str | None:
            return f"<{t}>" if with_text else None

        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(row),
            "weight_version": self.weight_version, "completion_tokens": len(out_tokens),
            "cached_tokens": 0, "e2e_latency": 0.001,
        }
        if lp_on:
            meta["output_token_logprobs"] = [[lp, t, text(t)]
                                             for lp, t in zip(out_lps, out_tokens, strict=True)]
            meta["input_token_logprobs"] = self._input_logprobs(row, start, text)
        return {"text": "".join(f"<{t}>" for t in out_tokens), "output_ids": out_tokens,
                "meta_info": meta}

    def _input_logprobs(self, row: list[int], start: int | None, text) -> list[list]:
        L = len(row)
        s = L - 1 if start is None or start < 0 else start
        k = self.shift_input_logprobs

        def entry(j: int) -> list:
            jj = min(max(j + k, 1), L - 1)
            return [self.logprob(row[:jj], row[jj]), row[jj], text(row[jj])]

        if self.logprob_semantics == "current":
            return [[None, row[s], text(row[s])]] + [entry(j) for j in range(s + 1, L)]
        pad = [[None, row[0], text(row[0])]] if s == 0 else []
        return pad + [entry(j) for j in range(s + 1, L)]


def verify_sampling(sp: dict, vocab_size: int) -> str | None:
    """``SamplingParams.verify``'s checks on the keys the adapter sends (its ValueError text)."""
    t = sp.get("temperature", 1.0)
    if t is not None and (not isinstance(t, int | float) or not math.isfinite(t) or t < 0):
        return f"temperature must be a non-negative finite number, got {t}."
    m = sp.get("max_new_tokens", 128)
    if m is not None and (not isinstance(m, int) or m < 0):
        return f"max_new_tokens must be at least 0, got {m}."
    seed = sp.get("sampling_seed")
    if seed is not None and not isinstance(seed, int):
        return f"sampling_seed must be an integer, got {seed!r}."
    stops = sp.get("stop_token_ids")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(x, int) for x in stops)):
        return f"stop_token_ids must be a list of token ids, got {stops!r}."
    return None


def check_modelopt_dir(path: Path, quantization: str | None = "modelopt_fp4") -> str | None:
    """What keeps SGLang's ``modelopt_fp4`` (or, for ``quantization`` libalign_minite, that
    method) from loading ``path`` (None: nothing)."""
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json"
    rows = quantization == "libalign_minite"
    try:
        q = json.loads((path / "hf_quant_config.json").read_text())
        q = q if rows else q["quantization"]
    except (OSError, ValueError, KeyError) as e:
        return f"{path}/hf_quant_config.json is missing or malformed ({e})"
    if rows:
        if (q.get("quant_method"), q.get("spec")) != ("libalign_minite", "minite"):
            return f"quantization config {q} is not libalign_minite's (spec minite)"
    elif q.get("quant_algo") not in ("FP8", "NVFP4"):
        return f"quant_algo {q.get('quant_algo')!r} is not FP8 or NVFP4"
    elif not (q.get("group_size") and q.get("exclude_modules")):
        return "NVFP4 quantization requires group size and kv_cache_quant_algo specified"
    index = path / "model.safetensors.index.json"
    shards = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
              if index.is_file() else ["model.safetensors"])
    for shard in shards:
        if not (path / shard).is_file():
            return f"shard {shard} is missing"
        with safe_open(path / shard, framework="pt") as f:
            names = set(f.keys())
            for name in names:
                sl = f.get_slice(name)
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                if name.endswith(".weight_scale_2") and rows and (
                        dtype != "F32" or len(shape) != 2 or shape[1] != 1):
                    return f"{name} is {dtype}{shape}; libalign_minite loads F32 [N, 1]"
                if name.endswith(".weight_scale_2") and not rows and (shape != [] or dtype != "F32"):
                    return f"{name} is {dtype}{shape}; modelopt_fp4 loads a scalar F32"
                if name.endswith(".weight_scale") and dtype != "F8_E4M3":
                    return f"{name} is {dtype}, not F8_E4M3"
                if (name.endswith(".weight") and f"{name}_scale" in names
                        and dtype != "U8"):
                    return f"{name} is {dtype}, not packed U8"
    return None
