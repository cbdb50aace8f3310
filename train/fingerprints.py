"""Fingerprints of arrays: two 32-bit sums of their bits, the same wherever they live.

A checkpoint records them at save time and compares them with the arrays it
reads back (``train.checkpoint``): a flipped byte changes one 32-bit word, hence
the plain sum and the position-weighted one. Device arrays are summed on their
device (sharded ones too: no host copy of the state), host arrays in NumPy,
with the same numbers for the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprints"]


def _words(x):
    """``x``'s bits as uint32 words of its own shape (8-byte items: a trailing axis of 2).

    No reshape: a reshape of an array sharded on Explicit mesh axes needs an output
    sharding; elementwise ops and full reductions need none.
    """
    size = jnp.dtype(x.dtype).itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape):
    """1 + the row-major flat index of every element of ``shape``, as uint32 (mod 2^32)."""
    index, stride = jnp.ones(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride = (stride * shape[axis]) % 2**32
    return index


@jax.jit
def _device_fingerprints(leaves):
    def one(x):
        w = _words(x)
        return jnp.stack(
            [jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * _flat_index(w.shape), dtype=jnp.uint32)]
        )

    return [one(x) for x in leaves]


def _host_fingerprint(x) -> list[int]:
    """``_device_fingerprints``' two sums for a host array (the same numbers for the same bits)."""
    data = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    size = data.dtype.itemsize
    if size in (4, 8):
        w = data.view(np.uint32).astype(np.uint64)
    else:
        w = data.view({2: np.uint16, 1: np.uint8}[size]).astype(np.uint64)
    index = np.arange(1, w.size + 1, dtype=np.uint64)
    # uint64 wraps modulo 2^64, a multiple of 2^32: the low words agree with uint32 sums.
    return [int(w.sum(dtype=np.uint64) % 2**32), int((w * index).sum(dtype=np.uint64) % 2**32)]


def fingerprints(tree) -> dict[str, list[int]]:
    """``{path: [sum, weighted sum]}`` of each array leaf's bits as 32-bit words (mod 2^32).

    Device arrays are summed where they live (sharded ones too: no host copy
    of the state), host arrays on the host, with the same numbers for the
    same bits either way.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [jax.tree_util.keystr(path) for path, _ in flat]
    device = [i for i, (_, x) in enumerate(flat) if isinstance(x, jax.Array)]
    sums = dict(zip(device, _device_fingerprints([flat[i][1] for i in device]), strict=True))
    return {
        name: [int(v) for v in np.asarray(sums[i])] if i in sums else _host_fingerprint(x)
        for i, (name, (_, x)) in enumerate(zip(names, flat, strict=True))
    }
