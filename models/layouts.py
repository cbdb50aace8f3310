"""The layer layouts production hybrids ship, as ``layers(L) -> L preset names``.

Each layout reproduces a released model's mixer pattern and its attention layer
at the caller's sizes (``models.presets``); the MLPs, MoEs and widths are the
caller's. What each reads from its authors' code, and where it departs:

* ``qwen3_next`` (Qwen3-Next-80B-A3B): three Gated DeltaNet layers, then one gated
  attention layer (``qwen3_next_attention``: GQA with ``gqa_kv_heads`` kv heads, the
  elementwise sigmoid output gate, q/k RMSNorm, RoPE on the first quarter of each
  head). Departs: its Gated DeltaNet has twice as many value heads as key heads;
  ours one each.
* ``kimi_linear`` (Kimi-Linear-48B-A3B): three KDA layers, then one MLA layer, and
  the last layer MLA too (layers 4, 8, ..., 24 and 27 of 27, 1-based). Its MLA has
  no positions (``kimi_mla``: ``mla_use_nope``, a direct query projection).
* ``nemotron_h`` (Nemotron-H-8B): Mamba-2 layers with GQA attention without
  positions (``nope_gqa``) at mixers 4, 10, 16, ... (0-based: every sixth, the first
  after four Mamba-2 layers); a stack of fewer than five layers has one attention
  layer, in its middle (layer L // 2). Jamba's is the same attention among Mamba-1
  layers, one in eight.
* ``minimax01`` (MiniMax-Text-01): seven lightning attention layers (``lightning``,
  ``models.lightning``), then one softmax layer (``minimax_attention``: GQA, RoPE
  on half of each head at base 10^7), the model ending on softmax.

A layout's attention layers are counted from the top where the model ends on one
(Qwen3-Next's and MiniMax's do: layer L-1 is attention, then every fourth, or
eighth, below it), so a short stack keeps the ratio and the last layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attn.checks import fail, positive_int
from models.patterns import register_preset


@dataclass(frozen=True)
class Layout:
    """A production layout: a description and ``layers(L) -> L preset names``."""

    description: str
    layers: Callable[[int], tuple[str, ...]]


def _from_top(linear: str, attention: str, period: int) -> Callable[[int], tuple[str, ...]]:
    """``attention`` at layers L-1, L-1-period, ...; ``linear`` elsewhere."""
    return lambda L: tuple(attention if (L - 1 - i) % period == 0 else linear for i in range(L))


def _kimi_linear(L: int) -> tuple[str, ...]:
    """MLA at every fourth layer (1-based) and the last; KDA elsewhere."""
    return tuple("kimi_mla" if (i + 1) % 4 == 0 or i == L - 1 else "kda" for i in range(L))


def _nemotron_h(L: int) -> tuple[str, ...]:
    """``nope_gqa`` at layers 4, 10, 16, ... (at L // 2 under five layers); Mamba-2 elsewhere."""
    attention = {i for i in range(L) if i % 6 == 4} or {L // 2}
    return tuple("nope_gqa" if i in attention else "mamba2" for i in range(L))


LAYOUTS: dict[str, Layout] = {
    "qwen3_next": Layout(
        "Qwen3-Next: 3 Gated DeltaNet : 1 gated attention",
        _from_top("gated_deltanet", "qwen3_next_attention", 4),
    ),
    "kimi_linear": Layout("Kimi Linear: 3 KDA : 1 MLA without positions", _kimi_linear),
    "nemotron_h": Layout(
        "Nemotron-H: Mamba-2, attention without positions in one of six", _nemotron_h
    ),
    "minimax01": Layout(
        "MiniMax-01: 7 lightning : 1 softmax", _from_top("lightning", "minimax_attention", 8)
    ),
}


def layout(name: str, num_layers: int) -> tuple[str, ...]:
    """The preset names of layout ``name`` at ``num_layers`` layers.

    Raises:
      ValueError: ``name`` is not in ``LAYOUTS`` or ``num_layers`` is not a positive int.
    """
    if name not in LAYOUTS:
        fail("name", f"one of {sorted(LAYOUTS)}", repr(name))
    return LAYOUTS[name].layers(positive_int(num_layers, "num_layers"))


register_preset(
    "qwen3_next_attention",
    lambda s: s.base(
        num_kv_heads=s.gqa_kv_heads,
        rotary_dim=max(2, s.head_dim // 4 // 2 * 2),
        qk_norm=True,
        output_gate="elementwise",
    ),
    description="Qwen3-Next's attention: GQA, q/k RMSNorm, RoPE on a quarter, elementwise gate",
)
register_preset(
    "kimi_mla",
    lambda s: s.latent(rope=False, q_rank=None),
    description="Kimi Linear's MLA: no positions (NoPE), a direct query projection",
)
register_preset(
    "nope_gqa",
    lambda s: s.base(rope=False, num_kv_heads=s.gqa_kv_heads),
    description="GQA without positions (Jamba's and Nemotron-H's attention)",
)
register_preset(
    "minimax_attention",
    lambda s: s.base(
        num_kv_heads=s.gqa_kv_heads,
        rotary_dim=max(2, s.head_dim // 2 // 2 * 2),
        rope_base=1e7,
    ),
    description="MiniMax-01's softmax layer: GQA, RoPE on half of each head at base 1e7",
)
