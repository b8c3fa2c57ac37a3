"""Derived defaults: config fields whose default is computed from other fields, declared once per class.

A config dataclass lists its derived fields in one ordered class attribute, ``derived``: field name →
rule, a function of the config giving the field's value when the field is left at its dataclass
default (its *sentinel*, normally ``None``)::

    @dataclass
    class Shape:
        derived: ClassVar[dict[str, Rule]] = {"d_ff": lambda c: 4 * c.d_model}
        d_model: int = 128
        d_ff: int | None = None

A rule may read fields derived before it (the order of the mapping); a subclass adds its own rules
after its bases' (and may replace a base's rule for the same field). Two functions use the rules:

* :func:`fill_derived` fills every field left at its sentinel (the config's one resolution step:
  model configs call it from ``ModelConfig.__post_init__`` after ``check_inputs``, ``TrainConfig``
  from its own ``__post_init__``, once the fields the rules read are validated), so a built config
  always holds the concrete values and saved configs hold them too;
* :func:`given_values` is the inverse: the config's fields without those whose value is what their
  rule derives from the config's other values, i.e. what a config must be given to be rebuilt.
  Rebuilding from it with another value of an input (``d_model``) derives the field again; a value
  that happens to equal the derived one counts as derived. :func:`replace` does that (where
  ``dataclasses.replace`` would keep the old derived values).

Nothing here imports the rest of the package (the Hugging Face export copies this module with the
model code).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

__all__ = ["Rule", "derived_rules", "sentinel", "fill_derived", "given_values", "replace"]

#: a derived field's rule: the config (its inputs validated, earlier derived fields filled) -> the value
Rule = Callable[[Any], Any]


def derived_rules(cls: type) -> dict[str, Rule]:
    """Field name → rule of the config class ``cls``: its bases' ``derived`` first, then its own, in
    declaration order (a subclass's rule for a field replaces its base's in place)."""
    rules: dict[str, Rule] = {}
    for klass in reversed(cls.__mro__):
        rules.update(vars(klass).get("derived", {}))
    return rules


def sentinel(cls: type, name: str) -> Any:
    """The value that means "derive me" for the field ``name`` of ``cls``: its dataclass default.

    Raises:
        ValueError: ``name`` is not a field of ``cls`` with a plain default (a rule for it is a bug).
    """
    for f in fields(cls):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise ValueError(f"{cls.__name__}.derived names {name!r}, which is not a field with a default")


def _is_sentinel(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def fill_derived(cfg: Any) -> None:
    """Set every derived field of ``cfg`` left at its sentinel to its rule's value, in rule order."""
    cls = type(cfg)
    for name, rule in derived_rules(cls).items():
        if _is_sentinel(getattr(cfg, name), sentinel(cls, name)):
            setattr(cfg, name, rule(cfg))


def given_values(cfg: Any) -> dict[str, Any]:
    """``{field: value}`` of the dataclass ``cfg`` (a built, filled config) without the derived fields
    whose value equals what their rule gives for ``cfg``: building ``type(cfg)(**given_values(cfg))``
    gives an equal config, and replacing an input there derives the dropped fields again."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}
    for name, rule in derived_rules(type(cfg)).items():
        if out[name] == rule(cfg):
            del out[name]
    return out


def replace(cfg: Any, **changes: Any) -> Any:
    """A copy of the dataclass ``cfg`` with ``changes``, like ``dataclasses.replace``, except that the
    derived fields whose value ``cfg`` derived (:func:`given_values`) derive again from the changed
    values: ``replace(cfg, d_model=128)`` has the ``d_ff`` of a fresh ``d_model=128`` config. A derived
    field named in ``changes`` takes the given value.

    Raises:
        ValueError: a name in ``changes`` is not a field of ``cfg``, or the new config is invalid.
    """
    given = given_values(cfg)
    names = {f.name for f in fields(cfg) if f.init}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"{type(cfg).__name__} has no field(s) {unknown}; expected some of {sorted(names)}")
    return type(cfg)(**{**given, **changes})
