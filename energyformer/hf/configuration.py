"""``transformers`` configs of the energyformer model families (docs/architecture.md §1, floor 6).

One :class:`EnergyformerConfig` subclass per family, ``model_type`` ``energyformer_<arch>``
(``energyformer_gpt``, ``energyformer_llama``, ``energyformer_cem``, ``energyformer_nrgpt``,
``energyformer_gpt_rec``). The config holds the model config of :mod:`energyformer.models` as
one dict (``energyformer``, the same dict a run's ``config.yaml`` has under ``model:``); the
usual Hugging Face names (``vocab_size``, ``max_position_embeddings``, ``hidden_size``,
``num_attention_heads``, ``num_hidden_layers``, ``tie_word_embeddings``) are derived from it,
so they cannot disagree with it.
"""
from __future__ import annotations

import sys
from typing import Any, ClassVar

from transformers import PretrainedConfig

from energyformer.models.config import ModelConfig
from energyformer.models.registry import LANGUAGE_MODELS, config_from_dict
from energyformer.utils.plugins import load_plugins

#: Hugging Face attribute names derived from the energyformer model config (never read back)
DERIVED_KEYS = ("vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads",
                "num_hidden_layers", "tie_word_embeddings")


class EnergyformerConfig(PretrainedConfig):
    """Base of the per-family configs; use a subclass (or :func:`config_for`).

    Args:
        energyformer: the model config dict (``arch`` and the fields of the family's
            :class:`~energyformer.models.config.ModelConfig`); missing fields take their defaults.
        imports: plugin modules the model config needs (a run's ``imports:``), imported
            (:func:`~energyformer.utils.plugins.load_plugins`) before the model config is read and
            kept in ``config.json``, so ``from_pretrained`` works in a fresh process.
        **kwargs: the usual :class:`~transformers.PretrainedConfig` arguments (``pad_token_id``...).

    Raises:
        ValueError: ``energyformer["arch"]`` is not this class's family, or a field is invalid
            (the model config's own check, naming the field); a plugin module fails to import.
    """

    model_type = "energyformer"
    arch: ClassVar[str] = ""

    def __init__(self, energyformer: dict[str, Any] | None = None, imports: list[str] | None = None,
                 **kwargs: Any):
        self.imports = load_plugins(imports)  # checked and imported before the model config is read
        spec = {"arch": self.arch, **dict(energyformer or {})}
        if spec["arch"] != self.arch:
            raise ValueError(f"energyformer['arch']={spec['arch']!r} does not match {type(self).__name__} "
                             f"(model_type {self.model_type!r}, arch {self.arch!r})")
        self.energyformer = config_from_dict(spec).to_dict()
        for key in DERIVED_KEYS:
            kwargs.pop(key, None)
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)
        self._set_derived()

    def _set_derived(self) -> None:
        c = self.model_config()
        self.vocab_size = c.vocab_size
        self.max_position_embeddings = c.block_size
        self.hidden_size = c.d_model
        self.num_attention_heads = getattr(c, "n_heads", 1)  # a plugin arch may have no attention
        self.num_hidden_layers = getattr(c, "n_layers", getattr(c, "n_steps", 1))
        self.tie_word_embeddings = bool(getattr(c, "tie_embeddings", False))

    def model_config(self) -> ModelConfig:
        """The :class:`~energyformer.models.config.ModelConfig` this config describes."""
        return config_from_dict(self.energyformer)


#: how each arch is spelled in class names (an arch missing here is capitalized)
CLASS_NAMES = {"gpt": "GPT", "llama": "Llama", "cem": "CEM", "nrgpt": "NRGPT", "gpt_rec": "GPTRec"}


def class_name(arch: str) -> str:
    """``"nrgpt"`` → ``"NRGPT"``: the arch as it appears in class names."""
    return CLASS_NAMES.get(arch) or "".join(p.capitalize() for p in arch.split("_"))


def family_class(base: type, arch: str, kind: str, module: str, attrs: dict[str, Any]) -> type:
    """The ``Energyformer<Arch><kind>`` subclass of ``base`` for ``arch`` (a config or a causal-LM class),
    made a global of ``module`` so that ``transformers`` and pickle find it by its qualified name.

    ``attrs`` are its class attributes beside ``__module__`` and a docstring naming the family.
    """
    what = {"Config": "config", "ForCausalLM": "causal LM"}.get(kind, kind)
    doc = f"The ``{arch}`` family's Hugging Face {what} (model_type ``energyformer_{arch}``)."
    cls = type(f"Energyformer{class_name(arch)}{kind}", (base,), {"__module__": module, "__doc__": doc, **attrs})
    setattr(sys.modules[module], cls.__name__, cls)
    return cls


def _family(arch: str) -> type[EnergyformerConfig]:
    # "__init__" in the class dict: transformers turns config subclasses into dataclasses and would
    # otherwise generate an __init__ that skips ours
    return family_class(EnergyformerConfig, arch, "Config", __name__,
                        {"model_type": f"energyformer_{arch}", "arch": arch, "__init__": EnergyformerConfig.__init__})


#: arch name -> config class (one per language model of ``energyformer.models.registry``; an arch a
#: plugin registers later gets its class from :func:`config_class`)
CONFIG_CLASSES: dict[str, type[EnergyformerConfig]] = {arch: _family(arch) for arch in LANGUAGE_MODELS}


def config_class(arch: Any) -> type[EnergyformerConfig]:
    """The config class of the language model ``arch``, made on first use for an arch registered after
    this module was imported (a plugin's).

    Raises:
        ValueError: ``arch`` is not a registered language model (one line listing those that are).
    """
    if arch in CONFIG_CLASSES:
        return CONFIG_CLASSES[arch]
    known = isinstance(arch, str) and arch in LANGUAGE_MODELS
    if not known:
        raise ValueError(f"arch={arch!r} has no Hugging Face config; expected one of {sorted(LANGUAGE_MODELS)}")
    CONFIG_CLASSES[arch] = _family(arch)
    return CONFIG_CLASSES[arch]


def config_for(model_config: ModelConfig | dict[str, Any], **kwargs: Any) -> EnergyformerConfig:
    """The Hugging Face config of an energyformer model config (or dict with an ``arch`` key).

    Raises:
        ValueError: unknown arch or invalid fields.
    """
    spec = model_config.to_dict() if isinstance(model_config, ModelConfig) else dict(model_config)
    return config_class(spec.get("arch"))(energyformer=spec, **kwargs)
