"""What every language model in energyformer shares, read top to bottom.

:func:`init_weights`; :class:`CausalLM`, the base of every model: it owns a dataclass ``config``
(:mod:`energyformer.models.config`) with at least ``vocab_size`` and ``block_size``, maps token
ids ``(B, N)`` (int64) to logits ``(B, N, V)`` and returns ``(logits, loss)`` from
``forward(idx, targets=None)``; input validation, the loss, parameter counts, the weight names
of earlier versions, tracing, the cache and ``generate`` (:mod:`energyformer.models.generation`)
live there once so that every architecture behaves the same on bad input. Then the two model
skeletons: :class:`LlamaStyleLM` (Llama, CEM-Llama) and :class:`LearnedPositionLM` (GPT, the
recurrent GPTs, NRGPT).

The models are single-device code: activation checkpointing, DDP/FSDP and compilation are
applied by :mod:`energyformer.train.parallelize`.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer.layers.kv_cache import KVCache, cache_length
from energyformer.layers.norms import RMSNorm
from energyformer.layers.step_maps import StepMap
from energyformer.layers.trace import Trace, tracing
from energyformer.models.config import LlamaShapeConfig, ModelConfig
from energyformer.models.generation import GenerationMixin


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Every ``nn.Linear`` / ``nn.Embedding`` weight ``N(0, std²)`` and every Linear bias 0.

    Step maps (:mod:`energyformer.layers.step_maps`) keep their own init (e.g. ``P = s·I``): their
    sub-modules are skipped and their ``reset_parameters`` is called instead.
    """
    maps = [m for m in model.modules() if isinstance(m, StepMap)]
    inside = {id(sub) for m in maps for sub in m.modules()}
    for m in model.modules():
        if id(m) in inside or not isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        nn.init.normal_(m.weight, mean=0.0, std=std)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    for m in maps:
        m.reset_parameters()


