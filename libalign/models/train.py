"""Train (once) and cache the tiny Qwen3-MoE on the synthetic task.

Diagnosing the execution gap needs activations of a model that has learned something: peaked
next-token distributions, routers that prefer some experts, hidden states with the outliers
training produces. :func:`trained_tiny_model` trains :func:`~libalign.models.config.tiny_config`
on :class:`~libalign.models.task.SyntheticTask` on the CPU in a few minutes, stores it with
``save_pretrained`` (safetensors, bf16) and loads it with ``from_pretrained`` afterwards.

Recipe
------
fp32 weights, AdamW (β = 0.9/0.98, weight decay 0.01), linear warm-up then cosine decay to a
tenth of the peak rate, gradient-norm clipping at 1. The loss is the cross-entropy of the
completion tokens only (the operands are random, so predicting them is noise) plus the
router's load-balancing loss (``router_aux_loss_coef``), which keeps all experts in use as in
a real MoE. Batches are sampled from the training split with a seeded ``random.Random``, the
weights from a forked seeded torch RNG, so one configuration trains to the same model on the
same software. Training runs on one CPU thread (:func:`cpu_threads`): the matrices are too
small to share, and on cores that other processes also use, multi-threaded small operations
were measured 20-40 times slower.

With the defaults (4-digit operands, 800 steps of 96 sequences) the loss plateaus near 1.0
while the model learns digit alignment, then drops to about 0.04 within 300 steps; greedy
accuracy on held-out prompts lands near 97% in bf16 (a model that is confident but not
perfect, so some tokens carry real uncertainty). That takes about two minutes on one core.

A warm start with headroom
-------------------------
RL needs a policy that is right sometimes but not always: one that already solves the task
leaves GRPO nothing to improve (its reward cannot rise) and hides what a numerical gap costs.
``stop_at_accuracy=a`` ends training at the first step where the teacher-forced sequence
accuracy of the last ``STOP_WINDOW`` training batches (the share of sequences whose every
completion token is the argmax, which is the greedy exact-match accuracy on those batches)
reaches ``a``. Stopping by accuracy rather than at a fixed step count makes the checkpoint
mean the same on any machine: the loss curve's sudden drop (above) comes a few dozen steps
earlier or later with other floating-point rounding, and a fixed step near it would give a
policy anywhere between hopeless and solved. The schedule is still that of ``steps``.

The cache
---------
The checkpoint lives at ``<root>/tiny-<hash>``, ``root`` being ``cache_dir``, else
``$ALIGN_MODEL_CACHE``, else ``~/.cache/libalign/models``; the hash covers the model config,
the task, the number of steps, the seed, the recipe and the stopping accuracy, if any. It is
written into a temporary directory next to it, fsynced and renamed into place, so a reader
sees either no checkpoint or a complete one; a failure removes the temporary directory, and
temporary directories of processes that no longer exist are swept on the next write
(:mod:`libalign.atomic_dir`, the writer the daemon's weight store also uses).
``training.json`` beside the weights records the loss curve, the training time, the step
training stopped at and the greedy accuracy on held-out prompts, per execution path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from libalign.atomic_dir import DestinationExistsError, atomic_directory, sweep_stale
from libalign.errors import ConfigError
from libalign.kernels import config
from libalign.models.config import build_model, tiny_config
from libalign.models.scoring import generate
from libalign.models.task import SyntheticTask

log = logging.getLogger(__name__)

DEFAULT_STEPS = 800
RECIPE = {"version": 1, "batch_size": 96, "lr": 3e-3, "warmup": 60, "min_lr_ratio": 0.1,
          "betas": (0.9, 0.98), "weight_decay": 0.01, "grad_clip": 1.0}
LOG_EVERY = 100
TRAIN_THREADS = 1
#: training batches whose mean teacher-forced sequence accuracy ``stop_at_accuracy`` compares
STOP_WINDOW = 10
EVAL_PROMPTS = 512
EVAL_PATHS = ("bf16", "nvfp4_naive", "nvfp4_minite")
META_FILE = "training.json"
#: a temporary directory of a writer that is gone is swept once this old (seconds)
STALE_AFTER_S = 3600.0
_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "dtype", "id2label", "label2id",
             "output_attentions", "output_hidden_states", "return_dict", "problem_type",
             "chunk_size_feed_forward", "use_cache", "is_encoder_decoder"}


# --- cache location ---------------------------------------------------------------------------

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where trained tiny models are kept (see the module docstring)."""
    root = cache_dir or config.current().model_cache or Path.home() / ".cache" / "libalign" / "models"
    return Path(root).expanduser()


