"""The price of strictness: strict execution against the normal kernels, same run.

Two tables, each with its baseline measured in the same run:

* **engine step** (the embedded engines on the trained tiny model, the demo's batch of 8
  prompts x 8 samples): the sampler's rollout (KV-cached decode), the learner's scores and one
  GRPO train step (forward and backward), normal against strict (:mod:`libalign.models.strict`)
  on ``bf16`` and ``nvfp4_minite``, with the max |δ| of each mode on its own rollouts (strict:
  0 exactly);
* **ops** at miniTE shapes (Qwen3-30B-A3B: hidden 2048, 32/4 heads of 128, 128 experts top-8
  with intermediate 768, vocabulary 151936): each batch-invariant op of
  :mod:`libalign.strict.ops` against the stock kernel it replaces, at a decode batch and a
  prefill batch, and whether a row's bits are the same computed alone and inside the batch
  (``invariant``: strict always; the stock kernel as measured here).

``--mode`` picks the strict mode the tables time (:mod:`libalign.strict.device`): ``device``
(the default: batch-invariant tensor-core kernels on a GPU, the portable ops on a CPU) or
``portable``. On a CUDA device a third table times one Qwen3-30B-A3B-shaped decoder layer
forward (4 x 512 tokens), normal against strict, and the run checks that strict decode equals
strict scoring bitwise on the device in both modes, and compares the device's portable-mode
log-probs with the CPU's; where they differ it names the first module whose output differs.

Run: ``python -m tests.bench strict [-- --device cuda] [-- --mode portable] [-- --quick]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from libalign import models
from libalign.models import strict
from libalign.strict import ops as strict_ops
from libalign.strict.device import op_set

from .measure import graph_ms, seconds

PATHS = ("bf16", "nvfp4_minite")


# --- the engine step ---------------------------------------------------------------------------

class _Side:
    """One mode's sampler and learner on copies of the model, and the batch it trains on."""

    def __init__(self, model, task, path: str, device: torch.device, strict_mode: bool,
                 mode: str = "device"):
        from alignd.learner.engine import TorchLearnerEngine, TrainBatch

        self.task, self.path, self.strict = task, path, strict_mode
        self.prompts = [p for p in task.prompts(8, seed=11, split="train") for _ in range(8)]
        self.sampler = models.build_model(model.config, seed=0).to(device)
        self.sampler.load_state_dict(model.state_dict())
        if strict_mode:
            strict.enable(self.sampler, mode)
        learner_model = models.build_model(model.config, seed=0).to(device)
        learner_model.load_state_dict(model.state_dict())
        self.learner = TorchLearnerEngine(learner_model, path, pad_id=task.pad_id,
                                          strict=strict_mode, strict_ops=mode,
                                          use_tis=not strict_mode)
        self.r = self.rollout()
        scores = self.learner.score(self.r.sequences, self.r.prompt_lens)
        self.max_abs_delta = max(abs(a - b) for s, lp in zip(scores, self.r.logprobs, strict=True)
                                 for a, b in zip(s, lp.tolist(), strict=True))
        rewards = [float(task.verify(s[:p], s[p:]))
                   for s, p in zip(self.r.sequences, self.r.prompt_lens, strict=True)]
        self.batch = TrainBatch(self.r.sequences, self.r.prompt_lens,
                                [t.tolist() for t in self.r.logprobs], rewards,
                                [i // 8 for i in range(len(self.prompts))])

    def rollout(self):
        t = self.task
        return models.generate(self.sampler, self.prompts, self.path,
                               max_new_tokens=t.max_completion_len, temperature=1.0, seed=3,
                               batch_size=64, eos_id=t.eos_id, pad_id=t.pad_id)

    def stages(self):
        return {"rollout": self.rollout,
                "score": lambda: self.learner.score(self.r.sequences, self.r.prompt_lens),
                "train": lambda: self.learner.train_step(self.batch)}


def engine_table(device: torch.device, repeat: int, mode: str = "device") -> list[dict]:
    """Normal and strict timed in alternation (each repeat times one, then the other), so both
    see the same load; the ratio column is the median of the per-repeat ratios."""
    model, task = models.trained_tiny_model()
    rows = []
    for path in PATHS:
        sides = {m: _Side(model, task, path, device, m, mode) for m in (False, True)}
        times: dict[tuple[bool, str], list[float]] = {}
        for _ in range(repeat):
            for stage in ("rollout", "score", "train"):
                for m, side in sides.items():
                    times.setdefault((m, stage), []).append(
                        seconds(side.stages()[stage], 1, device, warm=False))
        for m in (False, True):
            times[(m, "step")] = [sum(x) for x in zip(*(times[(m, s)] for s in
                                                        ("rollout", "score", "train")), strict=True)]
        rows.append({"path": path, "times": times,
                     "delta": {m: side.max_abs_delta for m, side in sides.items()}})
    print(f"\nengine step on {device}, strict mode {mode} (trained tiny model, 64 rollouts: "
          f"8 prompts x 8 samples; {repeat} alternating repeats); baseline: the normal mode in "
          "this run")
    print(f"{'path':14} {'stage':8} {'normal s':>10} {'strict s':>10} {'strict/normal':>14}")
    for row in rows:
        t = row["times"]
        for stage in ("rollout", "score", "train", "step"):
            n, s = t[(False, stage)], t[(True, stage)]
            ratio = statistics.median(b / a for a, b in zip(n, s, strict=True))
            print(f"{row['path']:14} {stage:8} {statistics.median(n):10.3f} "
                  f"{statistics.median(s):10.3f} {ratio:14.2f}")
        print(f"{row['path']:14} {'max|δ|':8} {row['delta'][False]:10.3g} {row['delta'][True]:10.3g}")
    return rows


# --- the ops ----------------------------------------------------------------------------------

def _invariant(fn, x: torch.Tensor, rows: int = 1) -> bool:
    full = fn(x)
    return bool(torch.equal(full[:rows], fn(x[:rows].clone())))


def op_table(device: torch.device, repeat: int, quick: bool, mode: str = "device") -> list[dict]:
    ops = op_set(mode)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    h, vocab = (2048, 151936) if not quick else (512, 8192)
    batches = (8, 512) if not quick else (8, 64)
    w = rnd(h, h, scale=h ** -0.5)
    w_exp = rnd(1536 if not quick else 384, h, scale=h ** -0.5)
    w_head = rnd(vocab, h, scale=h ** -0.5)
    norm_w = torch.ones(h, device=device, dtype=torch.bfloat16)
    rows = []

    def add(name, m, stock, strict_fn, x):
        t_n = seconds(lambda: stock(x), repeat, device, statistics.median)
        t_s = seconds(lambda: strict_fn(x), repeat, device, statistics.median)
        row = {"op": name, "rows": m, "normal_ms": t_n * 1e3, "strict_ms": t_s * 1e3,
               "normal_invariant": _invariant(stock, x),
               "strict_invariant": _invariant(strict_fn, x)}
        if device.type == "cuda":  # the kernels' own time: CUDA graph replays, no host work
            with torch.no_grad():
                row["normal_dev_ms"] = graph_ms(lambda: stock(x), max(repeat, 20))
                row["strict_dev_ms"] = graph_ms(lambda: strict_fn(x), max(repeat, 20))
        rows.append(row)

    for m in batches:
        x = rnd(m, h)
        add(f"linear {h}x{h}", m, lambda a: torch.nn.functional.linear(a, w),
            lambda a: ops.linear(a, w), x)
        add(f"expert GEMM {w_exp.shape[0]}x{h}", m,
            lambda a: torch.nn.functional.linear(a, w_exp), lambda a: _expert(ops, a, w_exp), x)
        add(f"rms_norm {h}", m, lambda a: _rms(a, norm_w), lambda a: ops.rms_norm(
            a, norm_w, 1e-6), x)
        logits = rnd(m, 128)
        add("router softmax 128", m, lambda a: torch.softmax(a.float(), -1), ops.softmax,
            logits)
        add("top-8 of 128", m, lambda a: torch.topk(a.float(), 8, -1).indices,
            lambda a: ops.topk_indices(a.float(), 8), logits)
        if m <= 64 or not quick:
            add(f"LM head {vocab}x{h}", m, lambda a: torch.nn.functional.linear(a, w_head),
                lambda a: ops.linear(a, w_head), x)
        lv = rnd(m, vocab, scale=3.0)
        add(f"log_softmax {vocab}", m, lambda a: torch.log_softmax(a.float(), -1),
            ops.log_softmax, lv)
    t = 256 if quick else 1024
    q, k, v = rnd(8, 32, 1, 128), rnd(8, 4, t, 128), rnd(8, 4, t, 128)
    allowed = torch.ones(8, 1, 1, t, dtype=torch.bool, device=device)
    add(f"decode attention 32/4x128, {t} keys", 8,
        lambda q_: torch.nn.functional.scaled_dot_product_attention(
            q_, k[:len(q_)], v[:len(q_)], enable_gqa=True),
        lambda q_: ops.attention(q_, k[:len(q_)], v[:len(q_)], allowed[:len(q_)], 128 ** -0.5), q)
    if not quick:
        tp = 512
        qp, kp, vp = rnd(4, 32, tp, 128), rnd(4, 4, tp, 128), rnd(4, 4, tp, 128)
        causal = torch.ones(tp, tp, dtype=torch.bool, device=device).tril().expand(4, 1, tp, tp)
        add(f"prefill attention 32/4x128, {tp} tokens", 4,
            lambda q_: torch.nn.functional.scaled_dot_product_attention(
                q_, kp[:len(q_)], vp[:len(q_)], is_causal=True, enable_gqa=True),
            lambda q_: ops.attention(q_, kp[:len(q_)], vp[:len(q_)], causal[:len(q_)],
                                     128 ** -0.5), qp)
    print(f"\nops on {device}, strict mode {mode}, at {'reduced' if quick else 'miniTE'} shapes "
          f"(median of {repeat}); "
          "baseline: the stock kernel in this run; invariant: row 0 alone == row 0 in the batch")
    dev = device.type == "cuda"
    if dev:
        print("device ms: a CUDA graph replay of the call (the kernels' time without the host's "
              "launch work); ms: one eager call to its synchronisation")
    print(f"{'op':36} {'rows':>5} {'normal ms':>10} {'strict ms':>10} {'strict/normal':>14} "
          + (f"{'normal dev':>10} {'strict dev':>10} {'dev ratio':>9} " if dev else "")
          + f"{'normal inv.':>11} {'strict inv.':>11}")
    for r in rows:
        cells = (f"{r['normal_dev_ms']:10.4f} {r['strict_dev_ms']:10.4f} "
                 f"{r['strict_dev_ms'] / r['normal_dev_ms']:9.2f} " if dev else "")
        print(f"{r['op']:36} {r['rows']:5d} {r['normal_ms']:10.3f} {r['strict_ms']:10.3f} "
              f"{r['strict_ms'] / r['normal_ms']:14.1f} {cells}{r['normal_invariant']!s:>11} "
              f"{r['strict_invariant']!s:>11}")
    return rows


def _expert(ops, a, w):
    """One expert's rows through the mode's expert product."""
    if ops.mode == "device" and a.is_cuda:
        return ops.kernels.grouped_matmul(a, w.unsqueeze(0), [a.shape[0]], out_dtype=a.dtype)
    return strict_ops.matmul_f32(a, w).to(a.dtype)


def _rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


# --- one Qwen3-30B-A3B-shaped layer ------------------------------------------------------------

def layer_table(device: torch.device, repeat: int, mode: str) -> dict:
    """One decoder layer at Qwen3-30B-A3B's shapes (embedding, layer, final norm; 4 x 512
    tokens, bf16 and nvfp4_minite experts): normal (sdpa attention, libalign's grouped experts)
    against strict, timed in alternation, the median of at least 10 forwards each (a
    host-bound call: a few forwards move the ratio by several percent)."""
    repeat = max(repeat, 10)
    cfg = models.qwen3_30b_a3b_shaped_config(num_layers=1, vocab_size=4096)
    model = models.build_model(cfg, seed=0, device=device)
    ids = torch.randint(0, 4096, (4, 512), generator=torch.Generator().manual_seed(0)).to(device)
    rows = {}
    for path in PATHS:
        models.set_path(model, path)
        t = {False: [], True: []}
        with torch.no_grad():
            for _ in range(repeat + 1):
                for m in (False, True):
                    with strict.use_strict(model, m, mode):
                        t[m].append(seconds(lambda: model.model(input_ids=ids), 1, device,
                                            warm=False))
        rows[path] = {m: statistics.median(v[1:]) for m, v in t.items()}
    models.reset_paths(model)
    print(f"\none Qwen3-30B-A3B-shaped layer forward on {device}, strict mode {mode} (4 x 512 "
          f"tokens; median of {repeat}); baseline: the normal forward in this run")
    print(f"{'path':14} {'normal ms':>10} {'strict ms':>10} {'strict/normal':>14}")
    for path, r in rows.items():
        print(f"{path:14} {r[False] * 1e3:10.2f} {r[True] * 1e3:10.2f} {r[True] / r[False]:14.2f}")
    return rows


# --- the device checks -------------------------------------------------------------------------

def first_difference(a_model, b_model, sequences, prompt_lens, path: str, pad_id: int) -> str:
    """Score one batch on two models (strict, any devices) and name the first module, in call
    order, whose output differs between them, with the largest difference there."""
    seen: dict[str, list] = {"a": [], "b": []}

    def hooks(model, key):
        def grab(name):
            def fn(_mod, _inp, out):
                x = out[0] if isinstance(out, tuple) else out
                if isinstance(x, torch.Tensor):
                    seen[key].append((name, x.detach().float().cpu()))
            return fn
        return [m.register_forward_hook(grab(n)) for n, m in model.named_modules() if n]

    handles = hooks(a_model, "a") + hooks(b_model, "b")
    try:
        for model in (a_model, b_model):
            models.score_sequences(model, sequences[:4], prompt_lens[:4], path, batch_size=4,
                                   pad_id=pad_id)
    finally:
        for h in handles:
            h.remove()
    for (name, x), (_, y) in zip(seen["a"], seen["b"], strict=False):
        if x.shape == y.shape and not torch.equal(x.nan_to_num(), y.nan_to_num()):
            return f"{name} (max |Δ| {float((x - y).abs().nan_to_num().max()):.3g})"
    return "no module output differs"


def device_checks(device: torch.device) -> bool:
    """Strict decode == strict scoring on ``device`` in both modes; the device's portable-mode
    log-probs vs the CPU's, and where they first differ."""
    model, task = models.trained_tiny_model()
    ok = True
    prompts = task.prompts(16, seed=5)
    for mode in ("device", "portable"):
        for path in PATHS:
            dev_model = models.build_model(model.config, seed=0).to(device)
            dev_model.load_state_dict(model.state_dict())
            with strict.use_strict(dev_model, mode=mode), strict.use_strict(model, mode=mode):
                r = models.generate(dev_model, prompts, path,
                                    max_new_tokens=task.max_completion_len, temperature=1.0,
                                    seed=1, batch_size=5, eos_id=task.eos_id, pad_id=task.pad_id)
                lp = models.score_sequences(dev_model, r.sequences, r.prompt_lens, path,
                                            batch_size=16, pad_id=task.pad_id)
                same = all(torch.equal(a, b) for a, b in zip(lp, r.logprobs, strict=True))
                line = (f"{device} {mode} {path}: strict decode == strict scoring on every "
                        f"token: {same}")
                if mode == "portable":
                    cpu = models.score_sequences(model, r.sequences, r.prompt_lens, path,
                                                 batch_size=16, pad_id=task.pad_id)
                    cpu_same = all(torch.equal(a, b) for a, b in zip(lp, cpu, strict=True))
                    diff = max(float((a - b).abs().max()) for a, b in zip(lp, cpu, strict=True))
                    line += f"; {device} == cpu: {cpu_same} (max |Δ| {diff:.3g})"
                    if not cpu_same:
                        line += "; first differing module: " + first_difference(
                            dev_model, model, r.sequences, r.prompt_lens, path, task.pad_id)
            ok = ok and same
            print(line)
    return ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench strict")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="reduced op shapes")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--mode", default="device", choices=("device", "portable"),
                    help="the strict mode the tables time")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: PyTorch's, as the demo runs)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"CPU threads: {args.threads or torch.get_num_threads()}")
    with models.cpu_threads(args.threads):
        ok = True
        if device.type == "cuda":
            ok = device_checks(device)
        if not args.skip_engine:
            engine_table(device, args.repeat, args.mode)
        if device.type == "cuda" and not args.quick:
            layer_table(device, args.repeat, args.mode)
    with models.cpu_threads(1 if device.type == "cpu" else None):  # small ops: one thread
        op_table(device, args.repeat, args.quick or device.type == "cpu", args.mode)
    return 0 if ok else 1
