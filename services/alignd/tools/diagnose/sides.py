"""The two sides of a diagnosis, run in batches with progress: sampling and learner scoring.

The sampler side on given tokens, the teacher-forced KV-cached replay of a path, is
:func:`libalign.models.teacher_forcing.replay_decode` (the sampler service scores with it too); the
report states whether replaying the generating path reproduced the generator's own log-probs
bit for bit.

Batches are fixed by order (:func:`~libalign.models.teacher_forcing.batch_ranges`: ``batch_size``
consecutive sequences), the same on every path and in the replay, so batch composition is
not a difference between conditions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from libalign import models
from libalign.models.teacher_forcing import Progress, batch_ranges


def sample(model: nn.Module, prompts: Sequence[Sequence[int]], path: str, *, max_new_tokens: int,
           temperature: float, seed: int, batch_size: int, eos_id, pad_id: int, backend: str,
           progress: Progress | None = None) -> models.GenerationResult:
    """Rollouts of ``path`` with its decode-time log-probs (:func:`libalign.models.generate`).

    Batch ``i`` draws from a generator seeded with ``seed * 1_000_003 + i``, so the tokens depend
    only on the seed, the path and the batching.
    """
    out = models.GenerationResult([], [], [], [])
    for i, (a, b) in enumerate(batch_ranges(len(prompts), batch_size)):
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
    for a, b in batch_ranges(len(sequences), batch_size):
        out.extend(models.score_sequences(model, sequences[a:b], prompt_lens[a:b], path,
                                          batch_size=b - a, backend=backend, pad_id=pad_id,
                                          seq_ids=range(a, b)))
        if progress:
            progress(b - a)
    return out
