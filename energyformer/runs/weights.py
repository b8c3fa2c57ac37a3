"""Model weights as safetensors: tied parameters stored once, no wrapper prefixes in names.

File format (unchanged since format version 1, so older run directories still load): one
tensor per distinct storage of ``model.state_dict()``, named without ``module.`` (DDP) or
``_orig_mod.`` (``torch.compile``) prefixes; the metadata holds ``"format": "pt"``,
``"energyformer_format": "1"``, ``"aliases"`` (JSON ``{extra name of a tied tensor: stored
name}``) and whatever the caller adds (a checkpoint adds ``"step"``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from energyformer.utils.io import atomic_path

FORMAT_VERSION = 1
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def strip_wrapper_prefixes(name: str) -> str:
    """Remove ``_orig_mod.`` (torch.compile) and ``module.`` (DDP) prefixes from a weight name."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model under ``torch.compile`` / DDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def weights_state(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, aliases)``: the state dict (on CPU) with each shared tensor stored once.

    ``aliases`` maps every extra name of a tied tensor to the name kept in ``tensors``.
    ``state_dict`` replaces ``model.state_dict()`` (e.g. the full state gathered from FSDP2
    shards); its tied names must share storage as the model's do.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    plain = unwrap_model(model)
    source = plain.state_dict() if state_dict is None else state_dict
    if state_dict is not None:  # gathered tensors share no storage: take the ties from the model
        first: dict[int, str] = {}
        for name, p in plain.named_parameters(remove_duplicate=False):
            name = strip_wrapper_prefixes(name)
            if id(p) in first and name in source:
                aliases[name] = first[id(p)]
            else:
                first.setdefault(id(p), name)
        source = {k: v for k, v in source.items() if strip_wrapper_prefixes(k) not in aliases}
    for name, t in source.items():
        name = strip_wrapper_prefixes(name)
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def write_weights_file(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None,
                       state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the safetensors file in place (not atomic: callers stage it, see :func:`save_weights`).

    ``state_dict``: see :func:`weights_state`.
    """
    from safetensors.torch import save_file

    tensors, aliases = weights_state(model, state_dict)
    meta = {"format": "pt", "energyformer_format": str(FORMAT_VERSION), "aliases": json.dumps(aliases)}
    meta.update(metadata or {})
    save_file(tensors, str(path), metadata=meta)


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Save the model's weights to a safetensors file, atomically; returns ``path``.

    Tied parameters are stored once; their other names are kept in the metadata key
    ``"aliases"`` (JSON) and restored by :func:`read_weights` / :func:`load_weights`.
    """
    with atomic_path(path) as tmp:
        write_weights_file(model, tmp, metadata)
    return Path(path)


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors incl. aliases, metadata)`` from a safetensors file written by :func:`save_weights`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a readable safetensors file (truncated, garbled).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} not found; expected the model.safetensors "
                                "that `energyformer train` writes into the run directory")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        aliases = json.loads(metadata.get("aliases", "{}"))
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise ValueError(f"weights file {str(path)!r} is corrupt or not a safetensors file "
                         f"({type(e).__name__}: {e}); expected the model.safetensors written by "
                         "`energyformer train`") from None
    for alias, target in aliases.items():
        if target in tensors:
            tensors[alias] = tensors[target]
    return tensors, metadata


def load_weights(model: nn.Module, path: str | Path) -> dict[str, str]:
    """Load a safetensors file into ``model`` (strict); returns the file's metadata.

    Raises:
        FileNotFoundError: missing file.
        ValueError: corrupt file, or names/shapes that do not match the model (the message lists
            missing, unexpected and mismatched tensors).
    """
    tensors, metadata = read_weights(path)
    target = unwrap_model(model)
    expected = {strip_wrapper_prefixes(k): v for k, v in target.state_dict().items()}
    if hasattr(target, "upgrade_state_dict"):  # weight names of files written by older versions
        tensors = target.upgrade_state_dict(tensors, expected)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
              for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {_few(shapes)}")
        raise ValueError(f"weights in {str(path)!r} do not match the model built from its config: "
                         + "; ".join(parts))
    target.load_state_dict({k: tensors[k] for k in expected}, strict=True)
    return metadata


def _few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}] ({len(items)} in all)"
