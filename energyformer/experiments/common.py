"""What every experiment shares: runs built from recipe files plus sweep overrides, training that
reuses finished runs, learning-rate sweeps, convergence measurement, mean ± std over seeds, and
writing ``results/NAME/{table.md, results.json, *.png, runs/<run>/}``.

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

Convergence. :func:`convergence` fits a line to the validation loss over the last 30% of the
steps before the learning-rate cooldown and calls a run *converged* when the fitted loss fell by
less than :data:`PLATEAU_REL` (1%) of its value across that window (docs/experiments.md §1).
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from energyformer.experiments.scoring import WEIGHTS_FILE, final_eval, keep_weights
from energyformer.experiments.stats import PLATEAU_REL, plateau_test
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

#: the window: this last fraction of the steps before the cooldown
WINDOW = 0.3

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
        deferred: set by the ``jobs`` driver: runs not yet trained are queued in ``pending``
            instead of trained, and :func:`need_runs` stops the experiment where it needs them.
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
    jobs: int = 1
    deferred: bool = False
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    return cfg


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


def _comparable(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in RUNTIME_KEYS}


def _same_run(run_dir: Path, cfg: Mapping[str, Any], *done_files: str) -> bool:
    """Whether ``run_dir`` has ``config.yaml``, one of ``done_files`` and a config equal to ``cfg``
    in model, data and training options (run-time options aside)."""
    if not (run_dir / CONFIG_FILE).is_file() or not any((run_dir / f).is_file() for f in done_files):
        return False
    try:
        saved_cfg = read_run_config(run_dir)
    except (ValueError, FileNotFoundError):
        return False
    want_cfg = load_config(dict(cfg), resolve_vocab=True)
    saved, want = saved_cfg.to_dict(), want_cfg.to_dict()
    return (saved["model"] == want["model"] and _comparable(saved["train"]) == _comparable(want["train"])
            and Path(saved_cfg.data.path) == Path(want_cfg.data.path))


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
        yet trained is queued in ``ctx.pending`` and ``{"pending": True}`` is returned.
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
    if ctx.deferred:
        if not ctx.waiting_for_sweep:  # a run configured from a sweep still training is queued next round
            ctx.pending[run] = cfg
        return {"pending": True}
    train_now(ctx, run, cfg)
    return _outcome(ctx, run)


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
                f"{summary['minutes']:.1f} min")


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
            _comparable(saved.to_dict()["train"]) == _comparable(want.to_dict()["train"]):
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
# learning-rate sweeps
# --------------------------------------------------------------------------------------------

def lr_sweep(ctx: Context, family: str, make_cfg: Callable[[float, int], dict[str, Any]],
             lrs: Sequence[float], steps: int, max_extend: int = 2) -> dict[str, Any]:
    """Train ``make_cfg(lr, steps)`` (seed 1) for every ``lr`` and pick the one with the lowest
    final validation loss (a diverged run loses). When the best is the largest or the smallest LR
    tried, the sweep extends by one more value in that direction (the grid's ratio), at most
    ``max_extend`` times, so the chosen LR is never at the edge of what was tried unless the
    extension stops improving.

    Returns:
        ``{"family", "steps" (each run's ``max_steps``), "lrs" (ascending), "final_val_loss" (per lr; inf
        when diverged), "best_lr"}``.
    """
    tried: dict[float, float] = {}
    trained = int(make_cfg(lrs[0], steps).get("train", {}).get("max_steps", steps))  # quick mode shrinks it

    def loss_at(lr: float) -> float:
        if lr not in tried:
            s = train_or_resume(ctx, f"sweep_{family}_lr{lr:g}", make_cfg(lr, steps), require_weights=False)
            if s.get("pending"):
                tried[lr] = math.nan
                return math.nan
            v = math.inf if s.get("diverged") else float(s["final_val_loss"])
            tried[lr] = v if math.isfinite(v) else math.inf
        return tried[lr]

    for lr in lrs:
        loss_at(lr)
    if any(math.isnan(v) for v in tried.values()):  # deferred: queued; the caller stops at need_runs
        ctx.waiting_for_sweep = True
        return {"family": family, "steps": trained, "lrs": sorted(tried), "final_val_loss": [], "best_lr": lrs[0],
                "pending": True}
    for _ in range(max_extend if len(lrs) > 1 else 0):
        grid = sorted(tried)
        best = min(grid, key=lambda lr: tried[lr])
        if best == grid[-1]:
            extra = loss_at(half_decade(best, up=True))
        elif best == grid[0]:
            extra = loss_at(half_decade(best, up=False))
        else:
            break
        if math.isnan(extra):
            ctx.waiting_for_sweep = True
            tried.pop(half_decade(best, up=best == grid[-1]))
            return {"family": family, "steps": trained, "lrs": sorted(tried), "final_val_loss": [],
                    "best_lr": best, "pending": True}
    grid = sorted(tried)
    best = min(grid, key=lambda lr: tried[lr])
    ctx.say_once(f"  LR sweep {family}: " + ", ".join(f"{lr:g} → {tried[lr]:.4f}" for lr in grid) + f"; using {best:g}")
    return {"family": family, "steps": trained, "lrs": grid, "final_val_loss": [tried[lr] for lr in grid],
            "best_lr": best}


def half_decade(lr: float, up: bool) -> float:
    """The next value of the 1-3-10 grid above (or below) ``lr``: 3e-3 → 1e-2, 1e-3 → 3e-4."""
    exp = math.floor(math.log10(lr) + 1e-9)
    steps = [(1, exp), (3, exp), (1, exp + 1)] if up else [(3, exp - 1), (1, exp), (3, exp)]
    cands = [m * 10.0 ** e for m, e in steps]
    pick = [c for c in cands if (c > lr * 1.05 if up else c < lr / 1.05)]
    value = min(pick) if up else max(pick)
    return float(f"{value:.3g}")


def sweep_table(sweeps: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per family, one column per LR (final val loss), the chosen LR."""
    rows = []
    for s in sweeps:
        cells = [("diverged" if not math.isfinite(v) else f"{v:.4f}") for v in s["final_val_loss"]]
        rows.append([s["family"], s["steps"], " / ".join(f"{lr:g}" for lr in s["lrs"]), " / ".join(cells),
                     f"{s['best_lr']:g}"])
    return markdown_table(["family", "sweep steps", "learning rates", "final val loss", "chosen"], rows)


# --------------------------------------------------------------------------------------------
# convergence
# --------------------------------------------------------------------------------------------

def val_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """``(steps, val_loss)`` of every evaluation in ``run_dir/metrics.jsonl``."""
    steps, vals = [], []
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return steps, vals
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("val_loss") is not None:
            steps.append(int(rec["step"]))
            vals.append(float(rec["val_loss"]))
    return steps, vals


def stable_end(train: Mapping[str, Any]) -> int:
    """The last step before the learning-rate cooldown (``wsd``), else the decay horizon."""
    end = int(train.get("lr_decay_steps") or train["max_steps"])
    if train.get("lr_schedule") == "wsd":
        end -= int(train.get("cooldown_steps") or 0)
    return min(end, int(train["max_steps"]))


def convergence(run_dir: Path) -> dict[str, Any]:
    """Convergence of a run with its evidence (docs/experiments.md §1): the line fitted to the
    validation loss over the last :data:`WINDOW` of the steps before the cooldown, its slope ± standard
    error (nats per 1,000 steps), the fitted drop across the window as a share of the loss with its 95%
    interval, and the verdict of :func:`energyformer.experiments.stats.plateau_test` (``"yes"``: the
    interval lies within ± :data:`PLATEAU_REL`; ``"no"``: its lower bound is a drop over it;
    ``"rising"``: its upper bound is a rise over it; ``"unclear"``: it straddles a bound). ``converged``
    is ``verdict == "yes"``; every value is ``None`` with fewer than 3 evaluations in the window."""
    train = read_run_config(run_dir).to_dict()["train"]
    end = stable_end(train)
    start = end - WINDOW * end
    steps, vals = val_curve(run_dir)
    pts = [(s, v) for s, v in zip(steps, vals) if start <= s <= end]
    out: dict[str, Any] = {"window": [int(start), end], "evals_in_window": len(pts)}
    if len(pts) < 3:
        return {**out, **dict.fromkeys(("slope_per_1k", "slope_se_per_1k", "drop", "drop_rel", "drop_rel_lo",
                                        "drop_rel_hi", "verdict", "converged"))}
    return {**out, **plateau_test([p[0] for p in pts], [p[1] for p in pts], end - start, PLATEAU_REL)}


#: how every table's "converged" column reads (docs/experiments.md §1)
CONVERGED_NOTE = ("Converged: the 95% interval of the fitted change of the val loss over the last 30% of the steps "
                  "before the cooldown lies within ±1% of the loss (yes), is a drop beyond 1% (no: still falling), "
                  "a rise beyond 1% (rising) or none of these (unclear: the interval straddles a ±1% bound); with the "
                  "slope ± its standard error per 1k steps; – with fewer than 3 evaluations in the window.")


def converged_cell(convs: Sequence[Mapping[str, Any]]) -> str:
    """The verdicts over seeds (``"yes"``, ``"no"``, ``"unclear"`` or counts such as ``"2 no, 1 unclear"``)
    with the mean slope ± its standard error (per 1k steps; the mean's error over the seeds' fits)."""
    verdicts = [c.get("verdict") for c in convs if c.get("verdict") is not None]
    if not verdicts:
        return "–"
    counts = {v: verdicts.count(v) for v in ("yes", "no", "rising", "unclear") if v in verdicts}
    word = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{n} {v}" for v, n in counts.items())
    fits = [(c["slope_per_1k"], c["slope_se_per_1k"]) for c in convs if c.get("slope_per_1k") is not None]
    slope = statistics.fmean(f[0] for f in fits)
    se = math.sqrt(sum(f[1] ** 2 for f in fits)) / len(fits)
    return f"{word} ({slope:+.3f} ± {se:.3f}/1k)"


# --------------------------------------------------------------------------------------------
# tables, results and plots
# --------------------------------------------------------------------------------------------

def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std)`` (std 0 for one value); NaN for none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(values: Sequence[float], digits: int = 4) -> str:
    """``"1.2345 ± 0.0123"`` (the ± part only for more than one value)."""
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    n = len([v for v in values if v is not None and math.isfinite(v)])
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if n > 1 else "")


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table of ``head`` and ``rows`` (cells are ``str()``-ed)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(ctx: Context) -> str:
    """The command that reproduces this experiment's table."""
    seeds = "" if ctx.seeds is None else f" --seeds {ctx.seeds}"
    profile = "" if ctx.profile == "cpu" else f" --profile {ctx.profile}"
    return f"energyformer experiment {ctx.name}{seeds}{profile}"


