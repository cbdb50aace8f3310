"""The block-sparse Pallas route of MoBA's and NSA's selected blocks: interpret mode against
the gathered form, and lowered for cuda from this host with ``jax.export``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import masks
from attn.sparse import compression_windows, moba_attention, nsa_attention
from attn.sparse.pallas import block_lists
from tests.util import normal, qkv, rel_err

TRITON = "__gpu$xla.gpu.triton"
B, T, N, K, H = 2, 40, 4, 2, 8
NSA = dict(compress_block=8, compress_stride=4, select_block=8, num_selected=2, window=10)


def nsa_inputs(k, v):
    win = dict(compress_block=8, compress_stride=4)
    ck, cv = (compression_windows(x, **win)[0].mean(2) for x in (k, v))
    return jax.nn.sigmoid(normal(3, (B, T, N, 3))), ck, cv


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_the_kernel_computes_the_gathered_function_and_its_gradients(method):
    q, k, v = qkv(0, B=B, T=T, N=N, K=K, H=H)  # T = 40: a partial query and key block
    gates, ck, cv = nsa_inputs(k, v)
    mask = masks.causal() & masks.sliding_window(20)

    def run(impl, q, k, v):
        kernel = dict(impl=impl, interpret=True if impl == "pallas" else None)
        if method == "moba":
            return moba_attention(q, k, v, block_size=8, top_k=2, mask=mask, **kernel)
        return nsa_attention(q, k, v, gates, ck, cv, mask=mask, **kernel, **NSA)

    ct = normal(4, (B, T, N, H))
    outs = {}
    for impl in ("gather", "pallas"):
        out, vjp = jax.vjp(lambda *a, impl=impl: run(impl, *a), q, k, v)
        outs[impl] = (out, vjp(ct))
    (want, want_grads), (got, grads) = outs["gather"], outs["pallas"]
    assert rel_err(got, want) <= 1e-6
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, w) <= 1e-6


def test_block_lists_are_each_query_blocks_union():
    ids = np.full((1, 8, 1, 2), -1, np.int32)
    ids[0, :4, 0] = [[0, 3], [3, -1], [1, 0], [-1, -1]]
    ids[0, 4:, 0] = [[2, -1], [2, 2], [-1, -1], [-1, -1]]
    lists, counts = block_lists(jnp.asarray(ids), 4, 5)
    assert counts.tolist() == [[[3, 1]]]
    assert lists[0, 0, 0, :3].tolist() == [0, 1, 3] and lists[0, 0, 1, 0] == 2


def test_what_the_kernel_cannot_take_is_refused():
    q, k, v = qkv(0, B=1, T=16, N=2, H=8)
    kw = dict(block_size=4, top_k=2, impl="pallas", interpret=True)
    seg = np.ones((1, 16), np.int32)
    with pytest.raises(ValueError, match="q_segment_ids"):
        moba_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, **kw)
    with pytest.raises(ValueError, match="kv_positions"):
        moba_attention(q, k, v, kv_positions=np.arange(16), **kw)
    with pytest.raises(ValueError, match="sink_logits"):
        moba_attention(q, k, v, sink_logits=np.zeros(2, np.float32), **kw)
    with pytest.raises(ValueError, match="return_lse"):
        moba_attention(q, k, v, return_lse=True, **kw)
    with pytest.raises(ValueError, match="impl"):
        moba_attention(q, k, v, block_size=4, top_k=2, impl="triton")
    with pytest.raises(ValueError, match="platform"):
        moba_attention(q, k, v, block_size=4, top_k=2, impl="pallas", platform="npu")
    with pytest.raises(ValueError, match="block_size: expected a power of two >= 16"):
        moba_attention(q, k, v, block_size=4, top_k=2, impl="pallas", platform="cuda")
    # On this CPU only the interpreter runs the kernel: asked for, never picked in silence.
    with pytest.raises(ValueError, match=r"^interpret: expected True to run the block-sparse"):
        moba_attention(q, k, v, block_size=4, top_k=2, impl="pallas")
    with pytest.raises(ValueError, match=r"^interpret: expected None for impl='gather'"):
        moba_attention(q, k, v, block_size=4, top_k=2, interpret=True)


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_lowered_for_cuda(method):
    """One Triton kernel per selected branch, forward and under ``value_and_grad`` (whose
    backward is the gathered form's, in XLA), at bfloat16, GQA and T = 1000."""
    T, N, K, H = 1000, 8, 2, 64
    nsa = dict(compress_block=32, compress_stride=16, select_block=64, num_selected=4,
               window=128)  # fmt: skip

    def forward(q, k, v, gates, ck, cv):
        if method == "moba":
            return moba_attention(q, k, v, block_size=64, top_k=4, mask=masks.causal(),
                                  impl="pallas", platform="cuda")  # fmt: skip
        return nsa_attention(q, k, v, gates, ck, cv, mask=masks.causal(), impl="pallas",
                             platform="cuda", **nsa)  # fmt: skip

    def both(*args):
        loss = lambda *a: forward(*a).astype(jnp.float32).sum()  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)

    M = -(-T // 16)
    shapes = [(1, T, N, H), (1, T, K, H), (1, T, K, H), (1, T, N, 3), (1, M, K, H), (1, M, K, H)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    for fn in (forward, both):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
        assert exported(*args).mlir_module().count(TRITON) == 1, fn.__name__
