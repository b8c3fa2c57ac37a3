"""Compare finished runs: one table (Markdown or JSON) and validation-loss curves.

Reads only what ``energyformer train`` writes into a run directory, through the readers of
``energyformer.runs``: ``summary.json`` (final numbers), ``config.yaml`` (the recipe) and
``metrics.jsonl`` (the curves), so it works on runs copied from another machine without the data.

    energyformer compare out/llama out/cem out/cem_t2 --out results/cem.md --plot results/cem.png
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from energyformer.runs.rundir import CONFIG_FILE, read_metrics, read_run_config, read_summary

COLUMNS = ("run", "arch", "params", "best_val_loss", "final_val_loss", "final_train_loss", "steps",
           "minutes", "tokens_per_s")


def run_row(run_dir: str | Path) -> dict[str, Any]:
    """The comparison row of one run directory.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``summary.json`` (the run has not finished).
        ValueError: ``summary.json`` is not valid JSON, or ``config.yaml`` does not load.
    """
    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    arch = read_run_config(run_dir).model.arch if (run_dir / CONFIG_FILE).is_file() else None
    row = {"run": run_dir.name, "arch": arch}
    row.update({k: summary.get(k) for k in COLUMNS if k not in row})
    return row


def compare_runs(run_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows for ``run_dirs`` in the given order (see :func:`run_row`)."""
    if not run_dirs:
        raise ValueError("compare needs at least one run directory")
    return [run_row(d) for d in run_dirs]


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: params with thousands separators, losses to 4 decimals, minutes to 1."""
    head = ["run", "arch", "params", "best val loss", "final val loss", "train loss", "steps", "minutes", "tokens/s"]

    def cell(k: str, v: Any) -> str:
        if v is None:
            return "–"
        if k in ("params", "steps"):
            return f"{int(v):,}"
        if k.endswith("loss"):
            return f"{v:.4f}"
        if k == "minutes":
            return f"{v:.1f}"
        if k == "tokens_per_s":
            return f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(k, r.get(k)) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def plot_curves(run_dirs: Sequence[str | Path], path: str | Path) -> Path:
    """Validation (solid) and training (faint) loss against step for every run, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run_dir in run_dirs:
        recs = read_metrics(run_dir)
        name = Path(run_dir).name
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        line, = ax.plot(*zip(*val), label=name) if val else ax.plot([], [], label=name)
        train = [(r["step"], r["train_loss"]) for r in recs if "train_loss" in r]
        if train:
            ax.plot(*zip(*train), color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
