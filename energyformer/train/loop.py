"""The training loop, read top to bottom: :func:`train`, then the phases it runs in order.

``train(run_cfg)`` checks everything that can be checked before step 1 (``_read_data`` and
:mod:`energyformer.train.preflight`: device, data splits against the context length, token ids
against the vocabulary, the model's memory, the run directory: writable, not in use, the model
and data of a checkpoint it resumes), decides where the run starts (``_choose_start``), seeds
everything, builds the model (``_build``), measures its training FLOPs per token once
(:func:`energyformer.models.flops.training_flops_per_token`, for the logged MFU), applies
checkpointing, DDP/FSDP2 and compile (:func:`energyformer.train.parallelize.parallelize`),
builds AdamW, resumes when asked, and ``_Loop`` runs ``max_steps`` optimizer
steps of ``grad_accum_steps`` micro-batches each, with warmup + cosine LR (``optim.lr_at``),
gradient clipping, periodic evaluation and checkpoints, ``metrics.jsonl`` (+ TensorBoard)
logging and a tqdm progress bar. The losses and gradient norms stay on the device and are read
once per ``log_interval`` (and at every evaluation and checkpoint): a non-finite loss or gradient
norm stops the run there with :class:`TrainingDivergedError`, naming the first such step, before
anything of it is logged or written, so the last good checkpoint survives (docs/gpu.md).

Under ``torchrun`` the same function trains with DDP or FSDP2 (``train.parallel``; see
:mod:`energyformer.train.distributed`): rank 0 logs and writes, every rank draws its own
micro-batches of one seeded stream.

Randomized depth (``train.depth_sampler``, ``train.backprop_steps``; :mod:`energyformer.train.depth`):
each optimizer step draws its number of recurrent steps from a generator of its own, the same on
every rank, and passes it to the model's forward with the truncation; the default (``fixed``, no
truncation) calls the model exactly as before.

Resuming is exact: the checkpoint holds the optimizer state, the torch/numpy/python RNG states
(of every rank), the state of the batch stream's ``torch.Generator`` and that of the depth
sampler's; evaluation draws its
batches from its own freshly seeded generators and never touches those states. So N steps +
resume for N more reproduces a 2N-step run. A resume keeps the run's derived values (the
schedule's ``lr_decay_steps``, ``min_lr``, ``cooldown_steps``, ``ckpt_interval``; the model's
``d_ff``, ``head_dim``, ...) unless a value is given explicitly, compares only the model values
given with the run's, and says what changed.

Fine-tuning is a fresh run that starts from another run's weights (``train.init_from``): step
0, a new optimizer and schedule. A run directory without a train state (``energyformer
import-hf`` writes one) cannot be resumed; the error gives the ``init_from`` command.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from energyformer.eval.loss import estimate_loss
from energyformer.models.flops import training_flops_per_token
from energyformer.models.registry import build_model
from energyformer.runs import checkpoint as ckpt
from energyformer.runs import rundir
from energyformer.runs.config import RunConfig, TrainConfig
from energyformer.runs.rng import rng_state, seed_everything, set_rng_state
from energyformer.runs.weights import load_weights
from energyformer.train import distributed as dist
from energyformer.train import preflight
from energyformer.train.depth import DepthSampler, check_supported
from energyformer.train.metrics import MetricsLogger, logger_options, peak_flops
from energyformer.train.optim import build_optimizer, lr_at
from energyformer.train.parallelize import parallelize
from energyformer.train.preflight import resolve_resumed_train, train_on_hint
from energyformer.utils.device import autocast_context, configure_backends, resolve_dtype
from energyformer.utils.plugins import check_imports

__all__ = ["train", "TrainingDivergedError", "CheckpointWriteError", "peak_flops", "resolve_resumed_train",
           "train_on_hint"]

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
        ``final_train_loss``, ``tokens_per_s``, ``minutes`` and ``cpu_minutes`` (wall clock and this
        process's CPU time, over all segments of the run; ``cpu_minutes`` None when a segment's
        checkpoint predates it),
        ``params``, ``params_non_embedding``, ``mfu`` (from the measured training FLOPs per token
        of :func:`energyformer.models.flops.training_flops_per_token`; None when the peak FLOP/s
        is unknown), ``device``, ``world_size``, ``out_dir``.

    Raises:
        ValueError: invalid device; randomized depth or ``train.backprop_steps`` for a model
            without recurrent steps (:func:`energyformer.train.depth.check_supported`); data that
            cannot train this model (a split shorter than
            ``block_size + 1``, token ids beyond the vocabulary, a data vocabulary larger than
            ``model.vocab_size``); a model too large for the memory; an out_dir that is a file,
            not writable or in use by another training; a checkpoint of a different model or
            trained on different data; a corrupt checkpoint; a checkpoint without a train state
            to resume (the message gives the ``init_from`` command); an ``init_from`` run of
            another model or vocabulary.
        FileNotFoundError: missing data, ``resume`` naming a directory without a checkpoint,
            ``init_from`` naming a directory without a run config or weights.
        TrainingDivergedError: the loss or gradient norm became non-finite (found at the next
            ``log_interval``, evaluation or checkpoint, naming the first such step; the last good
            checkpoint in ``out_dir`` is left untouched), or the weights did before a checkpoint.
        CheckpointWriteError: a checkpoint could not be written (the last one is kept).
    """
    info = dist.init_distributed(run_cfg.train.device, run_cfg.train.parallel)
    clean = False
    try:
        out = _train(run_cfg, info, progress)
        clean = True
        return out
    finally:
        dist.shutdown(info, synchronize=clean)


