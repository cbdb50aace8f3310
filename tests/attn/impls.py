"""The softmax implementations the property tests iterate: ``attn.dispatch.CAPABILITIES``.

A test says what its case needs (flags of ``attn.dispatch.FLAGS``), never
which implementations: ``impls_with(*flags)`` gives those whose capabilities
cover it and that run on this backend, ``attend(impl)`` is ``attn.attention``
with the tests' settings for it, and ``refuses`` checks that an implementation
given a case it lacks a flag for refuses it by name
(tests/attn/test_capabilities.py checks every cell of the table that way).
"""

from __future__ import annotations

import functools
import re

import jax
import pytest

import attn
from attn.dispatch import CAPABILITIES, FLAGS, IMPLS, OPTIONS

# Most tests' inputs: float32, with a head dim of 8 to 32 (not mosaic's 64 or 128).
SMALL_FLOAT32 = ("float32", "head_dim_8k")

# The tests' settings: small tiles, so small inputs cross several (mosaic's tiles are 64
# or 128: its default), and the kernels in interpret mode on every backend.
SETTINGS = {
    "blockwise": dict(block_q=8, block_k=8),
    "pallas": dict(block_q=8, block_k=8, interpret=True),
    "splash": dict(interpret=True),
    "mosaic": dict(interpret=True),
}

# The argument a refusal names for each flag: how its ValueError's message begins.
ARGUMENTS = {
    "bias": "bias",
    "mask_array": "mask",
    "score_mod": "score_mod",
    "softcap": "softcap",
    "sink": "sink_logits",
    "positions": "q_positions",
    "empty_rows_mean": "empty_rows",
    "return_lse": "return_lse",
    "return_weights": "return_weights",
    "float32": "q",  # mosaic's "q, k, v", cuDNN's "q"
    "head_dim_8k": "head dim H",
    "any_head_dim": "head dim H",
    "cpu": "impl",
}
# jax.nn's route (attn.dispatch._jax_nn) names ``impl`` where jax.nn has no equivalent of
# the argument: "impl: expected an impl computing our semantics for <the argument> ...".
JAX_NN = ("xla", "cudnn")
_JAX_NN_LACKS = ("softcap", "sink", "return_lse", "return_weights")


def runs_here(impl: str) -> bool:
    """Whether ``impl`` runs on this backend: all on a GPU, else those with ``"cpu"`` (the
    kernels interpreted)."""
    return jax.default_backend() == "gpu" or "cpu" in CAPABILITIES[impl]


def impls_with(*flags: str, auto: bool = False) -> list[str]:
    """The implementations whose capabilities include ``flags`` and that run here, in
    ``attn.IMPLS``'s order; ``"auto"`` among them only if ``auto``."""
    unknown = set(flags) - set(FLAGS)
    assert not unknown, f"not flags of attn.dispatch.FLAGS: {sorted(unknown)}"
    return [
        impl
        for impl in IMPLS
        if (auto or impl != "auto") and runs_here(impl) and CAPABILITIES[impl] >= set(flags)
    ]


def interpreted(impl: str) -> bool:
    """Whether ``impl`` runs here as an interpreted kernel (a second or more a case)."""
    return "interpret" in OPTIONS.get(impl, ()) and jax.default_backend() == "cpu"


def params(impls, *, interpreted_in_integration: bool = False) -> list:
    """``impls`` as pytest params; with ``interpreted_in_integration``, the interpreted
    kernels' cases in the integration tier (where the fast tier cannot take their time)."""
    slow = [pytest.mark.integration] if interpreted_in_integration else []
    return [pytest.param(impl, marks=slow if interpreted(impl) else []) for impl in impls]


def impls_without(flag: str) -> list[str]:
    """The implementations that run here and lack ``flag``."""
    return [impl for impl in IMPLS if runs_here(impl) and flag not in CAPABILITIES[impl]]


def attend(impl: str, **tiles):
    """``attn.attention`` with ``impl`` and its test settings; ``tiles`` (``block_q``,
    ``block_k``) replace the settings' where the implementation has them."""
    settings = dict(SETTINGS.get(impl, {}))
    settings |= {name: value for name, value in tiles.items() if name in settings}
    return functools.partial(attn.attention, impl=impl, **settings)


def refusal(impl: str, *flags: str) -> str:
    """A regex for the start of ``impl``'s refusal of a call that needs ``flags`` (one of
    those it lacks is named)."""
    lacking = [flag for flag in flags if flag not in CAPABILITIES[impl]]
    assert lacking, f"{impl} has {flags}"
    names = "|".join(re.escape(ARGUMENTS[flag]) for flag in lacking)
    if impl in JAX_NN and all(flag in _JAX_NN_LACKS for flag in lacking):
        return rf"^impl: expected an impl computing our semantics for .*({names})"
    return rf"^({names})(, k, v)?: expected"


def refuses(impl: str, flags, fn, *args, **kwargs) -> bool:
    """Where ``impl`` lacks one of ``flags``: checks that ``fn(*args, **kwargs)`` raises its
    refusal (``refusal``) and returns True; else returns False, running nothing."""
    if CAPABILITIES[impl] >= set(flags):
        return False
    with pytest.raises(ValueError, match=refusal(impl, *flags)):
        fn(*args, **kwargs)
    return True
