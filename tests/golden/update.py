"""Golden loss curves: each family's first 50 training steps on a tiny config (CPU, float32, a
fixed seed, one thread), committed as ``tests/golden/<family>.json`` beside this script, as
torchtitan keeps one per model (the language models' ``helpers.TINY_MODELS`` on a tiny char corpus,
the in-context regressor on a tiny GP dataset). The default suite (``tests/train/test_golden.py``) trains each
family again through ``energyformer.train.train`` and compares step by step within
:data:`ATOL` + :data:`RTOL` × |loss|: the CPU run is deterministic on one machine (identical to the
bit); the tolerance leaves room for another BLAS or thread count (about 5e-7 between one and two
threads), far below what a change to the model, the optimizer, the schedule or the batches moves.

    python -m tests.golden.update                 # compare every family with its committed curve
    python -m tests.golden.update nrgpt cem       # only these
    python -m tests.golden.update --rewrite       # record them again, after a change meant to move them

Each file holds what produced it (model and train options, the data's settings, torch's version),
so a comparison reruns exactly that; ``--rewrite`` takes the current :data:`MODELS`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # tests/, for helpers (python -m tests.golden.update)

from helpers import TINY_MODELS, make_data_dir  # noqa: E402

STEPS = 50
TRAIN = {"max_steps": STEPS, "batch_size": 4, "eval_interval": STEPS, "eval_iters": 1, "log_interval": 1,
         "warmup_steps": 5, "learning_rate": 3e-3, "device": "cpu", "dtype": "float32", "num_threads": 1,
         "seed": 1337}
DATA = {"n_words": 2000, "seed": 0}  # helpers.make_data_dir's tiny corpus
ATOL = RTOL = 1e-4
#: the in-context regressor (not a language model, so not in helpers.TINY_MODELS) on a tiny GP dataset
REGRESSOR = {"arch": "regressor", "x_dim": 1, "d_model": 16, "n_heads": 2, "n_layers": 1, "block_size": 12}
GP_DATA = {"task": "gp", "n_points": 6, "n_train": 64, "n_val": 8, "n_test": 4, "x_dim": 1, "seed": 0}
#: every family with a golden curve: the language models' tiny configs and the regressor
MODELS = {**TINY_MODELS, "regressor": REGRESSOR}
#: the families that train on other data than the char corpus :data:`DATA`
OTHER_DATA = {"regressor": GP_DATA}


def data_of(family: str) -> dict[str, Any]:
    """The tiny data ``family`` trains on: :data:`OTHER_DATA`'s entry, else the char corpus."""
    return dict(OTHER_DATA.get(family, DATA))


def train_of(family: str) -> dict[str, Any]:
    """:data:`TRAIN` less the keys ``family``'s training loop does not read (it refuses them)."""
    from energyformer.models.registry import get_spec

    keys = get_spec(MODELS[family]["arch"]).train_keys
    return {k: v for k, v in TRAIN.items() if keys is None or k in keys}


def golden_path(family: str) -> Path:
    return HERE / f"{family}.json"


def families() -> list[str]:
    """The families with a tiny config, and any with a committed curve."""
    return sorted(set(MODELS) | {p.stem for p in HERE.glob("*.json")})


def train_curve(model: dict[str, Any], train: dict[str, Any], data: dict[str, Any], work: Path) -> list[float]:
    """The per-step training losses of ``model`` trained with ``train`` on the tiny data ``data``
    (the char corpus, or with ``"task": "gp"`` a GP dataset; written under ``work``); the process's
    thread count is restored afterwards."""
    import torch

    from energyformer.runs import load_config
    from energyformer.runs.rundir import read_metrics
    from energyformer.train import train as run_training

    if data.get("task") == "gp":
        from energyformer.data.task_data import prepare_task_data

        options = {k: v for k, v in data.items() if k != "task"}
        data_dir = prepare_task_data("gp", out_dir=work / "data" / "gp", verbose=False, **options)
    else:
        data_dir = make_data_dir(work / "data" / "golden", **data)
    out = work / model["arch"]
    cfg = load_config({"model": model, "data": {"data_dir": str(data_dir)}, "train": {**train, "out_dir": str(out)}},
                      resolve_vocab=True)
    threads = torch.get_num_threads()
    try:
        run_training(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    return [float(r["train_loss"]) for r in read_metrics(out) if r.get("train_loss") is not None]


def differences(golden: list[float], got: list[float]) -> list[str]:
    """One line per step outside the tolerance (and one for a different number of steps)."""
    lines = [f"{len(got)} steps logged, the golden curve has {len(golden)}"] if len(got) != len(golden) else []
    lines += [f"step {i + 1}: golden {g:.6f}, now {x:.6f} (|Δ| {abs(x - g):.2e})"
              for i, (g, x) in enumerate(zip(golden, got)) if not abs(x - g) <= ATOL + RTOL * abs(g)]
    return lines


def load(family: str) -> dict[str, Any]:
    return json.loads(golden_path(family).read_text(encoding="utf-8"))


def record(family: str, work: Path) -> dict[str, Any]:
    """The golden record of ``family`` from its current tiny config."""
    import torch

    model, train, data = dict(MODELS[family]), train_of(family), data_of(family)
    return {"family": family, "steps": STEPS, "model": model, "train": train, "data": data,
            "torch": torch.__version__, "tolerance": {"atol": ATOL, "rtol": RTOL},
            "train_loss": train_curve(model, train, data, work)}


def compare(family: str, work: Path) -> list[str]:
    """The differences of ``family``'s training now from its committed curve (rerun with the
    options the file records)."""
    if not golden_path(family).is_file():
        return [f"no golden curve {golden_path(family)}; record it with --rewrite"]
    g = load(family)
    return differences(g["train_loss"], train_curve(g["model"], g["train"], g["data"], work))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.golden.update", description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all ({', '.join(families())})")
    ap.add_argument("--rewrite", action="store_true", help="record the curves again instead of comparing")
    args = ap.parse_args(argv)
    names = args.families or families()
    unknown = [f for f in names if f not in MODELS and not golden_path(f).is_file()]
    if unknown:
        ap.error(f"unknown family {', '.join(unknown)}; expected one of {', '.join(families())}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family in names:
            work = Path(tmp) / family
            if args.rewrite:
                rec = record(family, work)
                golden_path(family).write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
                print(f"{family}: wrote {golden_path(family)} ({rec['train_loss'][0]:.4f} → "
                      f"{rec['train_loss'][-1]:.4f} in {len(rec['train_loss'])} steps)")
                continue
            diff = compare(family, work)
            failed += bool(diff)
            print(f"{family}: " + ("matches its golden curve" if not diff else
                                   f"DIFFERS at {len(diff)} steps\n  " + "\n  ".join(diff[:10])))
    if failed:
        print(f"{failed} of {len(names)} families differ; if the change is meant to move them: "
              "python -m tests.golden.update --rewrite")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
