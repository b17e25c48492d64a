"""``alignd diagnose``: a frozen-policy, teacher-forced measurement of the learner–sampler gap.

What is measured, and on which tokens
-------------------------------------
One weight version, one model, several *conditions* (``learner_path/sampler_path``, see
:mod:`alignd.tools.diagnose.conditions`). For every token the report uses
``δ = log p_learner − log p_sampler``, the learner's teacher-forced log-prob (a batched full-sequence
forward, :func:`libalign.models.score_sequences`) minus the sampler's decode-time log-prob (the
KV-cached decode, :func:`libalign.models.generate`).

The statistically useful question is a *comparison*: does NVFP4 widen the |δ| tail beyond what
two bf16 stacks already disagree by (the cross-path floor ``bf16/bf16``)? A comparison of two
tail quantiles is only sharp when both are measured on the **same tokens**: token-to-token
variation (confident vs uncertain positions, long vs short completions) is then shared and
cancels in a paired resample. So the primary measurement is:

1. **Shared tokens.** Rollouts are generated once, by the generating sampler (``--generate-path``,
   by default the floor's sampler, bf16), seeded, at temperature 1, in fixed batches.
2. Every sampler path reports its log-probs on those tokens by the same KV-cached decode,
   teacher-forced (:func:`libalign.models.teacher_forcing.replay_decode`); for the generating path this
   reproduces the generator's own log-probs (checked and reported).
3. Every learner path scores those tokens teacher-forced.
4. Every condition therefore has δ on identical tokens, and ``stat(condition) − stat(floor)``
   gets a paired **cluster** bootstrap interval (whole sequences resampled, the same draw for
   both, because tokens of a sequence share a context and are not independent).

Because the tokens were drawn by the generating sampler, k3 is an unbiased KL estimate only for
conditions whose sampler is that path; for the others it is a discrepancy index.

**On-policy check** (``--on-policy``, default on): each sampler path also generates its own
rollouts (same prompts and seed) and the learner paths score those. These δ are what an RL run
on that sampler would see; they get per-condition cluster-bootstrap intervals but no paired
comparison (the token sets differ), and they show whether sampling on an NVFP4 path changes the
picture the shared tokens give.

With ``kv_formats``, the KV cache's share of the gap is measured on the shared tokens too: δ of
the aligned pair with the sampler's FP4 K/V against BF16 K/V, paired, with KV guidance off and
on (:mod:`alignd.tools.diagnose.kv`).

Then the localization (per layer, FC1/FC2, routing, routing-conditioned), the decoder-layer 2×2
replay and the context-swap check (:mod:`alignd.tools.diagnose.localize`) run on (a subset of) the
shared sequences, and the paper's 2×2 replay at the MoE entry, per prompt with the learner's
expert assignments fixed (:mod:`alignd.tools.diagnose.replay`), on the first
``moe_replay_prompts`` of them.

Everything the run decides is in ``report.json``: configuration, model, versions, every statistic
with its interval, and the seconds each stage took.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from alignclient.errors import ConfigError, InputError

import libalign
from alignd.tools.diagnose import context_swap as fc1_swap
from alignd.tools.diagnose import decode_localize, guided, inputs, localize, render, sides, stats
from alignd.tools.diagnose import kv as kv_diag
from alignd.tools.diagnose import replay as moe_entry
from alignd.tools.diagnose import routing as routing_diag
from alignd.tools.diagnose import strict as strict_diag
from alignd.tools.diagnose.conditions import (
    EXTERNAL,
    PAIR_SETS,
    Condition,
    check_path,
    parse_layers,
    paths_of,
    resolve_conditions,
)
from libalign import models
from libalign.models import strict as strict_mode
from libalign.models.routing_replay import capture_routing
from libalign.models.teacher_forcing import replay_decode
from libalign.spec.rounding import GUIDE_BITS

MODELS = ("tiny", "tiny-random", "qwen3-30b-a3b-shaped")


@dataclass
class DiagnoseConfig:
    """Every option of a diagnosis run (the CLI maps its flags one to one)."""

    model: str = "tiny"
    checkpoint: str | None = None
    num_layers: int = 2
    prompts_file: str | None = None
    sequences_file: str | None = None
    num_prompts: int = 2048
    prompt_len: int = 32
    max_new_tokens: int | None = None
    temperature: float = 1.0
    batch_size: int = 64
    conditions: str | None = None
    pairs: str = "papers"
    """the named default set when no condition is given (:data:`conditions.PAIR_SETS`)"""
    learner_paths: str | None = None
    sampler_paths: str | None = None
    floor: str = "bf16/bf16"
    generate_path: str | None = None
    on_policy: bool = True
    layers: str = "all"
    replay_layers: str = "0,-1"
    moe_replay_prompts: int = 12
    """prompts of the 2×2 replay at the MoE entry (:mod:`alignd.tools.diagnose.replay`)"""
    moe_replay_sampler: str = "decode"
    """where that replay's sampler input comes from: the sampler's ``decode`` or ``forward``"""
    conditioned: bool = True
    localize_sequences: int = 256
    context_swap: bool = True
    clip_low: float = 0.8
    clip_high: float = 1.28
    tis_cap: float = 2.0
    n_boot: int = 1000
    level: float = 0.95
    trace_bits: int = 1
    trace_layers: int | None = None
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    threads: int | None = None
    cache_dir: str | None = None
    strict: bool = False
    """strict execution on both sides (:mod:`alignd.tools.diagnose.strict`)"""
    kv_formats: str | None = None
    """FP4 KV formats whose share of the gap is measured (:mod:`alignd.tools.diagnose.kv`)"""


class Reporter:
    """Progress hooks; the default does nothing. ``task`` returns an ``advance(n)`` callable."""

    def task(self, description: str, total: int) -> Callable[[int], None]:
        return lambda n: None


@dataclass
class LoadedModel:
    """A model and what the run needs to know about its tokens."""

    model: torch.nn.Module
    name: str
    vocab_size: int
    eos_id: int | list[int] | None
    pad_id: int
    encode: Callable[[str], list[int]] | None = None
    default_prompts: Callable[[int, int], list[list[int]]] | None = None
    default_max_new_tokens: int = 32
    source: str = ""


def _check_config(cfg: DiagnoseConfig) -> None:
    if cfg.model not in MODELS:
        raise InputError(f"unknown --model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    # path names first, so a typo fails before any model is loaded
    conds, _ = resolve_conditions(cfg.conditions, cfg.learner_paths, cfg.sampler_paths,
                                  floor=cfg.floor, external=cfg.sequences_file is not None,
                                  pairs=cfg.pairs)
    guided.check_guided(conds)
    kv_diag.parse_formats(cfg.kv_formats)
    if cfg.strict:
        strict_diag.check(conds, cfg.generate_path)
    if cfg.trace_bits not in GUIDE_BITS:
        raise InputError(f"--trace-bits must be one of {GUIDE_BITS}, got {cfg.trace_bits}")
    if cfg.trace_layers is not None and cfg.trace_layers < 1:
        raise InputError(f"--trace-layers must be at least 1, got {cfg.trace_layers}")
    if cfg.generate_path:
        check_path(cfg.generate_path, "--generate-path")
    for name, v, lo in (("--num-prompts", cfg.num_prompts, 2), ("--batch-size", cfg.batch_size, 1),
                        ("--n-boot", cfg.n_boot, 1), ("--num-layers", cfg.num_layers, 1),
                        ("--prompt-len", cfg.prompt_len, 1),
                        ("--localize-sequences", cfg.localize_sequences, 1),
                        ("--moe-replay-prompts", cfg.moe_replay_prompts, 1),
                        ("--threads", 1 if cfg.threads is None else cfg.threads, 1)):
        if v < lo:
            raise InputError(f"{name} must be at least {lo}, got {v}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {cfg.max_new_tokens}")
    if not 0 < cfg.clip_low < 1 < cfg.clip_high:
        raise InputError(f"clip bounds must satisfy 0 < low < 1 < high, got ({cfg.clip_low}, "
                         f"{cfg.clip_high})")
    if not cfg.tis_cap > 0:
        raise InputError(f"--tis-cap must be positive, got {cfg.tis_cap}")
    if not 0 < cfg.level < 1:
        raise InputError(f"--level must be in (0, 1), got {cfg.level}")
    if cfg.temperature <= 0:
        raise InputError(f"--temperature must be positive, got {cfg.temperature}")
    if cfg.moe_replay_sampler not in moe_entry.SAMPLER_SIDES:
        raise InputError(f"--moe-replay-sampler must be one of {', '.join(moe_entry.SAMPLER_SIDES)}, "
                         f"got {cfg.moe_replay_sampler!r}")
    if cfg.prompts_file and cfg.sequences_file:
        raise InputError("give --prompts or --sequences, not both")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {cfg.device}: CUDA is not available on this machine")


# --- the model --------------------------------------------------------------------------------

def load_model(cfg: DiagnoseConfig) -> LoadedModel:
    """The model the configuration names, on its device, in bf16 and eval mode."""
    if cfg.checkpoint:
        return _load_checkpoint(Path(cfg.checkpoint), cfg.device)
    if cfg.model == "tiny":
        model, task = models.trained_tiny_model(cache_dir=cfg.cache_dir, device=cfg.device)
    elif cfg.model == "tiny-random":
        task = models.SyntheticTask()
        model = models.build_model(models.tiny_config(), seed=cfg.seed, device=cfg.device)
    else:
        conf = models.qwen3_30b_a3b_shaped_config(num_layers=cfg.num_layers)
        model = models.build_model(conf, seed=cfg.seed, device=cfg.device)
        return LoadedModel(model, f"qwen3-30b-a3b-shaped-{cfg.num_layers}L (random weights)",
                           conf.vocab_size, conf.eos_token_id, int(conf.pad_token_id or 0),
                           source="random init")
    return LoadedModel(model, "tiny (trained, synthetic addition)" if cfg.model == "tiny"
                       else "tiny (random weights)", task.vocab_size, task.eos_id, task.pad_id,
                       encode=task.encode,
                       default_prompts=lambda n, seed: task.prompts(n, seed),
                       default_max_new_tokens=task.max_completion_len,
                       source="libalign.models.trained_tiny_model" if cfg.model == "tiny" else "random init")


def _load_checkpoint(path: Path, device: str) -> LoadedModel:
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    if not (path / "config.json").is_file():
        raise InputError(f"--checkpoint {str(path)!r} is not a Hugging Face checkpoint directory "
                         "(no config.json)")
    try:
        model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    except (OSError, ValueError) as e:
        raise InputError(f"--checkpoint {str(path)!r} cannot be loaded as Qwen3-MoE: "
                         f"{' '.join(str(e).split())[:300]}") from None
    conf = model.config
    encode = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tok = AutoTokenizer.from_pretrained(path)
        encode = lambda text: tok(text, add_special_tokens=True)["input_ids"]  # noqa: E731
    pad = conf.pad_token_id
    if pad is None:
        eos = conf.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) or 0
    return LoadedModel(model, path.name, int(conf.vocab_size), conf.eos_token_id, int(pad),
                       encode=encode, source=str(path))


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


# --- the run ----------------------------------------------------------------------------------

class _Clock:
    """Wall seconds per stage (summed when a stage repeats); waits for the GPU at both ends."""

    def __init__(self, device: str):
        self.seconds: dict[str, float] = {}
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()

    @contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _versions() -> dict:
    import transformers

    return {"libalign": libalign.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def _environment(cfg: DiagnoseConfig) -> dict:
    env = {"device": cfg.device, "threads": torch.get_num_threads(), **_versions()}
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(cfg.device))
    return env


def _model_info(lm: LoadedModel) -> dict:
    c = lm.model.config
    return {"name": lm.name, "source": lm.source, "num_layers": int(c.num_hidden_layers),
            "moe_layers": models.moe_layer_indices(lm.model), "num_experts": int(c.num_experts),
            "top_k": int(c.num_experts_per_tok), "hidden_size": int(c.hidden_size),
            "moe_intermediate_size": int(c.moe_intermediate_size), "vocab_size": lm.vocab_size,
            "parameters": sum(p.numel() for p in lm.model.parameters()),
            "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", "")}


def _max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, bool]:
    m = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
            for x, y in zip(a, b, strict=True))
    return m, all(torch.equal(x.float(), y.float()) for x, y in zip(a, b, strict=True))


def _threads(cfg: DiagnoseConfig) -> int | None:
    """Intra-op CPU threads for the run: ``cfg.threads``, else 1 for the tiny models on the CPU
    (their matrices are too small to gain from more, and spinning OpenMP workers on shared cores
    slow every small operation down), else PyTorch's default."""
    if cfg.threads is not None:
        return cfg.threads
    if cfg.device == "cpu" and cfg.model.startswith("tiny") and not cfg.checkpoint:
        return 1
    return None


