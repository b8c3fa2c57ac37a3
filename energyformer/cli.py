"""``energyformer [--import MODULE ...] <command>``: the command line of :mod:`energyformer.commands`.

    energyformer prepare shakespeare_char|english|listops|gp [options]   # `prepare NAME --help`
    energyformer prepare text FILE [--out DIR] [--tokenizer char] [--force]
    energyformer train RECIPE.yaml [--section.key value ...]      # RECIPE --help lists every key
    energyformer train --config RECIPE.yaml [--section.key value ...]                # the same
    energyformer sample RUN_DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]
        [--top_p P] [--min_p P] [--repetition_penalty R] [--stop TEXT] [--interactive] [--use_cache false]
    energyformer info RECIPE.yaml|RUN_DIR [--section.key value ...]
    energyformer compare RUN_DIR [RUN_DIR ...] [--out TABLE.md|TABLE.json] [--plot CURVES.png] [--x tokens|steps]
    energyformer experiment NAME [--seeds K] [--quick] [--profile paper] [--jobs N] [--interim]  # results/NAME/
    energyformer inspect RUN_DIR --prompt TEXT --out DIR    # energy per layer/step/term/token: JSON + PNG
    energyformer export RUN_DIR [--to DIR] [--as energyformer|llama|gpt2] [--force] [--verbose]  # a transformers folder
    energyformer import-hf HF_DIR [--out RUN_DIR] [--force] [--verbose]      # stock Llama / GPT-2 → a run
    energyformer eval RUN_DIR [--tasks mmlu_dev,val_loss,TASK] [--limit N] [--out REPORT.json] [--quiet]
    energyformer zoo                                        # the trained models that ship: RUN_DIR = zoo:NAME

Each command's flags are built from its function's signature and docstring
(:class:`energyformer.runs.parser.ArgParser`: ``-`` or ``_`` in flag names, a boolean flag alone
means true, ``inf``/``nan`` are numbers); ``train`` and ``info`` hand their ``--section.key
value`` overrides to the run-config parser (``energyformer.runs.config.load_config``).
``--import MODULE`` (repeatable, before or after the command) imports a plugin module before the
command runs; ``train`` records it in the run's config.yaml (``imports:``) so later commands on
the run import it too.

User errors (bad options, missing files, data errors) print one line ``error: <message>`` and
exit with status 2; ``--debug`` (anywhere on the command line) shows the traceback too.
Warnings (e.g. a renamed config key) print as one line ``warning: <message>``. A diverged
training run exits with status 3.
"""
from __future__ import annotations

import inspect
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from energyformer import __version__
from energyformer import commands as cmd
from energyformer.runs.parser import ArgParser

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (`... | head`)
format_summary = cmd.format_summary  # the summary `train` prints (kept here for callers)

# command name -> (function, how its result is printed; None: not printed)
COMMANDS: dict[str, tuple[Callable[..., Any], Callable[[Any], str] | None]] = {
    "prepare": (cmd.prepare, None),
    "train": (cmd.train, cmd.format_summary),
    "sample": (cmd.sample, cmd.SAMPLE_SEPARATOR.join),
    "info": (cmd.info, str),
    "compare": (cmd.compare, str),
    "experiment": (cmd.experiment, str),
    "inspect": (cmd.inspect_energy, str),
    "export": (cmd.export, str),
    "import-hf": (cmd.import_hf, str),
    "eval": (cmd.evaluate, cmd.format_eval),
    "zoo": (cmd.zoo, str),
}
# parameters not built from the signature: free override tokens (added as REMAINDER), a list of
# positionals (added with nargs="+"), options for Python callers only (progress, imports)
_SKIP = {"train": {"overrides", "progress", "imports"}, "info": {"overrides"}, "compare": {"run_dirs"}}
# optional packages → the extra that installs them (named in the error when one is missing)
OPTIONAL_PACKAGES = {"matplotlib": "viz", "tensorboard": "viz", "transformers": "hf", "tokenizers": "hf",
                     "lm_eval": "eval", "wandb": "wandb"}


