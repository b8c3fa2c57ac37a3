"""Architectures as registry entries: one :class:`ArchSpec` per ``arch`` name (docs/architecture.md §2b).

An :class:`ArchSpec` says everything the rest of the package asks about an architecture, so no
code outside this module compares ``arch`` strings:

* its config and model classes (``module``, ``model_class``, ``config_class``; imported lazily, on
  first use);
* whether it is a language model (token ids in, next-token logits out: sampling, evaluation,
  Hugging Face export) or reads continuous values (the in-context regressor);
* its training loop (an import path ``"module:function"``, so that ``models/`` does not import
  ``train/``) and the ``TrainConfig`` keys that loop reads (:meth:`ArchSpec.check_train_config`
  refuses any other key set away from its default, in one line naming the keys);
* its inference options: which of :data:`INFERENCE_OPTIONS` its forward takes, read once from the
  model class's ``forward`` signature (:attr:`ArchSpec.inference_options`,
  :meth:`ArchSpec.check_inference_options`);
* its parameter-accounting view (``accounting``: ``"totals"``, ``"layers"`` or ``"vs_llama"``,
  :mod:`energyformer.models.accounting`), the stock Hugging Face family its weights can be written as
  (``hf_family``), and how its decoding counts exit steps (``exit_per_sub_block``).

A plugin adds an architecture with one call in the module its recipe's ``imports:`` names::

    from energyformer.models.registry import ArchSpec, register_arch
    register_arch(ArchSpec("toy", module="toy_model", model_class="ToyLM", config_class="ToyConfig"))

``ARCHS`` (name → ``(module, model class name, config class name)``), ``LANGUAGE_MODELS`` and
:func:`get_arch` are live views of the registry, kept for callers. ``build_model`` accepts a model
config object or a dict with an ``arch`` key (YAML recipes are read by :mod:`energyformer.runs`;
``energyformer.build_model`` accepts a recipe path too).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch.nn as nn

from energyformer._validate import did_you_mean
from energyformer.models.base import CausalLM
from energyformer.models.config import INFERENCE_OPTIONS, ModelConfig, forward_options
from energyformer.utils.derived import given_values
from energyformer.utils.registry import PLUGIN_HINT

__all__ = ["ArchSpec", "ARCH_SPECS", "ARCHS", "LANGUAGE_MODELS", "INFERENCE_OPTIONS", "LM_TRAIN_LOOP",
           "register_arch", "unregister_arch", "get_spec", "get_arch", "inference_options", "config_from_dict",
           "given_fields", "build_model"]

#: the training loop of the language models (token streams), :func:`energyformer.train.loop.train`
LM_TRAIN_LOOP = "energyformer.train.loop:train"
ACCOUNTING_VIEWS = ("totals", "layers", "vs_llama")
HF_FAMILIES = (None, "llama", "gpt2")


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: what every command asks about it (see the module docstring).

    Args:
        name: the ``arch`` name recipes use (``model.arch``).
        module: the module that defines the model and config classes (imported on first use).
        model_class: the model class's name in ``module`` (built as ``ModelClass(config)``).
        config_class: the config dataclass's name in ``module`` (a :class:`ModelConfig` whose
            ``arch`` class attribute is ``name``).
        language_model: token ids in, next-token logits out (``sample``, ``eval``, ``inspect``,
            ``export``, lm-eval); false for a model of continuous values (the regressor).
        train_loop: ``"module:function"`` of its training loop, called as ``function(run_cfg,
            progress=...)`` and returning the run summary.
        train_keys: the ``TrainConfig`` keys that loop reads; ``None`` = every key.
        accounting: the parameter-accounting view: ``"totals"`` (total / embedding counts),
            ``"layers"`` (also a per-layer split of a Llama-shaped model: ``model.layers[0]``) or
            ``"vs_llama"`` (per-layer groups from each sub-block's ``param_groups()`` next to the
            matching Llama, docs/cem.md §8).
        hf_family: the stock ``transformers`` family its weights can be written as (``"llama"``,
            ``"gpt2"``; ``None``: only as an energyformer folder). :mod:`energyformer.hf.convert` says
            which configs of the family qualify.
        exit_per_sub_block: exit-step counts are per sub-block (CEM: attention and MLP each exit).

    Raises:
        ValueError: an empty name or class name, a ``train_loop`` without ``":"``, an unknown
            ``accounting`` or ``hf_family``.
    """

    name: str
    module: str
    model_class: str
    config_class: str
    language_model: bool = True
    train_loop: str = LM_TRAIN_LOOP
    train_keys: frozenset[str] | None = None
    accounting: str = "totals"
    hf_family: str | None = None
    exit_per_sub_block: bool = False

    def __post_init__(self) -> None:
        for key in ("name", "module", "model_class", "config_class"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"ArchSpec.{key}={getattr(self, key)!r} must be a non-empty string")
        if not isinstance(self.train_loop, str) or ":" not in self.train_loop:
            raise ValueError(f"ArchSpec.train_loop={self.train_loop!r} must be 'module:function'")
        if self.accounting not in ACCOUNTING_VIEWS:
            raise ValueError(f"ArchSpec.accounting={self.accounting!r} is not valid; expected one of "
                             f"{', '.join(map(repr, ACCOUNTING_VIEWS))}")
        if self.hf_family not in HF_FAMILIES:
            raise ValueError(f"ArchSpec.hf_family={self.hf_family!r} is not valid; expected one of {HF_FAMILIES}")
        if self.train_keys is not None:
            object.__setattr__(self, "train_keys", frozenset(self.train_keys))

    # ------------------------------------------------------------------ classes
    def classes(self) -> tuple[type[nn.Module], type[ModelConfig]]:
        """``(ModelClass, ConfigClass)``, importing ``module`` on first use.

        Raises:
            ValueError: the module fails to import or lacks a class (one line naming it).
        """
        try:
            mod = importlib.import_module(self.module)
            return getattr(mod, self.model_class), getattr(mod, self.config_class)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"arch {self.name!r}: cannot load {self.module}.{self.model_class} / "
                             f"{self.config_class} ({type(e).__name__}: {e})") from e

    # ------------------------------------------------------------------ inference options
    @cached_property
    def inference_options(self) -> tuple[str, ...]:
        """The :data:`INFERENCE_OPTIONS` the model's ``forward`` takes (read from its signature once,
        :func:`~energyformer.models.config.forward_options`).

        Raises:
            ValueError: the model's module cannot be loaded (:meth:`classes`).
        """
        return forward_options(self.classes()[0])

    def takes(self, option: str) -> bool:
        """Whether the model's forward takes ``option`` (one of :data:`INFERENCE_OPTIONS`)."""
        return option in self.inference_options

    def check_inference_options(self, given: Iterable[str], names: Mapping[str, str] | None = None) -> None:
        """Refuse options the model's forward does not take.

        Args:
            given: the option names a caller is about to pass (``None`` values already dropped).
            names: how the caller's user spells each option (``{"stop_tol": "--stop-tol"}``, the CLI);
                the message lists the options of ``names`` the model takes (default: the inference
                options by their own names, ``backprop_steps`` aside).

        Raises:
            ValueError: one line naming the first option (in :data:`INFERENCE_OPTIONS` order) the arch
                does not take, and the ones it does.
        """
        names = dict(names or {k: k for k in INFERENCE_OPTIONS if k != "backprop_steps"})
        bad = [k for k in INFERENCE_OPTIONS if k in set(given) and k not in self.inference_options]
        bad += sorted(set(given) - set(INFERENCE_OPTIONS))
        if bad:
            spell = [names[k] for k in self.inference_options if k in names]
            raise ValueError(f"{names.get(bad[0], bad[0])} is not an option of the {self.name!r} model; "
                             f"it takes {sorted(spell) or 'none of them'}")

    # ------------------------------------------------------------------ training
    def train_function(self) -> Any:
        """The training loop named by ``train_loop`` (imported now).

        Raises:
            ValueError: the module or function cannot be found.
        """
        module, _, name = self.train_loop.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"arch {self.name!r}: train_loop {self.train_loop!r} cannot be loaded "
                             f"({type(e).__name__}: {e})") from e

    def ignored_train_keys(self, tc: Any) -> list[str]:
        """The keys of ``tc`` (a validated ``TrainConfig``) this arch's loop does not read and that hold
        another value than a config of the keys it reads would (defaults and derived defaults agree)."""
        if self.train_keys is None:
            return []
        base = type(tc)(**{k: getattr(tc, k) for k in self.train_keys if hasattr(tc, k)})
        return [f.name for f in fields(tc) if f.name not in self.train_keys
                and getattr(tc, f.name) != getattr(base, f.name)]

    def check_train_config(self, tc: Any) -> None:
        """Refuse ``TrainConfig`` keys set away from their defaults that this arch's loop does not read.

        Raises:
            ValueError: one line naming every such key, its value and the keys the loop reads.
        """
        bad = self.ignored_train_keys(tc)
        if bad:
            given = ", ".join(f"train.{k}={getattr(tc, k)!r}" for k in bad)
            raise ValueError(f"model.arch={self.name!r} trains with {self.train_loop}, which does not read {given}; "
                             f"leave {'it' if len(bad) == 1 else 'them'} at the default (it reads "
                             f"{', '.join(sorted(self.train_keys or ()))})")


