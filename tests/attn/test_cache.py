"""KV-cache sizes (Llama 3 8B's numbers exactly) and the slot bookkeeping of KV caches.

Llama 3 8B (Llama Team, "The Llama 3 Herd of Models", 2024) has 32 layers and 8
KV heads of dim 128: 2 x 32 x 8 x 128 x 2 bytes = 128 KiB per fp16 token, 1 GiB
for an 8K-token request, 16 GiB for 16 of them, 4x that with 32 KV heads (MHA).
"""

import jax.numpy as jnp
import numpy as np
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


# ----------------------------------------------------------------------------
# Slot caches: full and ring layouts, positions stored with the entries

EMPTY = attn.cache.EMPTY


def _empty(B, S, width=2):
    return (jnp.zeros((B, S, width)),), jnp.full((B, S), EMPTY, jnp.int32)


def _payload(start, T, B=2, width=2):
    """Entries whose value is their own position, so a slot shows what it holds."""
    pos = jnp.asarray(start)[:, None] + jnp.arange(T)
    return (jnp.broadcast_to(pos[..., None], (B, T, width)).astype(jnp.float32),)


def test_slot_of_pins_then_cycles():
    slots = attn.cache.slot_of(jnp.arange(10), pinned=2, slots=5)
    np.testing.assert_array_equal(slots, [0, 1, 2, 3, 4, 2, 3, 4, 2, 3])
    np.testing.assert_array_equal(attn.cache.slot_of(jnp.arange(4), 0, 4), np.arange(4))


def test_a_long_prompt_into_a_ring_equals_one_token_at_a_time():
    """Writing 9 tokens at once into 2 pinned + 3 ring slots keeps what 9 single
    writes keep: the pinned positions and the 3 latest; the gather never collides."""
    B, S, pinned = 2, 5, 2
    old, old_pos = _empty(B, S)
    start, count = jnp.array([0, 0]), jnp.array([9, 4])  # row 1: 4 real tokens, then padding
    arrays, pos = attn.cache.write_tokens(old, old_pos, _payload(start, 9), start, count, pinned)
    for b in range(B):
        one, one_pos = _empty(1, S)
        for t in range(int(count[b])):
            at = jnp.array([t])
            one, one_pos = attn.cache.write_token(one, one_pos, _payload(at, 1, B=1), at, pinned)
        np.testing.assert_array_equal(pos[b], one_pos[0])
        np.testing.assert_array_equal(arrays[0][b], one[0][0])
    np.testing.assert_array_equal(pos[0], [0, 1, 8, 6, 7])  # pinned 0, 1; 6..8 in ring order
    np.testing.assert_array_equal(pos[1], [0, 1, 2, 3, EMPTY])
    np.testing.assert_array_equal(arrays[0][..., 0], np.where(pos >= 0, pos, 0))


def test_extend_slots_prefill_then_decode():
    B, S = 2, 4
    old, old_pos = _empty(B, S)
    start, lengths = jnp.array([0, 0]), jnp.array([3, 1])
    (visible, vis_pos), (arrays, pos) = attn.cache.extend_slots(
        old, old_pos, _payload(start, 3), start, lengths, pinned=0
    )
    # A prefill attends over the old slots and the new tokens (padding EMPTY) ...
    assert visible[0].shape == (B, S + 3, 2)
    np.testing.assert_array_equal(vis_pos[:, S:], [[0, 1, 2], [0, EMPTY, EMPTY]])
    np.testing.assert_array_equal(pos, [[0, 1, 2, EMPTY], [0, EMPTY, EMPTY, EMPTY]])
    # ... and a decode step writes first, then attends over the slots alone.
    start = jnp.array([3, 1])
    (visible, vis_pos), (arrays, pos) = attn.cache.extend_slots(
        arrays, pos, _payload(start, 1), start
    )
    assert visible[0].shape == (B, S, 2)
    np.testing.assert_array_equal(vis_pos, pos)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3], [0, 1, EMPTY, EMPTY]])
    np.testing.assert_array_equal(arrays[0][1, :2, 0], [0, 1])
