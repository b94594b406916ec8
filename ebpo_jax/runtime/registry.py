"""One registry of named entries (task families, environments, estimators, losses).

Built-ins may be named as "module:attribute" and are imported on first use; every unknown
name raises the owner's one-line error, which names the known ones.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any


class Registry:
    """Names to entries, with lazily imported built-ins and per-name marks (e.g. "stateful")."""

    def __init__(
        self,
        unknown: Callable[[str, tuple[str, ...]], Exception],
        builtin: Mapping[str, str] | None = None,
    ):
        self.entries: dict[str, Any] = {}
        self.marks: dict[str, frozenset[str]] = {}
        self._builtin = dict(builtin or {})  # name -> "module:attribute", not yet imported
        self._unknown = unknown  # (name, known names) -> the exception to raise

    def add(self, name: str, entry: Any, *marks: str) -> Any:
        """Registers `entry` under `name` (replacing any), with exactly `marks`; returns it."""
        self.entries[name] = entry
        self.marks[name] = frozenset(marks)
        return entry

    def register(self, name: str, *marks: str) -> Callable[[Any], Any]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry, *marks)

    def names(self) -> tuple[str, ...]:
        """Every name, sorted, built-ins not yet imported included."""
        return tuple(sorted(set(self.entries) | set(self._builtin)))

    def get(self, name: str) -> Any:
        """The entry of `name` (a built-in is imported now); the owner's error if unknown."""
        if name not in self.entries and name in self._builtin:
            module, attr = self._builtin[name].split(":")
            self.entries[name] = getattr(importlib.import_module(module), attr)
        if name not in self.entries:
            raise self._unknown(name, self.names())
        return self.entries[name]

    def marked(self, name: str, mark: str) -> bool:
        """Whether `name` was registered with `mark`."""
        return mark in self.marks.get(name, ())
