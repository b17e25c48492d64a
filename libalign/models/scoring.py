"""Both sides of the execution gap on one model: teacher-forced scores and sampled log-probs.

Learner and sampler
-------------------
In RL the sampler generates each token with a KV cache, one step at a time, and reports the
log-probability it assigned to the token it drew; the learner later runs the finished
sequence through one teacher-forced forward pass and computes the log-probability of every
completion token from its prefix. With the parameter version and token ids held fixed the
two should agree; per token, ``δ = log p_learner − log p_sampler`` measures how much they
don't. Here both sides run on the same Hugging Face model, each under an execution path
(:mod:`libalign.models.paths`):

* :func:`score_sequences` is the learner: right-padded batches with an attention mask, one
  forward pass, ``log_softmax`` in fp32 of the logits at positions ``prompt_len-1 .. len-2``
  gathered at the next tokens.
* :func:`generate` is the sampler: prompts left-padded (attention mask, positions counted
  from each prompt's first real token), a prefill pass, then one token per step through the
  KV cache. The reported log-prob is ``log_softmax`` in fp32 of the raw step logits (before
  temperature), as inference engines report by default; the token is drawn from
  ``softmax(logits / temperature)`` with a seeded ``torch.Generator`` (temperature 0:
  argmax).

Even on the same path the two differ slightly: a cached decode step multiplies different
shapes than a full-sequence pass (another reduction order in attention and in every GEMM), and
padding sits on different sides. That residual is the cross-stack floor the NVFP4 paths are
measured against.

Replay
------
:func:`replay_layer` runs one decoder layer on given input hidden states under a path,
optionally with fixed expert assignments: ``F_X(h_Y)``, path X applied to an input captured on
path Y, the cell of the 2×2 replay that separates "different input" from "different
arithmetic". :func:`replay_moe` does the same for the MoE block alone (input captured at the
MoE entry, ``moe_in``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from libalign.errors import InputError, ShapeError, SpecError
from libalign.gemm.finite_checks import deferred_finite_checks
from libalign.guidance import MAX_SEQUENCE, row_keys
from libalign.models.capture import RoutingSpec, force_routing
from libalign.models.kv_cache import cache_kwarg, full_sequence_kwargs, new_cache
from libalign.models.paths import (
    PathAssignment,
    decoder_layers,
    experts_module,
    moe_layer_indices,
    set_row_keys,
    use_path,
)
from libalign.models.strict import log_softmax_for

try:
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
except ImportError:  # pragma: no cover - transformers < 4.53
    DynamicCache = None
    create_causal_mask = None


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _path_ctx(model: nn.Module, path: PathAssignment, backend: str):
    return nullcontext() if path is None else use_path(model, path, backend=backend)


def _seq_ids(seq_ids: Sequence[int] | None, n: int) -> list[int]:
    if seq_ids is None:
        return list(range(n))
    ids = [int(i) for i in seq_ids]
    if len(ids) != n:
        raise InputError(f"{len(ids)} sequence ids for {n} sequences")
    if any(not 0 <= i <= MAX_SEQUENCE for i in ids):
        raise InputError(f"sequence ids must lie in [0, {MAX_SEQUENCE}]")
    return ids


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")


# --- learner side -----------------------------------------------------------------------------

def right_padded_batch(seqs: Sequence[Sequence[int]], seq_ids: Sequence[int], pad_id: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, row_keys)`` ``[B, L]`` of right-padded sequences; padding has key -1.

    The keys name every token by sequence id and position (:func:`~libalign.guidance.row_keys`),
    what guidance capture and lookup need (:func:`~libalign.models.paths.set_row_keys`).
    """
    lens = [len(s) for s in seqs]
    ids = torch.full((len(seqs), max(lens)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, :len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
    sid = torch.tensor(list(seq_ids), device=device).unsqueeze(-1)
    return ids, mask, torch.where(mask.bool(), row_keys(sid, pos), -1)


def completion_logprobs(logits: torch.Tensor, ids: torch.Tensor, lens: Sequence[int],
                        prompt_lens: Sequence[int],
                        log_softmax: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> list[torch.Tensor]:
    """fp32 ``log_softmax`` of each row's logits at positions ``p-1 .. n-2``, gathered at the
    next tokens: the log-prob of every completion token of a right-padded batch.

    ``log_softmax`` (default ``torch.log_softmax`` over the last dimension) is the model's
    (:func:`~libalign.models.strict.log_softmax_for`: strict in strict mode)."""
    log_softmax = log_softmax or (lambda x: torch.log_softmax(x, dim=-1))
    out = []
    for r, (n, p) in enumerate(zip(lens, prompt_lens, strict=True)):
        lp = log_softmax(logits[r, p - 1:n - 1].float())
        out.append(lp.gather(-1, ids[r, p:n].unsqueeze(-1)).squeeze(-1))
    return out


def score_sequences(model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                    path: PathAssignment, *, batch_size: int = 8, backend: str = "auto",
                    pad_id: int = 0, seq_ids: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Teacher-forced fp32 log-prob of every completion token (positions ``prompt_len..len-1``).

    One CPU float32 tensor per sequence, of length ``len - prompt_len``. ``path=None`` leaves the
    model's current forwards as they are. ``seq_ids`` (default ``0..n-1``) name the sequences
    for guidance lookup (:func:`~libalign.models.paths.set_row_keys`).
    """
    _check_batch_size(batch_size)
    if len(sequences) != len(prompt_lens):
        raise InputError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    ids_of = _seq_ids(seq_ids, len(sequences))
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        if not 1 <= p <= len(seq):
            raise InputError(f"sequence {i}: prompt_len {p} must be in [1, {len(seq)}]")
    dev = _device(model)
    out: list[torch.Tensor] = []
    with torch.no_grad(), _path_ctx(model, path, backend):
        for start in range(0, len(sequences), batch_size):
            chunk = [list(map(int, s)) for s in sequences[start:start + batch_size]]
            ids, mask, keys = right_padded_batch(chunk, ids_of[start:start + len(chunk)], pad_id,
                                                 dev)
            set_row_keys(model, keys)
            try:  # one read of the expert GEMMs' NaN/Inf checks a batch, not one a GEMM
                with deferred_finite_checks():
                    logits = model(input_ids=ids, attention_mask=mask,
                                   **full_sequence_kwargs(model)).logits
            finally:
                set_row_keys(model, None)
            out += [t.cpu() for t in completion_logprobs(
                logits, ids, [len(s) for s in chunk], prompt_lens[start:start + len(chunk)],
                log_softmax_for(model))]
    return out


# --- sampler side -----------------------------------------------------------------------------

@dataclass
class GenerationResult:
    """What :func:`generate` returns: sequences (prompt + completion) and the sampler's log-probs.

    ``logprobs[i]`` holds one float32 value per completion token of ``sequences[i]``;
    ``finished[i]`` says whether that completion ended with the eos token.
    """

    sequences: list[list[int]]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)

    @property
    def completions(self) -> list[list[int]]:
        """The generated tokens of each sequence."""
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lens, strict=True)]


def _eos_set(model: nn.Module, eos_id) -> set[int]:
    if eos_id is None:
        eos_id = getattr(model.config, "eos_token_id", None)
    if eos_id is None:
        return set()
    return {int(e) for e in eos_id} if isinstance(eos_id, list | tuple | set) else {int(eos_id)}


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], path: PathAssignment, *,
             max_new_tokens: int, temperature: float = 1.0, seed: int = 0, batch_size: int = 8,
             eos_id: int | Sequence[int] | None = None, backend: str = "auto",
             pad_id: int | None = None, seq_ids: Sequence[int] | None = None) -> GenerationResult:
    """Sample completions token by token with a KV cache and report each token's log-prob.

    Prompts run in batches of ``batch_size`` (left-padded); a sequence stops at an eos token
    (``eos_id``, default the model config's) or after ``max_new_tokens``. The eos token is part
    of the completion. ``path=None`` leaves the model's current forwards as they are. Results
    depend on the seed and on the batching (which rows share a batch). ``seq_ids`` (default
    ``0..n-1``) name the rollouts in guidance records captured while generating.
    """
    _check_batch_size(batch_size)
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    if any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token")
    eos = _eos_set(model, eos_id)
    ids_of = _seq_ids(seq_ids, len(prompts))
    if pad_id is None:
        pad_id = getattr(model.config, "pad_token_id", None)
        pad_id = 0 if pad_id is None else int(pad_id)
    dev = _device(model)
    gen = torch.Generator(device=dev).manual_seed(seed)
    result = GenerationResult([], [], [], [])
    with torch.no_grad(), _path_ctx(model, path, backend):
        for start in range(0, len(prompts), batch_size):
            chunk = [list(map(int, p)) for p in prompts[start:start + batch_size]]
            seqs, lps, done = _generate_batch(model, chunk, max_new_tokens, temperature, gen, eos,
                                              pad_id, ids_of[start:start + len(chunk)])
            result.sequences.extend(seqs)
            result.prompt_lens.extend(len(p) for p in chunk)
            result.logprobs.extend(lps)
            result.finished.extend(done)
    return result


class KVDecode:
    """The sampler's decode of one batch: left-padded prompts prefilled once, then one token per
    :meth:`step` with the KV cache, positions counted from each prompt's first real token.

    ``logits`` (``[B, vocab]``) holds the logits that predict the next token of every row.
    :func:`generate` samples from it; a teacher-forced replay of given tokens feeds those
    instead, through the same calls, so both report the same log-probs for the same tokens.
    """

    def __init__(self, model: nn.Module, prompts: list[list[int]], pad_id: int,
                 seq_ids: Sequence[int] | None = None):
        if DynamicCache is None:  # pragma: no cover
            raise SpecError("decoding needs transformers with transformers.cache_utils.DynamicCache")
        self.seq_ids = _seq_ids(seq_ids, len(prompts))
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        self.model = model
        self.device = _device(model)
        self.cache_kw = cache_kwarg(model.forward)
        self.cache = new_cache(model)  # FP4 when the model has a KV format (kv_cache)
        ids, self.mask = ids.to(self.device), mask.to(self.device)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self._sid = torch.tensor(self.seq_ids, device=self.device).unsqueeze(-1)
        self.logits = self._forward(ids, positions, self.mask.bool())
        self.next_pos = positions[:, -1:] + 1

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 real: torch.Tensor) -> torch.Tensor:
        set_row_keys(self.model, torch.where(real, row_keys(self._sid, positions), -1))
        try:  # the expert GEMMs' NaN/Inf checks read once a forward, before anything samples
            with deferred_finite_checks():
                return self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                                  use_cache=True, **{self.cache_kw: self.cache}).logits[:, -1]
        finally:
            set_row_keys(self.model, None)

    def step(self, tokens: list[int], active: Sequence[bool] | None = None) -> None:
        """Feed one token per row (a finished row is fed the pad token by its caller and, when
        ``active`` says so, is not attributed to its sequence in guidance records)."""
        feed = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(-1)
        self.mask = torch.cat([self.mask, torch.ones_like(feed)], dim=-1)
        real = torch.ones_like(feed, dtype=torch.bool) if active is None else \
            torch.tensor(list(active), dtype=torch.bool, device=self.device).unsqueeze(-1)
        self.logits = self._forward(feed, self.next_pos, real)
        self.next_pos = self.next_pos + 1


def _generate_batch(model, chunk, max_new_tokens, temperature, gen, eos, pad_id, seq_ids):
    b = len(chunk)
    dec = KVDecode(model, chunk, pad_id, seq_ids)
    done = [False] * b
    new_tokens: list[list[int]] = [[] for _ in range(b)]
    new_lps: list[list[float]] = [[] for _ in range(b)]
    log_softmax = log_softmax_for(model)
    for step in range(max_new_tokens):
        lf = dec.logits.float()
        logp = log_softmax(lf)
        if temperature == 0:
            tok = lf.argmax(dim=-1)
        else:
            probs = torch.softmax(lf / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        tok_lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        tok_l, lp_l = tok.tolist(), tok_lp.tolist()
        for r in range(b):
            if not done[r]:
                new_tokens[r].append(tok_l[r])
                new_lps[r].append(lp_l[r])
                done[r] = tok_l[r] in eos
        if all(done) or step == max_new_tokens - 1:
            break
        dec.step([pad_id if d else t for d, t in zip(done, tok_l, strict=True)],
                 active=[not d for d in done])
    seqs = [p + t for p, t in zip(chunk, new_tokens, strict=True)]
    lps = [torch.tensor(v, dtype=torch.float32) for v in new_lps]
    return seqs, lps, done


# --- replay -----------------------------------------------------------------------------------

def _causal_mask(config, hidden: torch.Tensor, attention_mask, position_ids):
    if create_causal_mask is None:  # pragma: no cover
        raise SpecError("replay needs transformers with transformers.masking_utils.create_causal_mask")
    params = inspect.signature(create_causal_mask).parameters
    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                  position_ids=position_ids)
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return create_causal_mask(**kwargs)


def _replay_ctx(model, layer, path, routing, backend) -> ExitStack:
    stack = ExitStack()
    if path is not None and layer in moe_layer_indices(model):
        stack.enter_context(use_path(model, path, backend=backend, layers=[layer]))
    if routing is not None:
        stack.enter_context(force_routing(model, {layer: routing}))
    return stack


def replay_layer(model: nn.Module, layer: int, hidden_in: torch.Tensor, path: PathAssignment, *,
                 attention_mask: torch.Tensor | None = None, routing: RoutingSpec | None = None,
                 backend: str = "auto", position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Decoder layer ``layer`` applied to ``hidden_in`` ``[B, T, H]`` under ``path``.

    The attention sees a causal mask built as the model builds it (with ``attention_mask``
    ``[B, T]`` for padding) and rotary embeddings of ``position_ids`` (default ``0..T-1``, what
    the model uses when given none, e.g. in :func:`score_sequences`). ``routing`` fixes the
    layer's expert assignment (see :func:`~libalign.models.capture.force_routing`). Replaying a
    captured ``hidden_in`` on the path it was captured on reproduces ``hidden_out`` exactly.
    """
    layers = decoder_layers(model)
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise SpecError(f"layer {layer!r} does not exist; the model has {len(layers)} layers")
    if hidden_in.ndim != 3:
        raise ShapeError(f"hidden_in must be [B, T, H], got {tuple(hidden_in.shape)}")
    base = getattr(model, "model", model)
    t = hidden_in.shape[1]
    if position_ids is None:
        position_ids = torch.arange(t, device=hidden_in.device).unsqueeze(0)
    if attention_mask is not None:
        attention_mask = attention_mask.to(hidden_in.device)
    with torch.no_grad(), _replay_ctx(model, layer, path, routing, backend):
        mask = _causal_mask(base.config, hidden_in, attention_mask, position_ids)
        rope = base.rotary_emb(hidden_in, position_ids=position_ids)
        out = layers[layer](hidden_in, attention_mask=mask, position_ids=position_ids,
                            use_cache=False, position_embeddings=rope)
    return out[0] if isinstance(out, tuple) else out


def replay_moe(model: nn.Module, layer: int, moe_in: torch.Tensor, path: PathAssignment, *,
               routing: RoutingSpec | None = None, backend: str = "auto") -> torch.Tensor:
    """The MoE block of ``layer`` (router and experts) on ``moe_in`` ``[tokens, H]`` under ``path``.

    ``moe_in`` is what :func:`~libalign.models.capture.capture` records at the MoE entry;
    returns ``[tokens, H]``.
    """
    experts_module(model, layer)
    if moe_in.ndim != 2:
        raise ShapeError(f"moe_in must be [tokens, H], got {tuple(moe_in.shape)}")
    block = decoder_layers(model)[layer].mlp
    with torch.no_grad(), _replay_ctx(model, layer, path, routing, backend):
        out = block(moe_in.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(moe_in.shape)
