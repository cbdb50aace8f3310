"""The Mosaic GPU flash attention (``attn.pallas.mosaic``) without a GPU.

* Its twins (forward, dq, dk/dv) under Pallas's Mosaic GPU interpreter on this
  CPU: in float32 (which the twins also take) against float32 dense at its
  precision, output, lse and the gradients of q, k, v and the sink logits
  through both cotangents; in bfloat16, the output against the float64 oracle
  and the gradients against float32 dense on the same values (float16 takes
  the same code; its Hopper kernels are exported below).
  Between them: the block schedule (EMPTY blocks skipped, PARTIAL ones masked
  per element), positions given per row, T and S padded to whole blocks,
  segment ids with rows that see nothing, sinks, soft-cap, GQA and MQA,
  T != S, E != H, head dims 64 and 128, key blocks of 64 and 128. The twins run
  the Hopper kernels' tile math (``mosaic_tiles``) over the same packed
  schedules; only the loads and the products differ.
* The Hopper kernels lowered and exported for ``cuda``: three ``mosaic_gpu_v2``
  custom calls (forward, dq, dk/dv) per case, over masks, dtypes, head dims,
  GQA/MQA, padding, T != S, E != H, block sizes and the forward's consumer
  warpgroups (FlashAttention-3's two, one, or none).
* ``attn.attention(impl="mosaic")``, and refusals by name.

``tools/test_mosaic_jax011.sh`` runs this file under jax 0.11.2, the GPU machine's, with
``test_mosaic_hopper.py`` (the Hopper kernels themselves, interpreted).
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
pytestmark = pytest.mark.integration  # accelerator code lowered from the CPU
STREAMING = masks.causal() & (masks.sliding_window(70) | masks.initial_tokens(4))
GLOBAL = (masks.global_tokens((0, 90)) | masks.sliding_window(40)) & masks.causal()
STREAMING_32K = masks.causal() & (masks.sliding_window(1024) | masks.initial_tokens(4))


def value_and_grads(fn, q, k, v, sinks=True, **kw):
    """``(out, lse, grads)`` of one jitted value-and-grad with random cotangents for the
    output and the (finite) lse: the grads of q, k, v, and with ``sinks`` of the sink
    logits (up to 4 heads) too."""
    cot, lse_cot = normal(99, q.shape[:3] + v.shape[3:]), normal(98, q.shape[:3])

    def loss(q, k, v, sink):
        out, lse = fn(q, k, v, sink_logits=sink, return_lse=True, **kw)
        lse_term = jnp.where(jnp.isfinite(lse), lse * lse_cot, 0.0).sum()
        return (out.astype(jnp.float32) * cot).sum() + lse_term, (out, lse)

    sink = jnp.array([0.5, -1.0, 2.0, 0.0])[: q.shape[2]] if sinks else None
    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums, has_aux=True))(q, k, v, sink)
    return out, lse, grads


def check_lse(lse, want, tol):
    lse, want = np.asarray(lse), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    seen = np.isfinite(want)
    assert rel_err(lse[seen], want[seen]) <= tol


def segments(B, T, ends):
    """Segment ids: a second document in row 0 from ``ends[0]``, padding (id 0) in row 1
    from ``ends[1]`` (its queries see nothing, no query sees its keys)."""
    seg = np.ones((B, T), np.int32)
    seg[0, ends[0] :], seg[1, ends[1] :] = 2, 0
    return jnp.asarray(seg)


@pytest.mark.parametrize(
    ("mask", "shape", "extra"),
    [
        # T = S = 200: 4 query blocks of 64, the last key block 8 keys and 56 of padding.
        (STREAMING, dict(T=200, N=4, K=2, H=64), dict(softcap=20.0)),
        (
            GLOBAL,
            dict(T=192, N=2, K=1, H=64, E=128),
            dict(segments=(120, 150), block_k=128, sinks=False, consumers=0),
        ),
    ],
    ids=["streaming_gqa_sinks_softcap_padding", "global_mqa_segments_e_ne_h"],
)
def test_twin_forward_and_gradients_float32(mask, shape, extra):
    """Output, lse and the gradients of q, k, v (and of the sinks), at float32's precision."""
    q, k, v = qkv(5, B=2, **shape)
    kw = dict(extra)
    if "segments" in kw:
        seg = segments(2, shape["T"], kw.pop("segments"))
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    blocks = {name: kw.pop(name) for name in ("block_k", "consumers") if name in kw}
    out, lse, grads = value_and_grads(
        mosaic_attention, q, k, v, mask=mask, interpret=True, **kw, **blocks
    )
    want, want_lse, want_grads = value_and_grads(attn.dot_product_attention, q, k, v, mask=mask,
                                                 **kw)  # fmt: skip
    assert out.shape == want.shape and rel_err(out, want) <= TOL
    check_lse(lse, want_lse, TOL)
    for g, w in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g)).all() and rel_err(g, w) <= GRAD_TOL
    if "q_segment_ids" in kw:  # row 1's padding queries see nothing: zeros and -inf
        assert np.all(np.asarray(out[1, 150:]) == 0) and np.isneginf(lse[1, 150:]).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=["bf16"])  # fp16: the same code path
