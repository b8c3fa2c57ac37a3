"""Trained models that ship with energyformer: ``zoo:NAME`` wherever a run directory is taken
(``energyformer sample zoo:NAME``, ``export``, ``inspect``, ``eval``, ``load_run("zoo:NAME")``), and
``energyformer zoo`` to list them. Offline: the weights are package data.

An entry is a finished run directory inside the package, ``energyformer/zoo/NAME/``:
``config.yaml``, ``meta.json`` (the tokenizer), ``model.safetensors``, ``summary.json``,
``checkpoint.json``; ``README.md``, its model card (what it is, the data, parameters, the
fixed-evaluation metric, whether it converged, the command that made it); ``zoo.json``, the card's
fields; and ``check.json``, a few hundred validation tokens and the model's loss on them, so a test
can hold the shipped weights to their recorded metric without the corpus.
:mod:`energyformer.experiments.zoo_entries` makes the entries from the experiments' run records
(docs/zoo.md).
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

ZOO_PREFIX = "zoo:"
ENTRY_FILE = "zoo.json"
CHECK_FILE = "check.json"
_PACKAGE = Path(__file__).resolve().parents[1]  # .../energyformer


def zoo_root() -> Path:
    """The folder of the shipped entries (``energyformer/zoo``)."""
    return _PACKAGE / "zoo"


def zoo_entries(root: str | Path | None = None) -> list[dict[str, Any]]:
    """Every entry's card fields (``zoo.json``), sorted by name."""
    root = Path(root) if root is not None else zoo_root()
    if not root.is_dir():
        return []
    return [json.loads((d / ENTRY_FILE).read_text(encoding="utf-8"))
            for d in sorted(root.iterdir()) if (d / ENTRY_FILE).is_file()]


def is_zoo_ref(ref: str | Path) -> bool:
    """Whether ``ref`` names a zoo entry (``zoo:NAME``)."""
    return isinstance(ref, str) and ref.startswith(ZOO_PREFIX)


def resolve_run_dir(ref: str | Path, root: str | Path | None = None) -> Path:
    """The run directory ``ref`` names: ``zoo:NAME`` → the shipped entry's folder; anything else
    unchanged, as a path.

    Raises:
        FileNotFoundError: ``zoo:NAME`` names no entry (the message lists the entries and the closest).
    """
    if not is_zoo_ref(ref):
        return Path(ref)
    name = str(ref)[len(ZOO_PREFIX):]
    root = Path(root) if root is not None else zoo_root()
    if name and (root / name / ENTRY_FILE).is_file():
        return root / name
    names = [e["name"] for e in zoo_entries(root)]
    close = [n for n in names if name and n.startswith(name)][:1] or difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean zoo:{close[0]}?" if close else ""
    raise FileNotFoundError(f"{ref!r} is not in the model zoo (entries: {', '.join(names) or 'none'}){hint}; "
                            "`energyformer zoo` lists them")


def model_card(card: dict[str, Any]) -> str:
    """The Markdown model card of an entry's fields."""
    m = card["metric"]
    return (f"# zoo:{card['name']}\n\n{card['description']}\n\n"
            f"- architecture: `{card['arch']}`, {card['params']:,} parameters\n"
            f"- data: `{card['dataset']}` (`energyformer prepare {card['dataset']}`), {card['steps']:,} steps, "
            f"{card['tokens']:,} training tokens\n"
            f"- {m['name']}: **{m['value']:.4f}** over {m['tokens']:,} tokens\n"
            f"- converged: {card['converged']}\n"
            f"- made by: `{card['command']}` (run `{card['source']}`)\n\n"
            f"Start from it: `energyformer sample zoo:{card['name']} --prompt \"ROMEO:\"`, "
            f"`energyformer inspect zoo:{card['name']}`, `energyformer export zoo:{card['name']} --to DIR`, "
            f"`load_run(\"zoo:{card['name']}\")`.\n")


__all__ = ["CHECK_FILE", "ENTRY_FILE", "ZOO_PREFIX", "is_zoo_ref", "model_card", "resolve_run_dir", "zoo_entries",
           "zoo_root"]
