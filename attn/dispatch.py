"""``attn.attention``: the one softmax-attention call models make.

It picks an implementation and never changes the math: every ``impl`` computes
``attn.dot_product_attention``'s function or refuses with a ``ValueError``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn import masks, scores
from attn.errors import Dims, as_arrays, fail
from attn.pallas import flash_attention, splash_attention, splash_reason
from attn.softmax.blockwise import blockwise_attention
from attn.softmax.call import Call, check_call, dims_or_none
from attn.softmax.dense import dot_product_attention, modifier_bias

IMPLS = ("auto", "dense", "blockwise", "xla", "cudnn", "pallas", "splash")

# cuDNN's fused kernels take only half-precision inputs, and jax.nn accepts head
# dims that are multiples of 8 up to 128 (256 from Hopper on); auto keeps to
# what every generation takes. (A bias in training also needs even T and S.)
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128

# impl="auto" on CPU picks blockwise where it measured faster than dense (f32,
# B=1, N=8, H=64, causal, forward and forward+backward, 2-core AVX-512 CPU):
# - T = S: from 128 on (1.7x at 128, 5-7x at 1024-2048; about equal at 32-64);
# - short query blocks over long keys once T*S >= 2**18 with T >= 32 (T=64,
#   S=4096: 1.1-1.3x; T=32, S=32768: 1.2x), while dense stays faster below
#   (T=32, S=4096: 1.1-1.3x; T=64, S=1024: 1.15x; T=16, S=1024: 1.3x) and for
#   decoding (T=1: 1.2-2.3x at S = 1K-16K), where blockwise's re-layout of K/V
#   into tiles on every call costs as much as the attention itself.
BLOCKWISE_MIN_T = 128
BLOCKWISE_MIN_T_LONG_KEYS = 32
BLOCKWISE_MIN_SCORES = 2**18


def attention(q, k, v, *, impl: str = "auto", **kwargs):
    """Softmax attention through the implementation ``impl``.

    Args:
      q, k, v: ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,E]`` as in ``dot_product_attention``.
      impl: ``"dense"`` (ours, materialized); ``"blockwise"`` (ours, FlashAttention:
        memory linear in T and S, skips masked blocks; no ``bias`` or
        ``return_weights``, and accepts ``block_q``/``block_k``); ``"xla"`` or ``"cudnn"``
        (``jax.nn.dot_product_attention``, only where its semantics equal ours:
        no learned sink logits, soft-cap, segment ids or explicit positions, and causal or
        window masks only with T == S, since jax.nn aligns them to the top-left
        corner while our default queries are the last T key positions);
        ``"pallas"`` (``attn.pallas.flash_attention``: our fused kernel for every
        mask, interpret mode on a CPU; no ``bias`` or ``return_weights``; accepts
        ``block_q``/``block_k``/``interpret``); ``"splash"`` (TPU splash attention
        through ``attn.pallas.splash_attention``, where our mask maps, else a
        ``ValueError`` naming why);
        ``"auto"`` picks the fastest correct one for the platform (on CPU:
        blockwise where it measured faster than dense, from T = 128 on; see
        ``BLOCKWISE_MIN_T``; on GPU: cuDNN where its semantics, dtype and head
        dim fit, else pallas; on TPU: splash where the call maps, else blockwise;
        a ``bias`` goes to jax.nn where its semantics match, else to dense;
        returned weights always to dense). A ``score_mod`` runs in every
        implementation of ours; jax.nn and cuDNN take it only when it is
        additive (no soft-cap), as a materialized ``[B,N,T,S]`` bias, so auto
        sends it to pallas on a GPU.
      **kwargs: the keyword arguments of ``attn.dot_product_attention``.

    Returns:
      What ``attn.dot_product_attention`` returns for the same arguments.
    """
    q, k, v = as_arrays(q, k, v)
    if impl not in IMPLS:
        fail("impl", f"one of {IMPLS}", repr(impl))
    if impl == "auto":
        impl = _choose(q, k, v, kwargs)
    if impl == "dense":
        return dot_product_attention(q, k, v, **kwargs)
    if impl == "blockwise":
        return _blockwise(q, k, v, **kwargs)
    if impl in ("pallas", "splash"):
        return _pallas(q, k, v, impl, **kwargs)
    return _jax_nn(q, k, v, impl, **kwargs)


def _backend() -> str:
    """The platform ``impl="auto"`` chooses for (a function, so tests can fake it)."""
    return jax.default_backend()


def _choose(q, k, v, kwargs) -> str:
    dims = dims_or_none(q, k, v)
    if dims is None:  # not a call: the reference reports why
        return "dense"
    backend = _backend()
    fused_ok = kwargs.get("bias") is None and not kwargs.get("return_weights")
    if backend == "gpu":
        jax_nn_ok = _jax_nn_reason(q, k, v, kwargs) is None
        # A modifier would be materialized for cuDNN: the fused kernel evaluates it per tile.
        no_mod = kwargs.get("score_mod") is None
        if jax_nn_ok and no_mod and _cudnn_fits(dims, q.dtype, kwargs):
            return "cudnn"
        if fused_ok:
            return "pallas"
        return "xla" if jax_nn_ok else "dense"  # a bias: materialized either way
    if backend == "tpu" and fused_ok:
        # Our Pallas kernel's blocks do not meet Mosaic TPU's (8, 128) tiling: what
        # splash cannot run goes to blockwise, which XLA compiles for the TPU.
        return "splash" if splash_reason(q, k, v, **kwargs) is None else "blockwise"
    if backend == "cpu" and fused_ok and _blockwise_faster(dims):
        return "blockwise"
    return "dense"


def _cudnn_fits(dims: Dims, dtype, kwargs) -> bool:
    """Inputs cuDNN's fused kernel takes: half precision, equal head dims 8k <= 128."""
    if kwargs.get("bias") is not None and (dims.T % 2 or dims.S % 2):
        return False
    return (
        dtype in _CUDNN_DTYPES
        and dims.H == dims.E
        and dims.H % 8 == 0
        and 0 < dims.H <= _CUDNN_MAX_HEAD_DIM
    )


