"""A one-minute tour: a worked example by hand, our attention against jax.nn, cache sizes.

Run with ``python -m attn.demo``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import attn
from attn import masks


def worked_example() -> None:
    """Scaled dot-product attention (Vaswani et al., 2017) worked by hand.

    Three tokens, d_k = 2, Q = K = [[1, 0], [0, 1], [1, 1]] (identity
    projections), V = [[1, 0], [0, 1], [0.5, 0.5]]: the weights round to
    [[0.40, 0.20, 0.40], [0.20, 0.40, 0.40], [0.25, 0.25, 0.50]] and token 1's
    output is 0.4 [1, 0] + 0.2 [0, 1] + 0.4 [0.5, 0.5] = [0.6, 0.4].
    """
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, :, None]
    v = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])[None, :, None]
    out, w = attn.dot_product_attention(x, x, v, return_weights=True)
    print("A worked example (3 tokens, d_k = 2, Q = K):")
    print("weights =\n", np.round(np.asarray(w[0, 0], np.float64), 2))
    print("outputs =\n", np.round(np.asarray(out[0, :, 0], np.float64), 2))


def against_jax_nn() -> None:
    """Max |ours - jax.nn| for MHA/GQA/MQA under causal and sliding-window masks."""
    key = jax.random.PRNGKey(0)
    print("\nattn.dot_product_attention vs jax.nn.dot_product_attention (B=2, T=64, N=8, H=32):")
    print(f"{'heads':>10} {'mask':>10} {'max |diff|':>12}")
    for name, K in (("MHA", 8), ("GQA", 2), ("MQA", 1)):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, K), 3)
        q = jax.random.normal(kq, (2, 64, 8, 32))
        k = jax.random.normal(kk, (2, 64, K, 32))
        v = jax.random.normal(kv, (2, 64, K, 32))
        cases = (
            ("causal", masks.causal(), {"is_causal": True}),
            (
                "window16",
                masks.sliding_window(16),
                {"is_causal": True, "local_window_size": (15, 0)},
            ),
        )
        for mask_name, mask, kw in cases:
            ours = attn.dot_product_attention(q, k, v, mask=mask)
            theirs = jax.nn.dot_product_attention(q, k, v, **kw)
            print(f"{name:>10} {mask_name:>10} {float(jnp.abs(ours - theirs).max()):12.2e}")


def cache_sizes() -> None:
    """KV-cache arithmetic for Llama 3 8B (32 layers, 8 KV heads of dim 128; Llama Team,
    "The Llama 3 Herd of Models", 2024): 128 KiB per fp16 token, 1 GiB per 8K request."""
    llama = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": jnp.float16}
    per_token = attn.kv_cache_bytes(**llama)
    request = attn.kv_cache_bytes(**llama, num_tokens=8192)
    print("\nLlama 3 8B KV cache (fp16, 8 KV heads):")
    print(f"  per token: {per_token} bytes ({per_token // 1024} KiB)")
    print(f"  8192 tokens: {request / 2**30:g} GiB; 16 requests: {16 * request / 2**30:g} GiB")
    mha = attn.kv_cache_bytes(**dict(llama, num_kv_heads=32), num_tokens=8192)
    print(f"  with 32 KV heads (MHA): {mha / 2**30:g} GiB per request")


def main() -> None:
    worked_example()
    against_jax_nn()
    cache_sizes()


if __name__ == "__main__":
    main()
