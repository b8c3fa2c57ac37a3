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
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.layers.norms import RMSNorm
from energyformer.layers.step_maps import StepMap
from energyformer.layers.trace import Trace, tracing


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

    def check_input(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Validate token ids ``(B, N)``.

        Raises:
            ValueError: wrong dtype or rank, ``N > block_size``, ``N == 0``, or an id outside
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
        if n > self.config.block_size:
            raise ValueError(
                f"sequence length {n} exceeds block_size={self.config.block_size}; "
                f"crop the input to the last {self.config.block_size} tokens")
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} is out of range; expected ids in [0, {self.config.vocab_size})")
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
                got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise ValueError(f"targets must be a torch.long tensor of token ids, got {got}")
            if targets.shape != idx.shape:
                raise ValueError(
                    f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            lo, hi = int(targets.min()), int(targets.max())
            if lo < -1 or hi >= self.config.vocab_size:
                bad = lo if lo < -1 else hi
                raise ValueError(f"target id {bad} is out of range; expected ids in [0, {self.config.vocab_size}) "
                                 "or -1 (ignored)")

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

    def trace(self) -> "contextlib.AbstractContextManager[Trace]":
        """Record energies during the forward calls inside ``with model.trace() as trace:``.

        The forward's return value does not change; ``trace`` (:class:`~energyformer.layers.trace.Trace`)
        holds per layer × sub-block × step × term × token energies and the states.

        Raises:
            ValueError: the model has no energy layers (GPT, Llama, recurrent GPT).
        """
        return tracing(self)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 vocab_limit: int | None = None, **forward_kwargs: Any) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` ``(B, N)``; returns ``(B, N + max_new_tokens)``.

        The context is cropped to the last ``block_size`` tokens. ``temperature=0`` is greedy
        decoding. ``vocab_limit=V'`` samples only ids ``< V'`` (a model whose ``vocab_size`` was
        padded past its tokenizer's). Extra keyword arguments go to ``forward`` (e.g.
        ``n_steps`` for NRGPT).

        Raises:
            ValueError: negative ``max_new_tokens`` or ``temperature``, ``top_k < 1``, bad ``idx``,
                ``vocab_limit`` outside ``[1, vocab_size]``, non-finite logits (diverged weights).
        """
        check_int("max_new_tokens", max_new_tokens, 0)
        check_float("temperature", temperature, 0.0)
        if top_k is not None:
            check_int("top_k", top_k, 1)
        if vocab_limit is not None:
            check_int("vocab_limit", vocab_limit, 1, self.config.vocab_size)
        self.check_input(idx[:, -self.config.block_size:] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else idx)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                idx_cond = idx[:, -self.config.block_size:]
                logits, _ = self(idx_cond, **forward_kwargs)
                logits = logits[:, -1, :].float()
                if vocab_limit is not None:
                    logits[:, vocab_limit:] = float("-inf")
                if not torch.isfinite(logits[:, : vocab_limit or logits.size(-1)]).all():
                    raise ValueError("the model produced non-finite logits (NaN/Inf): its weights have diverged")
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    nxt = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat((idx, nxt.to(idx.dtype)), dim=1)
        finally:
            self.train(was_training)
        return idx


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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``.

        Raises:
            ValueError: bad ids, shape or length (``check_input``).
        """
        self.check_input(idx, targets)
        x = getattr(self, self.embed_name)(idx)
        for layer in getattr(self, self.layers_name):
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

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """``x⁰ = E_tok[idx] + E_pos[0:N]``: ``(B, N) -> (B, N, d)``."""
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
