"""What the training loop checks and decides before step 1, so that a run fails before it writes.

The data against the model (:func:`check_splits`), the memory (:func:`check_memory`), the run
directory's lock (:func:`locked`), where a run starts (:func:`resume_dir`: a fresh run or a
checkpoint to resume; :func:`check_init_from`: the weights a fine-tuning starts from), whether a
checkpoint belongs to this run (:func:`check_resumable`) and the train config a resumed run
continues with (:func:`resolve_resumed_train`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from energyformer.models.config import ModelConfig
from energyformer.models.registry import build_model
from energyformer.runs import checkpoint as ckpt
from energyformer.runs import rundir, sharded
from energyformer.runs.config import DEPTH_TRAIN_KEYS, DERIVED_TRAIN_KEYS, RunConfig, TrainConfig
from energyformer.train import distributed as dist
from energyformer.utils.derived import derived_rules, given_values

# train settings whose change on resume is not worth a word (where and how, not what)
_QUIET_ON_RESUME = ("out_dir", "resume", "device", "num_threads", "compile", "tensorboard")
# bytes per parameter while training in float32: weights, gradients, AdamW's two moments
_TRAIN_BYTES_PER_PARAM = 16



def check_splits(splits: dict[str, Any], data_dir: Path, vocab_size: int, block_size: int) -> None:
    from energyformer.data import check_token_ids

    for name, data in splits.items():
        path = data_dir / f"{name}.bin"
        if len(data) < block_size + 1:
            raise ValueError(f"{path} has {len(data)} tokens but model.block_size={block_size} needs at least "
                             f"{block_size + 1}; use a smaller --model.block_size or more text")
        check_token_ids(data, vocab_size, path)


def check_memory(mc: Any, device: torch.device, info: dist.DistInfo) -> None:
    """Refuse a model whose weights, gradients and AdamW state alone exceed the device's memory."""
    with torch.device("meta"):
        n = build_model(mc).num_params()
    need = n * _TRAIN_BYTES_PER_PARAM / (info.world_size if info.parallel == "fsdp" else 1)
    have = memory_bytes(device)
    if have is not None and need > have:
        raise ValueError(f"the model has {n:,} parameters: training needs at least {need / 2**30:.1f} GiB "
                         f"(weights, gradients, AdamW state) but {device} has {have / 2**30:.1f} GiB; reduce "
                         "model.d_model, model.n_layers or model.vocab_size")


def warn_schedule(tc: TrainConfig) -> None:
    """Warn (``UserWarning``, one line) when the warmup is longer than the whole run: the learning
    rate then never reaches ``train.learning_rate``."""
    if 0 < tc.max_steps < tc.warmup_steps:
        from energyformer.train.optim import lr_at

        peak = lr_at(tc.max_steps - 1, tc)
        warnings.warn(f"train.warmup_steps={tc.warmup_steps} is longer than train.max_steps={tc.max_steps}: "
                      f"the learning rate peaks at {peak:.3g} at the last step and never reaches "
                      f"train.learning_rate={tc.learning_rate:g}; lower train.warmup_steps", UserWarning,
                      stacklevel=2)


def memory_bytes(device: torch.device) -> float | None:
    try:
        if device.type == "cuda":
            return float(torch.cuda.mem_get_info(device)[1])
        if device.type == "cpu":
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass
    return None