def write_results(ctx: Context, table: str, results: dict[str, Any], header: str = "",
                  footer: str = "") -> dict[str, Any]:
    """Write ``table.md`` (``header``, the reproducing command, the table, ``footer``) and
    ``results.json`` into ``ctx.out`` (the run records are written as the runs finish)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    parts = [header.strip(), f"Reproduce: `{command_line(ctx)}`", table, footer.strip()]
    atomic_write_text(ctx.out / "table.md", "\n\n".join(p for p in parts if p) + "\n")
    payload = {"experiment": ctx.name, "seeds": ctx.seeds, "quick": ctx.quick, "command": command_line(ctx),
               **results}
    atomic_write_json(ctx.out / "results.json", payload)
    return {**payload, "table": table}


def pyplot():
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_axes(ax, xlabel: str, ylabel: str | None = None, logx: bool = False) -> None:
    """Labels, a light grid and the legend of one panel."""
    if logx:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels like "2×10⁴" collide on short ranges
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def save_figure(ctx: Context, fig, file_name: str) -> Path:
    """Save ``fig`` as ``ctx.out/file_name`` (tight layout, 110 dpi) and close it."""
    plt = pyplot()
    ctx.out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    path = ctx.out / file_name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_learning_curves(ctx: Context, groups: Mapping[str, Sequence[Path]], file_name: str = "curves.png",
                         floors: Mapping[str, float] | None = None, ylabel: str = "val loss") -> Path:
    """Validation loss against steps for every run (one colour per group, a line per seed), with
    horizontal lines at ``floors`` (label → value)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, dirs) in enumerate(groups.items()):
        for j, d in enumerate(dirs):
            steps, vals = val_curve(d)
            if steps:
                ax.plot(steps, vals, color=colors[i % len(colors)], alpha=0.8, linewidth=1,
                        label=label if j == 0 else None)
    for k, (label, v) in enumerate((floors or {}).items()):
        ax.axhline(v, color="gray", linestyle=("--", ":", "-.")[k % 3], linewidth=1, label=label)
    finish_axes(ax, "step", ylabel)
    return save_figure(ctx, fig, file_name)


