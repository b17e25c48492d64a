"""``alignd``: the command line of the libalign daemon."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Annotated

import typer
from alignclient import AlignClient
from alignclient.errors import AlignError, ConfigError
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from alignd.formats.export import convert_checkpoint
from alignd.infra.service_main import run_service
from alignd.infra.settings import TRACE_PAPER_DEFAULTS, AllInOneSettings, ApiAddress, ApiSettings
from alignd.infra.telemetry import Metrics
from libalign.atomic_dir import DestinationExistsError
from libalign.guidance.sizes import size_for_config, trace_dims, trace_reference_size
from libalign.kernels import backends
from libalign.kernels import config as kernel_config
from libalign.selfcheck import run_selfcheck
from libalign.spec import PRESETS

app = typer.Typer(add_completion=False, help="libalign: learner-sampler alignment for NVFP4 RL.")
console = Console()
log = logging.getLogger("alignd")


@app.callback()
def _edge() -> None:
    """Read the kernels' configuration (ALIGN_KERNELS, ALIGN_CPU_KERNEL, ...) from the
    environment once, as every command starts."""
    try:
        kernel_config.configure(kernel_config.from_env())
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _selfcheck_table() -> bool:
    results = run_selfcheck()
    t = Table(title="NVFP4 spec self-check")
    for col in ("check", "result", "detail"):
        t.add_column(col)
    for r in results:
        t.add_row(r.name, "[green]pass[/]" if r.passed else "[red]FAIL[/]", r.detail)
    console.print(t)
    return all(r.passed for r in results)


def _backends_table() -> None:
    """Which quantize implementation serves each device: a compiled kernel, or the spec and why."""
    with warnings.catch_warnings():  # a fallback is shown in the table, with its reason
        warnings.simplefilter("ignore", RuntimeWarning)
        served = backends()
    t = Table(title="quantize kernels (libalign.kernels.backends)")
    for col in ("device", "backend", "why"):
        t.add_column(col)
    for b in served.values():
        shown = "[yellow]spec (fallback)[/]" if b.fallback else f"[green]{b.backend} kernel[/]"
        t.add_row(b.device, shown, b.reason)
    console.print(t)


@app.command()
def selfcheck() -> None:
    """Verify the format tables, rounding, layouts and row scaling; show each device's kernel."""
    passed = _selfcheck_table()
    _backends_table()
    raise typer.Exit(0 if passed else 1)


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="print the specs as JSON")) -> None:
    """List the numerics presets and every choice each one makes."""
    if as_json:
        console.print_json(json.dumps({k: v.to_dict() for k, v in PRESETS.items()}))
        return
    fields = [f for f in next(iter(PRESETS.values())).to_dict() if f not in ("name", "hadamard_signs")]
    t = Table(title="numerics presets")
    t.add_column("field")
    for name in PRESETS:
        t.add_column(name)
    for f in fields:
        t.add_row(f, *[str(PRESETS[n].to_dict()[f]) for n in PRESETS])
    console.print(t)