@contextlib.contextmanager
def locked(out_dir: Path, info: dist.DistInfo):
    """Rank 0 holds the run directory's lock; a directory this call created is removed on a
    failure before anything but the lock was written into it."""
    if not info.is_main:
        yield
        return
    created = not out_dir.exists()
    try:
        with rundir.lock_run_dir(out_dir):
            yield
    except PermissionError as e:
        raise ValueError(f"train.out_dir={str(out_dir)!r} is not writable ({e.strerror}); choose another "
                         "--train.out_dir") from None
    except BaseException:
        if created and out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= {rundir.LOCK_FILE}:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def resume_dir(tc: TrainConfig, out_dir: Path) -> Path | None:
    """Where to resume from, or None for a fresh run.

    With ``resume="auto"`` an out_dir that holds checkpoint files but no complete checkpoint
    (marker missing or unreadable, a listed file gone) is an error rather than a fresh start:
    a fresh start deletes those files, and they may be the only copy of trained weights.
    """
    if tc.resume == "never":
        return None
    if tc.resume == "auto":
        if ckpt.find_checkpoint(out_dir) is not None:  # its train state was checked before the data was read
            return out_dir
        left = ckpt.has_checkpoint_files(out_dir)
        if left:
            raise ValueError(
                f"train.out_dir={str(out_dir)!r} holds checkpoint files {left} but no complete checkpoint, so "
                "train.resume='auto' cannot continue from it; use --train.resume never to start over "
                "(this deletes them) or choose another --train.out_dir")
        return None
    path = Path(tc.resume)
    if ckpt.find_checkpoint(path) is None:
        raise FileNotFoundError(f"train.resume={tc.resume!r}: no complete checkpoint there (expected "
                                f"{rundir.MARKER_FILE} and the files it lists)")
    require_train_state(path)
    return path


def train_on_hint(run_dir: str | Path) -> str:
    """How to train further from the run directory ``run_dir``, for error messages: resume it
    (when it has a train state) or fine-tune its weights in a new run (``train.init_from``)."""
    run_dir = Path(run_dir)
    config = run_dir / rundir.CONFIG_FILE
    fine_tune = (f"to fine-tune it, start a new run from its weights: energyformer train {config} "
                 f"--train.init_from {run_dir} --train.out_dir NEW_RUN_DIR --data.dataset NAME")
    if (ckpt.checkpoint_dir(run_dir) / rundir.STATE_FILE).is_file():
        return f"to continue it: energyformer train {config} --train.out_dir {run_dir}; {fine_tune}"
    source = (ckpt.find_checkpoint(run_dir) or {}).get("imported_from")
    made = f"made by `energyformer import-hf` from {source!r}" if source else f"no {rundir.STATE_FILE}"
    return f"it holds weights but no training state ({made}), so training cannot resume it; {fine_tune}"


def require_train_state(run_dir: Path) -> None:
    """Raise ``ValueError`` (saying how to fine-tune) if the checkpoint of ``run_dir`` holds
    weights but no train state, as a run written by ``energyformer import-hf`` does."""
    if not (ckpt.checkpoint_dir(run_dir) / rundir.STATE_FILE).is_file():
        raise ValueError(f"{str(run_dir)!r}: {train_on_hint(run_dir)}")


def keep_init_from(saved: TrainConfig, new: TrainConfig, run_dir: Path, explicit: frozenset[str] | None
                    ) -> TrainConfig:
    """A resumed run keeps the ``init_from`` it started from; naming another one is an error
    (the weights come from the checkpoint being resumed)."""
    if new.init_from != saved.init_from and new.init_from is not None and "init_from" in (explicit or ()):
        raise ValueError(f"train.init_from={new.init_from!r} starts a fresh run, but {str(run_dir)!r} holds a "
                         "checkpoint that this run resumes; use --train.resume never to start over (this deletes "
                         "that checkpoint) or choose another --train.out_dir")
    return dataclasses.replace(new, init_from=saved.init_from)


