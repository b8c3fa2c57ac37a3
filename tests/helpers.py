"""Test helpers shared by several test files (imported as ``from helpers import ...``)."""
import json

import numpy as np


def make_data_dir(path, n_words=2000, seed=0):
    """A tiny char-level dataset written by hand: train.bin/val.bin (uint16) + meta.json.

    Written without the data package on purpose, so train/CLI tests do not depend on it.
    """
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(["the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran\n"], size=n_words))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    path.mkdir(parents=True, exist_ok=True)
    ids[:n].tofile(path / "train.bin")
    ids[n:].tofile(path / "val.bin")
    meta = {"format_version": 1, "dataset": path.name, "tokenizer": "char", "vocab_size": len(chars),
            "chars": chars, "dtype": "uint16", "n_train": int(n), "n_val": int(len(ids) - n)}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def fenced_blocks(text, lang="python"):
    """The bodies of the Markdown code blocks fenced as ```lang, in order (the README tests read
    ```bash blocks the same way)."""
    import re

    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)