@contextmanager
def _capture_if(model, wanted: bool, layers: list[int], sampler: str):
    """Guidance capture around a sampler stage when ``wanted``; yields the capture or None."""
    if not wanted:
        yield None
        return
    with models.capture_guidance(model, layers, guided.capture_spec(sampler)) as cap:
        yield cap


def run_diagnosis(cfg: DiagnoseConfig, reporter: Reporter | None = None) -> dict:
    """Run every stage the configuration asks for and return the report dict (no files written)."""
    cfg = strict_diag.prepare(cfg)
    _check_config(cfg)
    with models.cpu_threads(_threads(cfg)):
        return _run(cfg, reporter or Reporter())


def _run(cfg: DiagnoseConfig, rep: Reporter) -> dict:
    clock = _Clock(cfg.device)
    t_start = time.perf_counter()
    opts = stats.StatOptions(cfg.clip_low, cfg.clip_high, cfg.tis_cap, cfg.n_boot, cfg.level, cfg.seed)

    with clock.stage("load_model"):
        lm = load_model(cfg)
    model = lm.model
    if cfg.strict:
        strict_mode.enable(model)
    n_layers = int(model.config.num_hidden_layers)
    layers = parse_layers(cfg.layers, n_layers, "--layers")
    replay_layers = parse_layers(cfg.replay_layers, n_layers, "--replay-layers")

    seqfile = None
    if cfg.sequences_file:
        seqfile = inputs.load_sequences(Path(cfg.sequences_file), vocab_size=lm.vocab_size)
    external = seqfile is not None and seqfile.sampler_logprobs is not None
    conds, floor = resolve_conditions(cfg.conditions, cfg.learner_paths, cfg.sampler_paths,
                                      floor=cfg.floor, external=external, pairs=cfg.pairs)
    gen_path = check_path(cfg.generate_path or floor.sampler, "--generate-path")
    learners = paths_of(conds, "learner")
    samplers = paths_of(conds, "sampler")
    recorders = paths_of(guided.guided_conditions(conds), "sampler")  # samplers that record
    trace_layers = guided.recording_layers(model, cfg.trace_layers) if recorders else []
    max_new = cfg.max_new_tokens or lm.default_max_new_tokens
    # quantize every path's expert weights once, up front, so that no stage below pays for it
    for p in dict.fromkeys(learners + samplers):
        with clock.stage(f"prepare_weights[{p}]"):
            for layer in models.moe_layer_indices(model):
                models.prepared_weights(models.experts_module(model, layer), p)
    common = dict(batch_size=cfg.batch_size, pad_id=lm.pad_id, backend=cfg.backend)

    # --- the shared sequences ---
    rollouts: dict[str, models.GenerationResult] = {}
    on_policy_guidance: dict[str, guided.Guidance] = {}
    if seqfile is None:
        if cfg.prompts_file:
            prompts = inputs.load_prompts(Path(cfg.prompts_file), encode=lm.encode,
                                          vocab_size=lm.vocab_size)
            prompt_source = cfg.prompts_file
        elif lm.default_prompts is not None:
            prompts = lm.default_prompts(cfg.num_prompts, cfg.seed)
            prompt_source = "task prompts (held-out split)"
        else:
            prompts = _random_prompts(cfg.num_prompts, cfg.prompt_len, lm.vocab_size, cfg.seed)
            prompt_source = f"random token ids (length {cfg.prompt_len})"
        gen_paths = [gen_path] + ([p for p in samplers if p != gen_path] if cfg.on_policy else [])
        for p in gen_paths:
            with clock.stage(f"generate[{p}]"), _capture_if(
                    model, p in recorders and p != gen_path, trace_layers, p) as cap:
                rollouts[p] = sides.sample(model, prompts, p, max_new_tokens=max_new,
                                           temperature=cfg.temperature, seed=cfg.seed,
                                           eos_id=lm.eos_id, progress=rep.task(f"sample {p}", len(prompts)),
                                           **common)
            if cap is not None:
                on_policy_guidance[p] = guided.Guidance(cap, cfg.trace_bits, trace_layers,
                                                        lm.model.device)
            inputs.check_same_tokens(f"rollouts of {p}", [s[:n] for s, n in zip(
                rollouts[p].sequences, rollouts[p].prompt_lens, strict=True)], prompts,
                rollouts[p].prompt_lens, [len(x) for x in prompts])
        g = rollouts[gen_path]
        shared = inputs.SequenceSet(g.sequences, g.prompt_lens, [t.tolist() for t in g.logprobs],
                                    source=f"generated by {gen_path}")
    else:
        shared = seqfile
        prompt_source = cfg.sequences_file
        gen_path = EXTERNAL if external else "file"
    inputs.validate_sequences(shared, lm.vocab_size)
    comp_lens = shared.completion_lens()

    # --- both sides on the shared tokens ---
    sampler_lp: dict[str, list[torch.Tensor]] = {}
    shared_guidance: dict[str, guided.Guidance] = {}
    route_caps = {}  # the sampler paths' routing on the shared tokens (routing replay rows)
    for p in samplers:
        with clock.stage(f"sampler_replay[{p}]"), _capture_if(
                model, p in recorders, trace_layers, p) as cap, capture_routing(model) as rcap:
            sampler_lp[p] = replay_decode(model, shared.tokens, shared.prompt_lens, p,
                                          progress=rep.task(f"replay decode {p}", len(shared)),
                                          **common)
        route_caps[p] = rcap
        if cap is not None:
            with clock.stage(f"guidance_records[{p}]"):
                shared_guidance[p] = guided.Guidance(cap, cfg.trace_bits, trace_layers,
                                                     lm.model.device)
        inputs.check_side_logprobs(f"sampler {p}", "sampler", sampler_lp[p], comp_lens)
    if external:
        sampler_lp[EXTERNAL] = [torch.tensor(v, dtype=torch.float32) for v in shared.sampler_logprobs]
    consistency = None
    if gen_path in rollouts and gen_path in sampler_lp:
        m, bitwise = _max_abs(sampler_lp[gen_path], rollouts[gen_path].logprobs)
        consistency = {"path": gen_path, "max_abs": m, "bitwise": bitwise}
    learner_lp: dict[str, list[torch.Tensor]] = {}
    for p in learners:
        if p == guided.GUIDED:
            continue
        with clock.stage(f"learner_score[{p}]"):
            learner_lp[p] = sides.score(model, shared.tokens, shared.prompt_lens, p,
                                        progress=rep.task(f"learner score {p}", len(shared)), **common)
        inputs.check_side_logprobs(f"learner {p}", "learner", learner_lp[p], comp_lens)
    guidance_report: dict[str, dict] = {}
    for c in guided.guided_conditions(conds):
        g = shared_guidance[c.sampler]
        with clock.stage(f"learner_score[{c.name}]"):
            learner_lp[c.name], agreement = guided.score_guided(
                model, shared.tokens, shared.prompt_lens, g,
                progress=rep.task(f"learner score {c.name}", len(shared)), **common)
        inputs.check_side_logprobs(f"learner {c.name}", "learner", learner_lp[c.name], comp_lens)
        guidance_report[c.sampler] = {**g.summary(), "agreement": agreement}

    def lkey(c: Condition) -> str:
        return c.name if c.learner == guided.GUIDED else c.learner

    # --- routing disagreement without and with routing replay (R3) ---
    routed = [c for c in conds if c.sampler in route_caps and c.learner != guided.GUIDED]
    with clock.stage("routing_replay"):
        routing_rows = routing_diag.routing_rows(
            model, shared.tokens, shared.prompt_lens, routed, route_caps, sampler_lp,
            progress=rep.task("routing replay", 2 * len(shared) * len(routed)), **common)

    # --- statistics ---
    with clock.stage("statistics"):
        deltas = {c.name: stats.deltas(learner_lp[lkey(c)], sampler_lp[c.sampler]) for c in conds}
        cond_rows = []
        for c in conds:
            s = stats.summarize(deltas[c.name], opts)
            if c != floor:
                s["vs_floor"] = stats.compare(deltas[c.name], deltas[floor.name], opts)
            cond_rows.append({"name": c.name, "learner": c.learner, "sampler": c.sampler, "shared": s})
        tails = {c.name: stats.abs_delta_ccdf(deltas[c.name]) for c in conds}

    # --- the KV cache's share, on the shared tokens ---
    kv_report = None
    if kv_diag.parse_formats(cfg.kv_formats):
        with clock.stage("kv_share"):
            kv_report = kv_diag.kv_share(
                model, shared.tokens, shared.prompt_lens, kv_diag.parse_formats(cfg.kv_formats),
                opts, bits=cfg.trace_bits, sampler_lp=sampler_lp.get(kv_diag.PAIR),
                learner_lp=learner_lp.get(kv_diag.PAIR), task=rep.task, **common)

    # --- on-policy ---
    if cfg.on_policy and rollouts:
        for row, c in zip(cond_rows, conds, strict=True):
            r = rollouts.get(c.sampler)
            if r is None:
                continue
            if c.sampler == gen_path:
                lp_l = learner_lp[lkey(c)]
            elif c.learner == guided.GUIDED:
                with clock.stage(f"on_policy_score[{c.name}]"):
                    lp_l, _ = guided.score_guided(
                        model, r.sequences, r.prompt_lens, on_policy_guidance[c.sampler],
                        progress=rep.task(f"on-policy score {c.name}", len(r.sequences)), **common)
            else:
                with clock.stage(f"on_policy_score[{c.name}]"):
                    lp_l = sides.score(model, r.sequences, r.prompt_lens, c.learner,
                                       progress=rep.task(f"on-policy score {c.name}", len(r.sequences)),
                                       **common)
            lens = [len(s) - p for s, p in zip(r.sequences, r.prompt_lens, strict=True)]
            inputs.check_side_logprobs(f"{c.name} on-policy", "learner", lp_l, lens)
            inputs.check_side_logprobs(f"{c.name} on-policy", "sampler", r.logprobs, lens)
            with clock.stage("statistics"):
                s = stats.summarize(stats.deltas(lp_l, r.logprobs), opts)
            s["completion_tokens"] = sum(lens)
            s["eos_fraction"] = sum(r.finished) / len(r.finished) if r.finished else None
            row["on_policy"] = s

    # --- localization and replay ---
    sub = min(len(shared), cfg.localize_sequences)
    loc_seqs = shared.tokens[:sub]
    # a guided learner needs records for the exact forwards it runs; localization's own
    # forwards carry none, so guided conditions are left out of it (and said so)
    internal = [c for c in conds if c.sampler != EXTERNAL and c.learner != guided.GUIDED]
    layer_rows, replay_rows, skipped = [], [], []
    if (layers or replay_layers) and internal:
        with clock.stage("localization"):
            layer_rows, replay_rows, skipped = localize.localize(
                model, loc_seqs, internal, layers=layers, replay_layers=replay_layers,
                conditioned=cfg.conditioned, progress=rep.task("localize layers", sub), **common)

    # --- the 2×2 replay at the MoE entry, per prompt ---
    moe_rows, moe_skipped = [], []
    n_replay = min(len(shared), cfg.moe_replay_prompts)
    # TRACE conditions replay with their sampler's records on the shared tokens (ids 0..n-1)
    replayed = [c for c in conds if c.sampler != EXTERNAL]
    records = {c.name: shared_guidance[c.sampler].table for c in guided.guided_conditions(conds)
               if c.sampler in shared_guidance}
    if replay_layers and replayed:
        with clock.stage("moe_replay"):
            moe_rows, moe_skipped = moe_entry.moe_replay(
                model, shared.tokens[:n_replay], replayed, layers=replay_layers,
                prompt_lens=shared.prompt_lens[:n_replay], sampler_side=cfg.moe_replay_sampler,
                guidance=records,
                progress=rep.task("2x2 replay at the MoE entry", len(replayed) * len(replay_layers)),
                **common)

    # --- localization against the sampler's own KV-cached decode (same-path pairs included) ---
    decode_rows, n_dec = [], min(sub, 12)
    if layers and internal:
        with clock.stage("decode_localization"):
            decode_rows = decode_localize.localize_decode(
                model, loc_seqs[:n_dec], shared.prompt_lens[:n_dec], internal, layers=layers,
                pad_id=lm.pad_id, backend=cfg.backend)

    # --- context swap ---
    ctx = fc1_ctx = None
    if cfg.context_swap and len(shared) >= 3:
        with clock.stage("context_swap"):
            ctx = localize.context_swap_check(model, shared.tokens[:max(sub, 3)],
                                              shared.prompt_lens[:max(sub, 3)],
                                              [p for p in dict.fromkeys(learners + samplers)
                                               if p != guided.GUIDED], **common)
            fc1_ctx = fc1_swap.fc1_context_swap(
                model, shared.tokens[:max(sub, 3)],
                [p for p in dict.fromkeys(learners + samplers) if p != guided.GUIDED], **common)

    clock.seconds["total"] = time.perf_counter() - t_start
    cfg_dict = asdict(cfg)
    cfg_dict.update(max_new_tokens_used=max_new, generate_path_used=gen_path)
    return {
        "tool": "alignd diagnose",
        "created_unix": time.time(),
        "config": cfg_dict,
        "model": _model_info(lm),
        "environment": _environment(cfg),
        "floor": floor.name,
        "pairs": {"set": cfg.pairs, "defaults": list(PAIR_SETS[cfg.pairs]),
                  "from_defaults": not (cfg.conditions or cfg.learner_paths or cfg.sampler_paths)},
        "conditions": cond_rows,
        "sequences": {"count": len(shared), "completion_tokens": shared.completion_tokens,
                      "prompt_source": prompt_source, "generated_by": gen_path,
                      "replay_consistency": consistency,
                      "eos_fraction": (sum(rollouts[gen_path].finished) / len(shared)
                                       if gen_path in rollouts else None)},
        "tails": tails,
        "layers": layer_rows,
        "replay": replay_rows,
        "localization": {"sequences": sub if layer_rows or replay_rows else 0,
                         "layers": layers, "replay_layers": replay_layers,
                         "skipped_same_path": skipped,
                         "skipped_guided": [c.name for c in guided.guided_conditions(conds)]},
        "moe_replay": {"prompts": n_replay if moe_rows else 0, "layers": replay_layers,
                       "sampler_side": cfg.moe_replay_sampler,
                       "rows": moe_rows, "skipped_same_path": moe_skipped,
                       "skipped_guided": [c.name for c in guided.guided_conditions(conds)]},
        "guidance": ({"bits": cfg.trace_bits, "layers": trace_layers, "by_sampler": guidance_report}
                     if guidance_report else None),
        "decode_localization": {"sequences": n_dec if decode_rows else 0, "rows": decode_rows},
        "context_swap": ctx,
        "fc1_context_swap": fc1_ctx,
        "routing_replay": {"rows": routing_rows,
                           "skipped": [c.name for c in conds if c not in routed]},
        "strict": strict_diag.summary(conds, deltas) if cfg.strict else None,
        "kv": kv_report,
        "timings_seconds": {k: round(v, 3) for k, v in clock.seconds.items()},
    }


def write_outputs(report: dict, out_dir: Path) -> dict:
    """``report.json`` and the PNGs into ``out_dir`` (created); returns ``{name: path}``."""
    from alignd.tools.diagnose import plots  # matplotlib: the demo extra, only when drawing

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    made = {p.stem: str(p) for p in plots.write_plots(report, out_dir)}
    report["timings_seconds"]["plots"] = round(time.perf_counter() - t0, 3)
    made["report"] = str(out_dir / "report.json")
    report["outputs"] = made
    tmp = out_dir / "report.json.tmp"
    tmp.write_text(render.to_json(report) + "\n", encoding="utf-8")
    tmp.replace(out_dir / "report.json")
    return made


def conditions_of(report: dict) -> list[Condition]:
    """The conditions a report holds, as :class:`Condition` objects."""
    return [Condition(c["learner"], c["sampler"]) for c in report["conditions"]]