# ---------------------------------------------------------------------------------- the registry
#: arch name -> spec, in registration order (the package's own first; plugins add theirs)
ARCH_SPECS: dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    """Add ``spec`` under ``spec.name``; registering an equal spec again is a no-op (a re-imported plugin).

    Raises:
        ValueError: not an :class:`ArchSpec`, or another spec already holds the name.
    """
    if not isinstance(spec, ArchSpec):
        raise ValueError(f"register_arch expects an ArchSpec, got {type(spec).__name__}")
    old = ARCH_SPECS.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"arch {spec.name!r} is already registered ({old.module}.{old.model_class})")
    ARCH_SPECS.setdefault(spec.name, spec)
    return ARCH_SPECS[spec.name]


def unregister_arch(name: str) -> None:
    """Remove ``name`` (for tests that register toy architectures). Unknown names are ignored."""
    ARCH_SPECS.pop(name, None)


def get_spec(arch: Any) -> ArchSpec:
    """The :class:`ArchSpec` registered as ``arch``.

    Raises:
        ValueError: ``arch`` is not registered (one line listing the registered names; a plugin's arch
            is known once the module in the recipe's ``imports:`` is imported).
    """
    try:
        return ARCH_SPECS[arch]
    except (KeyError, TypeError):
        raise ValueError(f"model.arch={arch!r} is not valid{did_you_mean(arch, ARCH_SPECS)}; expected one of "
                         f"{', '.join(repr(a) for a in ARCH_SPECS)}{PLUGIN_HINT}") from None


