"""Named attention configs (presets) and ``pattern``, which turns names into layers::

layers = pattern(("window", "window", "global") * 4)        # Gemma-style local/global
layers = pattern(("linear", "linear", "softmax") * 2)         # linear/softmax hybrid
layers = pattern(("band_global_tokens", "linear"))            # an encoder (Longformer-style)
layers = pattern(("based", "based", "based_window"))          # Based (Arora et al. 2024)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from attn.errors import fail
from models.config import AttentionConfig

# The width of the presets' short convolutions (the current token and the three
# before it): Mamba's ``d_conv`` and fla's ``conv_size`` default.
SHORT_CONV = 4
# Based projects queries and keys to 16 channels per head before its Taylor map
# (F = 1 + 16 + 16^2 = 273): a small head dim keeps the state [N,F,H] affordable.
BASED_HEAD_DIM = 16


def presets(
    *,
    num_heads: int = 4,
    head_dim: int = 8,
    gqa_kv_heads: int = 2,
    window: int = 4,
    num_initial_tokens: int = 2,
    global_positions: tuple[int, ...] = (0, 5),
    radius: int | None = None,
    kv_rank: int = 8,
    q_rank: int | None = 16,
    rope_head_dim: int = 4,
    chunk_size: int = 64,
    short_conv: int = SHORT_CONV,
    based_head_dim: int = BASED_HEAD_DIM,
) -> dict[str, AttentionConfig]:
    """A registry of named attention configs sharing N heads of dim H.

    Names: ``mha``/``softmax``/``global`` (full causal softmax, the "global"
    layer of local/global hybrids), ``gqa`` (``gqa_kv_heads`` kv heads), ``mqa``,
    ``mla``, ``window``, ``streaming`` (StreamingLLM: window plus the first
    ``num_initial_tokens`` positions), ``global_tokens`` (window plus Longformer
    global positions), ``linear`` (elu+1), ``linear_decay`` (RetNet gammas),
    ``linear_gated`` (data-dependent gates), ``based`` and ``based_window`` (below).
    ``window_sinks`` is a deprecated alias of ``streaming``, removed in attnlab 0.2.

    ``based`` and ``based_window`` are the two attention layers of Based (Arora
    et al. 2024, "Simple linear attention language models balance the
    recall-throughput tradeoff"), which mixes linear attention with the
    second-order Taylor feature map (``phi(q).phi(k) = 1 + q.k + (q.k)^2/2``, an
    approximation of ``exp(q.k)``), small sliding-window softmax attention and
    short convolutions: ``based`` is Taylor linear attention with head dim
    ``based_head_dim`` (Based's feature dim, 16; here the value dim too, where
    Based's values keep the model's head dim) and ``based_window`` a softmax
    window of ``window``, both with a short convolution of width ``short_conv``
    on their input. Based's convolutions are gated layers of their own; here each
    attention layer convolves its own input (``AttentionConfig.short_conv``; fla's
    ``use_short_conv`` convolves q, k and v instead).

    Window presets are causal (decoder layers). Their bidirectional (encoder)
    counterparts are ``band`` (a band of ``radius``, default ``window``) and
    ``band_global_tokens`` (the band plus the global positions).
    """
    base = AttentionConfig(num_heads=num_heads, head_dim=head_dim)
    linear = dataclasses.replace(base, kind="linear", rope=False, chunk_size=chunk_size)
    mha = base
    streaming = dataclasses.replace(base, window=window, initial_tokens=num_initial_tokens)
    band = dataclasses.replace(base, radius=window if radius is None else radius)
    return {
        "mha": mha,
        "softmax": mha,
        "global": mha,
        "gqa": dataclasses.replace(base, num_kv_heads=gqa_kv_heads),
        "mqa": dataclasses.replace(base, num_kv_heads=1),
        "mla": dataclasses.replace(
            base, kind="mla", kv_rank=kv_rank, q_rank=q_rank, rope_head_dim=rope_head_dim
        ),
        "window": dataclasses.replace(base, window=window),
        "streaming": streaming,
        "window_sinks": streaming,  # deprecated alias of "streaming", removed in attnlab 0.2
        "global_tokens": dataclasses.replace(
            base, window=window, global_tokens=tuple(global_positions)
        ),
        "band": band,
        "band_global_tokens": dataclasses.replace(band, global_tokens=tuple(global_positions)),
        "linear": linear,
        "linear_decay": dataclasses.replace(linear, decay="retnet"),
        "linear_gated": dataclasses.replace(linear, gating=True),
        "based": dataclasses.replace(
            linear, feature_map="taylor", head_dim=based_head_dim, short_conv=short_conv
        ),
        "based_window": dataclasses.replace(base, window=window, short_conv=short_conv),
    }


PRESETS: Mapping[str, AttentionConfig] = presets()


def pattern(
    names: Sequence[str], registry: Mapping[str, AttentionConfig] | None = None
) -> tuple[AttentionConfig, ...]:
    """``ModelConfig.layers`` from preset names, e.g. ``pattern(("window", "global") * 2)``.

    Args:
      names: one preset name per layer.
      registry: name -> ``AttentionConfig``; default ``PRESETS`` (see ``presets``).

    Returns:
      A tuple of L ``AttentionConfig``.
    """
    registry = PRESETS if registry is None else registry
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        fail("names", "a non-empty sequence of preset names", repr(names))
    for name in names:
        if name not in registry:
            fail("names", f"preset names from {sorted(registry)}", repr(name))
    return tuple(registry[name] for name in names)