@app.command("guidance-size")
def guidance_size(
    config: Annotated[Path | None, typer.Option(
        "--config", help="a Hugging Face config.json (or its checkpoint directory); default: "
        "Qwen3-30B-A3B's shapes (48 layers)")] = None,
    last_layers: int | None = typer.Option(None, help="record only the last N MoE layers"),
    trace_paper: bool = typer.Option(False, "--trace-paper", help="the TRACE paper's run: the "
                                     "latter half of the MoE layers (unless --last-layers) and "
                                     "routing ids (unless --routing)"),
    sites: str = typer.Option("fc1,fc2", help="captured sites: fc1, fc2 or both"),
    kv: bool = typer.Option(False, "--kv/--no-kv", help="also count K and V (sites k, v of an "
                            "FP4 KV cache)"),
    kv_format: str = typer.Option("kv_nvfp4", help="the KV cache's format: kv_nvfp4 (a block "
                                  "scale per 16 values) or kv_mxfp4 (per 32)"),
    routing: str = typer.Option("none", help="also count routing replay (R3) records of every "
                                "MoE layer: none, ids (gate weights recomputed) or weights"),
    tokens: int = typer.Option(256 * 1024, help="tokens per trajectory, for the per-step total"),
    trajectories: int = typer.Option(4096, help="trajectories per RL step"),
) -> None:
    """Bytes of guidance records per token (and per RL step) for a model, at 1, 2 and 4 bits."""
    try:
        if config is None:
            # libalign.models needs transformers (the models extra)
            from libalign.models import qwen3_30b_a3b_shaped_config

            cfg, name = qwen3_30b_a3b_shaped_config(48), "Qwen3-30B-A3B shapes"
        else:
            path = config / "config.json" if config.is_dir() else config
            cfg, name = json.loads(path.read_text()), str(path)
        chosen = [s.strip() for s in sites.split(",") if s.strip()]
        if trace_paper:
            last_layers = "half" if last_layers is None else last_layers
            routing = "ids" if routing == "none" else routing
        replay = None if routing == "none" else routing
        rows = {b: size_for_config(cfg, bits=b, last_layers=last_layers, sites=chosen, kv=kv,
                                   kv_spec=kv_format, routing=replay) for b in (1, 2, 4)}
    except (AlignError, OSError, ValueError, KeyError, TypeError) as e:
        typer.echo(f"error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    kv_part = (f" + kv ({kv_format})" if kv else "") + \
        (f" + routing ({routing})" if replay else "")
    t = Table(title=f"guidance bytes per token: {name}, sites {','.join(chosen)}{kv_part}"
              f", layers {'all' if last_layers is None else f'last {last_layers}'}"
              f"{' (TRACE paper)' if trace_paper else ''}"
              f"; a step is {trajectories} trajectories x {tokens} tokens")
    for c in ("bits", "codes", "scales", "row scales", "index", "kv",
              *(("routing",) if replay else ()), "B/token", "TiB/step", "vs 4 bits"):
        t.add_column(c, justify="right")
    for b, r in rows.items():
        t.add_row(str(b), f"{r['code_bits']:.0f}", f"{r['block_scales']:.0f}",
                  f"{r['row_scales']:.0f}", f"{r['index']:.0f}", f"{r['kv']:.0f}",
                  *((f"{r['routing']:.0f}",) if replay else ()), f"{r['total']:.0f}",
                  f"{r['total'] * tokens * trajectories / 2**40:.2f}",
                  f"{r['total'] / rows[4]['total']:.3f}")
    console.print(t)
    for what, dims in (("the paper's 35B MoE", {"hidden": 2048, "kv_values": 256, "layers": 40}),
                       (name, trace_dims(cfg))):
        ref = trace_reference_size(4, tokens, trajectories, **dims)
        console.print(f"TRACE's accounting for {what} (D1 {dims['hidden']}, D2 "
                      f"{dims['kv_values']}, {dims['layers']} MoE layers, 4.5 bits a value): "
                      f"{ref['activation_bytes'] / 1024:.1f} KiB activations + "
                      f"{ref['kv_bytes'] / 1024:.2f} KiB KV = "
                      f"{ref['per_token_bytes'] / 1024:.1f} KiB per token, "
                      f"{ref['per_step_bytes'] / 2**40:.1f} TiB per step")


@app.command()
def demo(
    steps: int | None = typer.Option(None, help="RL steps per configuration and seed (default "
                                     "24; --full: 60)"),
    seeds: int | None = typer.Option(None, help="seeds per configuration; the table gives the "
                                     "mean with its 95 % interval over them (default 5)"),
    configs: str | None = typer.Option(None, help="configurations to run, comma-separated "
                                       "(default: bf16, nvfp4_naive, nvfp4_naive_notis, "
                                       "nvfp4_minite, nvfp4_trace; --full: every one)"),
    full: bool = typer.Option(False, "--full", help="the complete picture: every configuration, "
                              "more steps (about half an hour on 2 free cores)"),
    prompts_per_step: int | None = typer.Option(None, help="prompts per step (default 16)"),
    samples_per_prompt: int | None = typer.Option(None, help="rollouts per prompt, one GRPO "
                                                  "group (default 4)"),
    out: Annotated[Path, typer.Option("--out", help="directory for the report, figure and "
                                      "weight store")] = Path("align-demo"),
    api: bool = typer.Option(True, "--api/--no-api", help="serve the control API, /metrics and "
                             "the status page while the demo runs"),
    api_port: int = typer.Option(8000, help="port of the API (0: any free port)"),
    tis_cap: float | None = typer.Option(None, help="truncated importance sampling cap "
                                         "(default 2; TRACE uses 5)"),
    ppo_clip_eps: float | None = typer.Option(None, help="PPO policy-ratio clip epsilon, e.g. "
                                              "0.2 (default: no clipping)"),
    ppo_epochs: int = typer.Option(1, help="optimizer steps on each rollout batch"),
    max_version_diff: int | None = typer.Option(None, help="drop rollouts more than this many "
                                                "versions older than the learner (TRACE uses 3; "
                                                "default: no bound)"),
    trace_paper: bool = typer.Option(False, "--trace-paper", help="the TRACE paper's defaults "
                                     "for options left unset: TIS cap 5 (token level), "
                                     "max_version_diff 3"),
) -> None:
    """Main job on the embedded default: RL of the tiny MoE through the services, per
    configuration and seed."""
    # the demo runs the tiny model (transformers, the models extra) and plots (matplotlib)
    from alignd.tools.demo.report import summary_table
    from alignd.tools.demo.run import CONFIGS, DEFAULT_CONFIGS, DEFAULT_RUN, FULL_RUN, DemoConfig, run_demo
    from alignd.tools.in_process import ApiThread
    from libalign.models import cpu_threads

    started = time.monotonic()
    if not _selfcheck_table():
        raise typer.Exit(1)
    profile = FULL_RUN if full else DEFAULT_RUN
    if trace_paper:
        tis_cap = TRACE_PAPER_DEFAULTS["tis_cap"] if tis_cap is None else tis_cap
        if max_version_diff is None:
            max_version_diff = TRACE_PAPER_DEFAULTS["max_version_diff"]
    tis_cap = 2.0 if tis_cap is None else tis_cap
    steps = profile["steps"] if steps is None else steps
    seeds = profile["seeds"] if seeds is None else seeds
    names = ([c.strip() for c in configs.split(",") if c.strip()] if configs is not None
             else list(CONFIGS if full else DEFAULT_CONFIGS))
    group = {k: v for k, v in (("prompts_per_step", prompts_per_step),
                               ("samples_per_prompt", samples_per_prompt)) if v is not None}
    cfg = DemoConfig(configs=tuple(names), steps=steps, seeds=seeds, **group, out_dir=out,
                     tis_cap=tis_cap, ppo_clip_eps=ppo_clip_eps, ppo_epochs=ppo_epochs,
                     max_version_diff=max_version_diff)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    tasks: dict[tuple[str, int], int] = {}

    def on_step(name, seed, r) -> None:
        if (name, seed) not in tasks:
            tasks[name, seed] = progress.add_task(f"{name:>17} seed {seed}", total=steps, info="")
        mean = sum(abs(x) for x in r.deltas) / max(1, len(r.deltas))
        progress.update(tasks[name, seed], advance=1,
                        info=f"reward {r.reward_mean:.3f}  mean|δ| {mean:.2e}")

    try:
        cfg.check()
        metrics = Metrics()
        api_settings = ApiSettings(store_dir=out / "store", dev_mode=True, api_port=api_port,
                                   max_version_diff=max_version_diff)
        with cpu_threads(1), ApiThread(api_settings, metrics, enabled=api) as url, progress:
            if url:
                console.print(f"status page {url}/  metrics {url}/metrics")
            elif api:
                console.print("[yellow]the API could not start (port taken?); continuing "
                              "without it[/]")
            report = run_demo(cfg, on_step=on_step, metrics=metrics)
    except (AlignError, OSError, ValidationError) as e:
        typer.echo(f"error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    Console(width=max(console.width, 230)).print(summary_table(report))
    for k, v in report["outputs"].items():
        console.print(f"{k}: {v}")
    wall = time.monotonic() - started
    console.print(f"wall time {int(wall // 60)} min {wall % 60:04.1f} s from the self-check on "
                  f"({len(names)} configuration(s) x {seeds} seed(s) x {steps} steps"
                  f"{', --full' if full else ''})")


SERVICES = ("api", "converter", "sampler", "learner")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    service: Annotated[str, typer.Argument(help="api, converter, sampler or learner")],
) -> None:
    """Run one service in this process (settings from ALIGN_* variables)."""
    if service not in SERVICES:
        typer.echo(f"error: unknown service {service!r}; choose one of {', '.join(SERVICES)}",
                   err=True)
        raise typer.Exit(2)
    # by name: each service needs only its own dependencies (the sampler: transformers)
    mod = importlib.import_module(f"alignd.{service}.main")
    argv = list(ctx.args)
    raise typer.Exit(mod.main(argv) if service == "learner" else mod.main())


@app.command()
def up(
    learner_steps: int = typer.Option(0, help="also run the embedded learner for N steps"),
    api: bool = typer.Option(True, "--api/--no-api", help="serve the control API"),
    trace_paper: bool = typer.Option(False, "--trace-paper", help="ALIGN_TRACE_PAPER=true: the "
                                     "TRACE paper's defaults for settings left unset"),
) -> None:
    """All services in one process (embedded Redis unless ALIGN_REDIS_URL is set) until Ctrl-C."""
    if trace_paper:  # the settings below are read from the environment
        os.environ["ALIGN_TRACE_PAPER"] = "true"
    # the sampler and the learner run the tiny model (transformers, the models extra)
    from alignd.infra.redis_clients import embedded_name
    from alignd.learner.service import build_loop
    from alignd.sampler.embedded import build_sampler
    from alignd.tools.in_process import ApiThread, ServiceThreads

    def run(settings: AllInOneSettings, stop: threading.Event) -> None:
        embedded = embedded_name(settings.redis_url) is not None
        if embedded:
            settings = settings.model_copy(update={"dev_mode": True})
        metrics = Metrics()
        engine, rollouts, guidance = build_sampler(settings, metrics=metrics)
        with ServiceThreads(settings, engine, rollouts=rollouts, guidance=guidance,
                            metrics=metrics, stop=stop), \
                ApiThread(settings, metrics, enabled=api) as url:
            console.print(f"alignd up: converter, sampler ({settings.sampler_path})"
                          + (f", API {url}" if url else "")
                          + (" on the embedded Redis" if embedded else ""))
            if learner_steps:
                loop = build_loop(settings, metrics=metrics)
                for step in range(learner_steps):
                    if stop.is_set():
                        break
                    r = loop.iteration(step)
                    console.print(f"step {r.step} {r.version_id}: reward {r.reward_mean:.3f}")
            while not stop.is_set():
                stop.wait(0.5)

    raise typer.Exit(run_service(log, AllInOneSettings, run))


@app.command()
def status(
    url: str | None = typer.Option(None, help="API base URL (default: ALIGN_API_URL or "
                                   "http://127.0.0.1:8000)"),
    as_json: bool = typer.Option(False, "--json", help="print the status JSON"),
    token: str | None = typer.Option(None, envvar=["ALIGN_READ_TOKEN", "ALIGN_API_TOKEN"],
                                     help="bearer token the API's reads need (default: "
                                     "ALIGN_READ_TOKEN, else ALIGN_API_TOKEN)"),
) -> None:
    """Versions, services and the current discrepancy, from a running API."""
    base = url or ApiAddress().resolved_api_url
    try:
        with AlignClient(base, token=token, retries=0, timeout=10) as client:
            st = client.get_status()
    except AlignError as e:
        typer.echo(f"error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(st.model_dump_json(indent=2))
        return
    console.print(f"[bold]libalign[/] at {base}: versions "
                  + ", ".join(f"{k} {v}" for k, v in st.versions_by_state.items() if v)
                  + f"; weight-version lag {st.weight_version_lag}")
    t = Table(title="services")
    for c in ("service", "name", "up", "age s", "state", "version"):
        t.add_column(c)
    for sv in st.services:
        t.add_row(sv.service, sv.name, "[green]up[/]" if sv.up else "[red]down[/]",
                  "—" if sv.age_s is None else f"{sv.age_s:.1f}", sv.state, sv.version)
    console.print(t)
    d = st.discrepancy.stats
    if d.count:
        console.print(f"discrepancy over the last {d.count} tokens: mean |δ| {d.mean_abs:.3g}, "
                      f"P99 |δ| {d.p99_abs:.3g}, max {d.max_abs:.3g}, clip potential "
                      f"{100 * (d.clip_potential or 0):.2f}%")
    g = st.guidance
    console.print(f"guidance store: {g.versions} versions, {g.rollouts} rollouts, "
                  f"{g.stored_bytes / 1e6:.1f} MB")


@app.command()
def config(
    as_list: bool = typer.Option(False, "--list", help="print the reference of every ALIGN_* "
                                 "variable as a Markdown table (docs/operations/settings.md)"),
) -> None:
    """The ALIGN_* settings: those set in this environment, or with --list all of them."""
    from alignd.tools.settings_table import markdown, rows

    if as_list:
        typer.echo(markdown(), nl=False)
        return
    known = {r["variable"].strip("`") for r in rows()}
    for var in sorted(v for v in os.environ if v in known):
        value = os.environ[var]
        if any(secret in var for secret in ("TOKEN", "KEY", "PASSWORD")):
            value = "***"
        value = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", value)  # a password inside a URL
        typer.echo(f"{var}={value}")


@app.command("redis-migrate")
def redis_migrate(
    source: Annotated[str, typer.Option("--from", help="Redis URL to copy from")],
    target: Annotated[str, typer.Option("--to", help="Redis URL to copy to (a cluster: "
                                        "redis+cluster://...)")],
    key_prefix: Annotated[str, typer.Option(help="the daemon's ALIGN_KEY_PREFIX")] = "libalign",
    skip_guidance: Annotated[bool, typer.Option(help="leave guidance records behind")] = False,
) -> None:
    """Copy the daemon's keys to another Redis in its key layout (one server -> cluster)."""
    from alignd.infra.redis_clients import client_for, redact_url
    from alignd.tools.redis_migrate import migrate

    src_settings = ApiSettings(redis_url=source, key_prefix=key_prefix)
    dst_settings = ApiSettings(redis_url=target, key_prefix=key_prefix)
    src = client_for(source, decode_responses=False, socket_timeout_s=30.0)
    dst = client_for(target, decode_responses=False, socket_timeout_s=30.0)
    try:
        done = migrate(src, dst, src_settings.key_prefix, dst_settings.key_prefix,
                       skip_guidance=skip_guidance)
    finally:
        src.close()
        dst.close()
    console.print(f"{redact_url(source)} {src_settings.key_prefix!r} -> {redact_url(target)} "
                  f"{dst_settings.key_prefix!r}: {done.copied} keys copied, {done.existing} "
                  f"already there (left alone), {done.left_out} guidance keys left out")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Run benchmarks from tests/bench (a source checkout): alignd bench [names] [-- options]."""
    try:
        from tests.bench.__main__ import main as bench_main
    except ImportError:
        typer.echo("error: the benchmarks live in tests/bench of a source checkout; run "
                   "alignd bench from its root", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(bench_main(list(ctx.args)))


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (safetensors)")],
    dst: Annotated[Path, typer.Argument(help="output directory; must not exist unless --overwrite")],
    preset: str = typer.Option("minite", help="numerics preset: minite, modelopt, "
                               "compressed_tensors, torchao, te, te_4over6, te_4over6_448, or "
                               "MXFP4 mxfp4, mxfp4_ceil, mxfp4_even, mxfp4_te (with --format "
                               "compressed-tensors)"),
    fmt: str = typer.Option("modelopt", "--format", help="modelopt or compressed-tensors"),
    all_linear: bool = typer.Option(False, "--all-linear", help="also every linear layer except "
                                    "embeddings, lm_head, norms and routers"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing DST"),
    device: str = typer.Option("cpu", help="device that quantizes (cpu, cuda); same bits"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar, no summary"),
) -> None:
    """Convert a checkpoint's expert weights to NVFP4 (or MXFP4) safetensors, atomically."""
    err = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}", style="cyan"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=err,
                   disable=quiet or not err.is_terminal, transient=True)
    task = bar.add_task("convert", total=None)

    def progress(done: int, total: int, what: str) -> None:
        bar.update(task, completed=done, total=total, description=what[-48:])

    try:
        with bar:
            result = convert_checkpoint(src, dst, preset=preset, fmt=fmt, all_linear=all_linear,
                                        overwrite=overwrite, device=device, progress=progress)
    except (AlignError, DestinationExistsError, OSError) as e:
        msg = " ".join(str(e).split())
        if isinstance(e, DestinationExistsError) and "--overwrite" not in msg:
            msg += " (pass --overwrite to replace it)"
        typer.echo(f"error: {type(e).__name__}: {msg}", err=True)
        raise typer.Exit(1) from None
    if not quiet:
        t = result.manifest["totals"]
        console.print(f"wrote {result.dst}: {t['tensors_converted']} tensors to FP4 "
                      f"({preset}, {fmt}), {t['bytes_in'] / 1e6:.1f} MB -> "
                      f"{t['bytes_out'] / 1e6:.1f} MB in "
                      f"{result.manifest['timings_seconds']['total']:.1f} s")


