"""Deprecated: the input checks are ``attn.checks`` (this name is removed in attnlab 0.2)."""

from attn.checks import *  # noqa: F403
from attn.checks import __all__  # noqa: F401
from attn.deprecation import warn

warn("attn.errors", "attn.checks")
