"""Compare runs: one table (Markdown or JSON) and loss curves against tokens seen.

Reads only what ``energyformer train`` writes into a run directory, through the readers of
``energyformer.runs``: ``summary.json`` (final numbers), ``config.yaml`` (the recipe) and
``metrics.jsonl`` (the curves), so it works on runs copied from another machine without the data.
A run without ``summary.json`` (still training, or stopped) is compared on its ``metrics.jsonl``
so far, its name marked ``(step 40 of 100, in progress (pid N))`` or ``(..., unfinished (no
training running))``.

The table gets one column per option whose value differs between the compared runs (flattened
dotted keys such as ``model.n_steps``; run-time keys such as ``train.out_dir`` are left out), so
a sweep shows what it swept. The curves put tokens seen on the x axis (``step × batch_size ×
grad_accum_steps × block_size × world_size``), so runs with different batch sizes line up.

    energyformer compare out/llama out/cem out/cem_t2 --out results/cem.md --plot results/cem.png
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from energyformer.runs.recipe import read_yaml_mapping
from energyformer.runs.rundir import (
    CONFIG_FILE,
    SUMMARY_FILE,
    progress_note,
    read_metrics,
    read_run_config,
    read_summary,
    run_progress,
)
from energyformer.utils.plugins import PluginError

COLUMNS = ("run", "arch", "params", "best_val_loss", "final_val_loss", "final_train_loss", "evals", "steps",
           "tokens", "minutes", "tokens_per_s")
HEADERS = {"best_val_loss": "best val loss", "final_val_loss": "final val loss", "final_train_loss": "train loss",
           "tokens_per_s": "tokens/s"}
# options that say where or how a run was executed or logged, not what was trained: never a column
RUN_TIME_KEYS = frozenset({"train.out_dir", "train.resume", "train.num_threads", "train.log_interval",
                           "train.ckpt_interval", "train.tensorboard", "train.wandb", "train.wandb_project",
                           "train.wandb_run_name"})
X_AXES = {"tokens": "tokens seen (step × batch_size × grad_accum_steps × block_size × world_size)",
          "steps": "optimizer step"}
LEGEND_LINES_INSIDE = 8  # more labelled lines than this: one legend entry per run, outside the axes
DPI = 110


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"n_steps": 2}}`` → ``{"model.n_steps": 2}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_options(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``config.yaml`` as flat dotted keys (``{}`` when the run has none). A run whose
    plugin (``imports:``) does not import here is read as its ``config.yaml`` is written (a run's
    saved config holds every value): comparing runs needs their options and metrics, not their code.

    Raises:
        ValueError: ``config.yaml`` does not load (for another reason than a plugin that does not import).
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        return flatten(read_run_config(run_dir).to_dict())
    except PluginError:
        return flatten(read_yaml_mapping(path))


def differing_options(options: Sequence[dict[str, Any]]) -> list[str]:
    """The keys whose value differs between the runs that have them (in first-seen order), less
    :data:`RUN_TIME_KEYS`. A key only one run has (e.g. an arch-specific option) is not a
    difference of its own: the ``arch`` column shows it."""
    keys = list(dict.fromkeys(k for opts in options for k in opts
                              if k not in RUN_TIME_KEYS and k != "model.arch"))  # the arch column shows it
    out = []
    for key in keys:
        values: list[Any] = []
        for opts in options:
            if key in opts and opts[key] not in values:
                values.append(opts[key])
        if len(values) > 1:
            out.append(key)
    return out


def tokens_per_step(options: dict[str, Any], world_size: int | None = 1) -> int | None:
    """``batch_size × grad_accum_steps × block_size × world_size`` of a run (None without a config)."""
    try:
        per_rank = options["train.batch_size"] * options["train.grad_accum_steps"] * options["model.block_size"]
    except KeyError:
        return None
    return per_rank * (world_size or 1)


def metrics_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ``summary.json`` would say, from a run's ``metrics.jsonl`` records so far (a run in
    progress): its last step and losses, the best validation loss, the last tokens/s, the world
    size (logged under torchrun; None for one process); ``params`` and ``minutes`` are not logged
    there (None)."""
    def last(key: str) -> Any:
        return next((r[key] for r in reversed(records) if r.get(key) is not None), None)

    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {"steps": max((r["step"] for r in records if isinstance(r.get("step"), int)), default=None),
            "best_val_loss": min(vals) if vals else None, "final_val_loss": last("val_loss"),
            "final_train_loss": last("train_loss"), "tokens_per_s": last("tokens_per_s"),
            "params": None, "minutes": None, "world_size": last("world_size")}


