"""The lm-evaluation-harness adapter: a run directory as an lm-eval model named ``energyformer``
(the only module that imports ``lm_eval``; docs/architecture.md §1).

::

    python -m energyformer.eval.mmlu tasks/ out/nrgpt   # write the mmlu_dev task (energyformer.eval.mmlu)
    python -m energyformer.eval.harness --model energyformer --model_args run=out/nrgpt --batch_size 16 \\
        --tasks mmlu_dev --include_path tasks/   # lm-eval's own command line, with this adapter registered
    energyformer eval out/nrgpt --tasks mmlu_dev,val_loss   # the report (energyformer.eval.suite)

(lm-eval's ``lm_eval`` executable has no plugin mechanism, so it cannot see a model registered
by another package; ``python -m energyformer.eval.harness`` is that executable with ours added.)

:class:`EnergyformerLM` implements ``loglikelihood`` (through lm-eval's ``TemplateLM``:
``_loglikelihood_tokens``), ``loglikelihood_rolling`` and ``generate_until`` on our model and
our tokenizer, batched; results go to lm-eval's cache hook, so ``--use_cache DB`` works.

Choices lm-eval leaves to the model (as its ``hf`` model does, :class:`lm_eval.models.huggingface.HFLM`):

- a context plus continuation longer than ``block_size`` keeps its last ``block_size + 1``
  tokens (the context is cut from the left); ``generate_until`` slides the context window;
- an empty context (and the first window of ``loglikelihood_rolling``) is conditioned on
  ``prefix_token_id``: our models have no BOS token, so it is the id of ``"\\n"`` when the
  vocabulary has one (a character model's natural "start of text"), else 0 (model argument
  ``prefix_token_id`` to change it);
- a text with a character outside a character vocabulary is an error naming it.

A task whose data come from the Hugging Face hub is checked before lm-eval loads it
(:func:`check_hub`): without ``HF_HUB_OFFLINE=1`` and with the hub unreachable, lm-eval's
``datasets`` retries for about 40 s before failing; here it fails at once, in one line.
"""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lm_eval.evaluator
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from energyformer._validate import check_int
from energyformer.layers.exit import parse_exit
from energyformer.models.registry import get_spec
from energyformer.runs.rundir import open_run

MODEL_NAME = "energyformer"
#: ``datasets`` builders that read local files: a task naming one (``dataset_path: json``) is not hub-backed
LOCAL_BUILDERS = frozenset({"arrow", "audiofolder", "csv", "imagefolder", "json", "pandas", "parquet", "text",
                            "webdataset"})
HUB_TIMEOUT_S = 3.0  # one HEAD request to the hub endpoint, at most this long


