"""The format of a prepared data directory and the one reader of its ``meta.json``.

A prepared directory holds ``train.bin`` and ``val.bin`` (raw little-endian token ids of the
dtype ``meta["dtype"]``: ``uint16``, the default when absent, or ``uint32`` for vocabularies over
65,535 ids; :func:`token_dtype`) and ``meta.json`` (written last by :mod:`energyformer.data.prepare`; its fields are listed
there). Everything that needs a dataset's metadata reads it with :func:`load_meta`; a run
directory's copy of it is read through ``energyformer.runs``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from energyformer.utils.io import read_json_object

FORMAT_VERSION = 1
META_FILE = "meta.json"
DATASETS = ("shakespeare_char", "listops", "gp", "english")  # names that `energyformer prepare NAME` builds
SPLITS = ("train", "val")
#: the dataset a run config names when it has none: ``energyformer import-hf`` writes it (the
#: imported model's training data are not known; a fine-tuning gives its own)
NO_DATASET = "none"
TOKEN_DTYPE = np.uint16  # the dtype of the token files of a vocabulary that fits it
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_UINT16_VOCAB = 65535  # id 65535 is kept free
#: what only a training run's directory holds (the names of ``energyformer.runs.layout``, a floor
#: above this one; tests/data/test_prepare_guard.py checks they agree): a prepare never writes there
RUN_FILES = ("config.yaml", "checkpoint.json", "summary.json", "metrics.jsonl", "train_state.pt", "checkpoints")


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` for ``vocab_size <= 65535``, else ``"uint32"``: the name the token files are written in."""
    return "uint16" if vocab_size <= MAX_UINT16_VOCAB else "uint32"


def token_dtype(meta: dict) -> np.dtype:
    """The numpy dtype of a prepared directory's ``.bin`` files (``meta["dtype"]``, default uint16).

    Raises:
        ValueError: a ``dtype`` that is not one of ``TOKEN_DTYPES``.
    """
    name = meta.get("dtype", "uint16")
    if name not in TOKEN_DTYPES:
        raise ValueError(f"dtype={name!r} in meta.json is not valid; expected one of {sorted(TOKEN_DTYPES)}")
    return np.dtype(TOKEN_DTYPES[name])
REQUIRED_META_KEYS = ("tokenizer", "vocab_size", "n_train", "n_val", "format_version")


def prepare_hint(data_dir: Path) -> str:
    """The ``energyformer prepare`` command that creates ``data_dir`` (for error messages)."""
    if data_dir.name in DATASETS:
        return f"run `energyformer prepare {data_dir.name}` first"
    if data_dir.name == NO_DATASET:  # the config of an imported model
        return ("this run config names no dataset (an `energyformer import-hf` run has no training data): "
                "give the data to train on with --data.dataset NAME or --data.data_dir DIR, prepared with the "
                "run's tokenizer")
    return (f"run `energyformer prepare <name>` (datasets: {', '.join(DATASETS)}) or "
            f"`energyformer prepare text --input FILE --out {data_dir}` first")


def load_meta(data_dir: str | Path) -> dict:
    """Read and check ``<data_dir>/meta.json``.

    Returns:
        the metadata dict (tokenizer, vocab_size, n_train, n_val, sha256, source, ...).

    Raises:
        FileNotFoundError: no ``meta.json``; the message says which ``energyformer prepare``
            command creates it.
        ValueError: the file is not valid JSON, not an object, or lacks a required key
            (``REQUIRED_META_KEYS``).
    """
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    meta = read_json_object(path, missing=f"the dataset is not prepared; {prepare_hint(data_dir)}",
                            corrupt=f"rerun the prepare command with --force ({prepare_hint(data_dir)})")
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks required keys {missing}; rerun the prepare command with --force")
    return meta
