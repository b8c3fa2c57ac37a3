"""The key/value cache of cached decoding (docs/architecture.md §5).

Every attention call of a model has one *slot* of the cache, numbered ``layer_idx``: a layer of
GPT and Llama, the attention sub-block of a CEM layer (the MLP is per token and needs nothing),
a recurrent step of NRGPT and the recurrent GPTs (their keys depend on the state at that step).
A slot holds ``key`` and ``value`` tensors of shape ``(B, H, S, e)`` that grow along ``S``, the
positions seen so far.

The protocol is the one of Hugging Face's ``transformers.Cache`` (``DynamicCache``), so either
object can be passed as ``cache=`` to a model's forward:

* ``update(key, value, layer_idx) -> (keys, values)`` appends ``(B, H, N, e)`` tensors to the
  slot and returns everything it holds, ``(B, H, S, e)``;
* ``get_seq_length(layer_idx=0) -> int`` is the number of positions cached in the slot.

A model may store a zero-width value tensor ``(B, H, N, 0)`` when its values are its keys (CEM's
tied attention, NRGPT): the keys are not stored twice.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVCache", "cache_length"]


class KVCache:
    """A growing per-slot key/value cache (``transformers.DynamicCache``'s protocol).

    ``update`` concatenates along the position axis and returns contiguous tensors (attention
    kernels are much slower on strided views of a preallocated buffer). ``meta`` is free for the
    model to record what the cache was filled with (NRGPT records ``n_steps`` and ``stop_tol`` and
    refuses a mismatching reuse).

    Example::

        cache = KVCache()
        logits, _ = model(prompt, cache=cache)            # prefill: (B, N, V)
        logits, _ = model(next_ids, cache=cache)          # (B, 1, V), positions continue at N
    """

    #: what ``transformers.GenerationMixin`` asks of a cache: a growing cache is not compilable
    #: (no fixed shapes) and no slot is a linear-attention state
    is_compileable = False

    def __init__(self) -> None:
        self._keys: list[torch.Tensor | None] = []
        self._values: list[torch.Tensor | None] = []
        self.meta: dict[str, Any] = {}

    @property
    def is_linear(self) -> list[bool]:
        """One ``False`` per slot (``transformers`` protocol: no slot holds a recurrent state)."""
        return [False] * max(1, len(self._keys))

    def __len__(self) -> int:
        """Number of slots used so far."""
        return len(self._keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached in slot ``layer_idx`` (0 for a slot never written)."""
        k = self._keys[layer_idx] if layer_idx < len(self._keys) else None
        return 0 if k is None else k.shape[-2]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key`` and ``value`` ``(B, H, N, e)`` to slot ``layer_idx``; return the slot's
        ``(keys, values)``, ``(B, H, S, e)``.

        Raises:
            ValueError: a tensor that is not 4-D, keys and values of different ``(B, H, N)``, or a
                shape/dtype other than what the slot holds.
        """
        if key.dim() != 4 or value.dim() != 4 or key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key and value must be (B, H, N, e) with equal (B, H, N); got {tuple(key.shape)} "
                             f"and {tuple(value.shape)}")
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
        old_k, old_v = self._keys[layer_idx], self._values[layer_idx]
        if old_k is None:
            self._keys[layer_idx], self._values[layer_idx] = key.contiguous(), value.contiguous()
        else:
            for old, new in ((old_k, key), (old_v, value)):
                if old.shape[:2] != new.shape[:2] or old.shape[-1] != new.shape[-1] or old.dtype != new.dtype:
                    raise ValueError(f"cache slot {layer_idx} holds (B, H, e) = "
                                     f"{tuple(old.shape[:2]) + (old.shape[-1],)}, {old.dtype}; cannot append "
                                     f"{tuple(new.shape)}, {new.dtype}")
            self._keys[layer_idx] = torch.cat((old_k, key), dim=-2)
            self._values[layer_idx] = torch.cat((old_v, value), dim=-2)
        return self._keys[layer_idx], self._values[layer_idx]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions of every slot (positions are not shifted)."""
        self._keys = [None if k is None else k[..., :max_length, :].contiguous() for k in self._keys]
        self._values = [None if v is None else v[..., :max_length, :].contiguous() for v in self._values]

    def reset(self) -> None:
        """Forget everything."""
        self.__init__()


def cache_length(cache: Any) -> int:
    """Positions already in ``cache`` (slot 0), i.e. the position of the next token; 0 for ``None``."""
    return 0 if cache is None else int(cache.get_seq_length(0))
