"""``energyformer prepare hf``: any corpus the ``datasets`` library reads, tokenized in shards (docs/data.md).

    prepare_hf(HFSettings(dataset="Skylion007/openwebtext", tokenizer="gpt2", num_proc=16))
    prepare_hf(HFSettings(dataset="corpus.jsonl", tokenizer="bpe", vocab_size=16384))

The source is a Hugging Face Hub dataset (streamed: nothing is downloaded in full first) or a
local file or folder: ``.jsonl`` / ``.json`` (one document per record, text in ``text_field``),
``.parquet`` (same), ``.txt`` (one document per file). Documents are read in order and written
in shards of ``shard_documents`` documents under ``OUT/shards/``: each shard is tokenized by
``num_proc`` processes, written atomically, then recorded in ``OUT/shards/progress.json``, so a
rerun after an interruption skips the finished shards (the same settings are required; other
settings start over). At the end the shards are joined into ``train.bin`` / ``val.bin`` (each
shard's last ``val_fraction`` of tokens goes to val, nanoGPT's positional split), ``meta.json``
is written last and the shards are removed.

Tokenizers: ``gpt2`` (GPT-2's BPE, 50,257 ids, ``<|endoftext|>`` = 50256 after each document),
``bpe`` (a byte-level BPE of ``vocab_size`` ids trained on the first ``bpe_train_documents``
documents, ``<|endoftext|>`` = id 0 after each document), ``char`` (the characters of the whole
corpus, one pass first; ``\\n`` after each document). Token files are uint16 when the vocabulary
has at most 65,535 ids, else uint32 (``meta["dtype"]``, read by :func:`energyformer.data.loader.load_split`).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .._validate import check_choice, check_float, check_int
from ..utils.io import atomic_write_bytes
from .meta import FORMAT_VERSION, META_FILE, dtype_for_vocab
from .shakespeare import sha256_file

HF_TOKENIZERS = ("gpt2", "bpe", "char")
EOT = "<|endoftext|>"
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
PROGRESS_FILE = "progress.json"
SHARDS_DIR = "shards"


@dataclass
class HFSettings:
    """What ``prepare hf`` reads and how it tokenizes.

    Args:
        dataset: a Hugging Face Hub dataset name (openwebtext, cerebras/SlimPajama-627B) or a local
            .jsonl/.json/.parquet/.txt file or folder of such files.
        config: the Hub dataset's configuration name (e.g. sample-10BT), if it has several.
        split: the split to read.
        text_field: the column that holds each document's text.
        tokenizer: gpt2, bpe (trained on the corpus) or char.
        vocab_size: bpe vocabulary size (ids above 65535 are written as uint32).
        bpe_train_documents: bpe: train on the first this many documents.
        val_fraction: share of each shard's tokens (its end) kept for validation.
        shard_documents: documents per shard (the unit of resuming).
        num_proc: tokenizing processes (default: the CPU count, at most 16).
        max_documents: read at most this many documents (null: all).

    Raises:
        ValueError: a value out of range or an unknown tokenizer (named).
    """

    dataset: str
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    tokenizer: str = "gpt2"
    vocab_size: int = 32768
    bpe_train_documents: int = 100_000
    val_fraction: float = 0.0005
    shard_documents: int = 10_000
    num_proc: int | None = None
    max_documents: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset.strip():
            raise ValueError(f"dataset={self.dataset!r} must name a Hub dataset or a local file/folder")
        check_choice("tokenizer", self.tokenizer, HF_TOKENIZERS)
        check_int("vocab_size", self.vocab_size, 258, maximum=2**32 - 1)
        check_int("bpe_train_documents", self.bpe_train_documents, 1)
        check_float("val_fraction", self.val_fraction, 0.0, strict=True, maximum=0.5)
        check_int("shard_documents", self.shard_documents, 1)
        if self.num_proc is not None:
            check_int("num_proc", self.num_proc, 1)
        if self.max_documents is not None:
            check_int("max_documents", self.max_documents, 1)

    @property
    def processes(self) -> int:
        return self.num_proc or max(1, min(16, os.cpu_count() or 1))


def default_out_dir(dataset: str, out_root: str | Path = "data") -> Path:
    """``out_root/<last part of the name without suffix>``: ``data/openwebtext``, ``data/corpus``."""
    return Path(out_root) / Path(dataset.rstrip("/")).name.split(".")[0]


# ----------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------

def _expected_records(builder: str, text_field: str) -> str:
    """What a local file of ``builder`` holds, for error messages."""
    return {"json": f"one JSON object per line with the document's text in {text_field!r} (--text-field)",
            "parquet": f"a parquet table with a {text_field!r} column (--text-field)",
            "text": "the text of one document"}[builder]


def _local_files(path: Path, text_field: str = "text") -> list[Path]:
    """The data files of a local source: the file itself, or a folder's files in sorted order.

    Raises:
        FileNotFoundError: a folder without data files.
        ValueError: files of several kinds, or every file empty (named).
    """
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS)
    if not files:
        raise FileNotFoundError(f"{str(path)!r} holds no {'/'.join(LOCAL_BUILDERS)} files")
    kinds = {LOCAL_BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"dataset={str(path)!r}: expected .jsonl/.json, .parquet or .txt files of one kind; "
                         f"got suffixes {sorted({p.suffix for p in files})}")
    if all(f.stat().st_size == 0 for f in files):
        what = f"{str(path)!r} is empty" if path.is_file() else \
            f"every file in {str(path)!r} is empty ({', '.join(repr(f.name) for f in files[:3])}" \
            f"{', ...' if len(files) > 3 else ''})"
        raise ValueError(f"{what}; expected {_expected_records(kinds.pop(), text_field)}")
    return files


def source_identity(s: HFSettings) -> dict[str, Any]:
    """What names the source in meta.json: the Hub name, or the local files and their sha256."""
    path = Path(s.dataset)
    ident: dict[str, Any] = {"kind": "hf", "dataset": s.dataset, "config": s.config, "split": s.split,
                             "text_field": s.text_field, "max_documents": s.max_documents}
    if path.exists():
        ident["files_sha256"] = [sha256_file(p) for p in _local_files(path, s.text_field)]
    return ident


def iter_documents(s: HFSettings, skip: int = 0) -> Iterator[str]:
    """The texts of the source's documents in order, after the first ``skip`` (a streamed dataset).

    Raises:
        FileNotFoundError: a local folder without data files.
        ValueError: no column ``text_field`` (the columns are listed) or a non-text value; local
            files that hold no document, or one that cannot be read: bytes that are not UTF-8, a
            line that is not JSON, a broken parquet file (one line naming the file, the line or
            byte offset, and what was expected; :func:`read_error`).
    """
    from datasets import load_dataset

    path = Path(s.dataset)
    if not path.exists():
        ds = load_dataset(s.dataset, s.config, split=s.split, streaming=True)
        yield from _texts(s, ds, skip, local=False)
        return
    files = _local_files(path, s.text_field)
    builder = LOCAL_BUILDERS[files[0].suffix]
    extra = {"sample_by": "document"} if builder == "text" else {}
    with _datasets_errors_unlogged():  # datasets logs a read error before raising it: we name the file instead
        try:
            try:
                ds = load_dataset(builder, data_files=[str(f) for f in files], split=s.split, streaming=True,
                                  **extra)
            except (UnicodeDecodeError, ValueError) as e:  # (it reads the first file for the columns)
                raise _ReadError() from e
            yield from _texts(s, ds, skip, local=True)
        except StopIteration:  # (datasets' json reader on files of blank lines, raised inside a generator)
            raise ValueError(f"{s.dataset!r} holds no documents; expected "
                             f"{_expected_records(builder, s.text_field)}") from None
        except _ReadError as e:
            raise ValueError(read_error(files, builder, s.text_field, e.__cause__ or e)) from None


class _ReadError(Exception):
    """A local file's documents could not be read (the ``datasets`` error is its ``__cause__``)."""


