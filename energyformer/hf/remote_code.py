"""Model code that travels with an export: ``trust_remote_code`` folders (docs/hf.md, "Exports that carry their code").

``energyformer export`` writes, beside the weights, a self-contained copy of the code the
family needs, as new architectures do on the Hugging Face Hub: ``configuration_energyformer.py``
and ``modeling_energyformer.py`` (this package's :mod:`~energyformer.hf.configuration` and
:mod:`~energyformer.hf.modeling`) and one flat module per energyformer module they import
(``energyformer_layers_nrgpt.py`` is ``energyformer.layers.nrgpt`` ...), and ``config.json``
gets an ``auto_map``. Then, in an environment with only torch and transformers::

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

The copies are generated from our own source files at export time (one copy of the math in
the repository): every ``from energyformer.a.b import x`` becomes ``from .energyformer_a_b
import x`` (transformers' dynamic-module loader copies the relative imports of the same folder,
recursively; it supports flat modules only). The one generated piece is the model registry
(``energyformer_models_registry.py``), which names only the exported family.

Raises ``ValueError`` for a run with plugin ``imports`` (their code is outside the package).
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from energyformer.models.registry import ARCHS, INFERENCE_OPTIONS, get_spec

PACKAGE = "energyformer"
#: modules whose flat name is the Hugging Face convention
SPECIAL_NAMES = {"energyformer.hf.configuration": "configuration_energyformer",
                 "energyformer.hf.modeling": "modeling_energyformer"}
REGISTRY_MODULE = "energyformer.models.registry"
ENTRY_MODULES = ("energyformer.hf.configuration", "energyformer.hf.modeling")


def flat_name(module: str) -> str:
    """``"energyformer.layers.nrgpt"`` → ``"energyformer_layers_nrgpt"`` (the file name, without ``.py``)."""
    return SPECIAL_NAMES.get(module) or module.replace(".", "_").replace("__", "_")


def _source_file(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _package_imports(tree: ast.AST) -> list[ast.ImportFrom]:
    """The ``from energyformer... import`` statements of a module (lazy ones too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
            raise ValueError(f"'import {node.names[0].name}' (line {node.lineno}) cannot be made relative; "
                             "use 'from ... import ...'")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            out.append(node)
    return out


def _rewrite_import(node: ast.ImportFrom) -> list[str]:
    """The relative import lines that replace one ``from energyformer... import`` statement."""
    plain, lines = [], []
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        if _is_module(sub):  # ``from energyformer.energies import nrgpt as E``: a module
            flat = flat_name(sub)
            lines.append(f"from . import {flat} as {alias.asname or alias.name}")
            lines.append(f"from .{flat} import __name__ as _{flat}  # noqa: F401  (names the file for the loader)")
        else:
            plain.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    if plain:
        lines.insert(0, f"from .{flat_name(node.module)} import {', '.join(plain)}")
    return lines


def rewrite_module(source: str) -> tuple[str, list[str]]:
    """``(source with relative imports, the energyformer modules it imported)``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    needed: list[str] = []
    for node in sorted(_package_imports(tree), key=lambda n: n.lineno, reverse=True):
        indent = lines[node.lineno - 1][:node.col_offset]
        if indent.strip():
            raise ValueError(f"line {node.lineno}: an import after another statement on its line")
        new = [indent + line for line in _rewrite_import(node)]
        lines[node.lineno - 1:node.end_lineno] = new
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            needed.append(sub if _is_module(sub) else node.module)
    return "\n".join(lines) + "\n", needed


def registry_source(arch: str) -> str:
    """The generated registry: the exported family only (``ARCHS``, ``LANGUAGE_MODELS``,
    ``config_from_dict``, ``build_model``, ``inference_options``: the names the configuration and
    modeling use)."""
    module, model_cls, config_cls = ARCHS[arch]
    options = INFERENCE_OPTIONS
    return f'''"""energyformer's model registry, reduced to the exported family ``{arch}`` \
(generated by `energyformer export`)."""
from __future__ import annotations

from .{flat_name(module)} import {config_cls}, {model_cls}

ARCHS = {{{arch!r}: ({model_cls}, {config_cls})}}
LANGUAGE_MODELS = tuple(ARCHS)


def config_from_dict(d):
    """The model config of a dict with an ``arch`` key; raises ``ValueError`` for another arch."""
    if d.get("arch") not in ARCHS:
        raise ValueError(f"arch={{d.get('arch')!r}} is not the exported family; expected {arch!r}")
    return ARCHS[d["arch"]][1].from_dict(d)


def build_model(spec):
    """A freshly initialised model of a model config (or a dict with an ``arch`` key)."""
    if isinstance(spec, dict):
        spec = config_from_dict(spec)
    return ARCHS[spec.arch][0](spec)


def inference_options(arch):
    """The inference options the family's forward takes (as ``ArchSpec.inference_options``)."""
    import inspect

    takes = inspect.signature(ARCHS[arch][0].forward).parameters
    return tuple(k for k in {options!r} if k in takes)
'''


def remote_sources(arch: str) -> dict[str, str]:
    """``{file name: source}`` of every module an export of ``arch`` carries.

    Raises:
        ValueError: ``arch`` unknown, or a module whose imports cannot be made relative.
    """
    try:
        get_spec(arch)
    except ValueError:
        raise ValueError(f"arch={arch!r} has no model code to export; expected one of {sorted(ARCHS)}") from None
    files = {flat_name(REGISTRY_MODULE) + ".py": registry_source(arch)}
    todo, seen = list(ENTRY_MODULES) + [ARCHS[arch][0]], {REGISTRY_MODULE}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _source_file(module)
        if path is None:
            raise ValueError(f"module {module!r} has no Python source to copy")
        source, needed = rewrite_module(path.read_text(encoding="utf-8"))
        files[flat_name(module) + ".py"] = source
        todo.extend(m for m in needed if m not in seen)
    return files


def auto_map(arch: str) -> dict[str, str]:
    """The ``auto_map`` of ``config.json``: the Auto classes → ``module.Class`` in the folder."""
    from energyformer.hf.configuration import class_name

    name = class_name(arch)
    return {"AutoConfig": f"{SPECIAL_NAMES['energyformer.hf.configuration']}.Energyformer{name}Config",
            "AutoModelForCausalLM": f"{SPECIAL_NAMES['energyformer.hf.modeling']}.Energyformer{name}ForCausalLM"}


def write_remote_code(arch: str, folder: str | Path) -> list[str]:
    """Write the family's code into ``folder``; returns the file names written.

    Raises:
        ValueError: as :func:`remote_sources`.
    """
    folder = Path(folder)
    files = remote_sources(arch)
    for name, source in files.items():
        (folder / name).write_text(source, encoding="utf-8")
    return sorted(files)
