"""Name -> object registries: the one extension mechanism of the project (docs/architecture.md, convention 3).

Algorithms, advantage estimators, policy losses, rollout engines and rewards are registered under a
name and resolved once at start-up. A duplicate name is refused; an unknown name lists the valid ones.

>>> r = Registry("widget")
>>> @r.register("a")
... def make_a():
...     return 1
>>> r.get("a")()
1
>>> r.get("b")
Traceback (most recent call last):
...
ValueError: unknown widget 'b'; valid names: ['a']
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to objects that refuses duplicates and names the valid keys on a miss."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name``."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def remove(self, name: str) -> T:
        """Unregister ``name`` (a plugin's or a test's registration), returning what it held."""
        self.get(name)  # the same error as a lookup when it is not registered
        return self._items.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {sorted(self._items)}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
