"""The training loop: one function, read top to bottom (nanoGPT style).

``train(run_cfg)`` checks everything that can be checked before step 1 (device, data splits
against the context length, token ids against the vocabulary, the model's memory, the run
directory: writable, not in use, the model and data of a checkpoint it resumes), then seeds
everything, builds the model and AdamW, resumes when asked, and runs ``max_steps`` optimizer
steps of ``grad_accum_steps`` micro-batches each, with warmup + cosine LR (``optim.lr_at``),
gradient clipping, periodic evaluation and checkpoints, ``metrics.jsonl`` (+ TensorBoard)
logging and a tqdm progress bar. A non-finite loss or gradient norm stops the run with
:class:`TrainingDivergedError` before anything is written, so the last good checkpoint survives.

Under ``torchrun`` the same function trains with DDP or FSDP2 (``train.parallel``; see
:mod:`energyformer.train.distributed`): rank 0 logs and writes, every rank draws its own
micro-batches of one seeded stream.

Resuming is exact: the checkpoint holds the optimizer state, the torch/numpy/python RNG states
(of every rank) and the state of the batch stream's ``torch.Generator``; evaluation draws its
batches from its own freshly seeded generators and never touches those states. So N steps +
resume for N more reproduces a 2N-step run. A resume keeps the run's resolved schedule
(``lr_decay_steps``, ``min_lr``, ``ckpt_interval``) unless a value is given explicitly, and
says what changed.

Fine-tuning is a fresh run that starts from another run's weights (``train.init_from``): step
0, a new optimizer and schedule. A run directory without a train state (``energyformer
import-hf`` writes one) cannot be resumed; the error gives the ``init_from`` command.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from energyformer.eval.loss import estimate_loss
from energyformer.models.registry import build_model
from energyformer.runs import checkpoint as ckpt
from energyformer.runs import rundir
from energyformer.runs.config import DERIVED_TRAIN_KEYS, RunConfig, TrainConfig
from energyformer.runs.rng import rng_state, seed_everything, set_rng_state
from energyformer.runs.weights import load_weights
from energyformer.train import distributed as dist
from energyformer.train.metrics import MetricsLogger
from energyformer.train.optim import build_optimizer, lr_at

# dense bf16 peak FLOP/s for MFU; devices not listed report mfu=None
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
               "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12}
# train settings whose change on resume is not worth a word (where and how, not what)
_QUIET_ON_RESUME = ("out_dir", "resume", "device", "num_threads", "compile", "tensorboard")
# bytes per parameter while training in float32: weights, gradients, AdamW's two moments
_TRAIN_BYTES_PER_PARAM = 16


class TrainingDivergedError(FloatingPointError):
    """The loss or the gradient norm became NaN/Inf; the message names the step."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. a full disk); the previous one stays committed."""


