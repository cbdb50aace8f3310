"""Are the numbers of a refactor's "after" the same bits as its "before"?

Computes outputs, log-sum-exps and gradients of every softmax implementation
(dense, blockwise, the Pallas kernel in interpret mode, splash in interpret
mode, split-K decoding, ring attention on 8 fake CPU devices), of the linear
and delta-rule forms, and the logits, parameter gradients and a prefill +
decode step of a 2-layer decoder of every preset, and saves them (``--save``)
or compares them with a saved set (``--check``), bit for bit::

    git stash; python tools/same_bits.py --save /tmp/before; git stash pop
    python tools/same_bits.py --check /tmp/before      # exit 1 if any bit differs

A refactor that moves code without changing the math leaves every array
identical; a difference names the case and its largest deviation.
"""

from __future__ import annotations

import os

# Before JAX starts: ring attention needs 8 devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import attn  # noqa: E402
from attn import masks, scores  # noqa: E402

B, T, S, N, K, H = 2, 37, 37, 4, 2, 16


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def qkv(T=T, S=S, N=N, K=K, dtype=jnp.float32):
    return (
        normal(1, (B, T, N, H), dtype),
        normal(2, (B, S, K, H), dtype),
        normal(3, (B, S, K, H), dtype),
    )


def segments(length):
    ids = np.ones((B, length), np.int32)
    ids[0, length // 3 :] = 2
    ids[1, length - 5 :] = 0  # padding
    return jnp.asarray(ids)


def softmax_cases():
    """name -> keyword arguments of one softmax call (besides q, k, v)."""
    slopes = jnp.asarray(scores.alibi_slopes(N))
    table = normal(7, (N, 32))
    log_f = jax.nn.log_sigmoid(normal(8, (B, T, N)) + 2.0)
    return {
        "full": {},
        "causal": dict(mask=masks.causal()),
        "window_initial": dict(
            mask=masks.causal() & (masks.sliding_window(5) | masks.initial_tokens(2))
        ),
        "segments": dict(
            mask=masks.causal(), q_segment_ids=segments(T), kv_segment_ids=segments(S)
        ),
        "softcap_sink": dict(mask=masks.causal(), softcap=5.0, sink_logits=normal(9, (N,))),
        "alibi": dict(mask=masks.causal(), score_mod=scores.alibi(slopes)),
        "t5": dict(mask=masks.causal(), score_mod=scores.relative_bias(table)),
        "fox_softcap": dict(
            mask=masks.causal(), score_mod=scores.softcap(4.0) + scores.forgetting(log_f)
        ),
        "global": dict(mask=masks.sliding_window(3) | masks.global_tokens((0, 9))),
    }


def grads(fn, q, k, v, kwargs):
    """``{out, lse, dq, dk, dv, d<leaf>...}`` of ``fn(q, k, v, return_lse=True, **kwargs)``."""
    differentiable = {name: x for name, x in kwargs.items() if name in ("sink_logits", "score_mod")}
    rest = {name: x for name, x in kwargs.items() if name not in differentiable}

    def loss(q, k, v, diff):
        out, lse = fn(q, k, v, return_lse=True, **rest, **diff)
        cot = normal(99, out.shape)
        lse_term = jnp.where(jnp.isfinite(lse), lse * normal(98, lse.shape), 0.0).sum()
        return (out.astype(jnp.float32) * cot).sum() + lse_term, (out, lse)

    g, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, differentiable
    )
    result = {"out": out, "lse": lse, "dq": g[0], "dk": g[1], "dv": g[2]}
    for i, leaf in enumerate(jax.tree.leaves(g[3])):
        result[f"d{i}"] = leaf
    return result


def attention_arrays():
    out = {}
    q, k, v = qkv()
    impls = {
        "dense": functools.partial(attn.attention, impl="dense"),
        "blockwise": functools.partial(attn.blockwise_attention, block_q=8, block_k=16),
        "pallas": functools.partial(
            attn.pallas.flash_attention, block_q=16, block_k=16, interpret=True
        ),
    }
    for name, kwargs in softmax_cases().items():
        for impl, fn in impls.items():
            out[f"{impl}/{name}"] = grads(fn, q, k, v, kwargs)
    out["blockwise/auto"] = grads(attn.blockwise_attention, q, k, v, dict(mask=masks.causal()))
    qb, kb, vb = qkv(dtype=jnp.bfloat16)
    out["blockwise/bf16"] = grads(
        functools.partial(attn.blockwise_attention, block_q=8, block_k=16),
        qb,
        kb,
        vb,
        dict(mask=masks.causal()),
    )
    out["dense/bf16"] = grads(attn.dot_product_attention, qb, kb, vb, dict(mask=masks.causal()))
    counts = attn.softmax.count_blocks(q, k, v, mask=masks.causal(), block_q=8, block_k=16)
    out["blockwise/counts"] = {"counts": np.asarray([counts.full, counts.partial, counts.total])}
    # T != S (bottom-right queries), xla (jax.nn) and splash in interpret mode.
    q1 = q[:, -5:]
    out["dense/decode_chunk"] = grads(
        attn.dot_product_attention, q1, k, v, dict(mask=masks.causal())
    )
    out["blockwise/decode_chunk"] = grads(
        functools.partial(attn.blockwise_attention, block_q=4, block_k=8),
        q1,
        k,
        v,
        dict(mask=masks.causal()),
    )
    qs, ks, vs = qkv(T=128, S=128)
    splash = attn.attention(qs, ks, vs, impl="splash", mask=masks.causal(), interpret=True)
    out["splash/causal"] = {"out": splash}
    out["xla/causal"] = {"out": attn.attention(q, k, v, impl="xla", mask=masks.causal())}
    # Split-K decoding over rows of their own lengths.
    lengths = jnp.asarray([30, 11])
    for impl, interpret in (("dense", None), ("pallas", True)):
        decoded = attn.decode_attention(
            q[:, :2], k, v, lengths=lengths, num_splits=3, mask=masks.causal(),
            sink_logits=normal(9, (N,)), impl=impl, interpret=interpret,
        )  # fmt: skip
        out[f"decode/{impl}"] = {"out": decoded}
    return out


