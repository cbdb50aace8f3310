"""KV-cache sizes: the note's Llama 3 8B numbers exactly."""

import jax.numpy as jnp
import pytest

import attn

LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": jnp.float16}
KIB, GIB = 2**10, 2**30


def test_llama3_8b_from_the_note():
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
