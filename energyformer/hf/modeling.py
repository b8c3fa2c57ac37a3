"""``transformers`` causal-LM classes around the energyformer models (docs/architecture.md §1, floor 6).

One :class:`EnergyformerForCausalLM` subclass per family (``EnergyformerNRGPTForCausalLM`` ...),
a :class:`~transformers.PreTrainedModel` + :class:`~transformers.GenerationMixin` whose
``model`` attribute is the energyformer model itself (weight names ``model.<our name>``), so
``from_pretrained`` / ``save_pretrained`` / ``generate`` work and the logits are ours exactly.

What the wrapper adds to the plain model:

- ``attention_mask``: padded batches (left or right). Our models have no padding mask, so each
  row's unmasked tokens are run as their own sequence (rows of equal length together) and
  their logits scattered back; masked positions get logits 0. A padded row thus gives exactly
  the logits of the unpadded sequence.
- ``labels``: the Hugging Face loss (labels shifted inside, ``-100`` ignored).
- ``generate``: decodes with our own KV cache (:class:`~energyformer.layers.kv_cache.KVCache`,
  docs/architecture.md §5) by default, with the same rule as our ``generate`` past
  ``block_size`` (the cache restarts on the last ``block_size − block_size // 4`` tokens), so
  greedy decoding equals ``model.generate(..., temperature=0)`` of the energyformer model.
  A padded batch (an ``attention_mask`` with zeros) and ``use_cache=False`` recompute the last
  ``block_size`` tokens each step instead (our models have no padding mask). A prompt longer
  than ``block_size`` is kept whole in the output and its last ``block_size`` tokens are the
  context (with a ``UserWarning``), as in ``energyformer sample`` and our ``generate``.
- the tied LM head is declared (``_tied_weights_keys``), so ``model.safetensors`` stores it once.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from energyformer.hf.configuration import CONFIG_CLASSES, EnergyformerConfig, config_class, family_class
from energyformer.models.registry import build_model, inference_options

#: keyword arguments of our models' forward that ``forward`` / ``generate`` pass through
MODEL_KWARGS = ("n_steps", "stop_tol", "exit", "accept_lower_energy")


class EnergyformerPreTrainedModel(PreTrainedModel):
    """Base: our modules initialise themselves, so Hugging Face's weight init is a no-op."""

    config_class = EnergyformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass


