"""``energyformer prepare listops|gp|english``: the datasets of the papers' experiments.

    prepare_task_data("listops", seed=0)                       # data/listops
    prepare_task_data("gp", length_scale=0.3, noise=0.05)      # data/gp
    prepare_task_data("english", tokenizer="gpt2")             # data/english

``options`` are the fields of :class:`~energyformer.data.listops.ListOpsSettings` (listops),
:class:`~energyformer.data.gp.GPSettings` (gp), or ``tokenizer``, ``vocab_size``, ``texts``,
``archive``, ``cache_dir`` (english, :func:`~energyformer.data.english.prepare_english`).
A directory already built with the same options is left as it is (``force`` rebuilds it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import gp, listops
from .english import prepare_english
from .prepare import check_out_dir, rebuild_reason
from .shakespeare import sha256_file

TASK_DATASETS = ("listops", "gp", "english")


def _settings(cls: type, name: str, options: dict[str, Any]) -> Any:
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"option(s) {unknown} are not valid for `prepare {name}`; expected some of {allowed}")
    return cls(**options)


def prepare_task_data(name: str, out_root: str | Path = "data", out_dir: str | Path | None = None,
                      force: bool = False, verbose: bool = True, **options: Any) -> Path:
    """Build the dataset ``name`` into ``out_dir`` (default ``out_root/name``).

    Returns:
        the dataset folder.

    Raises:
        ValueError: an unknown ``name`` or option, or an invalid option value (named); ``out_dir``
            holds a training run, or (without ``force``) a dataset of other settings
            (``energyformer.data.prepare.check_out_dir``).
        NotADirectoryError: ``out_dir`` is a file.
        FileNotFoundError / DataPreparationError: english: a missing ``--text`` file, a failed download.
    """
    if name not in TASK_DATASETS:
        raise ValueError(f"dataset={name!r} is not valid; expected one of {TASK_DATASETS}")
    say = print if verbose else (lambda msg: None)
    out = Path(out_dir) if out_dir is not None else Path(out_root) / name
    options = {k: v for k, v in options.items() if v is not None}
    if name == "english":
        allowed = ("tokenizer", "vocab_size", "texts", "archive", "cache_dir")
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"option(s) {unknown} are not valid for `prepare english`; expected some of {list(allowed)}")
        return prepare_english(out, force=force, say=say, **options)
    if name == "listops":
        s = _settings(listops.ListOpsSettings, name, options)
        expected = listops.expected_meta(s)
        fresh = rebuild_reason(out, expected, force) is None and (out / "test.jsonl").is_file() \
            and sha256_file(out / "test.jsonl") == _meta_value(out, "test_sha256")
        if fresh:
            say(f"{out} is up to date; pass --force to rebuild")
            return out
        meta = listops.write_listops(out, s)
        say(f"wrote {out}: {listops.describe(meta)}")
        return out
    s = _settings(gp.GPSettings, name, options)
    check_out_dir(out, {"dataset": "gp", "settings": dataclasses.asdict(s)}, force)
    if not force and gp.gp_up_to_date(out, s):
        say(f"{out} is up to date; pass --force to rebuild")
        return out
    meta = gp.write_gp(out, s)
    say(f"wrote {out}: {gp.describe(meta)}")
    return out


def _meta_value(out: Path, key: str) -> Any:
    from .meta import load_meta

    try:
        return load_meta(out).get(key)
    except (FileNotFoundError, ValueError):
        return None
