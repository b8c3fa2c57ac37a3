"""The one command-line parser: jsonargparse, with energyformer's conventions as its hooks.

Every command line (``energyformer sample RUN --temperature 0.8``) and every run-config
override (``--train.max_steps 10``) is read by an :class:`ArgParser`, a
``jsonargparse.ArgumentParser`` whose options are built from typed signatures and dataclasses
(``add_function_arguments`` / ``add_class_arguments``). What it adds, each in one place:

- flag names may use ``-`` or ``_`` (``--max-new-tokens`` = ``--max_new_tokens``); a flag
  spelled as a Python keyword names the parameter with a trailing ``_`` (``--as`` → ``as_``);
- a boolean option given alone means true (``--force``, ``--train.tensorboard``);
- an integer option takes a whole number in scientific notation (``--train.max_steps 1e9`` is
  ``1000000000``; ``1.5e0`` stays an error);
- ``inf``, ``-inf``, ``nan`` (any case, also ``Infinity``) are numbers for a float option, and
  ``-1``, ``-1e-3``, ``-inf`` are values, not flags, so the option's own check names its range;
- ``none`` / ``None`` (like ``null`` and ``~``) is null for an optional option; a plain ``str``
  option keeps the word;
- ``--config FILE`` may name a command's recipe (:attr:`ArgParser.config_flag`);
- every error is one ``ValueError`` line naming the option, the value and the expected type.
"""
from __future__ import annotations

import argparse
import keyword
import math
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from jsonargparse import ArgumentError, ArgumentParser, DefaultHelpFormatter, get_loader, set_loader

from energyformer._validate import nonfinite_float

LOAD_MODE = "energyformer"  # the jsonargparse parser_mode whose value loader reads `none` as null
# argparse takes a token for a flag unless it looks like a negative number; these are values too
NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)


def _load_value(text: str) -> Any:
    return None if text.strip().lower() == "none" else get_loader("yaml")(text)


set_loader(LOAD_MODE, _load_value, exceptions=(yaml.YAMLError,))


