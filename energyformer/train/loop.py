"""The training loop: one function, read top to bottom (nanoGPT style).

``train(run_cfg)`` seeds everything, reads the prepared data, builds the model and AdamW,
resumes from a checkpoint when asked, then runs ``max_steps`` optimizer steps of
``grad_accum_steps`` micro-batches each, with warmup + cosine LR (``optim.lr_at``), gradient
clipping, periodic evaluation and checkpoints, ``metrics.jsonl`` (+ TensorBoard) logging and a
tqdm progress bar. A non-finite loss or gradient norm stops the run with
:class:`TrainingDivergedError` before anything is written, so the last good checkpoint survives.

Resuming is exact: the checkpoint holds the optimizer state, the torch/numpy/python RNG states
and the state of the dedicated data ``torch.Generator``; evaluation draws its batches from its own
freshly seeded generators (the same batches at every evaluation) and never touches those states.
So N steps + resume for N more reproduces a 2N-step run (with the same ``lr_decay_steps``).
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from energyformer.eval.loss import estimate_loss
from energyformer.models.registry import build_model
from energyformer.runs import checkpoint as ckpt
from energyformer.runs import rundir
from energyformer.runs.config import RunConfig, TrainConfig
from energyformer.runs.rng import seed_everything
from energyformer.train.metrics import MetricsLogger
from energyformer.train.optim import build_optimizer, lr_at
from energyformer.utils.device import resolve_device

# dense bf16 peak FLOP/s for MFU; devices not listed report mfu=None
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
               "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


class TrainingDivergedError(FloatingPointError):
    """The loss or the gradient norm became NaN/Inf; the message names the step."""


def train(run_cfg: RunConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Train ``run_cfg.model`` on ``run_cfg.data`` following ``run_cfg.train``.

    Args:
        run_cfg: the resolved run config (``model.vocab_size`` must be set; see
            ``load_config(..., resolve_vocab=True)``).
        progress: show a tqdm progress bar; ``None`` shows it only on a terminal.

    Returns:
        Summary dict: ``steps`` (final step), ``steps_this_run``, ``resumed_from`` (step or None),
        ``best_val_loss``, ``final_val_loss``, ``final_train_loss``, ``tokens_per_s``, ``minutes``,
        ``params``, ``params_non_embedding``, ``mfu`` (None when the peak FLOP/s is unknown),
        ``device``, ``out_dir``.

    Raises:
        ValueError: invalid device, a data vocab larger than ``model.vocab_size``, a checkpoint
            in ``out_dir`` for a different model, or a corrupt checkpoint.
        FileNotFoundError: missing data, or ``resume`` naming a directory without a checkpoint.
        TrainingDivergedError: the loss or gradient norm became non-finite (the last good
            checkpoint in ``out_dir`` is left untouched).
    """
    from energyformer.data import get_batch, load_meta, load_split  # data/ is optional for models

    t_start = time.perf_counter()
    tc, mc = run_cfg.train, run_cfg.model
    out_dir = Path(tc.out_dir)

    # --- device, threads, seeds --------------------------------------------------------------
    device = resolve_device(tc.device)
    if tc.num_threads is not None:
        torch.set_num_threads(tc.num_threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, as nanoGPT
    else:
        # Denormal floats from GELU/softmax tails made CPU steps up to ~10x slower mid-run.
        torch.set_flush_denormal(True)
    seed_everything(tc.seed)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if tc.dtype == "bfloat16"
           else contextlib.nullcontext())

    # --- data ------------------------------------------------------------------------------------
    data_dir = run_cfg.data.path
    meta = load_meta(data_dir)
    if int(meta["vocab_size"]) > mc.vocab_size:
        raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the data vocabulary "
                         f"({meta['vocab_size']} in {data_dir / 'meta.json'}); drop model.vocab_size from "
                         "the config to read it from meta.json")
    train_data, val_data = load_split(data_dir, "train"), load_split(data_dir, "val")
    block_size = mc.block_size
    data_gen = torch.Generator().manual_seed(tc.seed)  # the only RNG that draws training batches

    # --- model and optimizer ---------------------------------------------------------------------
    model = build_model(mc).to(device)
    optimizer = build_optimizer(model, tc)

    # --- resume ----------------------------------------------------------------------------------
    start_step, best_val = 0, math.inf
    resume_dir = _resume_dir(tc, out_dir)
    if resume_dir is not None:
        _check_same_model(resume_dir, run_cfg)
        state = ckpt.restore_checkpoint(resume_dir, model, optimizer, data_gen)
        start_step = int(state["step"])
        best_val = math.inf if state["best_val_loss"] is None else float(state["best_val_loss"])
        if progress is not False:
            tqdm.write(f"resuming from {resume_dir} at step {start_step}")
    else:  # a fresh run: stale checkpoint files in out_dir must never be resumed or loaded
        for name in ckpt.CHECKPOINT_FILES:
            (out_dir / name).unlink(missing_ok=True)
    rundir.write_run_files(out_dir, run_cfg, meta)
    metrics = MetricsLogger(out_dir, keep_until_step=start_step if resume_dir is not None else None,
                            tensorboard=tc.tensorboard)

    use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
    fwd = torch.compile(model) if use_compile else model  # checkpoints always save `model`

    n_params, n_params_ne = model.num_params(), model.num_params(non_embedding=True)
    tokens_per_step = tc.batch_size * tc.grad_accum_steps * block_size
    flops_per_token = estimate_flops_per_token(model)
    peak = peak_flops(device)

    def evaluate() -> dict[str, float]:
        return estimate_loss(fwd, {"val": val_data, "train": train_data}, eval_iters=tc.eval_iters,
                             batch_size=tc.batch_size, block_size=block_size, seed=tc.seed, device=device,
                             autocast=amp, get_batch=get_batch)

    # --- the loop --------------------------------------------------------------------------------
    bar = tqdm(total=tc.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
               disable=(not progress) if progress is not None else None)
    say = bar.write if progress is not False else (lambda msg: None)
    step, train_loss, last_eval = start_step, math.nan, {}
    interval_tokens, interval_time, total_tokens, total_time = 0, 0.0, 0, 0.0
    model.train()
    try:
        while step < tc.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(tc.grad_accum_steps):
                x, y = get_batch(train_data, tc.batch_size, block_size, data_gen, device)
                with amp:
                    _, loss = fwd(x, y)
                (loss / tc.grad_accum_steps).backward()
                loss_sum += loss.detach()
            train_loss = loss_sum.item() / tc.grad_accum_steps
            max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                raise TrainingDivergedError(_diverged_msg(step + 1, train_loss, grad_norm, lr, out_dir))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            interval_tokens += tokens_per_step
            interval_time += dt
            total_tokens += tokens_per_step
            total_time += dt

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
                metrics.log(record)
                if bar.disable and progress is None:  # no terminal: plain log lines instead of a bar
                    say(f"step {step}/{tc.max_steps}: loss {train_loss:.4f}, lr {lr:.2e}, "
                              f"{tok_s:,.0f} tok/s")
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
                interval_tokens, interval_time = 0, 0.0
            if do_ckpt:
                # The step just taken can blow the weights up although this step's loss was finite.
                if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                    raise TrainingDivergedError(
                        f"parameters became non-finite at step {step} (lr {lr:.3g}); not saving a checkpoint. "
                        + _kept_msg(out_dir) + " Try a lower train.learning_rate or train.grad_clip.")
                ckpt.save_checkpoint(out_dir, model, optimizer, step, best_val, data_gen,
                                     extra={"train_loss": train_loss})
            bar.update(1)
    finally:
        bar.close()
        metrics.close()
        if device.type != "cuda":
            torch.set_flush_denormal(False)  # process-wide setting: restore PyTorch's default

    if not last_eval:  # nothing trained in this call (already at max_steps): still report losses
        last_eval = evaluate()
        best_val = min(best_val, last_eval["val"])
    tokens_per_s = total_tokens / total_time if total_time > 0 else 0.0
    summary = {
        "steps": step,
        "steps_this_run": step - start_step,
        "resumed_from": start_step if resume_dir is not None else None,
        "best_val_loss": best_val,
        "final_val_loss": last_eval["val"],
        "final_train_loss": last_eval["train"],
        "tokens_per_s": tokens_per_s,
        "mfu": _mfu(flops_per_token, tokens_per_s, peak),
        "minutes": (time.perf_counter() - t_start) / 60,
        "params": n_params,
        "params_non_embedding": n_params_ne,
        "device": str(device),
        "out_dir": str(out_dir),
    }
    # For `compare`-style tables across runs; metrics.jsonl keeps the full curve.
    rundir.write_summary(out_dir, summary)
    return summary


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


