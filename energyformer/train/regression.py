"""Training an in-context regressor (``arch: regressor``) on prepared GP data (docs/cem.md §9).

The language-model loop (:mod:`energyformer.train.loop`) reads token streams; a regressor reads
whole sequences of continuous pairs, so it has this short loop of its own, with the same
optimizer, schedule, run directory and summary: AdamW and warmup + decay from
:mod:`energyformer.train.optim`, batches of ``train.batch_size`` sequences drawn from a
``torch.Generator`` seeded with ``train.seed``, the validation MSE on the whole validation
split every ``eval_interval`` steps, ``metrics.jsonl``, and one checkpoint at the end
(``energyformer.runs.checkpoint``), which ``load_run`` reads, on ``train.device`` in float32. A
finished run is not repeated (the experiment runner checks ``summary.json``); an interrupted one
starts over.

It reads the ``TrainConfig`` keys of the regressor's
:class:`~energyformer.models.registry.ArchSpec` (``REGRESSOR_TRAIN_KEYS``); ``energyformer.train.train``
refuses the others (``resume``, ``parallel``, ``grad_accum_steps``, ...) when set away from their
defaults, in one line naming them.

    energyformer train configs/gp/cem_t4.yaml      # energyformer.train.train sends arch=regressor runs here
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from energyformer.data.gp import load_gp_split
from energyformer.data.meta import load_meta
from energyformer.models.registry import build_model, get_spec
from energyformer.runs import checkpoint as ckpt
from energyformer.runs import rundir
from energyformer.runs.config import RunConfig
from energyformer.runs.rng import seed_everything
from energyformer.train.depth import check_supported
from energyformer.train.metrics import MetricsLogger
from energyformer.train.optim import build_optimizer, lr_at
from energyformer.utils.device import configure_backends, resolve_device


@torch.no_grad()
def val_mse(model: torch.nn.Module, data: np.ndarray, batch_size: int) -> float:
    """Mean squared error of ``model`` over every sequence of ``data`` (shape (S, n, x_dim + 1)), in eval mode
    (the model is left in train mode), on the model's device."""
    model.eval()
    total = 0.0
    device = next(model.parameters()).device
    for i in range(0, len(data), batch_size):
        xy = torch.from_numpy(data[i:i + batch_size]).to(device)
        total += float(model(xy, xy[..., -1])[1]) * len(xy)
    model.train()
    return total / len(data)


def train_regressor(run_cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Train ``run_cfg.model`` (a :class:`~energyformer.models.regression.RegressorConfig`) on GP data.

    Returns:
        the summary (as :func:`energyformer.train.train`'s, losses are MSE): ``steps``,
        ``best_val_loss``, ``final_val_loss``, ``final_train_loss``, ``tokens_per_s`` (2 tokens per
        pair), ``minutes``, ``params``, ``params_non_embedding``, ``device``, ``out_dir``.

    The keys its arch does not read are refused by the caller, ``energyformer.train.train``
    (:meth:`~energyformer.models.registry.ArchSpec.check_train_config`).

    Raises:
        ValueError: the model is a language model (token ids, not continuous pairs), its
            ``x_dim``/``block_size`` do not fit the data, ``train.depth_sampler`` /
            ``train.backprop_steps`` are set (no recurrent steps), ``train.dtype`` is ``bfloat16``
            (the regressor trains in float32), or ``train.device`` is not available.
        FileNotFoundError: the GP data is not prepared.
        FloatingPointError: the loss became non-finite.
    """
    tc, mc = run_cfg.train, run_cfg.model
    if get_spec(mc.arch).language_model:
        raise ValueError(f"train_regressor trains models of continuous pairs; model.arch={mc.arch!r} is a "
                         "language model (energyformer.train.train picks its loop)")
    check_supported(mc, tc)  # no randomized depth: the regressor's forward takes no n_steps
    if tc.dtype == "bfloat16":
        raise ValueError("train.dtype='bfloat16': the regressor trains in float32; leave train.dtype 'auto' "
                         "or give 'float32'")
    device = resolve_device(tc.device)
    configure_backends(device)  # as every training: the CPU allocator (train.deterministic is refused above)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    if tc.num_threads is not None:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)
    meta = run_cfg.data_meta if run_cfg.data_meta is not None else load_meta(run_cfg.data.path)  # read once
    train, val = load_gp_split(run_cfg.data.path, "train"), load_gp_split(run_cfg.data.path, "val")
    n_points, feats = train.shape[1], train.shape[2]
    if feats != mc.x_dim + 1:
        raise ValueError(f"model.x_dim={mc.x_dim} but the data has x_dim={feats - 1} ({run_cfg.data.path})")
    if 2 * n_points > mc.block_size:
        raise ValueError(f"model.block_size={mc.block_size} is too small for {n_points} pairs ({2 * n_points} tokens)")
    out_dir = Path(tc.out_dir)
    for name in ckpt.CHECKPOINT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    model = build_model(mc).to(device)
    optimizer = build_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    rundir.write_run_files(out_dir, run_cfg, meta)
    best, last_val, train_loss, step_time = math.inf, math.nan, math.nan, 0.0
    with MetricsLogger(out_dir) as metrics:
        for step in range(1, tc.max_steps + 1):
            t0 = time.perf_counter()
            lr = lr_at(step - 1, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = torch.randint(len(train), (tc.batch_size,), generator=gen).numpy()
            xy = torch.from_numpy(train[rows]).to(device)
            _, loss = model(xy, xy[..., -1])
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_loss = float(loss.detach())
            if not math.isfinite(train_loss):
                raise FloatingPointError(f"the regression loss became {train_loss} at step {step} (lr {lr:.3g})")
            step_time += time.perf_counter() - t0
            record: dict[str, Any] = {"step": step, "train_loss": train_loss, "lr": lr}
            if step % tc.eval_interval == 0 or step == tc.max_steps:
                last_val = val_mse(model, val, 256)
                best = min(best, last_val)
                record.update(val_loss=last_val, best_val_loss=best)
                if progress:
                    print(f"step {step}: train mse {train_loss:.4f}, val mse {last_val:.4f}")
            if step % tc.log_interval == 0 or "val_loss" in record:
                metrics.log(record)
    ckpt.save_checkpoint(out_dir, model, optimizer, tc.max_steps, best, gen, extra={"train_loss": train_loss})
    summary = {"steps": tc.max_steps, "steps_this_run": tc.max_steps, "resumed_from": None,
               "best_val_loss": best, "final_val_loss": last_val, "final_train_loss": train_loss,
               "tokens_per_s": tc.max_steps * tc.batch_size * 2 * n_points / max(step_time, 1e-9), "mfu": None,
               "minutes": (time.perf_counter() - t_start) / 60,
               "cpu_minutes": (time.process_time() - cpu_start) / 60, "params": model.num_params(),
               "params_non_embedding": model.num_params(), "device": str(device), "out_dir": str(out_dir)}
    rundir.write_summary(out_dir, summary)
    return summary