def git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` (the ``git_hash`` of its results) with git's stderr
    discarded: outside a git repository git printed ``fatal: not a git repository`` on ours.

    ``git describe --always`` in the working directory; when git fails or is missing, lm-eval's
    own reading of ``.git`` (``None`` outside a repository).
    """
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        return done.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


lm_eval.evaluator.get_git_commit_hash = git_commit_hash  # simple_evaluate looks it up in its module


@register_model(MODEL_NAME)
class EnergyformerLM(TemplateLM):
    """lm-eval model over an energyformer run directory.

    Args (``--model_args key=value,...``):
        run: the run directory (``energyformer train``'s ``train.out_dir``), or ``zoo:NAME``; opened
            by :func:`energyformer.runs.rundir.open_run` (a one-line warning when a training still
            holds it).
        batch_size: sequences per forward pass (lm-eval passes its ``--batch_size`` here).
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``.
        max_gen_toks: default ``max_gen_toks`` of ``generate_until``.
        prefix_token_id: the token an empty context is conditioned on (see the module docstring).
        n_steps: NRGPT / recurrent GPT: descent steps at evaluation (default: as trained).
        exit: per-token adaptive exit ``NAME:THRESHOLD`` (``kl:1e-3`` ...; docs/inference_compute.md).
        accept_lower_energy: NRGPT / CEM: energy-safe steps (docs/inference_compute.md §5).
        progress: a tqdm bar (on stderr) over the requests of each call: ``None`` only on a
            terminal, ``False`` never, ``True`` always (unless lm-eval passes ``disable_tqdm``).

    Raises:
        FileNotFoundError / ValueError: a missing or incomplete run, bad arguments, an option the
            run's model does not take (``n_steps`` for GPT: its arch's ``ArchSpec.inference_options``).
    """

    backend = "causal"

    @property
    def device(self) -> torch.device:
        """The device the model was opened on (the CPU when a CUDA device was asked for but none is
        available)."""
        return self._device

    def __init__(self, run: str, batch_size: int | str = 8, device: str = "auto", max_gen_toks: int = 256,
                 prefix_token_id: int | None = None, n_steps: int | None = None, progress: bool | None = None,
                 exit: str | None = None, accept_lower_energy: bool | str = False, **kwargs: Any):
        super().__init__()
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line defaults to cuda; its hf model falls back to the CPU too
            warnings.warn(f"device={device!r} is not available; evaluating on cpu", stacklevel=2)
            device = "cpu"
        self.model, self.run_config, _, self.tokenizer, self._device, _ = open_run(run, str(device))
        self.batch_size = check_int("batch_size", 8 if str(batch_size) == "auto" else int(batch_size), 1)
        self.max_gen_toks = check_int("max_gen_toks", int(max_gen_toks), 1)
        self.max_length = self.model.config.block_size
        self.vocab_limit = min(self.tokenizer.vocab_size, self.model.config.vocab_size)
        self.progress = progress
        self.forward_kwargs = {} if n_steps is None else {"n_steps": check_int("n_steps", int(n_steps), 1)}
        if exit is not None:
            self.forward_kwargs["exit"] = parse_exit(exit)  # an unknown name raises here, naming the known ones
        if str(accept_lower_energy).lower() in ("true", "1"):  # lm-eval passes model_args as strings
            self.forward_kwargs["accept_lower_energy"] = True
        get_spec(self.run_config.model.arch).check_inference_options(self.forward_kwargs)
        if prefix_token_id is None:
            try:
                prefix_token_id = self.tokenizer.encode("\n")[0]
            except (KeyError, ValueError, IndexError):
                prefix_token_id = 0
        self._prefix = check_int("prefix_token_id", int(prefix_token_id), 0, self.model.config.vocab_size - 1)

    # --- what TemplateLM asks for ---------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Our tokenizer's ids of ``string``. Raises ``ValueError`` naming a character outside the vocabulary."""
        return list(self.tokenizer.encode(string))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's (its "Tokenizing inputs" bar off with ``progress=False``)."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.progress is False)

    def bar(self, total: int, desc: str, disable_tqdm: bool = False) -> tqdm:
        """The progress bar of one request type (see ``progress``), on stderr."""
        disable = True if disable_tqdm or self.progress is False else (None if self.progress is None else False)
        return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, disable=disable, file=sys.stderr)

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], bar: tqdm | None = None) -> list[torch.Tensor]:
        """Log-softmax of the next-token logits ``(n_i, V)`` of each sequence (each ≤ ``block_size``
        tokens), right-padded into batches of ``batch_size`` (causal: padding after a sequence never
        changes its logits); ``bar`` advances by the sequences of each batch."""
        out: list[torch.Tensor] = [None] * len(sequences)  # type: ignore[list-item]
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            n = len(sequences[rows[0]])
            batch = torch.zeros(len(rows), n, dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(sequences[i])] = torch.tensor(sequences[i])
            logits = self.model(batch.to(self._device), **self.forward_kwargs)[0].float()
            lp = F.log_softmax(logits, dim=-1).cpu()
            for r, i in enumerate(rows):
                out[i] = lp[r, :len(sequences[i])]
            if bar is not None:
                bar.update(len(rows))
        return out

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether it is the greedy continuation)`` per
        ``((context, continuation), context_ids, continuation_ids)``."""
        seqs, spans = [], []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            seqs.append(whole[:-1])
            spans.append((len(whole) - 1 - len(cont), list(cont)))
        results = []
        with self.bar(len(seqs), "loglikelihood", disable_tqdm) as bar:
            scored = self.logprobs(seqs, bar)
        for (req, (start, cont)), lp in zip(zip(requests, spans), scored):
            rows = lp[start:start + len(cont)]
            target = torch.tensor(cont)
            score = float(rows.gather(1, target[:, None]).sum())
            greedy = bool((rows[:, :self.vocab_limit].argmax(dim=-1) == target).all())
            results.append((score, greedy))
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], (score, greedy))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in disjoint windows of ``block_size`` tokens (the first
        token conditioned on ``prefix_token_id``), as lm-eval's ``hf`` model computes it."""
        results = []
        with self.bar(len(requests), "loglikelihood_rolling", disable_tqdm) as bar:
            for req in requests:
                (text,) = req.args
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)]
                scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
                total = sum(s for s, _ in scores)
                results.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
                bar.update(1)
        return results

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with ``do_sample``/``temperature`` > 0, sampled) continuations, cut before the
        first ``until`` string; ``max_gen_toks`` tokens at most. Requests with the same options are
        batched when their contexts have the same length."""
        results: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        parsed = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            opts = dict(gen_kwargs or {})
            until = opts.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(opts.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(opts.pop("temperature", 0.0) or 0.0)
            if not opts.pop("do_sample", temperature > 0):
                temperature = 0.0
            ids = self.tok_encode(context)[-self.max_length:] or [self.prefix_token_id]
            parsed.append((context, until, ids))
            groups.setdefault((len(ids), max_new, temperature), []).append(i)
        with self.bar(len(requests), "generate_until", disable_tqdm) as bar:
            for (_, max_new, temperature), rows in groups.items():
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start:start + self.batch_size]
                    idx = torch.tensor([parsed[i][2] for i in chunk], device=self._device)
                    out = self.model.generate(idx, max_new, temperature=temperature, vocab_limit=self.vocab_limit,
                                              **self.forward_kwargs)
                    for r, i in enumerate(chunk):
                        text = self.tok_decode(out[r, idx.shape[1]:].tolist())
                        for stop in parsed[i][1]:
                            if stop and stop in text:
                                text = text[:text.index(stop)]
                        results[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return results


def hub_datasets(manager: Any, tasks: Sequence[str]) -> dict[str, str]:
    """``{task: dataset_path}`` for each of ``tasks`` (groups and tags followed to their tasks) whose
    data come from the Hugging Face hub: a ``dataset_path`` that is neither a local builder
    (:data:`LOCAL_BUILDERS`) nor an existing path. Reads lm-eval's task index (no task is built,
    nothing is downloaded); ``{}`` when the index cannot be read."""
    index = getattr(manager, "task_index", None)
    if not isinstance(index, dict):
        return {}
    found: dict[str, str] = {}

    def visit(top: str, spec: Any, seen: set[str]) -> None:
        members: list[Any] = []
        if isinstance(spec, dict):  # an inline task config inside a group
            cfg = spec
        elif isinstance(spec, str) and spec not in seen and spec in index:
            seen.add(spec)
            entry = index[spec]
            cfg = getattr(entry, "cfg", None) or {}
            if getattr(getattr(entry, "kind", None), "name", "") == "TAG":  # a tag's tags are its tasks
                members = sorted(getattr(entry, "tags", ()))
        else:
            return
        members += cfg["task"] if isinstance(cfg.get("task"), list) else []  # a group's tasks
        path = cfg.get("dataset_path")
        if isinstance(path, str) and path not in LOCAL_BUILDERS and not Path(path).expanduser().exists():
            found.setdefault(top, path)
        for member in members:
            if top not in found:
                visit(top, member, seen)

    for task in tasks:
        visit(task, task, set())
    return found


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set true (as huggingface_hub reads them)."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@functools.lru_cache(maxsize=8)
def hub_reachable(endpoint: str, timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether one HEAD request to ``endpoint`` gets any HTTP answer within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:  # an answer, even an error status: the hub is there
        return True
    except (OSError, ValueError):  # refused, unroutable, timed out, no such host, a malformed URL
        return False


def check_hub(manager: Any, tasks: Sequence[str], bundled: Sequence[str] = ()) -> None:
    """Refuse, before lm-eval builds them, hub-backed ``tasks`` (:func:`hub_datasets`) when the hub
    (``HF_ENDPOINT``, default https://huggingface.co) does not answer within
    :data:`HUB_TIMEOUT_S`; nothing is checked with ``HF_HUB_OFFLINE=1`` (the cache is used).

    Raises:
        ConnectionError: the hub is unreachable; the message names the task, the endpoint, the
            dataset and the ``bundled`` tasks that need no hub.
    """
    if _offline():
        return
    needs = hub_datasets(manager, tasks)
    if not needs:
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if hub_reachable(endpoint):
        return
    task, path = next(iter(needs.items()))
    instead = f"use a bundled task ({', '.join(bundled)})" if bundled else "use a task whose data are local"
    raise ConnectionError(f"task {task!r} needs the Hugging Face hub ({endpoint} unreachable; its data: {path!r}); "
                          f"set HF_HUB_OFFLINE=1 with a cached copy or {instead}")


@contextlib.contextmanager
def quiet_bars(quiet: bool) -> Iterator[None]:
    """With ``quiet``, the progress bars of ``datasets`` (preparing a split) and of lm-eval's
    request building (its module's ``tqdm``, given ``disable=True``) are off; restored after."""
    if not quiet:
        yield
        return
    import datasets
    import lm_eval.api.task as task_module

    shown, original = datasets.is_progress_bar_enabled(), getattr(task_module, "tqdm", None)
    datasets.disable_progress_bars()
    if original is not None:
        task_module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            task_module.tqdm = original
        if shown:
            datasets.enable_progress_bars()


def run_tasks(lm: Any, tasks: list[str], include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, log_samples: bool = False,
              include_defaults: bool = True, model_args: dict[str, Any] | None = None,
              task_manager: Any = None) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``lm`` (our adapter, or any lm-eval model, or a model name
    such as ``"hf"``) on ``tasks``; ``include_defaults=False`` skips indexing lm-eval's own
    thousands of task files (seconds) when only ``include_path`` tasks are wanted. An adapter
    with ``progress=False`` runs without any progress bar (:func:`quiet_bars`).
    ``task_manager``: an ``lm_eval.tasks.TaskManager`` already built (e.g. by
    :func:`energyformer.eval.suite.check_tasks`), used instead of indexing the tasks again;
    ``include_path`` and ``include_defaults`` are then ignored.

    Returns lm-eval's results dict (``"results"`` per task; ``"samples"`` with ``log_samples``).

    Raises:
        ValueError: a task lm-eval does not know (named).
        ConnectionError: a hub-backed task while the hub is unreachable (:func:`check_hub`).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if isinstance(lm, str):
        import lm_eval.models  # noqa: F401  (registers lm-eval's own models: hf, ...)
    manager = task_manager if task_manager is not None else TaskManager(
        include_path=include_path, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task {unknown[0]!r}")
    check_hub(manager, tasks)
    with quiet_bars(getattr(lm, "progress", None) is False):
        return simple_evaluate(model=lm, model_args=model_args, tasks=list(tasks), task_manager=manager,
                               limit=limit, num_fewshot=num_fewshot, log_samples=log_samples, bootstrap_iters=0,
                               verbosity="ERROR")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``energyformer`` model registered, and the energyformer_*
    model types registered with transformers' Auto classes (so ``--model hf`` reads an exported
    folder without ``trust_remote_code``)."""
    import lm_eval.models  # noqa: F401  (lm-eval's own models, ``hf`` among them, beside ours)

    from energyformer.utils.plugins import load_plugins

    # hf/ sits above eval/ (docs/architecture.md): load it by name, as a run's plugin `imports:` are
    load_plugins(["energyformer.hf"])
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
