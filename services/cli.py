"""``alignd``: the command line of the libalign daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from libalign.report import conversion_report, synthetic_experts
from libalign.selfcheck import run_selfcheck
from libalign.spec import PRESETS

app = typer.Typer(add_completion=False, help="libalign: learner-sampler alignment for NVFP4 RL.")
console = Console()


def _selfcheck_table() -> bool:
    results = run_selfcheck()
    t = Table(title="NVFP4 spec self-check")
    for col in ("check", "result", "detail"):
        t.add_column(col)
    for r in results:
        t.add_row(r.name, "[green]pass[/]" if r.passed else "[red]FAIL[/]", r.detail)
    console.print(t)
    return all(r.passed for r in results)


@app.command()
def selfcheck() -> None:
    """Verify the format tables, rounding, layouts and row-scaling guarantee."""
    raise typer.Exit(0 if _selfcheck_table() else 1)


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


@app.command()
def demo(
    experts: int = typer.Option(8, help="experts in the synthetic layer"),
    rows: int = typer.Option(384, help="output rows per expert"),
    k: int = typer.Option(512, help="input features (K)"),
) -> None:
    """Main job on the embedded default: spec self-check and a conversion report."""
    ok = _selfcheck_table()
    w = synthetic_experts(experts, rows, k)
    report = conversion_report(w)
    t = Table(title=f"conversion report: {experts} x {rows} x {k} BF16 experts")
    for col in ("preset", "MB in", "MB out", "rel L2", "max |err|", "codes != minite",
                "scales != minite", "ref GB/s", "fast path", "fast GB/s", "fast == ref"):
        t.add_column(col, justify="right")
    for r in report:
        t.add_row(r.preset, f"{r.bytes_in / 1e6:.2f}", f"{r.bytes_out / 1e6:.2f}",
                  f"{r.rel_l2:.4f}", f"{r.max_abs_err:.2e}", f"{100 * r.codes_vs_minite:.2f}%",
                  f"{100 * r.scales_vs_minite:.2f}%", f"{r.gbps:.3f}", r.backend,
                  f"{r.fast_gbps:.3f}",
                  "[green]bit-exact[/]" if r.fast_bit_exact else "[red]DIFFERS[/]")
    Console(width=max(console.width, 150)).print(t)
    raise typer.Exit(0 if ok and all(r.fast_bit_exact for r in report) else 1)


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (safetensors)")],
    dst: Annotated[Path, typer.Argument(help="output directory; must not exist unless --overwrite")],
    preset: str = typer.Option("minite", help="numerics preset: minite, modelopt, "
                               "compressed_tensors, torchao or te"),
    fmt: str = typer.Option("modelopt", "--format", help="modelopt or compressed-tensors"),
    all_linear: bool = typer.Option(False, "--all-linear", help="also every linear layer except "
                                    "embeddings, lm_head, norms and routers"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing DST"),
    device: str = typer.Option("cpu", help="device that quantizes (cpu, cuda); same bits"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar, no summary"),
) -> None:
    """Convert a checkpoint's expert weights to NVFP4 safetensors, atomically."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from libalign.errors import AlignError
    from services.common.atomic_dir import DestinationExistsError
    from services.converter.checkpoint_export import convert_checkpoint

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
        console.print(f"wrote {result.dst}: {t['tensors_converted']} tensors to NVFP4 "
                      f"({preset}, {fmt}), {t['bytes_in'] / 1e6:.1f} MB -> "
                      f"{t['bytes_out'] / 1e6:.1f} MB in "
                      f"{result.manifest['timings_seconds']['total']:.1f} s")


if __name__ == "__main__":
    app()
