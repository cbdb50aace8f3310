"""The driver every family whose state is a model trained on the sequence shares (TTT, Titans).

Checks what the families' calls share (the heads, the inner LayerNorm, the inner
model's shapes, segment ids), lays the rows' segments out for the forms
(``attn.linear.ttt_forms``) and runs a form per row and head. With segment ids the
blocked forms lay each segment on its own mini-batch grid (``grid``); rows whose
segments need more blocks than the grid has run token by token (the recurrent form:
the same function), so a call is exact whatever its segments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks, masks
from attn.checks import fail
from attn.linear import front, segments, ttt_forms

MEMORIES = ("linear", "mlp")


def model_shapes(memory: str, N: int, H: int, F: int):
    """The per-head shapes of an inner model: linear ``(W, b)``, MLP ``(W1, b1, W2, b2)``."""
    return [(N, H, F), (N, F), (N, F, H), (N, H)] if memory == "mlp" else [(N, H, H), (N, H)]


def zero_model(memory: str, N: int, H: int, hidden: int | None = None):
    F = 4 * H if hidden is None else hidden
    return tuple(jnp.zeros(s, jnp.float32) for s in model_shapes(memory, N, H, F))


def check_heads(q, k, v, per_token: dict, norm_scale, norm_bias, step: bool):
    """The heads as every family checks them (``front.check_heads``), one width and one head
    count for q, k and v (the target is ``v - k``), the families' per-token ``[B,T,N]``
    arrays and the LayerNorm's ``[N,H]``. Returns ``(B, T, N, H)``."""
    B, T, _, N, H, _ = front.check_heads(q, k, v, step, per_token)
    if v.shape != q.shape:
        fail("v", f"the shape of q and k {tuple(q.shape)} (the target is v - k)",
             f"shape {tuple(v.shape)}")  # fmt: skip
    if (norm_scale is None) != (norm_bias is None):
        fail("norm_scale, norm_bias", "both arrays or both None (no LayerNorm)",
             f"{type(norm_scale).__name__}, {type(norm_bias).__name__}")  # fmt: skip
    for name, x in (("norm_scale", norm_scale), ("norm_bias", norm_bias)):
        if x is not None and np.shape(x) != (N, H):
            fail(name, f"shape {(N, H)} = [N,H]", f"shape {np.shape(x)}")
    return B, T, N, H


def check_model(model, state_params, memory: str, N: int, H: int):
    """The per-head model ``[N,...]`` float32 segments restart from: ``model`` checked, or
    zeros of the state's width (an MLP's F: the state's, else 4H). ``state_params``: the
    given state's weights (checked against it by the caller), or None."""
    want = "an MLP's 4 arrays (W1, b1, W2, b2)" if memory == "mlp" else "2 arrays (W, b)"
    for field, arrays in (("model", model), ("initial_state.params", state_params)):
        if arrays is not None and (not isinstance(arrays, tuple | list)
                                   or len(arrays) != (4 if memory == "mlp" else 2)):  # fmt: skip
            fail(field, want, f"{type(arrays).__name__} of {len(arrays)}")
    hidden = None
    if memory == "mlp":
        source = model if model is not None else state_params
        hidden = None if source is None else np.shape(source[0])[-1]
    zero = zero_model(memory, N, H, hidden)
    if model is None:
        return zero
    for i, (x, z) in enumerate(zip(model, zero, strict=True)):
        front.check_state(x, f"model[{i}]", z.shape, "[N,...] (per head)")
    return tuple(jnp.asarray(x, jnp.float32) for x in model)


def check_trees(state, fields: tuple[str, ...], model, B: int):
    """Each of ``state``'s ``fields`` (trees of the model's shapes per row) checked, in
    float32, and its count ``[B]``."""
    trees = []
    for field in fields:
        arrays = getattr(state, field)
        if not isinstance(arrays, tuple | list) or len(arrays) != len(model):
            fail(f"initial_state.{field}", f"{len(model)} arrays, as the model", repr(arrays))
        for i, (x, m) in enumerate(zip(arrays, model, strict=True)):
            front.check_state(x, f"initial_state.{field}[{i}]", (B, *m.shape), "[B,N,...]")
        trees.append(tuple(jnp.asarray(x, jnp.float32) for x in arrays))
    if np.shape(state.count) != (B,):
        fail("initial_state.count", f"shape ({B},)", f"shape {np.shape(state.count)}")
    return tuple(trees), jnp.asarray(state.count, jnp.int32)


