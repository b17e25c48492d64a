"""A synthetic verifiable task: multi-digit addition with the answer written backwards.

Why a synthetic task
--------------------
Localizing the execution gap needs the activations of a *trained* model: random weights give
near-uniform next-token distributions, flat router logits and activation statistics nothing
like those of a real checkpoint, so their quantization errors tell little. A task that a tiny
Mixture-of-Experts model learns in a few CPU minutes gives peaked distributions, specialized
experts and a verifier, which is all the diagnosis needs.

The format
----------
A character vocabulary of 15 symbols: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), the ten
digits, ``+`` and ``=``. A prompt is ``<bos>a+b=`` with both operands written with exactly
``max_digits`` digits (zero-padded); the completion is the digits of ``a + b`` **least
significant first**, without leading zeros, then ``<eos>``::

    <bos>0347+0085=  ->  234<eos>        (347 + 85 = 432, max_digits = 4)
    <bos>0004+0003=  ->  7<eos>

Writing the sum backwards lets a left-to-right model emit each digit after exactly the two
operand digits and the carry it depends on, and the fixed operand width puts those digits at
fixed offsets; that is why a tiny transformer learns it in a few hundred steps. Where the
answer stops (``<eos>`` after 1 to ``max_digits + 1`` digits) still depends on the operands,
so the completion length is not a constant. Operands are drawn by first choosing a digit
count uniformly, so small numbers (and many leading zeros) are common.

Held-out split
--------------
A pair ``(a, b)`` belongs to the evaluation split when a fixed hash of it falls in a 1/16
slice; training never samples those pairs, so accuracy on ``prompts(..., split="eval")`` is
measured on pairs the model has not seen.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from libalign.errors import InputError

SPECIALS = ("<pad>", "<bos>", "<eos>")
SYMBOLS = (*SPECIALS, *"0123456789", "+", "=")


@dataclass(frozen=True)
class SyntheticTask:
    """Reversed-sum addition over a 15-symbol vocabulary (see the module docstring)."""

    max_digits: int = 4
    name: str = "add_reversed_padded"

    def __post_init__(self) -> None:
        if not 1 <= self.max_digits <= 9:
            raise InputError(f"max_digits must be between 1 and 9, got {self.max_digits}")

    # --- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (embedding rows)."""
        return len(SYMBOLS)

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>``."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of ``<bos>``."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of ``<eos>``."""
        return 2

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens: ``<bos>``, two operands, ``+`` and ``=``."""
        return 3 + 2 * self.max_digits

    @property
    def max_completion_len(self) -> int:
        """Longest completion in tokens: the sum's digits (one more than an operand) and ``<eos>``."""
        return self.max_digits + 2

    def spec(self) -> dict:
        """What identifies the task (used in cache keys)."""
        return {"name": self.name, "max_digits": self.max_digits, "symbols": list(SYMBOLS)}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``<pad>``, ``<bos>`` and ``<eos>`` are written by name."""
        ids, i = [], 0
        while i < len(text):
            if text[i] == "<":
                end = text.find(">", i)
                word = text[i:end + 1] if end >= 0 else ""
                if word not in SPECIALS:
                    raise InputError(f"unknown special token at offset {i} of {text!r}")
                ids.append(SYMBOLS.index(word))
                i = end + 1
                continue
            if text[i] not in SYMBOLS:
                raise InputError(f"character {text[i]!r} is not in the task vocabulary")
            ids.append(SYMBOLS.index(text[i]))
            i += 1
        return ids

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of ``ids`` (specials by name unless ``skip_special``)."""
        out = []
        for t in ids:
            t = int(t)
            if not 0 <= t < len(SYMBOLS):
                raise InputError(f"token id {t} is outside the vocabulary (size {len(SYMBOLS)})")
            if skip_special and t < len(SPECIALS):
                continue
            out.append(SYMBOLS[t])
        return "".join(out)

    # --- problems -----------------------------------------------------------------------------

    def in_eval_split(self, a: int, b: int) -> bool:
        """Whether the pair ``(a, b)`` is held out of training."""
        digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=2).digest()
        return digest[0] % 16 == 0

    def sample_pair(self, rng: random.Random, split: str = "eval") -> tuple[int, int]:
        """One operand pair of the split: digit counts uniform in 1..max_digits, then values."""
        if split not in ("train", "eval"):
            raise InputError(f"split must be 'train' or 'eval', got {split!r}")
        want_eval = split == "eval"
        while True:
            a, b = (self._operand(rng) for _ in range(2))
            if self.in_eval_split(a, b) == want_eval:
                return a, b

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    def prompt_ids(self, a: int, b: int) -> list[int]:
        """``<bos>a+b=`` as ids, operands zero-padded to ``max_digits``."""
        d = self.max_digits
        if not (0 <= a < 10 ** d and 0 <= b < 10 ** d):
            raise InputError(f"operands must have at most {d} digits, got {a} and {b}")
        return [self.bos_id, *self.encode(f"{a:0{d}d}+{b:0{d}d}=")]

    def answer_ids(self, prompt_ids) -> list[int]:
        """The correct completion of a prompt: the sum's digits reversed, then ``<eos>``."""
        a, b = self.parse_prompt(prompt_ids)
        return [*self.encode(str(a + b)[::-1]), self.eos_id]

    def parse_prompt(self, prompt_ids) -> tuple[int, int]:
        """The operands of a ``<bos>a+b=`` prompt."""
        text = self.decode(prompt_ids)
        body = text[len("<bos>"):] if text.startswith("<bos>") else text
        left, plus, right = body.partition("+")
        if not plus or not right.endswith("=") or not left.isdigit() or not right[:-1].isdigit():
            raise InputError(f"not a prompt of this task: {text!r}")
        return int(left), int(right[:-1])

    def prompts(self, n: int, seed: int = 0, *, split: str = "eval") -> list[list[int]]:
        """``n`` prompts drawn with ``random.Random(seed)`` from a split (held-out by default)."""
        rng = random.Random(f"{self.name}:{split}:{seed}")
        return [self.prompt_ids(*self.sample_pair(rng, split)) for _ in range(n)]

    def verify(self, prompt_ids, completion_ids) -> bool:
        """True when the completion is the reversed sum followed by ``<eos>``.

        Tokens after the first ``<eos>`` are ignored; a completion without ``<eos>`` (cut by
        a length limit) is wrong.
        """
        want = self.answer_ids(prompt_ids)
        got = [int(t) for t in completion_ids]
        if self.eos_id not in got:
            return False
        return got[:got.index(self.eos_id) + 1] == want