def test_twin_16_bit_against_float64(dtype):
    """Chunked causal at T != S with explicit positions per row, head dim 128: the output
    against the float64 oracle, the lse and gradients against float32 dense on the same
    16-bit values."""
    q, k, v = qkv(2, B=2, T=64, S=200, N=2, K=1, H=128, dtype=dtype)
    q_pos = jnp.stack([jnp.arange(136, 200), jnp.arange(60, 124)])
    mask = masks.causal() & masks.chunked(96)
    out, lse, grads = value_and_grads(
        mosaic_attention, q, k, v, mask=mask, interpret=True, q_positions=q_pos
    )
    assert out.dtype == dtype and [g.dtype for g in grads[:3]] == [dtype] * 3
    ok = np.stack([np.asarray(mask.allowed(q_pos[b], np.arange(200))) for b in range(2)])
    want = np_attention(q, k, v, ok, sink_logits=np.array([0.5, -1.0]))
    assert rel_err(out, want) <= BF16_TOL
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, want_lse, want_grads = value_and_grads(attn.dot_product_attention, *f32, mask=mask,
                                              q_positions=q_pos)  # fmt: skip
    check_lse(lse, want_lse, LSE_TOL)
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, w) <= BF16_TOL


SEGMENTS = {"q_segment_ids": "seg", "kv_segment_ids": "seg"}
# name -> (mask, call keywords given as shapes, (T, S, K, H, E, dtype),
#          (block_q, block_k, consumers)); N = 4.
CASES = {
    "causal_padding_mqa": (masks.causal(), {}, (200, 200, 1, 64, 64, jnp.bfloat16), (64, 64, 2)),
    "streaming_sinks": (STREAMING, {"sink_logits": (4,)}, (256, 256, 2, 64, 64, jnp.bfloat16),
                        (64, 64, 2)),
    "segments_blocks_128": (masks.causal(), SEGMENTS, (256, 256, 2, 128, 128, jnp.float16),
                            (128, 128, 1)),
    "chunked_softcap": (masks.causal() & masks.chunked(96), {"softcap": 30.0},
                        (256, 256, 2, 128, 128, jnp.float16), (64, 64, 2)),
    "global_t_ne_s_e_ne_h": (GLOBAL, {}, (64, 1000, 4, 64, 128, jnp.bfloat16), (64, 128, 2)),
    "unspecialised": (masks.causal(), SEGMENTS, (200, 200, 2, 128, 64, jnp.bfloat16),
                      (64, 128, 0)),
}  # fmt: skip


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
def test_hopper_kernels_export_for_cuda(case):
    mask, extra, (T, S, K, H, E, dtype), (bq, bk, consumers) = CASES[case]
    module = lowered(2, T, S, 4, K, H, E, dtype, mask, extra, grad=True, block_q=bq, block_k=bk,
                     consumers=consumers)  # fmt: skip
    assert module.count("custom_call @mosaic_gpu_v2") == 3  # forward, dq, dk/dv


def test_attention_impl_mosaic_is_the_kernel():
    q, k, v = qkv(7, B=1, T=128, N=2, K=1, H=64, dtype=jnp.bfloat16)
    got = attn.attention(q, k, v, impl="mosaic", mask=masks.causal(), block_k=128, interpret=True)
    want = mosaic_attention(q, k, v, mask=masks.causal(), block_k=128, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    # platform="cuda" lowers the Hopper kernels from this CPU host, as impl="pallas" does
    # (it was refused; without it, or interpret=True, the call is refused on a CPU host).
    def exported(fn):
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
        return jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes).mlir_module()

    via = exported(lambda q, k, v: attn.attention(q, k, v, impl="mosaic", platform="cuda"))
    direct = exported(lambda q, k, v: mosaic_attention(q, k, v, interpret=False))
    assert (
        via.count("custom_call @mosaic_gpu_v2") == direct.count("custom_call @mosaic_gpu_v2") == 1
    )
    with pytest.raises(ValueError, match=r"^platform: expected None, 'cuda' or 'gpu'"):
        attn.attention(q, k, v, impl="mosaic", platform="tpu")
    with pytest.raises(ValueError, match=r"^interpret: expected False or None with platform"):
        mosaic_attention(q, k, v, platform="cuda", interpret=True)
    # On this CPU only the interpreter runs it: asked for, never picked in silence.
    with pytest.raises(ValueError, match=r"^interpret: expected True to run impl='mosaic'"):
        attn.attention(q, k, v, impl="mosaic")


