"""Import layering of the package: no module imports from a higher level, no file-level cycles.

Levels, low to high (a module may import its own level and the levels below)::

    0 _validate, utils     1 energies     2 layers     3 models, data     4 tasks, runs
    5 train, eval, inspect     6 hf     7 experiments     8 commands, cli
    top: energyformer/__init__.py, __main__.py (they may import anything)

Imports inside functions count too (a lazy import is still a dependency). Package
``__init__.py`` re-exports are left out of the cycle check (importing ``energyformer.runs``
runs its ``__init__``, but no module depends on another through it).
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "energyformer"
LEVELS = {"_validate": 0, "utils": 0, "energies": 1, "layers": 2, "models": 3, "data": 3, "tasks": 4,
          "runs": 4, "train": 5, "eval": 5, "inspect": 5, "hf": 6, "experiments": 7, "commands": 8,
          "cli": 8}
TOP = 9  # energyformer/__init__.py and __main__.py


def module_files() -> dict[str, Path]:
    """Dotted module name → file, for every .py under energyformer/."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def level(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return TOP
    if parts[1] not in LEVELS:
        raise AssertionError(f"{module}: the package {parts[1]!r} has no level; add it to LEVELS here "
                             "and in docs/architecture.md")
    return LEVELS[parts[1]]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The energyformer modules that ``module`` imports (absolute and relative, at any depth)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [name] + [f"{name}.{a.name}" for a in node.names]  # `from pkg import module`
        else:
            continue
        found |= {t for t in targets if t in known and t != module}
    return found


MODULES = module_files()
EDGES = {m: imports(m, p, set(MODULES)) for m, p in MODULES.items()}

# Tolerated violations, "importer -> imported": "why, and who removes it" (xfails the test while
# they are the only ones). None at present.
KNOWN_UPWARD: dict[str, str] = {}


def upward_imports() -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in EDGES.items() for t in targets
                  if t != "energyformer" and level(t) > level(m))


def test_every_package_has_a_level():
    for module in MODULES:
        level(module)


def test_no_upward_imports():
    found = upward_imports()
    bad = [v for v in found if v not in KNOWN_UPWARD]
    assert not bad, "modules importing from a higher level (see this file's docstring):\n" + "\n".join(bad)
    known = [f"{v} ({KNOWN_UPWARD[v]})" for v in found if v in KNOWN_UPWARD]
    if known:
        pytest.xfail("known upward imports: " + "; ".join(known))


def cycles() -> list[list[str]]:
    """Strongly connected components (> 1 module) of the file-level import graph (Tarjan)."""
    nodes = [m for m, p in MODULES.items() if p.name != "__init__.py"]
    graph = {m: sorted(t for t in EDGES[m] if t in nodes) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    found = cycles()
    assert not found, "file-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_violations(tmp_path, monkeypatch):
    """The walk finds relative, absolute and function-level imports."""
    src = tmp_path / "energyformer" / "layers" / "bad.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..train import loop\n    import energyformer.cli\n")
    known = {"energyformer.train", "energyformer.train.loop", "energyformer.cli"}
    assert imports("energyformer.layers.bad", src, known) == known
    assert level("energyformer.layers.bad") < level("energyformer.train.loop")


def documented_levels(text: str) -> dict[str, int]:
    """The level list of docs/architecture.md §1: ``name -> level`` for every ``name/`` (a
    subpackage) and ``name.py`` (a top-level module) that opens a numbered line of its first block."""
    section = text.split("## 1. ", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    found = {}
    for line in block.splitlines():
        words = line.split()
        if not words or not words[0].isdigit():
            continue
        for word in words[1:]:
            name = word.removesuffix("/") if word.endswith("/") else word.removesuffix(".py")
            if name == word or not name.isidentifier():
                break
            found[name] = int(words[0])
    return found


def package_parts() -> set[str]:
    """Every subpackage and top-level module of energyformer (not __init__/__main__)."""
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    return subpackages | modules


def test_docs_level_list_names_every_subpackage_on_its_level():
    docs = documented_levels((PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = sorted(package_parts() - set(docs))
    assert not missing, f"docs/architecture.md §1 does not list {missing} in its level list"
    stale = sorted(set(docs) - package_parts())
    assert not stale, f"docs/architecture.md §1 lists {stale}, which the package does not have"
    wrong = {name: (docs[name], LEVELS[name]) for name in docs if docs[name] != LEVELS[name]}
    assert not wrong, f"docs/architecture.md §1 levels differ from LEVELS here (docs, test): {wrong}"


def test_the_level_list_check_sees_a_missing_subpackage():
    text = "## 1. Levels\n\n```\n0  utils/  _validate.py   helpers\n1  energies/   math on x/y\n```\n## 2. Next\n"
    assert documented_levels(text) == {"utils": 0, "_validate": 0, "energies": 1}
    assert {"layers", "hf", "tasks"} <= package_parts() - set(documented_levels(text))
