"""The house rules, checked on the source tree: layers point down (the import-linter contracts in
pyproject.toml), no import loops, no private name used outside the module that defines it, no
module over the size a reader can hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("libalign", "alignd", "alignclient")
#: Where each import package's source lives in the repository.
SOURCE_DIRS = {"libalign": ROOT / "libalign", "alignd": ROOT / "services" / "alignd",
               "alignclient": ROOT / "clients" / "alignclient"}
#: A module holds one concept; this ceiling only catches one that grew into several (split it by
#: concept: never cut its explanations to fit).
MAX_MODULE_LINES = 800


def _modules() -> dict[str, Path]:
    """``dotted module name -> file`` for every module of the three packages."""
    out = {}
    for pkg, base in SOURCE_DIRS.items():
        for path in base.rglob("*.py"):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def test_import_contracts_are_kept():
    """Every import-linter contract in pyproject.toml holds (layers, core without web/Redis)."""
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "KEPT" in run.stdout and "BROKEN" not in run.stdout, run.stdout


def _strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm over the module graph: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
    return loops


def test_no_import_loops():
    """No two modules of the project import each other, directly or around a longer loop
    (imports inside functions count: a lazy import hides a loop, it does not remove it)."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    assert _strongly_connected(graph) == []


def test_loop_finder_finds_a_loop():
    """The loop check itself: a two-module loop and a three-module loop are both reported."""
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.a"), ("p.c", "p.d"), ("p.d", "p.e"), ("p.e", "p.c"),
                 ("p.f", "p.a")]:
        graph.add_import(importer=a, imported=b)
    assert sorted(_strongly_connected(graph)) == [["p.a", "p.b"], ["p.c", "p.d", "p.e"]]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    is_package = MODULES.get(module, Path()).name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_uses(module: str, source: str) -> list[str]:
    """``"line: what"`` for each private name of another project module this source uses."""
    tree = ast.parse(source)
    found = []
    bound: dict[str, str] = {}  # local name -> project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    bound[alias.asname or alias.name.split(".")[0]] = (alias.asname and alias.name) \
                        or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, node)
            if source_module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                target = f"{source_module}.{alias.name}"
                if target in MODULES:
                    bound[alias.asname or alias.name] = target
                    # a private module is its package's: siblings may import it
                    if _is_private(alias.name) and not module.startswith(source_module + "."):
                        found.append(f"{node.lineno}: imports private module {target}")
                elif _is_private(alias.name) and source_module != module:
                    found.append(f"{node.lineno}: imports {alias.name} from {source_module}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _is_private(node.attr)
                and f"{bound[node.value.id]}.{node.attr}" not in MODULES
                and bound[node.value.id] != module):
            found.append(f"{node.lineno}: uses {bound[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_used_outside_its_module():
    """``_name`` stays in the module that defines it: other modules use public names only."""
    offenders = {mod: uses for mod, path in sorted(MODULES.items())
                 if (uses := _private_uses(mod, path.read_text()))}
    assert offenders == {}


def test_private_use_check_sees_both_forms():
    """The check itself: ``from m import _x`` and ``m._x`` are found, a module's own are not."""
    src = "from libalign.spec import _hidden, quantize\nimport libalign.kernels as ops\nops._door()\n"
    assert _private_uses("alignd.x", src) == ["1: imports _hidden from libalign.spec",
                                              "3: uses libalign.kernels._door"]
    assert _private_uses("libalign.spec", "from libalign.spec import _hidden\n") == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_a_small_room(module):
    """No module outgrows one concept (a generous ceiling of 800 lines)."""
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{MODULES[module].relative_to(ROOT)}: {lines} lines"


def test_top_level_folders_are_the_product_cards():
    """The repository keeps its fixed top-level folders; packages live inside them."""
    for folder in ("services", "libalign", "csrc", "deploy", "tests", "clients"):
        assert (ROOT / folder).is_dir(), folder
    for name in ("docker-compose.yml", "pyproject.toml", "README.md"):
        assert (ROOT / name).is_file(), name
