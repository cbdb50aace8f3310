"""Accelerator code lowered from this CPU host with ``jax.export``: the CI's guard until a
device is lent.

* The Pallas kernel for ``cuda``: every case must lower to Triton (one
  ``__gpu$xla.gpu.triton`` custom call per kernel: the forward, and with the
  backward the dq and dk/dv kernels), over GQA/MQA/MHA, head dims 64 and
  128, lengths that are and are not powers of two, masks, dtypes and score
  modifiers. Launch parameters and interpret mode follow ``platform``, not
  the host (a CPU host would otherwise pick Mosaic GPU, which refuses these
  kernels); and with ``jax.nn``'s bias and boolean mask arrays.
* Splash attention for ``tpu``: a ``tpu_custom_call`` per kernel.
* Blockwise attention for ``tpu`` with modifiers: what ``impl="auto"`` runs on
  a TPU where splash cannot (our Pallas kernel's blocks do not meet Mosaic
  TPU's (8, 128) tiling, which ``test_pallas_for_tpu_is_refused_by_mosaic``
  records).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import attn
from attn import masks, scores
from attn.pallas import flash_attention, splash_attention

pytestmark = pytest.mark.integration  # accelerator code lowered from the CPU
TRITON = "__gpu$xla.gpu.triton"
STREAMING = masks.causal() & (masks.sliding_window(256) | masks.initial_tokens(4))


def modifier(name, B, T, N):
    """A modifier of each kind, from abstract-shaped leaves (only shapes matter to export)."""
    if name == "none":
        return None, ()
    if name == "alibi":
        return (lambda slopes: scores.alibi(slopes)), ((N,),)
    if name == "t5":
        return (lambda table: scores.relative_bias(table)), ((N, 32),)
    if name == "fox":
        return (lambda log_f: scores.forgetting(log_f)), ((B, T, N),)
    if name == "softcap_alibi_t5":
        return (
            lambda slopes, table: (
                scores.softcap(30.0)
                + scores.alibi(slopes)
                + scores.relative_bias(table, num_buckets=16, bidirectional=True)
            )
        ), ((N,), (N, 16))
    raise AssertionError(name)


def export(fn, platform, arg_shapes, dtypes, disabled=()):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(arg_shapes, dtypes, strict=True)]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in disabled]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


def lowered(impl, platform, *, K, H, T, mask, dtype, mod, backward, B=1, N=8, **kw):
    """The exported module's text for one case."""
    build, leaf_shapes = modifier(mod, B, T, N)

    def forward(q, k, v, *leaves):
        score_mod = None if build is None else build(*leaves)
        return impl(q, k, v, mask=mask, score_mod=score_mod, **kw)

    def both(q, k, v, *leaves):
        loss = lambda *a: forward(*a).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=tuple(range(3 + len(leaves))))(q, k, v, *leaves)

    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), *leaf_shapes]
    dtypes = [dtype] * 3 + [jnp.float32] * len(leaf_shapes)
    disabled = (TRITON,) if platform == "cuda" else ()
    return export(both if backward else forward, platform, shapes, dtypes, disabled).mlir_module()


# (K, H, T, mask, dtype, modifier, backward): every value of each appears, in pairs
# that vary together, instead of the full product (each export lowers 1-3 kernels).
CUDA_CASES = [
    (2, 64, 1000, masks.causal(), jnp.bfloat16, "none", False),
    (2, 64, 1000, masks.causal(), jnp.bfloat16, "alibi", True),
    (1, 128, 1024, STREAMING, jnp.bfloat16, "fox", True),
    (1, 128, 1024, masks.full(), jnp.float16, "t5", False),
    (8, 64, 2048, masks.causal(), jnp.float16, "softcap_alibi_t5", True),
    (2, 128, 2048, STREAMING, jnp.bfloat16, "none", True),
    (2, 64, 1024, masks.full(), jnp.float32, "fox", True),
    (1, 64, 1000, masks.causal() & masks.chunked(256), jnp.bfloat16, "t5", True),
]


@pytest.mark.parametrize("K, H, T, mask, dtype, mod, backward", CUDA_CASES)
def test_pallas_lowers_to_triton_for_cuda(K, H, T, mask, dtype, mod, backward):
    text = lowered(
        functools.partial(flash_attention, platform="cuda"), "cuda", K=K, H=H, T=T,
        mask=mask, dtype=dtype, mod=mod, backward=backward,
    )  # fmt: skip
    names = ["attn_flash_forward"] + (["attn_flash_dq", "attn_flash_dkdv"] if backward else [])
    assert text.count(TRITON) == len(names)
    for name in names:
        assert f'name = "{name}"' in text, name
    assert "num_warps" in text  # Triton's launch parameters, not Mosaic GPU's defaults


