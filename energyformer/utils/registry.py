"""Small name → entry registries: one per option family (docs/architecture.md §2, "Options that plug in").

An option family (CEM interactions, MLP ties, step maps, NRGPT attention and feed-forward
energies, norms) is a :class:`Registry`. Each entry is one class that owns its parameters, its
validation, its defaults, its math and its parameter accounting; adding a parameterization is one
``@REGISTRY.register("name")`` and its tests. Configs store the entry's name (a string), so
recipes, checkpoints and the CLI need no change when an entry is added::

    from energyformer.layers.cem_options import INTERACTIONS, LowRankInteraction

    @INTERACTIONS.register("my_interaction")
    class MyInteraction(LowRankInteraction):  # override what differs (docs/architecture.md §2)
        ...

The tables of entries in the docs are generated from the registries (:func:`markdown_tables`):
``python -m energyformer.utils.registry`` prints them and ``--write`` rewrites every
``<!-- registry:NAME -->`` … ``<!-- /registry:NAME -->`` block of ``README.md`` and ``docs/*.md``
(``tests/project/test_registry_docs.py`` fails when one differs).
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from energyformer._validate import did_you_mean

T = TypeVar("T")

#: every registry created so far, by option name (filled as the modules that define them are imported)
REGISTRIES: dict[str, Registry] = {}


#: the end of an unknown-name error: a plugin's names are registered when its module is imported
PLUGIN_HINT = (" (a plugin's name is known once its module is imported: the recipe's imports: [MODULE] or "
               "energyformer --import MODULE)")


class Registry(Generic[T]):
    """A mapping ``name -> entry`` for one option family.

    Args:
        option: the option name users write (``"interaction"``, ``"eta_param"``, ...); it is used
            in every error message and names the registry's generated table (:meth:`markdown_table`).
        title: what the family is, one line (the heading of its table).
        section: the section of the project's docs that defines the family; an entry may give its
            own (a ``section`` class attribute).

    Raises:
        ValueError: from :meth:`register` for a duplicate name, from :meth:`get` for an unknown one
            (the message lists the registered names).
    """

    def __init__(self, option: str, title: str = "", section: str = ""):
        self.option, self.title, self.section = option, title, section
        self.module = sys._getframe(1).f_globals.get("__name__", "")  # where the family is defined
        self._entries: dict[str, T] = {}
        REGISTRIES[option] = self

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("name")`` adds the class (or function) under ``name``.

        The entry gets ``entry.name = name``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.option}: an entry name must be a non-empty string, got {name!r}")

        def deco(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.option}={name!r} is already registered ({self._entries[name]!r})")
            try:
                entry.name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            self._entries[name] = entry
            return entry

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register toy entries). Unknown names are ignored."""
        self._entries.pop(name, None)

    def get(self, name: Any, option: str | None = None) -> T:
        """The entry registered as ``name``; ``option`` overrides the option name in the error message
        (one registry can serve options of several names, e.g. ``preconditioner`` and ``eta_param``).

        Raises:
            ValueError: ``name`` is not registered; the message names the option, the value and the
                allowed names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            allowed = ", ".join(repr(k) for k in self._entries)
            raise ValueError(f"{option or self.option}={name!r} is not valid{did_you_mean(name, self._entries)}; "
                             f"expected one of {allowed}{PLUGIN_HINT}") from None

    def check(self, name: Any, option: str | None = None) -> Any:
        """Raise ``ValueError`` (as :meth:`get`) unless ``name`` is registered; return ``name``."""
        self.get(name, option)
        return name

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.option!r}: {', '.join(self._entries)})"

    def builtin_names(self) -> tuple[str, ...]:
        """The names whose entry is defined in this package (not by a plugin), in registration order."""
        return tuple(n for n, e in self._entries.items() if getattr(e, "__module__", "").startswith("energyformer."))

    def markdown_table(self) -> str:
        """The table of the package's own entries: name, what it is (the first paragraph of the
        entry's docstring), and the docs section that defines it (the entry's ``section``, else
        the registry's). Plugin entries are left out (docs describe the package)."""
        rows = [f"| `{self.option}` | what it is | defined in |", "|---|---|---|"]
        for name in self.builtin_names():
            entry = self._entries[name]
            section = getattr(entry, "section", "") or self.section
            rows.append(f"| `{name}` | {_summary(entry)} | {section} |")
        return "\n".join(rows)


