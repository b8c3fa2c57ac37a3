"""Plugins: modules outside the package that register option entries (docs/architecture.md §2).

A plugin is a module whose import registers entries (``@INTERACTIONS.register("name")`` …).
Two ways load one:

* an installed distribution declares it in the entry-point group ``energyformer.plugins``
  (``[project.entry-points."energyformer.plugins"] my_plugin = "my_pkg.options"``): every such
  entry point is loaded once per process, the first time :func:`load_plugins` runs;
* a run config names it in its top-level ``imports: [module, ...]``, which the run's
  ``config.yaml`` keeps, so that reading the run back (``load_run``, ``sample``, ``eval``,
  ``export``, resuming ``train``) imports it again in a fresh process before any model is built.

:func:`load_plugins` is the one function that checks and imports them: ``load_config`` calls it
with the recipe's ``imports`` and the extra modules it is given (``energyformer --import``) before
it parses the model section, and records the list it returns; the Hugging Face config
(``energyformer.hf.configuration``) calls it with a ``config.json``'s ``imports``; the CLI with its
``--import`` modules before any command runs.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load_plugins", "load_listed_plugins", "check_imports"]

ENTRY_POINT_GROUP = "energyformer.plugins"
_entry_points_loaded = False


class PluginError(ValueError):
    """A plugin module (or entry point) that fails to import; the message is one line naming it."""


def check_imports(imports: object, *more: object, where: str = "imports") -> list[str]:
    """The module names of a run config's ``imports`` and of each list in ``more`` (modules added
    after them, e.g. ``--import``): in that order, stripped, each once; ``None`` is ``[]``.

    Args:
        imports, more: the lists of module names.
        where: what the messages call them: ``"imports"`` (a recipe's key) or a flag, ``"--import"``.

    Raises:
        ValueError: one of them is not a list (or tuple) of non-empty strings; the message names it
            and, for an entry that is empty or not a string, that entry.
    """
    names: list[str] = []
    for given in (imports, *more):
        if given is None:
            continue
        if isinstance(given, str) or not isinstance(given, (list, tuple)):
            raise ValueError(f"{where}={given!r} must be a list of module names, e.g. [my_options]")
        for i, m in enumerate(given):
            if isinstance(m, str) and m.strip():
                continue
            what = "an empty module name" if isinstance(m, str) else f"{m!r}, not a module name"
            if where.startswith("--"):  # a flag: one value each
                raise ValueError(f"{where} {m!r} is {what}; expected a module name, e.g. {where} my_options")
            raise ValueError(f"{where}={list(given)!r} has {what} (entry {i + 1}); expected a list of module "
                             "names, e.g. [my_options]")
        names.extend(m.strip() for m in given)
    return list(dict.fromkeys(names))


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - any failure of foreign code is reported as one line
            raise PluginError(f"the {ENTRY_POINT_GROUP} entry point {ep.name!r} ({ep.value}) failed to load: "
                              f"{_one_line(e)}") from e


def load_plugins(modules: Iterable[str] | None = (), *more: Iterable[str] | None, where: str = "imports") -> list[str]:
    """Check and import a run's plugin modules: the ``energyformer.plugins`` entry points (once per
    process), then each module of ``modules`` and of the lists in ``more`` (:func:`check_imports`: in
    order, each once). The one home of "check and import ``imports:``" (docs/architecture.md §2).

    Importing a module twice is free (Python caches it), so callers need not track what is loaded.

    Args:
        modules: a run config's ``imports`` (a list of module names; ``None`` is none).
        more: more lists, merged after it (``load_config``'s extra modules, from ``--import``).
        where: where the modules were given, as the messages name it: ``"imports"`` (a recipe's or a
            run's ``imports:``) or ``"--import"`` (the command line).

    Returns:
        the module names, merged (what a run config records as its ``imports``).

    Raises:
        ValueError: one of the lists is not a list of module names (:func:`check_imports`).
        PluginError: (a ``ValueError``) a module or entry point fails to import; one line naming it
            and its own error (type and message), and, when the module itself is not found, where
            Python looks for it.
    """
    _load_entry_points()
    names = check_imports(*(_as_list(m) for m in (modules, *more)), where=where)
    for module in names:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a plugin's own error, shown as one line
            missing = isinstance(e, ModuleNotFoundError) and e.name is not None and (
                module == e.name or module.startswith(e.name + "."))  # not found, not an import inside it
            hint = "; its directory must be on PYTHONPATH (or the module installed)" if missing else ""
            if missing and (module.endswith(".py") or "/" in module or "\\" in module):
                folder, _, stem = module.replace("\\", "/").rpartition("/")
                stem = stem.removesuffix(".py")
                hint = (f"; give a module name, not a file: {stem!r}, with its directory on PYTHONPATH "
                        f"(e.g. PYTHONPATH={folder or '.'} energyformer --import {stem} ...)")
            raise PluginError(f"{where}: plugin module {module!r} failed to import ({_one_line(e)}){hint}") from e
    return names


def load_listed_plugins(modules: object, file: str | Path) -> list[str]:
    """:func:`load_plugins` for the ``imports`` that ``file`` lists (a recipe, a run's config.yaml, an
    export's config.json): an error (``ValueError``, ``PluginError`` too) starts with the file's name."""
    try:
        return load_plugins(modules)  # type: ignore[arg-type]
    except ValueError as e:
        raise type(e)(f"{str(file)!r}: {e}") from e


def _as_list(modules: object) -> object:
    """Any other iterable of names (a generator, ``dict.fromkeys``' keys) as a list; a list, a tuple,
    ``None``, a string or a mapping as it is (:func:`check_imports` refuses the last two)."""
    if modules is None or isinstance(modules, (str, list, tuple, Mapping)) or not isinstance(modules, Iterable):
        return modules
    return list(modules)
