"""``alignd``: the command line of the libalign daemon."""

from __future__ import annotations

import json

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
                "scales != minite", "ref GB/s"):
        t.add_column(col, justify="right")
    for r in report:
        t.add_row(r.preset, f"{r.bytes_in / 1e6:.2f}", f"{r.bytes_out / 1e6:.2f}",
                  f"{r.rel_l2:.4f}", f"{r.max_abs_err:.2e}", f"{100 * r.codes_vs_minite:.2f}%",
                  f"{100 * r.scales_vs_minite:.2f}%", f"{r.gbps:.3f}")
    console.print(t)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()
