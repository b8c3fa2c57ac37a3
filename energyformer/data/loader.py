"""Reading prepared datasets: ``meta.json``, uint16 / uint32 memmap splits and random training batches.

A prepared data directory holds ``train.bin`` and ``val.bin`` (raw little-endian token ids of
``meta["dtype"]``, uint16 or uint32, read as ``np.memmap``) and ``meta.json`` (read by :func:`energyformer.data.meta.load_meta`;
its fields are listed in :mod:`energyformer.data.prepare`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .._validate import check_choice, check_int
from .meta import SPLITS, load_meta, prepare_hint, token_dtype


def load_split(data_dir: str | Path, split: str, meta: dict | None = None) -> np.memmap:
    """Memory-map one split of a prepared dataset.

    Args:
        data_dir: the prepared directory (e.g. ``data/shakespeare_char``).
        split: ``"train"`` or ``"val"``.
        meta: the directory's meta.json, already read (:func:`load_meta`); ``None``: read it here.

    Returns:
        read-only ``np.memmap`` of dtype ``meta["dtype"]`` (uint16 or uint32) and shape
        (n_train,) or (n_val,).

    Raises:
        ValueError: ``split`` is not "train"/"val", an unknown ``dtype`` in meta.json, or the file
            size disagrees with meta.json (truncated or stale file; the message says to
            re-prepare with --force).
        FileNotFoundError: meta.json or the ``.bin`` file is missing.
    """
    check_choice("split", split, SPLITS)
    data_dir = Path(data_dir)
    meta = load_meta(data_dir) if meta is None else meta
    path = data_dir / f"{split}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; {prepare_hint(data_dir)}")
    n_tokens = int(meta[f"n_{split}"])
    dtype = token_dtype(meta)
    expected = n_tokens * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise ValueError(
            f"{path} has {size} bytes but meta.json says n_{split}={n_tokens} {dtype.name} tokens "
            f"({expected} bytes): the file is truncated or stale; re-prepare the dataset with --force")
    if n_tokens == 0:
        raise ValueError(f"{path} is empty (n_{split}=0); re-prepare the dataset")
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


def _check_batch_args(data, batch_size: int, block_size: int, generator) -> None:
    check_int("batch_size", batch_size, minimum=1)
    check_int("block_size", block_size, minimum=1)
    if not isinstance(data, np.ndarray) or data.ndim != 1:
        raise ValueError(f"data must be a 1-D numpy array of token ids; got {type(data).__name__} "
                         f"with shape {getattr(data, 'shape', None)}")
    if len(data) < block_size + 1:
        raise ValueError(f"the split has {len(data)} tokens but block_size={block_size} needs at least "
                         f"block_size + 1 = {block_size + 1}; use a smaller block_size or more text")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator; got {type(generator).__name__}")


def _offsets(n: int, batch_size: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    # Offsets i in [0, n - block_size - 1] so that y = data[i + 1 : i + block_size + 1] fits.
    return torch.randint(n - block_size, (batch_size,), generator=generator, device=generator.device)


def get_batch(data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a random language-modelling batch (nanoGPT ``get_batch``), reproducibly.

    Offsets are drawn uniformly from ``generator`` (so a training run can save
    ``generator.get_state()`` and resume with identical batches); the windows are gathered in
    one fancy-indexing read of the memmap. ``get_batch_reference`` is the plain loop version.

    Args:
        data: 1-D token array, e.g. from :func:`load_split`, length n >= block_size + 1.
        batch_size: B.
        block_size: N, the context length.
        generator: a CPU ``torch.Generator``.
        device: where the returned tensors go (pinned + non-blocking copy for CUDA).

    Returns:
        ``(x, y)``, int64 tensors of shape (B, N) with ``y[b, t] == x[b, t + 1]`` for t < N - 1
        and ``y[b, N - 1]`` the token after the window.

    Raises:
        ValueError: non-positive sizes, ``data`` not 1-D, a split shorter than block_size + 1, or
            ``generator`` not a ``torch.Generator``.
    """
    _check_batch_args(data, batch_size, block_size, generator)
    ix = _offsets(len(data), batch_size, block_size, generator).cpu().numpy()
    window = ix[:, None] + np.arange(block_size + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(data[window], dtype=np.int64))  # (B, N + 1)
    x, y = chunk[:, :-1], chunk[:, 1:]
    device = torch.device(device)
    if device.type == "cuda":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.contiguous().to(device), y.contiguous().to(device)


def get_batch_reference(data: np.ndarray, batch_size: int, block_size: int,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-row version of :func:`get_batch` (test reference; same draws, same output)."""
    _check_batch_args(data, batch_size, block_size, generator)
    ix = _offsets(len(data), batch_size, block_size, generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
    return x, y


class BatchSampler:
    """Training batches of one rank: a seeded, resumable stream shared by every rank.

    One ``torch.Generator`` draws, step after step, the offsets of ``world_size * accum``
    micro-batches (in the order of :func:`get_batch`); rank ``r`` keeps micro-batches
    ``r * accum ... r * accum + accum - 1``. Every rank advances the same generator, so its
    state (``generator.get_state()``, saved in a checkpoint) resumes every rank, and ``W``
    ranks with ``A`` accumulation steps see exactly the windows of one process with ``W·A``.
    With one rank it is :func:`get_batch` called ``accum`` times.

    Args:
        data: 1-D token array (see :func:`load_split`).
        batch_size: B per micro-batch.
        block_size: N.
        generator: the CPU generator of the stream (seeded by the caller).
        rank, world_size: this rank and the number of ranks.
        device: where the batches go.

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)``, or the checks of :func:`get_batch`.
    """

    def __init__(self, data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
                 rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu"):
        _check_batch_args(data, batch_size, block_size, generator)
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.generator, self.rank, self.world_size, self.device = generator, rank, world_size, device

    def next_step(self, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``accum`` micro-batches ``(x, y)``, each of shape (B, N), for the next step."""
        check_int("accum", accum, 1)
        mine = range(self.rank * accum, (self.rank + 1) * accum)
        out = []
        for j in range(self.world_size * accum):
            if j in mine:
                out.append(get_batch(self.data, self.batch_size, self.block_size, self.generator, self.device))
            else:  # another rank's micro-batch: advance the stream the same way
                _offsets(len(self.data), self.batch_size, self.block_size, self.generator)
        return out
