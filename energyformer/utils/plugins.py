"""Plugins: modules outside the package that register option entries (docs/architecture.md §2).

A plugin is a module whose import registers entries (``@INTERACTIONS.register("name")`` …).
Two ways load one:

* an installed distribution declares it in the entry-point group ``energyformer.plugins``
  (``[project.entry-points."energyformer.plugins"] my_plugin = "my_pkg.options"``): every such
  entry point is loaded once per process, the first time :func:`load_plugins` runs;
* a run config names it in its top-level ``imports: [module, ...]``, which the run's
  ``config.yaml`` keeps, so that reading the run back (``load_run``, ``sample``, ``eval``,
  ``export``, resuming ``train``) imports it again in a fresh process before any model is built.

:func:`energyformer.runs.config.load_config` calls :func:`load_plugins` with the config's
``imports`` before it parses the model section.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load_plugins", "check_imports"]

ENTRY_POINT_GROUP = "energyformer.plugins"
_entry_points_loaded = False


class PluginError(ValueError):
    """A plugin module (or entry point) that fails to import; the message is one line naming it."""


def check_imports(imports: object) -> list[str]:
    """``imports`` of a run config as a list of module names (``None`` is ``[]``).

    Raises:
        ValueError: not a list of non-empty strings.
    """
    if imports is None:
        return []
    if isinstance(imports, str) or not isinstance(imports, (list, tuple)) or not all(
            isinstance(m, str) and m.strip() for m in imports):
        raise ValueError(f"imports={imports!r} must be a list of module names, e.g. [my_options]")
    return list(dict.fromkeys(m.strip() for m in imports))


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


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Load the ``energyformer.plugins`` entry points (once per process), then import each of ``modules``.

    Importing a module twice is free (Python caches it), so callers need not track what is loaded.

    Raises:
        PluginError: (a ``ValueError``) a module or entry point fails to import; one line naming it,
            the error, and where Python looks for it.
    """
    _load_entry_points()
    for module in check_imports(modules if isinstance(modules, str) else list(modules)):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a plugin's own error, shown as one line
            raise PluginError(f"imports: plugin module {module!r} failed to import ({_one_line(e)}); its directory "
                              "must be on PYTHONPATH (or the module installed)") from e
