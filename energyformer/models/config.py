"""Model configs: the fields every architecture's dataclass shares, and the shared shapes.

:class:`ModelConfig` (``vocab_size``, ``block_size``, the key renames of earlier versions,
``to_dict``/``from_dict``) is the base of every model config; :class:`GPTShapeConfig` holds the
fields GPT and the recurrent GPTs share, :class:`LlamaShapeConfig` those of Llama and CEM-Llama.
Each architecture's own config lives beside its model (``models/gpt.py``'s ``GPTConfig``, ...);
``energyformer.models.registry`` maps ``arch`` names to them.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from energyformer._validate import check_choice, check_float, check_int, check_width
from energyformer.utils.derived import Rule, fill_derived

__all__ = ["ModelConfig", "GPTShapeConfig", "LlamaShapeConfig", "default_d_ff", "INFERENCE_OPTIONS",
           "forward_options"]

#: the keyword options a model's forward may take beyond ``(inputs, targets)``: steps at inference,
#: per-token early stopping, per-token exit, energy-safe steps (docs/inference_compute.md), and truncated
#: back-propagation in training (``train.backprop_steps``)
INFERENCE_OPTIONS = ("n_steps", "stop_tol", "exit", "accept_lower_energy", "backprop_steps")


@functools.cache
def forward_options(model_cls: type) -> tuple[str, ...]:
    """The :data:`INFERENCE_OPTIONS` that ``model_cls.forward`` takes, read from its signature (once per
    class). ``ArchSpec.inference_options`` (``energyformer.models.registry``) and ``generate`` ask here."""
    takes = inspect.signature(model_cls.forward).parameters
    return tuple(k for k in INFERENCE_OPTIONS if k in takes)


@dataclass
class ModelConfig:
    """Fields every model config has. Subclasses add their own and call ``super().__post_init__()``.

    ``arch`` names the registry entry (see ``energyformer.models.registry``).

    Derived defaults (``d_ff`` from ``d_model``, ...) are declared once per class in ``derived``
    (field -> rule, :mod:`energyformer.utils.derived`) and filled in one step, here: ``__post_init__``
    checks the common fields, then :meth:`check_inputs` (the fields the rules read), then fills every
    derived field left at its default (:func:`~energyformer.utils.derived.fill_derived`); a
    subclass's ``__post_init__`` checks the rest after ``super().__post_init__()``. A built config
    therefore holds concrete values only, and so do the configs it saves.
    """

    arch: ClassVar[str] = ""
    #: old key -> new key, for recipes written before a rename; see :meth:`upgrade_dict`.
    renamed_keys: ClassVar[dict[str, str]] = {}
    #: derived field -> rule (its value when left at its default), in order; a subclass lists its own
    derived: ClassVar[dict[str, Rule]] = {}
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
        self.check_inputs()
        fill_derived(self)

    def check_inputs(self) -> None:
        """Validate the fields the ``derived`` rules read (a subclass with rules extends this and calls
        ``super().check_inputs()``), so that a rule never sees an invalid value.

        Raises:
            ValueError: one line naming the field.
        """

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
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a dict (old key spellings upgraded), raising ``ValueError`` for unknown keys."""
        d = cls.upgrade_dict(d)
        given = d.pop("arch", cls.arch)
        if given != cls.arch:  # a dict of another architecture
            raise ValueError(f"model.arch={given!r} does not match {cls.__name__} (arch {cls.arch!r})")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown model config key(s) {unknown} for arch {cls.arch!r}; "
                f"expected some of {sorted(names)}")
        return cls(**d)


@dataclass
class GPTShapeConfig(ModelConfig):
    """Fields shared by GPT and the recurrent GPT baselines. ``d_ff`` defaults to ``4·d_model``;
    ``activation`` is ``"relu"`` (the NRGPT reference code) or ``"gelu"`` (GPT-2)."""

    derived: ClassVar[dict[str, Rule]] = {"d_ff": lambda c: 4 * c.d_model}
    d_model: int = 128
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    activation: str = "relu"
    bias: bool = True

    def check_inputs(self) -> None:
        super().check_inputs()
        check_width(self.d_model, self.n_heads)

    def __post_init__(self) -> None:
        super().__post_init__()
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
    and ``d_ff`` to :func:`default_d_ff`.
    """

    derived: ClassVar[dict[str, Rule]] = {"head_dim": lambda c: c.d_model // c.n_heads,
                                          "d_ff": lambda c: default_d_ff(c.d_model)}
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    d_ff: int | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def check_inputs(self) -> None:
        super().check_inputs()
        check_width(self.d_model, self.n_heads, self.head_dim)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_layers", self.n_layers, 1)
        check_int("d_ff", self.d_ff, 1)
        check_float("norm_eps", self.norm_eps, 0.0, strict=True)
        check_float("init_std", self.init_std, 0.0, strict=True)
