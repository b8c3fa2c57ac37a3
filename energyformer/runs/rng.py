"""RNG states of torch (CPU, CUDA), numpy and python as tensors and primitive containers,
so that a train state holding them loads with ``torch.load(weights_only=True)``."""
from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Torch (CPU and, once initialized, CUDA), numpy and python RNG states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states(list(state["cuda"]))


_warned_cuda: list[bool] = []


def set_cuda_rng_states(states: list[torch.Tensor]) -> int:
    """Restore the CUDA RNG state of device ``i`` from ``states[i]`` for every device that exists
    here; returns how many were restored.

    A checkpoint written where more GPUs were visible (a resume under a per-rank
    ``CUDA_VISIBLE_DEVICES``, or on a smaller machine) restores the devices that exist and warns
    once per process that the others' states were dropped (the CPU, numpy and python states and
    the batch stream are restored in full; docs/gpu.md).
    """
    count = torch.cuda.device_count()
    for i, s in enumerate(states[:count]):
        torch.cuda.set_rng_state(s, i)
    if len(states) > count and not _warned_cuda:
        _warned_cuda.append(True)
        warnings.warn(f"the checkpoint holds the CUDA RNG states of {len(states)} devices but {count} are "
                      f"visible; restored devices 0..{count - 1}, the rest are dropped", stacklevel=2)
    return min(len(states), count)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x
