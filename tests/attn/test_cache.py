"""KV-cache sizes: Llama 3 8B's numbers exactly.

Llama 3 8B (Llama Team, "The Llama 3 Herd of Models", 2024) has 32 layers and 8
KV heads of dim 128: 2 x 32 x 8 x 128 x 2 bytes = 128 KiB per fp16 token, 1 GiB
for an 8K-token request, 16 GiB for 16 of them, 4x that with 32 KV heads (MHA).
"""

import jax.numpy as jnp
import pytest

import attn

LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": jnp.float16}
KIB, GIB = 2**10, 2**30


def test_llama3_8b_cache_sizes():
    assert attn.kv_cache_bytes(**LLAMA3_8B) == 131072 == 128 * KIB
    assert attn.kv_cache_bytes(**LLAMA3_8B, num_tokens=8192) == 1 * GIB
    assert attn.kv_cache_bytes(**LLAMA3_8B, num_tokens=8192, batch=16) == 16 * GIB
    mha = dict(LLAMA3_8B, num_kv_heads=32)
    assert attn.kv_cache_bytes(**mha, num_tokens=8192) == 4 * GIB


def test_dtype_and_mqa():
    f32 = dict(LLAMA3_8B, dtype=jnp.float32)
    assert attn.kv_cache_bytes(**f32) == 2 * attn.kv_cache_bytes(**LLAMA3_8B)
    assert attn.kv_cache_bytes(**dict(LLAMA3_8B, num_kv_heads=1)) * 8 == 131072
    assert attn.kv_cache_bytes(**LLAMA3_8B, num_tokens=0) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_kv_heads", -1),
        ("head_dim", 2.0),
        ("num_tokens", -1),
        ("batch", 0),
        ("dtype", "word"),
    ],
)
def test_bad_input(field, value):
    with pytest.raises(ValueError, match=field):
        attn.kv_cache_bytes(**dict(LLAMA3_8B, **{field: value}))


def test_latent_cache_of_deepseek_v2():
    # 60 layers, rank 512 plus a 64-wide RoPE key, bfloat16: (512 + 64) * 2 * 60 bytes.
    dsv2 = {"num_layers": 60, "kv_rank": 512, "rope_head_dim": 64, "dtype": jnp.bfloat16}
    assert attn.latent_cache_bytes(**dsv2) == 69120
    mha = attn.kv_cache_bytes(num_layers=60, num_kv_heads=128, head_dim=128, dtype=jnp.bfloat16)
    assert mha / attn.latent_cache_bytes(**dsv2) == pytest.approx(56.9, abs=0.05)
    assert attn.latent_cache_bytes(**dsv2, num_tokens=10, batch=3) == 30 * 69120


def test_linear_state_does_not_depend_on_length():
    shape = {"num_layers": 4, "num_heads": 8, "feature_dim": 64, "value_dim": 64}
    # kv [N,F,E] plus the normalizer z [N,F], float32.
    assert attn.linear_state_bytes(**shape) == 4 * 8 * 64 * 65 * 4
    assert attn.linear_state_bytes(**shape, batch=2) == 2 * attn.linear_state_bytes(**shape)


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (attn.latent_cache_bytes, {"kv_rank": 0, "rope_head_dim": 8, "dtype": "f4"}, "kv_rank"),
        (
            attn.latent_cache_bytes,
            {"kv_rank": 8, "rope_head_dim": -1, "dtype": "f4"},
            "rope_head_dim",
        ),
        (
            attn.linear_state_bytes,
            {"num_heads": 2, "feature_dim": 0, "value_dim": 4},
            "feature_dim",
        ),
    ],
)
def test_latent_and_state_bad_input(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(num_layers=2, **kwargs)