def cache_key(config: Qwen3MoeConfig, task: SyntheticTask, steps: int, seed: int,
              stop_at_accuracy: float | None = None) -> str:
    """16 hex digits identifying a trained model: config, task, steps, seed, recipe and the
    stopping accuracy (absent from the key when None, so full-length models keep theirs)."""
    cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE and not k.startswith("_")}
    what = {"config": cfg, "task": task.spec(), "steps": steps, "seed": seed, "recipe": RECIPE}
    if stop_at_accuracy is not None:
        what["stop_at_accuracy"] = float(stop_at_accuracy)
        what["stop_window"] = STOP_WINDOW
    blob = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def checkpoint_dir(*, cache_dir=None, steps: int | None = None, seed: int = 0,
                   config: Qwen3MoeConfig | None = None, task: SyntheticTask | None = None,
                   stop_at_accuracy: float | None = None) -> Path:
    """The directory :func:`trained_tiny_model` uses for these arguments."""
    task = task or SyntheticTask()
    config = config or tiny_config(vocab_size=task.vocab_size)
    steps = DEFAULT_STEPS if steps is None else steps
    return cache_root(cache_dir) / f"tiny-{cache_key(config, task, steps, seed, stop_at_accuracy)}"


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / META_FILE).is_file() and any(
        path.glob("*.safetensors"))