class _ArchTable(Mapping):
    """``ARCHS``: a live view, name -> ``(module, model class name, config class name)``."""

    def __getitem__(self, arch: str) -> tuple[str, str, str]:
        s = ARCH_SPECS[arch]
        return s.module, s.model_class, s.config_class

    def __iter__(self) -> Iterator[str]:
        return iter(list(ARCH_SPECS))

    def __len__(self) -> int:
        return len(ARCH_SPECS)

    def __repr__(self) -> str:
        return f"ARCHS({', '.join(ARCH_SPECS)})"


class _LanguageModels(Sequence):
    """``LANGUAGE_MODELS``: a live tuple of the language-model arch names."""

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, s in ARCH_SPECS.items() if s.language_model)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, arch: object) -> bool:
        return arch in self._names()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, Sequence)) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())


ARCHS: Mapping[str, tuple[str, str, str]] = _ArchTable()
#: the archs that map token ids to next-token logits (generation, Hugging Face export, lm-eval)
LANGUAGE_MODELS: Sequence[str] = _LanguageModels()

#: the ``TrainConfig`` keys the regressor's loop (:mod:`energyformer.train.regression`) reads; the
#: randomized-depth keys are read to be refused with their own message (``train.depth.check_supported``),
#: ``dtype`` to refuse ``bfloat16`` (it trains in float32)
REGRESSOR_TRAIN_KEYS = frozenset({
    "out_dir", "max_steps", "batch_size", "learning_rate", "min_lr", "lr_schedule", "warmup_steps",
    "lr_decay_steps", "cooldown_steps", "weight_decay", "beta1", "beta2", "grad_clip", "eval_interval",
    "log_interval", "seed", "num_threads", "device", "dtype",
    "depth_sampler", "depth_mean", "depth_min", "depth_max", "backprop_steps"})