def _blockwise_faster(dims: Dims) -> bool:
    """Where blockwise beat dense on CPU (see BLOCKWISE_MIN_T)."""
    T, S = dims.T, dims.S
    if T >= BLOCKWISE_MIN_T:
        return True
    return T >= BLOCKWISE_MIN_T_LONG_KEYS and T * S >= BLOCKWISE_MIN_SCORES


def _blockwise(q, k, v, *, bias=None, return_weights=False, **kwargs):
    if bias is not None:
        fail("bias", "None for impl='blockwise' (use impl='dense' for a bias)", "an array")
    if return_weights:
        fail("return_weights", "False for impl='blockwise' (it never forms the weights)", True)
    return blockwise_attention(q, k, v, **kwargs)


def _pallas(q, k, v, impl, *, bias=None, return_weights=False, **kwargs):
    if bias is not None:
        fail("bias", f"None for impl={impl!r} (use impl='dense' for a bias)", "an array")
    if return_weights:
        fail("return_weights", f"False for impl={impl!r} (it never forms the weights)", True)
    fn = flash_attention if impl == "pallas" else splash_attention
    return fn(q, k, v, **kwargs)


def _jax_nn_reason(q, k, v, kwargs) -> str | None:
    """Why ``jax.nn.dot_product_attention`` would compute another function, or None."""
    for name in ("sink_logits", "softcap", "q_positions", "kv_positions"):
        if kwargs.get(name) is not None:
            return f"{name} (jax.nn has no equivalent)"
    if not scores.additive(kwargs.get("score_mod")):
        return "a score_mod with a soft-cap (jax.nn takes additive biases only)"
    if kwargs.get("q_segment_ids") is not None or kwargs.get("kv_segment_ids") is not None:
        return "segment ids (jax.nn returns the mean of V on rows they fully mask)"
    if kwargs.get("return_weights") or kwargs.get("return_lse"):
        return "return_weights/return_lse"
    if _window_args(kwargs.get("mask")) is None:
        return f"mask {kwargs.get('mask')!r} (jax.nn has full, causal and band masks only)"
    causal, window = _window_args(kwargs.get("mask"))
    if (causal or window is not None) and q.shape[1] != k.shape[1]:
        return (
            "a causal or banded mask with T != S (jax.nn aligns it to the top-left corner; "
            "ours puts the T queries at the last T key positions)"
        )
    return None


def _window_args(mask) -> tuple[bool, tuple[int, int] | None] | None:
    """``(is_causal, local_window_size)`` for jax.nn, or None where it has no equivalent."""
    match mask:
        case None | masks.Full():
            return False, None
        case masks.Causal():
            return True, None
        # A sliding window is causal already; `causal() & window` is the same mask.
        case (
            masks.SlidingWindow(window=w)
            | masks.And(masks.Causal(), masks.SlidingWindow(window=w))
            | masks.And(masks.SlidingWindow(window=w), masks.Causal())
        ):
            return True, (w - 1, 0)
        case masks.BidirectionalWindow(radius=r):
            return False, (r, r)
    return None


def _jax_nn(q, k, v, impl, *, mask=None, bias=None, scale=None, score_mod=None, **rest):
    c: Call = check_call(q, k, v, mask=mask, scale=scale, score_mod=score_mod, **_call_args(rest))
    reason = _jax_nn_reason(q, k, v, dict(rest, mask=mask, score_mod=score_mod))
    if reason is not None:
        fail("impl", f"an impl computing our semantics for {reason}", repr(impl))
    if impl == "cudnn":
        if _backend() != "gpu":
            fail("impl", "'cudnn' only on a GPU backend", f"backend {_backend()!r}")
        if q.dtype not in _CUDNN_DTYPES:
            fail("q", "bfloat16 or float16 inputs for impl='cudnn'", q.dtype)
    is_causal, window = _window_args(c.mask)
    if c.score is not None:  # additive (checked above): one [B,N,T,S] bias
        extra = modifier_bias(c).astype(q.dtype)
        bias = extra if bias is None else bias + extra
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        scale=c.scale,
        is_causal=is_causal,
        local_window_size=window,
        implementation=impl,
    )


_CALL_ARGS = ("softcap", "sink_logits", "q_positions", "kv_positions")
_CALL_ARGS += ("q_segment_ids", "kv_segment_ids")


def _call_args(rest):
    unknown = set(rest) - set(_CALL_ARGS) - {"return_weights", "return_lse"}
    if unknown:
        raise TypeError(f"attention() got unexpected keyword arguments {sorted(unknown)}")
    return {key: rest[key] for key in _CALL_ARGS if key in rest}