def check_init_from(init_dir: Path, run_cfg: RunConfig, meta: dict[str, Any], out_dir: Path) -> Path:
    """``init_dir`` after checking that its weights can start this run: another directory than
    ``out_dir``, weights present, the same model (dropout aside) and the same vocabulary."""
    from energyformer.data import identity_change, vocab_identity

    if init_dir.resolve() == out_dir.resolve():
        raise ValueError(f"train.init_from={str(init_dir)!r} is train.out_dir; a fresh run there deletes the "
                         "weights it would start from: choose another --train.out_dir")
    try:
        saved = rundir.read_run_config(init_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"train.init_from={str(init_dir)!r}: {e}") from None
    weights = ckpt.weights_path(init_dir)
    if not weights.is_file() and not sharded.has_shards(weights.parent):
        raise FileNotFoundError(f"train.init_from={str(init_dir)!r}: no weights there ({str(weights)!r} not found)")
    a, b = saved.model.to_dict(), run_cfg.model.to_dict()
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k != "dropout" and a.get(k) != b.get(k)}
    if diff:
        raise ValueError(f"train.init_from={str(init_dir)!r} holds a different model (its vs this run's: {diff}); "
                         f"train with its model section, e.g. energyformer train {init_dir / rundir.CONFIG_FILE} "
                         f"--train.init_from {init_dir} --train.out_dir NEW_RUN_DIR --data.dataset NAME")
    if (init_dir / rundir.META_FILE).is_file():
        saved_meta = rundir.read_run_meta(init_dir)
        change = identity_change(vocab_identity(saved_meta), vocab_identity(meta), saved_meta, meta)
        if change:
            raise ValueError(f"the data in {str(run_cfg.data.path)!r} are not tokenized like the run "
                             f"train.init_from={str(init_dir)!r}: {change}; prepare the data with its tokenizer")
    return init_dir


def given_keys(cfg: Any, explicit: frozenset[str] | None) -> set[str]:
    """The fields of the config ``cfg`` a resume compares with the run's: the keys ``explicit`` names
    (what the recipe or the command line gave) and every field but the derived ones that ``cfg`` left
    to their rule (:func:`~energyformer.utils.derived.given_values`). The derived ones left out are
    the run's to keep."""
    return set(given_values(cfg)) | set(explicit or ())


def check_resumable(run_dir: Path, run_cfg: RunConfig, identity: dict[str, Any], meta: dict[str, Any]) -> RunConfig:
    """The saved run config, after checking that the data (first: a changed vocabulary changes
    the model's vocab_size too) and the model are the run's: the model values this run was given
    (:func:`given_keys`: every value but the derived ones left to their rule) must be the run's; the
    derived values it left to their rule are the run's (:func:`resolve_resumed_model`)."""
    from energyformer.data import identity_change, vocab_identity

    saved = rundir.read_run_config(run_dir)
    marker = ckpt.find_checkpoint(run_dir) or {}
    saved_meta = rundir.read_run_meta(run_dir) if (run_dir / rundir.META_FILE).is_file() else None
    recorded = marker.get("data") or (vocab_identity(saved_meta) if saved_meta else None)
    if isinstance(recorded, dict):
        change = identity_change(recorded, identity, saved_meta, meta)
        if change:
            raise ValueError(f"the data in {str(run_cfg.data.path)!r} differ from the data run {str(run_dir)!r} "
                             f"was trained on: {change}; resume on the same data, or use --train.resume never "
                             "to start over or another --train.out_dir")
    a, b = saved.model.to_dict(), run_cfg.model.to_dict()
    compared = {"arch"} | given_keys(run_cfg.model, (run_cfg.explicit or {}).get("model"))
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k in compared and a.get(k) != b.get(k)}
    if diff:
        raise ValueError(f"{str(run_dir)!r} holds a checkpoint of a different model (saved vs now: {diff}); "
                         "use --train.resume never to start over or choose another --train.out_dir")
    return saved


def resolve_resumed_model(saved: ModelConfig, new: ModelConfig) -> tuple[ModelConfig, str]:
    """The model config a resumed run continues with (the run's: :func:`check_resumable` has checked
    that it has every value ``new`` was given), and the derived values it keeps that ``new`` would have
    derived otherwise (e.g. after a change of the rule), in words."""
    kept = [f"model.{k}={getattr(saved, k)}" for k in derived_rules(type(saved))
            if getattr(saved, k) != getattr(new, k, None)]
    return saved, ("kept the run's " + ", ".join(kept) if kept else "")


