"""Plugins: modules imported before a command runs, so that the entries they register
(archs, interaction energies, ...) exist when a config names them.

``energyformer --import my_package.energies train RECIPE`` imports ``my_package.energies`` first
and records it in the run's config.yaml (top-level ``imports:``), so that ``sample``, ``eval``,
``export`` and resume of that run import it again in a fresh process.
"""
from __future__ import annotations

import importlib
from typing import Sequence


def load_plugins(modules: Sequence[str]) -> None:
    """Import each module of ``modules`` (in order; an already imported one is not re-run).

    Raises:
        ValueError: a module that does not exist (one line naming it); an error raised while
            importing a module that exists propagates as it is.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # the plugin exists; something it imports is missing
            raise ValueError(f"plugin module {name!r} cannot be imported: no module named {e.name!r} "
                             "(is it installed, or on PYTHONPATH?)") from None
