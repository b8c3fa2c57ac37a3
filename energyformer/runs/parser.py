"""The one command-line parser: jsonargparse, with energyformer's conventions as its hooks.

Every command line (``energyformer sample RUN --temperature 0.8``) and every run-config
override (``--train.max_steps 10``) is read by an :class:`ArgParser`, a
``jsonargparse.ArgumentParser`` whose options are built from typed signatures and dataclasses
(``add_function_arguments`` / ``add_class_arguments``). What it adds, each in one place:

- flag names may use ``-`` or ``_`` (``--max-new-tokens`` = ``--max_new_tokens``); a flag
  spelled as a Python keyword names the parameter with a trailing ``_`` (``--as`` → ``as_``);
- a boolean option given alone means true (``--force``, ``--train.tensorboard``);
- an integer option takes a whole number in scientific notation (``--train.max_steps 1e9`` is
  ``1000000000``; ``1.5e0`` stays an error), up to :data:`INT_LIMIT` (a larger one, ``1e30``, is
  "too large"), and a float option refuses a finite literal beyond the float range (``1e400``);
- ``inf``, ``-inf``, ``nan`` (any case, also ``Infinity``) are numbers for a float option, and
  ``-1``, ``-1e-3``, ``-inf`` are values, not flags, so the option's own check names its range;
- ``none`` / ``None`` (like ``null`` and ``~``) is null for an optional option; a plain ``str``
  option keeps the word;
- ``--config FILE`` may name a command's recipe (:attr:`ArgParser.config_flag`);
- the help of a dataclass field whose default is derived from other fields (its class's
  ``derived`` rules, :mod:`energyformer.utils.derived`) says so: ``default: derived from d_model``;
- every error is one ``ValueError`` line naming the option, the value exactly as typed and the
  expected type; a missing (sub)command lists every choice with a usage line.
"""
from __future__ import annotations

import argparse
import contextvars
import dataclasses
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
from energyformer.utils.derived import derived_rules, sentinel

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
_DIGITS = re.compile(r"^[+-]?\d+$")
#: the largest magnitude an integer option takes: what an int64 (a checkpoint, a tensor, numpy) holds
INT_LIMIT = 2 ** 63 - 1
_INF_WORDS = ("inf", "infinity")


class _TooLarge(ValueError):
    """An integer option's whole number beyond :data:`INT_LIMIT`."""


def _int_only(tp: Any) -> bool:
    return _accepts(tp, int) and not _accepts(tp, float)


def _scientific_int(value: Any) -> int | None:
    """``"1e9"`` (or the float ``1e9``, as YAML reads ``1.0e+9``) → ``1000000000``: an integer
    option takes a whole number written in scientific notation; anything else → ``None``.

    Raises:
        _TooLarge: a whole number (also in plain digits) beyond :data:`INT_LIMIT` in magnitude.
    """
    import decimal

    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        if abs(value) > INT_LIMIT:
            raise _TooLarge(value)
        return int(value)
    if isinstance(value, str) and _DIGITS.match(value.strip()):  # plain digits: jsonargparse reads them
        digits = value.strip().lstrip("+-").lstrip("0")
        if len(digits) > len(str(INT_LIMIT)) or (digits and int(digits) > INT_LIMIT):
            raise _TooLarge(value)
        return None
    if not isinstance(value, str) or not _SCIENTIFIC.match(value.strip()):
        return None
    number = decimal.Decimal(value.strip())
    if number != number.to_integral_value():
        return None
    if abs(number) > INT_LIMIT:  # (compared as a Decimal: 1e400 never becomes a 400-digit int)
        raise _TooLarge(value)
    return int(number)


def _float_overflow(text: Any) -> bool:
    """Whether ``text`` is a finite literal beyond the float range (``"1e400"``, read as inf), not ``inf`` itself."""
    if not isinstance(text, str) or nonfinite_float(text) is None:
        return False
    return text.strip().lstrip("+-").lower() not in (*_INF_WORDS, "nan")


#: the options as typed on the command line being parsed (dest -> (flag, value)), for messages
_TYPED: contextvars.ContextVar[dict[str, tuple[str, str]] | None] = contextvars.ContextVar("typed", default=None)