def train(run_cfg: RunConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Train ``run_cfg.model`` on ``run_cfg.data`` following ``run_cfg.train``.

    Args:
        run_cfg: the resolved run config (``model.vocab_size`` must be set; see
            ``load_config(..., resolve_vocab=True)``).
        progress: show a tqdm progress bar; ``None`` shows it only on a terminal.

    Returns:
        Summary dict (also ``summary.json``): ``steps`` (final step), ``steps_this_run``,
        ``resumed_from`` (step or None), ``best_val_loss``, ``final_val_loss``,
        ``final_train_loss``, ``tokens_per_s`` and ``minutes`` (over all segments of the run),
        ``params``, ``params_non_embedding``, ``mfu`` (None when the peak FLOP/s is unknown),
        ``device``, ``world_size``, ``out_dir``.

    Raises:
        ValueError: invalid device; data that cannot train this model (a split shorter than
            ``block_size + 1``, token ids beyond the vocabulary, a data vocabulary larger than
            ``model.vocab_size``); a model too large for the memory; an out_dir that is a file,
            not writable or in use by another training; a checkpoint of a different model or
            trained on different data; a corrupt checkpoint; a checkpoint without a train state
            to resume (the message gives the ``init_from`` command); an ``init_from`` run of
            another model or vocabulary.
        FileNotFoundError: missing data, ``resume`` naming a directory without a checkpoint,
            ``init_from`` naming a directory without a run config or weights.
        TrainingDivergedError: the loss or gradient norm became non-finite (the last good
            checkpoint in ``out_dir`` is left untouched).
        CheckpointWriteError: a checkpoint could not be written (the last one is kept).
    """
    info = dist.init_distributed(run_cfg.train.device, run_cfg.train.parallel)
    try:
        return _train(run_cfg, info, progress)
    finally:
        dist.shutdown(info)


def _train(run_cfg: RunConfig, info: dist.DistInfo, progress: bool | None) -> dict[str, Any]:
    from energyformer.data import BatchSampler, data_identity, get_batch, load_meta, load_split

    t_start = time.perf_counter()
    tc, mc = run_cfg.train, run_cfg.model
    out_dir = Path(tc.out_dir)
    device = info.device
    show = progress is not False and info.is_main
    say: Callable[[str], None] = tqdm.write if show else (lambda msg: None)

    # --- everything knowable, checked before anything is written ----------------------------------
    if tc.resume == "auto" and ckpt.find_checkpoint(out_dir) is not None:
        _require_train_state(out_dir)  # an import-hf run: say how to fine-tune it before the data is read
    data_dir = run_cfg.data.path
    meta = load_meta(data_dir)
    if int(meta["vocab_size"]) > mc.vocab_size:
        raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the data vocabulary "
                         f"({meta['vocab_size']} in {data_dir / 'meta.json'}); drop model.vocab_size from "
                         "the config to read it from meta.json")
    splits = {name: load_split(data_dir, name) for name in ("train", "val")}
    _check_splits(splits, data_dir, int(meta["vocab_size"]), mc.block_size)
    _check_memory(mc, device, info)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"train.out_dir={str(out_dir)!r} is a file; expected a run directory")
    identity = data_identity(data_dir, meta)

    with _locked(out_dir, info):
        # --- the run directory: orphans, resume, schedule ----------------------------------------
        if info.is_main:
            removed = ckpt.clean_orphans(out_dir)
            if removed:
                say(f"removed what an interrupted save left in {out_dir}: {', '.join(removed)}")
        info.barrier()
        resume_dir = _resume_dir(tc, out_dir)
        state, init_dir = None, None
        if resume_dir is not None:
            saved = _check_resumable(resume_dir, run_cfg, identity, meta)
            tc = _keep_init_from(saved.train, tc, resume_dir, (run_cfg.explicit or {}).get("train"))
            tc, notes = resolve_resumed_train(saved.train, tc, (run_cfg.explicit or {}).get("train"))
            run_cfg = dataclasses.replace(run_cfg, train=tc)
            state = ckpt.load_train_state(resume_dir)
            say(f"resuming from {resume_dir} at step {int(state['step'])}" + (f"; {notes}" if notes else ""))
        elif tc.init_from is not None:
            init_dir = _check_init_from(Path(tc.init_from), run_cfg, meta, out_dir)
            say(f"starting from the weights of {init_dir} ({ckpt.weights_path(init_dir)})")

        # --- device, threads, seeds ------------------------------------------------------------
        if tc.num_threads is not None:
            torch.set_num_threads(tc.num_threads)
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls, as nanoGPT
        else:
            # Denormal floats from GELU/softmax tails made CPU steps up to ~10x slower mid-run.
            torch.set_flush_denormal(True)
        seed_everything(tc.seed)  # the same on every rank: identical initial weights
        amp = (torch.autocast(device.type, dtype=torch.bfloat16) if tc.dtype == "bfloat16"
               else contextlib.nullcontext())
        data_gen = torch.Generator().manual_seed(tc.seed)  # the one stream of training batches
        sampler = BatchSampler(splits["train"], tc.batch_size, mc.block_size, data_gen,
                               rank=info.rank, world_size=info.world_size, device=device)

        # --- model, parallelism, optimizer -------------------------------------------------------
        try:
            model = build_model(mc).to(device)
            if tc.activation_checkpointing:
                model.set_activation_checkpointing()
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise ValueError(f"the model does not fit into the memory of {device} ({type(e).__name__}); "
                             "reduce model.d_model, model.n_layers or model.vocab_size") from None
        n_params, n_params_ne = model.num_params(), model.num_params(non_embedding=True)
        flops_per_token = estimate_flops_per_token(model)
        if init_dir is not None:
            load_weights(model, ckpt.weights_path(init_dir))
        if state is not None:
            metadata = load_weights(model, ckpt.checkpoint_dir(resume_dir) / rundir.WEIGHTS_FILE)
            ckpt.check_consistent(resume_dir, ckpt.find_checkpoint(resume_dir) or {"step": state["step"]},
                                  state, metadata)
        wrapped = dist.wrap_model(model, info)
        optimizer = build_optimizer(model, tc)
        start_step, best_val, totals = 0, math.inf, {"train_time_s": 0.0, "tokens": 0, "wall_s": 0.0}
        if state is not None:
            ckpt.restore_train_state(model, optimizer, data_gen, state)
            ranks = state.get("rng_ranks")
            if isinstance(ranks, list) and len(ranks) == info.world_size:
                set_rng_state(ranks[info.rank])
            start_step = int(state["step"])
            best_val = math.inf if state["best_val_loss"] is None else float(state["best_val_loss"])
            totals.update({k: state["extra"][k] for k in totals if k in state.get("extra", {})})
        elif info.is_main:  # a fresh run: stale checkpoint files must never be resumed or loaded
            ckpt.delete_checkpoint(out_dir)
        if start_step >= tc.max_steps:
            kept = info.broadcast(_summary_if_current(out_dir, start_step) if info.is_main else None)
            if kept is not None:  # nothing to train: the run's summary and config stay as they are
                say(f"nothing to train: the run is at step {start_step} of train.max_steps={tc.max_steps}")
                return {**kept, "steps_this_run": 0, "resumed_from": start_step}
        if info.is_main:
            rundir.write_run_files(out_dir, run_cfg, meta, write_meta=state is None)
        info.barrier()
        metrics = MetricsLogger(out_dir, keep_until_step=start_step if state is not None else None,
                                tensorboard=tc.tensorboard) if info.is_main else None

        use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
        fwd = torch.compile(wrapped) if use_compile else wrapped  # checkpoints always save `model`
        tokens_per_step = tc.batch_size * tc.grad_accum_steps * mc.block_size * info.world_size
        peak = peak_flops(device)

        def evaluate() -> dict[str, float]:
            return estimate_loss(fwd, {"val": splits["val"], "train": splits["train"]}, eval_iters=tc.eval_iters,
                                 batch_size=tc.batch_size, block_size=mc.block_size, seed=tc.seed, device=device,
                                 autocast=amp, get_batch=get_batch, rank=info.rank, world_size=info.world_size,
                                 all_reduce=info.all_reduce if info.enabled else None)

        def save(step: int, train_loss: float) -> None:
            model_state = dist.full_model_state(model, info)  # FSDP2: every rank gathers
            opt_state = ckpt.optimizer_state(model, optimizer) if (info.is_main or tc.parallel == "fsdp") else None
            ranks = info.all_gather(rng_state()) if info.enabled else None
            if info.is_main:
                extra = {"train_loss": train_loss, **totals,
                         "wall_s": totals["wall_s"] + time.perf_counter() - t_start}
                try:
                    ckpt.save_checkpoint(out_dir, model, opt_state, step, best_val, data_gen, extra=extra,
                                         data=identity, model_state=model_state, rng_ranks=ranks)
                except OSError as e:
                    raise CheckpointWriteError(
                        e.errno, f"could not write the checkpoint of step {step} into {str(out_dir)!r}: "
                        f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + ". "
                        + _kept_msg(out_dir)) from None
            info.barrier()

        # --- the loop --------------------------------------------------------------------------
        bar = tqdm(total=tc.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                   disable=True if not info.is_main else ((not progress) if progress is not None else None))
        step, train_loss, last_eval = start_step, math.nan, {}
        interval_tokens, interval_time = 0, 0.0
        wrapped.train()
        try:
            while step < tc.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(step, tc)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                batches = sampler.next_step(tc.grad_accum_steps)
                for i, (x, y) in enumerate(batches):
                    with dist.sync_gradients(wrapped, sync=i == len(batches) - 1), _out_of_memory(step, tc, out_dir):
                        with amp:
                            _, loss = fwd(x, y)
                        (loss / tc.grad_accum_steps).backward()
                    loss_sum += loss.detach()
                dist.reduce_replicated_grads(model, info)
                train_loss = info.all_reduce(loss_sum.item() / tc.grad_accum_steps, "mean")
                max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
                grad_norm = dist.clip_grad_norm(model, max_norm, info)
                if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                    raise TrainingDivergedError(_diverged_msg(step + 1, train_loss, grad_norm, lr, out_dir))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                dt = time.perf_counter() - t0
                interval_tokens += tokens_per_step
                interval_time += dt
                totals["tokens"] += tokens_per_step
                totals["train_time_s"] += dt

                do_eval = step % tc.eval_interval == 0 or step == tc.max_steps
                do_ckpt = step % tc.ckpt_interval == 0 or step == tc.max_steps
                if step % tc.log_interval == 0 or do_eval:
                    tok_s = interval_tokens / max(interval_time, 1e-9)
                    record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                              "tokens_per_s": tok_s, "mfu": _mfu(flops_per_token, tok_s, peak)}
                    if do_eval:
                        last_eval = evaluate()
                        if not math.isfinite(last_eval["val"]):
                            raise TrainingDivergedError(
                                f"validation loss is {last_eval['val']} at step {step}; not saving a checkpoint. "
                                + _kept_msg(out_dir))
                        best_val = min(best_val, last_eval["val"])
                        record.update(val_loss=last_eval["val"], train_loss_eval=last_eval["train"],
                                      best_val_loss=best_val)
                        say(f"step {step}: train loss {last_eval['train']:.4f}, val loss "
                            f"{last_eval['val']:.4f} (best {best_val:.4f})")
                    if metrics is not None:
                        metrics.log(record)
                    if bar.disable and progress is None:  # no terminal: plain log lines instead of a bar
                        say(f"step {step}/{tc.max_steps}: loss {train_loss:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s")
                    bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
                    interval_tokens, interval_time = 0, 0.0
                if do_ckpt:
                    # The step just taken can blow the weights up although this step's loss was finite.
                    if not dist.all_finite(model, info):
                        raise TrainingDivergedError(
                            f"parameters became non-finite at step {step} (lr {lr:.3g}); not saving a checkpoint. "
                            + _kept_msg(out_dir) + " Try a lower train.learning_rate or train.grad_clip.")
                    save(step, train_loss)
                bar.update(1)
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
            if device.type != "cuda":
                torch.set_flush_denormal(False)  # process-wide setting: restore PyTorch's default

        if not last_eval:  # nothing trained in this call (already at max_steps): still report losses
            last_eval = evaluate()
            best_val = min(best_val, last_eval["val"])
        wall_s = totals["wall_s"] + time.perf_counter() - t_start
        tokens_per_s = totals["tokens"] / totals["train_time_s"] if totals["train_time_s"] > 0 else None
        summary = {
            "steps": step,
            "steps_this_run": step - start_step,
            "resumed_from": start_step if state is not None else None,
            "best_val_loss": best_val,
            "final_val_loss": last_eval["val"],
            "final_train_loss": last_eval["train"],
            "tokens_per_s": tokens_per_s,
            "mfu": None if tokens_per_s is None else _mfu(flops_per_token, tokens_per_s, peak),
            "minutes": wall_s / 60,
            "params": n_params,
            "params_non_embedding": n_params_ne,
            "device": str(device),
            "world_size": info.world_size,
            "out_dir": str(out_dir),
        }
        if info.is_main:  # for `compare`-style tables across runs; metrics.jsonl keeps the full curve
            rundir.write_summary(out_dir, summary)
        return summary


# ------------------------------------------------------------------------------------------------
# checks before step 1
# ------------------------------------------------------------------------------------------------

def _check_splits(splits: dict[str, Any], data_dir: Path, vocab_size: int, block_size: int) -> None:
    from energyformer.data import check_token_ids

    for name, data in splits.items():
        path = data_dir / f"{name}.bin"
        if len(data) < block_size + 1:
            raise ValueError(f"{path} has {len(data)} tokens but model.block_size={block_size} needs at least "
                             f"{block_size + 1}; use a smaller --model.block_size or more text")
        check_token_ids(data, vocab_size, path)


def _check_memory(mc: Any, device: torch.device, info: dist.DistInfo) -> None:
    """Refuse a model whose weights, gradients and AdamW state alone exceed the device's memory."""
    with torch.device("meta"):
        n = build_model(mc).num_params()
    need = n * _TRAIN_BYTES_PER_PARAM / (info.world_size if info.parallel == "fsdp" else 1)
    have = _memory_bytes(device)
    if have is not None and need > have:
        raise ValueError(f"the model has {n:,} parameters: training needs at least {need / 2**30:.1f} GiB "
                         f"(weights, gradients, AdamW state) but {device} has {have / 2**30:.1f} GiB; reduce "
                         "model.d_model, model.n_layers or model.vocab_size")


def _memory_bytes(device: torch.device) -> float | None:
    try:
        if device.type == "cuda":
            return float(torch.cuda.mem_get_info(device)[1])
        if device.type == "cpu":
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass
    return None


@contextlib.contextmanager
def _locked(out_dir: Path, info: dist.DistInfo):
    """Rank 0 holds the run directory's lock; a directory this call created is removed on a
    failure before anything but the lock was written into it."""
    if not info.is_main:
        yield
        return
    created = not out_dir.exists()
    try:
        with rundir.lock_run_dir(out_dir):
            yield
    except PermissionError as e:
        raise ValueError(f"train.out_dir={str(out_dir)!r} is not writable ({e.strerror}); choose another "
                         "--train.out_dir") from None
    except BaseException:
        if created and out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= {rundir.LOCK_FILE}:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _resume_dir(tc: TrainConfig, out_dir: Path) -> Path | None:
    """Where to resume from, or None for a fresh run.

    With ``resume="auto"`` an out_dir that holds checkpoint files but no complete checkpoint
    (marker missing or unreadable, a listed file gone) is an error rather than a fresh start:
    a fresh start deletes those files, and they may be the only copy of trained weights.
    """
    if tc.resume == "never":
        return None
    if tc.resume == "auto":
        if ckpt.find_checkpoint(out_dir) is not None:  # its train state was checked before the data was read
            return out_dir
        left = ckpt.has_checkpoint_files(out_dir)
        if left:
            raise ValueError(
                f"train.out_dir={str(out_dir)!r} holds checkpoint files {left} but no complete checkpoint, so "
                "train.resume='auto' cannot continue from it; use --train.resume never to start over "
                "(this deletes them) or choose another --train.out_dir")
        return None
    path = Path(tc.resume)
    if ckpt.find_checkpoint(path) is None:
        raise FileNotFoundError(f"train.resume={tc.resume!r}: no complete checkpoint there (expected "
                                f"{rundir.MARKER_FILE} and the files it lists)")
    _require_train_state(path)
    return path


def train_on_hint(run_dir: str | Path) -> str:
    """How to train further from the run directory ``run_dir``, for error messages: resume it
    (when it has a train state) or fine-tune its weights in a new run (``train.init_from``)."""
    run_dir = Path(run_dir)
    config = run_dir / rundir.CONFIG_FILE
    fine_tune = (f"to fine-tune it, start a new run from its weights: energyformer train {config} "
                 f"--train.init_from {run_dir} --train.out_dir NEW_RUN_DIR --data.dataset NAME")
    if (ckpt.checkpoint_dir(run_dir) / rundir.STATE_FILE).is_file():
        return f"to continue it: energyformer train {config} --train.out_dir {run_dir}; {fine_tune}"
    source = (ckpt.find_checkpoint(run_dir) or {}).get("imported_from")
    made = f"made by `energyformer import-hf` from {source!r}" if source else f"no {rundir.STATE_FILE}"
    return f"it holds weights but no training state ({made}), so training cannot resume it; {fine_tune}"


def _require_train_state(run_dir: Path) -> None:
    """Raise ``ValueError`` (saying how to fine-tune) if the checkpoint of ``run_dir`` holds
    weights but no train state, as a run written by ``energyformer import-hf`` does."""
    if not (ckpt.checkpoint_dir(run_dir) / rundir.STATE_FILE).is_file():
        raise ValueError(f"{str(run_dir)!r}: {train_on_hint(run_dir)}")


def _keep_init_from(saved: TrainConfig, new: TrainConfig, run_dir: Path, explicit: frozenset[str] | None
                    ) -> TrainConfig:
    """A resumed run keeps the ``init_from`` it started from; naming another one is an error
    (the weights come from the checkpoint being resumed)."""
    if new.init_from != saved.init_from and new.init_from is not None and "init_from" in (explicit or ()):
        raise ValueError(f"train.init_from={new.init_from!r} starts a fresh run, but {str(run_dir)!r} holds a "
                         "checkpoint that this run resumes; use --train.resume never to start over (this deletes "
                         "that checkpoint) or choose another --train.out_dir")
    return dataclasses.replace(new, init_from=saved.init_from)


def _check_init_from(init_dir: Path, run_cfg: RunConfig, meta: dict[str, Any], out_dir: Path) -> Path:
    """``init_dir`` after checking that its weights can start this run: another directory than
    ``out_dir``, weights present, the same model (dropout aside) and the same vocabulary."""
    from energyformer.data import identity_change, vocab_identity

    if init_dir.resolve() == out_dir.resolve():
        raise ValueError(f"train.init_from={str(init_dir)!r} is train.out_dir; a fresh run there deletes the "
                         "weights it would start from: choose another --train.out_dir")
    try:
        saved = rundir.read_run_config(init_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"train.init_from={str(init_dir)!r}: {e}") from None
    weights = ckpt.weights_path(init_dir)
    if not weights.is_file():
        raise FileNotFoundError(f"train.init_from={str(init_dir)!r}: no weights there ({str(weights)!r} not found)")
    a, b = saved.model.to_dict(), run_cfg.model.to_dict()
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k != "dropout" and a.get(k) != b.get(k)}
    if diff:
        raise ValueError(f"train.init_from={str(init_dir)!r} holds a different model (its vs this run's: {diff}); "
                         f"train with its model section, e.g. energyformer train {init_dir / rundir.CONFIG_FILE} "
                         f"--train.init_from {init_dir} --train.out_dir NEW_RUN_DIR --data.dataset NAME")
    if (init_dir / rundir.META_FILE).is_file():
        saved_meta = rundir.read_run_meta(init_dir)
        change = identity_change(vocab_identity(saved_meta), vocab_identity(meta), saved_meta, meta)
        if change:
            raise ValueError(f"the data in {str(run_cfg.data.path)!r} are not tokenized like the run "
                             f"train.init_from={str(init_dir)!r}: {change}; prepare the data with its tokenizer")
    return init_dir


