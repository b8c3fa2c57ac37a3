"""Atomic file writes: the one place that writes a file so that readers never see half of it.

Every writer stages the new content in a temporary file in the target's own directory (the
same filesystem, so ``os.replace`` is atomic), flushes it to disk with ``fsync`` and then
replaces the target. A crash leaves either the old file or the new one, never a mix, and no
temporary file survives a failed write. Files get the usual permissions (``0o666 & ~umask``),
not the ``0o600`` of ``tempfile.mkstemp``.

    atomic_write_text(run_dir / "config.yaml", text)
    with atomic_path(run_dir / "model.safetensors") as tmp:   # for writers that need a path
        save_file(tensors, str(tmp))
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_path_for(path: str | Path) -> Path:
    """A new empty temporary file next to ``path`` (its parent directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def usual_mode(path: str | Path) -> None:
    """Give a file ``0o666 & ~umask`` and a directory ``0o777 & ~umask`` (what ``open`` and
    ``mkdir`` give), undoing the ``0o600``/``0o700`` of ``mkstemp``, ``mkdtemp`` and safetensors."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


def commit(tmp: str | Path, path: str | Path) -> Path:
    """Give ``tmp`` normal permissions, fsync it and ``os.replace`` it onto ``path``."""
    usual_mode(tmp)  # mkstemp (and safetensors) create 0600 files
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on normal exit it replaces ``path`` atomically.

    If the body raises (or the replace fails), ``path`` is left as it was and the temporary
    file is removed. Nest two of these to stage two files and replace them one after the other
    (the inner one is replaced first).
    """
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically; returns ``path``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, **dumps_kw: Any) -> Path:
    """Write ``obj`` as JSON (``indent=2`` unless given, trailing newline) atomically."""
    dumps_kw.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dumps_kw) + "\n")


def read_json_object(path: str | Path, *, missing: str, corrupt: str) -> dict[str, Any]:
    """Read a file holding one JSON object: the one reader behind ``meta.json`` and ``summary.json``.

    Args:
        path: the file.
        missing: what the ``FileNotFoundError`` adds after ``"<path> not found: "``.
        corrupt: what the ``ValueError`` adds after ``"<path> is corrupt (<why>); "``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8, not valid JSON, or not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {missing}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt (not valid JSON: {exc}); {corrupt}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} is corrupt (not valid JSON: expected an object, got {type(obj).__name__}); "
                         f"{corrupt}")
    return obj