for _spec in (
    ArchSpec("gpt", "energyformer.models.gpt", "GPT", "GPTConfig", hf_family="gpt2"),
    ArchSpec("nrgpt", "energyformer.models.nrgpt", "NRGPT", "NRGPTConfig"),
    ArchSpec("cem", "energyformer.models.cem", "CEMLlama", "CEMConfig", accounting="vs_llama",
             hf_family="llama", exit_per_sub_block=True),
    ArchSpec("llama", "energyformer.models.llama", "Llama", "LlamaConfig", accounting="layers", hf_family="llama"),
    ArchSpec("gpt_rec", "energyformer.models.recurrent_gpt", "RecurrentGPT", "RecurrentGPTConfig"),
    ArchSpec("regressor", "energyformer.models.regression", "SequenceRegressor", "RegressorConfig",
             language_model=False, train_loop="energyformer.train.regression:train_regressor",
             train_keys=REGRESSOR_TRAIN_KEYS),
):
    register_arch(_spec)


def inference_options(arch: str) -> tuple[str, ...]:
    """The :data:`INFERENCE_OPTIONS` the forward of ``arch``'s model takes (:attr:`ArchSpec.inference_options`).

    Raises:
        ValueError: ``arch`` is not registered.
    """
    return get_spec(arch).inference_options


def get_arch(arch: str) -> tuple[type[CausalLM], type[ModelConfig]]:
    """Return ``(ModelClass, ConfigClass)`` for a registered ``arch`` name.

    Raises:
        ValueError: ``arch`` is not registered, or its module cannot be loaded.
    """
    return get_spec(arch).classes()  # type: ignore[return-value]


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Build the right config class from a dict with an ``arch`` key.

    Raises:
        ValueError: no ``arch`` key, an unknown arch, unknown keys or invalid values.
    """
    if "arch" not in d:
        raise ValueError(f"model config needs an 'arch' key, one of {sorted(ARCHS)}; got keys {sorted(d)}")
    _, cfg_cls = get_arch(d["arch"])
    return cfg_cls.from_dict(d)


def given_fields(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` without the derived fields (its class's ``derived`` rules, ``d_ff`` from
    ``d_model``, ...) whose value is what their rule gives for ``cfg``
    (:func:`~energyformer.utils.derived.given_values`). Building a config from the result with other
    values of the fields they derive from derives them again (a value equal to the derived one counts
    as derived)."""
    return {"arch": cfg.arch, **given_values(cfg)}


def build_model(spec: ModelConfig | dict[str, Any], **overrides: Any) -> nn.Module:
    """Build a freshly initialized model from a model config or a dict with an ``arch`` key.

    The implementation behind the one public entry point, ``energyformer.build_model`` (which
    also reads YAML recipes); inside the package, code below ``runs/`` builds models here.

    ``overrides`` replace model config fields, e.g. ``build_model(cfg, vocab_size=65, n_steps=6)``;
    fields the config derived from others (``d_ff``, ``head_dim``, …: :func:`given_fields`) are
    derived again from the overridden values, as a fresh config would. A config without
    overrides is used as it is (it was validated when it was made; it is not validated again).

    Raises:
        ValueError: unknown arch or config keys, invalid values.
    """
    if isinstance(spec, ModelConfig) and overrides:
        spec = given_fields(spec)
    if isinstance(spec, dict):
        spec = config_from_dict({**spec, **overrides})
    if not isinstance(spec, ModelConfig):
        raise ValueError(f"build_model expects a ModelConfig, dict or recipe path, got {type(spec).__name__}")
    model_cls, _ = get_arch(spec.arch)
    return model_cls(spec)