def _resume_dir(tc: TrainConfig, out_dir: Path) -> Path | None:
    """Where to resume from, or None for a fresh run.

    With ``resume="auto"`` an out_dir that holds checkpoint files but no complete checkpoint
    (marker missing or unreadable, a listed file gone) is an error rather than a fresh start:
    a fresh start deletes those files, and they may be the only copy of trained weights.
    """
    if tc.resume == "never":
        return None
    if tc.resume == "auto":
        if ckpt.find_checkpoint(out_dir) is not None:
            return out_dir
        left = [n for n in ckpt.CHECKPOINT_FILES if (out_dir / n).exists()]
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
    return path


def _check_same_model(run_dir: Path, run_cfg: RunConfig) -> None:
    saved = rundir.read_run_config(run_dir).model
    if saved != run_cfg.model:
        a, b = saved.to_dict(), run_cfg.model.to_dict()
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        raise ValueError(f"{str(run_dir)!r} holds a checkpoint of a different model (saved vs now: {diff}); "
                         "use --train.resume never to start over or choose another --train.out_dir")


def _kept_msg(out_dir: Path) -> str:
    marker = ckpt.find_checkpoint(out_dir)
    if marker is None:
        return "No checkpoint was written."
    return f"The last good checkpoint (step {marker['step']}) in {str(out_dir)!r} was kept."


def _diverged_msg(step: int, loss: float, grad_norm: float, lr: float, out_dir: Path) -> str:
    what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
    return (f"training diverged at step {step}: {what} (lr {lr:.3g}). " + _kept_msg(out_dir)
            + " Try a lower train.learning_rate, a longer warmup or train.grad_clip.")
