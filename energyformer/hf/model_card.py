"""The model card (``README.md``) of an exported folder (docs/hf.md, "Model card").

It says what the folder holds and how to load it, and records the run: the model config (the
run's ``config.yaml`` ``model:``), the data (dataset or data directory, tokenizer, token
counts), the parameter count, the checkpoint step and the losses (the last training loss and
the last and best validation loss of ``metrics.jsonl``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from energyformer.runs.rundir import progress_note, read_metrics

LOAD_LINES = {
    "energyformer": ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                     "tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)\n"
                     "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)"
                     "  # code in this folder\n"
                     "out = model.generate(**tok([\"The \"], return_tensors=\"pt\"), max_new_tokens=40)"),
    "stock": ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              "tok, model = AutoTokenizer.from_pretrained(DIR), AutoModelForCausalLM.from_pretrained(DIR)"),
}


def _losses(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rec in read_metrics(run_dir):
        for key in ("train_loss", "val_loss", "best_val_loss"):
            if rec.get(key) is not None:
                out[key] = (rec.get("step"), rec[key])
    return out


def _fixed_evaluation(run_dir: Path) -> str | None:
    """The fixed evaluation of an experiment run (``final_eval.json``) or of a zoo entry (``zoo.json``'s
    ``metric``), as one line; None when the run has neither."""
    for name, key in (("final_eval.json", None), ("zoo.json", "metric")):
        path = Path(run_dir) / name
        if path.is_file():
            rec = json.loads(path.read_text(encoding="utf-8"))
            rec = rec.get(key) if key else rec
            if isinstance(rec, dict) and rec.get("value") is not None:
                what = rec.get("name") or f"{rec.get('metric', 'loss')} (whole validation split)"
                tokens = f" over {rec['tokens']:,} tokens" if isinstance(rec.get("tokens"), int) else ""
                return f"{what} {rec['value']:.4f}{tokens}"
    return None


def model_card(run_dir: Path, model: Any, run_cfg: Any, meta: dict[str, Any], marker: dict[str, Any],
               as_: str, remote_code: bool, progress: dict[str, Any] | None = None) -> str:
    """The Markdown text of the card of ``run_dir`` exported ``as_`` (``"energyformer"``, ``"llama"``, ``"gpt2"``);
    ``progress`` (``energyformer.runs.rundir.run_progress``) says the step of ``max_steps`` and
    whether the run was unfinished."""
    c = model.config
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    data = run_cfg.data
    source = data.data_dir or data.dataset
    losses = _losses(run_dir)
    lines = ["---", "library_name: transformers", "tags: [energyformer, " + c.arch + "]", "---", "",
             f"# {run_dir.name} ({c.arch})", "",
             f"Exported by `energyformer export` from the run `{run_dir.name}` at "
             f"{progress_note(progress) if progress else 'step ' + str(marker.get('step'))} as `{as_}`.", ""]
    if as_ == "energyformer":
        lines.append("The model code travels in this folder (`configuration_energyformer.py`, "
                     "`modeling_energyformer.py`, `energyformer_*.py`): load it with `trust_remote_code=True`; "
                     "energyformer itself is not needed." if remote_code else
                     "The run imports plugin modules (`imports:`), so this folder needs energyformer and "
                     "the plugins installed: `import energyformer.hf` first.")
    lines += ["", "```python", LOAD_LINES["energyformer" if as_ == "energyformer" else "stock"], "```", "",
              "## Training", "",
              f"- parameters: {n_params:,}",
              f"- data: `{source}`, tokenizer `{meta.get('tokenizer')}` ({meta.get('vocab_size')} ids), "
              f"{meta.get('n_train', 0):,} train / {meta.get('n_val', 0):,} validation tokens",
              ]
    if marker.get("best_val_loss") is not None:
        lines.append(f"- best validation loss (checkpoint): {marker['best_val_loss']:.4f}")
    evaluation = _fixed_evaluation(run_dir)
    if evaluation is not None:
        lines.append(f"- fixed evaluation: {evaluation}")
    for key, (step, value) in losses.items():
        lines.append(f"- {key.replace('_', ' ')}: {value:.4f} (step {step})")
    lines += ["", "## Run config (the run's `config.yaml`)", "", "```yaml",
              yaml.safe_dump(run_cfg.to_dict(), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write_model_card(folder: Path, *args: Any, **kwargs: Any) -> Path:
    """Write :func:`model_card` to ``folder/README.md``; returns the path."""
    path = Path(folder) / "README.md"
    path.write_text(model_card(*args, **kwargs), encoding="utf-8")
    return path
