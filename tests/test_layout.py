"""The package's layout: folders by role, on floors, imports only running down.

Data flows one way (README, "How it is built"): the model at the bottom, the
host's files and nvidia-smi's parsers on it, the read paths, engines and pods
above them, then the config, the metrics and the web. A module may import its
own package and any package on a lower floor, never one on its own floor or
above; and no two modules import each other, directly or round a loop.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "src" / "mig_exporter"

# The floors, lowest first. The package root (``__init__``: the version) is on the ground floor;
# the commands that put everything together are on the top one.
FLOORS: dict[str, int] = {
    "": 0,
    "core": 0,
    "model": 1,
    "capacity_rules": 1,
    "prometheus_api": 1,
    "host": 2,
    "nvidia_smi": 2,
    "engines": 3,
    "kubernetes": 3,
    "sources": 3,
    "config": 4,
    "metrics": 5,
    "web": 6,
    "doctor": 7,
    "status": 7,
    "fleet": 7,
    "cli": 8,
    "__main__": 9,
}


def _modules() -> dict[str, Path]:
    """Every module, by its dotted name under ``mig_exporter``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: a relative import; the package imports itself by its full name")
        else:
            continue
        for name in names:
            if name == "mig_exporter" or name.startswith("mig_exporter."):
                dotted = name.removeprefix("mig_exporter").removeprefix(".")
                if dotted in modules:
                    out.add(dotted)
    return out


def _floor_of(module: str) -> tuple[str, int]:
    package = module.split(".")[0] if "." in module else module
    if package not in FLOORS:
        package = ""  # a module at the root, other than the commands: not allowed (below)
    return package, FLOORS[package]


MODULES = _modules()
GRAPH = {m: _imports(p, MODULES) - {m} for m, p in MODULES.items()}


def test_every_module_lives_in_a_package_on_a_floor():
    stray = [m for m in MODULES if "." not in m and m and m not in FLOORS]
    assert not stray, f"modules outside the packages: {stray}"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == {p for p in FLOORS if p and not (PACKAGE / f"{p}.py").exists()}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        package, floor = _floor_of(module)
        for target in imported:
            target_package, target_floor = _floor_of(target)
            if target_package != package and target_floor >= floor:
                wrong.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
    return sorted(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_no_import_runs_up_or_sideways():
    assert not _upward(GRAPH), "\n".join(_upward(GRAPH))


def test_no_import_cycle():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The model importing the web is caught; so is a loop inside one package."""
    upward = {**GRAPH, "model.snapshot": {*GRAPH["model.snapshot"], "web.server"}}
    assert _upward(upward) == ["model.snapshot (floor 1) imports web.server (floor 6)"]
    loop = {**GRAPH, "model.snapshot": {*GRAPH["model.snapshot"], "model.placement"}}
    assert _cycle(loop) in (["model.placement", "model.snapshot", "model.placement"],
                            ["model.snapshot", "model.placement", "model.snapshot"])


@pytest.mark.parametrize("package", sorted(p for p in FLOORS if p and (PACKAGE / p).is_dir()))
def test_each_package_says_what_lives_in_it(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"{package}/__init__.py has no docstring saying what lives there"


def test_the_readme_tree_is_the_package():
    """The README's tree names every folder and module, and nothing else: a
    folder is a line ``name/`` at the left, its modules the ``name.py`` lines
    indented under it; the commands' modules are at the left too."""
    readme = (REPO / "README.md").read_text()
    tree = readme.split("## How it is built", 1)[1].split("```", 2)[1]
    shown, folder = set(), ""
    for line in tree.splitlines():
        m = re.match(r"^( *)(\w+)(/|\.py)(\s|$)", line)
        if not m:
            continue
        indent, name, kind = m.group(1), m.group(2), m.group(3)
        if kind == "/":
            folder = name
            shown.add(name)
        else:
            shown.add(f"{folder}.{name}" if indent else name)
    expected = {m for m in MODULES if m and not m.endswith("__main__") and not m.endswith("__init__")}
    assert shown == expected, f"missing from the README: {sorted(expected - shown)}; gone: {sorted(shown - expected)}"
