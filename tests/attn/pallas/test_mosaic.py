"""The Mosaic GPU flash attention (``attn.pallas.mosaic``) without a GPU.

* Its twin, under Pallas's Mosaic GPU interpreter on this CPU, against the
  float64 NumPy oracle: the block schedule (EMPTY blocks skipped, PARTIAL ones
  masked per element), positions, padding of T and S to whole blocks, segment
  ids with empty rows, sinks, soft-cap, GQA/MQA, T != S, E != H, bfloat16 and
  float16. The twin runs the Hopper kernel's tile math (``mosaic_tiles``)
  over the same packed schedule; only the loads and the products differ.
* The twins' gradients (the dq and dk/dv kernels') w.r.t. q, k, v and the
  sink logits, through the output's and the lse's cotangents: in float32
  (which the twin also takes) against float32 dense at its precision, and in
  bfloat16 against float32 dense on the same values.
* The Hopper kernels lowered and exported for ``cuda`` (one ``mosaic_gpu_v2``
  custom call for the forward, three with the backward) for every case the
  twin checks numerically, and more.
* Refusals by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.pallas.mosaic import mosaic_attention
from tests.util import normal, np_attention, qkv, rel_err

BF16_TOL = 1e-2  # inputs and P in 16 bits, statistics in float32
LSE_TOL = 1e-5  # float32 statistics of the same products, against float32 dense
TOL, GRAD_TOL = 1e-5, 1e-4  # float32: the same function in another order
STREAMING = masks.causal() & (masks.sliding_window(70) | masks.initial_tokens(4))
GLOBAL = (masks.global_tokens((0, 90)) | masks.sliding_window(40)) & masks.causal()


def check_twin(q, k, v, mask, *, q_positions=None, q_seg=None, kv_seg=None, blocks=None, **kw):
    """The twin's output against float64 and its lse against float32 dense."""
    segs = {} if q_seg is None else dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    pos = {} if q_positions is None else dict(q_positions=q_positions)
    out, lse = mosaic_attention(q, k, v, mask=mask, return_lse=True, **pos, **segs, **kw,
                                **(blocks or {}))  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[3:]
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    q_pos = np.broadcast_to(np.arange(S - T, S) if q_positions is None else q_positions, (B, T))
    ok = np.stack([np.asarray(mask.allowed(q_pos[b], np.arange(S))) for b in range(B)])
    if q_seg is not None:
        ok = ok & np.asarray(masks.same_segment(q_seg, kv_seg))
    sinks = kw.get("sink_logits")
    softcap = kw.get("softcap")
    want = np_attention(q, k, v, ok, softcap=softcap, sink_logits=sinks)
    assert rel_err(out, want) <= BF16_TOL
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, want_lse = attn.dot_product_attention(*f32, mask=mask, return_lse=True, **pos, **segs, **kw)
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    assert rel_err(lse[seen], want_lse[seen]) <= LSE_TOL
    return out, lse


def test_twin_causal_gqa_sinks_padding():
    # T = S = 200: 4 query blocks of 64, the last key block 8 real keys and 56 padding.
    q, k, v = qkv(0, B=1, T=200, N=4, K=2, H=64, dtype=jnp.bfloat16)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    check_twin(q, k, v, masks.causal(), sink_logits=sinks)


def test_twin_streaming_segments_empty_rows_float16_head_dim_128():
    q, k, v = qkv(1, B=2, T=192, N=2, K=2, H=128, dtype=jnp.float16)
    seg = np.ones((2, 192), np.int32)
    seg[0, 100:] = 2  # two documents in row 0
    seg[1, 150:] = 0  # padding in row 1: its queries see nothing
    seg = jnp.asarray(seg)
    out, lse = check_twin(q, k, v, STREAMING, q_seg=seg, kv_seg=seg)
    assert np.all(np.asarray(out[1, 150:], np.float32) == 0) and np.isneginf(lse[1, 150:]).all()


