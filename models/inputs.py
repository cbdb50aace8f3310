"""The checks of the models' token inputs: token ids, lengths, positions and segment ids.

Every public entry point of ``models`` (the models' calls, ``prefill``,
``generate``) checks what it is given here, and raises the project's
``ValueError`` (``attn.checks.fail``) naming the argument. Values are checked
where they are known (not under a trace).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import checks, masks
from attn.checks import concrete, fail

__all__ = [
    "MIN_BUCKET",
    "bucket",
    "check_lengths",
    "check_positions",
    "check_tokens",
    "pad_to",
    "segments",
]

# Prompts are padded to a bucket's width (a power of two, at least MIN_BUCKET), so
# generate and serve compile once per bucket of prompt lengths, not once per length:
# a compile costs seconds, the padded positions a prefill of at most twice the tokens.
MIN_BUCKET = 16


def check_tokens(tokens, name: str = "tokens", vocab: int | None = None):
    """Integer ids ``[B,T]``; with ``vocab``, values in ``[0, vocab)`` when concrete.

    Under a trace the values cannot be checked; the models' embedding then gives
    an out-of-range id a NaN embedding, so its logits are NaN rather than plausible.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        fail(name, "integer token ids of shape [B,T]", f"{tokens.dtype} {tokens.shape}")
    if tokens.shape[1] == 0:
        fail(name, "at least one token per row", f"shape {tokens.shape}")
    value = None if vocab is None else concrete(tokens)
    if value is not None and ((value < 0).any() or (value >= vocab).any()):
        fail(name, f"token ids in [0, {vocab})", f"ids from {value.min()} to {value.max()}")
    return tokens


def pad_prompts(prompts, name: str = "prompt"):
    """A list of 1-D token sequences as ``(tokens [B,T] int32 right-padded with 0, lengths [B])``.

    T is the longest prompt; row b's real tokens are its first ``lengths[b]``.
    """
    rows = []
    for i, p in enumerate(prompts):
        p = np.asarray(p)
        if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
            fail(f"{name}[{i}]", "a non-empty 1-D sequence of token ids", f"{p.dtype} {p.shape}")
        rows.append(p)
    if not rows:
        fail(name, "at least one prompt", "an empty list")
    T = max(len(p) for p in rows)
    tokens = np.zeros((len(rows), T), np.int32)
    for b, p in enumerate(rows):
        tokens[b, : len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in rows], jnp.int32)


def bucket(n: int, limit: int | None = None) -> int:
    """The width ``n`` tokens are padded to: the next power of two, at least ``MIN_BUCKET``,
    at most ``limit`` (the room there is), and never below ``n``."""
    width = max(MIN_BUCKET, 1 << (max(int(n), 1) - 1).bit_length())
    return max(int(n), width if limit is None else min(width, int(limit)))


def pad_to(tokens, width: int):
    """``[B,T]`` tokens right-padded with 0 to ``[B,width]`` (``width >= T``)."""
    return jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))


def check_lengths(lengths, B: int, T: int, name: str = "lengths", minimum: int = 0):
    """None, or ``[B]`` int32 lengths in ``[minimum, T]`` (values checked when concrete)."""
    if lengths is None:
        return None
    value = concrete(lengths)  # as given: an int64 length must not wrap into range
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        fail(name, f"integer lengths of shape ({B},)", f"{lengths.dtype} {lengths.shape}")
    if value is not None and ((value < minimum).any() or (value > T).any()):
        fail(name, f"values in [{minimum}, {T}]", value.tolist())
    return lengths.astype(jnp.int32)


def segments(tokens, lengths, segment_ids, name: str = "lengths"):
    """Segment ids ``[B,T]`` int32 (id 0 is padding) from ``lengths`` or ``segment_ids``, or None.

    The one representation of padding and packing inside the models: ``lengths``
    becomes ``masks.segment_ids_from_lengths`` (1 on tokens, 0 on right padding).
    """
    B, T = tokens.shape
    if lengths is not None and segment_ids is not None:
        fail("segment_ids", f"None when {name} is given", "both")
    if segment_ids is not None:
        checks.segment_values(segment_ids, "segment_ids")  # as given: int64 must not wrap
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            fail(
                "segment_ids",
                f"integer ids of shape ({B}, {T})",
                f"{segment_ids.dtype} {segment_ids.shape}",
            )
        return segment_ids.astype(jnp.int32)
    lengths = check_lengths(lengths, B, T, name)
    return None if lengths is None else masks.segment_ids_from_lengths(lengths, T)


def check_positions(positions, tokens):
    """None, or integer positions ``[B,T]`` shaped like ``tokens``."""
    if positions is None:
        return None
    checks.in_range(positions, "positions", -checks.MAX_POSITION, checks.MAX_POSITION, "positions")
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
        fail("positions", f"integer positions of shape {tokens.shape}", positions.shape)
    return positions
