"""What every language model in energyformer shares.

A model is a ``CausalLM``: it owns a dataclass ``config`` with at least ``vocab_size`` and
``block_size``, maps token ids ``(B, N)`` (int64) to logits ``(B, N, V)`` and returns
``(logits, loss)`` from ``forward(idx, targets=None)``. Input validation, the loss and
sampling live here once so that every architecture behaves the same on bad input.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.layers.kv_cache import KVCache, cache_length
from energyformer.layers.norms import RMSNorm
from energyformer.layers.step_maps import StepMap
from energyformer.layers.trace import Trace, tracing
from energyformer.models.sampling import check_sampling, select_next


@dataclass
class ModelConfig:
    """Fields every model config has. Subclasses add their own and call ``super().__post_init__()``.

    ``arch`` names the registry entry (see ``energyformer.models.registry``).
    """

    arch: ClassVar[str] = ""
    #: old key -> new key, for recipes written before a rename; see :meth:`upgrade_dict`.
    renamed_keys: ClassVar[dict[str, str]] = {}
    vocab_size: int = 65
    block_size: int = 256

    #: int fields that must be >= 1, checked here for every config (subclasses list their own)
    positive_ints: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, 1)
        check_int("block_size", self.block_size, 1)
        for name in self.positive_ints:
            check_int(name, getattr(self, name), 1)
        for f in fields(self):  # every bool field holds a bool (YAML "yes" or 1 is refused by name)
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} must be true or false")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with ``arch`` first: what recipes and checkpoints store."""
        return {"arch": self.arch, **asdict(self)}

    @classmethod
    def upgrade_dict(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``d`` with renamed keys (:attr:`renamed_keys`) under their new names.

        Each old key found emits a ``FutureWarning`` naming both spellings.

        Raises:
            ValueError: ``d`` holds both the old and the new spelling of one key.
        """
        d = dict(d)
        for old, new in cls.renamed_keys.items():
            if old in d:
                if new in d:
                    raise ValueError(f"model.{old} and model.{new} are the same option (model.{old} is its "
                                     f"old name); give only model.{new}")
                warnings.warn(f"model.{old} is deprecated for arch {cls.arch!r}; use model.{new} "
                              f"(same values)", FutureWarning, stacklevel=2)
                d[new] = d.pop(old)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict (old key spellings upgraded), raising ``ValueError`` for unknown keys."""
        d = cls.upgrade_dict(d)
        arch = d.pop("arch", cls.arch)
        if arch != cls.arch:
            raise ValueError(f"model.arch={arch!r} does not match {cls.__name__} (arch {cls.arch!r})")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown model config key(s) {unknown} for arch {cls.arch!r}; "
                f"expected some of {sorted(names)}")
        return cls(**d)


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


@dataclass
class GPTShapeConfig(ModelConfig):
    """Fields shared by GPT and the recurrent GPT baselines. ``d_ff`` defaults to ``4·d_model``;
    ``activation`` is ``"relu"`` (the NRGPT reference code) or ``"gelu"`` (GPT-2)."""

    d_model: int = 128
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    activation: str = "relu"
    bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("d_model", self.d_model, 1)
        check_int("n_heads", self.n_heads, 1)
        check_divides("n_heads", self.n_heads, "d_model", self.d_model)
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        check_int("d_ff", self.d_ff, 1)
        check_float("dropout", self.dropout, 0.0, maximum=0.999)
        check_choice("activation", self.activation, ("relu", "gelu"))