def ring_arrays():
    out = {}
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    q, k, v = qkv(T=64, S=64)
    slopes = jnp.asarray(scores.alibi_slopes(N))
    cases = {
        "causal_zigzag": dict(mask=masks.causal()),
        "streaming_contiguous": dict(
            mask=masks.causal() & (masks.sliding_window(5) | masks.initial_tokens(3)),
            layout="contiguous",
        ),
        "segments_sink_alibi": dict(
            mask=masks.causal(),
            q_segment_ids=segments(64),
            kv_segment_ids=segments(64),
            sink_logits=normal(9, (N,)),
            score_mod=scores.alibi(slopes),
        ),
    }
    for name, kwargs in cases.items():
        fn = functools.partial(attn.sharded_attention, mesh=mesh, axis_name="seq")
        out[f"ring/{name}"] = grads(fn, q, k, v, kwargs)
    return out


def linear_arrays():
    out = {}
    q, k, v = qkv(K=N)
    log_g = jax.nn.log_sigmoid(normal(5, (B, T, N)) + 3.0)
    for form in attn.LINEAR_FORMS:

        def f(q, k, v, form=form):
            return attn.linear_attention(q, k, v, form=form, chunk_size=8, log_gates=log_g)

        out[f"linear/{form}"] = _vjp(f, q, k, v)
    beta = jax.nn.sigmoid(normal(6, (B, T, N)))
    kn = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    for form in attn.DELTA_FORMS:

        def d(q, k, v, form=form):
            return attn.delta_rule(q, k, v, beta, log_gates=log_g, form=form, chunk_size=8)

        out[f"delta/{form}"] = _vjp(d, q, kn, v)
    return out


def _vjp(f, *args):
    y, pull = jax.vjp(f, *args)
    y = y[0] if isinstance(y, tuple) else y
    cot = normal(99, y.shape)
    grads = pull(
        cot
        if not isinstance(jax.eval_shape(f, *args), tuple)
        else (cot, *[jnp.zeros(s.shape, s.dtype) for s in jax.eval_shape(f, *args)[1:]])
    )
    return {"out": y, **{f"d{i}": g for i, g in enumerate(grads)}}


def model_arrays():
    from flax import nnx

    import models

    out = {}
    sizes = dict(num_heads=4, head_dim=8, window=3, kv_rank=8, q_rank=8, chunk_size=4)
    built = models.presets(**sizes)
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, 32)
    names = [n for n in built if not n.endswith("_conv")] + ["mha_conv", "linear_conv"]
    for name in sorted(names):
        try:
            layer = built[name]
        except ValueError:  # not buildable at these sizes
            continue
        if not models.patterns.valid_in(layer, causal=True):
            continue
        config = models.ModelConfig(vocab_size=32, width=16, mlp_width=32, layers=(layer, layer))
        model = models.Decoder(config, rngs=nnx.Rngs(0))
        cot = normal(11, (2, 11, 32))

        def loss(model, cot=cot):
            return (model(tokens) * cot).sum()

        arrays = {"logits": model(tokens)}
        grads_ = nnx.state(nnx.grad(loss)(model))
        for path, x in jax.tree_util.tree_leaves_with_path(grads_):
            arrays["grad" + jax.tree_util.keystr(path)] = x
        cache = model.init_cache(2, 16)
        arrays["prefill"], cache = model.prefill(tokens[:, :8], cache)
        arrays["step"], cache = model.decode_step(tokens[:, 8], cache)
        out[f"model/{name}"] = arrays
    return out


def compute() -> dict[str, np.ndarray]:
    jax.config.update("jax_default_matmul_precision", "highest")
    groups = {}
    for part in (attention_arrays, ring_arrays, linear_arrays, model_arrays):
        groups.update(part())
    flat = {}
    for case, arrays in groups.items():
        for name, x in arrays.items():
            flat[f"{case}:{name}"] = np.asarray(
                jnp.asarray(x).astype(jnp.float32) if jnp.asarray(x).dtype == jnp.bfloat16 else x
            )
    return flat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path)
    group.add_argument("--check", type=Path)
    args = parser.parse_args(argv)
    flat = compute()
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        np.savez(args.save / "arrays.npz", **flat)
        print(f"saved {len(flat)} arrays to {args.save}")
        return 0
    saved = dict(np.load(args.check / "arrays.npz"))
    bad = []
    for key in sorted(set(saved) | set(flat)):
        if key not in flat or key not in saved:
            bad.append(f"{key}: only in {'the saved set' if key in saved else 'this run'}")
            continue
        a, b = saved[key], flat[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{key}: {a.dtype}{a.shape} before, {b.dtype}{b.shape} now")
        elif not np.array_equal(a, b, equal_nan=True):
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            bad.append(f"{key}: differs, max |diff| {np.nanmax(diff):.3g}")
    for line in bad:
        print(line)
    print(f"{len(flat)} arrays, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
