"""Test helpers shared by several test files (imported as ``from helpers import ...``)."""
import json
import sys
from contextlib import contextmanager

import numpy as np
import torch

WORDS = ("the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran\n")

# Tiny model configs per family (block_size 16; the vocabulary comes from the data): the shared
# starting point of the training tests, the golden loss curves and the tiny run directory.
TINY_MODELS = {
    "gpt": {"arch": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "block_size": 16},
    "gpt_rec": {"arch": "gpt_rec", "d_model": 16, "n_heads": 2, "n_steps": 3, "block_size": 16},
    "llama": {"arch": "llama", "d_model": 16, "n_layers": 2, "n_heads": 2, "block_size": 16},
    "cem": {"arch": "cem", "d_model": 16, "n_layers": 2, "n_heads": 2, "n_steps": 2, "block_size": 16},
    "nrgpt": {"arch": "nrgpt", "d_model": 16, "n_heads": 2, "n_steps": 3, "block_size": 16},
}
# A short CPU training of those (each test overrides what it is about).
TINY_TRAIN = {"max_steps": 10, "batch_size": 4, "eval_interval": 5, "eval_iters": 1, "log_interval": 1,
              "warmup_steps": 2, "learning_rate": 3e-3, "device": "cpu"}


def make_data_dir(path, n_words=2000, seed=0, words=WORDS, chars=None, train_fraction=0.9):
    """A tiny char-level dataset written by hand: train.bin/val.bin (uint16) + meta.json.

    Written without the data package on purpose, so train/CLI tests do not depend on it.
    ``chars``: a fixed vocabulary (a superset of the text's characters; default: the text's own).
    """
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(list(words), size=n_words))
    chars = sorted(set(text)) if chars is None else list(chars)
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(train_fraction * len(ids))
    path.mkdir(parents=True, exist_ok=True)
    ids[:n].tofile(path / "train.bin")
    ids[n:].tofile(path / "val.bin")
    meta = {"format_version": 1, "dataset": path.name, "tokenizer": "char", "vocab_size": len(chars),
            "chars": chars, "dtype": "uint16", "n_train": int(n), "n_val": int(len(ids) - n)}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def tiny_config_dict(data_dir, out_dir=None, model="gpt", **train):
    """The config dict of a tiny CPU training: ``model`` a family of :data:`TINY_MODELS`, a dict
    with ``arch`` (that model, block_size 16 unless given) or a dict of overrides of the tiny GPT;
    ``train`` overrides :data:`TINY_TRAIN`; ``out_dir`` None leaves it out."""
    if isinstance(model, str):
        model = TINY_MODELS[model]
    model = {"block_size": 16, **model} if "arch" in model else {**TINY_MODELS["gpt"], **model}
    train = {**TINY_TRAIN, **({} if out_dir is None else {"out_dir": str(out_dir)}), **train}
    return {"model": model, "data": {"data_dir": str(data_dir)}, "train": train}


def tiny_config(data_dir, out_dir, model="gpt", **train):
    """:func:`tiny_config_dict` loaded as a ``RunConfig`` (the vocabulary read from the data)."""
    from energyformer.runs import load_config

    return load_config(tiny_config_dict(data_dir, out_dir, model, **train), resolve_vocab=True)


@contextmanager
def on_sys_path(folder, *modules):
    """``folder`` (scripts or plugin modules outside the package) first on ``sys.path`` for the block;
    afterwards it is taken off again and ``modules`` (imported from it) are forgotten."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for m in modules:
            sys.modules.pop(m, None)


def perturb(module, scale=0.05, seed=0):
    """Move every parameter of ``module`` off its init (zero diagonals, identity maps, P factors, η) by
    ``scale`` times seeded normal noise, so that no term is trivially zero; returns ``module``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def fenced_blocks(text, lang="python"):
    """The bodies of the Markdown code blocks fenced as ```lang, in order (the README tests read
    ```bash blocks the same way)."""
    import re

    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)
