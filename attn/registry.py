"""Named registries: the one mechanism every extensible name of the lab goes through.

Feature maps (``attn.linear.FEATURE_MAPS``), layer kinds (``models.KINDS``),
presets (``models.PRESET_REGISTRY``) and comparison variants (``train.variants.VARIANTS``)
are each a ``Registry``: a read-only mapping from names to entries, filled by
``Registry.add`` (built-in entries and plugins alike) and read at call time,
so an entry added after an import is seen by every module that imported it.

Adding a name that is already there is an error naming both entries, except
when the new entry comes from the same place (the same module and qualified
name) as the old one: re-importing or reloading a plugin replaces its own entries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from attn.checks import fail

__all__ = ["Registry", "defined_at"]

T = TypeVar("T")


def defined_at(obj) -> str:
    """Where ``obj`` is defined: ``"module.qualname"`` (of a class or function, else its type)."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


class Registry(Mapping[str, T], Generic[T]):
    """Names to entries, each added once (see the module docstring).

    Args:
      what: what an entry is, for messages (``"layer kind"``).
      field: the argument or config field that names an entry (``"kind"``), for
        the ``ValueError`` of ``lookup``.
    """

    def __init__(self, what: str, field: str):
        self.what, self.field = what, field
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}

    def add(self, name: str, entry: T, *, defined_by=None) -> T:
        """Adds ``entry`` under ``name`` and returns it.

        Args:
          name: a non-empty string.
          entry: the entry.
          defined_by: the class or function that defines the entry (or its
            ``"module.qualname"``), for messages and for telling a re-import from a
            clash; default ``entry`` itself.

        Raises:
          ValueError: ``name`` is not a non-empty string, or is taken by an
            entry defined elsewhere (the message names both).
        """
        if not isinstance(name, str) or not name or name != name.strip():
            fail(f"{self.what} name", "a non-empty string without surrounding spaces", repr(name))
        if isinstance(defined_by, str):
            where = defined_by
        else:
            where = defined_at(entry if defined_by is None else defined_by)
        old = self._origins.get(name)
        if old is not None and old != where:
            raise ValueError(
                f"{self.field}: {name!r} is already a {self.what}, defined by {old}; "
                f"got a second one defined by {where} (pick another name)"
            )
        self._entries[name] = entry
        self._origins[name] = where
        return entry

    def remove(self, name: str) -> T:
        """Takes ``name`` out again (a notebook's or a test's temporary entry); returns it."""
        entry = self.lookup(name)
        del self._entries[name], self._origins[name]
        return entry

    def origin(self, name: str) -> str:
        """Where the entry ``name`` is defined (``"module.qualname"``)."""
        self.lookup(name)
        return self._origins[name]

    def lookup(self, name, field: str | None = None) -> T:
        """The entry ``name``; a ``ValueError`` naming ``field`` and every name if absent."""
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        fail(field or self.field, f"a {self.what} from {sorted(self._entries)}", repr(name))

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"
