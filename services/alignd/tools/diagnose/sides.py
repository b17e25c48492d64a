"""The two sides of a diagnosis, run in batches with progress: sampling, sampler replay, learner scoring.

Why a *teacher-forced decode*
-----------------------------
The sampler's log-probabilities come from KV-cached decoding: a prefill of the prompt, then one
token per step. To compare several sampler paths on **identical tokens**, each path must report
its log-probability of tokens it did not necessarily draw itself. :func:`replay_decode` does that:
it runs exactly the decode of :func:`libalign.models.generate` (left-padded prompts, positions
counted from each prompt's first real token, a prefill, then one step per token with the cache,
finished rows fed the pad token) but, instead of sampling, feeds the given completion tokens and
records ``log_softmax`` (fp32) of the step logits at them. With the same batches as the
generator, replaying the generating path reproduces the generator's own log-probs bit for bit
(the report states whether it did), so a replayed sampler path is the sampler that path would
have been, given those tokens.

Batches are fixed by order (``batch_size`` consecutive sequences), the same on every path, so
batch composition is not a difference between conditions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from libalign import models
from libalign.models.scoring import KVDecode  # the generator's own decode, teacher-forced here

Progress = Callable[[int], None]
"""Called with the number of sequences just finished."""


def _chunks(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield start, min(n, start + batch_size)


def sample(model: nn.Module, prompts: Sequence[Sequence[int]], path: str, *, max_new_tokens: int,
           temperature: float, seed: int, batch_size: int, eos_id, pad_id: int, backend: str,
           progress: Progress | None = None) -> models.GenerationResult:
    """Rollouts of ``path`` with its decode-time log-probs (:func:`libalign.models.generate`).

    Batch ``i`` draws from a generator seeded with ``seed * 1_000_003 + i``, so the tokens depend
    only on the seed, the path and the batching.
    """
    out = models.GenerationResult([], [], [], [])
    for i, (a, b) in enumerate(_chunks(len(prompts), batch_size)):
        r = models.generate(model, prompts[a:b], path, max_new_tokens=max_new_tokens,
                            temperature=temperature, seed=seed * 1_000_003 + i, batch_size=b - a,
                            eos_id=eos_id, backend=backend, pad_id=pad_id, seq_ids=range(a, b))
        out.sequences.extend(r.sequences)
        out.prompt_lens.extend(r.prompt_lens)
        out.logprobs.extend(r.logprobs)
        out.finished.extend(r.finished)
        if progress:
            progress(b - a)
    return out


def score(model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], path: str,
          *, batch_size: int, pad_id: int, backend: str,
          progress: Progress | None = None) -> list[torch.Tensor]:
    """Learner side: teacher-forced log-probs (:func:`libalign.models.score_sequences`) by batch."""
    out: list[torch.Tensor] = []
    for a, b in _chunks(len(sequences), batch_size):
        out.extend(models.score_sequences(model, sequences[a:b], prompt_lens[a:b], path,
                                          batch_size=b - a, backend=backend, pad_id=pad_id,
                                          seq_ids=range(a, b)))
        if progress:
            progress(b - a)
    return out


@torch.no_grad()
def _replay_batch(model: nn.Module, seqs: list[list[int]], plens: list[int],
                  pad_id: int, seq_ids: Sequence[int]) -> list[torch.Tensor]:
    b = len(seqs)
    comps = [s[p:] for s, p in zip(seqs, plens, strict=True)]
    dec = KVDecode(model, [s[:p] for s, p in zip(seqs, plens, strict=True)], pad_id, seq_ids)
    steps = max(len(c) for c in comps)
    got: list[list[float]] = [[] for _ in range(b)]
    for step in range(steps):
        logp = torch.log_softmax(dec.logits.float(), dim=-1)
        want = torch.tensor([c[step] if step < len(c) else pad_id for c in comps], dtype=torch.long,
                            device=dec.device)
        lp = logp.gather(-1, want.unsqueeze(-1)).squeeze(-1).tolist()
        for r in range(b):
            if step < len(comps[r]):
                got[r].append(lp[r])
        if step == steps - 1:
            break
        # a row whose completion has ended is fed the pad token, as the generator does
        dec.step([c[step] if step < len(c) - 1 else pad_id for c in comps],
                 active=[step < len(c) - 1 for c in comps])
    return [torch.tensor(v, dtype=torch.float32) for v in got]


def replay_decode(model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                  path: str, *, batch_size: int, pad_id: int, backend: str,
                  progress: Progress | None = None) -> list[torch.Tensor]:
    """Sampler side on given tokens: the KV-cached decode of ``path``, teacher-forced.

    One float32 tensor per sequence with the log-prob of each completion token as the sampler
    of ``path`` computes it while decoding (see the module docstring).
    """
    out: list[torch.Tensor] = []
    with models.use_path(model, path, backend=backend):
        for a, b in _chunks(len(sequences), batch_size):
            out.extend(_replay_batch(model, [list(map(int, s)) for s in sequences[a:b]],
                                     list(prompt_lens[a:b]), pad_id, range(a, b)))
            if progress:
                progress(b - a)
    return out
