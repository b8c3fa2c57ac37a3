import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the tests live in one folder per subpackage (tests/<subpackage>/test_*.py); their shared helpers stay here
# (helpers.py, run_helpers.py) and their shared fixtures below
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import make_data_dir, tiny_config  # noqa: E402

# Tiny test tensors: one thread avoids thread-pool overhead that dominates at these sizes.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tiny char corpus (``helpers.make_data_dir``: train.bin, val.bin, meta.json), one per test
    module; a test that changes the data writes its own."""
    return make_data_dir(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture
def tiny_run_config(data_dir):
    """``tiny_run_config(out_dir, model="gpt", **train)``: a tiny CPU training of a family of
    ``helpers.TINY_MODELS`` on :func:`data_dir` (``helpers.tiny_config``)."""
    return lambda out_dir, model="gpt", **train: tiny_config(data_dir, out_dir, model, **train)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished tiny run directory (the tiny GPT trained 4 steps on its own corpus: config.yaml,
    meta.json, model.safetensors, checkpoints, metrics.jsonl, summary.json). Read it, do not change it."""
    from energyformer.train import train

    root = tmp_path_factory.mktemp("tiny_run")
    data = make_data_dir(root / "data" / "tiny")
    out = root / "run"
    train(tiny_config(data, out, max_steps=4, eval_interval=2, num_threads=1), progress=False)
    return out