@app.command()
def diagnose(
    checkpoint: Annotated[Path | None, typer.Option(
        "--checkpoint", help="Hugging Face Qwen3-MoE checkpoint directory (tokenizer used if "
        "present)")] = None,
    model: str = typer.Option("tiny", help="built-in model when no --checkpoint: tiny (trained "
                              "on the synthetic task, cached), tiny-random, qwen3-30b-a3b-shaped"),
    num_layers: int = typer.Option(2, help="decoder layers of the qwen3-30b-a3b-shaped model"),
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", help="JSONL: {\"prompt\": text} or {\"tokens\": list of ids} per line")] = None,
    sequences: Annotated[Path | None, typer.Option(
        "--sequences", help="JSONL of pre-generated sequences: tokens, prompt_len, optional "
        "sampler_logprobs")] = None,
    num_prompts: int = typer.Option(2048, help="prompts drawn from the task (or random ids) when "
                                    "no file is given"),
    prompt_len: int = typer.Option(32, help="length of random-id prompts (models without a "
                                   "tokenizer or task)"),
    max_new_tokens: int | None = typer.Option(None, help="completion limit (default: the task's "
                                              "longest answer; 32 otherwise)"),
    batch_size: int = typer.Option(64, help="sequences per batch, the same on every path"),
    conditions: str | None = typer.Option(None, help="learner/sampler pairs, e.g. "
                                          "bf16/bf16,bf16/nvfp4_naive"),
    pairs: str = typer.Option("papers", help="default pair set when no condition is given: papers "
                              "(bf16 floor, nvfp4_te/nvfp4_modelopt_pertoken, miniTE, TRACE) or "
                              "libalign (the earlier bf16/nvfp4_naive set)"),
    learner_paths: str | None = typer.Option(None, help="comma list; crossed with --sampler-paths"),
    sampler_paths: str | None = typer.Option(None, help="comma list; crossed with --learner-paths"),
    floor: str = typer.Option("bf16/bf16", help="the cross-path floor every condition is compared to"),
    generate_path: str | None = typer.Option(None, help="sampler path that generates the shared "
                                             "tokens (default: the floor's sampler)"),
    on_policy: bool = typer.Option(True, "--on-policy/--no-on-policy", help="also generate on "
                                   "every sampler path and report δ on its own rollouts"),
    layers: str = typer.Option("all", help="layers to localize: all, none or e.g. 0,3"),
    replay_layers: str = typer.Option("0,-1", help="layers of the 2x2 replays (none to skip)"),
    moe_replay_prompts: int = typer.Option(12, help="prompts of the 2x2 replay at the MoE entry "
                                           "(per prompt, learner's expert assignments fixed)"),
    moe_replay_sampler: str = typer.Option("decode", help="that replay's sampler input: decode (the "
                                           "sampler's KV-cached decode; same-path pairs measured) "
                                           "or forward (its teacher-forced forward)"),
    conditioned: bool = typer.Option(True, "--conditioned/--no-conditioned",
                                     help="routing-conditioned FC1/FC2 variant"),
    localize_sequences: int = typer.Option(256, help="shared sequences used for localization, "
                                           "replay and the context swap"),
    context_swap: bool = typer.Option(True, "--context-swap/--no-context-swap",
                                      help="batch-composition check per path"),
    clip_low: float = typer.Option(0.8, help="lower clip bound of exp(δ)"),
    clip_high: float = typer.Option(1.28, help="upper clip bound of exp(δ)"),
    tis_cap: float = typer.Option(2.0, help="TIS truncation C"),
    n_boot: int = typer.Option(1000, help="bootstrap resamples"),
    level: float = typer.Option(0.95, help="confidence level"),
    trace_bits: int = typer.Option(1, help="bits a value kept in the sampler's guidance records "
                                   "(1, 2, 3 or 4) for nvfp4_trace conditions"),
    trace_layers: int | None = typer.Option(None, help="record only the last N MoE layers "
                                            "(default: all)"),
    seed: int = typer.Option(0, help="seed of prompts, sampling and bootstrap"),
    device: str = typer.Option("cpu", help="cpu or cuda[:N]"),
    backend: str = typer.Option("auto", help="W4A4 GEMM backend: auto, torch, reference, triton"),
    threads: int | None = typer.Option(None, help="CPU intra-op threads (default: 1 for the tiny "
                                       "models on the CPU, else PyTorch's default)"),
    out: Annotated[Path | None, typer.Option(
        "--out", help="directory for report.json and the PNGs")] = None,
    as_json: bool = typer.Option(False, "--json", help="print the report JSON only"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars"),
    strict: bool = typer.Option(False, "--strict", help="strict execution on both sides "
                                "(batch-invariant ops): a strict pair has δ = 0; default "
                                "conditions bf16/bf16,nvfp4_minite/nvfp4_minite"),
    kv_formats: str | None = typer.Option(None, help="FP4 KV formats (comma list, or all) whose "
                                          "share of δ is measured: nvfp4_minite with the "
                                          "sampler's FP4 K/V against bf16 K/V, KV guidance off "
                                          "and on (e.g. kv_sglang_nvfp4)"),
) -> None:
    """Measure and localize the learner-sampler execution gap (teacher-forced, frozen policy)."""
    # the diagnosis runs models (transformers, the models extra) and plots (matplotlib)
    from alignd.tools.diagnose import render
    from alignd.tools.diagnose.run import DiagnoseConfig, run_diagnosis, write_outputs

    cfg = DiagnoseConfig(
        model=model, checkpoint=None if checkpoint is None else str(checkpoint), num_layers=num_layers,
        prompts_file=None if prompts is None else str(prompts),
        sequences_file=None if sequences is None else str(sequences), num_prompts=num_prompts,
        prompt_len=prompt_len, max_new_tokens=max_new_tokens, batch_size=batch_size,
        conditions=conditions, pairs=pairs, learner_paths=learner_paths, sampler_paths=sampler_paths,
        floor=floor,
        generate_path=generate_path, on_policy=on_policy, layers=layers, replay_layers=replay_layers,
        moe_replay_prompts=moe_replay_prompts, moe_replay_sampler=moe_replay_sampler,
        conditioned=conditioned,
        localize_sequences=localize_sequences, context_swap=context_swap,
        clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap, n_boot=n_boot, level=level,
        trace_bits=trace_bits, trace_layers=trace_layers, seed=seed, device=device,
        backend=backend, threads=threads, strict=strict, kv_formats=kv_formats)
    err = Console(stderr=True)
    try:
        with _DiagnoseProgress(err, disable=quiet or as_json or not err.is_terminal) as progress:
            report = run_diagnosis(cfg, progress)
        if out is not None:
            write_outputs(report, out)
    except (AlignError, OSError) as e:
        typer.echo(f"error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(render.to_json(report))
        return
    render.render_report(report, Console(width=max(console.width, 170)))


class _DiagnoseProgress:
    """rich progress bars for the diagnosis stages (one bar per stage)."""

    def __init__(self, console: Console, disable: bool):
        self.bar = Progress(TextColumn("{task.description}", style="cyan"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                            disable=disable, transient=True)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def task(self, description: str, total: int):
        task_id = self.bar.add_task(description, total=total)
        return lambda n: self.bar.advance(task_id, n)


if __name__ == "__main__":
    app()
