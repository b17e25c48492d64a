"""The sampler engine over a running SGLang server: the :class:`SamplerEngine` protocol on HTTP.

At scale the sampler is not a model in this process but an SGLang server (one per node or per
tensor-parallel group) that this adapter drives through SGLang's native HTTP API. The adapter
keeps the protocol of :mod:`alignd.sampler.engine`, so :class:`SamplerService` runs it
unchanged: it loads versions, generates with log-probs, scores given tokens.

What was matched, and where (sgl-project/sglang sources read for this module)
    ``python/sglang/srt/entrypoints/http_server.py`` @ ``0025436eab0556737d615b36a4dd3e1e26e82f3d``:
    the routes ``POST /generate``, ``POST /update_weights_from_disk`` (answers
    ``{"success", "message", "num_paused_requests"}``, 200 or 400), ``POST /pause_generation``
    and ``POST /continue_generation`` (``{"message", "status": "ok"}``), ``GET|POST
    /flush_cache`` (plain text, 200, or 400 "when there are running or waiting requests"),
    ``GET /get_model_info`` (``model_path``, ``tokenizer_path``, ``is_generation``,
    ``preferred_sampling_params``, ``weight_version``), ``GET /health`` (503 while the server
    is starting). Validation errors answer 400 (SGLang overrides FastAPI's 422).

    ``python/sglang/srt/managers/io_struct.py`` @ ``001067fffe33427bee0ed2f007fb7551a1d76b44``:
    ``GenerateReqInput`` (``rid``, ``input_ids`` one list or a batch of lists,
    ``sampling_params`` one dict or one per row, ``return_logprob``, ``logprob_start_len``
    an int or one per row), ``UpdateWeightFromDiskReqInput`` (``model_path``,
    ``load_format``, ``abort_all_requests``, ``weight_version``, ``flush_cache`` ...),
    ``PauseGenerationReqInput.mode`` (``abort`` | ``retract`` | ``in_place``).

    ``python/sglang/srt/sampling/sampling_params.py`` @ ``00c17cafcb9e289d5ca97c50e44ada54e4fd5b03``:
    ``max_new_tokens`` (``>= 0``), ``temperature``, ``stop_token_ids``, ``sampling_seed``
    (the seed's name). The dict is expanded into ``SamplingParams(**d)``, so a misspelt key
    is an error, while a misspelt *top-level* field is silently ignored (``GenerateReqInput``
    is a dataclass, and pydantic ignores extra fields of dataclasses): the recorded-contract
    tests in ``tests/services/sglang_contract.py`` reject unknown fields to catch that.

    ``python/sglang/srt/managers/scheduler_output_processor_mixin.py`` @
    ``004ec010d0292427acff6a0003fd5fd4c91fb356`` (``_process_input_token_logprobs``) and the
    tokenizer manager's ``detokenize_logprob_tokens``: log-probs come back in ``meta_info`` as
    ``[logprob, token_id, text]`` triples (``text`` null unless ``return_text_in_logprobs``);
    ``meta_info`` also carries ``finish_reason`` (``{"type": "stop" | "length" | "abort",
    ...}``) and ``weight_version`` (the server's at answer time).

Generating
    One ``POST /generate`` per call: ``input_ids`` as a batch, one ``sampling_params`` dict per
    row (``max_new_tokens``, ``temperature``, ``sampling_seed``, and ``stop_token_ids`` =
    ``[eos_id]`` when the engine has one), ``return_logprob: true``, our own ``rid`` per row
    (answers are matched by ``meta_info.id``). A completion's tokens and log-probs are the
    ``output_token_logprobs`` triples; ``finished`` is ``finish_reason.type == "stop"`` (the
    completion ended on a stop token, as the torch engine's ``finished`` means ended on eos);
    an ``abort`` is an :class:`~alignclient.errors.EngineRequestError`. Rows of one request
    repeat prompts (``samples_per_prompt``), so each row gets its own seed, derived from the
    request's seed and the row index. SGLang reproduces a seeded non-greedy sample only in
    its deterministic-inference mode (``--enable-deterministic-inference``).

Scoring (teacher forcing), and its off-by-one
    ``POST /generate`` with the whole sequence as ``input_ids``, ``max_new_tokens: 0`` (a
    prefill only, as SGLang's own ``/v1/score`` does), ``return_logprob: true`` and
    ``logprob_start_len = prompt_len - 1``. SGLang computes the logits from position
    ``s = logprob_start_len`` on; the log-prob of the token at position ``j`` comes from the
    logits at ``j - 1``, so the first token whose log-prob it can report is at ``s + 1 =
    prompt_len``, the first completion token. Current SGLang returns ``L - s`` entries for
    positions ``s .. L-1`` with a null log-prob first (``[None] + values``); older releases
    returned ``L - s - 1`` entries for ``s+1 .. L-1`` (and padded a null only when ``s == 0``).
    Both end with exactly the completion's ``L - prompt_len`` entries, so the adapter takes
    the last ``L - prompt_len`` entries and checks that their token ids are the completion's
    tokens: an off-by-one anywhere fails loudly rather than shifting log-probs by a token.

Loading a version (the weight-sync flow)
    1. export: the version as a ModelOpt NVFP4 checkpoint on a path the server sees
       (:mod:`alignd.sampler.sglang_export`); refusals (a preset SGLang cannot load,
       missing published files) raise before the server is touched;
    2. ``GET /health`` (retried while it answers 503);
    3. ``POST /pause_generation`` ``{"mode": "abort"}`` (the default ``pause_mode``): requests
       in flight end as aborted, new ones wait. ``abort`` is the only mode in which no
       completion mixes tokens of two versions (``retract`` re-runs them on the new weights,
       ``in_place`` keeps their old KV cache);
    4. ``POST /flush_cache`` until it answers 200: SGLang refuses (400) while requests are
       running or waiting, so this waits for the aborted ones to drain (deadline
       ``flush_deadline_s``). Only the status tells: the plain-text body reads "Cache
       flushed." either way. It matters: the scheduler asserts that its own flush after a
       weight update succeeds. (Newer SGLang can defer a flush until idle,
       ``FlushCacheReqInput.timeout_s``; polling works on every version.);
    5. ``POST /update_weights_from_disk`` ``{"model_path", "load_format", "weight_version":
       version_id, "flush_cache": true, "abort_all_requests": false}``; ``success: false``
       raises :class:`~alignclient.errors.WeightUpdateError` with SGLang's message (the server
       rolls back and keeps serving the old weights);
    6. ``GET /get_model_info``: the server must report ``weight_version == version_id``;
    7. ``POST /continue_generation``, always, also after a failure in 4-6;
    8. ``GET /health``.
    The engine holds a lock around loading, generating and scoring, so its own calls never
    overlap a load (the torch engine's pause semantics); other clients of the same server see
    SGLang's pause.

The served version
    Every answer's ``meta_info.weight_version`` is checked: all rows of a call must report the
    same one, and it must be the version this engine loaded (with ``strict_version``), else
    :class:`~alignclient.errors.WeightVersionMismatchError`; it is what
    :attr:`Generation.version_id` says. A server whose answers carry no ``weight_version``
    (older SGLang) is stamped with the engine's own record.

Guidance records
    SGLang's kernels round activations inside fused CUDA code; there is no hook through which
    the FP4 codes at a captured site could be recorded, so asking for guidance (TRACE) raises
    :class:`~alignclient.errors.GuidanceUnsupportedError`. Run an ``nvfp4_trace`` learner against
    the embedded torch sampler, or without records (round-to-nearest where none is attached).

Failures
    Each call has a timeout (``connect_s``; ``control_s`` for control routes, ``generate_s``,
    ``update_s``). Calls are retried by the project's one retry policy
    (:class:`alignclient.retry.RetryPolicy`: jittered exponential backoff from
    ``backoff_initial_s`` to ``backoff_max_s``) until ``retry_deadline_s`` when
    the server could not be reached or answered 503 (SGLang starting); idempotent calls
    (``GET`` routes, pause, continue, flush) are also retried after a read timeout or a broken
    connection, while ``/generate`` and ``/update_weights_from_disk`` are not (they may still
    be running). What is left when the deadline passes is
    :class:`~alignclient.errors.EngineUnavailableError` (could not connect, or 503) or
    :class:`~alignclient.errors.EngineTimeoutError`; any other refusal (400, 500, an answer of an
    unexpected shape) is :class:`~alignclient.errors.EngineRequestError` with SGLang's message.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from alignclient.errors import (
    AlignError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    GuidanceUnsupportedError,
    InputError,
    SpecError,
    WeightUpdateError,
    WeightVersionMismatchError,
)
from alignclient.retry import NEVER_SENT, RetryPolicy, http_transient

from alignd.sampler.engine import Generation
from libalign import gemm

log = logging.getLogger("alignd.sampler.sglang")

PAUSE_MODES = ("abort", "retract", "in_place")
SEED_MODULUS = 2**31 - 1


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


def row_seed(seed: int, row: int) -> int:
    """The ``sampling_seed`` of row ``row`` of a call with ``seed``: distinct per row (rows
    repeat prompts), stable across calls, and in the range every SGLang version accepts."""
    digest = hashlib.sha256(f"{seed}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


def _message(r: httpx.Response) -> str:
    """SGLang's words from an error answer: ``{"message"}``, ``{"error": {"message"}}``, text."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:500]
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
    return str(body)[:500]