def _shown(key: str) -> str:
    """How an option is named in a message: ``train.max_steps`` (a run-config key) or ``--top_k`` (a flag)."""
    return key if "." in key else f"--{key}"


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
        derived = getattr(action, "derived", None)  # (the field's sentinel, the fields its rule reads)
        if derived is not None:
            unset, reads = derived
            rule = f"derived from {', '.join(reads)}" if reads else "derived"
            shown = (rule if unset is None else f"{unset} ({rule})") if default == unset else (
                f"{default} ({'null' if unset is None else unset}: {rule})")
            text = text.replace("%(default)s", shown.replace("%", "%%"))
        elif isinstance(default, str) and (not default.strip() or not default.isprintable()):
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
        self._mark_derived(theclass, nested_key)
        return added

    def _mark_derived(self, theclass: Any, prefix: str | None) -> None:
        """Note on each option of a derived field (``theclass.derived``) its sentinel and the fields its
        rule reads (the field names its code uses), for the help (:class:`HelpFormatter`)."""
        if not dataclasses.is_dataclass(theclass):
            return
        names = [f.name for f in dataclasses.fields(theclass)]
        for name, rule in derived_rules(theclass).items():
            code = getattr(rule, "__code__", None)
            reads = [n for n in names if code is not None and n in code.co_names]
            for action in self._actions:
                if action.dest == (f"{prefix}.{name}" if prefix else name):
                    action.derived = (sentinel(theclass, name), reads)

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
        tokens, parsers, typed = self._normalize(list(sys.argv[1:] if args is None else args))
        outer = _TYPED.get()  # jsonargparse parses a subcommand's (normalized) tokens with its own parse_args
        reset = _TYPED.set(typed) if outer is None else None
        typed = typed if outer is None else {**typed, **outer}  # the flags as the user typed them
        try:
            return super().parse_args(tokens, namespace, **kwargs)
        except ArgumentError as e:
            raise ValueError(self._one_line(str(e), parsers, typed)) from None
        finally:
            if reset is not None:
                _TYPED.reset(reset)

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
            elif _int_only(self.hints.get(dest)):
                value = self._int_value(dest, value)
            out[key] = value
        return out

    @staticmethod
    def _int_value(key: str, value: Any, flag: str | None = None) -> Any:
        """An integer option's value: a whole number in scientific notation as an int, else as given.

        Raises:
            ValueError: a whole number beyond :data:`INT_LIMIT` ("too large", named as given: ``flag``).
        """
        try:
            n = _scientific_int(value)
        except _TooLarge:
            raise ValueError(f"{flag or _shown(key)}={value!r} is too large; expected an integer of magnitude "
                             f"at most 2**63 - 1 ({INT_LIMIT})") from None
        return value if n is None else n

    def _normalize(self, tokens: list[str]) -> tuple[list[str], list[ArgParser], dict[str, tuple[str, str]]]:
        """The tokens jsonargparse reads (flag names with ``_``, numbers spelled as it reads them),
        the parsers of the (sub)commands met, and each option's flag and value as typed (for messages).

        Raises:
            ValueError: a number too large for its option (see :meth:`_int_value`).
        """
        parsers: list[ArgParser] = [self]
        typed: dict[str, tuple[str, str]] = {}  # option dest -> (the flag as typed, its value as typed)
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
            text = tokens[i + 1] if apart else value
            flag = name if "." in name else tok.partition("=")[0]  # a run-config key, or the flag as typed
            if apart or eq:
                typed[name] = (flag, text)
            hint = parser.hints.get(name)
            if _accepts(hint, float) and _float_overflow(text):
                raise ValueError(f"{flag}={text!r} is too large; expected a number of magnitude at most "
                                 f"{sys.float_info.max:.4g} (or inf)")
            x = nonfinite_float(text) if _accepts(hint, float) else None
            n = self._int_value(name, text, flag) if _int_only(hint) else None
            if isinstance(n, int):
                out.append(f"--{name}={n}")
                i += apart
            elif x is None:
                out.append(f"--{name}{eq}{value}")
            else:
                out.append(f"--{name}={'.nan' if math.isnan(x) else '.inf' if x > 0 else '-.inf'}")
                i += apart
            i += 1
        return out, parsers, typed

    # -- errors -------------------------------------------------------------------------------------
    def _one_line(self, message: str, parsers: Sequence[ArgParser], values: Mapping[str, Any] = {}) -> str:
        """jsonargparse's error ``message`` as one line; ``values``: each option's value as the user gave
        it, or ``(flag as typed, value as typed)`` (jsonargparse names the value it parsed: ``inf`` for
        ``1e400``, ``1.5`` for ``1.5e0``)."""
        hints = {k: v for p in parsers for k, v in p.hints.items()}
        typed = re.search(r'Parser key "([\w.]+)":.*?(?:Got|Given) value: (.*?)(?:\n|$)', message, re.S)
        if typed:
            key, given = typed.groups()
            key = key if key in hints else key.split(".", 1)[-1]  # `sample.top_k` → `top_k`
            if key in hints:
                flag, value = _shown(key), values.get(key, given.strip())
                if isinstance(value, tuple):
                    flag, value = value
                return f"{flag}={value!r} must be {type_name(hints[key])}"
        missing = re.match(r'expected "([\w.]+)" to be one of \{.*\}, but it was not provided', message, re.S)
        if missing:
            return parsers[-1].missing_subcommand()
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

    #: what a subcommand of this parser is called in messages (``energyformer prepare``: "dataset")
    subcommand_noun = "command"

    def missing_subcommand(self) -> str:
        """The error for a command line that stops before this parser's subcommand: every choice and
        a usage line (``energyformer`` alone)."""
        choices = next((list(a.choices) for a in self._actions if isinstance(a, argparse._SubParsersAction)), [])
        noun, prog = self.subcommand_noun, self.prog.replace(" [options]", "")  # (argparse's prog of a subcommand)
        return (f"{prog} needs a {noun}, one of: {', '.join(choices)} "
                f"(usage: {prog} [options] {noun.upper()} ...; `{prog} {noun.upper()} --help` "
                f"lists a {noun}'s options)")

    def unrecognized(self, tokens: list[str]) -> str:
        """The error for tokens no option takes (a hook: run-config overrides name the key)."""
        return f"unrecognized arguments: {' '.join(tokens)}"

    def invalid_choice(self, value: str) -> str | None:
        """The error for an unknown subcommand ``value`` (a hook; None: jsonargparse's message)."""
        return None