@pytest.mark.parametrize(
    ("bias_shape", "mask_shape", "T"),
    [((1, 8, 1024, 1024), (2, 1, 1024, 1024), 1024), ((2, 1, 1, 1000), (1000, 1000), 1000)],
)
def test_bias_and_mask_arrays_lower_to_triton_for_cuda(bias_shape, mask_shape, T):
    """jax.nn's bias and boolean mask read per tile in all three kernels (the bias's
    gradient written by the dq kernel), forward and backward."""

    def both(q, k, v, bias, keep):
        def loss(q, k, v, bias):
            out = flash_attention(q, k, v, bias=bias, mask=keep, platform="cuda")
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    shapes = [(2, T, 8, 64), (2, T, 2, 64), (2, T, 2, 64), bias_shape, mask_shape]
    dtypes = [jnp.bfloat16] * 3 + [jnp.float32, jnp.bool_]
    text = export(both, "cuda", shapes, dtypes, (TRITON,)).mlir_module()
    assert text.count(TRITON) == 3
    for name in ("attn_flash_forward", "attn_flash_dq", "attn_flash_dkdv"):
        assert f'name = "{name}"' in text, name


def test_attention_dispatch_takes_the_platform_through():
    text = lowered(
        functools.partial(attn.attention, impl="pallas", platform="gpu"), "cuda", K=2, H=64,
        T=256, mask=masks.causal(), dtype=jnp.bfloat16, mod="alibi", backward=False,
    )  # fmt: skip
    assert text.count(TRITON) == 1


def test_split_k_decode_lowers_to_triton_for_cuda():
    """One query per row over a 64K cache in 16 splits: one Triton kernel over the splits."""
    B, S, N, K, H = 2, 65536, 8, 2, 128

    def decode(q, k, v, lengths):
        return attn.decode_attention(q, k, v, lengths=lengths, num_splits=16, mask=STREAMING,
                                     impl="pallas", platform="gpu")  # fmt: skip

    shapes = [(B, 1, N, H), (B, S, K, H), (B, S, K, H), (B,)]
    dtypes = [jnp.bfloat16] * 3 + [jnp.int32]
    text = export(decode, "cuda", shapes, dtypes, (TRITON,)).mlir_module()
    assert text.count(TRITON) == 1
    assert 'name = "attn_flash_forward"' in text


SPLASH_CASES = [
    (2, 128, 1024, masks.causal(), jnp.bfloat16, False, None),
    (2, 128, 1024, masks.sliding_window(256), jnp.bfloat16, True, None),
    (1, 64, 2048, STREAMING, jnp.float32, True, 20.0),
    (8, 128, 1000, masks.full(), jnp.bfloat16, True, None),
]


@pytest.mark.parametrize("K, H, T, mask, dtype, backward, cap", SPLASH_CASES)
def test_splash_lowers_to_mosaic_for_tpu(K, H, T, mask, dtype, backward, cap):
    impl = functools.partial(splash_attention, platform="tpu")
    if cap is not None:  # a lone soft-cap modifier maps onto splash's own
        impl = functools.partial(impl, score_mod=scores.softcap(cap))
    impl_no_mod = lambda q, k, v, mask, score_mod: impl(q, k, v, mask=mask)  # noqa: E731
    text = lowered(
        impl_no_mod, "tpu", K=K, H=H, T=T, mask=mask, dtype=dtype, mod="none", backward=backward
    )
    assert text.count("tpu_custom_call") == (3 if backward else 1)


@pytest.mark.parametrize("mod", ["alibi", "fox", "softcap_alibi_t5"])
def test_blockwise_with_modifiers_lowers_for_tpu(mod):
    text = lowered(
        attn.blockwise_attention, "tpu", K=2, H=128, T=1024, mask=masks.causal(),
        dtype=jnp.bfloat16, mod=mod, backward=True,
    )  # fmt: skip
    assert "stablehlo.while" in text and "custom_call" not in text


def test_pallas_for_tpu_is_refused_by_mosaic():
    """Recorded, not hidden: impl="auto" never sends a TPU call to our Pallas kernel."""
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        lowered(
            functools.partial(flash_attention, platform="tpu", interpret=False), "tpu", K=2,
            H=128, T=1024, mask=masks.causal(), dtype=jnp.bfloat16, mod="none", backward=False,
        )  # fmt: skip