def _train(run_cfg: RunConfig, info: dist.DistInfo, progress: bool | None) -> dict[str, Any]:
    t_start = (time.perf_counter(), time.process_time())  # wall clock; this process's CPU time
    out_dir = Path(run_cfg.train.out_dir)
    show = progress is not False and info.is_main
    say: Callable[[str], None] = tqdm.write if show else (lambda msg: None)
    data = _read_data(run_cfg, info)  # everything knowable, checked before anything is written
    with preflight.locked(out_dir, info):
        run_cfg, start = _choose_start(run_cfg, data, info, say)
        tc = run_cfg.train
        if info.is_main:
            preflight.warn_schedule(tc)
        amp = _set_up_process(tc, info.device)
        data_gen = torch.Generator().manual_seed(tc.seed)  # the one stream of training batches
        model = _build(run_cfg, start, info)
        with _out_of_memory(0, tc, Path(tc.out_dir)):  # one forward and backward of one sequence
            flops_per_token = training_flops_per_token(model)  # measured once, on the single-device model
        seed_ranks(tc.seed, info)
        wrapped, fwd = parallelize(model, info, activation_checkpointing=tc.activation_checkpointing,
                                   dtype=resolve_dtype(tc.dtype, info.device),
                                   use_compile=tc.compile if tc.compile is not None else info.device.type == "cuda",
                                   # truncated steps leave the embeddings of NRGPT / GPT_Rec without a gradient
                                   find_unused_parameters=tc.backprop_steps is not None)
        optimizer = build_optimizer(model, tc)  # after FSDP2 has sharded the parameters
        loop = _Loop(run_cfg, data, info, model, optimizer, data_gen, amp=amp, say=say, t_start=t_start,
                     wrapped=wrapped, fwd=fwd, flops_per_token=flops_per_token)
        if start.state is not None:
            loop.restore(start.state, ckpt.checkpoint_dir(start.resume_dir))
        elif info.is_main:  # a fresh run: stale checkpoint files must never be resumed or loaded
            ckpt.delete_checkpoint(out_dir)
        if loop.step >= tc.max_steps:
            kept = info.broadcast(preflight.summary_if_current(out_dir, loop.step) if info.is_main else None)
            if kept is not None:  # nothing to train: the run's summary and config stay as they are
                say(f"nothing to train: the run is at step {loop.step} of train.max_steps={tc.max_steps}")
                return {**kept, "steps_this_run": 0, "resumed_from": loop.step}
        if info.is_main:
            rundir.clear_summary(out_dir)  # unfinished from here until the new summary is written
            rundir.write_run_files(out_dir, run_cfg, data.meta, write_meta=start.state is None)
        info.barrier()
        loop.run(progress, resumed=start.state is not None)
        return loop.summary(resumed=start.state is not None)


