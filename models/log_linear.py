"""The log-linear layers (Guo et al. 2025): Mamba-2 and Gated DeltaNet over a Fenwick tree.

Two layer kinds, each a family choice on its parent's layer: ``models.mamba.Mamba2``
and ``models.delta.DeltaAttention`` (``gate="head"``) given a config with
``num_levels`` replace their one state by ``attn.log_linear_attention``'s
(``attn.log_linear_delta_rule``'s) Fenwick levels, read with per-token level
weights (``models.levels``):

- ``"log_linear_mamba2"`` (``LogLinearMamba2Config`` on ``Mamba2``): q = C,
  k = B, v = dt x, log decay dt A, ``scale=1``, plus Mamba-2's ``D x``.
- ``"log_linear_gated_deltanet"`` (``LogLinearDeltaConfig`` on
  ``DeltaAttention``): the delta rule's q, k, v, beta and log gates
  (``gate="none"``: log-linear DeltaNet).

The level weights are created after the parent's parameters, so with all
weights 1 a layer is its parent with the same parameters. Levels at or above
``L - 1`` share the top weight; ``num_levels`` defaults to 12, every level its own
weight up to ``2^11 = 2048`` tokens (fla takes 15, for 16384).

The presets ``log_linear_mamba2`` and ``log_linear_gated_deltanet`` are
registered here. Neither kind runs sequence-parallel: there is no sharded
log-linear form.
"""

from __future__ import annotations

import dataclasses

from attn.checks import fail
from attn.linear.log_linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
)
from models.config import check_bool, check_positive_int, is_int, register_kind
from models.delta import DeltaAttention, DeltaConfig
from models.mamba import Mamba2, Mamba2Config
from models.patterns import PresetSizes, register_preset

NUM_LEVELS = 12  # every level its own weight up to 2^(12 - 1) = 2048 tokens
NOT_SHARDED = "no sharded log-linear form (its Fenwick levels span the sequence)"


def _check_log_linear(cfg, kind: str, forms: tuple[str, ...]) -> None:
    """The fields both log-linear kinds check: levels, form, chunk size, rope, kv heads."""
    check_positive_int(cfg.num_levels, "num_levels")
    if cfg.form not in forms:
        fail("form", f"one of {forms} for kind={kind!r}", repr(cfg.form))
    c = cfg.chunk_size
    if not is_int(c) or c < 1 or c & (c - 1):
        why = "the levels align with chunks"
        fail("chunk_size", f"a power of 2 for kind={kind!r} ({why})", repr(c))
    if cfg.rope:
        fail("rope", f"False for kind={kind!r} (the recurrence orders the tokens)", "True")


# ----------------------------------------------------------------------------
# Log-linear Mamba-2


@dataclasses.dataclass(frozen=True)
class LogLinearMamba2Config(Mamba2Config):
    """A log-linear Mamba-2 layer (kind ``"log_linear_mamba2"``): ``Mamba2Config``'s
    fields (``form`` one of ``attn.LOG_LINEAR_FORMS``, ``chunk_size`` a power of 2,
    ``negative_eigenvalues`` False) and:

    Attributes:
      num_levels: L, the Fenwick levels with weights of their own (levels from
        L - 1 up share the last); ``L >= bit_length(T - 1) + 1`` separates all
        of T tokens.
    """

    kind: str = "log_linear_mamba2"
    num_levels: int = NUM_LEVELS

    def check_fields(self) -> None:
        _check_log_linear(self, "log_linear_mamba2", LOG_LINEAR_FORMS)
        check_bool(self.negative_eigenvalues, "negative_eigenvalues")
        if self.negative_eigenvalues:
            why = "the log-linear forms take decays in [0, 1]"
            fail("negative_eigenvalues", f"False for kind='log_linear_mamba2' ({why})", "True")
        if self.num_kv_heads is not None:
            why = "B and C are shared by groups of heads; set groups"
            fail("num_kv_heads", f"None for kind='log_linear_mamba2' ({why})", self.num_kv_heads)
        super().check_fields()


register_kind(
    "log_linear_mamba2",
    Mamba2,
    config=LogLinearMamba2Config,
    family="linear",
    sequence_parallel=NOT_SHARDED,
    in_order=True,
)


# ----------------------------------------------------------------------------
# Log-linear Gated DeltaNet

LOG_LINEAR_GATES = ("none", "head")


@dataclasses.dataclass(frozen=True)
class LogLinearDeltaConfig(DeltaConfig):
    """A log-linear Gated DeltaNet layer (kind ``"log_linear_gated_deltanet"``):
    ``DeltaConfig``'s fields (``form`` one of ``attn.LOG_LINEAR_DELTA_FORMS``,
    ``chunk_size`` a power of 2, ``gate`` ``"head"`` or ``"none"`` (log-linear
    DeltaNet), ``householder_steps`` 1) and:

    Attributes:
      num_levels: L, as ``LogLinearMamba2Config.num_levels``.
    """

    kind: str = "log_linear_gated_deltanet"
    num_levels: int = NUM_LEVELS

    def check_fields(self) -> None:
        kind = "log_linear_gated_deltanet"
        _check_log_linear(self, kind, LOG_LINEAR_DELTA_FORMS)
        if self.gate not in LOG_LINEAR_GATES:
            why = "attn.log_linear_delta_rule takes one gate per head, or none"
            fail("gate", f"one of {LOG_LINEAR_GATES} for kind={kind!r} ({why})", repr(self.gate))
        if self.householder_steps != 1:
            why = "attn.log_linear_delta_rule writes one key per token"
            fail("householder_steps", f"1 for kind={kind!r} ({why})", repr(self.householder_steps))
        if self.num_kv_heads is not None:
            why = "q and k share heads; set value_heads for more value heads"
            fail("num_kv_heads", f"None for kind={kind!r} ({why})", repr(self.num_kv_heads))
        super().check_fields()


register_kind(
    "log_linear_gated_deltanet",
    DeltaAttention,
    config=LogLinearDeltaConfig,
    family="linear",
    sequence_parallel=NOT_SHARDED,
    in_order=True,
)


# ----------------------------------------------------------------------------
# Presets


def _mamba2(sizes: PresetSizes) -> LogLinearMamba2Config:
    return LogLinearMamba2Config(
        num_heads=sizes.num_heads,
        head_dim=sizes.head_dim,
        state_dim=sizes.state_dim,
        chunk_size=sizes.chunk_size,
        conv=sizes.short_conv,
    )


def _gated_deltanet(sizes: PresetSizes) -> LogLinearDeltaConfig:
    return LogLinearDeltaConfig(
        num_heads=sizes.num_heads, head_dim=sizes.head_dim, chunk_size=sizes.chunk_size
    )


register_preset(
    "log_linear_mamba2",
    _mamba2,
    description="Log-linear Mamba-2: the SSD over a Fenwick tree of states (Guo et al. 2025)",
)
register_preset(
    "log_linear_gated_deltanet",
    _gated_deltanet,
    description="Log-linear Gated DeltaNet: the delta rule over a Fenwick tree of states",
)
