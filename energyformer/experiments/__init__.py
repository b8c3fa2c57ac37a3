"""The papers' experiments, one command each (``energyformer experiment NAME [--seeds 3] [--quick]``).

Each experiment is a module here with ``run(ctx)`` and its budget in its docstring; it trains its
runs (a finished run with the same config is reused, not repeated), writes
``results/NAME/{table.md, results.json, *.png}`` and the runs' summaries, and returns the table.

    (a) cem_ablation  (b) gp_recursion  (c) listops_transition  (d) shakespeare_scaling
    (e) energy_descent  (f) inference_steps  (g) inference_compute
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from energyformer._validate import check_choice, check_int

EXPERIMENTS = ("cem_ablation", "gp_recursion", "listops_transition", "shakespeare_scaling", "energy_descent",
               "inference_steps", "inference_compute")


PROFILES = ("cpu", "paper")
#: experiments that can write an interim table from the runs recorded so far (``--interim``): those
#: whose tables stand on any subset of their runs
INTERIM_EXPERIMENTS = ("cem_ablation",)


def run_experiment(name: str, seeds: int | None = None, quick: bool = False, results_dir: str | Path = "results",
                   work_dir: str | Path = "out/experiments", data_root: str | Path = "data",
                   verbose: bool = True, profile: str = "cpu", rescore: bool = False, jobs: int = 1,
                   threads: int | None = None, interim: bool = False) -> dict[str, Any]:
    """Run the experiment ``name`` (see :mod:`energyformer.experiments.common` for the options).

    Returns:
        its results (also in ``results_dir/NAME/results.json``; with ``interim``,
        ``results_dir/NAME/interim/results.json``), with the Markdown ``"table"``.

    Raises:
        ValueError: unknown ``name`` or ``profile``, ``seeds < 1``, ``jobs < 1``, ``threads < 1``;
            ``interim`` for an experiment outside :data:`INTERIM_EXPERIMENTS` or with the paper
            profile, or before the experiment's LR checks are recorded.
        FileNotFoundError: (full runs) the experiment's dataset is not prepared.
    """
    from energyformer.experiments.common import Context

    check_choice("profile", profile, PROFILES)
    if profile == "paper":
        from energyformer.experiments.profiles import profiles

        check_choice("experiment", name, tuple(profiles()))
    else:
        check_choice("experiment", name, EXPERIMENTS)
    if seeds is not None:
        check_int("seeds", seeds, 1)
    check_int("jobs", jobs, 1)
    if threads is not None:
        check_int("threads", threads, 1)
    if interim and name not in INTERIM_EXPERIMENTS:
        raise ValueError(f"--interim is available for {', '.join(INTERIM_EXPERIMENTS)}, not {name!r}: its "
                         "tables need all of their runs")
    if interim and profile != "cpu":
        raise ValueError(f"--interim works with the cpu profile, not {profile!r}")
    ctx = Context(name=name, seeds=seeds, quick=quick, results_dir=Path(results_dir), work_dir=Path(work_dir),
                  data_root=Path(data_root), verbose=verbose, profile=profile, rescore=rescore, jobs=jobs,
                  threads=threads, interim=interim)
    if profile == "paper":
        from energyformer.experiments.profiles import run_profile

        return run_profile(ctx)
    module = importlib.import_module(f"energyformer.experiments.{name}")
    ctx.say(f"experiment {name}: {'default' if seeds is None else seeds} seed(s){' (quick)' if quick else ''}"
            f"{' (interim: trains nothing)' if interim else ''}; runs in {ctx.runs}, results in {ctx.report_dir}")
    if rescore:
        from energyformer.experiments.common import rescore_records

        rescore_records(ctx)
    if jobs > 1 and not interim:  # interim trains nothing
        from energyformer.experiments.parallel import run_parallel

        return run_parallel(module, ctx)
    if threads is None:
        return module.run(ctx)
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return module.run(ctx)
    finally:
        torch.set_num_threads(saved)