def resolve_resumed_train(saved: TrainConfig, new: TrainConfig, explicit: frozenset[str] | None,
                          chosen: frozenset[str] | None = None) -> tuple[TrainConfig, str]:
    """The train config a resumed run continues with, and what changed, in words.

    The run's derived values (``TrainConfig.derived``: ``min_lr``, ``lr_decay_steps``,
    ``cooldown_steps``, ``ckpt_interval``) are kept unless given: named by ``explicit`` (the keys given
    by the recipe or the command line) or set in ``new`` away from what their rule derives
    (:func:`given_keys`; the only test when ``explicit`` is ``None``, a config built in Python). The
    run's choices of schedule (``lr_schedule``) and depth sampler (``DEPTH_TRAIN_KEYS``, kept together)
    are kept unless ``chosen`` (the keys the command line gave) names them, so that a resume that
    repeats the recipe but forgets the ``--train.lr_schedule wsd`` the run started with stays on wsd;
    ``chosen=None`` (unknown) falls back to ``explicit``, and with both ``None`` ``new``'s stay. So
    raising ``max_steps`` neither re-derives the learning-rate schedule nor turns a randomized-depth
    run into a fixed-depth one; the words compare what ``new`` gave with the run's values. Another
    ``lr_schedule``, chosen, continues from the resumed step on the new schedule (with the run's
    ``min_lr`` and ``lr_decay_steps``); ``cooldown_steps``, a part of the wsd schedule, is then derived
    again for it unless given (wsd → cosine: 0).

    Raises:
        ValueError: the kept values are invalid with the new ones (e.g. ``min_lr`` above a
            lowered ``learning_rate``): the message names the key to give.
    """
    given = given_keys(new, explicit)
    named = chosen if chosen is not None else explicit
    # the run's choices, kept unless named (the depth sampler's keys together)
    choices = () if named is None else (() if "lr_schedule" in named else ("lr_schedule",)) + (
        () if named & set(DEPTH_TRAIN_KEYS) else DEPTH_TRAIN_KEYS)
    schedule = saved.lr_schedule if "lr_schedule" in choices else new.lr_schedule
    # the cooldown belongs to the run's schedule: with another lr_schedule it derives again (0 but
    # for wsd, a tenth of the kept lr_decay_steps with wsd) unless given
    rederived = {"cooldown_steps"} - given if saved.lr_schedule != schedule else set()
    kept = {k: getattr(saved, k) for k in DERIVED_TRAIN_KEYS
            if k not in given and k not in rederived and getattr(saved, k) != getattr(new, k)}
    kept.update({k: getattr(saved, k) for k in choices if getattr(saved, k) != getattr(new, k)})
    try:
        resolved = dataclasses.replace(new, **kept, **dict.fromkeys(rederived))
    except ValueError as e:
        raise ValueError(f"{e} (kept from the resumed run; "
                         f"give --train.{' / --train.'.join(kept)} explicitly)") from None
    changed = [f"train.{f.name} {getattr(saved, f.name)} → {getattr(resolved, f.name)}"
               for f in dataclasses.fields(TrainConfig)
               if f.name not in _QUIET_ON_RESUME and getattr(saved, f.name) != getattr(resolved, f.name)]
    words = []
    if changed:
        words.append("changed: " + ", ".join(changed))
    if kept:
        words.append("kept the run's " + ", ".join(f"train.{k}={v}" for k, v in kept.items())
                     + " (give them explicitly to change them)")
    return resolved, "; ".join(words)


def summary_if_current(out_dir: Path, step: int) -> dict[str, Any] | None:
    try:
        summary = rundir.read_summary(out_dir)
    except (FileNotFoundError, ValueError):
        return None
    return summary if summary.get("steps") == step else None
