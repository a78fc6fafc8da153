"""Name -> function registries, one per kind of algorithm component.

Every loss, ratio, advantage estimator, aggregation mode and KL estimator is a pure
function registered under a name. A preset is a named combination of those names, and a
config refers to components only by name, so the valid choices are always read from here,
never typed out by hand in docs or error messages.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Sequence, TypeVar

from keelrl.errors import ConfigError

F = TypeVar("F", bound=Callable)


class UnknownNameError(ConfigError, KeyError):
    """A component name that is not in its registry. The message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable.
        return ValueError.__str__(self)


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered component: its name, the function and a one-line summary."""

    name: str
    fn: F
    summary: str
    tags: frozenset[str] = frozenset()


class Registry(Generic[F]):
    """A registry of one kind of component, all sharing one call signature.

    Registering a name twice, or a function whose parameters are not `params`, raises at
    import time. Looking up an unknown name raises `UnknownNameError` naming the kind, the bad
    name and every valid name.
    """

    def __init__(self, kind: str, params: Sequence[str] | None = None) -> None:
        self.kind = kind
        self.params = tuple(params) if params is not None else None
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, *, summary: str, tags: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Decorator: register `fn` under `name` with a one-line human `summary`.

        `tags` mark properties other code asks about (e.g. 'critic': needs value predictions).
        """

        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"duplicate {self.kind} name {name!r}: already registered "
                                 f"by {self._entries[name].fn.__module__}."
                                 f"{self._entries[name].fn.__qualname__}")
            if self.params is not None:
                found = tuple(inspect.signature(fn).parameters)
                if found != self.params:
                    raise TypeError(f"{self.kind} {name!r} takes ({', '.join(found)}); every {self.kind} "
                                    f"must take ({', '.join(self.params)})")
            self._entries[name] = Entry(name=name, fn=fn, summary=summary, tags=frozenset(tags))
            return fn

        return decorate

    def unregister(self, name: str) -> None:
        """Remove `name` (a notebook re-defining its component, a test cleaning up); KeyError if absent."""
        if name not in self._entries:
            raise KeyError(self._unknown(name))
        del self._entries[name]

    def get(self, name: str) -> F:
        return self.entry(name).fn

    def entry(self, name: str) -> Entry[F]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError("", self._unknown(name)) from None

    def check(self, name: str, field: str) -> None:
        """Raise a config-time error naming the dotted `field` if `name` is not registered."""
        if name not in self._entries:
            raise UnknownNameError(field, self._unknown(name))

    def _unknown(self, name: object) -> str:
        return f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