def write_dir_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a fresh temporary directory beside ``final``, then rename it there.

    On any failure the temporary directory is removed and ``final`` is untouched. When another
    writer renamed a complete ``final`` first, ours is discarded and theirs kept. Temporary
    directories of writers that are gone and older than ``STALE_AFTER_S`` are swept first
    (:func:`~libalign.atomic_dir.sweep_stale`).
    """
    final = Path(final)
    sweep_stale(final.parent, STALE_AFTER_S)
    try:
        with atomic_directory(final) as tmp:
            write(tmp)
    except DestinationExistsError:
        if not _is_complete(final):
            raise
    return final


# --- training ---------------------------------------------------------------------------------

def _batch(task: SyntheticTask, rng: random.Random, n: int, device) -> tuple[torch.Tensor, ...]:
    rows = []
    for _ in range(n):
        prompt = task.prompt_ids(*task.sample_pair(rng, "train"))
        rows.append((prompt, task.answer_ids(prompt)))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((n, width), task.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for r, (p, a) in enumerate(rows):
        ids[r, :len(p) + len(a)] = torch.tensor(p + a)
        mask[r, :len(p) + len(a)] = 1
        target[r, len(p):len(p) + len(a)] = True
    return ids.to(device), mask.to(device), target.to(device)


def _lr_at(step: int, steps: int) -> float:
    peak, warm, floor = RECIPE["lr"], RECIPE["warmup"], RECIPE["min_lr_ratio"]
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op CPU threads (``None``: unchanged), then restore.

    The tiny model's matrices are too small to gain from several threads, and when other
    processes share the cores, OpenMP workers that spin at every barrier slow each small
    operation down by an order of magnitude or more; one thread is the robust choice.
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_stop(stop_at_accuracy) -> float | None:
    if stop_at_accuracy is None:
        return None
    a = float(stop_at_accuracy)
    if not 0.0 < a <= 1.0:
        raise ConfigError(f"stop_at_accuracy must lie in (0, 1], got {stop_at_accuracy}")
    return a


def train_model(config: Qwen3MoeConfig, task: SyntheticTask, *, steps: int, seed: int = 0,
                device: str | torch.device = "cpu", threads: int | None = TRAIN_THREADS,
                stop_at_accuracy: float | None = None) -> tuple[Qwen3MoeForCausalLM, list[dict]]:
    """Train a fresh fp32 model on the task; returns it (fp32, eval mode) and the loss curve.

    With ``stop_at_accuracy``, training ends early once the teacher-forced sequence accuracy
    of the last ``STOP_WINDOW`` batches reaches it (the curve's last point says
    ``"stopped": True``; see the module docstring).
    """
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    stop = _check_stop(stop_at_accuracy)
    with cpu_threads(threads):
        model = build_model(config, seed=seed, dtype=torch.float32, device=device).train()
        return _train_loop(model, config, task, steps=steps, seed=seed, device=device, stop=stop)


def _train_loop(model, config, task, *, steps, seed, device, stop=None):
    opt = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], betas=RECIPE["betas"],
                            weight_decay=RECIPE["weight_decay"])
    rng = random.Random(f"train:{seed}")
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    curve: list[dict] = []
    acc = {"loss": 0.0, "tok": 0, "tok_ok": 0, "seq": 0, "seq_ok": 0, "n": 0}
    recent: deque[float] = deque(maxlen=STOP_WINDOW)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps)
        ids, mask, target = _batch(task, rng, RECIPE["batch_size"], device)
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=coef > 0)
        logits = out.logits[:, :-1].float()
        want, sel = ids[:, 1:], target[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits[sel], want[sel])
        loss = ce + coef * out.aux_loss if coef > 0 else ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["grad_clip"])
        opt.step()
        with torch.no_grad():
            right = (logits.argmax(-1) == want) | ~sel
            acc["loss"] += float(ce)
            acc["n"] += 1
            acc["tok"] += int(sel.sum())
            acc["tok_ok"] += int((right & sel).sum())
            acc["seq"] += ids.shape[0]
            acc["seq_ok"] += int(right.all(-1).sum())
            recent.append(float(right.all(-1).float().mean()))
        stopped = stop is not None and len(recent) == STOP_WINDOW and sum(recent) / STOP_WINDOW >= stop
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps or stopped:
            point = {"step": step + 1, "loss": acc["loss"] / acc["n"],
                     "token_acc": acc["tok_ok"] / acc["tok"], "seq_acc": acc["seq_ok"] / acc["seq"],
                     "lr": _lr_at(step, steps), "seconds": round(time.perf_counter() - t0, 2)}
            if stopped:
                point["stopped"] = True
                point["window_seq_acc"] = sum(recent) / STOP_WINDOW
            curve.append(point)
            log.info("tiny model step %d/%d: loss %.4f, token acc %.3f, teacher-forced seq acc %.3f"
                     " (%.0f s)", point["step"], steps, point["loss"], point["token_acc"],
                     point["seq_acc"], point["seconds"])
            acc = dict.fromkeys(acc, 0)
            acc["loss"] = 0.0
        if stopped:
            break
    return model.eval(), curve


def heldout_accuracy(model: Qwen3MoeForCausalLM, task: SyntheticTask, path, *, n: int = EVAL_PROMPTS,
                     seed: int = 0, batch_size: int = 64) -> float:
    """Greedy exact-match accuracy on ``n`` held-out prompts under ``path``."""
    prompts = task.prompts(n, seed, split="eval")
    res = generate(model, prompts, path, max_new_tokens=task.max_completion_len, temperature=0,
                   batch_size=batch_size, eos_id=task.eos_id, pad_id=task.pad_id)
    ok = sum(task.verify(p, c) for p, c in zip(prompts, res.completions, strict=True))
    return ok / max(1, n)


def trained_tiny_model(*, cache_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                       steps: int | None = None, seed: int = 0, eval_prompts: int = EVAL_PROMPTS,
                       stop_at_accuracy: float | None = None,
                       ) -> tuple[Qwen3MoeForCausalLM, SyntheticTask]:
    """The tiny model trained on the synthetic task (bf16, eval mode, on ``device``), and the task.

    Training always runs on the CPU (so the cached checkpoint does not depend on where it was
    first asked for); ``device`` is where the returned model lives.

    Trains and caches on the first call for these arguments (``steps=None``: ``DEFAULT_STEPS``,
    a couple of CPU minutes), loads from the cache afterwards. ``stop_at_accuracy`` asks for a
    policy that is right only that often (the warm start of an RL run with headroom; see the
    module docstring).
    """
    task = SyntheticTask()
    config = tiny_config(vocab_size=task.vocab_size)
    steps = DEFAULT_STEPS if steps is None else int(steps)
    stop = _check_stop(stop_at_accuracy)
    final = checkpoint_dir(cache_dir=cache_dir, steps=steps, seed=seed, config=config, task=task,
                           stop_at_accuracy=stop)
    if not _is_complete(final):
        log.info("training the tiny Qwen3-MoE (%d steps) into %s", steps, final)
        t0 = time.perf_counter()
        model, curve = train_model(config, task, steps=steps, seed=seed, device="cpu",
                                   stop_at_accuracy=stop)
        seconds = time.perf_counter() - t0
        model = model.to(torch.bfloat16)
        with cpu_threads(TRAIN_THREADS):
            accuracy = {p: heldout_accuracy(model, task, p, n=eval_prompts) for p in EVAL_PATHS}
        log.info("tiny model trained in %.0f s; held-out greedy accuracy %s", seconds,
                 {k: round(v, 4) for k, v in accuracy.items()})
        meta = {"key": final.name, "steps": steps, "seed": seed, "task": task.spec(), "recipe": RECIPE,
                "train_seconds": round(seconds, 2), "device": "cpu",
                "threads": TRAIN_THREADS, "loss_curve": curve,
                "final_loss": curve[-1]["loss"] if curve else None,
                "heldout_prompts": eval_prompts, "heldout_accuracy": accuracy,
                "stop_at_accuracy": stop, "trained_steps": curve[-1]["step"] if curve else 0,
                "torch": torch.__version__}

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

        write_dir_atomically(final, write)
    # loaded at torch's default dtype, then cast (the same bf16 bits): from_pretrained with
    # another dtype switches the process-wide default while it loads, under every other thread
    model = Qwen3MoeForCausalLM.from_pretrained(final, dtype=torch.get_default_dtype())
    return model.to(device=device, dtype=torch.bfloat16).eval(), task


def training_report(*, cache_dir=None, steps: int | None = None, seed: int = 0,
                    stop_at_accuracy: float | None = None) -> dict | None:
    """The ``training.json`` of the cached model for these arguments, or None if not trained yet."""
    meta = checkpoint_dir(cache_dir=cache_dir, steps=steps, seed=seed,
                          stop_at_accuracy=_check_stop(stop_at_accuracy)) / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None