@dataclasses.dataclass
class _Data:
    """The prepared data of a run, read and checked once."""

    path: Path
    meta: dict[str, Any]
    splits: dict[str, Any]
    identity: dict[str, Any]


@dataclasses.dataclass
class _Start:
    """Where a run starts: a checkpoint's train state to resume (and its directory), or the
    weights of another run to fine-tune (``init_dir``), or neither (a fresh run)."""

    state: dict[str, Any] | None = None
    resume_dir: Path | None = None
    init_dir: Path | None = None


def _read_data(run_cfg: RunConfig, info: dist.DistInfo) -> _Data:
    """Read and check the data, the memory and the out_dir before anything is written."""
    from energyformer.data import data_identity, load_meta, load_split

    tc, mc = run_cfg.train, run_cfg.model
    check_supported(mc, tc)
    out_dir = Path(tc.out_dir)
    if tc.resume == "auto" and ckpt.find_checkpoint(out_dir) is not None:
        preflight.require_train_state(out_dir)  # an import-hf run: say how to fine-tune it before the data is read
    data_dir = run_cfg.data.path
    meta = run_cfg.data_meta if run_cfg.data_meta is not None else load_meta(data_dir)  # read once per run
    if int(meta["vocab_size"]) > mc.vocab_size:
        raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the data vocabulary "
                         f"({meta['vocab_size']} in {data_dir / 'meta.json'}); drop model.vocab_size from "
                         "the config to read it from meta.json")
    splits = {name: load_split(data_dir, name, meta) for name in ("train", "val")}
    preflight.check_splits(splits, data_dir, int(meta["vocab_size"]), mc.block_size)
    preflight.check_memory(mc, info.device, info)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"train.out_dir={str(out_dir)!r} is a file; expected a run directory")
    return _Data(data_dir, meta, splits, data_identity(data_dir, meta))


def _choose_start(run_cfg: RunConfig, data: _Data, info: dist.DistInfo, say: Callable[[str], None]
                  ) -> tuple[RunConfig, _Start]:
    """Clean what an interrupted save left, then decide: resume (the run config a resumed run
    continues with, its train state), fine-tune from ``init_from``, or start fresh."""
    tc = run_cfg.train
    out_dir = Path(tc.out_dir)
    if info.is_main:
        removed = ckpt.clean_orphans(out_dir)
        if removed:
            say(f"removed what an interrupted save left in {out_dir}: {', '.join(removed)}")
    info.barrier()
    resume_dir = preflight.resume_dir(tc, out_dir)
    explicit = (run_cfg.explicit or {}).get("train")
    if resume_dir is not None:
        saved = preflight.check_resumable(resume_dir, run_cfg, data.identity, data.meta)
        tc = preflight.keep_init_from(saved.train, tc, resume_dir, explicit)
        chosen = None if run_cfg.overridden is None else run_cfg.overridden.get("train", frozenset())
        tc, notes = preflight.resolve_resumed_train(saved.train, tc, explicit, chosen)
        model, model_notes = preflight.resolve_resumed_model(saved.model, run_cfg.model)
        notes = "; ".join(n for n in (notes, model_notes) if n)
        state = ckpt.load_train_state(resume_dir)
        say(f"resuming from {resume_dir} at step {int(state['step'])}" + (f"; {notes}" if notes else ""))
        imports = check_imports(saved.imports, run_cfg.imports)  # the run's plugins stay recorded
        return (dataclasses.replace(run_cfg, model=model, train=tc, imports=imports),
                _Start(state=state, resume_dir=resume_dir))
    if tc.init_from is not None:
        init_dir = preflight.check_init_from(Path(tc.init_from), run_cfg, data.meta, out_dir)
        say(f"starting from the weights of {init_dir} ({ckpt.weights_path(init_dir)})")
        imports = check_imports(rundir.run_imports(init_dir), run_cfg.imports)  # its model needs its plugins
        return dataclasses.replace(run_cfg, imports=imports), _Start(init_dir=init_dir)
    return run_cfg, _Start()


