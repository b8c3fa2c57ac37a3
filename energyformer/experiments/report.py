"""What the experiments write: Markdown tables, mean ± std over seeds, ``results/NAME/{table.md,
results.json, *.png}``, learning-curve plots, and the count-model floors printed beside every table.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from energyformer.experiments.convergence import val_curve
from energyformer.utils.io import atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from energyformer.experiments.common import Context


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
    quick = " --quick" if ctx.quick else ""
    interim = " --interim" if ctx.interim else ""
    return f"energyformer experiment {ctx.name}{quick}{seeds}{profile}{interim}"


def missing_text(ctx: Context) -> str:
    """The runs an interim table lacks, grouped by reason: ``"12 run(s) not in the tables: 11 not
    recorded (a, b, …); 1 recorded without its weights (c)"``."""
    if not ctx.missing:
        return "every run is recorded"
    by: dict[str, list[str]] = {}
    for run, why in ctx.missing.items():
        by.setdefault(why, []).append(run)
    return (f"{len(ctx.missing)} run(s) not in the tables: "
            + "; ".join(f"{len(runs)} {why} ({', '.join(runs)})" for why, runs in by.items()))


def interim_note(ctx: Context) -> str:
    """The header line of an interim table."""
    return ("**Interim**: the tables of the runs recorded so far, superseded by `table.md` one folder up "
            "once every run is in; each row averages the seeds recorded (its n is given), so a width with "
            f"fewer seeds than the others leans the curves; {missing_text(ctx)}.")


def write_results(ctx: Context, table: str, results: dict[str, Any], header: str = "",
                  footer: str = "") -> dict[str, Any]:
    """Write ``table.md`` (``header``, the reproducing command, the table, ``footer``) and
    ``results.json`` into ``ctx.report_dir`` (``NAME/``, or ``NAME/interim/`` for an interim table,
    whose header then names the runs not in it and why); the run records are written as the runs
    finish. The full table removes an earlier ``NAME/interim/``, which it supersedes."""
    out = ctx.report_dir
    out.mkdir(parents=True, exist_ok=True)
    if ctx.interim:
        header = interim_note(ctx) + " " + header
        ctx.say(f"interim tables in {out}: {missing_text(ctx)}")
    elif (ctx.out / "interim").is_dir():  # the full table supersedes the interim one
        import shutil

        shutil.rmtree(ctx.out / "interim")
    parts = [header.strip(), f"Reproduce: `{command_line(ctx)}`", table, footer.strip()]
    atomic_write_text(out / "table.md", "\n\n".join(p for p in parts if p) + "\n")
    payload = {"experiment": ctx.name, "seeds": ctx.seeds, "quick": ctx.quick, "command": command_line(ctx),
               **({"interim": True, "missing": dict(ctx.missing)} if ctx.interim else {}), **results}
    atomic_write_json(out / "results.json", payload)
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
    """Save ``fig`` as ``ctx.report_dir/file_name`` (tight layout, 110 dpi) and close it."""
    plt = pyplot()
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    path = ctx.report_dir / file_name
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


#: one arm of a budget check: (its value, its convergence record)
Arm = tuple["float | None", Mapping[str, Any]]


def budget_check(comparisons: Iterable[tuple[str, int, Arm, Arm]], metric: str) -> tuple[str, list[dict[str, Any]]]:
    """Does a verdict survive twice the steps? (docs/experiments.md §1): one row per comparison ``"B − A"``
    and budget, each ``(comparison, steps, (A's value, A's convergence), (B's value, B's convergence))``
    from one seed, so no interval; a missing value (``None``) shows as "–" and has no difference. Returns
    ``(markdown table, rows for results.json)``."""
    from energyformer.experiments.convergence import converged_cell

    def cell(v: float | None, fmt: str) -> str:
        return "–" if v is None or not math.isfinite(v) else format(v, fmt)

    cells, rows = [], []
    for comparison, steps, (a, conv_a), (b, conv_b) in comparisons:
        diff = None if a is None or b is None else b - a
        rows.append({"comparison": comparison, "steps": steps, "a": a, "b": b, "difference": diff,
                     "convergence": [conv_a.get("verdict"), conv_b.get("verdict")]})
        cells.append([comparison, f"{steps:,}", cell(a, ".4f"), cell(b, ".4f"), cell(diff, "+.4f"),
                      f"{converged_cell([conv_a])}; {converged_cell([conv_b])}"])
    head = ["comparison (B − A)", "steps", f"A: {metric}", f"B: {metric}", "Δ (B − A)", "converged (A; B)"]
    return ("Does the verdict survive twice the steps? (seed 1, the same schedule shape, one pair per budget, "
            "so no interval):\n\n" + markdown_table(head, cells)), rows


__all__ = ["budget_check", "command_line", "corpus_floors", "count_floors", "finish_axes", "floors_table",
           "markdown_table", "mean_std",
           "plot_learning_curves", "pm", "pyplot", "save_figure", "write_results"]