_UNLOGGED: dict[str, Any] = {"depth": 0, "level": None}  # readers of local files alive, the level to restore


@contextlib.contextmanager
def _datasets_errors_unlogged() -> Iterator[None]:
    """``datasets`` logs "Failed to load JSON from file ..." before it raises: while local files are
    read (their errors :func:`read_error` reports in one line) its log stays quiet; the first
    reader to start saves the level, the last to end restores it."""
    from datasets.utils import logging as datasets_logging

    if _UNLOGGED["depth"] == 0:
        _UNLOGGED["level"] = datasets_logging.get_verbosity()
        datasets_logging.set_verbosity(logging.CRITICAL + 1)
    _UNLOGGED["depth"] += 1
    try:
        yield
    finally:
        _UNLOGGED["depth"] -= 1
        if _UNLOGGED["depth"] == 0:
            datasets_logging.set_verbosity(_UNLOGGED["level"])


def read_error(files: list[Path], builder: str, text_field: str, error: BaseException) -> str:
    """One line for a local source that ``datasets`` could not read: the first file, line or byte
    that is not UTF-8, not JSON (one object per line for ``.jsonl``), or not parquet, with what was
    expected; else the library's message with the source named. Reads the files again (an error path)."""
    for f in files:
        if builder == "parquet":
            import pyarrow.parquet as pq

            try:
                pq.ParquetFile(f)
            except Exception as e:  # noqa: BLE001  (pyarrow raises several kinds)
                return f"{str(f)!r} is not a readable parquet file ({' '.join(str(e).split())})"
            continue
        offset, bad_json = 0, None
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return (f"{str(f)!r} is not valid UTF-8: byte {raw[e.start:e.start + 1]!r} at offset "
                            f"{offset + e.start} (line {lineno}); convert it first, e.g. "
                            f"`iconv -f latin1 -t utf-8 {f.name}`")
                offset += len(raw)
                if builder == "json" and bad_json is None and line.strip():
                    try:
                        json.loads(line.rstrip("\r\n"))
                    except json.JSONDecodeError as e:
                        bad_json = (lineno, e)
        if bad_json is not None:
            lineno, e = bad_json
            if f.suffix == ".json":  # one JSON document (not JSON Lines) may span lines
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                    continue
                except json.JSONDecodeError as whole:
                    lineno, e = whole.lineno, whole
            return (f"{str(f)!r} line {lineno} is not valid JSON ({e.msg} at column {e.colno}); expected "
                    f"{_expected_records(builder, text_field)}")
    return f"{', '.join(repr(str(f)) for f in files[:3])} could not be read ({' '.join(str(error).split())})"


