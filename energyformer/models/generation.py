"""Text generation shared by every language model: ``model.generate(...)`` (docs/architecture.md §5).

:class:`GenerationMixin` needs of its model only ``config.vocab_size``, ``config.block_size``,
``check_input``, ``new_cache`` and a ``forward(idx, cache=...) -> (logits, loss)``; sampling
itself (temperature, top-k/p, min-p, repetition penalty) is :mod:`energyformer.models.sampling`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from energyformer._validate import check_int
from energyformer.layers.kv_cache import cache_length
from energyformer.models.config import INFERENCE_OPTIONS, forward_options
from energyformer.models.sampling import check_sampling, select_next

__all__ = ["GenerationMixin"]


class GenerationMixin:
    """``generate``: sampling with or without a key/value cache, batched by prompt length."""

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
            forward_kwargs: passed to ``forward`` (e.g. ``n_steps``, ``stop_tol`` for NRGPT; ``exit``
                and ``accept_lower_energy``, docs/inference_compute.md). With ``exit`` (or ``stop_tol``)
                the steps each generated token got are kept in ``model.generated_exit_steps``: a
                ``(B, L)`` int64 tensor for a tensor ``idx``, one 1-D tensor per prompt for a list.

        Returns:
            for a tensor ``idx``: ``(B, N + L)``, ``L ≤ max_new_tokens`` (fewer only when every row
            stopped); a row that stopped earlier is filled with its last token. For a list: one
            1-D tensor per prompt, ending at its stop.

        Raises:
            ValueError: negative ``max_new_tokens``, invalid sampling options (see
                :func:`~energyformer.models.sampling.check_sampling`), bad ``idx``, ``vocab_limit``
                outside ``[1, vocab_size]``, non-finite logits (diverged weights), an inference option
                the model's forward does not take (``stop_tol`` for CEM; :func:`forward_options`).
        """
        refused = [k for k in INFERENCE_OPTIONS if k in forward_kwargs and k not in forward_options(type(self))]
        if refused:
            raise ValueError(f"{refused[0]} is not an option of the {self.config.arch!r} model's forward; it takes "
                             f"{list(forward_options(type(self))) or 'none of them'}")
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
        self.generated_exit_steps = None
        try:  # the prompts' ids are checked here, once; the decoding loop's forwards skip it
            if isinstance(idx, torch.Tensor):
                self.check_input(idx[:, -self.config.block_size:] if idx.dim() == 2 else idx)
                with self.ids_checked():
                    seqs, _, steps = self._generate_rows(idx, max_new_tokens, **opts)
                self.generated_exit_steps = steps
                return seqs
            return self._generate_list(idx, max_new_tokens, opts)
        finally:
            self.train(was_training)

    def supports_cached_energy(self) -> bool:
        """Whether this model's energy options (an exit criterion that reads energies,
        ``accept_lower_energy``) work in KV-cached decoding: true unless one of its layers says
        otherwise through a ``cached_energy`` attribute (a CEM attention whose interaction has no
        energy of a cached context; docs/inference_compute.md §4). ``sample`` decodes without the
        cache when it is false."""
        return all(getattr(m, "cached_energy", True) for m in self.modules() if m is not self)

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
        steps_out: list[torch.Tensor | None] = [None] * len(rows)
        for n in sorted({len(r) for r in rows}):
            members = [i for i, r in enumerate(rows) if len(r) == n]
            with self.ids_checked():
                seqs, n_new, steps = self._generate_rows(torch.stack([rows[i] for i in members]), max_new_tokens,
                                                         **opts)
            for j, i in enumerate(members):
                out[i] = seqs[j, : n + int(n_new[j])]
                if steps is not None:
                    steps_out[i] = steps[j, : int(n_new[j])]
        if any(s is not None for s in steps_out):
            self.generated_exit_steps = steps_out
        return out  # type: ignore[return-value]

    def _generate_rows(self, idx: torch.Tensor, max_new_tokens: int, *, temperature, top_k, top_p, min_p,
                       repetition_penalty, generator, vocab_limit, stop_set, stop, use_cache,
                       forward_kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode a batch of equal-length prompts; returns ``(sequences (B, N + L), new tokens per row (B,),
        the steps each new token got (B, L) or None)`` (the steps when the forward sets ``exit_steps``).

        No host read per token (unless ``stop``/``stop_ids`` ask for one): whether the logits stayed
        finite is accumulated on the device and read once at the end.

        Raises:
            ValueError: non-finite logits among the allowed ids at some step (diverged weights).
        """
        block = self.config.block_size
        keep = max(1, block - max(1, block // 4))  # context kept when the cache restarts past block_size
        b, n0 = idx.shape
        n_new = torch.zeros(b, dtype=torch.long, device=idx.device)
        done = torch.zeros(b, dtype=torch.bool, device=idx.device)
        finite = torch.ones((), dtype=torch.bool, device=idx.device)
        cache, seq = None, idx
        steps: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(seq[:, -block:], **forward_kwargs)
            elif cache is None or cache_length(cache) >= block:
                cache = self.new_cache()  # first call, or full: restart on the last tokens
                logits, _ = self(seq[:, -(block if seq.shape[1] == n0 else keep):], cache=cache, **forward_kwargs)
            else:
                logits, _ = self(seq[:, -1:], cache=cache, **forward_kwargs)
            used = getattr(self, "exit_steps", None)
            if used is not None:
                steps.append(used[:, -1])
            last = logits[:, -1, :].float()
            ok = torch.isfinite(last[:, : vocab_limit or last.size(-1)]).all()
            finite &= ok
            last = torch.where(ok, last, torch.zeros_like(last))  # keeps sampling defined; raised below
            nxt = select_next(last, seq, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, repetition_penalty=repetition_penalty, vocab_limit=vocab_limit,
                              generator=generator, check_finite=False).to(idx.dtype)
            nxt = torch.where(done[:, None], seq[:, -1:], nxt)  # a stopped row repeats its last token
            seq = torch.cat((seq, nxt), dim=1)
            n_new += (~done).long()
            if (stop_set is not None or stop is not None) and self._stop_rows(nxt, seq[:, n0:], done, stop_set, stop):
                break
        if not bool(finite):
            raise ValueError("the model produced non-finite logits (NaN/Inf): its weights have diverged")
        return seq, n_new, (torch.stack(steps, dim=1) if steps and len(steps) == seq.shape[1] - n0 else None)

    @staticmethod
    def _stop_rows(nxt: torch.Tensor, generated: torch.Tensor, done: torch.Tensor, stop_set: set[int] | None,
                   stop: Callable[[list[int]], bool] | None) -> bool:
        """Mark in ``done`` the rows whose new token ``nxt`` (B, 1) or text ends them; whether all are done."""
        for i, (tok, was_done) in enumerate(zip(nxt[:, 0].tolist(), done.tolist())):
            if was_done:
                continue
            if (stop_set is not None and tok in stop_set) or (stop is not None and stop(generated[i].tolist())):
                done[i] = True
        return bool(done.all())
