"""The recipes that ship with energyformer (``configs/`` of a clone, ``energyformer/configs/`` of a wheel).

``energyformer train shakespeare_char/nrgpt.yaml`` (or ``configs/shakespeare_char/nrgpt.yaml``, or
``shakespeare_char/nrgpt``) finds the bundled recipe when no such file exists in the working
directory; a file that does exist always wins. docs/install.md says how the wheel carries them.
"""
from __future__ import annotations

import difflib
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


def similar_recipes(recipe: str | Path, n: int = 3, cutoff: float = 0.75) -> list[str]:
    """The bundled recipes closest to a mistyped relative ``recipe`` (``difflib`` ratios of the
    paths without ``.yaml``, and of the file names when ``recipe`` names no folder), best first,
    spelled as it was (with ``configs/`` and ``.yaml`` when it had them); ``[]`` for an absolute
    path, one that exists, or nothing as close as ``cutoff``."""
    path, root = Path(recipe), recipes_dir()
    if root is None or path.is_absolute() or path.exists():
        return []
    prefix = "configs/" if path.parts[:1] == ("configs",) and len(path.parts) > 1 else ""
    rel = Path(*path.parts[1:]) if prefix else path
    suffix = rel.suffix if rel.suffix in (".yaml", ".yml") else ""
    typed = rel.with_suffix("").as_posix() if suffix else rel.as_posix()
    scores = []
    for name in sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")):
        ratio = difflib.SequenceMatcher(None, typed, name).ratio()
        if "/" not in typed:  # a bare name: also against the file names
            ratio = max(ratio, difflib.SequenceMatcher(None, typed, name.rsplit("/", 1)[-1]).ratio())
        if ratio >= cutoff:
            scores.append((-ratio, name))
    return [f"{prefix}{name}{'.yaml' if suffix else ''}" for _, name in sorted(scores)[:n]]


def did_you_mean(recipe: str | Path) -> str:
    """``" (did you mean 'shakespeare_char/nrgpt.yaml'?)"`` for a mistyped recipe
    (:func:`similar_recipes`), else ``""``."""
    names = [repr(m) for m in similar_recipes(recipe)]
    if not names:
        return ""
    return f" (did you mean {', '.join(names[:-1]) + ' or ' if len(names) > 1 else ''}{names[-1]}?)"

