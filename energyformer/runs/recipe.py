"""Reading YAML recipes, with inheritance.

A recipe may name another one it extends::

    # configs/shakespeare_char/cem_t2.yaml
    base: cem.yaml          # relative to this file; chains allowed
    model:
      n_steps: 2

:func:`read_recipe` loads the chain base-first and merges it deeply: mappings are merged key by
key and the child's value wins everywhere else (also a ``null``: ``rope: null`` turns RoPE off
in a child of a recipe that sets ``rope: exact``). An empty section (``train:``) counts as
``{}``. The result has no ``base`` key.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

BASE_KEY = "base"
IMPORTS_KEY = "imports"  # top-level recipe key: plugin modules imported before the config is read


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping (YAML allows it silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file (``{}`` for an empty file).

    Raises:
        FileNotFoundError: ``path`` does not exist (or is a directory).
        ValueError: one line naming the file (and the line and column where known): the file
            is not UTF-8, not valid YAML, holds a key twice in one mapping, or its top level is
            not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist"
                                + (" (it is a directory)" if path.is_dir() else ""))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} on line "
                         f"{line}); save it as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = " ".join((f"{problem} ({context})" if context and "duplicate" not in problem else problem).split())
        raise ValueError(f"config file {where}: not valid YAML: {detail}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping with sections model, data, "
                         f"train, got {type(raw).__name__}")
    return raw


def deep_merge(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``child``: nested mappings merged, any other child value wins."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` merged over the recipes it extends (``base:``), without ``base``.

    Raises:
        FileNotFoundError: the recipe or a base recipe does not exist (the message names the
            recipe that refers to it).
        ValueError: invalid YAML, a ``base`` that is not a file name, or an inheritance cycle
            (the message lists the chain).
    """
    return _read_chain(Path(path), [])


def _read_chain(path: Path, chain: list[Path]) -> dict[str, Any]:
    key = path.resolve()
    if key in chain:
        names = " -> ".join(str(p.name) for p in chain[chain.index(key):] + [key])
        raise ValueError(f"recipe inheritance cycle: {names}; a recipe cannot extend itself")
    raw = read_yaml_mapping(path)
    for section, value in list(raw.items()):
        if value is None and section == IMPORTS_KEY:  # `imports:` left empty: none (a base's stay)
            del raw[section]
        elif value is None and section != BASE_KEY:
            raw[section] = {}
    base = raw.pop(BASE_KEY, None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"base={base!r} in {str(path)!r} must be the file name of another recipe "
                         "(relative to this one), e.g. base: cem.yaml")
    base_path = path.parent / base
    if not base_path.is_file():
        raise FileNotFoundError(f"base recipe {str(base_path)!r} (base: {base} in {str(path)!r}) does not exist")
    return deep_merge(_read_chain(base_path, chain + [key]), raw)


def imports_source(path: str | Path) -> Path:
    """The file of the recipe chain at ``path`` whose ``imports:`` the merged recipe holds (the recipe
    itself, or the nearest base that names them), for messages; ``path`` when none does. Read after
    :func:`read_recipe` has checked the chain (no cycle, every base present)."""
    here = Path(path)
    for _ in range(64):  # a chain is short; read_recipe has refused cycles
        raw = read_yaml_mapping(here)
        base = raw.get(BASE_KEY)
        if raw.get(IMPORTS_KEY) is not None or not isinstance(base, str):
            return here
        here = here.parent / base
    return Path(path)