def test_twin_global_softcap_mqa_t_ne_s_e_ne_h():
    q, k, v = qkv(2, B=2, T=64, S=200, N=2, K=1, H=64, E=128, dtype=jnp.bfloat16)
    q_pos = jnp.stack([jnp.arange(136, 200), jnp.arange(60, 124)])  # per row, T != S
    check_twin(q, k, v, GLOBAL, q_positions=q_pos, softcap=20.0, blocks=dict(block_k=128))


def value_and_grads(fn, q, k, v, **kw):
    """``(out, lse, (dq, dk, dv, dsink))`` of one jitted value-and-grad with random
    cotangents for the output and the (finite) lse."""
    cot, lse_cot = normal(99, q.shape[:3] + v.shape[3:]), normal(98, q.shape[:3])

    def loss(q, k, v, sink):
        out, lse = fn(q, k, v, sink_logits=sink, return_lse=True, **kw)
        lse_term = jnp.where(jnp.isfinite(lse), lse * lse_cot, 0.0).sum()
        return (out.astype(jnp.float32) * cot).sum() + lse_term, (out, lse)

    sink = jnp.array([0.5, -1.0, 2.0, 0.0])[: q.shape[2]]
    grads, (out, lse) = jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, sink)
    return out, lse, grads


@pytest.mark.parametrize(
    ("mask", "extra"),
    [
        (STREAMING, dict(softcap=20.0)),  # T = 200: padded rows and keys
        (GLOBAL, dict(q_segment_ids="seg", kv_segment_ids="seg")),
    ],
    ids=["streaming_softcap", "global_segments"],
)
def test_twin_gradients_float32(mask, extra):
    q, k, v = qkv(5, B=2, T=200, N=4, K=2, H=64)
    seg = np.ones((2, 200), np.int32)
    seg[0, 120:], seg[1, 180:] = 2, 0  # a second document; padding queries and keys
    kw = {name: jnp.asarray(seg) if x == "seg" else x for name, x in extra.items()}
    out, lse, grads = value_and_grads(mosaic_attention, q, k, v, mask=mask, **kw)
    want, want_lse, want_grads = value_and_grads(attn.dot_product_attention, q, k, v, mask=mask,
                                                 **kw)  # fmt: skip
    assert rel_err(out, want) <= TOL
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert rel_err(np.asarray(lse)[finite], np.asarray(want_lse)[finite]) <= TOL
    for g, w in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g)).all() and rel_err(g, w) <= GRAD_TOL


def test_twin_gradients_bfloat16_mqa_e_ne_h():
    q, k, v = qkv(6, B=1, T=128, S=192, N=2, K=1, H=64, E=128, dtype=jnp.bfloat16)
    out, _, grads = value_and_grads(mosaic_attention, q, k, v, mask=masks.causal())
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, _, want = value_and_grads(attn.dot_product_attention, *f32, mask=masks.causal())
    assert [g.dtype for g in grads[:3]] == [jnp.bfloat16] * 3
    for g, w in zip(grads, want, strict=True):
        assert rel_err(g, w) <= BF16_TOL


CASES = {  # name -> (mask, call keywords given shapes)
    "causal": (masks.causal(), {}),
    "streaming_sinks": (STREAMING, {"sink_logits": (4,)}),
    "segments": (masks.causal(), {"q_segment_ids": "seg", "kv_segment_ids": "seg"}),
    "chunked_softcap": (masks.causal() & masks.chunked(96), {"softcap": 30.0}),
    "global": (GLOBAL, {}),
}


