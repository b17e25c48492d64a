"""What ``alignd diagnose`` reads: prompt files and pre-generated sequence files, validated.

Two JSON Lines formats are accepted (one JSON object a line; blank lines are skipped):

* **prompts** (``--prompts``): ``{"prompt": "text"}`` (encoded with the checkpoint's tokenizer
  or the built-in task's encoder) or ``{"tokens": [ids...]}``.
* **sequences** (``--sequences``): ``{"tokens": [ids...], "prompt_len": n}`` with an optional
  ``"sampler_logprobs": [...]``, one float per completion token (``len(tokens) - prompt_len``
  of them), the log-probabilities an external sampler reported while generating.

Every problem is an :class:`~alignclient.errors.InputError` that names the file, the line and the
item (``prompt 3``, ``sequence 7``) and says what is wrong, so a bad record is found without a
debugger: an empty prompt, a sequence without completion tokens, a token id outside the
vocabulary, a log-prob list whose length differs from the completion, a NaN/Inf or positive
log-probability.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from alignclient.errors import InputError, NonFiniteError


@dataclass(frozen=True)
class SequenceSet:
    """Token sequences (prompt + completion) shared by every side that scores them.

    ``sampler_logprobs`` holds, when known, the generating sampler's own log-probability of each
    completion token (``len(tokens[i]) - prompt_lens[i]`` values for sequence ``i``).
    """

    tokens: list[list[int]]
    prompt_lens: list[int]
    sampler_logprobs: list[list[float]] | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    def completion_lens(self) -> list[int]:
        """Completion tokens per sequence."""
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lens, strict=True)]

    @property
    def completion_tokens(self) -> int:
        """Completion tokens over all sequences."""
        return sum(self.completion_lens())


def _read_jsonl(path: Path, what: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line; InputError on unreadable lines."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{what} file {str(path)!r} cannot be read: {e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: each line must be a JSON object, got "
                             f"{type(obj).__name__}")
        out.append((n, obj))
    if not out:
        raise InputError(f"{what} file {str(path)!r} holds no records")
    return out


def check_token_ids(tokens: object, where: str, vocab_size: int | None) -> list[int]:
    """A list of token ids in ``[0, vocab_size)``; InputError naming ``where`` otherwise."""
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InputError(f"{where}: tokens must be a list of integer token ids")
    for j, t in enumerate(tokens):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else "≥ 0"
            raise InputError(f"{where}: token id {t} at position {j} is outside the vocabulary "
                             f"{limit}")
    return list(tokens)


def check_logprobs(values: object, where: str, expected: int | None = None) -> list[float]:
    """Finite log-probabilities ≤ 0 (``expected`` of them); typed errors naming ``where``."""
    if not isinstance(values, list):
        raise InputError(f"{where}: log-probs must be a list of numbers")
    out = []
    for j, v in enumerate(values):
        if v is None:
            raise NonFiniteError(f"{where}: log-prob at completion position {j} is null (NaN)",
                                 count=1, nan=1, inf=0, first_indices=[(j,)])
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{where}: log-prob at completion position {j} is not a number: {v!r}")
        v = float(v)
        if not math.isfinite(v):
            nan = math.isnan(v)
            raise NonFiniteError(f"{where}: log-prob at completion position {j} is {v}",
                                 count=1, nan=int(nan), inf=int(not nan), first_indices=[(j,)])
        if v > 1e-6:
            raise InputError(f"{where}: log-prob {v!r} at completion position {j} is above 0")
        out.append(v)
    if expected is not None and len(out) != expected:
        raise InputError(f"{where}: {len(out)} sampler log-probs for {expected} completion "
                         "tokens; the two sides must score the same tokens")
    return out


def load_prompts(path: Path, *, encode: Callable[[str], Sequence[int]] | None,
                 vocab_size: int | None) -> list[list[int]]:
    """Token ids of every prompt in a prompts JSONL file (see the module docstring)."""
    prompts = []
    for i, (n, obj) in enumerate(_read_jsonl(path, "prompts")):
        where = f"{path}:{n} (prompt {i})"
        has_text, has_tokens = "prompt" in obj, "tokens" in obj
        if has_text == has_tokens:
            raise InputError(f"{where}: give exactly one of \"prompt\" (text) or \"tokens\" (ids)")
        if has_text:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise InputError(f"{where}: \"prompt\" must be a string")
            if not text.strip():
                raise InputError(f"{where}: the prompt is empty")
            if encode is None:
                raise InputError(f"{where}: a text prompt needs a tokenizer and this model has "
                                 "none; give token ids as {\"tokens\": [...]}")
            ids = check_token_ids(list(encode(text)), where, vocab_size)
        else:
            ids = check_token_ids(obj["tokens"], where, vocab_size)
        if not ids:
            raise InputError(f"{where}: the prompt is empty (no tokens)")
        prompts.append(ids)
    return prompts


def _check_prompt_len(p, n_tokens: int, where: str) -> None:
    """A prompt length must be an int leaving at least one prompt and one completion token."""
    if isinstance(p, bool) or not isinstance(p, int):
        raise InputError(f"{where}: prompt_len must be an integer, got {p!r}")
    if p <= 0:
        raise InputError(f"{where}: the prompt is empty (prompt_len {p})")
    if p >= n_tokens:
        raise InputError(f"{where}: no completion tokens (prompt_len {p}, {n_tokens} tokens)")


def validate_sequences(seqs: SequenceSet, vocab_size: int | None) -> SequenceSet:
    """Check every sequence of ``seqs``; return it unchanged or raise naming the sequence."""
    if len(seqs.tokens) != len(seqs.prompt_lens):
        raise InputError(f"{len(seqs.tokens)} sequences but {len(seqs.prompt_lens)} prompt lengths")
    if not seqs.tokens:
        raise InputError("no sequences to score")
    if seqs.sampler_logprobs is not None and len(seqs.sampler_logprobs) != len(seqs.tokens):
        raise InputError(f"{len(seqs.tokens)} sequences but {len(seqs.sampler_logprobs)} lists of "
                         "sampler log-probs")
    for i, (toks, p) in enumerate(zip(seqs.tokens, seqs.prompt_lens, strict=True)):
        where = f"sequence {i}"
        check_token_ids(toks, where, vocab_size)
        _check_prompt_len(p, len(toks), where)
        if seqs.sampler_logprobs is not None:
            check_logprobs(seqs.sampler_logprobs[i], where, expected=len(toks) - p)
    return seqs


def load_sequences(path: Path, *, vocab_size: int | None) -> SequenceSet:
    """Sequences from a sequences JSONL file (see the module docstring), validated.

    Either every line carries ``sampler_logprobs`` or none does.
    """
    tokens, plens, logps = [], [], []
    with_logp = None
    for i, (n, obj) in enumerate(_read_jsonl(path, "sequences")):
        where = f"{path}:{n} (sequence {i})"
        for key in ("tokens", "prompt_len"):
            if key not in obj:
                raise InputError(f"{where}: missing \"{key}\"")
        toks = check_token_ids(obj["tokens"], where, vocab_size)
        p = obj["prompt_len"]
        _check_prompt_len(p, len(toks), where)
        has = "sampler_logprobs" in obj
        if with_logp is None:
            with_logp = has
        elif has != with_logp:
            raise InputError(f"{where}: \"sampler_logprobs\" must be on every line or on none")
        if has:
            logps.append(check_logprobs(obj["sampler_logprobs"], where, expected=len(toks) - p))
        tokens.append(toks)
        plens.append(p)
    return SequenceSet(tokens, plens, logps if with_logp else None, source=str(path))


def check_same_tokens(name: str, tokens_a: list[list[int]], tokens_b: list[list[int]],
                      lens_a: Sequence[int], lens_b: Sequence[int]) -> None:
    """Both sides hold the same sequences and prompt lengths; InputError naming the first that differs."""
    if len(tokens_a) != len(tokens_b):
        raise InputError(f"{name}: {len(tokens_a)} sequences on one side, {len(tokens_b)} on the "
                         "other")
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)):
        if len(a) != len(b):
            raise InputError(f"{name}: sequence {i} has {len(a)} tokens on one side and {len(b)} "
                             "on the other")
        if a != b:
            j = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            raise InputError(f"{name}: sequence {i} differs at position {j} (token {a[j]} vs "
                             f"{b[j]}); both sides must score identical tokens")
        if lens_a[i] != lens_b[i]:
            raise InputError(f"{name}: sequence {i} has prompt length {lens_a[i]} on one side and "
                             f"{lens_b[i]} on the other")


def check_side_logprobs(name: str, side: str, logps: Sequence, completion_lens: Sequence[int]) -> None:
    """One side's per-sequence log-probs: one finite value ≤ 0 per completion token.

    Raises naming the condition, the side and the sequence, so a scorer that drops or adds a
    token, or produces NaN, is caught before any statistic is computed.
    """
    if len(logps) != len(completion_lens):
        raise InputError(f"{name}: {side} returned log-probs for {len(logps)} sequences, "
                         f"expected {len(completion_lens)}")
    for i, (lp, n) in enumerate(zip(logps, completion_lens, strict=True)):
        t = torch.as_tensor(lp)
        if t.dim() != 1 or t.numel() != n:
            raise InputError(f"{name}: {side} log-probs of sequence {i} have shape "
                             f"{tuple(t.shape)}, expected ({n},): the sides disagree on its length")
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise NonFiniteError(f"{name}: {side} log-probs of sequence {i} (position {j})",
                                 count=int(bad.sum()), nan=int(torch.isnan(t).sum()),
                                 inf=int(torch.isinf(t).sum()), first_indices=[(i, j)])