def type_name(tp: Any) -> str:
    """``int | None`` → ``"an integer or null"``: how a type reads in an error message."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple, Sequence):
        return "a list like [1, 2]"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _accepts(tp: Any, kind: type) -> bool:
    return tp is kind or kind in typing.get_args(tp)


_SCIENTIFIC = re.compile(r"^[+-]?\d+(\.\d*)?[eE][+]?\d+$")


def _int_only(tp: Any) -> bool:
    return _accepts(tp, int) and not _accepts(tp, float)


def _scientific_int(value: Any) -> int | None:
    """``"1e9"`` (or the float ``1e9``, as YAML reads ``1.0e+9``) → ``1000000000``: an integer
    option takes a whole number written in scientific notation; anything else → ``None``."""
    import decimal

    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if not isinstance(value, str) or not _SCIENTIFIC.match(value.strip()):
        return None
    number = decimal.Decimal(value.strip())
    return int(number) if number == number.to_integral_value() and abs(number) < 10 ** 30 else None


def _flat(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        out[f"{prefix}{key}"] = value
    return out


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with a string default that is blank or not printable (``--prompt``'s
    newline) shown as its Python literal, ``'\\n'``, instead of as nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action)
        default = action.default
        if isinstance(default, str) and (not default.strip() or not default.isprintable()):
            text = text.replace("%(default)s", repr(default))  # (jsonargparse's template knows only %(...)s)
        return text


class ArgParser(ArgumentParser):
    """``jsonargparse.ArgumentParser`` with the conventions above; errors raise ``ValueError``.

    ``noun`` starts the "needs a value" message (``"override "`` for run-config overrides);
    with ``config_flag = "config"``, ``--config FILE`` right after the command is its first
    positional argument, FILE (``energyformer train --config RECIPE.yaml`` = ``train RECIPE.yaml``).
    """

    noun = ""
    config_flag: str | None = None  # e.g. "config": `--config FILE` is the first positional, FILE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = {"exit_on_error": False, "allow_abbrev": False, "parser_mode": LOAD_MODE,
                  "formatter_class": HelpFormatter, **kwargs}
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE
        self.hints: dict[str, Any] = {}  # option dest -> its type annotation

    # -- building: record each option's type; a boolean flag alone means true ---------------------
    def add_class_arguments(self, theclass: Any, nested_key: str | None = None, *args: Any, **kwargs: Any):
        added = super().add_class_arguments(theclass, nested_key, *args, **kwargs)
        self._typed(typing.get_type_hints(theclass), nested_key, added)
        return added

    def add_function_arguments(self, function: Any, nested_key: str | None = None, *args: Any, **kwargs: Any):
        added = super().add_function_arguments(function, nested_key, *args, **kwargs)
        self._typed(typing.get_type_hints(function), nested_key, added)
        return added

    def _typed(self, hints: dict[str, Any], prefix: str | None, added: Sequence[str]) -> None:
        for action in self._actions:
            name = action.dest[len(prefix) + 1:] if prefix else action.dest
            if action.dest in added and name in hints:
                self.hints[action.dest] = hints[name]
                if action.option_strings and _accepts(hints[name], bool):
                    action.nargs, action.const = "?", True

    def subcommand_parser(self, name: str) -> ArgParser | None:
        """The parser of subcommand ``name``, or None."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return None

    # -- parsing ------------------------------------------------------------------------------------
    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None, **kwargs: Any):
        """``jsonargparse.ArgumentParser.parse_args`` of the normalized tokens.

        Raises:
            ValueError: a usage error, as one line naming the option and the expected type.
            SystemExit: ``--help`` (status 0).
        """
        tokens, parsers = self._normalize(list(sys.argv[1:] if args is None else args))
        try:
            return super().parse_args(tokens, namespace, **kwargs)
        except ArgumentError as e:
            raise ValueError(self._one_line(str(e), parsers)) from None

    def parse_object(self, obj: Any, *args: Any, **kwargs: Any):
        """``jsonargparse.ArgumentParser.parse_object`` (a float option's ``"inf"`` / ``"nan"`` string,
        as YAML reads them, is that number); a type error is one ``ValueError`` line."""
        if isinstance(obj, Mapping):
            obj = self._numbers(obj)
        try:
            return super().parse_object(obj, *args, **kwargs)
        except ArgumentError as e:
            raise ValueError(self._one_line(str(e), [self], _flat(obj) if isinstance(obj, Mapping) else {})) from None

    def _numbers(self, obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in obj.items():
            dest = f"{prefix}{key}"
            if isinstance(value, Mapping):
                value = self._numbers(value, f"{dest}.")
            elif _accepts(self.hints.get(dest), float) and nonfinite_float(value) is not None:
                value = nonfinite_float(value)
            elif _int_only(self.hints.get(dest)) and _scientific_int(value) is not None:
                value = _scientific_int(value)
            out[key] = value
        return out

    def _normalize(self, tokens: list[str]) -> tuple[list[str], list[ArgParser]]:
        parsers: list[ArgParser] = [self]
        out: list[str] = []
        i = first = 0  # first: where the current (sub)command's own tokens start
        while i < len(tokens):
            tok, parser = tokens[i], parsers[-1]
            sub = parser.subcommand_parser(tok) if not tok.startswith("-") else None
            if sub is not None:
                parsers.append(sub)
                first = len(out) + 1
            if not tok.startswith("--") or len(tok) == 2:
                out.append(tok)
                i += 1
                continue
            name, eq, value = tok[2:].partition("=")
            name = name.replace("-", "_")
            if name == parser.config_flag and len(out) == first and (eq or i + 1 < len(tokens)):  # = `FILE`
                out.append(value if eq else tokens[i + 1])
                i += 1 if eq else 2
                continue
            if keyword.iskeyword(name) and f"--{name}" not in parser._option_string_actions:
                name += "_"
            apart = not eq and i + 1 < len(tokens)  # `--flag VALUE`
            x = nonfinite_float(tokens[i + 1] if apart else value) if _accepts(parser.hints.get(name), float) else None
            n = _scientific_int(tokens[i + 1] if apart else value) if _int_only(parser.hints.get(name)) else None
            if n is not None:
                out.append(f"--{name}={n}")
                i += apart
            elif x is None:
                out.append(f"--{name}{eq}{value}")
            else:
                out.append(f"--{name}={'.nan' if math.isnan(x) else '.inf' if x > 0 else '-.inf'}")
                i += apart
            i += 1
        return out, parsers

    # -- errors -------------------------------------------------------------------------------------
    def _one_line(self, message: str, parsers: Sequence[ArgParser], values: Mapping[str, Any] = {}) -> str:
        hints = {k: v for p in parsers for k, v in p.hints.items()}
        typed = re.search(r'Parser key "([\w.]+)":.*?(?:Got|Given) value: (.*?)(?:\n|$)', message, re.S)
        if typed:
            key, given = typed.groups()
            key = key if key in hints else key.split(".", 1)[-1]  # `sample.top_k` → `top_k`
            if key in hints:
                value = values.get(key, given.strip())
                return f"{key if '.' in key else '--' + key}={value!r} must be {type_name(hints[key])}"
        bare = re.match(r"argument (--[\w.]+): expected one argument", message)
        if bare and bare.group(1)[2:] in hints:
            return f"{parsers[-1].noun}{bare.group(1)} needs a value ({type_name(hints[bare.group(1)[2:]])})"
        unknown = re.match(r"unrecognized arguments: (.*)", message, re.S)
        if unknown:
            return parsers[-1].unrecognized(unknown.group(1).split())
        choice = re.match(r"argument \w+: invalid choice: '(.*?)'", message)
        if choice:
            return parsers[-1].invalid_choice(choice.group(1)) or " ".join(message.split())
        return " ".join(message.split())

    def unrecognized(self, tokens: list[str]) -> str:
        """The error for tokens no option takes (a hook: run-config overrides name the key)."""
        return f"unrecognized arguments: {' '.join(tokens)}"

    def invalid_choice(self, value: str) -> str | None:
        """The error for an unknown subcommand ``value`` (a hook; None: jsonargparse's message)."""
        return None
