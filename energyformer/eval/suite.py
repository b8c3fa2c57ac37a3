"""``energyformer eval RUN --tasks mmlu_dev,val_loss,...``: one JSON + Markdown report per run.

Tasks:

- ``mmlu_dev``: MMLU-format multiple choice on the dev questions lm-eval ships
  (:mod:`energyformer.eval.mmlu`), through the lm-eval adapter; accuracy ± standard error with
  the chance level beside it, per-subject accuracy in the JSON, and how many questions were
  dropped (unparseable, or not writable in a character vocabulary).
- ``val_loss``: the run's whole validation split (``val.bin`` of its data directory) in
  consecutive windows of ``block_size`` tokens: loss (nats per token), perplexity, bits per token
  (= per character for a character tokenizer) and bits per UTF-8 byte (tokenizer-independent;
  :mod:`energyformer.eval.loss`).
- any other name: an lm-eval task (it must find its data locally: most lm-eval tasks download
  theirs and fail offline); ``include_path`` adds a folder of task YAMLs. A task whose data come
  from the Hugging Face hub is refused at once when the hub is unreachable and ``HF_HUB_OFFLINE``
  is not set (:func:`energyformer.eval.harness.check_hub`).

Progress goes to stderr (the report to stdout): a line as each task starts and one with its
time when it ends, and tqdm bars over the requests (lm-eval tasks, mmlu_dev) and the windows
(val_loss), shown on a terminal only unless ``progress`` says otherwise.
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from energyformer._validate import check_int
from energyformer.eval.loss import bits_per_byte, bits_per_token, perplexity
from energyformer.utils.io import atomic_write_json, atomic_write_text

BUILTIN_TASKS = ("mmlu_dev", "val_loss")


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` → ``["a", "b"]``. Raises ``ValueError`` when empty."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) for t in t.split(",")]
    names = [t for t in names if t]
    if not names:
        raise ValueError(f"--tasks={tasks!r} names no task; expected e.g. mmlu_dev,val_loss")
    return list(dict.fromkeys(names))


def check_tasks(names: list[str], include_path: str | None = None) -> Any:
    """Refuse unknown task names before any model runs.

    Returns the ``lm_eval.tasks.TaskManager`` that indexed the lm-eval tasks (``None`` when every
    name is built in), for :func:`energyformer.eval.harness.run_tasks` to reuse: indexing
    lm-eval's thousands of task files is the slowest part of a short evaluation.

    Raises:
        ValueError: a name that is neither built in nor an lm-eval task (the message names it).
        ConnectionError: a task whose data come from the Hugging Face hub, which is unreachable
            (and ``HF_HUB_OFFLINE`` is not set; see :func:`energyformer.eval.harness.check_hub`).
    """
    others = [n for n in names if n not in BUILTIN_TASKS]
    if not others:
        return None
    from lm_eval.tasks import TaskManager

    from energyformer.eval.harness import check_hub

    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    unknown = [n for n in others if n not in known]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}: expected {', '.join(BUILTIN_TASKS)} or an lm-eval task "
                         f"name (`lm_eval ls tasks`; {len(known)} known)")
    check_hub(manager, others, bundled=BUILTIN_TASKS)
    return manager


@torch.no_grad()
def val_loss(model: Any, data_dir: str | Path, tokenizer: Any, batch_size: int = 8,
             max_tokens: int | None = None, device: str | torch.device = "cpu",
             progress: bool | None = False) -> dict[str, float]:
    """Loss over the validation split in consecutive windows of ``block_size`` tokens.

    Each window predicts its tokens from the ones before it in the window (the first token of a
    window is context only), so every scored token has 1…``block_size`` tokens of context.
    ``progress``: a tqdm bar over the windows on stderr (``None``: on a terminal only).

    Returns:
        ``{"loss", "perplexity", "bits_per_token", "bits_per_byte", "tokens", "bytes"}``.

    Raises:
        FileNotFoundError: no ``val.bin`` or ``meta.json`` in ``data_dir``. ValueError: a split shorter
            than 2 tokens, or a ``val.bin`` whose size disagrees with ``meta.json`` (see
            :func:`energyformer.data.load_split`: the token dtype, uint16 or uint32, is the corpus').
    """
    from energyformer.data import load_split

    try:  # the dtype (uint16 / uint32) and the size come from the corpus' meta.json
        split = load_split(data_dir, "val")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"val_loss needs the run's prepared data (data directory {str(data_dir)!r}): {e}"
                                ) from None
    path = Path(data_dir) / "val.bin"
    data = np.asarray(split if max_tokens is None else split[:max_tokens + 1], dtype=np.int64)
    if len(data) < 2:
        raise ValueError(f"{str(path)!r} holds {len(data)} tokens; val_loss needs at least 2")
    loss, count = windows_loss(model, data, batch_size, device, progress)
    n_bytes = len(tokenizer.decode(data[1:].tolist()).encode("utf-8"))
    return {"loss": loss, "perplexity": perplexity(loss), "bits_per_token": bits_per_token(loss),
            "bits_per_byte": bits_per_byte(loss, count, n_bytes), "tokens": count, "bytes": n_bytes}


@torch.no_grad()
def windows_loss(model: Any, data: np.ndarray, batch_size: int = 8, device: str | torch.device = "cpu",
                 progress: bool | None = False) -> tuple[float, int]:
    """Mean next-token loss (nats/token) of ``model`` over the token ids ``data`` (shape (n,)) in
    consecutive windows of ``model.config.block_size``: each window predicts its tokens from the ones
    before it in the window, so every token after the first is scored once, with 1…``block_size``
    tokens of context. Returns ``(loss, tokens scored)``.

    Raises:
        ValueError: fewer than 2 tokens.
    """
    data = np.asarray(data, dtype=np.int64)
    if len(data) < 2:
        raise ValueError(f"{len(data)} tokens: scoring needs at least 2")
    block = model.config.block_size
    starts = list(range(0, len(data) - 1, block))
    total, count = 0.0, 0
    bar = tqdm(total=len(starts), desc="val_loss", unit="window", dynamic_ncols=True, file=sys.stderr,
               disable=_disable(progress))
    for i in range(0, len(starts), batch_size):
        chunk = [data[s:s + block + 1] for s in starts[i:i + batch_size]]
        n = max(len(c) for c in chunk) - 1
        x = torch.zeros(len(chunk), n, dtype=torch.long)
        y = torch.full((len(chunk), n), -1, dtype=torch.long)
        for r, c in enumerate(chunk):
            x[r, :len(c) - 1], y[r, :len(c) - 1] = torch.from_numpy(c[:-1]), torch.from_numpy(c[1:])
        logits = model(x.to(device))[0].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1),
                                       ignore_index=-1, reduction="sum"))
        count += int((y >= 0).sum())
        bar.update(len(chunk))
    bar.close()
    return total / count, count


def _disable(progress: bool | None) -> bool | None:
    """tqdm's ``disable`` for ``progress`` (``None``: tqdm's own choice, shown on a terminal only)."""
    return None if progress is None else not progress


def evaluate_run(run_dir: str | Path, tasks: str | Sequence[str] = BUILTIN_TASKS, out: str | Path | None = None,
                 num_fewshot: int = 4, batch_size: int = 8, limit: int | None = None,
                 include_path: str | None = None, device: str = "auto", n_steps: int | None = None,
                 progress: bool | None = None, name: str | None = None, exit: str | None = None,
                 accept_lower_energy: bool = False) -> dict[str, Any]:
    """Evaluate a run on ``tasks``; write ``out`` (``.json``, and the Markdown table beside it as ``.md``).

    Args:
        run_dir: a run directory with a complete checkpoint.
        tasks: comma-separated names (see the module docstring).
        out: the JSON report path (default ``RUN_DIR/eval.json``; ``eval.md`` beside it).
        num_fewshot: mmlu_dev shots (0–4) and lm-eval tasks' ``num_fewshot``.
        batch_size: sequences per forward pass.
        limit: at most this many questions per task (val_loss: this many windows of
            ``block_size`` tokens); for quick checks.
        include_path: a folder of extra lm-eval task YAMLs.
        device: auto (CUDA when available, else the CPU), cpu, cuda, cuda:N or mps.
        n_steps: NRGPT / recurrent GPT: descent steps at evaluation (default: as trained).
        progress: on stderr, a line per task as it starts and ends (with its time) and progress
            bars; ``None``: the lines, and the bars on a terminal only; ``False``: nothing.
        exit, accept_lower_energy: per-token adaptive exit (``kl:1e-3`` ...) and energy-safe steps
            for every task (docs/inference_compute.md); with them and ``n_steps``, val_loss runs the
            model with the same options as the other tasks.
        name: how the report names the run (``"run"``; default: ``run_dir``), e.g. ``zoo:NAME`` for a
            model that ships with the package.

    Returns:
        the report: ``{"run", "tasks": {name: results}}``.

    Raises:
        ValueError: an unknown task (before anything runs), an incomplete run, bad options.
        FileNotFoundError: a missing run, data or lm-eval file.
        ConnectionError: a hub-backed lm-eval task while the hub is unreachable (before anything runs).
    """
    from energyformer.eval import harness
    from energyformer.runs.checkpoint import find_checkpoint

    names = parse_tasks(tasks)
    manager = check_tasks(names, include_path)  # one index of lm-eval's tasks for the whole call
    if limit is not None:
        check_int("limit", limit, minimum=1)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if find_checkpoint(run_dir) is None:
        raise ValueError(f"run {str(run_dir)!r} is incomplete: it holds no complete checkpoint yet")
    spec = exit.spec() if hasattr(exit, "spec") else exit  # a parsed criterion is recorded as its spelling
    options = {k: v for k, v in (("n_steps", n_steps), ("exit", spec),
                                 ("accept_lower_energy", accept_lower_energy or None)) if v is not None}
    report: dict[str, Any] = {"run": name or str(run_dir), **({"options": options} if options else {}), "tasks": {}}
    lm = harness.EnergyformerLM(run=str(run_dir), batch_size=batch_size, device=device, n_steps=n_steps,
                                progress=progress, exit=exit, accept_lower_energy=accept_lower_energy)
    say: Callable[[str], None] = (lambda msg: None) if progress is False else (
        lambda msg: tqdm.write(msg, file=sys.stderr))
    for i, task in enumerate(names, 1):
        say(f"eval {task} ({i}/{len(names)}): started")
        start = time.perf_counter()
        report["tasks"][task] = _run_task(task, lm, num_fewshot, limit, include_path, device, progress,
                                          manager)
        say(f"eval {task} ({i}/{len(names)}): done in {time.perf_counter() - start:.1f} s")
    out = Path(out) if out is not None else run_dir / "eval.json"
    atomic_write_json(out, report)
    atomic_write_text(out.with_suffix(".md"), format_report(report) + "\n")
    return report


class _WithOptions:
    """``model`` called with ``options`` (``n_steps``, ``exit``, ...) added to every forward; every other
    attribute is the model's (``config``, ``parameters``, ...). With an ``exit`` it tallies the steps each
    token got (``model.exit_steps`` after every forward): :meth:`steps_used`."""

    def __init__(self, model: Any, options: dict[str, Any]):
        self.model, self.options = model, options
        self._steps: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **{**self.options, **kwargs})
        taken = getattr(self.model, "exit_steps", None) if self.options.get("exit") is not None else None
        if taken is not None:
            self._steps.append(taken.detach().flatten().double().cpu())
        return out

    def steps_used(self) -> dict[str, float] | None:
        """``{"mean", "min", "max"}`` of the steps per token over every forward so far (None without an exit)."""
        if not self._steps:
            return None
        import torch

        s = torch.cat(self._steps)
        return {"mean": float(s.mean()), "min": float(s.min()), "max": float(s.max())}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _run_task(name: str, lm: Any, num_fewshot: int, limit: int | None, include_path: str | None,
              device: str, progress: bool | None, manager: Any = None) -> dict[str, Any]:
    """The results of one task of :func:`evaluate_run` on the adapter ``lm``."""
    from energyformer.eval import harness, mmlu

    if name == "val_loss":  # the run the adapter opened: its config and tokenizer
        model = _WithOptions(lm.model, lm.forward_kwargs) if lm.forward_kwargs else lm.model
        res = val_loss(model, lm.run_config.data.path, lm.tokenizer, lm.batch_size,
                       None if limit is None else limit * lm.max_length, lm.device, progress)
        steps = model.steps_used() if isinstance(model, _WithOptions) else None
        return {**res, "steps_per_token": steps} if steps else res
    if name == "mmlu_dev":
        vocab = set(getattr(lm.tokenizer, "chars", ())) or None
        with tempfile.TemporaryDirectory() as tmp:
            built = mmlu.build_task(tmp, vocab=vocab, num_fewshot=num_fewshot,  # (the harness scores
                                    fits=lambda t: len(lm.tok_encode(t)) <= lm.max_length + 1)  # N+1 tokens)
            res = harness.run_tasks(lm, [mmlu.TASK_NAME], include_path=tmp, limit=limit, log_samples=True,
                                    include_defaults=False)
        samples = [{"subject": s["doc"]["subject"], "correct": bool(s["acc"])}
                   for s in res["samples"][mmlu.TASK_NAME]]
        return {**mmlu.accuracy_table(samples), **{k: built[k] for k in (
            "n_parse_skipped", "n_oov_skipped", "num_fewshot", "shots", "n_truncated",
            "subject_line_chars_removed")}}
    res = harness.run_tasks(lm, [name], include_path=include_path, limit=limit, num_fewshot=num_fewshot,
                            task_manager=manager)
    return res["results"][name]


def _shots(res: dict[str, Any]) -> str:
    """``4-shot``, or what really fit the context: ``0–1 of 4 shots fit block_size``."""
    shots = res.get("shots") or {"min": res["num_fewshot"], "max": res["num_fewshot"]}
    if shots["min"] == shots["max"] == res["num_fewshot"]:
        return f"{res['num_fewshot']}-shot"
    fit = f"{shots['min']}" if shots["min"] == shots["max"] else f"{shots['min']}–{shots['max']}"
    cut = f", {res['n_truncated']} prompts truncated" if res.get("n_truncated") else ""
    return f"{fit} of {res['num_fewshot']} shots fit the context{cut}"


def format_report(report: dict[str, Any]) -> str:
    """The report as Markdown: one row per metric (per-subject accuracy stays in the JSON)."""
    def num(x: Any) -> str:
        return f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else str(x)

    options = ", ".join(f"{k}={v}" for k, v in report.get("options", {}).items())
    lines = [f"**{report['run']}**" + (f" ({options})" if options else ""), "",
             "| task | metric | value | ± stderr | chance | n |",
             "|---|---|---|---|---|---|"]
    for name, res in report["tasks"].items():
        if name == "mmlu_dev":
            lines.append(f"| mmlu_dev ({_shots(res)}) | acc | {num(res['acc'])} | {num(res['acc_stderr'])} "
                         f"| {res['chance']} | {res['n']} (skipped: {res['n_parse_skipped']} unparsed, "
                         f"{res['n_oov_skipped']} out of vocabulary) |")
        elif name == "val_loss":
            for key in ("loss", "perplexity", "bits_per_token", "bits_per_byte"):
                lines.append(f"| val_loss | {key} | {num(res[key])} | | | {res['tokens']} tokens |")
            if res.get("steps_per_token"):
                st = res["steps_per_token"]
                lines.append(f"| val_loss | steps per token (mean; min–max) | {num(st['mean'])} | | | "
                             f"{st['min']:.0f}–{st['max']:.0f} |")
        else:
            for key, value in res.items():
                if key.endswith("_stderr,none") or key == "alias" or not isinstance(value, (int, float)):
                    continue
                err = res.get(key.replace(",", "_stderr,", 1), "")
                lines.append(f"| {name} | {key.split(',')[0]} | {num(value)} | {num(err)} | | |")
    return "\n".join(lines)
