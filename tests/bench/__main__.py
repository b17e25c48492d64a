"""Run the benchmark modules: ``python -m tests.bench [names...] [-- bench options]``.

Every ``tests/bench/bench_*.py`` module exposes ``main(argv)``. Without names all of them
run in alphabetical order; a name may be given with or without the ``bench_`` prefix
(``spec`` or ``bench_spec``). Arguments after ``--`` are passed to each module's
``main`` (``python -m tests.bench spec -- --quick``). The exit status is non-zero when a
module raises or returns a non-zero status, or a name matches no module.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover() -> list[str]:
    """Module names (without the ``bench_`` prefix) of every bench_*.py here, sorted."""
    return sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py"))


def _status(result: object) -> int:
    if result is None or result is True:
        return 0
    if isinstance(result, bool):
        return 1
    return result if isinstance(result, int) else 0


def run(names: list[str], bench_argv: list[str]) -> int:
    """Run the named benchmarks (all when ``names`` is empty); 0 when every one passed."""
    available = discover()
    wanted = [n.removeprefix("bench_").removesuffix(".py") for n in names] or available
    unknown = [n for n in wanted if n not in available]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}",
              file=sys.stderr)
        return 2
    failed: list[str] = []
    for name in wanted:
        print(f"== bench_{name} ==", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"{__package__ or 'tests.bench'}.bench_{name}")
            status = _status(module.main(list(bench_argv)))
        except SystemExit as exc:  # argparse errors, explicit sys.exit in a bench
            status = _status(exc.code) if exc.code is not None else 0
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
                status = 1
        except Exception:
            traceback.print_exc()
            status = 1
        took = time.perf_counter() - start
        verdict = "ok" if status == 0 else f"FAILED (status {status})"
        print(f"== bench_{name}: {verdict} in {took:.1f} s ==", flush=True)
        if status:
            failed.append(name)
    if failed:
        print(f"{len(failed)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\navailable:", ", ".join(discover()))
        return 0
    if "--" in argv:
        cut = argv.index("--")
        names, bench_argv = argv[:cut], argv[cut + 1 :]
    else:  # options without a `--` go to the benchmarks too
        names = [a for a in argv if not a.startswith("-")]
        bench_argv = [a for a in argv if a.startswith("-")]
    return run(names, bench_argv)


if __name__ == "__main__":
    sys.exit(main())
