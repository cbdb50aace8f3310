"""The numerics phase's cases for softmax attention, the sparse methods (MoBA, NSA, DSA),
split-K and paged decoding, and PaTH (``bench/_device_numerics.py``; the shapes, helpers and
fixed-state families are ``bench/_device_cases.py``'s).
"""

from __future__ import annotations

import functools

import numpy as np

from bench._device_cases import (
    SIZES,
    Case,
    normal,
    packed_ids,
    reads,
    ref_softmax,
    rng_for,
    unit,
    visible,
)
from bench._device_common import interpreted


def softmax_case(variant: str, dry_run: bool) -> Case:
    import attn
    from attn import masks

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for(f"softmax/{variant}")
    mask = masks.causal()
    if variant == "streaming":
        mask = mask & (masks.sliding_window(z["window"]) | masks.initial_tokens(z["sinks"]))
    arrays = dict(q=normal(rng, (B, T, N, H)), k=normal(rng, (B, T, K, H)),
                  v=normal(rng, (B, T, K, H)))  # fmt: skip
    pos = np.arange(T)[None]
    seg = packed_ids(B, T) if variant == "segments" else None
    arrays["ok"] = visible(mask, pos, pos, seg, seg)
    softcap = None
    if variant == "sinks-softcap":
        arrays["sinks"] = rng.standard_normal(N).astype(np.float32)
        softcap = z["softcap"]
    if seg is not None:
        arrays["seg"] = seg

    def run(form, a):
        kw = dict(mask=mask, impl=form, softcap=softcap, sink_logits=a.get("sinks"))
        kw.update(interpreted(form))
        block = z[f"{form}_block"] if form in ("blockwise", "pallas") else None
        if block is not None:
            kw.update(block_q=block, block_k=block)
        if "seg" in a:
            kw.update(q_segment_ids=a["seg"], kv_segment_ids=a["seg"])
        return attn.attention(a["q"], a["k"], a["v"], **kw)

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["ok"], scale=H**-0.5,
                                     softcap=softcap, sinks=a.get("sinks"))  # fmt: skip

    return Case(f"softmax/{variant}", arrays, ("q", "k", "v"), ("q", "k", "v"),
                run, oracle, reference_only=("ok",))  # fmt: skip


def sparse_inputs(name: str, z: dict):
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for(name)
    arrays = dict(q=normal(rng, (B, T, N, H)), k=normal(rng, (B, T, K, H)),
                  v=normal(rng, (B, T, K, H)))  # fmt: skip
    return rng, arrays


def moba_case(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse import moba_select

    z = SIZES[dry_run]
    T, H, mask = z["T"], z["H"], masks.causal()
    _, arrays = sparse_inputs("moba/causal", z)
    pos = np.arange(T)[None]
    vis = visible(mask, pos, pos)
    sizes = dict(block_size=z["moba_block"], top_k=z["moba_top_k"])

    def run(form, a):
        return attn.moba_attention(a["q"], a["k"], a["v"], mask=mask, impl=form, **sizes,
                                   **interpreted(form))  # fmt: skip

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        start, stop = jax.jit(functools.partial(moba_select, **sizes))(c, a["q"], a["k"])
        return {"reads": reads(start, stop, T) & vis}

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["reads"], scale=H**-0.5)

    return Case("moba/causal", arrays, ("q", "k", "v"), ("q", "k", "v"), run,
                oracle, select=select)  # fmt: skip