def _texts(s: HFSettings, ds: Any, skip: int, local: bool) -> Iterator[str]:
    """The ``text_field`` of each row of the streamed dataset ``ds`` (after ``skip``, up to
    ``max_documents``); with ``local``, a read error comes out as :class:`_ReadError`."""
    limit = None if s.max_documents is None else max(0, s.max_documents - skip)
    if skip:
        ds = ds.skip(skip)
    rows = iter(itertools.islice(ds, limit))
    i = -1
    while True:
        i += 1
        try:
            row = next(rows)
        except StopIteration:
            return
        except (UnicodeDecodeError, ValueError) as e:  # (pyarrow's ArrowInvalid is a ValueError)
            if not local:
                raise
            raise _ReadError() from e
        if s.text_field not in row:
            raise ValueError(f"text_field={s.text_field!r} is not a column of {s.dataset!r}; "
                             f"its columns: {sorted(row)}")
        text = row[s.text_field]
        if not isinstance(text, str):
            raise ValueError(f"document {skip + i} of {s.dataset!r}: {s.text_field!r} holds "
                             f"{type(text).__name__}, not text")
        yield text


# ----------------------------------------------------------------------------------------------
# Tokenizing in processes
# ----------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tok_meta: dict[str, Any]) -> None:
    from .tokenizers import load_tokenizer

    tok = load_tokenizer(tok_meta)
    _WORKER["tok"] = tok
    _WORKER["dtype"] = np.dtype(dtype_for_vocab(tok.vocab_size))
    _WORKER["eot"] = _separator(tok)


def _separator(tok: Any) -> list[int]:
    """The ids appended after every document: ``<|endoftext|>`` (gpt2, bpe) or ``\\n`` (char)."""
    if tok.name == "gpt2":
        return [tok.EOT]
    if tok.name == "bpe":
        return [tok.tokenizer.token_to_id(EOT)]
    return tok.encode("\n")


def _encode_documents(texts: list[str]) -> np.ndarray:
    tok, eot = _WORKER["tok"], _WORKER["eot"]
    ids = [i for text in texts for i in (*tok.encode(text), *eot)]
    return np.asarray(ids, dtype=_WORKER["dtype"])


