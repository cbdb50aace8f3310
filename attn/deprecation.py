"""Deprecated public names: one mechanism, one warning format, one release that removes them.

A renamed name keeps working until ``REMOVED_IN`` and warns where it is used::

    __getattr__ = deprecated_names(__name__, {"FORMS": ("attn.LINEAR_FORMS", lambda: LINEAR_FORMS)})
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = ["REMOVED_IN", "deprecated_names", "warn"]

REMOVED_IN = "attnlab 0.2"


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated in favour of ``new`` (both as a user writes them)."""
    warnings.warn(
        f"{old} is deprecated and removed in {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def deprecated_names(module: str, names: dict[str, tuple[str, Callable[[], object]]]):
    """A module ``__getattr__`` serving old names: ``{old: (new, get)}``, warning on each use."""

    def __getattr__(name: str):
        if name in names:
            new, get = names[name]
            warn(f"{module}.{name}", new)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
