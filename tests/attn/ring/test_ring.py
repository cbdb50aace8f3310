"""Ring attention's layouts, work counts and argument checks: what needs no devices.

Its multi-device cases (sharded ring attention equals dense attention on 4 and 8
devices) need several devices requested before JAX starts:
``tests/devices/test_ring.py``, in the fake-device tier.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, ring
from attn.ring.work import ring_work, work_table
from tests.util import qkv


def test_zigzag_order():
    np.testing.assert_array_equal(ring.zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    order = ring.zigzag_order(24, 3)  # chunks of 4: devices hold (0, 5), (1, 4), (2, 3)
    np.testing.assert_array_equal(order.reshape(3, 2, 4)[:, :, 0] // 4, [[0, 5], [1, 4], [2, 3]])
    np.testing.assert_array_equal(np.sort(order), np.arange(24))
    np.testing.assert_array_equal(ring.layout_order(12, 3, "contiguous"), np.arange(12))


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_layout_round_trip(layout):
    x = jnp.arange(2 * 16 * 4).reshape(2, 16, 4)
    there = ring.to_layout(x, 4, layout)
    assert not (layout == "zigzag" and np.array_equal(there, x))
    np.testing.assert_array_equal(ring.from_layout(there, 4, layout), x)
    np.testing.assert_array_equal(
        ring.from_layout(ring.to_layout(x, 2, layout, 2), 2, layout, 2), x
    )


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: ring.zigzag_order(12, 4), "length"),  # 12 % 8
        (lambda: ring.layout_order(10, 4, "contiguous"), "length"),
        (lambda: ring.layout_order(8, 0, "contiguous"), "num_devices"),
        (lambda: ring.layout_order(8, 2, "ring"), "layout"),
        (lambda: ring.to_layout(jnp.zeros((1, 6)), 4), "length"),
    ],
)
def test_layout_errors_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        call()


def test_ring_attention_needs_a_bound_axis():
    q, k, v = qkv(0, B=1, T=8, N=4, K=2, H=8)
    with pytest.raises(ValueError, match=r"^axis_name: expected a mesh axis bound"):
        attn.ring_attention(q, k, v, axis_name="seq")
    with pytest.raises(ValueError, match=r"^axis_name: expected the name"):
        attn.ring_attention(q, k, v, axis_name=0)
    with pytest.raises(ValueError, match=r"^mask: expected"):
        attn.ring_attention(q, k, v, axis_name="seq", mask="causal")


def test_sharded_attention_checks_its_mesh():
    q, k, v = qkv(0, B=1, T=8, N=4, K=2, H=8)
    with pytest.raises(ValueError, match=r"^mesh: expected a jax.sharding.Mesh"):
        attn.sharded_attention(q, k, v, mesh="mesh", axis_name="seq")


def test_causal_work_contiguous_is_unbalanced_zigzag_is_not():
    T, P, block = 4096, 8, 128
    contiguous = ring_work(masks.causal(), T, P, layout="contiguous", block_q=block, block_k=block)
    zigzag = ring_work(masks.causal(), T, P, layout="zigzag", block_q=block, block_k=block)
    # Contiguous: device i meets the i + 1 blocks at or before its own; the rest are skipped.
    np.testing.assert_array_equal(contiguous.steps, np.arange(1, P + 1))
    np.testing.assert_array_equal(zigzag.steps, np.full(P, P))
    # The same tiles in all (the mask's non-empty ones), spread evenly only by zigzag.
    n = T // block
    assert contiguous.tiles.sum() == zigzag.tiles.sum() == n * (n + 1) // 2
    assert (zigzag.tiles == zigzag.tiles[0]).all()
    assert contiguous.tiles.max() / contiguous.tiles.mean() > 1.8
    # Default zigzag tiles stop at a chunk, so no tile spans a shard's two chunks.
    default = ring_work(masks.causal(), T, P, layout="zigzag")
    assert (default.tiles == default.tiles[0]).all()
    assert default.tiles.sum() == (2 * P) * (2 * P + 1) // 2


def test_work_table_renders():
    table = work_table(256, 4, blocks=(16,))
    assert "| 16 | zigzag |" in table and "| 16 | contiguous |" in table