def _set_up_process(tc: TrainConfig, device: torch.device) -> Any:
    """Threads, matmul precision (:func:`~energyformer.utils.device.configure_backends`: TF32 on
    CUDA, ``train.deterministic``), denormals and seeds; returns the autocast context of
    ``train.dtype`` (``auto``: bf16 on CUDA, fp32 elsewhere)."""
    if tc.num_threads is not None:
        torch.set_num_threads(tc.num_threads)
    configure_backends(device, deterministic=tc.deterministic)
    if device.type != "cuda":
        # Denormal floats from GELU/softmax tails made CPU steps up to ~10x slower mid-run.
        torch.set_flush_denormal(True)
    seed_everything(tc.seed)  # the same on every rank: identical initial weights
    return autocast_context(device, resolve_dtype(tc.dtype, device))


def seed_ranks(seed: int, info: dist.DistInfo) -> None:
    """After the model is built: seed the process-wide RNGs (dropout, ...) with ``seed + rank``
    under torchrun, so that no two ranks draw the same dropout masks; one process keeps its
    stream. The training batches come from their own generator (one seeded stream that the
    ranks share out, ``energyformer.data.BatchSampler``), which this does not touch."""
    if info.enabled:
        seed_everything(seed + info.rank)


def _build(run_cfg: RunConfig, start: _Start, info: dist.DistInfo) -> nn.Module:
    """The single-device model on its device, with the weights the run starts from."""
    device = info.device
    try:
        model = build_model(run_cfg.model).to(device)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise ValueError(f"the model does not fit into the memory of {device} ({type(e).__name__}); "
                         "reduce model.d_model, model.n_layers or model.vocab_size") from None
    if start.init_dir is not None:
        ckpt.load_checkpoint_weights(model, start.init_dir)
    if start.state is not None and not ckpt.is_sharded(start.state):  # shards load after parallelize
        metadata = load_weights(model, ckpt.checkpoint_dir(start.resume_dir) / rundir.WEIGHTS_FILE)
        ckpt.check_consistent(start.resume_dir, ckpt.find_checkpoint(start.resume_dir)
                              or {"step": start.state["step"]}, start.state, metadata)
    return model