def _check_resumable(run_dir: Path, run_cfg: RunConfig, identity: dict[str, Any], meta: dict[str, Any]) -> RunConfig:
    """The saved run config, after checking that the data (first: a changed vocabulary changes
    the model's vocab_size too) and the model are the run's."""
    from energyformer.data import identity_change, vocab_identity

    saved = rundir.read_run_config(run_dir)
    marker = ckpt.find_checkpoint(run_dir) or {}
    saved_meta = rundir.read_run_meta(run_dir) if (run_dir / rundir.META_FILE).is_file() else None
    recorded = marker.get("data") or (vocab_identity(saved_meta) if saved_meta else None)
    if isinstance(recorded, dict):
        change = identity_change(recorded, identity, saved_meta, meta)
        if change:
            raise ValueError(f"the data in {str(run_cfg.data.path)!r} differ from the data run {str(run_dir)!r} "
                             f"was trained on: {change}; resume on the same data, or use --train.resume never "
                             "to start over or another --train.out_dir")
    if saved.model != run_cfg.model:
        a, b = saved.model.to_dict(), run_cfg.model.to_dict()
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        raise ValueError(f"{str(run_dir)!r} holds a checkpoint of a different model (saved vs now: {diff}); "
                         "use --train.resume never to start over or choose another --train.out_dir")
    return saved