def default_d_ff(d_model: int, multiple_of: int = 32) -> int:
    """Llama's SwiGLU width rule: ``8·d/3`` rounded up to a multiple of ``multiple_of`` (128 → 352)."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass
class LlamaShapeConfig(ModelConfig):
    """Shape fields shared by Llama and CEM-Llama (which is compared against it layer by layer).

    ``head_dim`` defaults to ``d_model // n_heads`` (then ``n_heads`` must divide ``d_model``)
    and ``d_ff`` to :func:`default_d_ff`; ``resolved_*`` give the values in use.
    """

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    d_ff: int | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("d_model", self.d_model, 1)
        check_int("n_layers", self.n_layers, 1)
        check_int("n_heads", self.n_heads, 1)
        if self.head_dim is None:
            check_divides("n_heads", self.n_heads, "d_model", self.d_model)
        else:
            check_int("head_dim", self.head_dim, 1)
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, 1)
        check_float("norm_eps", self.norm_eps, 0.0, strict=True)
        check_float("init_std", self.init_std, 0.0, strict=True)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        return self.d_ff if self.d_ff is not None else default_d_ff(self.d_model)


class CausalLM(nn.Module):
    """Base class for all language models: validation, loss, parameter counts, ``generate``.

    Subclasses implement ``forward(idx, targets=None, **kw) -> (logits, loss)`` and call
    ``self.check_input(idx)`` first and ``self.lm_loss(logits, targets)`` last.
    """

    config: ModelConfig

    def check_input(self, idx: torch.Tensor, targets: torch.Tensor | None = None, offset: int = 0) -> None:
        """Validate token ids ``(B, N)`` (that follow ``offset`` cached positions).

        Under ``torch.compile`` only the static checks run (type, rank, length): the id-range checks
        read the ids on the host, which would break the graph; the training loop validates ids
        when it reads the data, and eager calls check them here.

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
        if torch.compiler.is_compiling():
            # The value checks below read the ids on the host (a graph break under torch.compile);
            # a compiled training step gets ids the loop validated when it read the data.
            return
        self._check_values(idx, targets)

    def _check_values(self, idx: torch.Tensor, targets: torch.Tensor | None) -> None:
        """The id-range checks of :meth:`check_input` (host reads; eager mode only)."""
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} is out of range; expected ids in [0, {self.config.vocab_size})")
        if targets is not None:
            lo, hi = int(targets.min()), int(targets.max())
            if lo < -1 or hi >= self.config.vocab_size:
                bad = lo if lo < -1 else hi
                raise ValueError(f"target id {bad} is out of range; expected ids in [0, {self.config.vocab_size}) "
                                 "or -1 (ignored)")
            if hi == -1:  # the mean over no targets is NaN: say so instead
                raise ValueError(f"every target is -1 (ignored) in targets of shape {tuple(targets.shape)}; "
                                 "the loss needs at least one target id in [0, vocab_size)")

    @staticmethod
    def lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Mean next-token cross-entropy over all positions (targets ``-1`` are ignored)."""
        if targets is None:
            return None
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)

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
        import re

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

    #: recompute activations in the backward pass (see :meth:`set_activation_checkpointing`)
    activation_checkpointing: bool = False

    def set_activation_checkpointing(self, enabled: bool = True) -> "CausalLM":
        """Keep only each unit's input in the forward and recompute the rest in the backward
        (``torch.utils.checkpoint``, non-reentrant): a layer of GPT / Llama, a recurrent step of
        NRGPT / GPT_Rec, a descent step inside every CEM sub-block. Applies in training with
        gradients only (not under ``no_grad``, with a cache, or while tracing). Returns ``self``.

        Trade: about one extra forward of compute for activation memory that no longer grows with
        the number of steps (tests/test_checkpointing.py measures the saved tensors).
        """
        self.activation_checkpointing = bool(enabled)
        for m in self.modules():
            if hasattr(type(m), "checkpoint_steps"):
                m.checkpoint_steps = bool(enabled)
        return self

    def run_unit(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, checkpointed when :attr:`activation_checkpointing` is on and gradients flow."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def trace(self) -> "contextlib.AbstractContextManager[Trace]":
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

    @torch.no_grad()
    def generate(self, idx: torch.Tensor | Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None,
                 vocab_limit: int | None = None, *, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, stop_ids: Sequence[int] | None = None,
                 stop: Callable[[list[int]], bool] | None = None, use_cache: bool = True,
                 **forward_kwargs: Any) -> torch.Tensor | list[torch.Tensor]:
        """Sample up to ``max_new_tokens`` tokens after each prompt (docs/architecture.md §5).

        Args:
            idx: prompts of equal length ``(B, N)``, or a list of prompts of any lengths (lists of
                ids or 1-D tensors). Prompts of equal length are batched together, each group with
                its own cache and no padding, so every row sees exactly its own positions.
            max_new_tokens: tokens to add (≥ 0).
            temperature: ``0`` is greedy decoding; any ``T > 0`` samples from ``softmax(logits/T)``
                (tiny ``T`` gives the greedy token, never NaN).
            top_k, top_p, min_p, repetition_penalty: filters and penalty in the order of
                :mod:`energyformer.models.sampling` (``None`` = off).
            generator: the ``torch.Generator`` that makes sampling reproducible.
            vocab_limit: sample only ids ``< vocab_limit`` (a vocabulary padded past its tokenizer's).
            stop_ids: a row stops after emitting one of these ids.
            stop: ``stop(generated_ids) -> bool`` called per row after each token (e.g. stop strings).
            use_cache: decode with a key/value cache (default). Past ``block_size`` the cached path
                restarts its cache on the last ``block_size − block_size // 4`` tokens (so its context
                is then 3/4 to all of ``block_size``); ``use_cache=False`` recomputes the last
                ``block_size`` tokens for every token (the classic sliding window). Under
                ``model.trace()`` the cache is not used (tracing records whole sequences).
            forward_kwargs: passed to ``forward`` (e.g. ``n_steps``, ``stop_tol`` for NRGPT).

        Returns:
            for a tensor ``idx``: ``(B, N + L)``, ``L ≤ max_new_tokens`` (fewer only when every row
            stopped); a row that stopped earlier is filled with its last token. For a list: one
            1-D tensor per prompt, ending at its stop.

        Raises:
            ValueError: negative ``max_new_tokens``, invalid sampling options (see
                :func:`~energyformer.models.sampling.check_sampling`), bad ``idx``, ``vocab_limit``
                outside ``[1, vocab_size]``, non-finite logits (diverged weights).
        """
        check_int("max_new_tokens", max_new_tokens, 0)
        check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
        if vocab_limit is not None:
            check_int("vocab_limit", vocab_limit, 1, self.config.vocab_size)
        stop_set = None if stop_ids is None else {check_int("stop_ids entry", int(i), 0) for i in stop_ids}
        opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, generator=generator, vocab_limit=vocab_limit,
                    stop_set=stop_set, stop=stop, use_cache=use_cache and not self._tracing(),
                    forward_kwargs=forward_kwargs)
        was_training = self.training
        self.eval()
        try:
            if isinstance(idx, torch.Tensor):
                self.check_input(idx[:, -self.config.block_size:] if idx.dim() == 2 else idx)
                return self._generate_rows(idx, max_new_tokens, **opts)[0]
            return self._generate_list(idx, max_new_tokens, opts)
        finally:
            self.train(was_training)

    def _generate_list(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
                       opts: dict[str, Any]) -> list[torch.Tensor]:
        """Prompts of any lengths: one batched run per length; each result cut after its stop."""
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise ValueError("idx must be a (B, N) tensor or a non-empty list of prompts (lists of token ids)")
        device = next(self.parameters()).device
        rows = [torch.as_tensor(p, dtype=torch.long, device=device) for p in prompts]
        for i, r in enumerate(rows):
            if r.dim() != 1:
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got shape {tuple(r.shape)}")
            self.check_input(r[None, -self.config.block_size:])
        out: list[torch.Tensor | None] = [None] * len(rows)
        for n in sorted({len(r) for r in rows}):
            members = [i for i, r in enumerate(rows) if len(r) == n]
            seqs, n_new = self._generate_rows(torch.stack([rows[i] for i in members]), max_new_tokens, **opts)
            for j, i in enumerate(members):
                out[i] = seqs[j, : n + int(n_new[j])]
        return out  # type: ignore[return-value]

    def _generate_rows(self, idx: torch.Tensor, max_new_tokens: int, *, temperature, top_k, top_p, min_p,
                       repetition_penalty, generator, vocab_limit, stop_set, stop, use_cache,
                       forward_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a batch of equal-length prompts; returns ``(sequences (B, N + L), new tokens per row (B,))``."""
        block = self.config.block_size
        keep = max(1, block - max(1, block // 4))  # context kept when the cache restarts past block_size
        b, n0 = idx.shape
        n_new = torch.zeros(b, dtype=torch.long, device=idx.device)
        done = torch.zeros(b, dtype=torch.bool, device=idx.device)
        cache, seq = None, idx
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(seq[:, -block:], **forward_kwargs)
            elif cache is None or cache_length(cache) >= block:
                cache = self.new_cache()  # first call, or full: restart on the last tokens
                logits, _ = self(seq[:, -(block if seq.shape[1] == n0 else keep):], cache=cache, **forward_kwargs)
            else:
                logits, _ = self(seq[:, -1:], cache=cache, **forward_kwargs)
            nxt = select_next(logits[:, -1, :], seq, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, repetition_penalty=repetition_penalty, vocab_limit=vocab_limit,
                              generator=generator).to(idx.dtype)
            nxt = torch.where(done[:, None], seq[:, -1:], nxt)  # a stopped row repeats its last token
            seq = torch.cat((seq, nxt), dim=1)
            n_new += (~done).long()
            if stop_set is not None or stop is not None:
                for i in range(b):
                    if done[i]:
                        continue
                    tok = int(nxt[i])
                    if (stop_set is not None and tok in stop_set) or \
                            (stop is not None and stop(seq[i, n0:].tolist())):
                        done[i] = True
                if bool(done.all()):
                    break
        return seq, n_new

class LlamaStyleLM(CausalLM):
    """Token embedding → ``n_layers`` blocks → final RMSNorm → LM head (no biases): Llama and CEM-Llama.

    Subclasses set :attr:`embed_name` / :attr:`layers_name` (the attribute names of the embedding
    and the block list, which fix the weight names) and implement :meth:`make_layer`. Every
    matrix starts at ``N(0, init_std²)`` (step maps keep their own init, see :func:`init_weights`);
    ``tie_embeddings`` makes the LM head the embedding matrix (one Parameter).
    """

    embed_name: ClassVar[str] = "embed_tokens"
    layers_name: ClassVar[str] = "layers"
    #: activation checkpointing wraps whole layers (False: the layers checkpoint their own steps)
    checkpoint_layers: ClassVar[bool] = True

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
        offset = cache_length(cache)
        self.check_input(idx, targets, offset)
        x = getattr(self, self.embed_name)(idx)
        for i, layer in enumerate(getattr(self, self.layers_name)):
            if cache is not None:
                x = layer(x, cache, i, offset)
            elif self.checkpoint_layers:
                x = self.run_unit(layer, x)
            else:  # the layer checkpoints its own steps (CEM)
                x = layer(x)
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