def _chunks(items: list[str], n: int) -> list[list[str]]:
    size = max(1, -(-len(items) // n))
    return [items[i:i + size] for i in range(0, len(items), size)]


class ShardTokenizer:
    """Tokenize lists of documents with ``processes`` worker processes (inline for one).

    Args:
        tok_meta: the tokenizer's ``to_meta()`` (each worker rebuilds it with ``load_tokenizer``).
        processes: worker processes.
    """

    def __init__(self, tok_meta: dict[str, Any], processes: int):
        _init_worker(tok_meta)
        self.pool = None
        if processes > 1:
            import multiprocessing

            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            self.pool = multiprocessing.get_context(method).Pool(processes, _init_worker, (tok_meta,))
        self.processes = processes

    def __call__(self, texts: list[str]) -> np.ndarray:
        """The ids of ``texts``, each followed by the separator, shape (n_tokens,)."""
        if self.pool is None:
            return _encode_documents(texts)
        parts = self.pool.map(_encode_documents, _chunks(texts, 4 * self.processes))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=_WORKER["dtype"])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


# ----------------------------------------------------------------------------------------------
# The tokenizer of the corpus
# ----------------------------------------------------------------------------------------------

def build_tokenizer(s: HFSettings, say: Callable[[str], None]) -> dict[str, Any]:
    """The tokenizer's ``to_meta()``: GPT-2's, a BPE trained on the first documents, or the chars of all."""
    from .english import train_bpe
    from .tokenizers import BPETokenizer, CharTokenizer, GPT2Tokenizer

    if s.tokenizer == "gpt2":
        return GPT2Tokenizer().to_meta()
    if s.tokenizer == "bpe":
        say(f"training a byte-level BPE (vocab {s.vocab_size:,}) on the first {s.bpe_train_documents:,} documents")
        docs = itertools.islice(iter_documents(s), s.bpe_train_documents)
        bpe = train_bpe(docs, s.vocab_size, special_tokens=[EOT], max_vocab=2**32 - 1)
        return BPETokenizer(bpe.to_str()).to_meta()
    say("reading the corpus once for its characters")
    chars = {"\n"}
    for text in iter_documents(s):
        chars.update(text)
    return CharTokenizer(sorted(chars)).to_meta()


# ----------------------------------------------------------------------------------------------
# Shards, resuming and the final files
# ----------------------------------------------------------------------------------------------

def _identity(s: HFSettings) -> dict[str, Any]:
    """The settings the shards depend on (not ``num_proc``: any process count gives the same ids; not
    ``val_fraction``: the split is made when the shards are joined)."""
    bpe_only = ("vocab_size", "bpe_train_documents")
    return {k: v for k, v in asdict(s).items()
            if k not in ("num_proc", "val_fraction") and (s.tokenizer == "bpe" or k not in bpe_only)}


def _load_progress(shards: Path, settings: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any] | None:
    """The progress of an interrupted prepare with the same settings whose shards are all intact, else None."""
    path = shards / PROGRESS_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    if state.get("settings") != settings:
        say(f"{shards} holds shards of other settings; starting over")
        return None
    for shard in state["shards"]:
        f = shards / shard["file"]
        if not f.is_file() or sha256_file(f) != shard["sha256"]:
            say(f"{f} is missing or corrupt; starting over")
            return None
    return state


def write_shard(shards: Path, state: dict[str, Any], n_documents: int, ids: np.ndarray) -> None:
    """Write shard ``len(state["shards"])`` atomically, then record it in progress.json."""
    name = f"{len(state['shards']):05d}.bin"
    atomic_write_bytes(shards / name, ids.tobytes())
    state["shards"].append({"file": name, "n_documents": n_documents, "n_tokens": int(ids.size),
                            "sha256": hashlib.sha256(ids.tobytes()).hexdigest()})
    atomic_write_bytes(shards / PROGRESS_FILE, (json.dumps(state, indent=1) + "\n").encode("utf-8"))


def _tokenize_shards(s: HFSettings, state: dict[str, Any], shards: Path, progress: bool | None) -> None:
    from tqdm.auto import tqdm

    done_docs = sum(sh["n_documents"] for sh in state["shards"])
    docs = iter_documents(s, skip=done_docs)
    tokenizer = ShardTokenizer(state["tokenizer"], s.processes)
    bar = tqdm(desc="tokenize", unit="tok", unit_scale=True, dynamic_ncols=True,
               initial=sum(sh["n_tokens"] for sh in state["shards"]),
               disable=(not progress) if progress is not None else None)
    try:
        while batch := list(itertools.islice(docs, s.shard_documents)):
            ids = tokenizer(batch)
            write_shard(shards, state, len(batch), ids)
            done_docs += len(batch)
            bar.update(int(ids.size))
            bar.set_postfix_str(f"{done_docs:,} documents, {len(state['shards'])} shards")
    finally:
        tokenizer.close()
        bar.close()
    state["complete"] = True
    atomic_write_bytes(shards / PROGRESS_FILE, (json.dumps(state, indent=1) + "\n").encode("utf-8"))


def _join_shards(out_dir: Path, shards: Path, state: dict[str, Any], val_fraction: float,
                 dtype: np.dtype) -> dict[str, Any]:
    """Write ``train.bin`` / ``val.bin`` from the shards (each shard split by position); their sizes and sha256."""
    from ..utils.io import atomic_path
    from .prepare import split_sizes

    out: dict[str, Any] = {}
    for split in ("train", "val"):
        digest, n = hashlib.sha256(), 0
        with atomic_path(out_dir / f"{split}.bin") as tmp, open(tmp, "wb") as f:
            for shard in state["shards"]:
                ids = np.fromfile(shards / shard["file"], dtype=dtype)
                n_train, _ = split_sizes(ids.size, val_fraction)
                part = (ids[:n_train] if split == "train" else ids[n_train:]).tobytes()
                f.write(part)
                digest.update(part)
                n += len(part) // dtype.itemsize
        out[f"n_{split}"], out[f"{split}_sha256"] = n, digest.hexdigest()
    return out


def _expected(s: HFSettings, out_dir: Path) -> dict[str, Any]:
    ident = source_identity(s)
    return {"dataset": out_dir.name, "tokenizer": s.tokenizer, "val_fraction": s.val_fraction,
            "hf_settings": _identity(s),
            **{f"source.{k}": v for k, v in ident.items()}}


def prepare_hf(s: HFSettings, out_dir: str | Path | None = None, out_root: str | Path = "data",
               force: bool = False, progress: bool | None = None, verbose: bool = True) -> Path:
    """Build ``out_dir/{train.bin, val.bin, meta.json}`` from ``s.dataset`` (module docstring).

    Args:
        s: the settings.
        out_dir: the dataset folder (default :func:`default_out_dir`).
        out_root: parent folder of the default dataset folder.
        force: rebuild even if up to date (finished shards of the same settings are still reused),
            and replace a dataset of other settings (never a training run:
            ``energyformer.data.prepare.check_out_dir``).
        progress: show the tokens/s progress bar (None: only on a terminal).
        verbose: print what happens.

    Returns:
        the dataset folder.

    Raises:
        ValueError: a missing text column, too few tokens for the validation split; ``out_dir``
            holds a training run, or (without ``force``) a dataset of other settings.
        NotADirectoryError: ``out_dir`` is a file.
        FileNotFoundError: a local folder without data files.
        DataPreparationError: gpt2: the ranks file cannot be fetched.
    """
    from .prepare import rebuild_reason

    say = print if verbose else (lambda msg: None)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(s.dataset, out_root)
    expected = _expected(s, out_dir)
    if rebuild_reason(out_dir, expected, force) is None:
        say(f"{out_dir} is up to date; pass --force to rebuild")
        return out_dir
    shards = out_dir / SHARDS_DIR
    settings = _identity(s)
    state = _load_progress(shards, settings, say)
    if state is None:
        shutil.rmtree(shards, ignore_errors=True)
        shards.mkdir(parents=True)
        state = {"settings": settings, "tokenizer": build_tokenizer(s, say), "shards": [], "complete": False}
    elif state["shards"]:
        say(f"resuming after {len(state['shards'])} finished shards in {shards}")
    if not state.get("complete"):
        _tokenize_shards(s, state, shards, progress)
    return _finish(out_dir, shards, state, s, expected, say)


def _finish(out_dir: Path, shards: Path, state: dict[str, Any], s: HFSettings, expected: dict[str, Any],
            say: Callable[[str], None]) -> Path:
    if not any(sh["n_documents"] for sh in state["shards"]):  # (files of blank lines)
        builder = LOCAL_BUILDERS.get(Path(s.dataset).suffix)
        raise ValueError(f"{s.dataset!r} holds no documents"
                         + (f"; expected {_expected_records(builder, s.text_field)}" if builder else ""))
    vocab_size = int(state["tokenizer"]["vocab_size"])
    dtype = np.dtype(dtype_for_vocab(vocab_size))
    (out_dir / META_FILE).unlink(missing_ok=True)
    files = _join_shards(out_dir, shards, state, s.val_fraction, dtype)
    if files["n_train"] < 2 or files["n_val"] < 2:
        raise ValueError(f"{s.dataset!r} gave {files['n_train']} train and {files['n_val']} val tokens; each "
                         f"split needs at least 2 (more documents or a larger val_fraction)")
    n_docs = sum(sh["n_documents"] for sh in state["shards"])
    meta = {"format_version": FORMAT_VERSION, "dataset": out_dir.name, **state["tokenizer"],
            "dtype": dtype.name, "val_fraction": s.val_fraction, **files, "n_documents": n_docs,
            "hf_settings": expected["hf_settings"],
            "source": {k.split(".", 1)[1]: v for k, v in expected.items() if k.startswith("source.")}}
    atomic_write_bytes(out_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    shutil.rmtree(shards, ignore_errors=True)
    say(f"wrote {out_dir}: {n_docs:,} documents, {s.tokenizer} vocab {vocab_size:,} ({dtype.name}), "
        f"train {files['n_train']:,} / val {files['n_val']:,} tokens")
    return out_dir
