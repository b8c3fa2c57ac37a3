"""Small helpers that turn invalid values into clear ``ValueError`` messages.

Every message names the offending option, the value received and what was expected,
so that a mistyped YAML key or flag is fixed in one look.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any


def did_you_mean(value: Any, choices: Iterable[Any]) -> str:
    """`` (did you mean 'diag_shared'?)`` for a string close to one of the string ``choices``
    (``difflib``'s ratio ≥ 0.6); ``""`` otherwise."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``; return it. The message names the
    closest choice of a mistyped string (:func:`did_you_mean`)."""
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not valid{did_you_mean(value, choices)}; expected one of {allowed}")
    return value


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None) -> int:
    """Raise ``ValueError`` unless ``value`` is an int within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} must be <= {maximum}")
    return value


def check_float(name: str, value: Any, minimum: float | None = None, *, strict: bool = False,
                maximum: float | None = None) -> float:
    """Raise ``ValueError`` unless ``value`` is a finite real number above ``minimum``.

    ``strict=True`` requires ``value > minimum``; otherwise ``value >= minimum``. A value that is
    not a finite number (``inf``, ``nan``, a string) is told the whole range, e.g.
    ``temperature=inf must be a finite number >= 0.0``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        bounds = [f"{'>' if strict else '>='} {minimum}"] if minimum is not None else []
        bounds += [f"<= {maximum}"] if maximum is not None else []
        raise ValueError(f"{name}={value!r} must be a finite number{' ' if bounds else ''}{' and '.join(bounds)}")
    if minimum is not None:
        if strict and not value > minimum:
            raise ValueError(f"{name}={value} must be > {minimum}")
        if not strict and not value >= minimum:
            raise ValueError(f"{name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} must be <= {maximum}")
    return float(value)


def nonfinite_float(text: Any) -> float | None:
    """``"inf"``, ``"-Infinity"``, ``"nan"`` (any case) → that float; anything else → ``None``.

    Command-line and YAML parsers read these spellings as strings, so a float option given
    ``inf`` would be reported as "not a number"; turned into the float, the option's own check
    (:func:`check_float`) names the range it expects.
    """
    if not isinstance(text, str):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isfinite(value) else value


def check_divides(name_a: str, a: int, name_b: str, b: int) -> None:
    """Raise ``ValueError`` unless ``a`` divides ``b`` (e.g. ``n_heads`` divides ``d_model``)."""
    if b % a != 0:
        raise ValueError(f"{name_a}={a} must divide {name_b}={b} (got remainder {b % a})")


def check_width(d_model: Any, n_heads: Any = None, head_dim: Any = None) -> int | None:
    """The one check of a model's or layer's width: ``d_model >= 1``; with ``n_heads``, also
    ``n_heads >= 1`` and, unless an explicit ``head_dim >= 1`` is given, ``n_heads`` dividing
    ``d_model``.

    Returns:
        the head size in use (``head_dim``, or ``d_model // n_heads``), or ``None`` without ``n_heads``.

    Raises:
        ValueError: naming the offending value, e.g. ``n_heads=3 must divide d_model=64``.
    """
    check_int("d_model", d_model, 1)
    if n_heads is None:
        return None
    check_int("n_heads", n_heads, 1)
    if head_dim is not None:
        return check_int("head_dim", head_dim, 1)
    check_divides("n_heads", n_heads, "d_model", d_model)
    return d_model // n_heads
