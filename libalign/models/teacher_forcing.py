"""Teacher-forced decoding: what a sampler would report for tokens it did not draw.

Why a *teacher-forced decode*
-----------------------------
A sampler's log-probabilities come from KV-cached decoding: a prefill of the prompt, then one
token per step. To compare several sampler paths on **identical tokens** (the diagnosis), or
to ask a running sampler for its log-probabilities of given sequences (its ``score``), each
path must report its log-probability of tokens it did not necessarily draw itself.
:func:`replay_decode` does that: it runs exactly the decode of
:func:`libalign.models.generate` (left-padded prompts, positions counted from each prompt's
first real token, a prefill, then one step per token with the cache, finished rows fed the
pad token; the same :class:`~libalign.models.scoring.KVDecode`) but, instead of sampling,
feeds the given completion tokens and records ``log_softmax`` (fp32) of the step logits at
them. With the same batches as the generator, replaying the generating path reproduces the
generator's own log-probs bit for bit, so a replayed sampler path is the sampler that path
would have been, given those tokens.

This is not the learner's score (:func:`libalign.models.score_sequences`), which runs the
whole sequence through one forward pass without a cache: even on the same path the two
differ slightly (other GEMM shapes, padding on the other side), the cross-stack floor that
:mod:`libalign.models.scoring` describes.

Batches are fixed by order (:func:`batch_ranges`: ``batch_size`` consecutive sequences), the
same on every path, so batch composition is not a difference between paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from libalign.models.paths import use_path
from libalign.models.scoring import KVDecode
from libalign.models.strict import log_softmax_for

Progress = Callable[[int], None]
"""Called with the number of sequences just finished."""


def batch_ranges(n: int, batch_size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive batches of ``batch_size`` over ``n`` items."""
    for start in range(0, n, batch_size):
        yield start, min(n, start + batch_size)


@torch.no_grad()
def replay_batch(model: nn.Module, seqs: list[list[int]], plens: list[int],
                 pad_id: int, seq_ids: Sequence[int]) -> list[torch.Tensor]:
    """One batch of :func:`replay_decode`, under whatever path the model has now."""
    b = len(seqs)
    comps = [s[p:] for s, p in zip(seqs, plens, strict=True)]
    dec = KVDecode(model, [s[:p] for s, p in zip(seqs, plens, strict=True)], pad_id, seq_ids)
    steps = max(len(c) for c in comps)
    got: list[list[float]] = [[] for _ in range(b)]
    log_softmax = log_softmax_for(model)
    for step in range(steps):
        logp = log_softmax(dec.logits.float())
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
    """The KV-cached decode of ``path`` on given tokens, teacher-forced.

    One float32 tensor per sequence with the log-prob of each completion token as the sampler
    of ``path`` computes it while decoding (see the module docstring).
    """
    out: list[torch.Tensor] = []
    with use_path(model, path, backend=backend):
        for a, b in batch_ranges(len(sequences), batch_size):
            out.extend(replay_batch(model, [list(map(int, s)) for s in sequences[a:b]],
                                    list(prompt_lens[a:b]), pad_id, range(a, b)))
            if progress:
                progress(b - a)
    return out
