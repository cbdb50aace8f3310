"""The DPLR delta rule with the sequence sharded over a mesh axis: ``sharded_dplr_delta_rule``.

``attn.dplr_delta_rule`` on whole arrays whose T is split over one mesh axis,
each device running the one-device form on its contiguous span and the states
chained across devices by ``attn.linear.chain``, exactly as
``attn.sharded_delta_rule`` (``attn.linear.sharded``, whose docstring says what
the sharded forms take: batch axes, meshes of Auto or Explicit axes, whole or
laid-out arrays, eager or jitted calls, T a multiple of nothing).

The state is affine in the state a span starts from, ``S_out = M S_in + S_span``
with ``M = prod_t (diag(w_t) + b_t a_t^T)`` (``H x H``, later tokens on the
left): the transition acts on the key axis and every value column evolves by
it alone, values only writing. So ``M`` is read off one pass from a zero state
with ``H`` extra value columns that receive zero values and start from the
identity, as for the delta rule; segments (``M`` is zero past a segment start:
the start's ``-inf`` decays and zeroed ``a``), padding and chunking are then
the form's own.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from attn.checks import segment_values
from attn.linear import dplr
from attn.linear.chain import Recurrence
from attn.linear.dplr import dplr_delta_rule
from attn.linear.drive import check_mesh, check_whole, drive, finish

__all__ = ["sharded_dplr_delta_rule"]


def _apply(M, S):
    """``M [B,N,H,H] @ S [B,N,H,E]`` (the key axis)."""
    return jnp.einsum("bnij,bnje->bnie", M, S)


def _apply_t(M, G):
    """``M^T G``."""
    return jnp.einsum("bnji,bnje->bnie", M, G)


def _recurrence(options: dict) -> Recurrence:
    def run(t, p, a, state):
        return dplr_delta_rule(
            t["q"],
            t["k"],
            t["v"],
            t["a"],
            t["b"],
            t["log_w"],
            q_segment_ids=a.get("q_seg"),
            kv_segment_ids=a.get("seg"),
            initial_state=state,
            return_state=True,
            **options,
        )

    def zeros(t, p):
        B, N, E = t["v"].shape[0], t["v"].shape[-2], t["v"].shape[-1]
        return jnp.zeros((B, N, t["q"].shape[-1], E), jnp.float32)

    def transition(t, p, a):
        v = t["v"]
        H = t["q"].shape[-1]
        # H extra value columns: zero values, starting from the identity.
        wide_v = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], H), v.dtype)], -1)
        empty = zeros(t, p)
        eye = jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (*empty.shape[:-1], H))
        _, final = run({**t, "v": wide_v}, p, a, jnp.concatenate([empty, eye], -1))
        return final[..., :-H], final[..., -H:]

    return Recurrence(run, transition, _apply, _apply_t, zeros)


def sharded_dplr_delta_rule(
    q,
    k,
    v,
    a,
    b,
    log_w,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    q_segment_ids=None,
    kv_segment_ids=None,
    initial_state=None,
    return_state: bool = False,
    **options,
):
    """``attn.dplr_delta_rule`` with T sharded over the mesh axis ``axis_name``.

    Args:
      q, k, v, a, b, log_w, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``attn.dplr_delta_rule``, whole arrays.
      axis_name, mesh, batch_axes, exchange: as in ``attn.sharded_linear_attention``.
      **options: ``form``, ``chunk_size``, ``scale``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    check_whole(
        dplr_delta_rule,
        q,
        k,
        v,
        a,
        b,
        log_w,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        initial_state=initial_state,
        **options,
    )
    check_mesh(mesh, axis_name, batch_axes, jnp.shape(q)[0])
    segment_values(q_segment_ids, "q_segment_ids")
    segment_values(kv_segment_ids, "kv_segment_ids")
    dplr.check_values(a, b, log_w, kv_segment_ids)  # the values, as given
    tokens = dict(q=q, k=k, v=v, a=a, b=b, log_w=log_w)
    tokens = {name: jnp.asarray(x) for name, x in tokens.items()}
    aux = dict(q_seg=q_segment_ids, seg=kv_segment_ids)
    kw = dict(axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange)
    y, final = drive(_recurrence(options), tokens, {}, aux, initial_state, T=jnp.shape(q)[1], **kw)
    return finish(y, final, return_state)
