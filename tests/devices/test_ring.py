"""Ring attention on 4 and 8 fake CPU devices, checked against dense attention.

Each case compares the output, the lse and every gradient with
``attn.dot_product_attention`` on the whole sequence. The layouts, the work
counts and the argument checks that need no devices are in
``tests/attn/ring/test_ring.py``.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import PartitionSpec

import attn
from attn import masks, ring
from attn.ring.work import ring_work
from tests.util import mesh_of, normal, qkv, rel_err

pytestmark = pytest.mark.devices

TOL = 1e-5  # float32: the same function, summed in another order
BF16_TOL = 1e-2
AXIS = "seq"
CAUSAL = masks.causal()
STREAMING = masks.causal() & (masks.sliding_window(5) | masks.initial_tokens(3))


def grads_of(fn, q, k, v, sink):
    """Output, lse and gradients (q, k, v and the sink logits if given) of ``fn``."""
    cot = normal(99, q.shape[:3] + v.shape[3:])
    lse_cot = normal(98, q.shape[:3])

    def loss(q, k, v, sink):
        out, lse = fn(q, k, v, sink_logits=sink, return_lse=True)
        # Finite lse entries carry a cotangent too: the lse is an output.
        lse_term = jnp.where(jnp.isfinite(lse), lse * lse_cot, 0.0).sum()
        return (out * cot).sum() + lse_term, (out, lse)

    argnums = (0, 1, 2) if sink is None else (0, 1, 2, 3)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sink)
    return out, lse, grads


def compare(ring_fn, q, k, v, sink=None, tol=TOL, **kw):
    """Relative errors of ``ring_fn`` against dense attention on the whole sequence.

    Half-precision inputs are compared with dense attention on their float32 values.
    """
    dense = functools.partial(attn.dot_product_attention, **kw)
    out, lse, grads = grads_of(functools.partial(ring_fn, **kw), q, k, v, sink)
    if out.dtype != q.dtype:
        return {"ok": False, "dtype": str(out.dtype)}
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_lse, want_grads = grads_of(dense, *f32, sink)
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    seen = np.isfinite(want_lse)
    errors = {
        "out": rel_err(out, want),
        "lse": rel_err(lse[seen], want_lse[seen]) if seen.any() else 0.0,
    }
    for name, g, want_g in zip(("dq", "dk", "dv", "dsink"), grads, want_grads, strict=False):
        finite = np.isfinite(np.asarray(g, np.float32)).all()
        errors[name] = rel_err(g, want_g) if finite else float("inf")
    same_empty = bool((np.isneginf(lse) == np.isneginf(want_lse)).all())
    ok = same_empty and all(e <= tol for e in errors.values())
    return {"ok": ok, "errors": errors, "empty_rows": int((~seen).sum()), "same_empty": same_empty}


def sharded(num_devices, layout, block=4, explicit=False):
    return functools.partial(
        attn.sharded_attention,
        mesh=mesh_of(num_devices, explicit),
        axis_name=AXIS,
        layout=layout,
        block_q=block,
        block_k=block,
    )


def packed_segments(B, T):
    """Packed sequences (ids 1, 2, 3) with right padding (id 0: it sees no key and none sees it)."""
    rng = np.random.default_rng(7)
    q_seg = np.empty((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - 4), size=2, replace=False))
        q_seg[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
    q_seg[:, T - 4 :] = 0
    return jnp.asarray(q_seg), jnp.asarray(q_seg)


def poisoned(x, ids):
    """``x [B,T,...]`` with NaN at padding (id 0) in row 0 and +Inf in the other rows."""
    junk = jnp.where(jnp.arange(x.shape[0]) == 0, jnp.nan, jnp.inf).astype(x.dtype)
    pad = (ids == 0).reshape(ids.shape + (1,) * (x.ndim - 2))
    return jnp.where(pad, junk.reshape((-1,) + (1,) * (x.ndim - 1)), x)


def equal_case(
    num_devices,
    layout,
    mask,
    T,
    *,
    S=None,
    B=2,
    N=4,
    K=2,
    block=4,
    dtype=jnp.float32,
    tol=TOL,
    **extra,
):
    """A case: sharded ring attention equals dense, forward and gradients."""

    def run():
        q, k, v = qkv(T, B=B, T=T, S=S, N=N, K=K, H=8, dtype=dtype)
        kw = dict(extra)
        sink_seed = kw.pop("sink_seed", None)
        sink = None if sink_seed is None else normal(sink_seed, (N,))
        if kw.pop("segments", False):
            kw["q_segment_ids"], kw["kv_segment_ids"] = packed_segments(B, T)
            # Padding holds anything: NaN and Inf there must reach no real token.
            q, k, v = (poisoned(x, kw["q_segment_ids"]) for x in (q, k, v))
        fn = sharded(num_devices, layout, block, kw.pop("explicit", False))
        return compare(fn, q, k, v, sink, tol=tol, mask=mask, **kw)

    return run


def scores_case(num_devices, layout, explicit, T=40):
    """ALiBi + T5 buckets + FoX gates (+ a soft-cap) through sharded_attention equal dense:
    the output and the gradients of q, k, v and of the modifiers' arrays."""

    def run():
        from attn import scores

        B, N = 2, 4
        q, k, v = qkv(T + 1, B=B, T=T, N=N, K=2, H=8)
        slopes = jnp.asarray(scores.alibi_slopes(N))
        table = normal(5, (N, 8))
        log_f = jnp.log(jax.nn.sigmoid(normal(6, (B, T, N)) + 2.0))
        cot = normal(99, q.shape)

        def loss(fn, q, k, v, slopes, table, log_f):
            mod = scores.softcap(4.0) + scores.alibi(slopes)
            mod = mod + scores.relative_bias(table, num_buckets=8, max_distance=20)
            out = fn(q, k, v, mask=CAUSAL, score_mod=mod + scores.forgetting(log_f))
            return (out * cot).sum(), out

        def run_one(fn):
            grad = jax.grad(functools.partial(loss, fn), argnums=range(6), has_aux=True)
            return jax.jit(grad)(q, k, v, slopes, table, log_f)

        grads, out = run_one(sharded(num_devices, layout, 4, explicit))
        want_grads, want = run_one(attn.dot_product_attention)
        errors = {"out": rel_err(out, want)}
        names = ("dq", "dk", "dv", "dslopes", "dtable", "dlog_f")
        for name, g, w in zip(names, grads, want_grads, strict=True):
            errors[name] = rel_err(g, w)
        return {"ok": all(e <= TOL for e in errors.values()), "errors": errors}

    return run


