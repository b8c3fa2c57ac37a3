"""A same-distribution split of a character corpus: held-out speeches of the same plays.

A prepared character dataset (``energyformer prepare shakespeare_char``, 90/10 by position) validates
on the *last plays*: its val − train gap is there from the first epoch, because validation is other
text, not because the model overfits. To measure overfitting (the growth of the gap over epochs,
docs/experiments.md §6) the training part is split again by speech (blocks of lines separated by a
blank line, the tiny-Shakespeare layout): every ``every``-th speech is held out for validation, the
others train. The vocabulary is the source's, so a model trained here is scored on the source's
(cross-play) validation split as well, token for token.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from energyformer._validate import check_int
from energyformer.data.loader import load_split
from energyformer.data.meta import FORMAT_VERSION, META_FILE, load_meta
from energyformer.data.prepare import check_out_dir
from energyformer.data.tokenizers import CharTokenizer
from energyformer.utils.io import atomic_write_bytes


def split_speeches(text: str, every: int = 10) -> tuple[str, str]:
    """``(train, held_out)``: the speeches of ``text`` (separated by blank lines), every ``every``-th
    one (the 1st, the ``every + 1``-th, …, counting from 0) held out; each keeps its trailing blank
    line, so the two texts hold every character of ``text`` once.

    Raises:
        ValueError: ``every`` < 2, or fewer than ``every`` speeches.
    """
    check_int("every", every, 2)
    speeches: list[str] = []
    for piece in re.split(r"(?<=\n\n)", text):
        if speeches and not piece.strip():  # blank lines beyond the separator stay with their speech
            speeches[-1] += piece
        elif piece:
            speeches.append(piece)
    if len(speeches) < every:
        raise ValueError(f"the text has {len(speeches)} speeches; holding out every {every}th needs at least {every}")
    held = [s for i, s in enumerate(speeches) if i % every == 0]
    kept = [s for i, s in enumerate(speeches) if i % every != 0]
    return "".join(kept), "".join(held)


def prepare_speech_split(source_dir: str | Path, out_dir: str | Path, every: int = 10) -> Path:
    """Write ``out_dir/{train,val}.bin`` and ``meta.json``: the *training* split of the prepared
    character dataset ``source_dir`` divided by speech (:func:`split_speeches`), with the source's
    vocabulary (so the source's ``val.bin``, other plays, scores a model trained here). Up to date
    (nothing written) when ``out_dir`` was made from the same source split.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``source_dir`` is not prepared. ValueError: the source is not a
            character dataset, too short (see :func:`split_speeches`), or ``out_dir`` holds a
            training run. NotADirectoryError: ``out_dir`` is a file.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    meta = load_meta(source_dir)
    if meta.get("tokenizer") != "char":
        raise ValueError(f"{str(source_dir)!r} uses the {meta.get('tokenizer')!r} tokenizer; a speech split needs "
                         "a character dataset")
    source_sha = meta.get("train_sha256")
    try:
        old = load_meta(out_dir)
        if old.get("source", {}).get("train_sha256") == source_sha and old.get("source", {}).get("every") == every:
            return out_dir
    except (FileNotFoundError, ValueError):
        pass
    check_out_dir(out_dir, {}, force=True)  # never into a run directory (its own up-to-date check is above)
    tok = CharTokenizer.from_meta(meta)
    train_text, held_text = split_speeches(tok.decode(np.asarray(load_split(source_dir, "train")).tolist()), every)
    train, val = tok.encode_array(train_text), tok.encode_array(held_text)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / META_FILE).exists():  # never leave an old meta.json beside half-written new .bin files
        (out_dir / META_FILE).unlink()
    for name, arr in (("train", train), ("val", val)):
        atomic_write_bytes(out_dir / f"{name}.bin", arr.tobytes())
    new = {"format_version": FORMAT_VERSION, "dataset": out_dir.name, **tok.to_meta(), "dtype": "uint16",
           "n_train": int(len(train)), "n_val": int(len(val)),
           "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
           "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
           "source": {"kind": "speech_split", "dataset": str(source_dir), "train_sha256": source_sha,
                      "every": every}}
    atomic_write_bytes(out_dir / META_FILE, (json.dumps(new, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return out_dir


__all__ = ["prepare_speech_split", "split_speeches"]
