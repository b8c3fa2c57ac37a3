"""Tokenizers stored as plain JSON in a dataset's ``meta.json`` (no pickle).

``CharTokenizer`` is nanoGPT's shakespeare_char tokenizer: the vocabulary is the sorted set of
characters of the corpus, token id = rank of the character (nanoGPT's shakespeare_char).
``load_tokenizer`` dispatches on ``meta["tokenizer"]`` so that BPE tokenizers can be added to
``TOKENIZERS`` later without touching callers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .meta import load_meta

MAX_UINT16_VOCAB = 65535  # ids are stored as uint16; id 65535 is kept free


class CharTokenizer:
    """Character-level tokenizer: one token per Unicode code point of the vocabulary.

    Args:
        chars: the vocabulary, distinct single characters in sorted (code point) order; token
            ``i`` is ``chars[i]``.

    Raises:
        ValueError: ``chars`` is empty, holds an entry that is not one character, holds
            duplicates or is not sorted.
    """

    name = "char"

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("chars=[] is not valid; a character vocabulary needs at least one character")
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"chars must hold single characters; got {c!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not hold duplicates")
        if chars != sorted(chars):
            raise ValueError("chars must be sorted by code point (as sorted(set(text)) gives)")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.int64)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """Vocabulary = ``sorted(set(text))``. Raises ``ValueError`` for empty text."""
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "CharTokenizer":
        """Rebuild from a ``meta.json`` dict (keys ``tokenizer == "char"`` and ``chars``).

        Raises:
            ValueError: the meta is for another tokenizer, lacks ``chars`` or its ``vocab_size``
                disagrees with ``chars``.
        """
        if meta.get("tokenizer") != cls.name:
            raise ValueError(f"meta tokenizer={meta.get('tokenizer')!r} is not {cls.name!r}")
        if "chars" not in meta:
            raise ValueError("meta for the char tokenizer has no 'chars' list")
        tok = cls(meta["chars"])
        if "vocab_size" in meta and meta["vocab_size"] != tok.vocab_size:
            raise ValueError(
                f"meta vocab_size={meta['vocab_size']} disagrees with len(chars)={tok.vocab_size}")
        return tok

    def to_meta(self) -> dict:
        """``{"tokenizer": "char", "vocab_size": V, "chars": [...]}`` (JSON-serialisable)."""
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "chars": list(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def _unknown(self, text: str, position: int) -> ValueError:
        c = text[position]
        return ValueError(
            f"character {c!r} (U+{ord(c):04X}) at position {position} is not in the vocabulary "
            f"of this char tokenizer ({self.vocab_size} characters: "
            f"{''.join(self.chars)!r}); use only characters seen in the training text")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, shape (len(text),). Plain reference implementation.

        Raises:
            ValueError: a character of ``text`` is not in the vocabulary (named in the message).
        """
        ids = []
        for pos, c in enumerate(text):
            i = self.stoi.get(c)
            if i is None:
                raise self._unknown(text, pos)
            ids.append(i)
        return ids

    def encode_array(self, text: str, dtype=np.uint16) -> np.ndarray:
        """Fast vectorised ``encode`` for large corpora: int array of shape (len(text),).

        Equal to ``np.array(self.encode(text))`` (held equal by a test); same ``ValueError``.
        """
        if not text:
            return np.zeros(0, dtype=dtype)
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.searchsorted(self._codepoints, cps)
        ids_clipped = np.minimum(ids, self.vocab_size - 1)
        bad = np.flatnonzero(self._codepoints[ids_clipped] != cps)
        if bad.size:
            raise self._unknown(text, int(bad[0]))
        return ids.astype(dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of token ids (list, 1-D array or 1-D tensor).

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            out.append(self.chars[i])
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


TOKENIZERS = {"char": CharTokenizer}


def load_tokenizer(meta_or_dir: Mapping[str, Any] | str | Path):
    """Build the tokenizer a dataset was prepared with.

    Args:
        meta_or_dir: a ``meta.json`` dict, or a prepared data directory (its ``meta.json`` is read
            with :func:`energyformer.data.meta.load_meta`).

    Raises:
        FileNotFoundError / ValueError: see ``load_meta``; ``ValueError`` if ``meta["tokenizer"]``
            is not one of ``TOKENIZERS``.
    """
    if isinstance(meta_or_dir, (str, Path)):
        meta = load_meta(meta_or_dir)
    else:
        meta = meta_or_dir
    kind = meta.get("tokenizer")
    if kind not in TOKENIZERS:
        allowed = ", ".join(repr(k) for k in TOKENIZERS)
        raise ValueError(f"tokenizer={kind!r} in meta is not valid; expected one of {allowed}")
    return TOKENIZERS[kind].from_meta(meta)
