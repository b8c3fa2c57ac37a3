"""The identity of a prepared dataset: which tokenizer, and which exact token files.

A run records the identity of the data it trained on (in its checkpoint marker). Resuming,
evaluating or sampling checks the data at hand against it, so that embeddings are never read
with another character table and a run never continues on other text without a word.

    ident = data_identity("data/shakespeare_char")          # hashes train.bin and val.bin
    problem = identity_change(recorded, ident, old_meta, new_meta)   # None when equal
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .meta import SPLITS, load_meta
from .shakespeare import sha256_file
from .tokenizers import load_tokenizer

VOCAB_KEYS = ("tokenizer", "vocab_size", "vocab_sha256")


def vocab_identity(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``{"tokenizer", "vocab_size", "vocab_sha256"}`` of a meta.json dict (no file is read).

    ``vocab_sha256`` hashes what defines the tokenizer (for ``char``: the ordered characters).

    Raises:
        ValueError: the meta's tokenizer is unknown or inconsistent (see ``load_tokenizer``).
    """
    tok_meta = load_tokenizer(meta).to_meta()
    digest = hashlib.sha256(json.dumps(tok_meta, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return {"tokenizer": tok_meta["tokenizer"], "vocab_size": int(tok_meta["vocab_size"]),
            "vocab_sha256": digest.hexdigest()}


def data_identity(data_dir: str | Path, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Vocabulary identity plus the sha256 of ``train.bin`` and ``val.bin`` as they are on disk.

    Raises:
        FileNotFoundError / ValueError: see ``load_meta`` and :func:`vocab_identity`.
    """
    data_dir = Path(data_dir)
    meta = load_meta(data_dir) if meta is None else meta
    ident = vocab_identity(meta)
    for split in SPLITS:
        path = data_dir / f"{split}.bin"
        ident[f"{split}_sha256"] = sha256_file(path) if path.is_file() else None
    return ident


def identity_change(recorded: Mapping[str, Any], current: Mapping[str, Any],
                    recorded_meta: Mapping[str, Any] | None = None,
                    current_meta: Mapping[str, Any] | None = None) -> str | None:
    """What differs between two identities, in words; ``None`` when they agree.

    Keys missing from either side (older run directories) are not compared. With both meta
    dicts of char tokenizers, the added and removed characters are named.
    """
    changes = []
    if any(k in recorded and k in current and recorded[k] != current[k] for k in VOCAB_KEYS):
        a, b = recorded.get("tokenizer"), current.get("tokenizer")
        kinds = f"{a} tokenizer: " if a == b else f"{a} tokenizer → {b} tokenizer, "
        what = f"the vocabulary changed ({kinds}{recorded.get('vocab_size')} → {current.get('vocab_size')} tokens"
        old, new = (recorded_meta or {}).get("chars"), (current_meta or {}).get("chars")
        if isinstance(old, list) and isinstance(new, list):
            added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
            if added:
                what += f"; added {''.join(added)!r}"
            if removed:
                what += f"; removed {''.join(removed)!r}"
            if not added and not removed:
                what += "; same characters, other ids"
        changes.append(what + ")")
    for split in SPLITS:
        key = f"{split}_sha256"
        a, b = recorded.get(key), current.get(key)
        if a is not None and b is not None and a != b:
            changes.append(f"{split}.bin changed (sha256 {a[:12]} → {b[:12]})")
    return "; ".join(changes) or None


def check_token_ids(data: np.ndarray, vocab_size: int, path: str | Path) -> None:
    """Raise ``ValueError`` naming ``path`` if a token id of ``data`` is ``>= vocab_size``.

    Catches a corrupt token file, or one whose meta.json belongs to another preparation.
    """
    if len(data) == 0:
        return
    top = int(np.max(data))
    if top >= vocab_size:
        where = int(np.argmax(np.asarray(data) >= vocab_size))
        raise ValueError(f"{path} holds token id {top} (first bad id at position {where}) but its meta.json "
                         f"says vocab_size={vocab_size}: the file is corrupt or from another preparation; "
                         "re-prepare the dataset with --force")
