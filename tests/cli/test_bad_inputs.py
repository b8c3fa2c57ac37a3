"""The catalogue of bad inputs: every one a clear error, and nothing lost.

Each command-line case asserts: exit status 2, exactly one line on stderr, ``error: ...``
naming the value and what was expected (the regex), no traceback, and no file under the test's
folder written, changed or removed (the run directory's ``.lock`` aside: taking the lock is
how a training finds out that it may write). The Python cases assert the documented exception
with a one-line message.
"""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import make_data_dir

from energyformer.cli import main
from energyformer.data import DATASETS

MODEL = {"arch": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "block_size": 16}
TRAIN = {"max_steps": 2, "batch_size": 4, "eval_interval": 2, "eval_iters": 1, "log_interval": 1,
         "warmup_steps": 1, "device": "cpu"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run and its data (copied into each case's folder)."""
    root = tmp_path_factory.mktemp("trained")
    data = make_data_dir(root / "data")
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "data": {"data_dir": str(data)}, "train": TRAIN}))
    assert main(["train", str(recipe), "--train.out_dir", str(root / "run")]) == 0
    return root


class Case:
    """A case's folder: ``data`` and ``run`` are fresh copies; ``recipe(...)`` writes a recipe."""

    def __init__(self, root: Path, trained: Path):
        self.root = root
        shutil.copytree(trained / "data", root / "data")
        shutil.copytree(trained / "run", root / "run")
        self.data, self.run = root / "data", root / "run"
        self.recipe_path = self.recipe()

    def recipe(self, name="r.yaml", model=None, train=None, text=None):
        path = self.root / name
        if text is not None:
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
            return path
        doc = {"model": {**MODEL, **(model or {})}, "data": {"data_dir": str(self.data)},
               "train": {**TRAIN, "out_dir": str(self.root / "out"), **(train or {})}}
        path.write_text(yaml.safe_dump(doc))
        return path

    def train(self, *overrides, recipe=None):
        return ["train", str(recipe or self.recipe_path), *overrides]

    def resume(self, *overrides):
        return ["train", str(self.recipe_path), "--train.out_dir", str(self.run), *overrides]


def _train(*overrides):
    """A case's set-up that trains the shared recipe with ``overrides``."""
    return lambda c: c.train(*overrides)


def _set_meta(c, **changes):
    meta = json.loads((c.data / "meta.json").read_text())
    meta.update(changes)
    (c.data / "meta.json").write_text(json.dumps(meta))


