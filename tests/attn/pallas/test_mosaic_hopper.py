"""The Mosaic GPU flash attention's Hopper kernels themselves, on a CPU.

Pallas's Mosaic GPU interpreter in jax 0.11 runs everything the Hopper
kernels do except ``wgmma`` with a register operand and swizzled shared
memory: the warp-specialised kernels (their TMA producer warpgroup, their
consumers each on its own block, the forward's two taking turns on a barrier,
the pipelines' dynamic trip counts and index maps read from the schedule row
in shared memory), their unspecialised forms, the dk/dv kernel's transposed
tiles and GQA loop over query heads, the outputs written over the operands'
slots. Here the two product helpers are replaced by ``jnp.dot`` on the same
tiles and the tiles are left unswizzled; every other line is the kernels' own. What remains for a
GPU: wgmma and its register layouts, the swizzle, the fast ``ex2``, timing.

jax 0.10's interpreter (the CI's) cannot run these kernels (no pipelines),
so this file runs under ``tools/test_mosaic_jax011.sh`` (jax 0.11.2, the GPU
machine's) and is skipped under older jax; the twins in ``test_mosaic.py``
check the same math under both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.pallas import mosaic_backward, mosaic_common, mosaic_forward
from attn.pallas.mosaic import mosaic_attention
from tests.attn.pallas.test_mosaic import (
    BF16_TOL,
    GLOBAL,
    LSE_TOL,
    STREAMING,
    check_lse,
    segments,
    value_and_grads,
)
from tests.util import qkv, rel_err

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        jax.__version_info__ < (0, 11),
        reason="jax 0.11's Mosaic GPU interpreter (tools/test_mosaic_jax011.sh)",
    ),
]


@pytest.fixture
def emulated(monkeypatch):
    """The Hopper kernels under the interpreter, their wgmma products as ``jnp.dot``."""
    dot, launch = mosaic_common.dot, mosaic_common.kernel

    def product(a_smem, b_smem, shape, issued=None):
        out = dot(a_smem[...], b_smem[...], (1, 1))
        if issued is not None:
            issued()
        return out

    def accumulate(acc, a, b_smem):
        return acc + dot(a.astype(b_smem.dtype), b_smem[...], (1, 0))

    def kernel(body, out_shape, scratch, grid, approx=False, **kwargs):
        return launch(body, out_shape, scratch, grid, interpret=mosaic_common.interpreter(),
                      **kwargs)  # fmt: skip

    stand_ins = dict(product=product, accumulate=accumulate, kernel=kernel, swizzle=lambda: ())
    for module in (mosaic_common, mosaic_forward, mosaic_backward):
        for name, fn in stand_ins.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fn)


# name -> (mask, shape, dtype, call keywords, kernel keywords); B = 2.
CASES = {
    # Two consumers taking turns; T = S = 200 pads the last program and key block.
    "specialised_streaming_segments_sinks_softcap": (
        STREAMING, dict(T=200, N=4, K=2, H=64), jnp.bfloat16,
        dict(softcap=20.0, segments=(120, 150)), dict(consumers=2),
    ),
    # One consumer; E != H gives the output its own slots; MQA; key blocks of 128.
    "one_consumer_global_mqa_e_ne_h": (
        GLOBAL, dict(T=192, N=2, K=1, H=128, E=64), jnp.float16, {},
        dict(consumers=1, block_k=128),
    ),
    # The defaults the GPU benchmarks time: two consumers, blocks of 64, head dim 128,
    # causal, no sinks.
    "specialised_causal_defaults_h128": (
        masks.causal(), dict(T=256, N=2, K=1, H=128), jnp.bfloat16, dict(sinks=False), {},
    ),
    # Unspecialised, blocks of 128, T != S with positions given per row.
    "unspecialised_chunked_t_ne_s": (
        masks.causal() & masks.chunked(96), dict(T=128, S=200, N=2, K=1, H=64, E=128),
        jnp.bfloat16, dict(positions=True), dict(consumers=0, block_q=128, block_k=128),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_hopper_kernels_interpreted(case, emulated):
    """Output, lse and the gradients of q, k, v (and the sinks, where given) of the Hopper
    kernels against float32 dense on the same 16-bit values."""
    mask, shape, dtype, call, kernel_kw = CASES[case]
    q, k, v = qkv(5, B=2, dtype=dtype, **shape)
    kw = dict(call, mask=mask)
    if "segments" in kw:
        seg = segments(2, shape["T"], kw.pop("segments"))
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    if kw.pop("positions", False):
        kw["q_positions"] = jnp.stack([jnp.arange(72, 200), jnp.arange(60, 188)])
    sinks = kw.pop("sinks", True)
    kernel = functools.partial(mosaic_attention, interpret=False, **kernel_kw)
    out, lse, grads = value_and_grads(kernel, q, k, v, sinks=sinks, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_lse, want_grads = value_and_grads(attn.dot_product_attention, *f32,
                                                 sinks=sinks, **kw)  # fmt: skip
    assert out.dtype == dtype and rel_err(out, want) <= BF16_TOL
    check_lse(lse, want_lse, LSE_TOL)
    for g, w in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all() and rel_err(g, w) <= BF16_TOL