def eager_case(explicit: bool):
    """sharded_attention called eagerly (no jit) equals dense. (On Auto axes the eager and the
    jitted call run the same code; on Explicit ones the reshards must work outside jit.)"""

    def run():
        q, k, v = qkv(6, B=2, T=32, N=4, K=2, H=8)
        seg = packed_segments(2, 32)
        kw = dict(mask=STREAMING, q_segment_ids=seg[0], kv_segment_ids=seg[1], return_lse=True)
        out, lse = sharded(4, "zigzag", 4, explicit)(q, k, v, **kw)
        want, want_lse = attn.dot_product_attention(q, k, v, **kw)
        seen = np.isfinite(np.asarray(want_lse))
        errors = {
            "out": rel_err(out, want),
            "lse": rel_err(np.asarray(lse)[seen], np.asarray(want_lse)[seen]),
        }
        return {"ok": all(e <= TOL for e in errors.values()), "errors": errors}

    return run


def direct_case(check_vma: bool):
    """ring_attention inside the caller's own shard_map, with its default (contiguous) positions."""

    def run():
        num_devices, T = 4, 40
        q, k, v = qkv(3, B=2, T=T, N=4, K=2, H=8)
        sink = normal(5, (4,))
        seq = PartitionSpec(None, AXIS)

        def fn(q, k, v, *, sink_logits, return_lse, mask):
            local = functools.partial(
                attn.ring_attention,
                axis_name=AXIS,
                mask=mask,
                block_q=4,
                block_k=3,
                return_lse=True,
            )
            return jax.shard_map(
                lambda q, k, v, s: local(q, k, v, sink_logits=s),
                mesh=mesh_of(num_devices),
                in_specs=(seq, seq, seq, PartitionSpec()),
                out_specs=(seq, seq),
                check_vma=check_vma,
            )(q, k, v, sink_logits)

        return compare(fn, q, k, v, sink, mask=STREAMING)

    return run