def _summary(entry: Any) -> str:
    """The first paragraph of ``entry``'s own docstring as one line of Markdown (reST double backquotes
    become single ones, ``|`` is escaped for a table cell)."""
    doc = inspect.getdoc(entry) or ""
    first = doc.split("\n\n", 1)[0]
    return " ".join(first.split()).replace("``", "`").replace("|", "\\|")


# ------------------------------------------------------------------------------- generated docs
#: the modules that define the package's registries (imported by name, as plugins are)
BUILTIN_MODULES = ("energyformer.layers",)
DOC_FILES = ("README.md", "docs/*.md")
_BLOCK = re.compile(r"(<!-- registry:([\w-]+) -->\n)(.*?)(<!-- /registry:\2 -->)", re.S)


def _index_table() -> str:
    rows = ["| registry option | module | what | entries |", "|---|---|---|---|"]
    for option, reg in sorted(REGISTRIES.items()):
        names = ", ".join(f"`{n}`" for n in reg.builtin_names())
        rows.append(f"| `{option}` | `{reg.module}` | {reg.title} | {names} |")
    return "\n".join(rows)


def markdown_tables() -> dict[str, str]:
    """Every generated docs block by name: ``"index"`` (one row per registry) and one table per
    registry, named by its option (``"interaction"``, ``"step_map"``, ...).

    A docs page holds a block as ``<!-- registry:NAME -->`` … ``<!-- /registry:NAME -->``;
    :func:`sync_docs` rewrites or checks them (``python -m energyformer.utils.registry --write``).
    """
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    tables = {"index": _index_table()}
    tables.update({option: reg.markdown_table() for option, reg in sorted(REGISTRIES.items())})
    return tables


def sync_docs(root: str | Path = ".", write: bool = False) -> list[str]:
    """Compare (``write=False``) or rewrite (``write=True``) the generated blocks of ``README.md`` and
    ``docs/*.md`` under ``root``; return the ``"file: block"`` names that differed.

    Raises:
        ValueError: a block names no generated table (the message lists the names).
    """
    tables, stale = markdown_tables(), []
    files = sorted({p for pattern in DOC_FILES for p in Path(root).glob(pattern)})
    for path in files:
        text = path.read_text(encoding="utf-8")

        def fill(m: re.Match, path: Path = path) -> str:
            if m.group(2) not in tables:
                raise ValueError(f"{path}: <!-- registry:{m.group(2)} --> names no registry table; "
                                 f"expected one of {', '.join(tables)}")
            body = tables[m.group(2)] + "\n"
            if m.group(3) != body:
                stale.append(f"{path.relative_to(root)}: {m.group(2)}")
            return m.group(1) + body + m.group(4)

        new = _BLOCK.sub(fill, text)
        if write and new != text:
            path.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    """``python -m energyformer.utils.registry [--write] [ROOT]``: print the tables, or rewrite the docs blocks."""
    args = list(sys.argv[1:] if argv is None else argv)
    write = "--write" in args
    rest = [a for a in args if a != "--write"]
    if not write:
        print("\n\n".join(f"<!-- registry:{n} -->\n{t}\n<!-- /registry:{n} -->" for n, t in markdown_tables().items()))
        return 0
    stale = sync_docs(rest[0] if rest else ".", write=True)
    print("rewrote " + (", ".join(stale) if stale else "nothing (every block was up to date)"))
    return 0


if __name__ == "__main__":  # run the imported module's main: its REGISTRIES are the ones the layers fill
    from energyformer.utils.registry import main as _main

    sys.exit(_main())