def _rewrite_data(c, text):
    shutil.rmtree(c.data)
    make_data_dir(c.data, seed=1)
    chars = sorted(set(text))
    ids = np.array([chars.index(ch) for ch in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    ids[:n].tofile(c.data / "train.bin")
    ids[n:].tofile(c.data / "val.bin")
    _set_meta(c, chars=chars, vocab_size=len(chars), n_train=n, n_val=len(ids) - n)


def _foreign_state(c):
    marker = json.loads((c.run / "checkpoint.json").read_text())
    torch.save({"epoch": 1, "model": {}}, c.run / marker["dir"] / "train_state.pt")
    return c.resume("--train.max_steps", "4")


def _hold_lock(c):
    import fcntl
    fd = os.open(c.run / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    c.held = fd  # closed (released) with the case
    return c.resume("--train.max_steps", "4")


def _no_matplotlib(c, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    return ["compare", str(c.run), "--plot", str(c.root / "p.png"), "--out", str(c.root / "t.md")]


# (id, setup(case[, monkeypatch]) -> argv, regex the one error line must match)
CLI_CASES = [
    # --- recipes (YAML) ---
    ("recipe-missing", lambda c: ["train", str(c.root / "nope.yaml")], r"config file .*nope\.yaml' does not exist"),
    ("recipe-mistyped-bundled", lambda c: ["train", "shakespeare_char/nrpgt.yaml"],
     r"^error: config file 'shakespeare_char/nrpgt\.yaml' does not exist \(did you mean "
     r"'shakespeare_char/nrgpt\.yaml', "),
    ("recipe-mistyped-bundled-folder", lambda c: ["train", "configs/englsh/cem.yaml"],
     r"config file 'configs/englsh/cem\.yaml' does not exist \(did you mean 'configs/english/cem\.yaml'\?\)$"),
    ("recipe-is-a-directory", lambda c: ["train", str(c.data)],
     r"config file .*data' does not exist \(it is a directory\)"),
    ("recipe-not-utf8", lambda c: c.train(recipe=c.recipe(text=b"model:\n  arch: gpt\xff\n")),
     r"r\.yaml' is not UTF-8 text \(byte 0xff on line 2\)"),
    ("recipe-malformed", lambda c: c.train(recipe=c.recipe(text="model:\n  arch: gpt\n   x: 1\n")),
     r"r\.yaml:3:5: not valid YAML: mapping values are not allowed here"),
    ("recipe-duplicate-key", lambda c: c.train(recipe=c.recipe(text="model:\n  arch: gpt\n  arch: llama\n")),
     r"r\.yaml:3:3: .*duplicate key 'arch' \(first on line 2\)"),
    ("recipe-top-level-list", lambda c: c.train(recipe=c.recipe(text="- 1\n")), r"must hold a mapping"),
    ("recipe-unknown-section", lambda c: c.train(recipe=c.recipe(text="model: {arch: gpt}\noptim: {}\n")),
     r"unknown config section\(s\) \['optim'\]"),
    ("recipe-base-missing", lambda c: c.train(recipe=c.recipe(text="base: nope.yaml\n")),
     r"base recipe .*nope\.yaml' .* does not exist"),
    ("recipe-no-arch", lambda c: c.train(recipe=c.recipe(text="model: {d_model: 8}\n")), r"needs an 'arch' key"),
    # --- overrides and values ---
    ("unknown-arch", _train("--model.arch", "gpt5"),
     r"model\.arch='gpt5' is not valid \(did you mean 'gpt'\?\); expected one of"),
    ("unknown-model-key", _train("--model.d_modle", "8"),
     r"unknown config key 'model\.d_modle' \(did you mean 'd_model'\?\)"),
    ("unknown-train-key", _train("--train.max_step", "8"), r"'train\.max_step' \(did you mean 'max_steps'\?\)"),
    ("override-without-section", _train("--max_steps", "5"), r"--max_steps must name a section and a key"),
    ("override-stray-word", _train("extra"), r"unexpected argument 'extra'"),
    ("override-needs-value", _train("--train.max_steps"), r"--train\.max_steps needs a value \(an integer\)"),
    ("max-steps-not-int", _train("--train.max_steps", "ten"), r"train\.max_steps='ten' must be an integer"),
    ("max-steps-negative", _train("--train.max_steps", "-1"), r"train\.max_steps=-1 must be >= 0"),
    ("batch-size-zero", _train("--train.batch_size", "0"), r"train\.batch_size=0 must be >= 1"),
    ("learning-rate-zero", _train("--train.learning_rate", "0"), r"train\.learning_rate=0\.0 must be > 0"),
    ("min-lr-above-lr", _train("--train.min_lr", "1"), r"train\.min_lr=1\.0 must be <= "),
    ("beta2-above-one", _train("--train.beta2", "1.5"), r"train\.beta2=1\.5 must be <= "),
    ("lr-schedule-unknown", _train("--train.lr_schedule", "linear"), r"train\.lr_schedule='linear' is not valid"),
    ("dtype-unknown", _train("--train.dtype", "float16"),
     r"train\.dtype='float16' is not valid \(did you mean 'bfloat16'\?\); expected one of 'float32', 'bfloat16'"),
    ("device-unknown", _train("--train.device", "tpu"), r"train\.device='tpu' is not valid"),
    ("parallel-unknown", _train("--train.parallel", "mpi"),
     r"train\.parallel='mpi' is not valid; expected one of 'ddp', 'fsdp'"),
    ("fsdp-checkpoint-unknown", _train("--train.fsdp_checkpoint", "gathered"),
     r"train\.fsdp_checkpoint='gathered' is not valid; expected one of 'sharded', 'full'"),
    # inf/nan are numbers, just not finite ones: the message says the range expected
    ("learning-rate-inf", _train("--train.learning_rate", "inf"),
     r"train\.learning_rate=inf must be a finite number > 0\.0$"),
    ("grad-clip-nan", _train("--train.grad_clip=nan"), r"train\.grad_clip=nan must be a finite number >= 0\.0$"),
    ("min-lr-minus-inf", _train("--train.min_lr", "-inf"),
     r"train\.min_lr=-inf must be a finite number >= 0\.0 and <= "),
    ("heads-do-not-divide", _train("--model.d_model", "30", "--model.n_heads", "4"),
     r"n_heads=4 must divide d_model=30"),
    # --- data: knowable before step 1 ---
    ("data-missing", lambda c: c.train("--data.data_dir", str(c.root / "nodata")),
     r"model\.vocab_size is not set and '.*nodata/meta\.json' does not exist"),
    ("data-vocab-larger-than-model", _train("--model.vocab_size", "3"),
     r"model\.vocab_size=3 is smaller than the data vocabulary"),
    ("split-shorter-than-context", _train("--model.block_size", "4000"),
     r"val\.bin has \d+ tokens but model\.block_size=4000 needs at least 4001"),
    ("token-id-beyond-vocab", lambda c: (np.full(50, 60000, dtype=np.uint16).tofile(c.data / "val.bin"),
                                         _set_meta(c, n_val=50), c.train())[-1],
     r"val\.bin holds token id 60000 .* but its meta\.json says vocab_size=\d+"),
    ("token-file-truncated", lambda c: ((c.data / "train.bin").write_bytes(b"\x01\x00" * 10), c.train())[-1],
     r"train\.bin has 20 bytes but meta\.json says n_train=\d+"),
    ("meta-not-json", lambda c: ((c.data / "meta.json").write_text("{oops"), c.train())[-1],
     r"meta\.json is corrupt \(not valid JSON"),
    ("meta-missing-keys", lambda c: ((c.data / "meta.json").write_text("{}"), c.train())[-1],
     r"meta\.json lacks required keys"),
    ("model-too-large", _train("--model.d_model", "262144", "--model.n_heads", "1",
                                            "--model.n_layers", "64"),
     r"the model has [\d,]+ parameters: training needs at least [\d.]+ GiB .* but cpu has"),
    # --- the run directory ---
    ("out-dir-is-a-file", lambda c: ((c.root / "afile").write_text("x"),
                                      c.train("--train.out_dir", str(c.root / "afile")))[-1],
     r"train\.out_dir='.*afile' is a file; expected a run directory"),
    ("out-dir-in-use", _hold_lock, r"train\.out_dir='.*run' is in use by another training \(pid \d+\)"),
    ("resume-other-model", lambda c: c.resume("--model.n_layers", "3"),
     r"holds a checkpoint of a different model \(saved vs now: \{'n_layers': \(2, 3\)\}\)"),
    ("resume-other-vocabulary", lambda c: (_rewrite_data(c, "abcxyz " * 400), c.resume("--train.max_steps", "4"))[-1],
     r"differ from the data run .* was trained on: the vocabulary changed "
     r"\(char tokenizer: 15 → 7 tokens; added 'bxyz'; removed"),
    ("resume-other-text", lambda c: (make_data_dir(c.data, seed=7), c.resume("--train.max_steps", "4"))[-1],
     r"differ from the data .*: train\.bin changed \(sha256 \w+ → \w+\)"),
    ("resume-path-without-checkpoint", lambda c: c.train("--train.resume", str(c.root)),
     r"train\.resume='.*': no complete checkpoint there"),
    ("resume-incomplete-checkpoint", lambda c: ((c.run / "checkpoint.json").unlink(),
                                                 c.resume("--train.max_steps", "4"))[-1],
     r"holds checkpoint files \['model\.safetensors', 'checkpoints/'\] but no complete checkpoint"),
    ("resume-foreign-train-state", _foreign_state,
     r"train_state\.pt' was not written by energyformer \(missing keys \["),
    # --- sample ---
    ("sample-run-missing", lambda c: ["sample", str(c.root / "norun")], r"run directory '.*norun' does not exist"),
    ("sample-run-is-a-file", lambda c: ((c.root / "afile").write_text("x"), ["sample", str(c.root / "afile")])[-1],
     r"'.*afile' is a file; expected a run directory"),
    ("sample-not-a-run", lambda c: ["sample", str(c.data)],
     r"config\.yaml' not found; '.*data' is not a run directory: .*; it holds meta\.json, train\.bin, val\.bin$"),
    ("sample-unknown-character", lambda c: ["sample", str(c.run), "--prompt", "Ω"],
     r"character 'Ω' \(U\+03A9\) at position 0 is not in the vocabulary"),
    ("sample-empty-prompt", lambda c: ["sample", str(c.run), "--prompt", ""], r"the prompt is empty"),
    ("sample-num-samples-zero", lambda c: ["sample", str(c.run), "--num_samples", "0"], r"num_samples=0 must be >= 1"),
    ("sample-max-steps-zero", lambda c: ["sample", str(c.run), "--exit", "kl:1e-3", "--max-steps", "0"],
     r"error: --max-steps=0 must be >= 1$"),
    ("sample-negative-temperature", lambda c: ["sample", str(c.run), "--temperature", "-1"],
     r"temperature=-1\.0 must be >= 0"),
    ("sample-temperature-inf", lambda c: ["sample", str(c.run), "--temperature", "inf"],
     r"temperature=inf must be a finite number >= 0\.0$"),
    ("sample-temperature-nan", lambda c: ["sample", str(c.run), "--temperature=nan"],
     r"temperature=nan must be a finite number >= 0\.0$"),
    ("sample-temperature-minus-inf", lambda c: ["sample", str(c.run), "--temperature", "-inf"],
     r"temperature=-inf must be a finite number >= 0\.0$"),
    ("sample-top-p-nan", lambda c: ["sample", str(c.run), "--top_p", "NaN"],
     r"top_p=nan must be a finite number > 0\.0 and <= 1\.0$"),
    ("sample-repetition-penalty-inf", lambda c: ["sample", str(c.run), "--repetition_penalty", "Infinity"],
     r"repetition_penalty=inf must be a finite number > 0\.0$"),
    ("sample-max-new-tokens-word", lambda c: ["sample", str(c.run), "--max_new_tokens", "many"],
     r"--max_new_tokens='many' must be an integer"),
    ("sample-corrupt-weights",
     lambda c: ((c.run / "checkpoints/step-00000002/model.safetensors").write_bytes(b"\x00junk"),
                ["sample", str(c.run)])[-1],
     r"step-00000002/model\.safetensors' is corrupt or not a safetensors file"),
    ("sample-meta-of-other-data", lambda c: (_retokenize_run_meta(c), ["sample", str(c.run)])[-1],
     r"meta\.json found for run .* does not match the data it was trained on: the vocabulary changed"),
    # --- other commands ---
    ("info-not-a-run-directory", lambda c: ["info", str(c.data)],
     r"'.*data' is not a run directory: expected a recipe YAML file or a run directory holding config\.yaml "
     r"\(with model\.safetensors and meta\.json\), as `energyformer train` and `energyformer import-hf` write; "
     r"it holds meta\.json, train\.bin, val\.bin$"),
    ("info-empty-directory", lambda c: ((c.root / "empty").mkdir(), ["info", str(c.root / "empty")])[-1],
     r"'.*empty' is not a run directory: expected a recipe YAML file or a run directory .*; it is empty$"),
    ("info-weights-file", lambda c: ["info", str(c.run / "checkpoints/step-00000002/model.safetensors")],
     r"model\.safetensors' is a weights file; expected a recipe YAML file or a run directory holding config\.yaml "
     r"\(this file is in the run directory '.*run': energyformer info .*run\)$"),
    ("info-recipe-missing", lambda c: ["info", str(c.root / "nope.yaml")],
     r"'.*nope\.yaml' does not exist; expected a recipe YAML file or a run directory holding config\.yaml$"),
    ("info-recipe-mistyped-bundled", lambda c: ["info", "shakespeare_char/nrpgt"],
     r"'shakespeare_char/nrpgt' does not exist \(did you mean 'shakespeare_char/nrgpt', .*\?\); expected a "
     r"recipe YAML file or a run directory holding config\.yaml$"),
    ("info-run-directory-missing", lambda c: ["info", str(c.root / "norun")],
     r"'.*norun' does not exist; expected a recipe YAML file or a run directory holding config\.yaml$"),
    ("compare-run-missing", lambda c: ["compare", str(c.root / "norun")], r"summary\.json'? not found"),
    ("compare-plot-without-matplotlib", _no_matplotlib,
     r"needs the optional package 'matplotlib', which is not installed; pip install 'energyformer\[viz\]'"),
    ("compare-plot-inside-a-file", lambda c: ((c.root / "afile").write_text("x"),
                                              ["compare", str(c.run), "--plot", "afile/x.png"])[-1],
     r"^error: --plot 'afile/x\.png': 'afile' is a file; expected a folder \(or a path where one can be created\)$"),
    ("compare-out-inside-a-file", lambda c: ((c.root / "afile").write_text("x"),
                                             ["compare", str(c.run), "--out", "afile/t.md"])[-1],
     r"^error: --out 'afile/t\.md': 'afile' is a file; expected a folder"),
    ("prepare-unknown-dataset", lambda c: ["prepare", "tinystories", "--out_root", str(c.root / "d")],
     r"dataset='tinystories' is not valid; expected one of " + ", ".join(f"'{n}'" for n in (*DATASETS, "text", "hf"))
     + r" \('text': any UTF-8 text file, with --input FILE; 'hf': a Hugging Face dataset or local "
     r"jsonl/parquet/txt files, with --dataset NAME_OR_PATH\)"),
    ("prepare-text-without-input", lambda c: ["prepare", "text"], r"prepare text needs --input FILE"),
    ("prepare-text-val-fraction-inf", lambda c: ["prepare", "text", "--input", str(c.root / "no.txt"),
                                                  "--val_fraction", "inf"],
     r"val_fraction=inf must be a finite number > 0\.0 and <= 0\.5$"),
    ("prepare-text-input-missing", lambda c: ["prepare", "text", "--input", str(c.root / "no.txt"),
                                               "--out", str(c.root / "d")],
     r"no\.txt"),
    ("unknown-command", lambda c: ["trian", str(c.recipe_path)], r"trian"),
]


def _retokenize_run_meta(c):
    meta = json.loads((c.run / "meta.json").read_text())
    meta["chars"] = meta["chars"][::-1][:-1] + ["~"]
    meta["chars"].sort()
    (c.run / "meta.json").write_text(json.dumps(meta))


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.name == ".lock":
            continue
        rel = str(path.relative_to(root))
        out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest() + str(path.stat().st_mtime_ns)
                    if path.is_file() else "dir")
    return out


def test_the_catalogue_is_large_enough():
    assert len(CLI_CASES) + len(PYTHON_CASES) >= 50
    assert len({c[0] for c in CLI_CASES}) == len(CLI_CASES)


@pytest.mark.parametrize("name,setup,pattern", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_command_line(name, setup, pattern, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case = Case(tmp_path, trained)
    argv = setup(case, monkeypatch) if setup.__code__.co_argcount == 2 else setup(case)
    before = snapshot(tmp_path)
    capsys.readouterr()
    try:
        code = main(argv)
    finally:
        if hasattr(case, "held"):
            os.close(case.held)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "weights_only=False" not in err
    import re
    assert re.search(pattern, lines[0]), lines[0]
    assert snapshot(tmp_path) == before, "files were written, changed or removed"


def _tiny():
    from energyformer import build_model
    return build_model({"arch": "gpt", "vocab_size": 11, "block_size": 8, "d_model": 16, "n_layers": 1, "n_heads": 2})


def _load(d):
    from energyformer.runs.config import load_config
    return load_config(d)


def _batch(**kw):
    from energyformer.data import get_batch
    args = dict(data=np.arange(10, dtype=np.uint16), batch_size=2, block_size=4, generator=torch.Generator())
    args.update(kw)
    return get_batch(**args)


def _sampler(**kw):
    from energyformer.data import BatchSampler
    args = dict(data=np.arange(100, dtype=np.uint16), batch_size=2, block_size=4, generator=torch.Generator())
    args.update(kw)
    return BatchSampler(**args)


PYTHON_CASES = [
    ("token-id-out-of-range", lambda: _tiny()(torch.tensor([[11]])), ValueError,
     r"token id 11 is out of range; expected ids in \[0, 11\)"),
    ("sequence-longer-than-block", lambda: _tiny()(torch.zeros(1, 9, dtype=torch.long)), ValueError,
     r"sequence length 9 exceeds block_size=8"),
    ("all-targets-ignored", lambda: _tiny()(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -1)), ValueError,
     r"every target is -1 \(ignored\)"),
    ("target-below-minus-one", lambda: _tiny()(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -2)), ValueError,
     r"target id -2 is out of range"),
    ("generate-negative-temperature", lambda: _tiny().generate(torch.zeros(1, 1, dtype=torch.long), 2,
                                                                temperature=-1.0),
     ValueError, r"temperature=-1\.0 must be >= 0"),
    ("config-unknown-key", lambda: _load({"model": {"arch": "gpt", "d_modle": 3}}), ValueError,
     r"did you mean 'd_model'"),
    ("batch-block-too-long", lambda: _batch(block_size=10), ValueError,
     r"the split has 10 tokens but block_size=10 needs at least"),
    ("sampler-rank-out-of-range", lambda: _sampler(rank=2, world_size=2), ValueError, r"rank=2 must be <= 1"),
]


@pytest.mark.parametrize("name,call,exc,pattern", PYTHON_CASES, ids=[c[0] for c in PYTHON_CASES])
def test_bad_python_input(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call()
    assert "\n" not in str(info.value)