def run_row(run_dir: str | Path, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The comparison row of one run directory: :data:`COLUMNS` (``evals``: the validation
    evaluations in ``metrics.jsonl``; ``tokens``: tokens seen at the last step).

    A run without ``summary.json`` whose ``metrics.jsonl`` holds records (in progress, or stopped)
    gets its row from them (:func:`metrics_summary`) and its name marked with where it stands
    (``energyformer.runs.rundir.progress_note``: the step of max_steps, the training's pid).

    Raises:
        FileNotFoundError: ``run_dir`` has neither ``summary.json`` nor ``metrics.jsonl`` records.
        ValueError: ``summary.json`` is not valid JSON, or ``config.yaml`` does not load.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    finished = (run_dir / SUMMARY_FILE).is_file() or not records
    summary = read_summary(run_dir) if finished else metrics_summary(records)
    options = run_options(run_dir) if options is None else options
    per_step = tokens_per_step(options, summary.get("world_size"))
    steps = summary.get("steps")
    name = run_dir.name
    if not finished:
        progress = run_progress(run_dir) if (run_dir / CONFIG_FILE).is_file() else \
            {"step": steps, "max_steps": None, "finished": False, "pid": None}
        name += f" ({progress_note(progress, steps)})"
    row = {"run": name, "arch": options.get("model.arch"),
           "evals": sum(1 for r in records if r.get("val_loss") is not None),
           "tokens": None if per_step is None or steps is None else steps * per_step}
    row.update({k: summary.get(k) for k in COLUMNS if k not in row})
    return {k: row[k] for k in COLUMNS}


def compare_runs(run_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows for ``run_dirs`` in the given order (see :func:`run_row`; a run in progress is compared
    on its metrics so far), each followed by the options that differ between the runs
    (:func:`differing_options`; None where a run lacks one).

    Raises:
        ValueError: no run directory, or see :func:`run_row`.
    """
    if not run_dirs:
        raise ValueError("compare needs at least one run directory")
    options = [run_options(d) for d in run_dirs]
    differing = differing_options(options)
    return [{**run_row(d, opts), **{k: opts.get(k) for k in differing}} for d, opts in zip(run_dirs, options)]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key in ("params", "steps", "evals", "tokens"):
        return f"{int(value):,}"
    if key.endswith("loss"):
        return f"{value:.4f}"
    if key == "minutes":
        return f"{value:.1f}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):  # 12 significant digits: 3e-3·0.1 shows as 0.0003, not 0.00030000000000000003
        return f"{value:.12g}"
    return str(value).replace("|", "\\|")


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: run, arch, the differing options (dotted keys), then the numbers
    (params with thousands separators, losses to 4 decimals, minutes to 1)."""
    extra = list(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS))
    keys = [*COLUMNS[:2], *extra, *COLUMNS[2:]]
    head = [HEADERS.get(k, k) for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(k, r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _x_scale(run_dir: str | Path, x: str) -> int:
    """What one step is worth on the x axis: 1 (steps) or the run's tokens per step."""
    if x == "steps":
        return 1
    summary = read_summary(run_dir) if (Path(run_dir) / SUMMARY_FILE).is_file() else \
        metrics_summary(read_metrics(run_dir))  # in progress: what the records say
    per_step = tokens_per_step(run_options(run_dir), summary.get("world_size"))
    if per_step is None:
        raise ValueError(f"{str(run_dir)!r} has no {CONFIG_FILE} to count tokens per step from; use --x steps")
    return per_step


def _draw_run(ax: Any, run_dir: str | Path, color: Any, x: str) -> None:
    """The run's validation (solid, dots) and training (dashed) losses, each line labelled
    ``RUN val`` / ``RUN train``; a run with one evaluation is one dot, one without any a legend entry."""
    scale, name = _x_scale(run_dir, x), Path(run_dir).name
    recs = read_metrics(run_dir)
    for kind, key, style in (("val", "val_loss", "-"), ("train", "train_loss", "--")):
        pts = [(r["step"] * scale, r[key]) for r in recs if r.get(key) is not None]
        xs, ys = (list(v) for v in zip(*pts)) if pts else ([], [])
        few = len(pts) <= (50 if kind == "val" else 1)
        ax.plot(xs, ys, color=color, linestyle=style, marker="o" if few else None,
                markersize=4 if kind == "val" else 3, linewidth=1.6 if kind == "val" else 1.0,
                alpha=1.0 if kind == "val" else 0.6, label=f"{name} {kind}" + ("" if pts else " (none recorded)"))


def _legend(ax: Any, n_runs: int) -> None:
    """Every line's label when few; else one entry per run (its colour) and one per line style,
    outside the axes on the right, in columns of at most 20 entries."""
    from matplotlib.lines import Line2D

    lines = ax.get_lines()
    if len(lines) <= LEGEND_LINES_INSIDE:
        ax.legend(fontsize=8, loc="best")
        return
    handles = [Line2D([], [], color=lines[2 * i].get_color(), linewidth=2,
                      label=lines[2 * i].get_label().rsplit(" val", 1)[0]) for i in range(n_runs)]
    handles += [Line2D([], [], color="0.3", linestyle="-", marker="o", markersize=3, label="validation"),
                Line2D([], [], color="0.3", linestyle="--", label="train")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              ncol=math.ceil(len(handles) / 20))


def curves_figure(run_dirs: Sequence[str | Path], x: str = "tokens") -> Any:
    """The loss curves of ``run_dirs`` as a matplotlib Figure (the caller closes it).

    Args:
        run_dirs: run directories (their ``metrics.jsonl`` and ``config.yaml``).
        x: ``"tokens"`` (tokens seen, from each run's config) or ``"steps"``.

    Raises:
        ValueError: ``x`` is neither, or ``x="tokens"`` for a run without ``config.yaml``.
        ModuleNotFoundError: no matplotlib.
    """
    if x not in X_AXES:
        raise ValueError(f"x={x!r} is not valid; expected 'tokens' (tokens seen) or 'steps'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(8, 4.5))
    cmap = plt.get_cmap("tab10" if len(run_dirs) <= 10 else "tab20")
    for i, run_dir in enumerate(run_dirs):
        _draw_run(ax, run_dir, cmap(i % cmap.N), x)
    ax.set_xlabel(X_AXES[x])
    if x == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    _legend(ax, len(run_dirs))
    fig.tight_layout()
    return fig


def plot_curves(run_dirs: Sequence[str | Path], path: str | Path, x: str = "tokens") -> Path:
    """Save :func:`curves_figure` to ``path`` (PNG, the legend included) and return ``path``."""
    fig = curves_figure(run_dirs, x)  # (sets the Agg backend before pyplot is imported here)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path
