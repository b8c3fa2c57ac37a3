"""Small name → entry registries: one per option family (docs/architecture.md, "Options that plug in").

An option family (CEM interactions, MLP ties, step maps, NRGPT attention and feed-forward
energies, norms) is a :class:`Registry`. Each entry is one class that owns its parameters, its
validation, its defaults and its parameter accounting; adding a parameterization is one
``@REGISTRY.register("name")`` and its tests. Configs store the entry's name (a string), so
recipes, checkpoints and the CLI need no change when an entry is added::

    from energyformer.layers.cem_options import INTERACTIONS

    @INTERACTIONS.register("my_interaction")
    class MyInteraction(InteractionBase):
        ...
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping ``name -> entry`` for one option family.

    Args:
        option: the option name users write (``"interaction"``, ``"eta_param"``, ...); it is used
            in every error message.

    Raises:
        ValueError: from :meth:`register` for a duplicate name, from :meth:`get` for an unknown one
            (the message lists the registered names).
    """

    def __init__(self, option: str):
        self.option = option
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("name")`` adds the class (or function) under ``name``.

        The entry gets ``entry.name = name``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.option}: an entry name must be a non-empty string, got {name!r}")

        def deco(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.option}={name!r} is already registered ({self._entries[name]!r})")
            try:
                entry.name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            self._entries[name] = entry
            return entry

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register toy entries). Unknown names are ignored."""
        self._entries.pop(name, None)

    def get(self, name: Any, option: str | None = None) -> T:
        """The entry registered as ``name``; ``option`` overrides the option name in the error message
        (one registry can serve options of several names, e.g. ``preconditioner`` and ``eta_param``).

        Raises:
            ValueError: ``name`` is not registered; the message names the option, the value and the
                allowed names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            allowed = ", ".join(repr(k) for k in self._entries)
            raise ValueError(f"{option or self.option}={name!r} is not valid; expected one of {allowed}") from None

    def check(self, name: Any, option: str | None = None) -> Any:
        """Raise ``ValueError`` (as :meth:`get`) unless ``name`` is registered; return ``name``."""
        self.get(name, option)
        return name

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.option!r}: {', '.join(self._entries)})"