def nsa_case(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse.gather import DEFAULT_CHUNK
    from attn.sparse.nsa import compressed_branch

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    sizes, mask = z["nsa"], masks.causal()
    block, stride = sizes["compress_block"], sizes["compress_stride"]
    rng, arrays = sparse_inputs("nsa/causal", z)
    M = -(-T // stride)
    arrays.update(
        gates=(1 / (1 + np.exp(-rng.standard_normal((B, T, N, 3))))).astype(np.float32),
        ck=normal(rng, (B, M, K, H)),
        cv=normal(rng, (B, M, K, H)),
    )
    pos = np.arange(T)[None]
    vis = np.broadcast_to(visible(mask, pos, pos), (B, 1, T, T))
    # Compressed block m holds positions m*stride .. m*stride + block - 1 (where they exist):
    # a query reads it when it sees every key in it.
    first = np.arange(M) * stride
    seen = np.concatenate([np.zeros((B, 1, T, 1), int), np.cumsum(vis, -1)], -1)
    last = np.minimum(first + block, T)
    arrays["cmp_ok"] = (first + block <= T) & (seen[..., last] - seen[..., first] == block)
    arrays["win_ok"] = vis & (pos[:, None, None, :] > pos[:, None, :, None] - sizes["window"])

    def run(form, a):
        return attn.nsa_attention(a["q"], a["k"], a["v"], a["gates"], a["ck"], a["cv"],
                                  mask=mask, impl=form, **sizes, **interpreted(form))  # fmt: skip

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        branch = functools.partial(compressed_branch, chunk=DEFAULT_CHUNK, **sizes)
        _, start, stop = jax.jit(branch)(c, a["q"], a["ck"], a["cv"])
        return {"slc_ok": np.repeat(reads(start, stop, T), N // K, axis=1) & vis}

    def oracle(a):
        scale = H**-0.5
        o_cmp = ref_softmax().softmax(a["q"], a["ck"], a["cv"], a["cmp_ok"], scale=scale)
        o_slc = ref_softmax().softmax(a["q"], a["k"], a["v"], a["slc_ok"], scale=scale)
        o_win = ref_softmax().softmax(a["q"], a["k"], a["v"], a["win_ok"], scale=scale)
        g = a["gates"]
        return sum(g[..., i, None] * o for i, o in enumerate((o_cmp, o_slc, o_win)))

    return Case("nsa/causal", arrays, ("q", "k", "v", "ck", "cv"),
                ("q", "k", "v", "gates", "ck", "cv"), run, oracle,
                reference_only=("cmp_ok", "win_ok"), select=select)  # fmt: skip


def dsa_case(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse import indexer_topk

    z = SIZES[dry_run]
    B, T, H, mask = z["B"], z["T"], z["H"], masks.causal()
    rng, arrays = sparse_inputs("dsa/causal", z)
    I, F = z["index_heads"], z["index_dim"]
    arrays.update(iq=normal(rng, (B, T, I, F)), ik=normal(rng, (B, T, F)),
                  iw=normal(rng, (B, T, I)))  # fmt: skip
    pos = np.arange(T)[None]
    vis = visible(mask, pos, pos)
    top_k = z["dsa_top_k"]

    def run(form, a):
        return attn.indexed_topk_attention(a["q"], a["k"], a["v"], a["iq"], a["ik"], a["iw"],
                                           top_k=top_k, mask=mask)  # fmt: skip

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        topk = jax.jit(functools.partial(indexer_topk, top_k=top_k))
        start, stop = topk(c, a["iq"], a["ik"], a["iw"])
        return {"reads": reads(start, stop, T) & vis}

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["reads"], scale=H**-0.5)

    return Case("dsa/causal", arrays, ("q", "k", "v"), ("q", "k", "v"), run,
                oracle, select=select)  # fmt: skip


def decode_case(dry_run: bool) -> Case:
    import jax.numpy as jnp

    import attn
    from attn import masks

    z = SIZES[dry_run]
    B, S, N, K, H, T = z["B"], z["T"], z["N"], z["K"], z["H"], z["decode_T"]
    rng = rng_for("decode/causal")
    mask, page = masks.causal(), z["page"]
    lengths = np.asarray(z["lengths"], np.int32)
    arrays = dict(q=normal(rng, (B, T, N, H)), k=normal(rng, (B, S, K, H)),
                  v=normal(rng, (B, S, K, H)), lengths=lengths)  # fmt: skip
    # Every row's own pages in a shuffled pool; -1 past a row's length; the last page is
    # scratch for the unused entries' writes.
    M = S // page
    tables = rng.permutation(B * M).reshape(B, M).astype(np.int32)
    tables[np.arange(M)[None] * page >= lengths[:, None]] = -1
    arrays["tables"] = tables
    q_pos = lengths[:, None] - T + np.arange(T)
    kv_pos = np.broadcast_to(np.arange(S), (B, S))
    arrays["ok"] = visible(mask, q_pos, kv_pos) & (kv_pos < lengths[:, None])[:, None, None]

    def run(form, a):
        if form != "paged":
            return attn.decode_attention(a["q"], a["k"], a["v"], lengths=a["lengths"],
                                         num_splits=z["splits"], mask=mask, impl=form,
                                         **interpreted(form))  # fmt: skip
        index = jnp.where(a["tables"] >= 0, a["tables"], B * M)
        pools = [
            jnp.zeros((B * M + 1, page, *x.shape[2:]), x.dtype).at[index].set(
                x.reshape(B, M, page, *x.shape[2:]))
            for x in (a["k"], a["v"])
        ]  # fmt: skip
        return attn.paged_decode_attention(a["q"], *pools, a["tables"], a["lengths"],
                                           num_splits=z["splits"], mask=mask)  # fmt: skip

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["ok"], scale=H**-0.5)

    return Case("decode/causal", arrays, ("q", "k", "v"), (), run, oracle,
                reference_only=("ok",))  # fmt: skip


def path_case(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for("path/fox")
    arrays = dict(q=normal(rng, (B, T, N, H)), k=normal(rng, (B, T, K, H)),
                  v=normal(rng, (B, T, K, H)), w=unit(rng, (B, T, K, H)),
                  beta=rng.uniform(0.05, 1.9, (B, T, K)).astype(np.float32),
                  log_forget=-rng.uniform(0.0, 0.5, (B, T, N)).astype(np.float32))  # fmt: skip
    scale = H**-0.5

    def run(form, a):
        return attn.path_attention(a["q"], a["k"], a["v"], a["w"], a["beta"], form=form,
                                   block_size=z["chunk"], log_forget=a["log_forget"],
                                   scale=scale)  # fmt: skip

    def oracle(a):
        args = (a["q"], a["k"], a["v"], a["w"], a["beta"], a["log_forget"])
        return ref_softmax().path_attention(*args, scale=scale)

    return Case("path/fox", arrays, ("q", "k", "v", "w"),
                ("q", "k", "v", "w", "beta", "log_forget"), run, oracle)  # fmt: skip
