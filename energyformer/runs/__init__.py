"""Runs: the run configuration (recipes, overrides) and the run directory with its checkpoints.

    from energyformer.runs import load_config, load_run, open_run
    cfg = load_config("configs/shakespeare_char/cem_t2.yaml", ["--train.max_steps", "100"])
    model, run_cfg, meta = load_run("out/cem_t2")
    model, run_cfg, meta, tokenizer, device, run_dir = open_run("zoo:cem_t2_shakespeare_char", "cpu")

Modules, one job each: ``config`` (DataConfig/TrainConfig/RunConfig, ``load_config``,
``save_config``), ``parser`` (the one command-line parser: jsonargparse with the project's
conventions, for every command and the run-config overrides), ``recipe`` (YAML recipes with
``base:`` inheritance), ``weights``
(safetensors with tied aliases), ``rng`` (RNG states), ``rundir`` (the files of a run directory,
``load_run``, and ``open_run``: a run opened for inference as ``sample``, ``inspect`` and ``eval``
open it), ``checkpoint`` (saving, finding and restoring a checkpoint).
"""
from energyformer.runs.checkpoint import find_checkpoint, load_train_state, restore_checkpoint, save_checkpoint
from energyformer.runs.config import (
    DataConfig,
    RunConfig,
    TrainConfig,
    build_model_from_recipe,
    load_config,
    run_config_parser,
    save_config,
)
from energyformer.runs.recipe import read_recipe
from energyformer.runs.rundir import (
    OpenRun,
    load_run,
    open_run,
    read_metrics,
    read_run_config,
    read_run_meta,
    read_summary,
    write_run_files,
    write_summary,
)
from energyformer.runs.weights import load_weights, read_weights, save_weights

__all__ = ["DataConfig", "OpenRun", "RunConfig", "TrainConfig", "build_model_from_recipe", "find_checkpoint",
           "load_config", "load_run", "load_train_state", "load_weights", "open_run", "read_metrics", "read_recipe",
           "read_run_config", "read_run_meta", "read_summary", "read_weights", "restore_checkpoint",
           "run_config_parser", "save_checkpoint", "save_config", "save_weights", "write_run_files", "write_summary"]