def resolve_resumed_train(saved: TrainConfig, new: TrainConfig, explicit: frozenset[str] | None
                          ) -> tuple[TrainConfig, str]:
    """The train config a resumed run continues with, and what changed, in words.

    The run's derived values (``DERIVED_TRAIN_KEYS``: ``lr_decay_steps``, ``min_lr``,
    ``ckpt_interval``) are kept unless ``explicit`` (the keys given by the recipe or the command
    line; ``None``: unknown, keep ``new`` as it is) names them, so raising ``max_steps`` does
    not re-derive the learning-rate schedule.

    Raises:
        ValueError: the kept values are invalid with the new ones (e.g. ``min_lr`` above a
            lowered ``learning_rate``): the message names the key to give.
    """
    kept = {}
    if explicit is not None:
        kept = {k: getattr(saved, k) for k in DERIVED_TRAIN_KEYS
                if k not in explicit and getattr(saved, k) != getattr(new, k)}
    try:
        resolved = dataclasses.replace(new, **kept)
    except ValueError as e:
        raise ValueError(f"{e} (kept from the resumed run; give --train.{' / --train.'.join(kept)} explicitly)") from None
    changed = [f"train.{f.name} {getattr(saved, f.name)} → {getattr(resolved, f.name)}"
               for f in dataclasses.fields(TrainConfig)
               if f.name not in _QUIET_ON_RESUME and getattr(saved, f.name) != getattr(resolved, f.name)]
    words = []
    if changed:
        words.append("changed: " + ", ".join(changed))
    if kept:
        words.append("kept the run's " + ", ".join(f"train.{k}={v}" for k, v in kept.items())
                     + " (give them explicitly to change them)")
    return resolved, "; ".join(words)


