"""Name -> object registries: the one mechanism behind every kind of named component.

Each kind of component (an advantage estimator, a sink, an environment, a critic, an alarm,
an audit probe...) has one `Registry`. A config refers to a component only by its name, so the
valid choices are always read from the registry, never typed out by hand in docs or error
messages.

What a registry guarantees: a name is registered at most once (a duplicate raises, leaving the
first registration in place); when the registry declares `params`, every callable registered
takes exactly those parameters, by name and in order (checked at registration, so at import);
looking up an unknown name raises `UnknownNameError` naming the kind, the bad name and every
valid name. Names iterate in registration order.

What it does not guarantee: anything about what a registered object does, or that a registry
holds the same names in every process (registration happens at import, and a user or a test may
register or unregister names at run time). It is not thread-safe against concurrent
registration; registration is expected at import time.

This module is on the bottom floor: it imports only `keelrl.errors`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from keelrl.errors import ConfigError

T = TypeVar("T")


class UnknownNameError(ConfigError, KeyError):
    """A component name that is not in its registry. The message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable.
        return ValueError.__str__(self)


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its name, the object, a one-line summary and its tags."""

    name: str
    obj: T
    summary: str
    tags: frozenset[str] = frozenset()

    @property
    def fn(self) -> T:
        """`obj`, under the name it had when only functions were registered."""
        return self.obj


class Registry(Generic[T]):
    """The registry of one kind of component (see the module docstring).

    Iterating it, `len` and `in` work on the names, and `registry[name]` gives the registered
    object, so a registry stands wherever code reads a name -> object mapping.
    """

    def __init__(self, kind: str, params: Sequence[str] | None = None) -> None:
        """`kind` names the component in error messages ("sink", "advantage estimator");
        `params`: the parameter names every registered callable must take (None: not checked)."""
        self.kind = kind
        self.params = tuple(params) if params is not None else None
        self._entries: dict[str, Entry[T]] = {}

    # ------------------------------------------------------------------ registering
    def register(self, name: str, *, summary: str, tags: Sequence[str] = ()) -> Callable[[T], T]:
        """Decorator: register the decorated function or class under `name` with a one-line `summary`.

        `tags` mark properties other code asks about (e.g. 'critic': needs value predictions).
        """

        def decorate(obj: T) -> T:
            return self.add(name, obj, summary=summary, tags=tags)

        return decorate

    def add(self, name: str, obj: T, *, summary: str = "", tags: Sequence[str] = ()) -> T:
        """Register `obj` (any object: a spec, a class, a function) under `name`; returns `obj`.

        ValueError for a duplicate name, TypeError for a callable whose parameters are not
        `params` (when the registry declares them); either way nothing is registered.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty str, got {name!r}")
        if name in self._entries:
            raise ValueError(f"duplicate {self.kind} name {name!r}: already registered"
                             f"{_registered_by(self._entries[name].obj)}")
        if self.params is not None:
            found = tuple(inspect.signature(obj).parameters) if callable(obj) else None
            if found != self.params:
                takes = f"takes ({', '.join(found)})" if found is not None else "is not callable"
                raise TypeError(f"{self.kind} {name!r} {takes}; every {self.kind} "
                                f"must take ({', '.join(self.params)})")
        self._entries[name] = Entry(name=name, obj=obj, summary=summary, tags=frozenset(tags))
        return obj

    def unregister(self, name: str) -> None:
        """Remove `name` (a notebook re-defining its component, a test cleaning up); UnknownNameError if absent."""
        if name not in self._entries:
            raise UnknownNameError("", self._unknown(name))
        del self._entries[name]

    # ------------------------------------------------------------------ looking up
    def get(self, name: str) -> T:
        """The object registered as `name`; UnknownNameError (never a default) if there is none."""
        return self.entry(name).obj

    def entry(self, name: str) -> Entry[T]:
        """The whole entry of `name` (object, summary, tags); UnknownNameError if absent."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name is unknown too
            raise UnknownNameError("", self._unknown(name)) from None

    def check(self, name: str, field: str) -> None:
        """Raise a config-time error naming the dotted `field` if `name` is not registered."""
        if name not in self:
            raise UnknownNameError(field, self._unknown(name))

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def entries(self) -> list[Entry[T]]:
        """The registered entries, in registration order."""
        return list(self._entries.values())

    def _unknown(self, name: object) -> str:
        valid = ", ".join(self._entries) if self._entries else "(none registered)"
        return f"unknown {self.kind} {name!r}; valid names: {valid}"

    # ------------------------------------------------------------------ the mapping view
    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # an unhashable name is not registered
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))  # a copy: a loop body may register or unregister

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


def _registered_by(obj: object) -> str:
    """' by module.qualname' for a function or class, '' for other objects."""
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(qualname, str) and (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
        return f" by {obj.__module__}.{qualname}"
    return ""