class _Loop:
    """The state of one training call (model, optimizer, step, totals) and its steps, read in order:
    :meth:`restore`, :meth:`run` (:meth:`train_step`, :meth:`log`, :meth:`evaluate`, :meth:`save`),
    :meth:`summary`. ``wrapped`` and ``fwd`` come from :func:`~energyformer.train.parallelize.parallelize`;
    checkpoints are written from ``model``."""

    def __init__(self, run_cfg: RunConfig, data: _Data, info: dist.DistInfo, model: nn.Module,
                 optimizer: torch.optim.Optimizer, data_gen: torch.Generator, *, amp: Any,
                 say: Callable[[str], None], t_start: tuple[float, float], wrapped: nn.Module, fwd: nn.Module,
                 flops_per_token: float):
        from energyformer.data import BatchSampler

        self.run_cfg, self.tc, self.data, self.info = run_cfg, run_cfg.train, data, info
        self.model, self.optimizer, self.data_gen, self.amp, self.say = model, optimizer, data_gen, amp, say
        self.out_dir, self.device, self.t_start = Path(self.tc.out_dir), info.device, t_start
        self.sampler = BatchSampler(data.splits["train"], self.tc.batch_size, run_cfg.model.block_size, data_gen,
                                    rank=info.rank, world_size=info.world_size, device=info.device)
        self.n_params, self.n_params_ne = model.num_params(), model.num_params(non_embedding=True)
        self.step = self.start_step = 0
        self.best_val, self.train_loss, self.last_eval = math.inf, math.nan, {}
        self.totals = {"train_time_s": 0.0, "tokens": 0, "wall_s": 0.0, "cpu_s": 0.0}
        self.cpu_known = True
        self.wrapped, self.fwd, self.flops_per_token = wrapped, fwd, flops_per_token
        self.peak = peak_flops(info.device)
        self.pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [loss, grad norm]) not yet read
        self.tokens_per_step = (self.tc.batch_size * self.tc.grad_accum_steps * run_cfg.model.block_size
                                * info.world_size)
        self.depth = DepthSampler(self.tc)  # the recurrent steps of each optimizer step (train.depth_sampler)
        self.last_depth: int | None = None

    def restore(self, state: dict[str, Any], folder: Path) -> None:
        """Continue from a checkpoint's train state: optimizer, batch stream, RNG, step, totals;
        for a sharded checkpoint also the weights, from the DCP shards in ``folder`` (every
        rank, resharded to this run's layout: any number of ranks, DDP or one process).

        Each rank restores its own RNG states when the number of ranks is the one saved; with
        another number the ranks reseed with ``seed + step + rank`` (distinct dropout masks, not
        the saved stream)."""
        ckpt.restore_train_state(self.model, self.optimizer, self.data_gen, state, folder)
        self.depth.load_state(state.get("extra", {}))
        ranks = state.get("rng_ranks")
        if isinstance(ranks, list) and len(ranks) == self.info.world_size:
            set_rng_state(ranks[self.info.rank])
        else:
            seed_ranks(self.tc.seed + int(state["step"]), self.info)
        self.step = self.start_step = int(state["step"])
        self.best_val = math.inf if state["best_val_loss"] is None else float(state["best_val_loss"])
        self.totals.update({k: state["extra"][k] for k in self.totals if k in state.get("extra", {})})
        self.cpu_known = "cpu_s" in state.get("extra", {})  # a checkpoint older than cpu_minutes: unknown

    def run(self, progress: bool | None, resumed: bool) -> None:
        """Train until ``max_steps``: step, log (and evaluate), checkpoint; then restore the
        process-wide denormal setting."""
        tc, info = self.tc, self.info
        metrics = MetricsLogger(self.out_dir, keep_until_step=self.start_step if resumed else None,
                                **logger_options(self.run_cfg)) if info.is_main else None
        bar = tqdm(total=tc.max_steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True,
                   disable=True if not info.is_main else ((not progress) if progress is not None else None))
        interval = [0, 0.0]  # tokens, seconds since the last log line
        untimed, mark = 0, time.perf_counter()  # tokens of the steps since the last device read, and its time
        self.wrapped.train()
        stack = contextlib.ExitStack()
        # the splits' ids were checked when they were read (preflight): no host read per forward
        stack.enter_context(getattr(self.model, "ids_checked", contextlib.nullcontext)())
        try:
            while self.step < tc.max_steps:
                self.train_step()
                untimed += self.tokens_per_step
                self.totals["tokens"] += self.tokens_per_step
                do_eval = self.step % tc.eval_interval == 0 or self.step == tc.max_steps
                do_save = self.step % tc.ckpt_interval == 0 or self.step == tc.max_steps
                checked = self.step % tc.log_interval == 0 or do_eval or do_save
                if checked:  # the one host read of these steps: it waits for them, so it times them
                    lr, grad_norm = self.check_finite()
                    dt = time.perf_counter() - mark
                    self.totals["train_time_s"] += dt
                    interval = [interval[0] + untimed, interval[1] + dt]
                    untimed = 0
                if self.step % tc.log_interval == 0 or do_eval:
                    self.log(metrics, bar, progress, lr, grad_norm, interval[0] / max(interval[1], 1e-9), do_eval)
                    interval = [0, 0.0]
                if do_save:
                    # The step just taken can blow the weights up although this step's loss was finite.
                    if not dist.all_finite(self.model, info):
                        raise TrainingDivergedError(
                            f"parameters became non-finite at step {self.step} (lr {lr:.3g}); not saving a "
                            "checkpoint. " + _kept_msg(self.out_dir) + " Try a lower train.learning_rate or "
                            "train.grad_clip.")
                    self.save()
                if checked:  # evaluation and checkpoints are not training time
                    mark = time.perf_counter()
                bar.update(1)
        finally:
            stack.close()
            bar.close()
            if metrics is not None:
                metrics.close()
            if self.device.type != "cuda":
                torch.set_flush_denormal(False)  # process-wide setting: restore PyTorch's default

    def train_step(self) -> None:
        """One optimizer step of ``grad_accum_steps`` micro-batches, without reading the device: the
        step's loss and gradient norm stay on it (``self.pending``) until :meth:`check_finite`."""
        tc, info, step = self.tc, self.info, self.step
        lr = lr_at(step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        batches = self.sampler.next_step(tc.grad_accum_steps)
        self.last_depth = self.depth.draw()  # one depth per optimizer step, the same on every rank
        depth_kwargs = self.depth.forward_kwargs(self.last_depth)  # {} by default: the call as before
        for i, (x, y) in enumerate(batches):
            with dist.sync_gradients(self.wrapped, sync=i == len(batches) - 1), \
                    _out_of_memory(step, tc, self.out_dir):
                with self.amp:
                    _, loss = self.fwd(x, y, **depth_kwargs)
                (loss / tc.grad_accum_steps).backward()
            loss_sum += loss.detach().float()
        dist.reduce_replicated_grads(self.model, info)
        grad_norm = dist.clip_grad_norm(self.model, tc.grad_clip if tc.grad_clip > 0 else math.inf, info)
        self.pending.append((step + 1, lr, torch.stack([loss_sum / tc.grad_accum_steps,
                                                         grad_norm.detach().float().to(loss_sum.device)])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def check_finite(self) -> tuple[float, float]:
        """Read the losses and gradient norms of the steps since the last call (one host read,
        the loss averaged over ranks); returns ``(lr, grad_norm)`` of the last step and sets
        ``train_loss``. Called at every ``log_interval``, evaluation and checkpoint.

        Raises:
            TrainingDivergedError: a non-finite loss or gradient norm; the message names the first
                such step (nothing is logged or checkpointed after it).
        """
        steps = self.pending
        self.pending = []
        values = torch.stack([v for _, _, v in steps])
        losses = self.info.all_reduce_tensor(values[:, 0], "mean") if self.info.enabled else values[:, 0]
        rows = list(zip(losses.double().cpu().tolist(), values[:, 1].double().cpu().tolist()))
        for (step, lr, _), (loss, grad_norm) in zip(steps, rows):
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise TrainingDivergedError(_diverged_msg(step, loss, grad_norm, lr, self.out_dir))
        self.train_loss = rows[-1][0]
        return steps[-1][1], rows[-1][1]

    def log(self, metrics: MetricsLogger | None, bar: Any, progress: bool | None, lr: float, grad_norm: float,
            tok_s: float, do_eval: bool) -> None:
        """One log record (metrics.jsonl, the bar or a plain line), with an evaluation when ``do_eval``."""
        step, loss = self.step, self.train_loss
        record = {"step": step, "train_loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tok_s, "mfu": _mfu(self.flops_per_token, tok_s, self.peak)}
        if self.last_depth is not None:  # the depth drawn for this step (train.depth_sampler)
            record["depth"] = self.last_depth
        if self.info.enabled:  # compare counts the tokens of a run in progress from it
            record["world_size"] = self.info.world_size
        if do_eval:
            self.last_eval = ev = self.evaluate()
            if not math.isfinite(ev["val"]):
                raise TrainingDivergedError(f"validation loss is {ev['val']} at step {step}; not saving a "
                                            "checkpoint. " + _kept_msg(self.out_dir))
            self.best_val = min(self.best_val, ev["val"])
            record.update(val_loss=ev["val"], train_loss_eval=ev["train"], best_val_loss=self.best_val)
            self.say(f"step {step}: train loss {ev['train']:.4f}, val loss {ev['val']:.4f} "
                     f"(best {self.best_val:.4f})")
        if metrics is not None:
            metrics.log(record)
        if bar.disable and progress is None:  # no terminal: plain log lines instead of a bar
            self.say(f"step {step}/{self.tc.max_steps}: loss {loss:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s")
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")

    def evaluate(self) -> dict[str, float]:
        """Mean loss on ``eval_iters`` batches of each split (its own seeded batches, all ranks)."""
        from energyformer.data import get_batch

        tc, info, splits = self.tc, self.info, self.data.splits
        return estimate_loss(self.fwd, {"val": splits["val"], "train": splits["train"]}, eval_iters=tc.eval_iters,
                             batch_size=tc.batch_size, block_size=self.run_cfg.model.block_size, seed=tc.seed,
                             device=self.device, autocast=self.amp, get_batch=get_batch, rank=info.rank,
                             world_size=info.world_size, all_reduce=info.all_reduce if info.enabled else None)

    def save(self) -> None:
        """Write the checkpoint of this step: rank 0 writes it, under FSDP2 with
        ``train.fsdp_checkpoint: full`` after every rank gathered the state; with ``sharded``
        (the default) every rank writes its own shards and rank 0 commits (the last step adds
        the single-file export ``model.safetensors``).

        Raises:
            CheckpointWriteError: the checkpoint could not be written (the last one is kept).
        """
        info, step = self.info, self.step
        extra = {"train_loss": self.train_loss, **self.totals, **self._elapsed(), **self.depth.state()}
        common = dict(extra=extra, data=self.data.identity)
        try:
            if info.enabled and self.tc.parallel == "fsdp" and self.tc.fsdp_checkpoint == "sharded":
                final = step == self.tc.max_steps
                model_state = dist.full_model_state(self.model, info) if final else None  # the export
                ranks = info.all_gather(rng_state())
                ckpt.save_sharded_checkpoint(self.out_dir, self.model, self.optimizer, step, self.best_val,
                                             self.data_gen, rng_ranks=ranks, export=final, model_state=model_state,
                                             is_main=info.is_main, broadcast=info.broadcast, **common)
            else:
                model_state = dist.full_model_state(self.model, info)  # FSDP2: every rank gathers
                opt_state = ckpt.optimizer_state(self.model, self.optimizer) \
                    if (info.is_main or self.tc.parallel == "fsdp") else None
                ranks = info.all_gather(rng_state()) if info.enabled else None
                if info.is_main:
                    ckpt.save_checkpoint(self.out_dir, self.model, opt_state, step, self.best_val, self.data_gen,
                                         model_state=model_state, rng_ranks=ranks, **common)
        except OSError as e:
            raise CheckpointWriteError(
                e.errno, f"could not write the checkpoint of step {step} into {str(self.out_dir)!r}: "
                f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + ". "
                + _kept_msg(self.out_dir)) from None
        info.barrier()

    def _elapsed(self) -> dict[str, float]:
        """``wall_s`` and ``cpu_s`` over all segments of the run: wall-clock seconds, and the CPU
        seconds of this process (every thread; a pause or another job on the cores adds to the
        first, not to the second)."""
        wall0, cpu0 = self.t_start
        return {"wall_s": self.totals["wall_s"] + time.perf_counter() - wall0,
                "cpu_s": self.totals["cpu_s"] + time.process_time() - cpu0}

    def summary(self, resumed: bool) -> dict[str, Any]:
        """The run's summary (also ``summary.json``, written by rank 0); see :func:`train`."""
        if not self.last_eval:  # nothing trained in this call (already at max_steps): still report losses
            self.last_eval = self.evaluate()
            self.best_val = min(self.best_val, self.last_eval["val"])
        elapsed = self._elapsed()
        train_s = self.totals["train_time_s"]
        tokens_per_s = self.totals["tokens"] / train_s if train_s > 0 else None
        summary = {
            "steps": self.step,
            "steps_this_run": self.step - self.start_step,
            "resumed_from": self.start_step if resumed else None,
            "best_val_loss": self.best_val,
            "final_val_loss": self.last_eval["val"],
            "final_train_loss": self.last_eval["train"],
            "tokens_per_s": tokens_per_s,
            "mfu": None if tokens_per_s is None else _mfu(self.flops_per_token, tokens_per_s, self.peak),
            "minutes": elapsed["wall_s"] / 60,
            "cpu_minutes": elapsed["cpu_s"] / 60 if self.cpu_known else None,
            "params": self.n_params,
            "params_non_embedding": self.n_params_ne,
            "device": str(self.device),
            "world_size": self.info.world_size,
            "out_dir": str(self.out_dir),
        }
        if self.info.is_main:  # for `compare`-style tables across runs; metrics.jsonl keeps the full curve
            rundir.write_summary(self.out_dir, summary)
        return summary


# ------------------------------------------------------------------------------------------------
# throughput and messages
# ------------------------------------------------------------------------------------------------

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