class CausalLM(GenerationMixin, nn.Module):
    """Base class for all language models: validation, loss, parameter counts, ``generate``.

    Subclasses implement ``forward(idx, targets=None, **kw) -> (logits, loss)`` and call
    ``self.check_input(idx)`` first and ``self.lm_loss(logits, targets)`` last.
    """

    config: ModelConfig

    def check_input(self, idx: torch.Tensor, targets: torch.Tensor | None = None, offset: int = 0) -> None:
        """Validate token ids ``(B, N)`` (that follow ``offset`` cached positions).

        Under ``torch.compile`` and :meth:`ids_checked` only the static checks run (type, rank,
        length): the id-range checks read the ids on the host (a graph break, a device sync); the
        training loop validates ids when it reads the data and ``generate`` at its entry, and other
        eager calls check them here, in one host read.

        Raises:
            ValueError: wrong dtype or rank, ``offset + N > block_size``, ``N == 0``, or an id outside
                ``[0, vocab_size)``; each message names the value and what was expected.
        """
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype not in (torch.int64, torch.int32):  # what nn.Embedding accepts
            raise ValueError(f"idx must hold integer token ids of dtype torch.long (or torch.int32), "
                             f"got dtype {idx.dtype}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, N), got shape {tuple(idx.shape)}")
        n = idx.shape[1]
        if n == 0:
            raise ValueError("idx has sequence length 0; expected at least 1 token")
        if offset and offset + n > self.config.block_size:
            raise ValueError(
                f"sequence length {offset + n} ({offset} cached + {n} new) exceeds block_size="
                f"{self.config.block_size}; start a new cache on the last {self.config.block_size} tokens "
                "(generate() does this, docs/architecture.md §5)")
        if n > self.config.block_size:
            raise ValueError(
                f"sequence length {n} exceeds block_size={self.config.block_size}; "
                f"crop the input to the last {self.config.block_size} tokens")
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
                got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise ValueError(f"targets must be a torch.long tensor of token ids, got {got}")
            if targets.shape != idx.shape:
                raise ValueError(
                    f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        if torch.compiler.is_compiling() or self._ids_checked:
            # The value checks below read the ids on the host (a graph break under torch.compile, a
            # device sync on a GPU); a training step and generate() get ids checked once before.
            return
        self._check_values(idx, targets)

    _ids_checked: bool = False

    @contextlib.contextmanager
    def ids_checked(self):
        """Inside ``with model.ids_checked():`` forward calls skip the id-range checks (one host
        read each): for callers that checked the ids already, where they entered (the training
        loop checks the data splits when it reads them, ``generate`` its prompts)."""
        before = self._ids_checked
        self._ids_checked = True
        try:
            yield self
        finally:
            self._ids_checked = before

    def _check_values(self, idx: torch.Tensor, targets: torch.Tensor | None) -> None:
        """The id-range checks of :meth:`check_input`: one host read for ids and targets together."""
        if not idx.numel():
            return
        extremes = [idx.min(), idx.max()]
        if targets is not None:
            extremes += [targets.min(), targets.max()]
        lo, hi, *target_range = torch.stack([e.long() for e in extremes]).tolist()
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is out of range; expected ids in [0, {self.config.vocab_size})")
        if targets is not None:
            lo, hi = target_range
            if lo < -1 or hi >= self.config.vocab_size:
                bad = lo if lo < -1 else hi
                raise ValueError(f"target id {bad} is out of range; expected ids in [0, {self.config.vocab_size}) "
                                 "or -1 (ignored)")
            if hi == -1:  # the mean over no targets is NaN: say so instead
                raise ValueError(f"every target is -1 (ignored) in targets of shape {tuple(targets.shape)}; "
                                 "the loss needs at least one target id in [0, vocab_size)")

    @staticmethod
    def lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Mean next-token cross-entropy over all positions (targets ``-1`` are ignored).

        Computed in float32 for narrower logits (bf16/fp16) and in the logits' own dtype when it
        is wider (a float64 model gets a float64 loss).
        """
        if targets is None:
            return None
        if logits.dtype != torch.float64:
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared tensors counted once).

        ``non_embedding=True`` subtracts the token (and learned position) embedding tables,
        following nanoGPT's convention; subclasses list them in ``embedding_params()``.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.embedding_params())
        return n

    def embedding_params(self) -> list[nn.Parameter]:
        """Embedding tables excluded from the non-embedding count (override per model)."""
        return []

    #: ``(old regex, new template)`` weight-name renames of earlier versions, applied by
    #: :meth:`upgrade_state_dict` (e.g. version 0.1 names before the option registries)
    legacy_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def upgrade_state_dict(self, tensors: dict[str, torch.Tensor],
                           expected: Any = None) -> dict[str, torch.Tensor]:
        """``tensors`` with the weight names of earlier versions renamed to today's.

        Only names absent from ``expected`` (default: this model's ``state_dict`` keys) are
        renamed, and only to names in it, so a current file is returned unchanged.
        """
        expected = set(self.state_dict() if expected is None else expected)
        out = {}
        for name, t in tensors.items():
            if name not in expected:
                for old, new in self.legacy_renames:
                    cand = re.sub(old, new, name)
                    if cand != name and cand in expected:
                        name = cand
                        break
            out[name] = t
        return out

    def trace(self) -> contextlib.AbstractContextManager[Trace]:
        """Record energies during the forward calls inside ``with model.trace() as trace:``.

        The forward's return value does not change; ``trace`` (:class:`~energyformer.layers.trace.Trace`)
        holds per layer × sub-block × step × term × token energies and the states.

        Raises:
            ValueError: the model has no energy layers (GPT, Llama, recurrent GPT).
        """
        return tracing(self)

    def new_cache(self) -> KVCache:
        """An empty key/value cache for ``forward(..., cache=...)`` (docs/architecture.md §5)."""
        return KVCache()

    def _tracing(self) -> bool:
        return any(getattr(m, "_trace", None) is not None for m in self.modules())


class LlamaStyleLM(CausalLM):
    """Token embedding → ``n_layers`` blocks → final RMSNorm → LM head (no biases): Llama and CEM-Llama.

    Subclasses set :attr:`embed_name` / :attr:`layers_name` (the attribute names of the embedding
    and the block list, which fix the weight names) and implement :meth:`make_layer`. Every
    matrix starts at ``N(0, init_std²)`` (step maps keep their own init, see :func:`init_weights`);
    ``tie_embeddings`` makes the LM head the embedding matrix (one Parameter).
    """

    embed_name: ClassVar[str] = "embed_tokens"
    layers_name: ClassVar[str] = "layers"

    def __init__(self, config: LlamaShapeConfig):
        super().__init__()
        self.config = c = config
        setattr(self, self.embed_name, nn.Embedding(c.vocab_size, c.d_model))
        setattr(self, self.layers_name, nn.ModuleList(self.make_layer(c) for _ in range(c.n_layers)))
        self.norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        init_weights(self, c.init_std)
        if c.tie_embeddings:
            self.lm_head.weight = getattr(self, self.embed_name).weight

    def make_layer(self, config: LlamaShapeConfig) -> nn.Module:  # pragma: no cover - abstract
        """One block ``(B, N, d) -> (B, N, d)``."""
        raise NotImplementedError

    def embedding_params(self) -> list[nn.Parameter]:
        return [getattr(self, self.embed_name).weight]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache=None):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``.

        ``cache`` (docs/architecture.md §5): a :class:`~energyformer.layers.kv_cache.KVCache` or a
        ``transformers`` ``Cache``; ``idx`` then follows the cached positions, slot ``i`` is layer
        ``i``, and the cache is updated in place.

        Raises:
            ValueError: bad ids, shape or length (``check_input``).
        """
        return self.run_layers(idx, targets, cache)

    def run_layers(self, idx: torch.Tensor, targets: torch.Tensor | None, cache, **layer_kwargs: Any):
        """The body of :meth:`forward`: embed, every layer (called with ``layer_kwargs`` too, e.g.
        CEM's ``n_steps``), the final norm and head, the loss."""
        offset = cache_length(cache)
        self.check_input(idx, targets, offset)
        x = getattr(self, self.embed_name)(idx)
        for i, layer in enumerate(getattr(self, self.layers_name)):
            x = layer(x, **layer_kwargs) if cache is None else layer(x, cache, i, offset, **layer_kwargs)
        logits = self.lm_head(self.norm(x))
        return logits, self.lm_loss(logits, targets)


class LearnedPositionLM(CausalLM):
    """Shared by GPT, the recurrent GPTs and NRGPT: token plus learned absolute position embeddings
    (``wte``, ``wpe``), both excluded from the non-embedding parameter count."""

    def make_embeddings(self, config: ModelConfig, d_model: int) -> None:
        """Create ``wte`` (V, d) and ``wpe`` (block_size, d)."""
        self.wte = nn.Embedding(config.vocab_size, d_model)
        self.wpe = nn.Embedding(config.block_size, d_model)

    def embedding_params(self) -> list[nn.Parameter]:
        return [self.wte.weight, self.wpe.weight]

    def embed(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x⁰ = E_tok[idx] + E_pos[offset : offset+N]``: ``(B, N) -> (B, N, d)`` (``offset``: cached positions)."""
        return self.wte(idx) + self.wpe(torch.arange(offset, offset + idx.shape[1], device=idx.device))