def lowered(B, T, S, N, K, H, E, dtype, mask, extra, grad=False, **kw):
    """The Hopper kernels exported for cuda (with ``grad``, the backward's too): the text."""
    arrays = [((B, T, N, H), dtype), ((B, S, K, H), dtype), ((B, S, K, E), dtype)]
    names = []
    for name, spec in extra.items():
        if isinstance(spec, tuple):
            arrays.append((spec, jnp.float32))
            names.append(name)
        elif spec == "seg":
            arrays.append(((B, T if name.startswith("q") else S), jnp.int32))
            names.append(name)
        else:
            kw[name] = spec

    def fn(q, k, v, *rest):
        return mosaic_attention(q, k, v, mask=mask, interpret=False, return_lse=True,
                                **dict(zip(names, rest, strict=True)), **kw)  # fmt: skip

    if grad:
        forward = fn

        def fn(q, k, v, *rest):
            loss = lambda q, k, v: sum(x.astype(jnp.float32).sum() for x in forward(q, k, v, *rest))  # noqa: E731
            return jax.grad(loss, (0, 1, 2))(q, k, v)

    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in arrays]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes)
    return exported.mlir_module()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("H", "dtype"), [(64, jnp.bfloat16), (128, jnp.float16)])
def test_hopper_kernels_export_for_cuda(case, H, dtype):
    mask, extra = CASES[case]
    module = lowered(2, 256, 256, 4, 2, H, H, dtype, mask, extra, grad=True)
    assert module.count("custom_call @mosaic_gpu_v2") == 3  # forward, dq, dk/dv


@pytest.mark.parametrize(
    ("T", "S", "K", "E", "blocks"),
    [(200, 200, 1, 64, (64, 64)), (64, 1000, 4, 128, (64, 128)), (256, 256, 2, 64, (128, 128))],
)
def test_hopper_kernels_export_padding_t_ne_s_mqa_e_ne_h_and_blocks(T, S, K, E, blocks):
    extra = {"q_segment_ids": "seg", "kv_segment_ids": "seg"} if T == S else {}
    module = lowered(1, T, S, 4, K, 64, E, jnp.bfloat16, masks.causal(), extra, grad=True,
                     block_q=blocks[0], block_k=blocks[1])  # fmt: skip
    assert module.count("custom_call @mosaic_gpu_v2") == 3
    forward = lowered(1, T, S, 4, K, 64, E, jnp.bfloat16, masks.causal(), extra,
                      block_q=blocks[0], block_k=blocks[1])  # fmt: skip
    assert forward.count("custom_call @mosaic_gpu_v2") == 1


def test_attention_impl_mosaic_is_the_kernel():
    q, k, v = qkv(7, B=1, T=128, N=2, K=1, H=64, dtype=jnp.bfloat16)
    got = attn.attention(q, k, v, impl="mosaic", mask=masks.causal(), block_k=128)
    want = mosaic_attention(q, k, v, mask=masks.causal(), block_k=128)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match=r"^platform: expected None for impl='mosaic'"):
        attn.attention(q, k, v, impl="mosaic", platform="cuda")


def test_refusals_name_the_argument():
    q, k, v = qkv(3, B=1, T=64, N=2, H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^q, k, v: expected all in one of bfloat16, float"):
        mosaic_attention(q.astype(jnp.float32), k, v)
    with pytest.raises(ValueError, match=r"^q, k, v: expected all in one of bfloat16 or float16"):
        mosaic_attention(q, k, v.astype(jnp.float32), interpret=False)
    with pytest.raises(ValueError, match=r"^head dim H: expected one of \(64, 128\)"):
        mosaic_attention(q[..., :32], k[..., :32], v)
    with pytest.raises(ValueError, match=r"^value head dim E: expected one of"):
        mosaic_attention(q, k, v[..., :48])
    with pytest.raises(ValueError, match=r"^block_q: expected one of \(64, 128\), got 32"):
        mosaic_attention(q, k, v, block_q=32)
    with pytest.raises(ValueError, match=r"^stages: expected an int >= 1, got 0"):
        mosaic_attention(q, k, v, stages=0)
    with pytest.raises(ValueError, match=r"^score_mod: expected None for impl='mosaic'"):
        mosaic_attention(q, k, v, score_mod=attn.scores.alibi(jnp.ones(2)))
    with pytest.raises(ValueError, match=r"^bias: expected no bias array for impl='mosaic'"):
        mosaic_attention(q, k, v, bias=normal(4, (1, 2, 64, 64)))
