"""The sampler engine over a running SGLang server: the :class:`SamplerEngine` protocol on HTTP.

At scale the sampler is not a model in this process but SGLang servers (one per node or per
tensor-parallel group) that this adapter drives through SGLang's native HTTP API: one, a list
of them, or the workers behind an ``sglang-router``. The adapter keeps the protocol of
:mod:`alignd.sampler.engine`, so :class:`SamplerService` runs it unchanged: it loads versions,
generates with log-probs, scores given tokens. One server's calls, retries and switch are
:mod:`alignd.sampler.sglang_server`.

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

    ``python/sglang/srt/environ.py`` @ ``0003215cf1464f44b389cd0b18d0b4c56f2a3da6``:
    ``SGLANG_RETURN_ORIGINAL_LOGPROB`` and ``SGLANG_EXPOSE_OWN_ENV_VARS`` (``EnvBool``, both
    False by default), ``exportable_env_vars()``; the scheduler adds them to its internal state
    as ``env_vars`` when exposure is on, and ``GET /get_server_info`` answers
    ``{**server_args, **scheduler_info, "internal_states": [...], "version"}``. The router's
    ``GET /list_workers`` / ``GET /workers`` / ``POST /add_worker?url=`` /
    ``POST /remove_worker?url=`` (``sgl-router/src/server.rs``); ``utils/auth.py``
    (``--api-key``, ``--admin-api-key``). Floor: ``sglang>=0.5.6`` (pyproject's extra).

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
    1. the export: the version as a ModelOpt NVFP4 checkpoint on a path the servers see,
       written once by whoever converted the version (:mod:`alignd.formats.modelopt_export`;
       the converter with ``ALIGN_SAMPLER_LAYOUT=modelopt``). ``exporter(version_id, path)``
       returns its directory; refusals (a version the path's method does not load, MXFP4, one
       missing from the store, one whose manifest names another KV format than the path's:
       :class:`~alignclient.errors.SpecError` with ``field="kv.format"``) raise before any
       server is touched, outside the switch lock;
    2. each server is checked (``GET /get_server_info``): a quantization other than the path's
       (``nvfp4_naive``: ``modelopt_fp4``; ``nvfp4_minite``: ``libalign_minite``), an embedding
       model, or a model path neither the model directory nor under the export root is
       :class:`~alignclient.errors.EngineMismatchError` naming the mismatch (``field``); what
       it says of ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is kept (see "Log-probs and temperature");
    3. the switch lock is taken for writing: this engine's calls in flight finish, new ones
       wait (a completion never mixes two versions, and none of ours is aborted); then on
       every server at once (a thread per server): ``GET /health`` (retried while 503);
       ``POST /pause_generation`` ``{"mode": "abort"}`` (the default ``pause_mode``: other
       clients' requests in flight end aborted; ``retract`` would re-run them on the new
       weights, ``in_place`` keep their old KV cache); ``POST /flush_cache`` until 200 (SGLang
       answers 400 while requests run or wait, deadline ``flush_deadline_s``; only the status
       tells, the body reads "Cache flushed." either way); ``POST /update_weights_from_disk``
       ``{"model_path", "load_format", "weight_version", "flush_cache": true,
       "abort_all_requests": false}`` (``success: false``: WeightUpdateError, rolled back);
       ``GET /get_model_info`` must report ``weight_version == version_id`` and the export's
       ``model_path``; ``POST /continue_generation``, always; ``GET /health``.

Several servers, and what a failure on one does
    ``base_url`` may be a list: generation and scoring calls go to the server with the fewest
    of this engine's calls in flight (ties: the one used least), weight switches to every
    server. A load succeeds when at least one server serves the new version; a server that
    failed its check or its switch (the error in the load's ``failed``) leaves rotation: calls
    go only to servers whose verified version is the engine's. A server that refused the update
    (``success: false``) still serves the old version; one that timed out or could not be
    reached is unknown until a later load verifies it. Every load switches every server again,
    also those out of rotation, so a server that recovered rejoins at the next version. When
    every server fails, the load raises (the error of the first one, the message naming all)
    and the engine keeps its old version on the servers that still serve it.

    ``router`` names an ``sglang-router`` instead: calls go to the router (it spreads them);
    its workers (``GET /list_workers`` ``{"urls"}``, or ``GET /workers`` ``{"workers": [{"url"}]}``
    of newer routers) get the switch directly. A worker that failed is removed from the router
    (``POST /remove_worker?url=``) so no call reaches it, and added back (``POST
    /add_worker?url=``) once a later load switched it; the rules above hold otherwise.

Log-probs and temperature
    SGLang reports the log-probs of sampled tokens *after* temperature scaling (``log_softmax(z
    / T)``) unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
    (``layers/sampler.py``: then ``log_softmax(z)`` of the raw logits), while a learner scores
    untempered log-probs: at ``T`` other than 1 the gap would be biased. A server started with
    ``SGLANG_EXPOSE_OWN_ENV_VARS=1`` reports its variables in ``/get_server_info``
    (``internal_states[i].env_vars``), read at each load. A call at T other than 0 or 1 raises
    :class:`~alignclient.errors.TemperedLogprobsError` before anything is sent when a server it
    could reach returns tempered log-probs, or does not say (``original_logprobs=None``, the
    default). ``original_logprobs=True`` is the operator's word that every server runs with the
    variable (older SGLang that cannot expose it); ``False`` refuses every such call. Scoring
    asks for no temperature, so it is always untempered.

Concurrency
    No lock serialises calls: threads generate and score at once. A reader-writer lock is held
    for reading by each call and for writing by a switch (a waiting switch holds back new
    calls), so a call runs on one version. Two loads are serialised by a lock of their own.

The served version
    Every answer's ``meta_info.weight_version`` is checked: all rows of a call must report the
    same one, and it must be the version this engine loaded (with ``strict_version``), else
    :class:`~alignclient.errors.WeightVersionMismatchError`; it is what
    :attr:`Generation.version_id` says. A server whose answers carry no ``weight_version``
    (older SGLang) is stamped with the engine's own record.

Routing records (R3)
    Built with a routing geometry (``routing``: :class:`~alignd.sampler.sglang_routing.SGLangRouting`,
    read from the model's ``config.json`` by :func:`~alignd.sampler.sglang_sampler.build_sglang_sampler`),
    the engine records routing: ``generate(..., routing=True)`` adds ``return_routed_experts:
    true`` to the request (servers started with ``--enable-return-routed-experts``) and fills
    :attr:`Generation.routing` with one record per row, the MoE layers of SGLang's
    ``[len(tokens) - 1, num_hidden_layers, top_k]`` answer, stamped with the served version
    (:mod:`alignd.sampler.sglang_routing` says what was matched and what each fault raises).

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from alignclient.errors import (
    AlignError,
    EngineRequestError,
    EngineUnavailableError,
    GuidanceUnsupportedError,
    InputError,
    SpecError,
    TemperedLogprobsError,
    WeightVersionMismatchError,
)

from alignd.sampler.engine import Generation
from alignd.sampler.sglang_routing import REQUEST_FIELD, SGLangRouting, routing_record
from alignd.sampler.sglang_server import SGLangServer, SGLangTimeouts, SwitchLock
from libalign import gemm

__all__ = ["PAUSE_MODES", "SGLangSamplerEngine", "SGLangTimeouts", "SwitchLock", "row_seed"]

log = logging.getLogger("alignd.sampler.sglang")

PAUSE_MODES = ("abort", "retract", "in_place")
SEED_MODULUS = 2**31 - 1
#: Temperatures at which SGLang's log-probs are untempered whatever its settings (0: greedy).
UNTEMPERED = (0.0, 1.0)


def row_seed(seed: int, row: int) -> int:
    """The ``sampling_seed`` of row ``row`` of a call with ``seed``: distinct per row (rows
    repeat prompts), stable across calls, and in the range every SGLang version accepts."""
    digest = hashlib.sha256(f"{seed}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_MODULUS


class SGLangSamplerEngine:
    """A :class:`~alignd.sampler.engine.SamplerEngine` driving SGLang servers over HTTP."""

    def __init__(self, base_url: str | Sequence[str] | None, exporter: Callable[[str, str], Path | str],
                 *, path: str = "nvfp4_naive", eos_id: int | None = None,
                 load_format: str | None = None, pause_mode: str = "abort",
                 timeouts: SGLangTimeouts | None = None, strict_version: bool = True,
                 client: httpx.Client | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None, router: str | None = None,
                 original_logprobs: bool | None = None, model_paths: Sequence[str | Path] = (),
                 deterministic: bool = False, routing: SGLangRouting | None = None):
        if pause_mode not in PAUSE_MODES:
            raise InputError(f"pause_mode {pause_mode!r} is not one of {PAUSE_MODES}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url or [])
        if bool(urls) == bool(router):
            raise InputError("give the SGLang servers' URLs or an sglang-router's URL, not both "
                             f"(base_url={base_url!r}, router={router!r})")
        self.path = gemm.get_path(path).name
        """The execution path this sampler stands for (versions converted for it are loaded);
        numerics: SGLang's kernels for nvfp4_naive, libalign's (libalign_minite) for nvfp4_minite."""
        self.exporter = exporter
        self.eos_id = eos_id
        self.load_format = load_format
        self.pause_mode = pause_mode
        self.strict_version, self.deterministic = strict_version, deterministic  # strict mode
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.original_logprobs = original_logprobs
        """True: the operator says every server returns untempered log-probs; None: ask them."""
        self.model_paths = tuple(str(p).rstrip("/") for p in model_paths)
        self.routing = routing
        """The model's routing geometry (None: this engine records no routing)."""
        self._timeouts = timeouts or SGLangTimeouts()
        self.router = (SGLangServer(router, timeouts=self._timeouts, api_key=api_key,
                                    admin_api_key=admin_api_key, client=client) if router else None)
        self.servers = [SGLangServer(u, timeouts=self._timeouts, api_key=api_key,
                                     admin_api_key=admin_api_key,
                                     client=client if len(urls) == 1 else None) for u in urls]
        """The servers that get weight switches (a router's workers once it was asked)."""
        self.base_url = self.router.url if self.router else self.servers[0].url
        self.switch = SwitchLock()
        """Calls read it, a weight switch writes it (no call straddles two versions)."""
        self._loading = threading.Lock()
        self._pick_lock = threading.Lock()
        self._removed: set[str] = set()  # router workers taken out of the router by us
        self._version: str | None = None
        self.model_path: str | None = None
        """The export the servers loaded last (through this engine)."""

    @property
    def records_routing(self) -> bool:
        """Whether ``generate(..., routing=True)`` works (a routing geometry was given)."""
        return self.routing is not None

    @property
    def timeouts(self) -> SGLangTimeouts:
        """Seconds every server's calls wait (set it to change them on every server)."""
        return self._timeouts

    @timeouts.setter
    def timeouts(self, value: SGLangTimeouts) -> None:
        self._timeouts = value
        for s in self._everyone():
            s.timeouts = value

    def _everyone(self) -> list[SGLangServer]:
        return ([self.router] if self.router else []) + self.servers

    # --- the protocol ---------------------------------------------------------------------

    @property
    def version_id(self) -> str | None:
        """The version being served (None before the first load)."""
        return self._version

    def load(self, version_id: str) -> dict:
        """Export ``version_id`` and make the servers serve it (the module doc's flow)."""
        with self._loading:
            seconds: dict[str, float] = {}
            t0 = time.perf_counter()
            model_path = str(self.exporter(version_id, self.path))
            seconds["export"] = time.perf_counter() - t0
            if self.router is not None:
                self._refresh_workers()
            outcomes = self._each(lambda s: s.check(self.model_paths, self.deterministic,
                                                    self.path), self.servers)
            fit = [s for s in self.servers if outcomes[s.url][1] is None]
            for s in set(self.servers) - set(fit):
                s.version = None  # not the server this sampler needs: out of rotation
            if fit:
                with self.switch.writing():
                    outcomes.update(self._each(lambda s: s.switch(
                        version_id, model_path, pause_mode=self.pause_mode,
                        load_format=self.load_format, seconds=s.seconds), fit))
            ok = [u for u, (_, e) in outcomes.items() if e is None]
            failed = {u: e for u, (_, e) in outcomes.items() if e is not None}
            if not ok:
                first = next(iter(failed.values()))
                if len(failed) == 1:
                    raise first
                raise _with_message(first, f"no server could switch to {version_id!r}: " + "; ".join(
                    f"{u}: {type(e).__name__}: {e}" for u, e in failed.items()))
            for u, e in failed.items():
                log.error("SGLang at %s did not switch to %s and is out of rotation: %s",
                          u, version_id, e)
            self._version = version_id
            self.model_path = model_path
            if self.router is not None:
                self._steer_router(ok, list(failed))
            for stage in ("drain", "update"):
                seconds[stage] = max(s.seconds.get(stage, 0.0) for s in fit if s.url in ok)
            seconds["total"] = time.perf_counter() - t0
        log.info("SGLang (%d of %d servers) serves %s (%s)", len(ok), len(outcomes),
                 version_id, model_path)
        return {"version_id": version_id, "model_path": model_path, "seconds": seconds,
                "num_paused_requests": sum(outcomes[u][0].get("num_paused_requests", 0) for u in ok),
                "servers": ok, "failed": {u: f"{type(e).__name__}: {e}" for u, e in failed.items()}}

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, seed: int = 0,
                 guidance_bits: int | None = None, routing: bool = False) -> Generation:
        """Sample completions on a server; log-probs are the ones SGLang drew them with (and,
        with ``routing``, each row's routing record)."""
        if guidance_bits is not None:
            raise GuidanceUnsupportedError(
                "the SGLang sampler cannot capture guidance records: SGLang rounds activations "
                "inside fused kernels with no hook to record the FP4 codes; use the embedded "
                "torch sampler for TRACE, or roll out without guidance_bits")
        rows = [self._tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if routing and self.routing is None:
            raise SpecError("this SGLang sampler has no routing geometry (give routing=, or "
                            "build it with build_sglang_sampler from an MoE model directory)")
        with self.switch.reading():
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
            if routing:
                body[REQUEST_FIELD] = True
            with self._server(temperature=float(temperature)) as server:
                metas = self._generate(server, body, rids)
            served = self._served(server, metas)
            sequences, logprobs, finished = [], [], []
            for rid, prompt, meta in zip(rids, rows, metas, strict=True):
                tokens, lps = self._triples(meta.get("output_token_logprobs"), rid,
                                            "output_token_logprobs")
                sequences.append(prompt + tokens)
                logprobs.append(lps)
                finished.append(self._finished(meta, rid))
            records = {i: routing_record(meta, rid, seq, self.routing, served)
                       for i, (rid, seq, meta) in enumerate(zip(rids, sequences, metas,
                                                                strict=True))} \
                if routing and self.routing is not None else {}
            return Generation(served, sequences, [len(p) for p in rows], logprobs, finished,
                              routing=records)

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Teacher-forced log-probs of each completion, as a server computes them."""
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
        with self.switch.reading():
            self._require_loaded()
            if not todo:
                return out
            rids = self._rids(len(todo))
            body = {"rid": rids, "input_ids": [rows[i] for i in todo],
                    "sampling_params": [{"max_new_tokens": 0} for _ in todo],
                    "return_logprob": True,
                    "logprob_start_len": [lens[i] - 1 for i in todo]}
            with self._server() as server:
                metas = self._generate(server, body, rids)
            self._served(server, metas)
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
        """The ``weight_version`` the (first) server reports, or None if it reports none."""
        return (self.router or self.servers[0]).served_version()

    def close(self) -> None:
        """Close the HTTP clients the engine made."""
        for s in self._everyone():
            s.close()

    def __enter__(self) -> SGLangSamplerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- switching ------------------------------------------------------------------------

    def _each(self, fn: Callable[[SGLangServer], Any], servers: list[SGLangServer]
              ) -> dict[str, tuple[Any, AlignError | None]]:
        """``fn`` on every server at once (a thread each); url -> (its result, its error)."""
        def one(s: SGLangServer) -> tuple[Any, AlignError | None]:
            try:
                return fn(s), None
            except AlignError as e:
                return None, e

        if len(servers) == 1:
            return {servers[0].url: one(servers[0])}
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            return dict(zip([s.url for s in servers], pool.map(one, servers), strict=True))

    def _refresh_workers(self) -> None:
        """The router's workers (and those we took out of it) become :attr:`servers`."""
        assert self.router is not None
        urls = self._worker_urls() + sorted(self._removed)
        known = {s.url: s for s in self.servers}
        self.servers = [known.get(u.rstrip("/")) or SGLangServer(
            u, timeouts=self._timeouts, api_key=self.api_key, admin_api_key=self.admin_api_key)
            for u in dict.fromkeys(urls)]
        if not self.servers:
            raise EngineUnavailableError(f"the sglang-router at {self.router.url} lists no workers")

    def _worker_urls(self) -> list[str]:
        assert self.router is not None
        r = self.router.request("GET", "/list_workers", timeout=self._timeouts.control_s,
                                idempotent=True)
        if r.status_code == 200:
            return [str(u) for u in self.router.decode(r, "/list_workers").get("urls", [])]
        body = self.router.json("GET", "/workers")
        return [str(w["url"]) for w in body.get("workers", [])]

    def _steer_router(self, ok: list[str], failed: list[str]) -> None:
        """Out of the router: workers that did not switch; back in: those that now did."""
        assert self.router is not None
        for url, route, keep in [*((u, "/remove_worker", True) for u in failed),
                                 *((u, "/add_worker", False) for u in ok)]:
            if keep == (url in self._removed):
                continue
            try:
                self.router.json("POST", route, params={"url": url}, admin=True)
            except AlignError as e:
                log.error("sglang-router at %s: %s %s failed: %s", self.router.url, route, url, e)
                continue
            (self._removed.add if keep else self._removed.discard)(url)

    # --- requests -------------------------------------------------------------------------

    @contextmanager
    def _server(self, *, temperature: float = 1.0) -> Iterator[SGLangServer]:
        """The server a call goes to (the router, or the least busy one in rotation)."""
        if self.router is not None:
            self._check_logprobs([s for s in self.servers if s.version == self._version],
                                 temperature)
            yield self.router
            return
        with self._pick_lock:
            live = [s for s in self.servers if s.version == self._version]
            if not live:
                raise EngineUnavailableError(f"no SGLang server serves {self._version!r}: "
                                             + ", ".join(f"{s.url} ({s.version!r})"
                                                         for s in self.servers))
            s = min(live, key=lambda s: (s.in_flight, s.calls))
            self._check_logprobs([s], temperature)
            s.in_flight += 1
            s.calls += 1
        try:
            yield s
        finally:
            with self._pick_lock:
                s.in_flight -= 1

    def _check_logprobs(self, servers: list[SGLangServer], temperature: float) -> None:
        """Refuse a call at T not in {0, 1} that would get tempered (or unknown) log-probs."""
        if temperature in UNTEMPERED or self.original_logprobs is True:
            return
        for s in servers:
            said = False if self.original_logprobs is False else s.original_logprobs()
            if said is True:
                continue
            why = ("returns log-probs after temperature scaling (SGLANG_RETURN_ORIGINAL_LOGPROB "
                   "is not set)" if said is False else "does not report whether its log-probs "
                   "are tempered (start it with SGLANG_EXPOSE_OWN_ENV_VARS=1)")
            raise TemperedLogprobsError(
                f"the SGLang server at {s.url} {why}: at temperature {temperature:g} its "
                "log-probs would be log_softmax(logits / T) and the gap to the learner biased; "
                "start it with SGLANG_RETURN_ORIGINAL_LOGPROB=1, or set original_logprobs=True "
                "(ALIGN_SGLANG_ORIGINAL_LOGPROBS) if every server already runs with it")

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

    def _generate(self, server: SGLangServer, body: dict, rids: list[str]) -> list[dict]:
        answer = server.json("POST", "/generate", body, timeout=self._timeouts.generate_s,
                             idempotent=False)
        if not isinstance(answer, list) or len(answer) != len(rids):
            raise EngineRequestError(f"/generate at {server.url} answered "
                                     f"{type(answer).__name__} of "
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

    def _served(self, server: SGLangServer, metas: list[dict]) -> str | None:
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
                f"the server at {server.url} answered with weight_version {served!r}; this "
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
        """One call to the first server (or the router), its JSON answer."""
        return (self.router or self.servers[0]).json(method, route, body, timeout=timeout,
                                                    idempotent=idempotent)


def _with_message(e: AlignError, msg: str) -> AlignError:
    """``e``'s class with another message (its code kept)."""
    out = type(e).__new__(type(e))
    Exception.__init__(out, msg)
    out.__dict__.update(e.__dict__)  # field, version_id ... kept
    return out
