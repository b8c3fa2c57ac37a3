"""ListOps as the NRGPT paper's released code generates it: nested functions on digits, written as
a chain of reductions (docs/nrgpt.md §8; ``energyformer prepare listops``).

An expression is a random tree: the root is a function node; each function node has
``min_args…max_args`` children (uniform); a child is itself a function node with probability
``func_node_prob`` while the tree is shallower than ``max_depth`` (so depth 2 = the root plus one
level of nested functions), else a digit ``0…9``. Functions (defaults: the released code's
``add``/``max``/``median``, all mod 10)::

    S  sum of the arguments mod 10
    X  max
    D  median: the element at index n // 2 of the sorted arguments (an argument, so a digit)

Each example is written as its chain of reductions, one token per character: the expression,
then after every ``=`` the expression with one function node replaced by its value (the
leftmost innermost function first, as the released code reduces), ending in the answer and
the end token ``\\n``::

    S(3X(12)4)=S(324)=9\\n

Held-out design (as the released code): an *exclusion set* of ``int(10**max_args ·
exclusion_rate)`` random ordered tuples of ``max_args`` distinct digits is drawn first. An
expression whose chain contains one of them as ``max_args`` consecutive characters goes to the
test set, every other one may go to train (and validation), so no test expression (and no
excluded digit sequence) ever appears in training. Everything is drawn from one
``random.Random(seed)``: the same seed gives the same files, byte for byte.

Files (``data/listops``): ``train.bin`` / ``val.bin`` (the concatenated chains, uint16 character
ids), ``test.jsonl`` (one test problem per line: ``prompt`` = the expression and ``=``,
``answer``, ``function`` of the root, ``chain``), ``meta.json`` (char tokenizer, the generator
settings, sha256 of every file).
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from .._validate import check_float, check_int
from ..utils.io import atomic_write_bytes
from .meta import FORMAT_VERSION, META_FILE, TOKEN_DTYPE
from .shakespeare import sha256_file
from .tokenizers import CharTokenizer

END = "\n"
DIGITS = "0123456789"


def _sum_mod_10(args: Sequence[int]) -> int:
    return sum(args) % 10


def _median(args: Sequence[int]) -> int:
    return sorted(args)[len(args) // 2]


#: function name -> (its one-character symbol, the function of a list of digits)
FUNCTIONS: dict[str, tuple[str, Callable[[Sequence[int]], int]]] = {
    "sum_mod_10": ("S", _sum_mod_10),
    "max": ("X", max),
    "median": ("D", _median),
}
SYMBOLS = {symbol: name for name, (symbol, _) in FUNCTIONS.items()}


@dataclass(frozen=True)
class ListOpsSettings:
    """Generator settings; the defaults are the released NRGPT code's ListOps (LOPS00) data file.

    Raises:
        ValueError: an unknown function, ``max_depth < 1``, ``min_args < 1``,
            ``max_args < min_args``, ``max_args > 10`` (excluded tuples hold distinct digits),
            a probability outside [0, 1], or sizes < 1.
    """

    functions: tuple[str, ...] = ("sum_mod_10", "max", "median")
    max_depth: int = 2
    min_args: int = 2
    max_args: int = 3
    func_node_prob: float = 0.25
    exclusion_rate: float = 0.05
    n_train: int = 50_000
    n_val: int = 2_000
    n_test: int = 2_000
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "functions", tuple(self.functions))
        if not self.functions:
            raise ValueError("functions=() is not valid; give at least one of " + ", ".join(FUNCTIONS))
        for f in self.functions:
            if f not in FUNCTIONS:
                raise ValueError(f"function {f!r} is not valid; expected some of {list(FUNCTIONS)}")
        check_int("max_depth", self.max_depth, 1)
        check_int("min_args", self.min_args, 1)
        check_int("max_args", self.max_args, self.min_args, maximum=10)
        check_float("func_node_prob", self.func_node_prob, 0.0, maximum=1.0)
        check_float("exclusion_rate", self.exclusion_rate, 0.0, strict=True, maximum=1.0)
        for name in ("n_train", "n_val", "n_test"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)


# ----------------------------------------------------------------------------------------------
# trees and chains
# ----------------------------------------------------------------------------------------------

# A tree is either a digit (int) or a list ``[symbol, child, child, ...]``.

def random_tree(rng: random.Random, s: ListOpsSettings, depth: int = 0, symbol: str | None = None) -> list:
    """A random function node at ``depth`` (its children drawn as the module docstring says)."""
    symbols = [FUNCTIONS[f][0] for f in s.functions]
    node: list = [symbol if symbol is not None else rng.choice(symbols)]
    for _ in range(rng.randint(s.min_args, s.max_args)):
        if depth + 1 < s.max_depth and rng.random() < s.func_node_prob:
            node.append(random_tree(rng, s, depth + 1))
        else:
            node.append(rng.randrange(10))
    return node


def to_text(tree: list | int) -> str:
    """``["S", 3, ["X", 1, 2], 4]`` → ``"S(3X(12)4)"``."""
    if isinstance(tree, int):
        return str(tree)
    return tree[0] + "(" + "".join(to_text(c) for c in tree[1:]) + ")"


def evaluate(tree: list | int) -> int:
    """The value of a tree (a digit)."""
    if isinstance(tree, int):
        return tree
    return FUNCTIONS[SYMBOLS[tree[0]]][1]([evaluate(c) for c in tree[1:]])


def _reduce_once(tree: list) -> list | int:
    """``tree`` with its leftmost innermost function node replaced by its value."""
    for i, child in enumerate(tree[1:], start=1):
        if isinstance(child, list):
            return tree[:i] + [_reduce_once(child)] + tree[i + 1:]
    return evaluate(tree)


def chain(tree: list) -> str:
    """The chain of reductions of ``tree``, ``"S(3X(12)4)=S(324)=9\\n"`` (ends with the end token)."""
    steps = [to_text(tree)]
    node: list | int = tree
    while isinstance(node, list):
        node = _reduce_once(node)
        steps.append(to_text(node))
    return "=".join(steps) + END


def exclusion_set(rng: random.Random, s: ListOpsSettings) -> set[str]:
    """``int(10**max_args · exclusion_rate)`` draws of ``max_args`` distinct digits, as strings."""
    n = max(1, int(10 ** s.max_args * s.exclusion_rate))
    return {"".join(rng.sample(DIGITS, s.max_args)) for _ in range(n)}


def is_held_out(text: str, excluded: set[str], width: int) -> bool:
    """Whether ``text`` holds an excluded tuple as ``width`` consecutive characters."""
    return any(text[i:i + width] in excluded for i in range(len(text) - width + 1))


def generate(s: ListOpsSettings, max_draws_per_example: int = 200) -> dict:
    """Draw the train, validation and test examples.

    Returns:
        ``{"train": [chain, ...], "val": [chain, ...], "test": [{"prompt", "answer", "function",
        "chain"}, ...], "excluded": sorted excluded tuples}``.

    Raises:
        ValueError: the settings cannot give ``n_test`` held-out expressions within
            ``max_draws_per_example · (n_train + n_val + n_test)`` draws (e.g. an exclusion
            rate so small that no expression is held out).
    """
    rng = random.Random(s.seed)
    excluded = exclusion_set(rng, s)
    train: list[str] = []
    val: list[str] = []
    test: list[dict] = []
    budget = max_draws_per_example * (s.n_train + s.n_val + s.n_test)
    for _ in range(budget):
        if len(train) >= s.n_train and len(val) >= s.n_val and len(test) >= s.n_test:
            break
        tree = random_tree(rng, s)
        text = chain(tree)
        if is_held_out(text, excluded, s.max_args):
            if len(test) < s.n_test:
                test.append(_problem(tree, text))
        elif len(train) < s.n_train:
            train.append(text)
        elif len(val) < s.n_val:
            val.append(text)
    else:
        raise ValueError(f"could not draw {s.n_test} held-out and {s.n_train + s.n_val} other ListOps "
                         f"expressions in {budget} draws (got {len(test)} and {len(train) + len(val)}); "
                         "raise exclusion_rate or lower n_test")
    return {"train": train, "val": val, "test": test, "excluded": sorted(excluded)}


def _problem(tree: list, text: str) -> dict:
    return {"prompt": text.split("=", 1)[0] + "=", "answer": str(evaluate(tree)), "function": SYMBOLS[tree[0]],
            "chain": text}


def single_function_tests(s: ListOpsSettings, n: int = 100, max_draws_per_example: int = 200) -> dict[str, list[dict]]:
    """Held-out test problems whose every operator is one function, per function (the released
    code's ``test_single_ops``).

    For each function of ``s``, trees are drawn as :func:`random_tree` draws them but from that
    function alone, and kept when their chain is held out by the same exclusion set as the
    dataset made with ``s`` (so none can appear in its training split). Each function has its
    own ``random.Random`` seeded from ``s.seed`` and its name: the sets do not depend on each
    other or on ``n_train``.

    Returns:
        ``{function name: [{"prompt", "answer", "function", "chain"}, ...]}`` (``n`` each, in the
        order of ``s.functions``).

    Raises:
        ValueError: ``n < 1``, or fewer than ``n`` held-out expressions of a function within
            ``max_draws_per_example · n`` draws.
    """
    check_int("n", n, 1)
    excluded = exclusion_set(random.Random(s.seed), s)  # the first draws of generate(s)
    out: dict[str, list[dict]] = {}
    for name in dict.fromkeys(s.functions):
        rng = random.Random(f"listops-single-function:{s.seed}:{name}")
        one = ListOpsSettings(**{**asdict(s), "functions": (name,)})
        found: list[dict] = []
        for _ in range(max_draws_per_example * n):
            tree = random_tree(rng, one)
            text = chain(tree)
            if is_held_out(text, excluded, s.max_args):
                found.append(_problem(tree, text))
                if len(found) == n:
                    break
        else:
            raise ValueError(f"found {len(found)} of {n} held-out {name} expressions in {max_draws_per_example * n} "
                             "draws; lower n or raise exclusion_rate")
        out[name] = found
    return out


def vocabulary(s: ListOpsSettings) -> list[str]:
    """Every character a chain can hold, sorted: the char tokenizer's vocabulary."""
    return sorted(set(DIGITS + "()=" + END + "".join(FUNCTIONS[f][0] for f in s.functions)))


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------

def write_listops(out_dir: str | Path, s: ListOpsSettings) -> dict:
    """Generate the data and write ``train.bin``, ``val.bin``, ``test.jsonl`` and ``meta.json`` (last).

    Returns:
        the metadata written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)
    data = generate(s)
    tok = CharTokenizer(vocabulary(s))
    arrays = {split: tok.encode_array("".join(data[split]), dtype=TOKEN_DTYPE) for split in ("train", "val")}
    for split, arr in arrays.items():
        atomic_write_bytes(out_dir / f"{split}.bin", arr.tobytes())
    test_text = "".join(json.dumps(ex, sort_keys=True) + "\n" for ex in data["test"])
    atomic_write_bytes(out_dir / "test.jsonl", test_text.encode("utf-8"))
    meta = {
        "format_version": FORMAT_VERSION, "dataset": "listops", **tok.to_meta(), "dtype": "uint16",
        "n_train": int(arrays["train"].size), "n_val": int(arrays["val"].size),
        "n_train_examples": len(data["train"]), "n_val_examples": len(data["val"]),
        "n_test_examples": len(data["test"]),
        "train_sha256": hashlib.sha256(arrays["train"].tobytes()).hexdigest(),
        "val_sha256": hashlib.sha256(arrays["val"].tobytes()).hexdigest(),
        "test_sha256": sha256_file(out_dir / "test.jsonl"),
        "functions": {f: FUNCTIONS[f][0] for f in s.functions},
        "excluded": data["excluded"],
        "settings": {**asdict(s), "functions": list(s.functions)},
        "source": {"kind": "generator", "generator": "listops", "version": 1},
    }
    atomic_write_bytes(out_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return meta


def read_test(data_dir: str | Path) -> list[dict]:
    """The test problems of a prepared ListOps directory (``test.jsonl``).

    Raises:
        FileNotFoundError: no ``test.jsonl`` (run ``energyformer prepare listops``).
    """
    path = Path(data_dir) / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `energyformer prepare listops` first")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def expected_meta(s: ListOpsSettings) -> dict:
    """The meta.json values that must match for a prepared directory to be up to date."""
    return {"dataset": "listops", "settings": {**asdict(s), "functions": list(s.functions)},
            "source.version": 1}


def describe(meta: dict) -> str:
    """One line for the prepare command's output."""
    return (f"{meta['n_train_examples']:,} train / {meta['n_val_examples']:,} val / "
            f"{meta['n_test_examples']:,} test expressions, vocab {meta['vocab_size']}, "
            f"train {meta['n_train']:,} / val {meta['n_val']:,} tokens")


__all__ = ["FUNCTIONS", "ListOpsSettings", "chain", "evaluate", "generate", "read_test", "single_function_tests",
           "write_listops"]