def count_floors(data: Mapping[str, Any] | None, ctx: Context, dataset: str = "shakespeare_char") -> dict[str, float]:
    """The unigram and bigram count-model validation losses (nats/token) of the corpus of a run's
    ``data`` section (``None``: the prepared ``dataset`` under ``ctx.data_root``), as table floors."""
    return corpus_floors(Path(data["root"]) / data["dataset"] if data else Path(ctx.data_root) / dataset)


def corpus_floors(path: str | Path) -> dict[str, float]:
    """The unigram and bigram count-model validation losses (nats/token) of the prepared dataset
    at ``path``, as table floors."""
    from energyformer.eval.floors import dataset_floors

    floors = dataset_floors(path)
    return {"unigram count model": float(floors["unigram"]), "bigram count model": float(floors["bigram"])}


def floors_table(floors: Mapping[str, float], unit: str) -> str:
    """A two-column Markdown table of floors."""
    return markdown_table(["floor", unit], [[k, f"{v:.4f}"] for k, v in floors.items()])


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


__all__ = ["CONVERGED_NOTE", "Context", "PendingRuns", "QUICK", "char_data", "convergence", "converged_cell",
           "count_floors", "finish_axes", "floors_table", "half_decade", "lr_sweep", "markdown_table", "mean_std",
           "need_runs", "plot_learning_curves", "pm", "pyplot", "quick_text", "recipe_path", "record_dir",
           "rescore_records", "resolve", "same_config", "save_figure", "schedule", "sweep_table", "train_now",
           "train_or_resume", "val_curve", "write_results"]