class EnergyformerForCausalLM(EnergyformerPreTrainedModel, GenerationMixin):
    """An energyformer model as a Hugging Face causal LM; use the per-family subclasses.

    ``forward(input_ids (B, N), attention_mask (B, N) = None, labels (B, N) = None, n_steps=None,
    stop_tol=None)`` → :class:`~transformers.modeling_outputs.CausalLMOutputWithPast` with
    ``logits (B, N, V)`` (float32 as computed) and ``loss``.
    """

    def __init__(self, config: EnergyformerConfig):
        super().__init__(config)
        self.model = build_model(config.model_config())
        # a tied LM head is one Parameter under two names: declare it so it is saved once
        params = dict(self.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        tied = {}
        for name, p in params.items():
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
        self._tied_weights_keys = tied
        self._model_kwargs = set(inference_options(config.model_config().arch)) & set(MODEL_KWARGS)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate gets our own KVCache (see _prepare_cache_for_generation), not a DynamicCache

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict[str, Any],
                                      *args: Any, **kwargs: Any) -> None:
        """Put a fresh energyformer ``KVCache`` into ``model_kwargs["cache"]`` unless the caller gave a
        cache, turned caching off, or padded the batch (rows of different lengths recompute)."""
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            return
        model_kwargs["cache"] = self.model.new_cache()

    def get_input_embeddings(self) -> torch.nn.Module:
        # Llama-style models name theirs by their class's embed_name (CEM: "embed"); GPT-style: wte
        for name in (getattr(self.model, "embed_name", None), "wte", "embed_tokens"):
            if name and isinstance(getattr(self.model, name, None), torch.nn.Embedding):
                return getattr(self.model, name)
        raise AttributeError(f"{type(self.model).__name__} has no token embedding")

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                return_dict: bool | None = None, n_steps: int | None = None, stop_tol: float | None = None,
                exit: str | None = None, accept_lower_energy: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits ``(B, N, V)`` of ``input_ids (B, N)``; see the class docstring.

        Raises:
            ValueError: ``inputs_embeds`` (not supported), a model keyword the family does not
                take (``n_steps`` for GPT), or bad ids / a sequence longer than ``block_size``
                (the model's own check, naming the value).
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported by energyformer models; pass input_ids")
        if input_ids is None:
            raise ValueError("input_ids is required (B, N) token ids")
        model_kwargs = {k: v for k, v in {"n_steps": n_steps, "stop_tol": stop_tol, "exit": exit,
                                          "accept_lower_energy": accept_lower_energy or None}.items() if v is not None}
        unknown = set(model_kwargs) - self._model_kwargs
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not options of the {self.config.model_config().arch!r} "
                             f"forward; it takes {sorted(self._model_kwargs) or 'none'}")
        cache = kwargs.get("cache")
        if cache is not None:  # the new tokens after the cached ones; a padding mask cannot apply here
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("a cache cannot be used with a padded batch (attention_mask has zeros); "
                                 "pass use_cache=False or prompts of one length")
            logits = self.model(input_ids, cache=cache, **model_kwargs)[0]
            self._log_exit_steps()
            return CausalLMOutputWithPast(logits=logits, cache=cache)
        logits = self._logits(input_ids, attention_mask, model_kwargs)
        self._log_exit_steps()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    _exit_log: list | None = None

    def _log_exit_steps(self) -> None:
        """Inside :meth:`generate`: keep the steps the newest position got (``exit``, ``stop_tol``)."""
        steps = getattr(self.model, "exit_steps", None)
        if self._exit_log is not None and steps is not None:
            self._exit_log.append(steps[:, -1])

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                model_kwargs: dict[str, Any]) -> torch.Tensor:
        if attention_mask is None or bool(attention_mask.bool().all()):
            return self.model(input_ids, **model_kwargs)[0]
        keep = attention_mask.bool().to(input_ids.device)
        lengths = keep.sum(dim=1)
        logits = steps = None
        for n in lengths.unique().tolist():
            if n == 0:
                continue
            rows = (lengths == n).nonzero().squeeze(1)
            ids = input_ids[rows][keep[rows]].view(len(rows), n)
            out = self.model(ids, **model_kwargs)[0]
            if logits is None:
                logits = out.new_zeros(*input_ids.shape, out.size(-1))
            block = logits[rows]
            block[keep[rows]] = out.reshape(-1, out.size(-1))
            logits[rows] = block
            used = getattr(self.model, "exit_steps", None)  # the exit's steps, scattered as the logits
            if used is not None:
                steps = input_ids.new_zeros(input_ids.shape) if steps is None else steps
                part = steps[rows]
                part[keep[rows]] = used.reshape(-1)
                steps[rows] = part
        if logits is None:
            raise ValueError("attention_mask masks every token of every row; nothing to run")
        if steps is not None:  # padded positions: 0 steps
            self.model.exit_steps = steps
        return logits

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      cache: Any = None, n_steps: int | None = None, stop_tol: float | None = None,
                                      exit: str | None = None, accept_lower_energy: bool | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """With a cache: the prompt (its last ``block_size`` tokens) first, then the newest token; when
        the cache is full, a fresh cache on the last ``block_size − block_size // 4`` tokens (the rule
        of energyformer's own ``generate``). Without: the last ``block_size`` tokens."""
        block = self.config.max_position_embeddings
        inputs: dict[str, Any] = {}
        if cache is None:
            inputs["input_ids"] = input_ids[:, -block:]
            if attention_mask is not None:
                inputs["attention_mask"] = attention_mask[:, -block:]
        else:
            seen = cache.get_seq_length(0)
            if seen == 0:
                ids = input_ids[:, -block:]
            elif seen >= block:
                cache, ids = self.model.new_cache(), input_ids[:, -max(1, block - max(1, block // 4)):]
            else:
                ids = input_ids[:, -1:]
            inputs.update(input_ids=ids, cache=cache)
        inputs.update({k: v for k, v in {"n_steps": n_steps, "stop_tol": stop_tol, "exit": exit,
                                         "accept_lower_energy": accept_lower_energy}.items() if v is not None})
        return inputs

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any):
        """:meth:`transformers.GenerationMixin.generate`, after checking the prompt fits the context.

        ``n_steps`` (NRGPT, recurrent GPT, CEM: steps at inference), ``stop_tol`` (NRGPT only),
        ``exit`` (``"kl:1e-3"`` ...: per-token adaptive exit, NRGPT and the recurrent GPTs) and
        ``accept_lower_energy`` (energy-safe steps, NRGPT and CEM; docs/inference_compute.md) pass
        through to every forward; with ``exit`` the steps of each generated token are in
        ``self.model.generated_exit_steps`` ``(B, L)`` afterwards.
        Beam search (``num_beams > 1``) recomputes the last ``block_size`` tokens
        each step (``use_cache=False``): our KV cache cannot be reordered across beams.

        A prompt longer than ``block_size`` is kept whole in the output, and its last
        ``block_size`` tokens are the context (``prepare_inputs_for_generation`` crops each
        step's input), with a ``UserWarning`` naming both lengths: what ``energyformer sample``
        and our own ``generate`` do.
        """
        import warnings

        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            mask = kwargs.get("attention_mask")
            n, block = (int(mask.sum(dim=1).max()) if isinstance(mask, torch.Tensor) else ids.shape[1],
                        self.config.max_position_embeddings)
            if n > block:
                warnings.warn(f"the prompt has {n} tokens, more than the model's block_size={block}: only its "
                              f"last {block} tokens are the context (the output keeps the whole prompt)",
                              UserWarning, stacklevel=2)
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
            kwargs["use_cache"] = False  # beams reorder the cache; ours cannot be reordered: recompute
        self._exit_log = []
        try:
            out = super().generate(inputs, *args, **kwargs)
        finally:
            log, self._exit_log = self._exit_log, None
        self.model.generated_exit_steps = torch.stack(log, dim=1) if log else None
        return out


def _family(arch: str) -> type[EnergyformerForCausalLM]:
    return family_class(EnergyformerForCausalLM, arch, "ForCausalLM", __name__, {"config_class": config_class(arch)})


#: arch name -> causal-LM class (an arch a plugin registers later gets its class from :func:`model_class`)
MODEL_CLASSES: dict[str, type[EnergyformerForCausalLM]] = {arch: _family(arch) for arch in CONFIG_CLASSES}


def model_class(arch: str) -> type[EnergyformerForCausalLM]:
    """The causal-LM class of the language model ``arch``, made on first use for an arch registered after
    this module was imported (a plugin's).

    Raises:
        ValueError: ``arch`` is not a registered language model.
    """
    cls = MODEL_CLASSES.get(arch)
    if cls is None:
        cfg_cls = config_class(arch)  # raises for an unknown arch
        cls = MODEL_CLASSES[arch] = _family(arch)
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)  # from_pretrained in this process
        AutoModelForCausalLM.register(cfg_cls, cls, exist_ok=True)
    return cls
