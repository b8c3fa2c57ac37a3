"""The entries of the model zoo (:mod:`energyformer.runs.zoo`), made from the experiments' run records.

``python -m energyformer.experiments.zoo_entries`` (from a clone, with the corpora prepared) writes
every entry of :data:`ENTRIES` into ``energyformer/zoo/``; each is the experiment run with the lowest
fixed-evaluation loss of its arm (docs/zoo.md). A run record becomes an entry with its config, meta
and weights, a model card, and ``check.json``: the first :data:`CHECK_TOKENS` + 1 validation tokens
and the model's loss on them, which the tests recompute from the shipped weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from energyformer.runs.zoo import CHECK_FILE, ENTRY_FILE, model_card, zoo_root

CHECK_TOKENS = 512
#: name → (experiment, arm's run prefix, description, the command that made it)
ENTRIES: dict[str, tuple[str, str, str, str]] = {
    "nrgpt_shakespeare_char": (
        "energy_descent", "nrgpt_c_diag_gamma_s",
        "NRGPT FF2W with η = c·diag(γ) (provable energy descent), one block run 4 steps, d_model 64, 4 heads, "
        "on character-level Shakespeare.",
        "energyformer experiment energy_descent"),
    "cem_shakespeare_char": (
        "cem_ablation", "cem_tied_T_1_s",
        "Tied CEM-Llama, one descent step per sub-block (T=1): attention with K = V, O = Qᵀ and a gated MLP with a "
        "tied down projection, 4 layers, d_model 128, on character-level Shakespeare.",
        "energyformer experiment cem_ablation"),
    "llama_shakespeare_char": (
        "cem_ablation", "llama_s",
        "The Llama baseline of the CEM comparison (RMSNorm, RoPE, SwiGLU, untied), 4 layers, d_model 128, on "
        "character-level Shakespeare.",
        "energyformer experiment cem_ablation"),
    "cem_t2_shakespeare_char": (
        "cem_ablation", "cem_T_2_s",
        "Tied CEM-Llama with two descent steps per sub-block (T=2), 4 layers, d_model 128, on character-level "
        "Shakespeare.",
        "energyformer experiment cem_ablation"),
}


def best_record(results_dir: str | Path, experiment: str, prefix: str) -> Path:
    """The record of ``experiment`` whose name is ``prefix<seed>`` with the lowest fixed evaluation.

    Raises:
        FileNotFoundError: no such record with a fixed evaluation.
    """
    runs = Path(results_dir) / experiment / "runs"
    found = [(json.loads((d / "final_eval.json").read_text())["value"], d)
             for d in sorted(runs.glob(f"{prefix}*")) if (d / "final_eval.json").is_file()
             and d.name[len(prefix):].isdigit()]
    if not found:
        raise FileNotFoundError(f"no scored run {prefix}<seed> in {runs}")
    return min(found)[1]


def build_entry(record: str | Path, name: str, description: str, command: str,
                root: str | Path | None = None, check_tokens: int = CHECK_TOKENS) -> Path:
    """Make the zoo entry ``NAME`` from an experiment's run record (``results/EXP/runs/RUN``: config,
    meta, weights, ``final_eval.json``, ``summary.json``, ``metrics.jsonl``) and the run's prepared
    data (for the check tokens). Returns the entry's folder.

    Raises:
        FileNotFoundError: a file of the record, or the run's data, is missing.
    """
    from energyformer.data.loader import load_split
    from energyformer.eval.suite import windows_loss
    from energyformer.experiments.convergence import convergence
    from energyformer.runs.checkpoint import FORMAT_VERSION, MARKER_FILE
    from energyformer.runs.rundir import load_run, read_summary

    record = Path(record)
    out = (Path(root) if root is not None else zoo_root()) / name
    for f in ("config.yaml", "meta.json", "model.safetensors", "final_eval.json", "summary.json"):
        if not (record / f).is_file():
            raise FileNotFoundError(f"run record {str(record)!r} has no {f}: it cannot become a zoo entry")
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.yaml", "meta.json", "model.safetensors", "summary.json"):
        shutil.copyfile(record / f, out / f)
    summary = read_summary(record)
    # a complete run directory, as training leaves one: the marker lists the files (export needs it)
    marker = {"format_version": FORMAT_VERSION, "step": int(summary["steps"]),
              "files": ["config.yaml", "meta.json", "model.safetensors"]}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    model, run_cfg, _ = load_run(out)
    tokens = np.asarray(load_split(run_cfg.data.path, "val")[:check_tokens + 1], dtype=np.int64)
    loss, _ = windows_loss(model, tokens)
    (out / CHECK_FILE).write_text(json.dumps({"tokens": tokens.tolist(), "loss": loss}) + "\n", encoding="utf-8")
    evaluation = json.loads((record / "final_eval.json").read_text(encoding="utf-8"))
    c = convergence(record)
    conv = ("unknown (too few evaluations)" if c.get("verdict") is None else
            f"{c['verdict']} (slope {c['slope_per_1k']:+.4f} ± {c['slope_se_per_1k']:.4f} per 1k steps over the "
            "last 30% before the cooldown)")
    card = {"name": name, "description": description, "arch": run_cfg.model.arch, "params": summary["params"],
            "dataset": Path(run_cfg.data.path).name, "steps": summary["steps"],
            "tokens": summary["steps"] * run_cfg.train.batch_size * run_cfg.model.block_size,
            "metric": {"name": f"{evaluation['metric']} (whole validation split, nats/token)",
                       "value": evaluation["value"], "tokens": evaluation["tokens"]},
            "converged": conv, "source": f"results/{record.parent.parent.name}/runs/{record.name}", "command": command}
    (out / ENTRY_FILE).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "README.md").write_text(model_card(card), encoding="utf-8")
    return out


def main(results_dir: str | Path = "results") -> list[Path]:
    """Write every entry of :data:`ENTRIES` from the best scored run of its arm."""
    out = []
    for name, (experiment, prefix, description, command) in ENTRIES.items():
        out.append(build_entry(best_record(results_dir, experiment, prefix), name, description, command))
        print(f"wrote {out[-1]}")
    return out


if __name__ == "__main__":
    main()