def memory_case():
    """No array on a device grows like T x S: no score matrix, local or global, in either pass.

    Walks the program of the forward and backward pass (every nested loop, cond
    and custom VJP) and compares each array inside the shard_map with the local
    q ``[B,T,N,H]``. The largest are the two partial outputs the merge stacks,
    twice q here; a ``[B,N,T_local,S_local]`` score block would be 4 times q.
    """

    def run():
        num_devices, T, block = 4, 128, 8  # 32 local positions, 4 x 4 tiles per step
        q, k, v = qkv(4, B=2, T=T, N=4, K=2, H=8)
        fn = functools.partial(sharded(num_devices, "zigzag", block), mask=CAUSAL)
        loss = lambda q, k, v: fn(q, k, v).sum()  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        local = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "shard_map"]
        sizes = [size for eqn in local for size in _array_sizes(eqn.params["jaxpr"])]
        q_local = q.size // num_devices
        scores = 2 * 4 * (T // num_devices) ** 2  # [B,N,T_local,S_local]
        return {
            "ok": len(local) == 2 and max(sizes) <= 2 * q_local < scores,
            "largest": max(sizes),
            "local_q": q_local,
            "local_scores": scores,
            "shard_maps": len(local),  # the forward's and the backward's
        }

    return run


def _array_sizes(jaxpr):
    """Element counts of every value a jaxpr and its nested jaxprs compute."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's jaxpr
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield int(np.prod(var.aval.shape, dtype=np.int64))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, Jaxpr | ClosedJaxpr):
                    yield from _array_sizes(sub)


def counts_case(num_devices, layout, mask, T, block):
    """Steps and tiles counted by the kernels' loops equal ``attn.ring.work.ring_work``'s replay."""

    def run():
        q, k, v = qkv(1, B=1, T=T, N=2, K=1, H=4)
        seq = PartitionSpec(AXIS)
        order = ring.layout_order(T, num_devices, layout)
        count = functools.partial(
            ring.count_ring_tiles, axis_name=AXIS, mask=mask, block_q=block, block_k=block
        )
        counted = jax.jit(
            jax.shard_map(
                lambda q, k, v, pos: count(q, k, v, q_positions=pos, kv_positions=pos),
                mesh=mesh_of(num_devices),
                in_specs=(PartitionSpec(None, AXIS),) * 3 + (seq,),
                out_specs=seq,
            )
        )(*(ring.to_layout(x, num_devices, layout) for x in (q, k, v)), jnp.asarray(order))
        counted = np.asarray(counted).reshape(num_devices, 3)
        work = ring_work(mask, T, num_devices, layout=layout, block_q=block, block_k=block)
        want = np.stack([work.steps, work.full, work.partial], 1)
        return {
            "ok": bool((counted == want).all()),
            "counted": counted.tolist(),
            "predicted": want.tolist(),
        }

    return run


def errors_case():
    """Bad shapes and names raise ValueError naming the argument."""

    def run():
        q, k, v = qkv(0, B=1, T=36, N=4, K=2, H=8)
        mesh = mesh_of(4)
        tries = {
            "q": lambda: attn.sharded_attention(q, k, v, mesh=mesh, axis_name=AXIS),  # 36 % 8
            "q ": lambda: attn.sharded_attention(
                q[:, :30], k, v, mesh=mesh, axis_name=AXIS, layout="contiguous", mask=masks.full()
            ),  # 30 % 4
            "k": lambda: attn.sharded_attention(
                q[:, :32], k[:, :36], v[:, :36], mesh=mesh, axis_name=AXIS, mask=masks.full()
            ),  # S = 36 % 8
            "axis_name": lambda: attn.sharded_attention(q, k, v, mesh=mesh, axis_name="data"),
            "layout": lambda: attn.sharded_attention(
                q, k, v, mesh=mesh, axis_name=AXIS, layout="x"
            ),
        }
        raised = {}
        for name, call in tries.items():
            try:
                call()
                raised[name] = "no error"
            except ValueError as e:
                raised[name] = str(e)
        ok = all(msg.startswith(f"{name.strip()}:") for name, msg in raised.items())
        return {"ok": ok, "messages": raised}

    return run


CASES = {
    "causal_contiguous_8": equal_case(8, "contiguous", CAUSAL, 64),
    "window_initial_zigzag_4": equal_case(4, "zigzag", STREAMING, 40),
    "window_initial_contiguous_8_mha": equal_case(8, "contiguous", STREAMING, 48, K=4, block=3),
    "full_zigzag_8": equal_case(8, "zigzag", masks.full(), 48),
    "full_contiguous_4_mqa": equal_case(4, "contiguous", None, 40, K=1, block=3),
    "segments_contiguous_4": equal_case(4, "contiguous", CAUSAL, 40, segments=True),
    "segments_sink_softcap_zigzag_8": equal_case(
        8, "zigzag", CAUSAL, 48, segments=True, sink_seed=12, softcap=2.0
    ),
    "sink_softcap_zigzag_4": equal_case(4, "zigzag", CAUSAL, 40, sink_seed=11, softcap=2.0),
    "explicit_segments_sink_zigzag_4": equal_case(
        4, "zigzag", CAUSAL, 40, segments=True, sink_seed=13, explicit=True
    ),
    "explicit_full_contiguous_8": equal_case(8, "contiguous", masks.full(), 48, explicit=True),
    "eager_explicit_mesh": eager_case(explicit=True),
    "scores_zigzag_4_explicit": scores_case(4, "zigzag", explicit=True),
    "scores_contiguous_8": scores_case(8, "contiguous", explicit=False, T=48),
    "cross_lengths_zigzag_4": equal_case(4, "zigzag", CAUSAL, 24, S=40),
    "bf16_causal_zigzag_4": equal_case(4, "zigzag", CAUSAL, 40, dtype=jnp.bfloat16, tol=BF16_TOL),
    "direct_default_positions": direct_case(check_vma=True),
    "direct_unchecked_vma": direct_case(check_vma=False),
    "memory_linear": memory_case(),
    "counts_causal_zigzag_8": counts_case(8, "zigzag", CAUSAL, 64, 4),
    "counts_causal_contiguous_8": counts_case(8, "contiguous", CAUSAL, 64, 4),
    "counts_window_contiguous_4": counts_case(4, "contiguous", masks.sliding_window(9), 48, 5),
    "errors": errors_case(),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ring_case(case):
    result = CASES[case]()
    assert result["ok"], json.dumps(result, indent=1)
    if "errors" in result and not case.startswith("bf16"):  # float32 meets its tolerance
        assert max(result["errors"].values()) <= TOL, result["errors"]
    if case == "segments_contiguous_4":
        # Padding queries see no key: they must give zeros, -inf lse and finite gradients.
        assert result["empty_rows"] > 0
