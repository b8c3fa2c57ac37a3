"""FLOPs of a training step, measured from what the model really runs (for MFU and benchmarks).

:func:`training_flops_per_token` runs one forward and backward pass of a model on a ``(1, N)``
batch under PyTorch's own :class:`torch.utils.flop_counter.FlopCounterMode` and divides by
``N``. Counting what is executed means a recurrent model (NRGPT, GPT_Rec, CEM with ``T > 1``)
is charged for every step it takes, and an energy model for its analytic-gradient matmuls, which
a parameter-count rule such as ``6·params`` gets wrong (a shared block is used ``T`` times).

Attention is counted as PyTorch counts ``scaled_dot_product_attention``: ``4·N·d_h`` FLOPs per
query and head for the scores and the weighted sum (the full ``N × N`` product, not the causal
half, as in nanoGPT's ``12·L·d·N`` term) and 2.5 times that for the backward (it recomputes the
scores), so ``14·N·d`` per layer and token in training. PyTorch 2.13 has no
formula for the CPU flash-attention kernels, so they are registered here with the same formulas
as the CUDA ones. Element-wise work (norms, activations, softmax) is not counted.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils import flop_counter as _fc

from energyformer._validate import check_int

__all__ = ["training_flops_per_token"]


def _register_cpu_sdpa() -> None:
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in _fc.flop_registry:
        @_fc.register_flop_formula(fwd)
        def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return _fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    if bwd is not None and bwd not in _fc.flop_registry:
        @_fc.register_flop_formula(bwd)
        def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                               **kwargs) -> int:
            return _fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_sdpa()


def training_flops_per_token(model: nn.Module, seq_len: int | None = None) -> float:
    """Measured FLOPs of one forward + backward pass per token, ``float``.

    Runs the model once on random ids of shape ``(1, seq_len)`` (default ``config.block_size``)
    in training mode, with gradients, then clears the gradients it made and leaves the global RNG
    (and that of the model's CUDA device) as it found it. Call it before training starts (it
    costs one step); the training loop calls it once per run, for the MFU it logs.

    Raises:
        ValueError: ``seq_len`` not in ``[1, block_size]``.
    """
    cfg = model.config
    n = cfg.block_size if seq_len is None else check_int("seq_len", seq_len, 1, cfg.block_size)
    device = next(model.parameters()).device
    idx = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    counter = _fc.FlopCounterMode(display=False)
    was_training = model.training
    model.train()
    try:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), counter:  # dropout draws must not move the training RNG
            _, loss = model(idx, idx)
            loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return counter.get_total_flops() / n
