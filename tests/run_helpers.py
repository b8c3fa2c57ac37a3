"""Tiny run directories written by hand (no training): for the hf, harness and eval tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from energyformer.models.registry import build_model
from energyformer.runs.config import DataConfig, RunConfig
from energyformer.runs.rundir import CONFIG_FILE, MARKER_FILE, META_FILE, WEIGHTS_FILE, write_run_files
from energyformer.runs.weights import save_weights

TEXT = "the cat sat on a mat.\nthe dog ran to the cat; a cat ran on.\nAnd so on, 0 to 9!\n"
CHARS = sorted(set(TEXT + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .,;:?!'()\n"))
SMALL = {"vocab_size": len(CHARS), "block_size": 32, "d_model": 16, "n_heads": 2}
SHAPES = {"gpt": {"n_layers": 2}, "llama": {"n_layers": 2}, "cem": {"n_layers": 2},
          "nrgpt": {"n_steps": 2}, "gpt_rec": {"n_steps": 2}}


def char_meta(chars=CHARS) -> dict:
    return {"format_version": 1, "tokenizer": "char", "chars": list(chars), "vocab_size": len(chars),
            "n_train": 0, "n_val": 0, "dtype": "uint16"}


def make_run(path: Path, spec: dict, meta: dict | None = None, seed: int = 0, complete: bool = True,
             data_dir: Path | None = None) -> Path:
    """A run directory holding a randomly initialised model whose every parameter is perturbed
    (so biases, norms and step sizes are not at their init and a wrong mapping shows)."""
    torch.manual_seed(seed)
    arch = spec["arch"]
    model = build_model({**SMALL, **SHAPES.get(arch, {}), **spec})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    data = DataConfig(data_dir=str(data_dir)) if data_dir is not None else DataConfig(dataset=path.name)
    write_run_files(path, RunConfig(model=model.config, data=data), meta or char_meta())
    if complete:
        save_weights(model, path / WEIGHTS_FILE, {"step": "1"})
        (path / MARKER_FILE).write_text(json.dumps({"format_version": 1, "step": 1, "best_val_loss": None,
                                                    "files": [CONFIG_FILE, META_FILE, WEIGHTS_FILE]}))
    return path


def local_task(folder: Path, docs: list[dict], name: str = "tiny_local_mc") -> Path:
    """``folder`` holding an lm-eval multiple-choice task ``name`` over ``docs`` (``{"q", "choices",
    "answer"}``) read from a local jsonl file (no hub); pass it as ``include_path``."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
           "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}",
           "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return folder