def run(rule, q, k, v, gates, hyper, norms, trees, count, model, *, form: str, b_size: int,
        aligned: bool, q_seg, kv_seg):  # fmt: skip
    """A rule over the rows: ``(out [B,T,N,H] float32, (trees, count [B]))``.

    Args:
      rule: ``ttt_forms.Rule``.
      q, k, v: ``[B,T,N,H]``; gates ``[B,T,N,G]``; hyper the rule's arrays (shared).
      norms: the LayerNorm's ``(scale, bias)`` ``[N,H]`` or ``(None, None)``.
      trees: the state's trees, leaves ``[B,N,...]``; count ``[B]``.
      model: the per-head model ``[N,...]`` a segment restarts from.
      form: ``"dual"``, ``"primal"`` or ``"recurrent"``; b_size: the mini-batch.
      aligned: every row starts at a mini-batch boundary (no state given).
      q_seg, kv_seg: the checked segment ids, or None.
    """
    B, T, N, _ = q.shape
    q = masks.drop_padding(q, q_seg)
    k, v, gates = (masks.drop_padding(x, kv_seg) for x in (k, v, gates))
    heads = [jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (q, k, v, gates)]  # [B,N,T,.]
    real, start, q_read = _segments(q_seg, kv_seg, B, T)
    norms = tuple(None if x is None else jnp.asarray(x, jnp.float32) for x in norms)
    counts = jnp.broadcast_to(count[:, None], (B, N))

    def per_head(fn, static, layout):
        fn = functools.partial(fn, rule, static=static)
        inner = jax.vmap(fn, (0, 0, 0, 0, None, 0, 0, 0, 0, None))
        outer = jax.vmap(inner, (0, 0, 0, 0, None, None, None, 0, None, 0))
        return outer(*heads, hyper, *norms, (trees, counts), model, layout)

    recurrent = functools.partial(per_head, ttt_forms.recurrent, (form, b_size), (real, start))
    if form == "recurrent":
        out, final = recurrent()
    else:
        # Room for a count's shift (none without a state), and, with segment ids, for a
        # few segments' partial last mini-batches; rows that need more run token by token.
        extra = 0 if q_seg is None else -(-T // (4 * b_size))
        L = (-(-(T + (0 if aligned else b_size - 1)) // b_size) + extra) * b_size
        layout, fits = _grid(real, start, count, b_size, L)
        blocked = functools.partial(per_head, ttt_forms.blocked, (form, b_size, L), layout)
        out, final = blocked() if q_seg is None else jax.lax.cond(fits, blocked, recurrent)
    out = jnp.moveaxis(out, 1, 2)
    if q_read is not None:
        out = jnp.where(q_read[:, :, None, None], out, 0.0)
    trees, counts = final
    return out, (trees, counts[:, 0])


def check_options(form, forms, mini_batch, q_segment_ids, kv_segment_ids, B: int, T: int):
    """``(form, b, q_seg, kv_seg)``: the form, the mini-batch and the segment ids checked."""
    form = front.check_form(form, forms)
    b_size = checks.positive_int(mini_batch, "mini_batch")
    q_seg, kv_seg = checks.same_token_segment_ids(q_segment_ids, kv_segment_ids, B, T)
    return form, b_size, q_seg, kv_seg


def _segments(q_seg, kv_seg, B: int, T: int):
    """``(real, start, q_read)`` ``[B,T]`` bools (``q_read`` None without ids): the tokens
    that train the model, the first tokens of segments after a row's first, and the
    queries that read (``attn.linear.segments.causal``'s rules, which every family's)."""
    if kv_seg is None:
        return jnp.ones((B, T), bool), jnp.zeros((B, T), bool), None
    rules = segments.causal(q_seg, kv_seg, None, 1)
    return rules.key_real, jnp.isneginf(rules.log_a[..., 0]), rules.q_read


def _grid(real, start, count, b_size: int, L: int):
    """Where each token sits on the blocked forms' grid of L slots: ``((slot [B,T], reset
    [B,L/b], end [B]), fits)``.

    A row's segments follow each other in whole blocks of ``b_size`` slots: segment s
    takes ``ceil((offset_s + length_s) / b)`` blocks, its tokens (padding left out) at
    ``offset_s`` on, the first segment's offset the state's count, the others' 0. A block
    that begins a segment after the first restarts the model (``reset``); ``end`` is the
    slot past the row's last token (the count, without one). ``fits``: every row's tokens
    are within the L slots.
    """
    T = real.shape[1]

    def row(real, start, count):
        seg = jnp.cumsum(start)  # the token's segment in the row
        before = jnp.cumsum(real) - real  # real tokens before it
        at = lambda x: jnp.zeros(T, jnp.int32).at[seg].add(x)  # noqa: E731  per segment
        base, length = at(jnp.where(start, before, 0)), at(real.astype(jnp.int32))
        offset = jnp.where(jnp.arange(T) == 0, count, 0)
        blocks = (offset + length + b_size - 1) // b_size
        first = b_size * (jnp.cumsum(blocks) - blocks)  # the slot each segment starts at
        slot = jnp.where(real, first[seg] + offset[seg] + before - base[seg], L)
        end = jnp.where(real.any(), jnp.max(jnp.where(real, slot, -1)) + 1, count)
        begins = jnp.where((jnp.arange(T) > 0) & (length > 0), first // b_size, L)
        reset = jnp.zeros(L // b_size, bool).at[begins].set(True, mode="drop")
        return (slot, reset, end), end <= L

    layout, fits = jax.vmap(row)(real, start, count)
    return layout, fits.all()
