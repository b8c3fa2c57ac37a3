"""What every experiment's runs share: runs built from recipe files plus sweep overrides, and
training that reuses finished runs, recorded in ``results/NAME/runs/<run>/``.

An experiment is a module of this package with ``run(ctx) -> dict`` (its ``"table"`` is the
Markdown printed and written); :class:`Context` carries the options of
``energyformer experiment NAME [--seeds K] [--quick]``.

Runs. Every run is ``recipe file + overrides`` (:func:`resolve`): the recipe under ``configs/``
gives the model and the optimizer, the experiment gives only what it sweeps (width, seed, LR,
steps, the option under study). A finished run's record (``summary.json``, ``config.yaml``,
``metrics.jsonl`` and, where an analysis needs the model, ``model.safetensors`` + ``meta.json``)
is copied into ``results/NAME/runs/<run>/`` as soon as it finishes, so a later call of the same
command (another session, another machine) reuses it instead of training it again
(:func:`train_or_resume`).

Quick mode. ``--quick`` applies one override (:data:`QUICK`: tiny widths, tens of steps, a tiny
corpus made in the work directory) and writes into ``WORK/quick-results/NAME``, never into
``results/``: it tests the pipeline, not the science.

The other shared pieces have their own modules: learning-rate sweeps (:mod:`.sweeps`), the
convergence test (:mod:`.convergence`), tables, plots and the count-model floors (:mod:`.report`),
statistics (:mod:`.stats`) and the fixed evaluation (:mod:`.scoring`).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from energyformer.experiments.scoring import WEIGHTS_FILE, final_eval, keep_weights
from energyformer.runs.config import load_config
from energyformer.runs.recipe import deep_merge, read_recipe
from energyformer.runs.rundir import (
    CONFIG_FILE,
    MARKER_FILE,
    META_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    read_run_config,
    read_summary,
)
from energyformer.utils.bundled import recipes_dir
from energyformer.utils.io import atomic_write_json, atomic_write_text


def recipe_path(recipe: str) -> Path:
    """The bundled recipe ``recipe`` (e.g. ``shakespeare_char/nrgpt.yaml``): experiments are defined as
    bundled recipes + overrides, read where ``energyformer train`` finds them
    (:func:`energyformer.utils.bundled.recipes_dir`: a wheel's ``energyformer/configs/`` or a
    clone's ``configs/``), whatever the working directory.

    Raises:
        FileNotFoundError: no bundled recipe folder (a broken install) or no such recipe in it.
    """
    root = recipes_dir()
    if root is None:
        raise FileNotFoundError(f"recipe {recipe!r}: no bundled recipes were found (neither energyformer/configs/ "
                                "nor a clone's configs/); reinstall energyformer")
    return root / recipe

#: the one quick-mode override (keys a recipe's model does not have are skipped)
QUICK: dict[str, dict[str, Any]] = {
    "model": {"d_model": 16, "n_heads": 2, "d_ff": 48, "n_layers": 2, "block_size": 32},
    "train": {"max_steps": 20, "batch_size": 4, "warmup_steps": 2, "eval_interval": 5, "eval_iters": 2,
              "log_interval": 5, "num_threads": 1},
}

#: run-time options that do not change what a run computes (ignored when matching a finished run)
RUNTIME_KEYS = ("out_dir", "num_threads", "device", "resume", "tensorboard", "compile", "init_from", "wandb",
                "wandb_project", "wandb_run_name")

DIVERGED_FILE = "diverged.json"


@dataclass
class Context:
    """Options of one experiment call.

    Args:
        name: the experiment's name (its results folder).
        seeds: seeds per configuration (``1 … seeds`` are used as ``train.seed``); ``None``: the
            experiment's own default.
        quick: tiny sizes (seconds), for tests of the pipeline; results go to the work directory.
        results_dir: parent of ``NAME/`` with the table, results, plots and run records.
        work_dir: where runs train (``WORK/NAME/<run>``) and, for ``quick``, the tiny data.
        data_root: where the full-size prepared datasets are (``energyformer prepare …``).
        verbose: print a line per run.
        profile: ``"cpu"`` (the protocol sized for 2 CPU cores) or ``"paper"`` (the published
            setting, for GPUs; see :mod:`energyformer.experiments.profiles`).
        rescore: compute every run's fixed evaluation again from its kept weights
            (:mod:`energyformer.experiments.scoring`).
        jobs: trainings at once (:mod:`energyformer.experiments.parallel`), the threads split between them.
        threads: CPU threads of each training; ``None``: the cores divided by ``jobs`` (``jobs=1``:
            torch's default, every core).
        deferred: set by the ``jobs`` driver: runs not yet trained are queued in ``pending``
            instead of trained, and :func:`need_runs` stops the experiment where it needs them.
        interim: train nothing; write the tables from the runs recorded so far into
            ``NAME/interim/`` (a run without a usable record is named in ``missing`` with the
            reason), for an experiment whose queue takes days (those of ``INTERIM_EXPERIMENTS`` in
            :mod:`energyformer.experiments`). A finished run found in the work directory is recorded,
            as a normal call records it.
    """

    name: str
    seeds: int | None = None
    quick: bool = False
    results_dir: Path = Path("results")
    work_dir: Path = Path("out/experiments")
    data_root: Path = Path("data")
    verbose: bool = True
    profile: str = "cpu"
    rescore: bool = False
    interim: bool = False
    jobs: int = 1
    threads: int | None = None
    deferred: bool = False
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    rescored: set[str] = field(default_factory=set)
    waiting_for_sweep: bool = False
    said: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.quick:  # never into results/: quick runs test the pipeline
            self.results_dir = Path(self.work_dir) / "quick-results"

    @property
    def out(self) -> Path:
        """``results_dir/NAME`` (``NAME-paper`` for the paper profile)."""
        return Path(self.results_dir) / (self.name + ("" if self.profile == "cpu" else f"-{self.profile}"))

    @property
    def report_dir(self) -> Path:
        """Where the table, ``results.json`` and the plots go: :attr:`out`, or ``out/interim`` with ``interim``."""
        return self.out / "interim" if self.interim else self.out

    @property
    def records(self) -> Path:
        """``results_dir/NAME/runs``: the committed records of finished runs."""
        return self.out / "runs"

    @property
    def runs(self) -> Path:
        """``work_dir/NAME`` (``-paper`` for the paper profile, ``-quick`` appended in quick mode)."""
        return Path(self.work_dir) / (self.name + ("" if self.profile == "cpu" else f"-{self.profile}")
                                      + ("-quick" if self.quick else ""))

    def say(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def say_once(self, msg: str) -> None:
        """:meth:`say`, unless this context said ``msg`` already (the ``--jobs`` driver runs the experiment
        again after each batch of trainings: a reused run or a sweep's choice is announced once)."""
        if msg not in self.said:
            self.said.add(msg)
            self.say(msg)

    def seed_list(self, default: int = 3) -> list[int]:
        """``[1 … seeds]`` (``default`` seeds when none were asked for; 1 in quick mode)."""
        n = self.seeds if self.seeds is not None else (1 if self.quick else default)
        return list(range(1, n + 1))


# --------------------------------------------------------------------------------------------
# run configs: recipe + overrides
# --------------------------------------------------------------------------------------------

def resolve(ctx: Context, recipe: str, *overrides: Mapping[str, Any], data: Mapping[str, Any] | None = None,
            swept: Sequence[str] = ()) -> dict[str, Any]:
    """The run config of the bundled recipe ``recipe`` (:func:`recipe_path`) with ``overrides``
    merged in order (later wins).

    ``data`` replaces the recipe's data section (quick mode: the experiment's tiny data); else the
    recipe's dataset is read from ``ctx.data_root``. In quick mode :data:`QUICK` is merged last
    (only keys the model already has, and not the model keys named in ``swept``, which the
    experiment sweeps with quick values of its own). The CPU profile runs on the CPU.

    Raises:
        FileNotFoundError: the recipe does not exist.
    """
    cfg = read_recipe(recipe_path(recipe))
    for o in overrides:
        cfg = deep_merge(cfg, o)
    if ctx.quick:
        quick_model = {k: v for k, v in QUICK["model"].items() if k in cfg.get("model", {}) and k not in swept}
        cfg = deep_merge(cfg, {"model": quick_model, "train": QUICK["train"]})
    if data is not None:
        cfg["data"] = dict(data)
    else:
        cfg["data"] = {**cfg.get("data", {}), "root": str(ctx.data_root)}
    cfg.setdefault("train", {})["device"] = "cpu" if ctx.profile == "cpu" else "auto"
    if ctx.profile == "cpu":  # what train.dtype "auto" resolves to on the CPU, stated so records compare equal
        cfg["train"]["dtype"] = "float32"
    reads = _train_keys(cfg.get("model", {}).get("arch"))
    if reads is not None:  # the shared schedule's keys (eval_iters, ...) that the arch's loop does not read
        cfg["train"] = {k: v for k, v in cfg["train"].items() if k in reads}
    return cfg


def _train_keys(arch: Any) -> frozenset[str] | None:
    """The ``train`` keys the loop of ``arch`` reads (``ArchSpec.train_keys``); None: every key, or an
    arch not registered here (a plugin's: its loop checks)."""
    from energyformer.models.registry import ARCH_SPECS

    spec = ARCH_SPECS.get(arch) if isinstance(arch, str) else None
    return None if spec is None else spec.train_keys


def schedule(ctx: Context, max_steps: int, learning_rate: float, *, cooldown: float = 0.1, evals: int = 50,
             warmup_steps: int = 100, eval_iters: int = 10) -> dict[str, Any]:
    """The ``train`` overrides of a constant-LR run with a linear cooldown (``lr_schedule: wsd``)
    over the last ``cooldown`` of ``max_steps`` to ``learning_rate / 10``, evaluated ``evals``
    times (a learning curve), with the decay horizon set explicitly (quick mode: :data:`QUICK`'s
    steps)."""
    if ctx.quick:
        max_steps, evals = QUICK["train"]["max_steps"], 4
    return {"max_steps": max_steps, "learning_rate": learning_rate, "min_lr": learning_rate / 10,
            "lr_schedule": "wsd", "lr_decay_steps": max_steps, "cooldown_steps": int(round(cooldown * max_steps)),
            "warmup_steps": min(warmup_steps, max_steps // 10), "eval_interval": max(1, max_steps // evals),
            "eval_iters": eval_iters, "log_interval": max(1, min(50, max_steps // evals))}


def _comparable(d: Mapping[str, Any], arch: Any = None) -> dict[str, Any]:
    """The train options that change what a run of ``arch`` computes: run-time options and keys its loop
    does not read (a regressor run recorded with ``eval_iters``) left out."""
    reads = _train_keys(arch)
    return {k: v for k, v in d.items() if k not in RUNTIME_KEYS and (reads is None or k in reads)}


def _same_run(run_dir: Path, cfg: Mapping[str, Any], *done_files: str) -> bool:
    """Whether ``run_dir`` has ``config.yaml``, one of ``done_files`` and a config equal to ``cfg``
    in model, data and training options (run-time options aside)."""
    if not (run_dir / CONFIG_FILE).is_file() or not any((run_dir / f).is_file() for f in done_files):
        return False
    try:
        return not config_differences(run_dir, cfg)
    except (ValueError, FileNotFoundError):
        return False


def config_differences(run_dir: Path, cfg: Mapping[str, Any]) -> list[str]:
    """Where ``run_dir``'s recorded config differs from ``cfg`` in what a run computes: the model keys,
    the train options (run-time options aside, :func:`_comparable`) and the data path.

    Raises:
        ValueError / FileNotFoundError: an unreadable or missing ``config.yaml``.
    """
    saved_cfg = read_run_config(run_dir)
    want_cfg = load_config(dict(cfg), resolve_vocab=True)
    saved, want = saved_cfg.to_dict(), want_cfg.to_dict()
    arch = want["model"]["arch"]
    old_train, new_train = _comparable(saved["train"], arch), _comparable(want["train"], arch)
    differ = [f"model.{k}" for k in sorted(set(saved["model"]) | set(want["model"]))
              if saved["model"].get(k) != want["model"].get(k)]
    differ += [f"train.{k}" for k in sorted(set(old_train) | set(new_train)) if old_train.get(k) != new_train.get(k)]
    if Path(saved_cfg.data.path) != Path(want_cfg.data.path):
        differ.append(f"data.path {str(saved_cfg.data.path)!r} != {str(want_cfg.data.path)!r}")
    return differ


def same_config(run_dir: Path, cfg: Mapping[str, Any]) -> bool:
    """Whether ``run_dir`` holds a finished run (``summary.json`` or a divergence record) of the
    config ``cfg``: the same model, data and training options, run-time options aside."""
    return _same_run(run_dir, cfg, SUMMARY_FILE, DIVERGED_FILE)


# --------------------------------------------------------------------------------------------
# training with records
# --------------------------------------------------------------------------------------------

def record_dir(ctx: Context, run: str) -> Path:
    """Where a run can be loaded from: its record if it holds the weights; else its work directory
    if that holds the run (weights included); else its record (config, metrics and summary: all
    that the tables and curves read, e.g. on a fresh checkout where the work directory is gone)."""
    rec, out = ctx.records / run, ctx.runs / run
    if (rec / WEIGHTS_FILE).is_file() or not (out / CONFIG_FILE).is_file():
        return rec
    return out


def _save_record(ctx: Context, run: str) -> None:
    """Copy a finished run's summary, config, metrics, meta and final weights (bf16 when large,
    :func:`energyformer.experiments.scoring.keep_weights`) into its record."""
    src, dst = ctx.runs / run, ctx.records / run
    dst.mkdir(parents=True, exist_ok=True)
    for f in (SUMMARY_FILE, CONFIG_FILE, METRICS_FILE, DIVERGED_FILE, META_FILE):
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    if (src / WEIGHTS_FILE).is_file():
        keep_weights(src / WEIGHTS_FILE, dst / WEIGHTS_FILE)


def rescore_records(ctx: Context) -> dict[str, float]:
    """Compute the fixed evaluation again for every recorded run of the experiment that keeps its
    weights (``--rescore`` does this first, so runs the current protocol no longer asks for are
    re-scored too). Returns run name → value."""
    out = {}
    if not ctx.records.is_dir():
        return out
    for rec in sorted(p for p in ctx.records.iterdir() if (p / WEIGHTS_FILE).is_file()):
        if rec.name not in ctx.rescored:
            out[rec.name] = final_eval(rec, force=True)["value"]
            ctx.rescored.add(rec.name)
            ctx.say(f"  {rec.name}: fixed evaluation {out[rec.name]:.4f}")
    return out


class PendingRuns(Exception):
    """Raised (deferred mode, ``--jobs``) at a point where an experiment needs runs not yet trained."""


def need_runs(ctx: Context) -> None:
    """A barrier: in deferred mode (``--jobs``), stop the experiment here if runs it needs are queued
    (:class:`PendingRuns`); the driver trains them in parallel and calls the experiment again.
    An experiment calls it after its LR sweeps and after queuing its runs, before it analyses them."""
    if ctx.deferred and ctx.pending:
        raise PendingRuns(f"{len(ctx.pending)} run(s) to train: {', '.join(ctx.pending)}")


def train_or_resume(ctx: Context, run: str, cfg: Mapping[str, Any], require_weights: bool = True
                    ) -> dict[str, Any]:
    """Train ``cfg`` into ``ctx.runs/run``, unless a finished run of the same config is recorded in
    ``ctx.records/run`` or sits in the work directory; then record it with its final weights
    (:func:`_save_record`) and score it on the fixed evaluation
    (:func:`energyformer.experiments.scoring.final_eval`).

    Args:
        require_weights: reuse a finished run only if its weights are kept (every reported number
            is re-scorable); ``False`` for LR-sweep runs, whose older records kept no weights and
            whose choice compares runs of one seed on the same batches.

    Returns:
        the run's summary plus ``"final_eval"`` (the fixed evaluation; absent for a record without
        weights) and ``"seed"``; ``{"diverged": True, "message": …}`` for a run whose loss became
        NaN/Inf (recorded too, so it is not retried); in deferred mode (``ctx.deferred``) a run not
        yet trained is queued in ``ctx.pending`` and ``{"pending": True}`` is returned; with
        ``ctx.interim`` it is named in ``ctx.missing`` and ``{"missing": True}`` is returned.
    """
    rec, out = ctx.records / run, ctx.runs / run
    cfg = {**cfg, "train": {**cfg.get("train", {}), "out_dir": str(out)}}
    for where in (rec, out):
        if same_config(where, cfg) and (not require_weights or (where / WEIGHTS_FILE).is_file()
                                        or (where / DIVERGED_FILE).is_file()):
            if where == out:
                _save_record(ctx, run)
            ctx.say_once(f"  {run}: finished earlier, reusing {where}")
            return _outcome(ctx, run)
    if ctx.interim:  # the tables of what is recorded; the run is named as missing, never trained
        ctx.missing.setdefault(run, _why_unusable(rec, cfg, require_weights))
        return {"missing": True, "why": ctx.missing[run]}
    if ctx.deferred:
        if not ctx.waiting_for_sweep:  # a run configured from a sweep still training is queued next round
            ctx.pending[run] = cfg
        return {"pending": True}
    train_now(ctx, run, cfg)
    return _outcome(ctx, run)


def _why_unusable(rec: Path, cfg: Mapping[str, Any], require_weights: bool) -> str:
    """Why the record ``rec`` cannot stand for ``cfg`` (``--interim``'s list of missing runs): not
    recorded, recorded with another config (:func:`config_differences`), without its weights, or not
    finished."""
    if not (rec / CONFIG_FILE).is_file():
        return "not recorded"
    try:
        differ = config_differences(rec, cfg)
    except (ValueError, FileNotFoundError) as e:
        return f"recorded with an unreadable {CONFIG_FILE} ({e})"
    if differ:
        return f"recorded with another config ({'; '.join(differ[:4])})"
    if require_weights and not (rec / WEIGHTS_FILE).is_file():
        return f"recorded without its weights ({WEIGHTS_FILE})"
    return "not finished"


def train_now(ctx: Context, run: str, cfg: Mapping[str, Any]) -> None:
    """Train ``cfg`` (its ``train.out_dir`` is ``ctx.runs/run``) from its checkpoint or recorded
    partial run, then write its record (a diverged run records its divergence)."""
    from energyformer.train.loop import TrainingDivergedError

    out = ctx.runs / run
    run_cfg = load_config(dict(cfg), resolve_vocab=True)
    _set_aside_stale(ctx, out, cfg)
    _restore_partial(ctx, run, cfg)
    n_threads = torch.get_num_threads()
    try:
        summary = _train(run_cfg)
    except TrainingDivergedError as e:
        atomic_write_json(out / DIVERGED_FILE, {"diverged": True, "message": str(e)})
        summary = {"diverged": True, "message": str(e)}
    finally:
        torch.set_num_threads(n_threads)
    _save_record(ctx, run)
    if (ctx.out / PARTIAL_DIR / run).exists():
        shutil.rmtree(ctx.out / PARTIAL_DIR / run)
    if summary.get("diverged"):
        ctx.say(f"  {run}: diverged ({summary['message']})")
    else:
        ctx.say(f"  {run}: best val {summary['best_val_loss']:.4f}, {summary['params']:,} params, "
                f"{summary['minutes']:.1f} min" + (f" ({summary['cpu_minutes']:.1f} CPU-min)"
                                                    if summary.get("cpu_minutes") is not None else ""))


def _outcome(ctx: Context, run: str) -> dict[str, Any]:
    """The recorded outcome of a finished run, with its fixed evaluation when its weights are kept
    (recomputed once per call of the experiment with ``ctx.rescore``)."""
    where = record_dir(ctx, run)
    out = _read_outcome(where)
    if out.get("diverged"):
        return out
    out["seed"] = read_run_config(where).train.seed
    if (where / WEIGHTS_FILE).is_file():
        force = ctx.rescore and run not in ctx.rescored
        out["final_eval"] = final_eval(where, force=force)
        ctx.rescored.add(run)
    return out


PARTIAL_DIR = "partial"


def record_partial(ctx: Context, run: str) -> Path | None:
    """Copy the committed checkpoint of an unfinished run in the work directory into
    ``results/NAME/partial/<run>/`` (config, meta, metrics, marker and the checkpoint folder), so a
    later call on a fresh checkout resumes it instead of starting over; ``None`` if there is none."""
    from energyformer.runs.checkpoint import checkpoint_dir, find_checkpoint

    src = ctx.runs / run
    marker = find_checkpoint(src)
    if marker is None or (src / SUMMARY_FILE).is_file():
        return None
    dst = ctx.out / PARTIAL_DIR / run
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in (CONFIG_FILE, META_FILE, METRICS_FILE, MARKER_FILE):
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    ck = checkpoint_dir(src, marker)
    shutil.copytree(ck, dst / ck.relative_to(src))
    return dst


def record_partials(name: str, results_dir: str | Path = "results",
                    work_dir: str | Path = "out/experiments") -> list[Path]:
    """:func:`record_partial` for every unfinished run of experiment ``name`` (e.g. before a
    machine is given back)."""
    ctx = Context(name, results_dir=Path(results_dir), work_dir=Path(work_dir))
    if not ctx.runs.is_dir():
        return []
    return [p for d in sorted(ctx.runs.iterdir()) if d.is_dir() and (p := record_partial(ctx, d.name))]


def _restore_partial(ctx: Context, run: str, cfg: Mapping[str, Any]) -> None:
    """Seed an empty work directory from a recorded partial run of the same config."""
    part, out = ctx.out / PARTIAL_DIR / run, ctx.runs / run
    if (out / MARKER_FILE).is_file() or not same_config_unfinished(part, cfg):
        return
    shutil.copytree(part, out, dirs_exist_ok=True)
    ctx.say(f"  {run}: resuming the recorded partial run {part}")


def same_config_unfinished(run_dir: Path, cfg: Mapping[str, Any]) -> bool:
    """Whether ``run_dir`` holds a checkpoint (finished or not) of the config ``cfg``."""
    return _same_run(run_dir, cfg, MARKER_FILE)


def _set_aside_stale(ctx: Context, out: Path, cfg: Mapping[str, Any]) -> None:
    """Move a work directory holding a run of another config (an older protocol) to ``<out>.stale``,
    so the new run starts clean; an unfinished run of the same config stays and is resumed."""
    if not (out / CONFIG_FILE).is_file():
        return
    try:
        saved = read_run_config(out)
    except (ValueError, FileNotFoundError):
        saved = None
    want = load_config(dict(cfg), resolve_vocab=True)
    if saved is not None and saved.model == want.model and \
            _comparable(saved.to_dict()["train"], want.model.arch) == _comparable(want.to_dict()["train"],
                                                                                   want.model.arch):
        return
    stale = out.with_name(out.name + ".stale")
    if stale.exists():
        shutil.rmtree(stale)
    out.rename(stale)
    ctx.say(f"  {out.name}: the work directory held a run of another config; moved it to {stale}")


def _train(run_cfg) -> dict[str, Any]:
    from energyformer.train import train  # the one dispatch on the arch (language model or regressor)

    return train(run_cfg, progress=False)


def _read_outcome(run_dir: Path) -> dict[str, Any]:  # summary.json or the divergence record
    if (run_dir / DIVERGED_FILE).is_file():
        return json.loads((run_dir / DIVERGED_FILE).read_text(encoding="utf-8"))
    return read_summary(run_dir)


# --------------------------------------------------------------------------------------------
# the tiny corpus of quick runs
# --------------------------------------------------------------------------------------------

def quick_text() -> str:
    """A small offline English text for quick runs: the docstrings of this package (about 100 kB)."""
    import importlib
    import inspect
    import pkgutil

    import energyformer

    parts = []
    for info in sorted(pkgutil.walk_packages(energyformer.__path__, "energyformer."), key=lambda i: i.name):
        if ".experiments" in info.name or info.name.endswith("__main__") or ".hf" in info.name:
            continue
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: its text is not needed
            continue
        parts.append(inspect.getdoc(mod) or "")
    return "\n\n".join(p for p in parts if p)


def char_data(ctx: Context, dataset: str = "shakespeare_char") -> dict[str, Any] | None:
    """The ``data`` section of a character-level run in quick mode (a tiny corpus,
    :func:`quick_text`, prepared into the work directory); ``None`` (the recipe's prepared
    ``dataset`` under ``data_root``) otherwise."""
    if not ctx.quick:
        return None
    from energyformer.data import prepare_text

    path = ctx.runs / "data" / "quick.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, quick_text())
    out = prepare_text(path, out_dir=ctx.runs / "data" / "quick_char", verbose=False)
    return {"dataset": out.name, "root": str(out.parent)}


__all__ = ["Context", "PendingRuns", "QUICK", "char_data", "need_runs", "quick_text", "recipe_path", "record_dir",
           "record_partial", "record_partials", "rescore_records", "resolve", "same_config", "schedule", "train_now",
           "train_or_resume"]
