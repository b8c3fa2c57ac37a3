"""The recipes that ship with energyformer (``configs/`` of a clone, ``energyformer/configs/`` of a wheel).

``energyformer train shakespeare_char/nrgpt.yaml`` (or ``configs/shakespeare_char/nrgpt.yaml``, or
``shakespeare_char/nrgpt``) finds the bundled recipe when no such file exists in the working
directory; a file that does exist always wins. docs/install.md says how the wheel carries them.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # .../energyformer


def recipes_dir() -> Path | None:
    """The folder of the bundled recipes: ``energyformer/configs`` (installed wheel) or the clone's
    ``configs/`` beside the package (editable install, source checkout); None if neither exists."""
    for root in (_PACKAGE / "configs", _PACKAGE.parent / "configs"):
        if root.is_dir():
            return root
    return None


def find_recipe(recipe: str | Path) -> str:
    """``recipe`` itself if it exists as given, else the matching bundled recipe, else ``recipe``
    unchanged (so the caller's own "does not exist" error names what the user typed)."""
    path = Path(recipe)
    root = recipes_dir()
    if path.exists() or root is None or path.is_absolute():
        return str(recipe)
    rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
    for candidate in (root / rel, root / rel.with_name(rel.name + ".yaml")):
        if candidate.is_file():
            return str(candidate)
    return str(recipe)
