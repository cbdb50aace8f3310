"""A one-minute tour: the note's worked example and our attention against jax.nn.

Run with ``python -m attn.demo``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import attn
from attn import masks


def worked_example() -> None:
    """The note's 3 tokens with d_k = 2 and Q = K."""
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, :, None]
    v = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])[None, :, None]
    out, w = attn.dot_product_attention(x, x, v, return_weights=True)
    print("The note's worked example (3 tokens, d_k = 2):")
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
    """The note's KV-cache arithmetic for Llama 3 8B."""
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
