"""Named attention configs (presets) and ``pattern``, which turns names into layers::

layers = pattern(("window", "window", "global") * 4)        # Gemma-style local/global
layers = pattern(("linear", "linear", "softmax") * 2)         # linear/softmax hybrid
layers = pattern(("band_global_tokens", "linear"))            # an encoder (Longformer-style)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from models.config import AttentionConfig, _fail


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
) -> dict[str, AttentionConfig]:
    """A registry of named attention configs sharing N heads of dim H.

    Names: ``mha``/``softmax``/``global`` (full causal softmax, the "global"
    layer of local/global hybrids), ``gqa`` (``gqa_kv_heads`` kv heads), ``mqa``,
    ``mla``, ``window``, ``streaming`` (StreamingLLM: window plus the first
    ``num_initial_tokens`` positions), ``global_tokens`` (window plus Longformer
    global positions), ``linear`` (elu+1), ``linear_decay`` (RetNet gammas),
    ``linear_gated`` (data-dependent gates). ``window_sinks`` is a deprecated
    alias of ``streaming``, kept for one release.

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
        "window_sinks": streaming,  # deprecated alias of "streaming"
        "global_tokens": dataclasses.replace(
            base, window=window, global_tokens=tuple(global_positions)
        ),
        "band": band,
        "band_global_tokens": dataclasses.replace(band, global_tokens=tuple(global_positions)),
        "linear": linear,
        "linear_decay": dataclasses.replace(linear, decay="retnet"),
        "linear_gated": dataclasses.replace(linear, gating=True),
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
        _fail("names", "a non-empty sequence of preset names", names)
    for name in names:
        if name not in registry:
            _fail("names", f"preset names from {sorted(registry)}", name)
    return tuple(registry[name] for name in names)
