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

    Storage grows by doubling, so appending one position is amortised O(1) copies; ``update``
    returns views of the filled part. ``meta`` is free for the model to record what the cache
    was filled with (NRGPT records ``n_steps`` and ``stop_tol`` and refuses a mismatching reuse).

    Example::

        cache = KVCache()
        logits, _ = model(prompt, cache=cache)            # prefill: (B, N, V)
        logits, _ = model(next_ids, cache=cache)          # (B, 1, V), positions continue at N
    """

    def __init__(self) -> None:
        self._keys: list[torch.Tensor | None] = []
        self._values: list[torch.Tensor | None] = []
        self._lengths: list[int] = []
        self.meta: dict[str, Any] = {}

    def __len__(self) -> int:
        """Number of slots used so far."""
        return len(self._lengths)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached in slot ``layer_idx`` (0 for a slot never written)."""
        return self._lengths[layer_idx] if layer_idx < len(self._lengths) else 0

    @staticmethod
    def _grow(buf: torch.Tensor | None, new: torch.Tensor, length: int) -> torch.Tensor:
        need = length + new.shape[-2]
        if buf is None or buf.shape[:-2] != new.shape[:-2] or buf.shape[-1] != new.shape[-1] \
                or buf.dtype != new.dtype or buf.device != new.device:
            if buf is not None and length:
                raise ValueError(f"cache slot holds (B, H, e) = {tuple(buf.shape[:2]) + (buf.shape[-1],)}, "
                                 f"{buf.dtype}; cannot append {tuple(new.shape)}, {new.dtype}")
            buf = new.new_empty(*new.shape[:-2], max(need, 16), new.shape[-1])
        elif need > buf.shape[-2]:
            bigger = buf.new_empty(*buf.shape[:-2], max(need, 2 * buf.shape[-2]), buf.shape[-1])
            bigger[..., :length, :] = buf[..., :length, :]
            buf = bigger
        buf[..., length:need, :] = new
        return buf

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key`` and ``value`` ``(B, H, N, e)`` to slot ``layer_idx``; return the slot's
        ``(keys, values)``, ``(B, H, S, e)`` (views, valid until the next update of the slot).

        Raises:
            ValueError: a tensor that is not 4-D, keys and values of different ``(B, H, N)``, or a
                shape/dtype other than what the slot holds.
        """
        if key.dim() != 4 or value.dim() != 4 or key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key and value must be (B, H, N, e) with equal (B, H, N); got {tuple(key.shape)} "
                             f"and {tuple(value.shape)}")
        while len(self._lengths) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
            self._lengths.append(0)
        n = self._lengths[layer_idx]
        self._keys[layer_idx] = self._grow(self._keys[layer_idx], key, n)
        self._values[layer_idx] = self._grow(self._values[layer_idx], value, n)
        self._lengths[layer_idx] = s = n + key.shape[-2]
        return self._keys[layer_idx][..., :s, :], self._values[layer_idx][..., :s, :]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions of every slot (positions are not shifted)."""
        self._lengths = [min(n, max_length) for n in self._lengths]

    def reset(self) -> None:
        """Forget everything (the storage is dropped)."""
        self.__init__()


def cache_length(cache: Any) -> int:
    """Positions already in ``cache`` (slot 0), i.e. the position of the next token; 0 for ``None``."""
    return 0 if cache is None else int(cache.get_seq_length(0))
