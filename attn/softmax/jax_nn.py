"""``jax.nn.dot_product_attention``'s arguments in the call's own terms.

Internal to ``attn.softmax``: ``check_call`` translates them, so every
softmax entry point takes them with ``jax.nn``'s meaning and every
implementation runs them through its own masks, positions and segment ids:

* ``mask`` as a boolean array: ``keep`` (``attn.softmax.pairs``);
* ``is_causal``: ``masks.causal()``; ``local_window_size=(l, r)``:
  ``masks.band(l, r)``. Both are aligned to the top-left corner, as ``jax.nn``
  aligns them: without ``q_positions`` the queries take positions
  ``arange(T)`` (our default puts them at the last T key positions; the two
  agree when T == S);
* ``query_seq_lengths``, ``key_value_seq_lengths``: tokens past a row's length
  are padding (segment id 0): a padding query outputs 0 (as in ``jax.nn``) and
  no query sees a padding key.

One difference stays, by design: a query that sees no key outputs 0 here and
the mean of V in ``jax.nn``; ``attn.attention(..., empty_rows="mean")`` gives
``jax.nn``'s (``mean_where_empty``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import masks
from attn.checks import Dims, concrete, fail
from attn.masks import PADDING, Mask
from attn.softmax.pairs import check_pair

EMPTY_ROWS = ("zero", "mean")


def translate(d: Dims, mask, is_causal, window, q_lengths, kv_lengths, q_positions, q_seg, kv_seg):
    """``(mask, keep, q_positions, q_segment_ids, kv_segment_ids)`` in our terms.

    Returns the mask (a ``Mask`` or None), the boolean ``keep`` array or None,
    and the positions and ids as given, or made from the lengths.
    """
    keep = None
    if mask is not None and not isinstance(mask, Mask):
        keep, mask = check_pair(mask, "mask", d, boolean=True), None
    if not isinstance(is_causal, bool | np.bool_):
        fail("is_causal", "a bool", repr(is_causal))
    extra = [masks.causal()] if is_causal else []
    if window is not None:
        extra.append(masks.band(*_window(window)))
    for m in extra:
        mask = m if mask is None else mask & m
    if extra and q_positions is None and d.T != d.S:
        q_positions = np.arange(d.T, dtype=np.int32)  # jax.nn's top-left corner
    if q_lengths is not None or kv_lengths is not None:
        if q_seg is None and kv_seg is None:  # one segment per row, cut at its lengths
            q_seg, kv_seg = jnp.ones((d.B, d.T), jnp.int32), jnp.ones((d.B, d.S), jnp.int32)
        q_seg = _within(q_seg, q_lengths, "query_seq_lengths", d.B, d.T)
        kv_seg = _within(kv_seg, kv_lengths, "key_value_seq_lengths", d.B, d.S)
    return mask, keep, q_positions, q_seg, kv_seg


def _window(window) -> tuple[int, int]:
    """``local_window_size``: an int ``w`` (``(w, w)``) or a pair ``(left, right)``, each a
    non-negative int (checked here, so the error names the caller's argument)."""
    pair = (window, window) if not isinstance(window, tuple | list) else tuple(window)
    if len(pair) != 2 or not all(_count(x) for x in pair):
        fail("local_window_size", "an int or a pair (left, right) of non-negative ints",
             repr(window))  # fmt: skip
    return int(pair[0]), int(pair[1])


def _count(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and x >= 0


def _within(ids, lengths, name: str, batch: int, length: int):
    """Segment ids with the tokens at or past ``lengths [B]`` as padding (None: as given)."""
    if lengths is None:
        return ids
    value = concrete(lengths)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        fail(name, f"integer lengths of shape ({batch},)", f"{lengths.dtype} {lengths.shape}")
    if value is not None and value.min() < 0:
        fail(name, "lengths >= 0", f"min {value.min()}")
    base = jnp.asarray(ids)
    inside = jnp.arange(length)[None, :] < lengths[:, None]
    return jnp.where(inside, base, jnp.asarray(PADDING, base.dtype))


def mean_where_empty(call, out, lse, v):
    """``out`` with every real query that sees no key set to the mean of its kv head's V.

    ``jax.nn``'s output there (its softmax spreads evenly over all S keys once
    every logit is masked); padding queries (segment id 0) keep their zeros,
    as ``jax.nn``'s padded queries do. ``lse [B,T,N]`` is ``-inf`` on empty rows.
    """
    d = call.dims
    empty = jnp.isneginf(lse)  # [B,T,N]
    if call.q_segment_ids is not None:
        empty = empty & (call.q_segment_ids != PADDING)[:, :, None]
    mean = v.astype(jnp.float32).mean(1)  # [B,K,E]
    mean = jnp.repeat(mean, d.G, axis=1)[:, None]  # [B,1,N,E]
    return jnp.where(empty[..., None], mean.astype(out.dtype), out)
