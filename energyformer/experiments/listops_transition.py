"""(c) ``listops_transition``: ListOps accuracy vs parameters for NRGPT FF1, NRGPT FF2W and
GPT_Rec_parallel (docs/nrgpt.md §8). The paper reports the ≥ 80 % transition at 2.3–3.0 × 10⁴
parameters for all three (GPT_Rec_parallel 2.3e4, FF1 2.4e4, FF2W 2.98e4) after 100k iterations.

Protocol on 2 CPU cores, in three stages:

1. **Pilot**: GPT_Rec_parallel d_model 50 (``configs/listops/gpt_rec_parallel.yaml``: one head,
   5 recurrent steps, block 128, batch 64, AdamW wd 0.01, β₂ 0.999), LR 2e-3, 10,000 steps
   with the reference's decay horizon (exponential decay set for 100,000 iterations, so the LR is
   still 63% of its peak at the end), 50 evaluations.
2. **LR check per model** (only if the pilot reaches 80%): each model at width :data:`CHECK_WIDTH`
   (next to the transition), seed 1, :data:`CHECK_STEPS` steps (the same schedule, so these are the
   first steps of a full run), at the pilot's LR and the values either side ({1e-3, 2e-3, 3e-3},
   extended past an edge); each model then trains at its own best LR at every width.
3. **Widths**: the three models at widths around the paper's transition with the pilot's budget.
   If the pilot stays below 80%, the table says so and the sweep is left to the GPU profile
   (``--profile paper``).

Reported beside accuracy: the floors on the same test problems (always answering the majority
answer; the majority answer per root function; the generator's entropy floor of the loss) and
the end-token rate, the loss on the predictable tokens after the first ``=``, and per-function
accuracy on single-function test sets. Each run's scores are kept in its record as ``listops_eval.json``
(with the weights' SHA-256 and the test set's; computed again when either changes, or with ``--rescore``).

Budget (idle 2-core CPU): the pilot ≈ 45 minutes; the LR checks 9 runs (one more for each check
extended past an edge) ≈ 2 hours; the width stage 15 runs ≈ 10 hours and 12 more seeds beside the
transitions ≈ 8 hours.
``--quick``: 600 expressions, width 8, 20 steps, 20 test problems.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import report
from energyformer.experiments.scoring import cached_eval
from energyformer.experiments.sweeps import lr_sweep, sweep_table

MODELS: dict[str, str] = {
    "GPT_Rec_parallel": "listops/gpt_rec_parallel.yaml",
    "NRGPT FF1": "listops/nrgpt_ff1.yaml",
    "NRGPT FF2W": "listops/nrgpt_ff2w.yaml",
}
PILOT_WIDTH, PILOT_LR, PILOT_STEPS, DECAY_HORIZON = 50, 2e-3, 10_000, 100_000
#: the pilot's accuracy that opens the width stage
PILOT_LEVEL = 0.8
CHECK_WIDTH, CHECK_STEPS = 32, 2_500
#: the LR check's grid around the pilot's LR (then extended past an edge by half-decades)
CHECK_LRS = (1e-3, PILOT_LR, 3e-3)
WIDTHS = (16, 24, 32, 40, 50)
#: seeds beyond the first at the two widths beside each model's transition
EXTRA_SEEDS = 2
N_TEST = 300
#: a record's ListOps evaluation (accuracy, floors, single-function sets), kept beside its weights
LISTOPS_EVAL_FILE = "listops_eval.json"


def data_section(ctx: ex.Context) -> dict[str, Any] | None:
    if not ctx.quick:
        return None
    from energyformer.data.task_data import prepare_task_data

    out = prepare_task_data("listops", out_dir=ctx.runs / "data" / "listops", verbose=False, n_train=500,
                            n_val=50, n_test=50)
    return {"dataset": out.name, "root": str(out.parent)}


def config(ctx: ex.Context, recipe: str, width: int, seed: int, lr: float = PILOT_LR,
           steps: int = PILOT_STEPS) -> dict[str, Any]:
    """The recipe at ``width`` with the LR ``lr`` (default the pilot's), ``steps`` (default the pilot's
    budget) and the reference's decay horizon."""
    train = {"max_steps": steps, "learning_rate": lr, "lr_decay_steps": DECAY_HORIZON,
             "eval_interval": steps // 50, "log_interval": 50, "seed": seed}
    quick = {"model": {"block_size": 64}, "train": {"lr_decay_steps": 200}} if ctx.quick else {}
    return ex.resolve(ctx, recipe, {"model": {"d_model": width}, "train": train}, quick, data=data_section(ctx),
                   swept=("d_model", "block_size"))


def transition(points: list[tuple[int, float]], level: float = 0.8) -> int | None:
    """The smallest parameter count whose accuracy is ≥ ``level`` (None if none reaches it)."""
    hits = [p for p, acc in sorted(points) if acc >= level]
    return hits[0] if hits else None


def _score(ctx: ex.Context, name: str, problems, data_dir: str) -> dict[str, Any]:
    from energyformer.data import load_tokenizer
    from energyformer.data.meta import load_meta
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.listops import listops_report

    where = ex.record_dir(ctx, name)
    settings = load_meta(data_dir)["settings"]
    n_single = 10 if ctx.quick else 100
    keep = ("accuracy", "stderr", "n", "per_function", "end_token_rate", "answer_loss", "chance", "floor",
            "single_function")

    def evaluate() -> dict[str, Any]:
        net, _, meta = load_run(where)
        ev = listops_report(net, load_tokenizer(meta), problems, settings=settings, single_function=n_single)
        return {k: ev[k] for k in keep}

    # kept in the record (listops_eval.json) beside final_eval.json: every accuracy the table and the
    # README quote has a machine-written source, and a finished run is not scored again
    problems_sha = hashlib.sha256(json.dumps(list(problems), sort_keys=True).encode()).hexdigest()
    inputs = {"test_problems": len(problems), "test_sha256": problems_sha, "single_function": n_single,
              "settings": settings}
    ev = cached_eval(where, LISTOPS_EVAL_FILE, inputs, evaluate, force=ctx.rescore)
    return {**{k: ev[k] for k in keep}, "convergence": conv.convergence(where), "dir": where}


def _row(label: str, width: int, params: int, evs: list[dict[str, Any]], finals: list[float]) -> list[Any]:
    """One table row from the scores ``evs`` and fixed-evaluation val losses ``finals`` of a width's seeds:
    with one seed its accuracy ± standard error, with several every column over all of them (means;
    accuracy and losses ± the sample std over seeds; the convergence verdicts of every seed)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    funcs = sorted(evs[0]["single_function"])
    single = " / ".join(f"{f} {mean([e['single_function'][f]['accuracy'] for e in evs]):.2f}" for f in funcs)
    if len(evs) == 1:
        acc = f"{evs[0]['accuracy']:.3f} ± {evs[0]['stderr']:.3f}"
    else:
        acc = f"{report.pm([e['accuracy'] for e in evs], 3)} ({len(evs)} seeds)"
    return [label, width, f"{params:,}", acc, f"{mean([e['end_token_rate'] for e in evs]):.3f}",
            report.pm([e["answer_loss"]["loss"] for e in evs]), report.pm(finals),
            conv.converged_cell([e["convergence"] for e in evs]), single]


HEAD = ["model", "d_model", "params", "accuracy ± s.e.", "end-token rate", "loss after first =", "val loss",
        "converged", "single-function accuracy"]


def _floors_table(ev: dict[str, Any]) -> str:
    chance, floor = ev["chance"], ev["floor"]
    rows = [[f"accuracy of always answering {chance['majority']['answer']} (majority)",
             f"{chance['majority']['accuracy']:.3f}"],
            ["accuracy of the majority answer per root function", f"{chance['majority_per_function']['accuracy']:.3f}"],
            ["generator entropy floor, all tokens (nats/token)", f"{floor['all_tokens']:.4f}"],
            ["generator entropy floor, expression tokens (nats/token)", f"{floor['problem_tokens']:.4f}"],
            ["generator entropy floor, tokens after the first = (nats/token)", f"{floor['after_first_eq']:.4f}"]]
    return report.markdown_table(["floor on the same problems", "value"], rows)


def next_to_transition(points: list[tuple[int, float]], level: float = 0.8) -> list[int]:
    """The widths beside the ``level`` crossing of ``(width, accuracy)`` points: the narrowest width at
    or above ``level`` and the widest narrower one below it; only the widest width when none reaches
    ``level``, only the narrowest when all do; none without points."""
    above = [w for w, acc in points if acc >= level]
    below = [w for w, acc in points if acc < level]
    if not above:
        return [max(below)] if below else []
    first = min(above)
    under = [w for w in below if w < first]
    return ([max(under)] if under else []) + [first]


def run(ctx: ex.Context) -> dict[str, Any]:
    """The pilot, then (if it reaches 80%) the width sweep of the three models (seed 1 at every width,
    :data:`EXTRA_SEEDS` more at the widths beside each model's transition)."""
    from energyformer.data.listops import read_test

    data = data_section(ctx)
    data_dir = f"{data['root']}/{data['dataset']}" if data else f"{ctx.data_root}/listops"
    problems = read_test(data_dir)[: 20 if ctx.quick else N_TEST]
    width = 8 if ctx.quick else PILOT_WIDTH
    pilot_name = f"pilot_GPT_Rec_parallel_d{width}_s1"
    summary = ex.train_or_resume(ctx, pilot_name, config(ctx, MODELS["GPT_Rec_parallel"], width, 1))
    ex.need_runs(ctx)
    pilot = {**_score(ctx, pilot_name, problems, data_dir), "params": summary["params"],
             "final_val_loss": summary["final_eval"]["value"]}
    rows = [_row("GPT_Rec_parallel (pilot)", width, pilot["params"], [pilot], [pilot["final_val_loss"]])]
    groups = {"pilot": [pilot.pop("dir")]}
    sweep: dict[str, list[dict[str, Any]]] = {}
    checks: dict[str, dict[str, Any]] = {}
    if pilot["accuracy"] >= PILOT_LEVEL:
        widths = (8, 16) if ctx.quick else WIDTHS
        check_width = 8 if ctx.quick else CHECK_WIDTH
        checks = {label: lr_sweep(ctx, label.replace(" ", "_"),
                                     lambda lr, steps, r=recipe: config(ctx, r, check_width, 1, lr, steps),
                                     CHECK_LRS, CHECK_STEPS) for label, recipe in MODELS.items()}
        ex.need_runs(ctx)
        lr = {label: c["best_lr"] for label, c in checks.items()}
        name = lambda label, w, seed: f"{label.replace(' ', '_')}_d{w}_s{seed}"  # noqa: E731
        first = {(label, w): ex.train_or_resume(ctx, name(label, w, 1), config(ctx, recipe, w, 1, lr[label]))
                 for label, recipe in MODELS.items() for w in widths}
        ex.need_runs(ctx)
        scored = {key: _score(ctx, name(*key, 1), problems, data_dir) for key in first}
        extra = {}
        for label, recipe in MODELS.items():
            for w in next_to_transition([(w, scored[(label, w)]["accuracy"]) for w in widths]):
                for seed in range(2, 2 + (0 if ctx.quick else EXTRA_SEEDS)):
                    extra[(label, w, seed)] = ex.train_or_resume(ctx, name(label, w, seed),
                                                                 config(ctx, recipe, w, seed, lr[label]))
        ex.need_runs(ctx)
        for (label, w), s in first.items():
            seeds = [(1, s, scored[(label, w)])] + [
                (seed, e, _score(ctx, name(label, w, seed), problems, data_dir))
                for (lab, ww, seed), e in extra.items() if (lab, ww) == (label, w)]
            for _, _, sc in seeds:
                groups.setdefault(label, []).append(sc.pop("dir"))
            ev = seeds[0][2]
            accs = [x[2]["accuracy"] for x in seeds]
            finals = [x[1]["final_eval"]["value"] for x in seeds]
            # seed 1's scores at the top level (as before); every seed's in "seeds"
            entry = {"width": w, "params": s["params"], **ev, "final_val_loss": finals[0],
                     "accuracy_seeds": accs, "accuracy_mean": sum(accs) / len(accs),
                     "seeds": [{"seed": seed, "accuracy": sc["accuracy"], "stderr": sc["stderr"],
                                "final_val_loss": e["final_eval"]["value"], "convergence": sc["convergence"]}
                               for seed, e, sc in seeds]}
            sweep.setdefault(label, []).append(entry)
            rows.append(_row(label, w, s["params"], [x[2] for x in seeds], finals))
    table = report.markdown_table(HEAD, rows) + "\n\n" + _floors_table(pilot)
    if sweep:
        trans = {m: transition([(r["params"], r["accuracy_mean"]) for r in rs]) for m, rs in sweep.items()}
        table += "\n\n" + report.markdown_table(["model", "≥80% transition (params, mean accuracy over seeds)"],
                                           [[m, "not reached" if t is None else f"{t:,}"] for m, t in trans.items()])
        verdict = ("The pilot reached 80%; the width stage ran at the pilot's budget, each model at the best LR of "
                   f"its own check (width {check_width}, seed 1, {CHECK_STEPS if not ctx.quick else 20:,} steps, the "
                   "in-training validation estimate):\n\n" + sweep_table(list(checks.values())))
    else:
        verdict = (f"The pilot reached {pilot['accuracy']:.1%} < 80% at {PILOT_STEPS:,} steps: the width sweep is left "
                   "to the GPU profile (`energyformer experiment listops_transition --profile paper`).")
    report.plot_learning_curves(ctx, groups, "curves.png", ylabel="val loss (nats/token)")
    header = (f"ListOps held-out accuracy (greedy final answer, {len(problems)} test problems; one seed: ± its "
              f"standard error; beside each model's transition {1 + EXTRA_SEEDS} seeds: every column over the seeds, "
              "accuracy and losses as mean ± sample std, the convergence verdict of each seed), "
              f"{PILOT_STEPS:,} steps with the reference's {DECAY_HORIZON:,}-iteration decay horizon. Val loss: the "
              "fixed evaluation (whole validation split, kept weights). " + conv.CONVERGED_NOTE)
    return report.write_results(ctx, table, {"pilot": pilot, "lr_checks": checks, "widths": sweep}, header, verdict)


__all__ = ["next_to_transition", "run", "transition"]