def _command_parser(name: str, fn: Callable[..., Any]) -> ArgParser:
    from jsonargparse import REMAINDER

    doc = inspect.cleandoc(fn.__doc__ or "").split("\nArgs:")[0]  # the Args section becomes the flags' help
    sub = ArgParser(prog=f"energyformer {name}", description=doc)
    skip = _SKIP.get(name, set())
    sub.add_function_arguments(fn, as_positional=True, skip=skip)
    if "overrides" in skip:  # the recipe may also be given as --config RECIPE
        sub.config_flag = "config"
        sub.add_argument("overrides", nargs=REMAINDER, metavar="--section.key VALUE",
                         help="overrides of recipe values, e.g. --train.max_steps 100 --model.n_steps=6")
    if "run_dirs" in skip:
        sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                         help="run directories (finished, or in progress: compared on their metrics so far)")
    return sub


def build_parser() -> ArgParser:
    """The ``energyformer`` parser: one subcommand per entry of :data:`COMMANDS`."""
    parser = ArgParser(prog="energyformer",
                           description="Energy-based Transformer layers (CEM, NRGPT): data, training, sampling.")
    parser.add_argument("--version", action="version", version=f"energyformer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--import", dest="imports", action="append", type=str, default=[], metavar="MODULE",
                        help="import this plugin module first (repeatable, also after the command); train "
                             "records it in the run's config")
    subcommands = parser.add_subcommands(dest="command", required=True)
    for name, (fn, _) in COMMANDS.items():
        sub = cmd.prepare_parser() if name == "prepare" else _command_parser(name, fn)
        subcommands.add_subcommand(name, sub, help=(sub.description or "").splitlines()[0])
        if name == "prepare":  # (jsonargparse adds nested subcommands once their parent is attached)
            cmd.add_datasets(sub)
    return parser


def _split_imports(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(argv without its --import MODULE tokens, the modules in order)``: ``--import`` is taken
    anywhere on the command line, before the command or after it (as ``--debug``).

    Raises:
        ValueError: an ``--import`` at the end, without its module.
    """
    rest: list[str] = []
    modules: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name != "--import":
            rest.append(argv[i])
        elif eq:
            modules.append(value)
        elif i + 1 < len(argv):
            modules.append(argv[i + 1])
            i += 1
        else:
            raise ValueError("--import needs a value (a module name, e.g. --import my_options)")
        i += 1
    return rest, modules


def _parse(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    argv, imports = _split_imports(argv)
    ns = build_parser().parse_args(argv)
    kwargs = ns[ns.command].as_dict()
    if ns.command == "prepare":  # {"name": "gp", "gp": {...}} → name="gp", the gp options
        kwargs = {"name": kwargs["name"], **kwargs[kwargs["name"]]}
    return ns.command, kwargs, imports


def parse_command_line(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``(command name, keyword arguments of its function)`` for a command line (without ``--debug``).

    Raises:
        SystemExit: ``--help`` / ``--version`` (status 0).
        ValueError: a usage error, as one line naming the flag and the expected type.
    """
    name, kwargs, _ = _parse(argv)
    return name, kwargs


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


def _run(argv: list[str], fail: Callable[..., int]) -> int:
    """Parse ``argv``, import the plugins, run the command and print its result."""
    from energyformer.data import DataPreparationError
    from energyformer.train.loop import TrainingDivergedError
    from energyformer.utils.plugins import load_plugins

    user_errors = (ValueError, OSError, DataPreparationError)
    try:
        name, kwargs, imports = _parse(argv)
        imports = load_plugins(imports, where="--import")  # checked and imported before the command runs
        if name == "train":
            kwargs["imports"] = imports
        fn, show = COMMANDS[name]
        if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 prints the result
            show = None
        result = fn(**kwargs)
        if show is not None and result is not None:
            print(show(result), flush=True)
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    except TrainingDivergedError as e:
        return fail(e, EXIT_DIVERGED)
    except BrokenPipeError:  # the reader went away: stop quietly, no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "energyformer":
            raise
        return fail(e)
    except user_errors as e:
        return fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energyformer`` / ``python -m energyformer``; returns the exit status.

    Exit status: 0 success; 2 a user error (bad input, a missing file or optional package, an
    operating-system error such as a full disk), printed as one line ``error: ...``; 3 a
    diverged training run; 130 interrupted; 141 output closed early (``| head``), quietly.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv

    def fail(e: BaseException, code: int = EXIT_USER_ERROR) -> int:
        if debug:
            traceback.print_exc()
        _report(f"error: {error_line(e)}")
        return code

    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run([a for a in argv if a != "--debug"], fail)
