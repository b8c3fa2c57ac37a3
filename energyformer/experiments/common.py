"""What every experiment shares: where its data and runs live, training that resumes finished
runs, mean ± std over seeds, and writing ``results/NAME/{table.md, results.json, *.png}``.

An experiment is a module of this package with ``run(ctx) -> dict`` (its ``"table"`` is the
Markdown printed and written); :class:`Context` carries the options of
``energyformer experiment NAME [--seeds 3] [--quick]``. With ``quick`` every size shrinks (tiny
data made in the work directory, tiny models, tens of steps): it tests the pipeline, not the science.
"""
from __future__ import annotations

import math
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from energyformer.runs.config import load_config
from energyformer.runs.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, read_run_config, read_summary
from energyformer.utils.io import atomic_write_json, atomic_write_text


@dataclass
class Context:
    """Options of one experiment call.

    Args:
        name: the experiment's name (its results folder).
        seeds: seeds per configuration (``1 … seeds`` are used as ``train.seed``).
        quick: tiny sizes (seconds), for tests of the pipeline.
        results_dir: parent of ``NAME/`` with the table, results and plots.
        work_dir: where runs go (``WORK/NAME/<run>``) and, for ``quick``, the tiny data.
        data_root: where the full-size prepared datasets are (``energyformer prepare …``).
        verbose: print a line per run.
    """

    name: str
    seeds: int = 3
    quick: bool = False
    results_dir: Path = Path("results")
    work_dir: Path = Path("out/experiments")
    data_root: Path = Path("data")
    verbose: bool = True

    @property
    def out(self) -> Path:
        """``results_dir/NAME``."""
        return Path(self.results_dir) / self.name

    @property
    def runs(self) -> Path:
        """``work_dir/NAME`` (``-quick`` appended in quick mode)."""
        return Path(self.work_dir) / (self.name + ("-quick" if self.quick else ""))

    def say(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def seed_list(self) -> list[int]:
        return list(range(1, self.seeds + 1))


def same_config(run_dir: Path, cfg: dict[str, Any]) -> bool:
    """Whether ``run_dir`` holds a finished run (``summary.json``) of exactly the config ``cfg``."""
    if not (run_dir / SUMMARY_FILE).is_file() or not (run_dir / CONFIG_FILE).is_file():
        return False
    try:
        saved = read_run_config(run_dir)
    except (ValueError, FileNotFoundError):
        return False
    want = load_config(cfg, resolve_vocab=True)
    return saved.model == want.model and saved.train == want.train and saved.data.path == want.data.path


def train_or_resume(ctx: Context, run: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the run config ``cfg`` (a recipe dict) into ``ctx.runs/run``, or read its summary if that run
    already finished with the same config. ``arch: regressor`` goes to the regression loop.

    Returns:
        the run's summary (``energyformer.train.train``'s).
    """
    out = ctx.runs / run
    # quick runs are tiny: one thread avoids the synchronisation cost that dominates them on shared cores
    threads = {"num_threads": 1} if ctx.quick else {}
    cfg = {**cfg, "train": {**cfg.get("train", {}), **threads, "out_dir": str(out)}}
    if same_config(out, cfg):
        ctx.say(f"  {run}: finished earlier, reusing {out}")
        return read_summary(out)
    run_cfg = load_config(cfg, resolve_vocab=True)
    n_threads = torch.get_num_threads()
    try:
        from energyformer.train import train

        summary = train(run_cfg, progress=False)
    finally:
        torch.set_num_threads(n_threads)
    ctx.say(f"  {run}: best val {summary['best_val_loss']:.4f}, {summary['params']:,} params, "
            f"{summary['minutes']:.1f} min")
    return summary


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
    n = len([v for v in values if v is not None])
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if n > 1 else "")


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table of ``head`` and ``rows`` (cells are ``str()``-ed)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(ctx: Context, table: str, results: dict[str, Any], run_names: Sequence[str] = (),
                  header: str = "") -> dict[str, Any]:
    """Write ``table.md`` (``header`` + table), ``results.json`` and, for each run, its
    ``summary.json``, ``config.yaml`` and ``metrics.jsonl`` under ``ctx.out/runs/<run>/``."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ctx.out / "table.md", (header.strip() + "\n\n" if header else "") + table + "\n")
    payload = {"experiment": ctx.name, "seeds": ctx.seeds, "quick": ctx.quick, **results}
    atomic_write_json(ctx.out / "results.json", payload)
    for run in run_names:
        src, dst = ctx.runs / run, ctx.out / "runs" / run
        dst.mkdir(parents=True, exist_ok=True)
        for f in (SUMMARY_FILE, CONFIG_FILE, METRICS_FILE):
            if (src / f).is_file():
                shutil.copyfile(src / f, dst / f)
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


def char_data(ctx: Context, dataset: str = "shakespeare_char") -> dict[str, Any]:
    """The ``data`` section of a character-level run: the prepared ``dataset`` under ``data_root``,
    or, in quick mode, a tiny corpus (:func:`quick_text`) prepared into the work directory."""
    if not ctx.quick:
        return {"dataset": dataset, "root": str(ctx.data_root)}
    from energyformer.data import prepare_text

    path = ctx.runs / "data" / "quick.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, quick_text())
    out = prepare_text(path, out_dir=ctx.runs / "data" / "quick_char", verbose=False)
    return {"dataset": out.name, "root": str(out.parent)}


__all__ = ["Context", "char_data", "finish_axes", "markdown_table", "save_figure", "mean_std", "pm", "pyplot", "quick_text",
           "train_or_resume", "write_results"]