def _summary_if_current(out_dir: Path, step: int) -> dict[str, Any] | None:
    try:
        summary = rundir.read_summary(out_dir)
    except (FileNotFoundError, ValueError):
        return None
    return summary if summary.get("steps") == step else None


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def estimate_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    A model may define ``flops_per_token()`` for its own count. Otherwise nanoGPT's estimate
    ``6 N + 12 L d T`` (N non-embedding params, L layers x recurrence steps, d width, T block),
    which undercounts models that reuse one block's weights many times only in the ``6 N`` term
    (rough; MFU is a throughput hint, not a measurement).
    """
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token())
    c = model.config
    depth = getattr(c, "n_layers", 1) * getattr(c, "n_steps", 1)
    d = getattr(c, "d_model", 0)
    return 6.0 * model.num_params(non_embedding=True) + 12.0 * depth * d * c.block_size


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known CUDA GPU, else ``None``."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def _mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    return None if peak is None else flops_per_token * tokens_per_s / peak


@contextlib.contextmanager
def _out_of_memory(step: int, tc: TrainConfig, out_dir: Path):
    """Turn an allocation failure inside a training step into one line that says what to change.

    The parameter check before step 1 cannot see activations (attention over a long block, many
    recurrent steps), so the first forward is where an impossible size shows; nothing of the run
    is lost (the last checkpoint, if any, is untouched).
    """
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise ValueError(_oom_msg(step, tc, out_dir, e)) from None
    except RuntimeError as e:
        if "allocate" not in str(e) and "out of memory" not in str(e):
            raise
        raise ValueError(_oom_msg(step, tc, out_dir, e)) from None


def _oom_msg(step: int, tc: TrainConfig, out_dir: Path, e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"out of memory in training step {step + 1} ({first[:160]}); reduce train.batch_size "
            f"(now {tc.batch_size}), model.block_size or the model's size, or use "
            f"--train.activation_checkpointing true. " + _kept_msg(out_dir))


def _kept_msg(out_dir: Path) -> str:
    marker = ckpt.find_checkpoint(out_dir)
    if marker is None:
        return "No checkpoint was written."
    return f"The last good checkpoint (step {marker['step']}) in {str(out_dir)!r} was kept."


def _diverged_msg(step: int, loss: float, grad_norm: float, lr: float, out_dir: Path) -> str:
    what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
    return (f"training diverged at step {step}: {what} (lr {lr:.3g}). " + _kept_msg(out_dir)
            + " Try a lower train.learning_rate, a longer warmup or train.grad_clip.")
