"""Rollout work between a trainer and the samplers: requests and completions on Redis Streams.

A trainer (the embedded learner, or a user's RL loop through the API) asks for rollouts by
adding a :class:`RolloutRequest` to :func:`requests_stream` of its key prefix
(``<key_prefix>:events:rollout_requests``). The samplers of that prefix share the consumer
group :data:`SAMPLER_GROUP` on it, so each request is served by exactly one sampler of the
run (and re-served by another if that one dies before acknowledging it); a daemon with
another prefix has other streams and never sees it. The sampler generates, stores the
rollouts (token ids and its log-probs) in the rollout store and, when asked, their guidance
records in the guidance store, then adds a :class:`RolloutsReady` to :func:`ready_stream`
(``<key_prefix>:events:rollouts_ready``) naming the rollout ids, or the error that stopped
it. Tokens travel as JSON in the request because prompts are short; rollouts themselves
never ride on a stream. :data:`REQUESTS` and :data:`READY` are the two names under the
default prefix.
"""

from __future__ import annotations

import json
import time
from typing import ClassVar

from alignclient.errors import InputError
from alignclient.ids import ID_PATTERN
from pydantic import Field, field_validator

from alignd.infra.events import DEFAULT_KEY_PREFIX, Event, VersionId, event_stream


def requests_stream(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The stream of rollout requests under a key prefix."""
    return event_stream(key_prefix, "rollout_requests")


def ready_stream(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The stream of rollout completions under a key prefix."""
    return event_stream(key_prefix, "rollouts_ready")


#: The rollout-request stream under the default key prefix ``libalign``.
REQUESTS = requests_stream()
#: The rollout-completion stream under the default key prefix ``libalign``.
READY = ready_stream()
SAMPLER_GROUP = "samplers"
MAX_PROMPTS = 4096
#: steps a run's sampling seeds are spread over (:func:`sampling_seed`)
SEED_STEPS = 2**32


def sampling_seed(seed: int, step: int) -> int:
    """The sampling seed of a run's rollout request at ``step``: ``seed · 2³² + step``, so
    every (run seed, step) pair gets its own seed, reproducibly, and seed 0 keeps ``step``.
    InputError outside ``0 ≤ seed < 2³¹``, ``0 ≤ step < 2³²`` (the seed stays below 2⁶³)."""
    if not (0 <= seed < 2**31 and 0 <= step < SEED_STEPS):
        raise InputError(f"sampling seed needs 0 <= seed < 2**31 and 0 <= step < 2**32, "
                         f"got seed {seed}, step {step}")
    return seed * SEED_STEPS + step
MAX_PROMPT_TOKENS = 4096


class RolloutRequest(Event):
    """Generate ``samples_per_prompt`` completions of each prompt with version ``version_id``."""

    kind: ClassVar[str] = "rollout_request"
    request_id: str = Field(pattern=ID_PATTERN)
    version_id: VersionId
    prompts: str  # JSON list of token-id lists
    samples_per_prompt: int = Field(1, ge=1, le=256)
    max_new_tokens: int = Field(ge=1, le=8192)
    temperature: float = Field(1.0, ge=0)
    seed: int = 0
    guidance_bits: int = Field(0, ge=0, le=4)  # 0: no guidance records
    routing: bool = False  # routing records (R3) with the rollouts
    requested_at: float = Field(default_factory=time.time)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: str) -> str:
        """A JSON list of non-empty lists of non-negative ints, within the limits."""
        try:
            data = json.loads(v)
        except ValueError as e:
            raise ValueError(f"prompts are not JSON: {e}") from None
        if not isinstance(data, list) or not 1 <= len(data) <= MAX_PROMPTS:
            raise ValueError(f"prompts must be a list of 1..{MAX_PROMPTS} token lists")
        for i, p in enumerate(data):
            if (not isinstance(p, list) or not 1 <= len(p) <= MAX_PROMPT_TOKENS
                    or not all(isinstance(t, int) and t >= 0 for t in p)):
                raise ValueError(f"prompt {i} must be 1..{MAX_PROMPT_TOKENS} non-negative ints")
        return v

    def prompt_list(self) -> list[list[int]]:
        """The prompts as token lists."""
        return json.loads(self.prompts)


class RolloutsReady(Event):
    """The rollouts of request ``request_id`` are stored (or ``error`` says why not)."""

    kind: ClassVar[str] = "rollouts_ready"
    request_id: str
    version_id: VersionId
    rollout_ids: str = "[]"  # JSON list, in prompt order, samples of a prompt adjacent
    sampler: str = ""
    guidance: bool = False
    error: str | None = None
    seconds: float = 0.0

    def ids(self) -> list[str]:
        """The rollout ids."""
        return json.loads(self.rollout_ids)