class SGLangSamplerEngine:
    """A :class:`~alignd.sampler.engine.SamplerEngine` driving an SGLang server over HTTP."""

    def __init__(self, base_url: str, exporter: Callable[[str], Path | str], *,
                 path: str = "nvfp4_naive", eos_id: int | None = None,
                 load_format: str | None = None, pause_mode: str = "abort",
                 timeouts: SGLangTimeouts | None = None, strict_version: bool = True,
                 client: httpx.Client | None = None):
        if pause_mode not in PAUSE_MODES:
            raise InputError(f"pause_mode {pause_mode!r} is not one of {PAUSE_MODES}")
        self.path = gemm.get_path(path).name
        """The execution path this sampler stands for (versions converted for it are loaded);
        the numerics are SGLang's kernels, not libalign's spec."""
        self.base_url = base_url.rstrip("/")
        self.exporter = exporter
        self.eos_id = eos_id
        self.load_format = load_format
        self.pause_mode = pause_mode
        self.timeouts = timeouts or SGLangTimeouts()
        self.strict_version = strict_version
        self._client = client or httpx.Client(base_url=self.base_url)
        self._own_client = client is None
        self._lock = threading.Lock()
        self._version: str | None = None
        self.model_path: str | None = None
        """The export the server loaded last (through this engine)."""

    # --- the protocol ---------------------------------------------------------------------

    @property
    def version_id(self) -> str | None:
        """The version being served (None before the first load)."""
        return self._version

    def load(self, version_id: str) -> dict:
        """Export ``version_id`` and make the server serve it (the flow in the module doc)."""
        with self._lock:
            seconds: dict[str, float] = {}
            t0 = time.perf_counter()
            model_path = str(self.exporter(version_id))
            seconds["export"] = time.perf_counter() - t0
            self._health()
            t1 = time.perf_counter()
            self._json("POST", "/pause_generation", {"mode": self.pause_mode},
                       timeout=self.timeouts.control_s, idempotent=True)
            failure: BaseException | None = None
            try:
                self._flush_until_drained()
                seconds["drain"] = time.perf_counter() - t1
                t2 = time.perf_counter()
                answer = self._update(version_id, model_path)
                seconds["update"] = time.perf_counter() - t2
                served = self.served_version()
                if served is not None and served != version_id:
                    raise WeightVersionMismatchError(
                        f"after updating to {version_id!r} the server at {self.base_url} reports "
                        f"weight_version {served!r}")
                self._version = version_id
                self.model_path = model_path
            except BaseException as e:
                failure = e
                raise
            finally:
                self._continue(failure)
            self._health()
            seconds["total"] = time.perf_counter() - t0
        log.info("SGLang at %s serves %s (%s)", self.base_url, version_id, model_path)
        return {"version_id": version_id, "model_path": model_path, "seconds": seconds,
                "num_paused_requests": answer.get("num_paused_requests", 0)}

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, seed: int = 0,
                 guidance_bits: int | None = None) -> Generation:
        """Sample completions on the server; log-probs are the ones SGLang drew them with."""
        if guidance_bits is not None:
            raise GuidanceUnsupportedError(
                "the SGLang sampler cannot capture guidance records: SGLang rounds activations "
                "inside fused kernels with no hook to record the FP4 codes; use the embedded "
                "torch sampler for TRACE, or roll out without guidance_bits")
        rows = [self._tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        with self._lock:
            self._require_loaded()
            if not rows:
                return Generation(self._version, [], [], [], [])
            params = []
            for i in range(len(rows)):
                sp: dict[str, Any] = {"max_new_tokens": int(max_new_tokens),
                                      "temperature": float(temperature),
                                      "sampling_seed": row_seed(seed, i)}
                if self.eos_id is not None:
                    sp["stop_token_ids"] = [int(self.eos_id)]
                params.append(sp)
            rids = self._rids(len(rows))
            body = {"rid": rids, "input_ids": rows, "sampling_params": params,
                    "return_logprob": True}
            metas = self._generate(body, rids)
            served = self._served(metas)
            sequences, logprobs, finished = [], [], []
            for rid, prompt, meta in zip(rids, rows, metas, strict=True):
                tokens, lps = self._triples(meta.get("output_token_logprobs"), rid,
                                            "output_token_logprobs")
                sequences.append(prompt + tokens)
                logprobs.append(lps)
                finished.append(self._finished(meta, rid))
            return Generation(served, sequences, [len(p) for p in rows], logprobs, finished)

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Teacher-forced log-probs of each completion, as the server computes them."""
        if len(sequences) != len(prompt_lens):
            raise InputError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        rows = [self._tokens(s, f"sequence {i}") for i, s in enumerate(sequences)]
        lens = [int(p) for p in prompt_lens]
        for i, (row, p) in enumerate(zip(rows, lens, strict=True)):
            if not 1 <= p <= len(row):
                raise InputError(f"sequence {i}: prompt length {p} must be in 1..{len(row)} "
                                 "(the first token has no log-prob to score)")
        out: list[list[float]] = [[] for _ in rows]
        todo = [i for i, (row, p) in enumerate(zip(rows, lens, strict=True)) if len(row) > p]
        with self._lock:
            self._require_loaded()
            if not todo:
                return out
            rids = self._rids(len(todo))
            body = {"rid": rids, "input_ids": [rows[i] for i in todo],
                    "sampling_params": [{"max_new_tokens": 0} for _ in todo],
                    "return_logprob": True,
                    "logprob_start_len": [lens[i] - 1 for i in todo]}
            metas = self._generate(body, rids)
            self._served(metas)
            for rid, i, meta in zip(rids, todo, metas, strict=True):
                want = rows[i][lens[i]:]
                triples = meta.get("input_token_logprobs")
                if not isinstance(triples, list) or len(triples) < len(want):
                    raise EngineRequestError(
                        f"request {rid}: input_token_logprobs has "
                        f"{len(triples) if isinstance(triples, list) else triples!r} entries, "
                        f"fewer than the {len(want)} completion tokens (logprob_start_len "
                        f"{lens[i] - 1})")
                tokens, lps = self._triples(triples[len(triples) - len(want):], rid,
                                            "input_token_logprobs")
                if tokens != want:
                    raise EngineRequestError(
                        f"request {rid}: input_token_logprobs name tokens {tokens[:8]} where the "
                        f"completion has {want[:8]}: the log-probs are not aligned to the "
                        "completion (logprob_start_len off by one?)")
                out[i] = lps
        return out

    # --- more than the protocol -----------------------------------------------------------

    def served_version(self) -> str | None:
        """The ``weight_version`` the server reports (``GET /get_model_info``), or None if
        this SGLang does not report one."""
        info = self._json("GET", "/get_model_info", None, timeout=self.timeouts.control_s,
                          idempotent=True)
        v = info.get("weight_version")
        return None if v is None else str(v)

    def close(self) -> None:
        """Close the HTTP client (when the engine made it)."""
        if self._own_client:
            self._client.close()

    def __enter__(self) -> SGLangSamplerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the steps of a load --------------------------------------------------------------

    def _health(self) -> None:
        r = self._request("GET", "/health", None, timeout=self.timeouts.control_s,
                          idempotent=True)
        if r.status_code != 200:
            raise EngineRequestError(f"GET /health at {self.base_url} answered "
                                     f"{r.status_code}: {_message(r)}")

    def _retry(self, deadline_s: float) -> RetryPolicy:
        t = self.timeouts
        return RetryPolicy(initial_s=t.backoff_initial_s, max_s=t.backoff_max_s,
                           deadline_s=deadline_s)

    def _flush_until_drained(self) -> None:
        attempts = 0

        def flush() -> httpx.Response:
            nonlocal attempts
            attempts += 1
            return self._request("POST", "/flush_cache", None, timeout=self.timeouts.control_s,
                                 idempotent=True)

        # 400: requests are still running or waiting; asked again until they drained
        r = self._retry(self.timeouts.flush_deadline_s).call(
            flush, transient=lambda e: False, again=lambda r: r.status_code == 400)
        if r.status_code == 400:
            raise EngineTimeoutError(
                f"the server at {self.base_url} still had running or waiting requests "
                f"after {self.timeouts.flush_deadline_s:.0f}s ({attempts} /flush_cache "
                "attempts); generation was paused and is being continued")
        if r.status_code != 200:
            raise EngineRequestError(f"POST /flush_cache answered {r.status_code}: "
                                     f"{_message(r)}")

    def _update(self, version_id: str, model_path: str) -> dict:
        body: dict[str, Any] = {"model_path": model_path, "weight_version": version_id,
                                "flush_cache": True, "abort_all_requests": False}
        if self.load_format is not None:
            body["load_format"] = self.load_format
        r = self._request("POST", "/update_weights_from_disk", body,
                          timeout=self.timeouts.update_s, idempotent=False)
        answer = self._decode(r, "/update_weights_from_disk", allow_400=True)
        if not isinstance(answer, dict) or "success" not in answer:
            raise EngineRequestError(f"/update_weights_from_disk answered {answer!r}")
        if not answer["success"]:
            raise WeightUpdateError(
                f"SGLang at {self.base_url} could not load version {version_id!r} from "
                f"{model_path}: {answer.get('message', '')} (it keeps serving "
                f"{self._version!r})")
        return answer

    def _continue(self, failure: BaseException | None) -> None:
        """``POST /continue_generation``; its own failure is raised unless it would hide
        ``failure``, the error of the load it ends (then it is logged)."""
        try:
            self._json("POST", "/continue_generation", {}, timeout=self.timeouts.control_s,
                       idempotent=True)
        except AlignError as e:
            log.error("POST /continue_generation at %s failed; the server may stay paused: %s",
                      self.base_url, e)
            if failure is None:
                raise

    # --- requests -------------------------------------------------------------------------

    def _require_loaded(self) -> None:
        if self._version is None:
            raise SpecError("the SGLang sampler has not loaded a version yet")

    @staticmethod
    def _tokens(seq: Sequence[int], what: str) -> list[int]:
        try:
            row = [int(t) for t in seq]
        except (TypeError, ValueError):
            raise InputError(f"{what} is not a list of token ids") from None
        if not row or min(row) < 0:
            raise InputError(f"{what} must be a non-empty list of non-negative token ids")
        return row

    @staticmethod
    def _rids(n: int) -> list[str]:
        base = uuid.uuid4().hex[:16]
        return [f"libalign-{base}-{i}" for i in range(n)]

    def _generate(self, body: dict, rids: list[str]) -> list[dict]:
        answer = self._json("POST", "/generate", body, timeout=self.timeouts.generate_s,
                            idempotent=False)
        if not isinstance(answer, list) or len(answer) != len(rids):
            raise EngineRequestError(f"/generate answered {type(answer).__name__} of "
                                     f"{len(answer) if isinstance(answer, list) else '?'} items "
                                     f"for a batch of {len(rids)}")
        by_id: dict[str, dict] = {}
        for item in answer:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise EngineRequestError(f"/generate answered an item without meta_info: {item!r:.200}")
            by_id[str(meta.get("id"))] = meta
        if set(by_id) != set(rids):
            raise EngineRequestError(f"/generate answered ids {sorted(by_id)[:4]}, asked "
                                     f"{rids[:4]}")
        return [by_id[r] for r in rids]

    def _served(self, metas: list[dict]) -> str | None:
        versions = {m.get("weight_version") for m in metas}
        if len(versions) > 1:
            raise WeightVersionMismatchError(
                f"one call was answered by weight versions {sorted(map(str, versions))}")
        served = versions.pop()
        if served is None:
            return self._version
        served = str(served)
        if self.strict_version and served != self._version:
            raise WeightVersionMismatchError(
                f"the server at {self.base_url} answered with weight_version {served!r}; this "
                f"sampler loaded {self._version!r}")
        return served

    @staticmethod
    def _triples(triples: Any, rid: str, field: str) -> tuple[list[int], list[float]]:
        if not isinstance(triples, list):
            raise EngineRequestError(f"request {rid}: meta_info.{field} is {triples!r:.100}")
        tokens, lps = [], []
        for j, t in enumerate(triples):
            if not isinstance(t, list | tuple) or len(t) < 2 or t[0] is None:
                raise EngineRequestError(f"request {rid}: {field}[{j}] is {t!r}, not "
                                         "[logprob, token_id, text]")
            lps.append(float(t[0]))
            tokens.append(int(t[1]))
        return tokens, lps

    @staticmethod
    def _finished(meta: dict, rid: str) -> bool:
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "stop":
            return True
        if kind == "length":
            return False
        if kind == "abort":
            msg = reason.get("message", "") if isinstance(reason, dict) else ""
            raise EngineRequestError(f"request {rid} was aborted by the server: {msg}")
        raise EngineRequestError(f"request {rid} came back unfinished (finish_reason {reason!r})")

    def _json(self, method: str, route: str, body: Any, *, timeout: float,
              idempotent: bool) -> Any:
        r = self._request(method, route, body, timeout=timeout, idempotent=idempotent)
        return self._decode(r, route)

    def _decode(self, r: httpx.Response, route: str, *, allow_400: bool = False) -> Any:
        if r.status_code != 200 and not (allow_400 and r.status_code == 400):
            raise EngineRequestError(f"{r.request.method} {route} at {self.base_url} answered "
                                     f"{r.status_code}: {_message(r)}")
        try:
            return r.json()
        except ValueError:
            if allow_400 and r.status_code == 400:
                raise EngineRequestError(f"{route} answered 400: {_message(r)}") from None
            raise EngineRequestError(f"{route} answered non-JSON: {r.text[:200]!r}") from None

    def _request(self, method: str, route: str, body: Any, *, timeout: float,
                 idempotent: bool) -> httpx.Response:
        """One call, retried (see the module doc, Failures) until the deadline."""
        t = self.timeouts

        def once() -> httpx.Response:
            return self._client.request(method, route, json=body,
                                        timeout=httpx.Timeout(timeout, connect=t.connect_s))

        try:
            r = self._retry(t.retry_deadline_s).call(
                once, transient=lambda e: http_transient(e, idempotent=idempotent),
                again=lambda r: r.status_code == 503)
        except httpx.TransportError as e:
            raise self._engine_error(method, route, timeout, e) from None
        if r.status_code == 503:
            raise EngineUnavailableError(f"{method} {route} at {self.base_url}: 503 (the server "
                                         f"is starting or loading) for {t.retry_deadline_s:g}s")
        return r

    def _engine_error(self, method: str, route: str, timeout: float,
                      e: httpx.TransportError) -> AlignError:
        """The typed error for a transport failure that was not (or no longer) retried."""
        where = f"{method} {route} at {self.base_url}"
        if isinstance(e, NEVER_SENT):
            return EngineUnavailableError(f"{where}: cannot connect ({e})")
        if isinstance(e, httpx.TimeoutException):
            return EngineTimeoutError(f"{where}: no answer within {timeout:g}s ({type(e).__name__})")
        return EngineUnavailableError(f"{where}: connection failed ({type(e).__name__}: {e})")
