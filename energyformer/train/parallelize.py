"""Everything that turns a single-device model into the module that trains, in one place.

The models are plain single-device code; this module applies, in this order (torchtitan's
``parallelize``):

1. **activation checkpointing** (:func:`apply_activation_checkpointing`, ``train.activation_checkpointing``):
   the unit is a layer of GPT / Llama, one application of the shared block of NRGPT / GPT_Rec,
   and one descent step inside every CEM sub-block (a layer that checkpoints its own steps sets
   the class attribute ``checkpoint_steps``);
2. **data parallelism** under ``torchrun`` (:func:`apply_data_parallel`, ``train.parallel``):
   ``DistributedDataParallel`` or FSDP2's ``fully_shard`` per unit and on the root;
3. **compilation** (``train.compile``): ``torch.compile`` of the module that trains.

Weight names never change: checkpointing wraps a unit's ``forward`` in place (no wrapper module),
FSDP2 shards in place, and checkpoints are always written from the plain model (no ``module.``
or ``_orig_mod.`` prefix), so a checkpoint written before any of this resumes unchanged.
"""
from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from energyformer.train.distributed import DistInfo

__all__ = ["parallelize", "apply_activation_checkpointing", "apply_data_parallel", "shard_units",
           "mixed_precision_policy"]


def parallelize(model: nn.Module, info: DistInfo, *, activation_checkpointing: bool = False,
                use_compile: bool = False, dtype: str = "float32", find_unused_parameters: bool = False
                ) -> tuple[nn.Module, nn.Module]:
    """Apply checkpointing, DDP/FSDP2 and ``torch.compile`` to ``model``.

    ``dtype`` is the run's resolved ``train.dtype``: with ``"bfloat16"`` FSDP2 gathers the
    parameters in bf16 and reduces the gradients in fp32 (:func:`mixed_precision_policy`).
    ``find_unused_parameters``: DDP's option of that name, for steps in which some parameters
    get no gradient (truncated back-propagation, ``train.backprop_steps``).

    Returns:
        ``(wrapped, fwd)``: ``wrapped`` is the model under DDP (or ``model`` itself: one process or
        FSDP2, which changes ``model`` in place), for gradient synchronisation; ``fwd`` is what the
        training step calls (``wrapped`` compiled when ``use_compile``). Checkpoints save ``model``.
    """
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    wrapped = apply_data_parallel(model, info, dtype=dtype, find_unused_parameters=find_unused_parameters)
    fwd = torch.compile(wrapped) if use_compile else wrapped
    return wrapped, fwd


def shard_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """``(module, reused)`` pairs: the units that checkpointing and FSDP2 treat on their own.

    A model may define ``shard_units()`` returning its modules; otherwise every element of a
    top-level ``nn.ModuleList`` (GPT blocks, Llama/CEM layers) and a top-level ``block`` (the
    one block NRGPT and the recurrent GPT apply ``n_steps`` times; ``reused=True``).
    """
    if hasattr(model, "shard_units"):
        return [(m, False) for m in model.shard_units()]
    units = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            units.extend((m, False) for m in child)
        elif name == "block":
            units.append((child, True))
    return units


# ------------------------------------------------------------------------------------------------
# activation checkpointing
# ------------------------------------------------------------------------------------------------

def apply_activation_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Keep only each unit's input in the forward and recompute the rest in the backward.

    ``torch.utils.checkpoint`` (non-reentrant) around every unit of :func:`shard_units`; a unit
    holding layers that checkpoint their own descent steps (CEM sub-blocks: the class attribute
    ``checkpoint_steps``) gets those flags set instead. It applies in training with gradients
    only: not under ``no_grad``, in eval mode, with a cache argument or while tracing. The loss
    and gradients are unchanged (tests/train/test_activation_checkpointing.py); activation memory no longer grows
    with the number of steps, for about one extra forward of compute. ``enabled=False`` undoes
    it. Returns ``model``.
    """
    for unit, _ in shard_units(model):
        steppers = [m for m in unit.modules() if hasattr(type(m), "checkpoint_steps")]
        for m in steppers:
            m.checkpoint_steps = bool(enabled)
        if steppers:
            continue
        if enabled:
            unit.forward = types.MethodType(_checkpointed_forward, unit)
        elif "forward" in vars(unit):
            del unit.forward
    return model


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The unit's own ``forward``, under ``torch.utils.checkpoint`` when it trains with gradients
    on plain tensor/number arguments (a cache object or a trace means no checkpointing)."""
    fwd = functools.partial(type(self).forward, self)
    plain = all(a is None or isinstance(a, (torch.Tensor, int, float)) for a in (*args, *kwargs.values()))
    if plain and self.training and torch.is_grad_enabled() and getattr(self, "_trace", None) is None:
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)
    return fwd(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# data parallelism
# ------------------------------------------------------------------------------------------------

def mixed_precision_policy(dtype: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a run of ``dtype``: bf16 parameters in the forward and
    backward (the sharded master weights and the optimizer stay fp32) with fp32 gradient
    reduction, as torchtitan; the default policy (fp32 throughout) for ``"float32"``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_data_parallel(model: nn.Module, info: DistInfo, dtype: str = "float32",
                        find_unused_parameters: bool = False) -> nn.Module:
    """The model to train: ``model`` itself (one process), DDP around it, or it sharded by FSDP2.

    FSDP2 changes ``model`` in place (its parameters become DTensor shards, gathered in the
    precision of :func:`mixed_precision_policy`); the returned module is ``model``. A reused
    block is not resharded between its applications. FSDP2 cannot shard 0-d parameters (scalar
    step sizes, scales): they stay replicated (fp32) and their gradients are averaged in one
    all-reduce per step by :func:`~energyformer.train.distributed.reduce_replicated_grads`.
    """
    if not info.enabled:
        return model
    if info.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        scalars = {p for p in model.parameters() if p.dim() == 0}
        policy = mixed_precision_policy(dtype)
        for unit, reused in shard_units(model):
            fully_shard(unit, reshard_after_forward=not reused, ignored_params=scalars or None, mp_policy=policy)
        fully_shard(model, ignored_params=scalars or None, mp_policy=policy)
        # FSDP2 warns on every rank when a sharded module returns a view (our models' logits and
        # blocks' outputs can be reshapes): an in-place op on that view would skip its pre-backward
        # hook. Nothing here changes a model output in place (the loss is out of place; the
        # distributed tests hold the gradients equal to one process), so the warning does not
        # apply, and cloning the (B, N, V) logits to silence it would cost memory.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        model._replicated_params = [p for p in model.parameters() if p in scalars and p.requires_grad]
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                                   find_unused_parameters=find_unused_parameters)
