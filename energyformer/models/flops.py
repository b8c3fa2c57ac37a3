"""FLOPs of a training step, measured from what the model really runs (for MFU and benchmarks).

:func:`training_flops_per_token` runs one forward and backward pass of a model on a ``(1, N)``
batch under PyTorch's :class:`torch.utils.flop_counter.FlopCounterMode` (with the attention
formulas below, :func:`flop_counter`) and divides by ``N``. Counting what is executed means a
recurrent model (NRGPT, GPT_Rec, CEM with ``T > 1``) is charged for every step it takes, and an
energy model for its analytic-gradient matmuls, which a parameter-count rule such as ``6·params``
gets wrong (a shared block is used ``T`` times).

**Causal attention convention** (one rule for the training loop's MFU, ``train/metrics.py``, and
every benchmark; docs/gpu.md, "MFU"): an attention is charged for the query–key pairs its mask
lets through, i.e. ``N(N+1)/2`` pairs for a causal ``N × N`` attention (the strict mask of NRGPT,
run as the shifted ``N−1`` stream, ``N(N−1)/2``), not the full ``N × N`` a kernel may touch.
Per pair and head: ``4·d_h`` FLOPs forward (scores and weighted sum, a multiply and an add each)
and 2.5 times that backward (PyTorch's SDPA formulas, which recompute the scores), so a causal
layer costs ``14·d·(N+1)/2`` per token in training. Every energy attention is counted on its
SDPA form (``force_attention_path("sdpa")`` while counting), so the model's FLOPs do not depend
on which path (SDPA or materialized scores, chosen by device and width) runs it. An SDPA call
with an explicit mask (cached decoding only) is charged the full product. Element-wise work
(norms, activations, softmax) is not counted.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils import flop_counter as _fc

from energyformer._validate import check_int
from energyformer.energies.heads import force_attention_path

__all__ = ["training_flops_per_token", "flop_counter", "causal_pairs"]


def causal_pairs(n_query: int, n_key: int) -> int:
    """Query–key pairs of a causal attention whose ``n_query`` queries are the last of ``n_key``
    positions (query ``i`` sees keys ``j ≤ n_key − n_query + i``): ``n(n+1)/2`` when square.

    Raises:
        ValueError: ``n_query > n_key`` or a size < 1.
    """
    check_int("n_query", n_query, 1)
    check_int("n_key", n_key, n_query)
    offset = n_key - n_query
    return n_query * offset + n_query * (n_query + 1) // 2


def _causal_formula(op: Any, full: Any, shapes_at: tuple[int, int]) -> Any:
    """A flop formula of ``op`` that charges ``full``'s count for the causal pairs only when the
    call has ``is_causal=True`` (the query and key shapes are arguments ``shapes_at``)."""
    names = [a.name for a in op._schema.arguments]
    causal_at = names.index("is_causal")

    def formula(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        count = full(*args, out_shape=out_shape, **kwargs)
        is_causal = kwargs["is_causal"] if "is_causal" in kwargs else (
            args[causal_at] if len(args) > causal_at else False)
        if not is_causal:
            return count
        n_q, n_k = args[shapes_at[0]][-2], args[shapes_at[1]][-2]
        return count * causal_pairs(n_q, n_k) // (n_q * n_k)

    return formula


def _attention_formulas() -> dict[Any, Any]:
    """The causal-aware formulas of every SDPA kernel op (CUDA flash, memory-efficient, cuDNN and
    the CPU flash kernel, which PyTorch has no formula for)."""
    aten = torch.ops.aten
    fwd = lambda q, k, v, *a, out_shape=None, **kw: _fc.sdpa_flop_count(q, k, v)  # noqa: E731
    bwd = lambda go, q, k, v, *a, out_shape=None, **kw: _fc.sdpa_backward_flop_count(go, q, k, v)  # noqa: E731
    table = {}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        for op_name, full, at in ((name, fwd, (0, 1)), (name + "_backward", bwd, (1, 2))):
            packet = getattr(aten, op_name, None)
            if packet is not None:
                table[packet] = _causal_formula(packet.default, full, at)
    return table


def flop_counter() -> _fc.FlopCounterMode:
    """A :class:`~torch.utils.flop_counter.FlopCounterMode` (no display) that counts attention by
    this module's causal convention; the benchmarks count with it too."""
    return _fc.FlopCounterMode(display=False, custom_mapping=_attention_formulas())


def training_flops_per_token(model: nn.Module, seq_len: int | None = None) -> float:
    """Measured FLOPs of one forward + backward pass per token, ``float``, causal attention
    counted by the module's convention (``N(N+1)/2`` pairs).

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
    counter = flop_counter()
    was_training = model.training
    model.train()
    try:
        devices = [device] if device.type == "cuda" else []
        # dropout draws must not move the training RNG; every energy attention counted on its SDPA form
        with torch.random.fork_rng(devices=devices), force_attention_path("sdpa"), counter:
            _, loss = model(idx, idx)
            loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return counter.get_total_flops() / n
