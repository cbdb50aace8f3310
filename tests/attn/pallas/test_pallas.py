"""The Pallas flash-attention kernel computes the dense reference's function.

Run in Pallas interpret mode on the CPU (``interpret=True``: None refuses there).
Forward, lse and the gradients w.r.t. q, k, v (and sink logits, and through the
lse's cotangent) are compared with ``attn.dot_product_attention`` in float32;
bfloat16 inputs with the float64 oracle (forward) and the float32 reference
(gradients). Blocks of 16 keep several blocks per axis at lengths (37, 21, 50)
that are not multiples of them. Interpret mode compiles slowly, so each case
packs several features (GQA, sinks, soft-cap, segment ids) into one call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.pallas import flash_attention
from attn.pallas.common import FlashConfig
from attn.pallas.schedule import schedules
from attn.softmax.call import CallSpec
from attn.softmax.schedule import BlockSpec, build_schedule
from tests.util import normal, np_attention, qkv, rel_err

TOL = 1e-5  # float32, the same function computed in another order
GRAD_TOL = 1e-4  # float32 gradients (composed: recomputed P, dS, then matmuls)
BF16_TOL = 1e-2
BLOCKS = dict(block_q=16, block_k=16, interpret=True)


def outputs_and_grads(fn, q, k, v, sink_logits=None, traced=None, **kw):
    """``(out, lse, grads)`` of one jitted value-and-grad; ``traced`` kwargs are jit arguments."""
    cot = normal(99, q.shape[:3] + v.shape[3:])
    lse_cot = normal(98, q.shape[:3])

    def loss(q, k, v, sink, traced):
        out, lse = fn(q, k, v, sink_logits=sink, return_lse=True, **kw, **traced)
        lse_term = jnp.where(jnp.isfinite(lse), lse * lse_cot, 0.0).sum()
        return (out.astype(jnp.float32) * cot).sum() + lse_term, (out, lse)

    argnums = (0, 1, 2) if sink_logits is None else (0, 1, 2, 3)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums, has_aux=True))(
        q, k, v, sink_logits, traced or {}
    )
    return out, lse, grads


def pallas(*args, **kw):
    return flash_attention(*args, **BLOCKS, **kw)


def assert_matches_dense(q, k, v, **kw):
    out, lse, grads = outputs_and_grads(pallas, q, k, v, **kw)
    want, want_lse, want_grads = outputs_and_grads(attn.dot_product_attention, q, k, v, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert rel_err(out, want) <= TOL
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    assert rel_err(lse[seen], want_lse[seen]) <= TOL
    for g, want_g in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g)).all()
        assert rel_err(g, want_g) <= GRAD_TOL
    return out, grads


SHAPE = dict(B=2, T=37, N=4, K=2, H=8)  # GQA: 2 query heads per kv head; 3x3 blocks of 16
SINKS = jnp.array([0.5, -1.0, 2.0, 0.0])

# full(): in test_t_ne_s_full_with_sinks; initial tokens alone: in the MQA test.
MASKS = {
    "causal": masks.causal(),
    "window": masks.sliding_window(9),
    "streaming": masks.causal() & (masks.sliding_window(7) | masks.initial_tokens(3)),
    "chunked": masks.causal() & masks.chunked(12),
    "global": masks.global_tokens((0, 20)) | masks.sliding_window(5),
    "bidirectional_band": masks.bidirectional_window(6),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_mask_forward_lse_and_gradients(name):
    q, k, v = qkv(1, **SHAPE)
    assert_matches_dense(q, k, v, mask=MASKS[name])


def test_mqa_sinks_and_softcap_with_their_gradients():
    q, k, v = qkv(2, B=1, T=37, N=4, K=1, H=8)
    _, grads = assert_matches_dense(
        3 * q, k, v, mask=masks.initial_tokens(5), softcap=2.5, scale=0.3, sink_logits=SINKS
    )
    assert np.abs(np.asarray(grads[3])).min() > 0  # every sink logit gets a gradient


def test_t_ne_s_full_with_sinks():
    q, k, v = qkv(3, B=2, T=21, S=50, N=4, K=2, H=8)
    assert_matches_dense(q, k, v, mask=masks.full(), sink_logits=SINKS)


def test_segment_ids_with_empty_rows_and_traced_schedule():
    q, k, v = qkv(4, **SHAPE)
    # Row 0: packed segments 1, 2, then queries of segment 9 that no key has,
    # then padding (id 0). Row 1: one segment and right padding.
    q_seg = np.r_[np.full(10, 1), np.full(15, 2), np.full(7, 9), np.full(5, 0)]
    kv_seg = np.r_[np.full(10, 1), np.full(15, 2), np.full(7, 3), np.full(5, 0)]
    q_seg = jnp.asarray(np.stack([q_seg, np.r_[np.full(30, 1), np.full(7, 0)]]), jnp.int32)
    kv_seg = jnp.asarray(np.stack([kv_seg, np.r_[np.full(30, 1), np.full(7, 0)]]), jnp.int32)
    # Segment ids passed as jit arguments: the schedule is computed at run time.
    traced = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, (gq, *_) = assert_matches_dense(q, k, v, mask=masks.causal(), softcap=4.0, traced=traced)
    dead = np.asarray(q_seg) == 0  # padding sees no key, and segment 9 has none
    dead[0, 25:32] = True
    assert not np.asarray(out)[dead].any() and not np.asarray(gq)[dead].any()
    _, lse = flash_attention(q, k, v, mask=masks.causal(), return_lse=True, **traced, **BLOCKS)
    assert np.isneginf(np.asarray(lse)[dead]).all()


def test_explicit_positions_chunked_prefill_t_ne_s():
    q, k, v = qkv(5, B=2, T=21, S=50, N=4, K=2, H=8)
    q_pos = jnp.stack([jnp.arange(29, 50), jnp.arange(10, 31)])  # per row
    assert_matches_dense(q, k, v, mask=MASKS["global"] & masks.causal(), q_positions=q_pos)


def test_bfloat16_against_float64():
    q, k, v = qkv(6, **SHAPE, dtype=jnp.bfloat16)
    mask = MASKS["streaming"]
    out, _, grads = outputs_and_grads(pallas, q, k, v, mask=mask, sink_logits=SINKS)
    assert out.dtype == jnp.bfloat16
    ok = np.asarray(mask.allowed(np.arange(37), np.arange(37)))[None].repeat(2, 0)
    assert rel_err(out, np_attention(q, k, v, ok, sink_logits=SINKS)) <= BF16_TOL
    # Gradients: against float32 dense on the same (bf16-valued) inputs.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, _, want = outputs_and_grads(attn.dot_product_attention, *f32, mask=mask, sink_logits=SINKS)
    for g, w in zip(grads, want, strict=True):
        assert rel_err(g, w) <= BF16_TOL


def test_lse_merges_two_key_halves_and_default_blocks():
    q, k, v = qkv(7, B=1, T=30, S=70, N=2, K=1, H=8)
    pos = jnp.arange(40, 70)
    kw = dict(mask=masks.causal(), q_positions=pos, return_lse=True)
    halves = [
        flash_attention(q, k[:, s], v[:, s], kv_positions=jnp.arange(70)[s], interpret=True, **kw)
        for s in (slice(0, 35), slice(35, 70))
    ]  # default block sizes (the CPU entry of attn.pallas.blocks); one compile serves both
    out, lse = attn.merge_attention(*halves[0], *halves[1])
    want, want_lse = attn.dot_product_attention(q, k, v, **kw)
    assert rel_err(out, want) <= TOL and rel_err(lse, want_lse) <= TOL


def test_schedule_is_blockwise_schedule_and_its_transpose():
    T = S = 70
    mask = MASKS["streaming"]
    spec = CallSpec(mask=mask, scale=1.0, softcap=None, score=None, has_sink=False,
                    has_segments=False, B=1, T=T, S=S, K=1, G=1)  # fmt: skip
    config = FlashConfig(
        call=spec, block_q=16, block_k=32, bwd_block_q=16, bwd_block_k=32, platform="cpu",
        interpret=True, num_warps=None, num_stages=None,
    )  # fmt: skip
    pos = np.arange(T)[None]
    plan = schedules(config, [jnp.asarray(pos)] * 2, [pos, pos])
    ref = build_schedule(BlockSpec(spec, 16, 32), [jnp.asarray(pos)] * 2, [pos, pos])
    width = ref.key_tile.shape[1]
    np.testing.assert_array_equal(plan.by_query.count, ref.count)
    for i, n in enumerate(np.asarray(ref.count)):
        np.testing.assert_array_equal(plan.by_query.key_tile[i, :n], ref.key_tile[i, :n])
        np.testing.assert_array_equal(plan.by_query.kind[i, :n], ref.kind[i, :n])
    assert plan.by_query.key_tile.shape[1] >= width
    dense = np.zeros((5, 3), int)  # kinds [query block, key block] from both layouts
    dense_t = np.zeros((5, 3), int)
    for i, n in enumerate(np.asarray(plan.by_query.count)):
        dense[i, np.asarray(plan.by_query.key_tile[i, :n])] = plan.by_query.kind[i, :n]
    for j, n in enumerate(np.asarray(plan.by_key.count)):
        dense_t[np.asarray(plan.by_key.key_tile[j, :n]), j] = plan.by_key.kind[j, :n]
    np.testing.assert_array_equal(dense, dense_t)
    assert (dense == 0).any()  # the window empties some block pairs: they are never visited


def test_bad_arguments_are_named():
    q, k, v = qkv(8, B=1, T=8, N=2)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, k, v, block_q=0, interpret=True)
    # On a CPU only the interpreter runs the kernel: asked for, never picked in silence.
    refused = r"^interpret: expected True to run impl='pallas' on platform 'cpu'"
    for call in (flash_attention, lambda *a: attn.attention(*a, impl="pallas")):
        with pytest.raises(ValueError, match=refused):
            call(q, k, v)
    with pytest.raises(ValueError, match="block_k: expected a power of two"):
        flash_attention(q, k, v, block_k=24, interpret=False)
    with pytest.raises(ValueError, match="q_segment_ids/kv_segment_ids"):
        flash_attention(q, k, v, q_segment_ids=jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="bias: expected a shape broadcastable"):
        attn.attention(q, k, v, impl="pallas", bias=jnp.zeros((1, 3, 8, 8)))
