"""The papers' own protocols as run lists: ``energyformer experiment NAME --profile paper``.

A profile is a list of :class:`ProfileRun`: a recipe under ``configs/paper/`` plus overrides
(width, seed, steps, …) and the evaluations to run after training. Nothing here trains; the
experiment runner trains each run (resuming finished ones) and runs its evaluations. The
recipes read corpora the user prepared (``data.dataset`` / ``data.root`` in each recipe).

``listops_transition`` (NRGPT paper, released sweep LOPS00; docs/nrgpt.md §7)
    16 widths (``2^3 … 2^8`` log-spaced, as ``np.int16(np.logspace(3, 8, 16, base=2))``) × 3
    models (GPT_Rec_parallel, NRGPT FF1, NRGPT FF2W) × 100k iterations, batch 64, LR 5e-4 →
    2e-5 exponential, one seed; accuracy on 100 held-out problems (as the reference) and on
    100 single-function problems per function. 48 runs of 2e3–1e6 parameters: :func:`pack`
    groups them so that several share one GPU.
``cem_ablation`` (CEM paper, docs/cem.md §9)
    Llama and four CEM variants (tied T=1, T=2, D+LR shared diagonal, full) at two shapes (the
    paper's are not known): d 576 / 12 layers / 9 heads / d_ff 1536 and d 768 / 12 / 12 / 2048,
    GPT-2 BPE vocabulary (50304), so the models run from 87.2M (tied CEM, small) to 162.2M
    (Llama, base): the paper's 86M–162M. Each is trained at 20 tokens per parameter of its own
    count (Chinchilla), 2% warmup, cosine decay.
``nrgpt_owt`` (NRGPT paper, OpenWebText; docs/nrgpt.md §7–8)
    NRGPT_H_FF2W (90.5M), GPT-2 small (124.4M, tied) and GPT_Rec_parallel (85.2M) with the
    released config file (100k × 393,216 tokens), then MMLU 5-shot through lm-eval: all of
    ``mmlu`` (the paper's claim) and the two subjects the released inference script scores.

Example::

    from energyformer.experiments.profiles import profile_runs
    for run in profile_runs("listops_transition"):
        cfg = run.load_config()           # a RunConfig (the data's meta.json gives the vocab)
        run.parameters(), run.tokens()    # from the recipe alone, fast
    run.for_world_size(8)                 # the same global batch on 8 GPUs (grad_accum_steps / 8)
    pack(profile_runs("listops_transition"), n_slots=16)   # 16 workers sharing the GPUs
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from energyformer.runs.config import RunConfig, TrainConfig, load_config
from energyformer.runs.recipe import read_recipe

__all__ = ["LISTOPS_WIDTHS", "ProfileRun", "chinchilla_steps", "pack", "profile_runs", "profiles"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PAPER = "configs/paper"
#: the released sweep's widths, widest first: np.int16(np.logspace(3, 8, 16, base=2))[::-1]
LISTOPS_WIDTHS = (256, 203, 161, 128, 101, 80, 64, 50, 40, 32, 25, 20, 16, 12, 10, 8)
LISTOPS_MODELS = {"GPT_Rec_parallel": "gpt_rec_parallel", "NRGPT_FF1": "nrgpt_ff1", "NRGPT_FF2W": "nrgpt_ff2w"}
LISTOPS_VOCAB = 17  # the default generator's characters (energyformer.data.listops.vocabulary)
CEM_VARIANTS = ("llama", "cem", "cem_t2", "cem_diag_shared", "cem_full")
#: name -> model overrides of the recipes' shape (the recipes hold "base": d 768, 12 layers)
CEM_SHAPES: dict[str, dict[str, int]] = {
    "small": {"d_model": 576, "n_layers": 12, "n_heads": 9, "d_ff": 1536},
    "base": {},
}
TOKENS_PER_PARAM = 20
WARMUP_SHARE = 0.02
OWT_MODELS = ("nrgpt_ff2w", "gpt", "gpt_rec_parallel")
MMLU_EVALS = ({"kind": "lm_eval", "tasks": "mmlu", "num_fewshot": 5},
              {"kind": "lm_eval", "tasks": "mmlu_high_school_computer_science,mmlu_astronomy", "num_fewshot": 5})


@dataclass(frozen=True)
class ProfileRun:
    """One run of a profile.

    Args:
        name: the run directory name (unique within the profile).
        recipe: the recipe's path relative to the project root (``configs/paper/...``).
        overrides: ``{"section.key": value}`` applied over the recipe (``"model.d_model": 64``).
        evals: what to evaluate after training: ``{"kind": "listops", "n_test", "single_function"}``
            (accuracy on the first ``n_test`` test problems and on ``single_function`` problems per
            function, :func:`energyformer.tasks.listops.listops_report`) or ``{"kind": "lm_eval",
            "tasks", "num_fewshot"}`` (``energyformer eval RUN --tasks … --num_fewshot …``).
        default_vocab_size: the vocabulary to assume when the data is not prepared (for building
            the config before the data exists); the data's ``meta.json`` wins when present.
        group: a label shared by runs that belong to one table row (model family, size).
    """

    name: str
    recipe: str
    overrides: dict[str, Any] = field(default_factory=dict)
    evals: tuple[dict[str, Any], ...] = ()
    default_vocab_size: int | None = None
    group: str = ""

    def recipe_dict(self, root: str | Path | None = None) -> dict[str, Any]:
        """The recipe (its ``base:`` chain merged) with ``overrides`` applied, as a recipe dict.

        Raises:
            FileNotFoundError: the recipe is not under ``root`` (default: the project root).
            ValueError: an override key that is not ``section.key``.
        """
        raw = copy.deepcopy(read_recipe(Path(root if root is not None else PROJECT_ROOT) / self.recipe))
        for dotted, value in self.overrides.items():
            section, sep, key = dotted.partition(".")
            if not sep or not key or "." in key:
                raise ValueError(f"override {dotted!r} of run {self.name!r} must be 'section.key'")
            raw.setdefault(section, {})[key] = value
        return raw

    def load_config(self, root: str | Path | None = None, *, data_root: str | Path | None = None) -> RunConfig:
        """The validated run config; ``data_root`` replaces the recipe's ``data.root``.

        Raises:
            FileNotFoundError / ValueError: as :func:`energyformer.runs.config.load_config`.
        """
        raw = self.recipe_dict(root)
        if data_root is not None:
            raw.setdefault("data", {})["root"] = str(data_root)
        return load_config(raw, resolve_vocab=True, default_vocab_size=self.default_vocab_size)

    def model_config(self, root: str | Path | None = None) -> Any:
        """The model config alone, built fast (no command-line parsing, no data read): the
        recipe's ``vocab_size``, else ``default_vocab_size``.

        Raises:
            ValueError: neither gives a vocabulary size, or an invalid model field.
        """
        from energyformer.models.registry import config_from_dict

        model = dict(self.recipe_dict(root).get("model", {}))
        if model.get("vocab_size") is None:
            if self.default_vocab_size is None:
                raise ValueError(f"run {self.name!r}: the recipe sets no model.vocab_size and the profile no default")
            model["vocab_size"] = self.default_vocab_size
        return config_from_dict(model)

    def parameters(self, root: str | Path | None = None) -> int:
        """The model's parameter count (built on torch's meta device: nothing is allocated)."""
        from energyformer.models.accounting import parameter_counts

        return int(parameter_counts(self.model_config(root))["total"])

    def tokens_per_step(self, root: str | Path | None = None) -> int:
        """``batch_size × grad_accum_steps × block_size``."""
        tc = TrainConfig(**self.recipe_dict(root).get("train", {}))
        return tc.batch_size * tc.grad_accum_steps * self.model_config(root).block_size

    def for_world_size(self, world_size: int, root: str | Path | None = None) -> ProfileRun:
        """This run for data-parallel training on ``world_size`` processes with the same global
        batch: ``grad_accum_steps`` divided by ``world_size`` (training multiplies the per-process
        batch by the number of processes).

        Raises:
            ValueError: ``world_size < 1``, or it does not divide ``grad_accum_steps`` (e.g. the
                ListOps runs, which take one GPU each: see :func:`pack`).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not valid; expected an integer >= 1")
        accum = TrainConfig(**self.recipe_dict(root).get("train", {})).grad_accum_steps
        if accum % world_size:
            raise ValueError(f"world_size={world_size} does not divide grad_accum_steps={accum} of run {self.name!r}; "
                             f"use a divisor of {accum} (or pack several runs per GPU)")
        return dataclasses.replace(self, overrides={**self.overrides, "train.grad_accum_steps": accum // world_size})

    def tokens(self, root: str | Path | None = None) -> int:
        """Training tokens: ``max_steps × tokens_per_step``."""
        return TrainConfig(**self.recipe_dict(root).get("train", {})).max_steps * self.tokens_per_step(root)


def chinchilla_steps(n_params: int, tokens_per_step: int, tokens_per_param: float = TOKENS_PER_PARAM) -> int:
    """Optimizer steps for ``tokens_per_param × n_params`` training tokens (rounded up)."""
    return math.ceil(tokens_per_param * n_params / tokens_per_step)


def _listops() -> list[ProfileRun]:
    evals = ({"kind": "listops", "n_test": 100, "single_function": 100},)
    return [ProfileRun(name=f"{label}_d{width}", recipe=f"{PAPER}/listops/{stem}.yaml",
                       overrides={"model.d_model": width}, evals=evals, default_vocab_size=LISTOPS_VOCAB,
                       group=label)
            for label, stem in LISTOPS_MODELS.items() for width in LISTOPS_WIDTHS]


def _cem() -> list[ProfileRun]:
    runs = []
    for shape, model in CEM_SHAPES.items():
        for variant in CEM_VARIANTS:
            base = ProfileRun(name=f"{variant}_{shape}", recipe=f"{PAPER}/cem/{variant}.yaml",
                              overrides={f"model.{k}": v for k, v in model.items()}, group=shape)
            steps = chinchilla_steps(base.parameters(), base.tokens_per_step())
            schedule = {"train.max_steps": steps, "train.lr_decay_steps": steps,
                        "train.warmup_steps": max(1, round(WARMUP_SHARE * steps))}
            runs.append(ProfileRun(name=base.name, recipe=base.recipe, overrides={**base.overrides, **schedule},
                                   group=shape))
    return runs


def _owt() -> list[ProfileRun]:
    return [ProfileRun(name=model, recipe=f"{PAPER}/owt/{model}.yaml", evals=MMLU_EVALS, group=model)
            for model in OWT_MODELS]


PROFILES: dict[str, dict[str, Callable[[], list[ProfileRun]]]] = {
    "listops_transition": {"paper": _listops},
    "cem_ablation": {"paper": _cem},
    "nrgpt_owt": {"paper": _owt},
}


def profiles() -> dict[str, list[str]]:
    """``{experiment: [profile names]}``."""
    return {name: sorted(p) for name, p in PROFILES.items()}


@functools.cache
def _cached(experiment: str, profile: str) -> tuple[ProfileRun, ...]:
    return tuple(PROFILES[experiment][profile]())


def profile_runs(experiment: str, profile: str = "paper") -> list[ProfileRun]:
    """The runs of ``experiment``'s ``profile``.

    Raises:
        ValueError: an experiment without profiles or an unknown profile (naming the valid ones).
    """
    if experiment not in PROFILES:
        raise ValueError(f"experiment {experiment!r} has no profiles; experiments with profiles: "
                         f"{', '.join(sorted(PROFILES))}")
    if profile not in PROFILES[experiment]:
        raise ValueError(f"profile {profile!r} is not valid for {experiment}; expected one of "
                         f"{', '.join(sorted(PROFILES[experiment]))}")
    return list(_cached(experiment, profile))


def pack(runs: Sequence[ProfileRun], n_slots: int, root: str | Path | None = None) -> list[list[ProfileRun]]:
    """Runs grouped into ``n_slots`` lists of about equal cost (parameters × tokens), largest first.

    A slot is what one worker trains in sequence: on one GPU several slots run side by side
    (the ListOps models are tiny), or one slot per GPU. Greedy longest-processing-time.

    Raises:
        ValueError: ``n_slots < 1``.
    """
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise ValueError(f"n_slots={n_slots!r} is not valid; expected an integer >= 1")
    costs = [(run.parameters(root) * run.tokens(root), run.name, run) for run in runs]
    slots: list[list[ProfileRun]] = [[] for _ in range(n_slots)]
    loads = [0] * n_slots
    for cost, _, run in sorted(costs, key=lambda c: (-c[0], c[1])):
        i = loads.index(min(loads))
        slots[i].append(run)
        loads[i] += cost
    return slots


def _evaluate(run: ProfileRun, run_dir: Path, data_dir: Path, quick: bool) -> dict[str, Any]:
    """Run ``run.evals`` on the trained ``run_dir``: ListOps reports, lm-eval tasks."""
    out: dict[str, Any] = {}
    for ev in run.evals:
        if ev["kind"] == "listops":
            from energyformer.data import load_tokenizer
            from energyformer.data.listops import read_test
            from energyformer.data.meta import load_meta
            from energyformer.runs.rundir import load_run
            from energyformer.tasks.listops import listops_report

            model, _, meta = load_run(run_dir, device="cuda" if torch_cuda() else "cpu")
            problems = read_test(data_dir)[: ev.get("n_test", 100)]
            rep = listops_report(model, load_tokenizer(meta), problems, settings=load_meta(data_dir)["settings"],
                                 single_function=ev.get("single_function"))
            out["listops"] = {k: rep[k] for k in ("accuracy", "stderr", "end_token_rate", "single_function")}
        elif ev["kind"] == "lm_eval":
            from energyformer.eval.suite import evaluate_run

            rep = evaluate_run(run_dir, ev["tasks"], num_fewshot=ev.get("num_fewshot", 5),
                               limit=2 if quick else None, device="cuda" if torch_cuda() else "cpu")
            out[f"lm_eval:{ev['tasks']}"] = rep["tasks"]
    return out


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_profile(ctx) -> dict[str, Any]:
    """Train and evaluate every run of ``ctx.name``'s paper profile (``energyformer experiment NAME
    --profile paper``), one after the other in this process (under ``torchrun`` each run uses
    every rank, with the global batch kept by :meth:`ProfileRun.for_world_size`); finished runs
    are reused (:func:`energyformer.experiments.common.train_or_resume`). Writes
    ``results/NAME-paper/{table.md, results.json}``.

    Raises:
        ValueError: an experiment without a paper profile.
        FileNotFoundError: a corpus the profile reads is not prepared under ``ctx.data_root``.
    """
    import os

    from energyformer.experiments.common import train_or_resume
    from energyformer.experiments.report import markdown_table, write_results

    world = int(os.environ.get("WORLD_SIZE", "1"))
    runs = [r.for_world_size(world) if world > 1 else r for r in profile_runs(ctx.name, "paper")]
    if ctx.quick:  # one run per group (model), a few steps each: the pipeline, not the protocol
        runs = list({r.group: r for r in reversed(runs)}.values())
    rows, results = [], {}
    for run in runs:
        cfg = run.load_config(data_root=ctx.data_root).to_dict()
        if ctx.quick:  # the pipeline at a tiny width: a few steps
            cfg["model"].update({k: v for k, v in {"d_model": 16, "n_layers": 2, "d_ff": 48}.items()
                                 if k in cfg["model"]})
            cfg["model"]["n_heads"] = 2 if "n_heads" in cfg["model"] else cfg["model"].get("n_heads")
            cfg["train"].update({"max_steps": 2, "batch_size": 2, "grad_accum_steps": 1, "eval_interval": 1,
                                 "eval_iters": 1, "warmup_steps": 0, "lr_decay_steps": 2})
        summary = train_or_resume(ctx, run.name, cfg)
        from energyformer.experiments.common import record_dir
        from energyformer.runs.config import load_config as _load

        data_dir = _load(cfg, resolve_vocab=True).data.path
        evals = _evaluate(run, record_dir(ctx, run.name), Path(data_dir), ctx.quick)
        results[run.name] = {"summary": summary, "evals": evals, "group": run.group}
        acc = evals.get("listops", {}).get("accuracy")
        rows.append([run.name, f"{summary.get('params', 0):,}", f"{summary.get('final_val_loss', float('nan')):.4f}",
                     "–" if acc is None else f"{acc:.3f}"])
    table = markdown_table(["run", "params", "final val loss", "ListOps accuracy"], rows)
    return write_results(ctx, table, {"profile": "paper", "runs": results},
                         f"{ctx.name}, the paper profile ({len(runs)} runs).")