def test_refusals_name_the_argument():
    q, k, v = qkv(3, B=1, T=64, N=2, H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^q, k, v: expected all in one of bfloat16, float"):
        mosaic_attention(q.astype(jnp.float32), k, v, interpret=True)
    with pytest.raises(ValueError, match=r"^q, k, v: expected all in one of bfloat16 or float16"):
        mosaic_attention(q, k, v.astype(jnp.float32), interpret=False)
    with pytest.raises(ValueError, match=r"^head dim H: expected one of \(64, 128\)"):
        mosaic_attention(q[..., :32], k[..., :32], v, interpret=True)
    with pytest.raises(ValueError, match=r"^value head dim E: expected one of"):
        mosaic_attention(q, k, v[..., :48], interpret=True)
    with pytest.raises(ValueError, match=r"^block_q: expected one of \(64, 128\), got 32"):
        mosaic_attention(q, k, v, block_q=32, interpret=True)
    with pytest.raises(ValueError, match=r"^stages: expected an int >= 1, got 0"):
        mosaic_attention(q, k, v, stages=0, interpret=True)
    # Floats and bools are refused by name (64.0 failed inside Pallas with a TypeError about
    # pad_width); NumPy ints are taken as ints, as flash_attention takes them (an empty
    # AssertionError from Pallas before).
    for name, value in (("block_q", 64.0), ("block_k", True), ("consumers", 2.0),
                        ("stages", 2.0)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{name}: expected .*, got {value!r}$"):
            mosaic_attention(q, k, v, **{name: value}, interpret=True)
    from attn.pallas import mosaic
    from attn.softmax.call import check_call

    config = mosaic._config(check_call(q, k, v), q, k, v, np.int64(64), np.int32(64),
                            np.int64(2), np.int64(2), interpret=True)  # fmt: skip
    assert all(type(x) is int for x in (config.block_q, config.block_k, config.stages))
    big = [x.astype(jnp.bfloat16) for x in qkv(3, B=1, T=256, N=2, H=128)]
    with pytest.raises(ValueError, match=r"^consumers: expected one of \(0, 1, 2\), got 3"):
        mosaic_attention(q, k, v, consumers=3, interpret=True)
    with pytest.raises(ValueError, match=r"^stages: expected >= 2 with consumers=2"):
        mosaic_attention(q, k, v, stages=1, interpret=True)
    mosaic_attention(q, k, v, stages=1, consumers=1, interpret=True)  # one consumer takes one stage
    with pytest.raises(ValueError, match=r"^block_q, block_k, stages, consumers: expected tiles"):
        mosaic_attention(*big, block_q=128, block_k=128, stages=3, interpret=False)
    with pytest.raises(ValueError, match=r"^score_mod: expected None for impl='mosaic'"):
        mosaic_attention(q, k, v, score_mod=attn.scores.alibi(jnp.ones(2)), interpret=True)
    with pytest.raises(ValueError, match=r"^bias: expected no bias array for impl='mosaic'"):
        mosaic_attention(q, k, v, bias=normal(4, (1, 2, 64, 64)), interpret=True)


def test_window_and_sinks_visit_a_fraction_of_causal_tiles_at_32k():
    """Block skipping by the schedule: at T = 32K, in programs of two consumers' 64 rows
    over key blocks of 64, a window of 1024 with 4 sink tokens visits under a thirteenth of
    causal's tiles, and the dk/dv kernel's programs (128 keys over query blocks of 64) as
    few; only the window's edges and the sinks' block evaluate the mask."""
    from attn.pallas import mosaic
    from attn.softmax.call import check_call

    T = 32768
    q = jnp.zeros((1, T, 1, 64), jnp.bfloat16)
    visits = {}
    for name, mask in (("causal", masks.causal()), ("streaming", STREAMING_32K)):
        call = check_call(q, q, q, mask=mask)
        config = mosaic._config(call, q, q, q, 64, 64, 2, 2, interpret=False)
        config, (by_query, by_key), _ = mosaic._schedule(config, call)
        kinds = np.asarray(by_query[:, 1 + config.width : 1 + 2 * config.width])
        partial = (kinds == masks.BlockKind.PARTIAL).sum()
        visits[name] = (by_query[:, 0].sum(), by_key[:, 0].sum(), partial)
    # 256 programs of 128 rows see 2, 4, ..., 512 key blocks, two of them on the diagonal.
    assert visits["causal"] == (256 * 257, 256 * 257, 512)
    assert 13 * max(visits["streaming"][:2]) < visits["causal"][0]
    assert visits["streaming"][2] <= 5 * 256
