"""``attn.attention``: the one softmax-attention call models make.

It picks an implementation and never changes the math: every ``impl`` computes
``attn.dot_product_attention``'s function or refuses with a ``ValueError``.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp

from attn import masks, scores
from attn.checks import Dims, as_arrays, fail
from attn.pallas import flash, splash
from attn.softmax import blockwise, dense
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args

IMPLS = ("auto", "dense", "blockwise", "xla", "cudnn", "pallas", "splash")

# cuDNN's fused kernels take only half-precision inputs, and jax.nn accepts head
# dims that are multiples of 8 up to 128 (256 from Hopper on); auto keeps to
# what every generation takes. (A bias in training also needs even T and S.)
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128

# impl="auto" on CPU picks blockwise where it measured faster than dense
# (bench/results/blockwise-tiles-cpu.md): T = S from 128 on, and short query
# blocks over long keys once T*S >= 2**18; dense below, and for decoding.
BLOCKWISE_MIN_T = 128
BLOCKWISE_MIN_T_LONG_KEYS = 32
BLOCKWISE_MIN_SCORES = 2**18


# The settings each implementation takes besides the call (performance only: never the math).
OPTIONS = {
    "blockwise": ("block_q", "block_k"),
    "pallas": ("block_q", "block_k", "interpret", "platform"),
    "splash": ("interpret", "platform"),
}
IMPLEMENTATIONS = {
    "dense": dense.attend,
    "blockwise": blockwise.attend,
    "pallas": flash.attend,
    "splash": splash.attend,
}


@takes_call_args
def attention(
    q,
    k,
    v,
    *,
    impl: str = "auto",
    bias=None,
    return_weights: bool = False,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    platform: str | None = None,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention through the implementation ``impl``.

    Args:
      q, k, v: ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,E]`` as in ``dot_product_attention``.
      impl: ``"dense"`` (ours, materialized); ``"blockwise"`` (ours, FlashAttention:
        memory linear in T and S, skips masked blocks; no ``bias`` or
        ``return_weights``); ``"xla"`` or ``"cudnn"``
        (``jax.nn.dot_product_attention``, only where its semantics equal ours:
        no learned sink logits, soft-cap, segment ids or explicit positions, and causal or
        window masks only with T == S, since jax.nn aligns them to the top-left
        corner while our default queries are the last T key positions);
        ``"pallas"`` (``attn.pallas.flash_attention``: our fused kernel for every
        mask, interpret mode on a CPU; no ``bias`` or ``return_weights``); ``"splash"``
        (TPU splash attention through ``attn.pallas.splash_attention``, where our
        mask maps, else a ``ValueError`` naming why);
        ``"auto"`` picks the fastest correct one for the platform (on CPU:
        blockwise where it measured faster than dense, from T = 128 on; see
        ``BLOCKWISE_MIN_T``; on GPU: cuDNN where its semantics, dtype and head
        dim fit, else pallas; on TPU: splash where the call maps, else blockwise;
        a ``bias`` goes to jax.nn where its semantics match, else to dense;
        returned weights always to dense). A ``score_mod`` runs in every
        implementation of ours; jax.nn and cuDNN take it only when it is
        additive (no soft-cap), as a materialized ``[B,N,T,S]`` bias, so auto
        sends it to pallas on a GPU.
      bias, return_weights, return_lse: as in ``attn.dot_product_attention``.
      block_q, block_k: tile sizes of ``"blockwise"`` and ``"pallas"``;
        interpret, platform: of ``"pallas"`` and ``"splash"``. None: each
        implementation's default. Another implementation refuses them, except
        under ``"auto"``, which passes on those its choice takes.
      **call_args: the call (``attn.softmax.call.CallArgs``), as in
        ``attn.dot_product_attention``.

    Returns:
      What ``attn.dot_product_attention`` returns for the same arguments.
    """
    q, k, v = as_arrays(q, k, v)
    if impl not in IMPLS:
        fail("impl", f"one of {IMPLS}", repr(impl))
    call = check_call(q, k, v, **call_args)
    given = dict(block_q=block_q, block_k=block_k, interpret=interpret, platform=platform)
    given = {name: value for name, value in given.items() if value is not None}
    chosen = _choose(call, q.dtype, bias, return_weights, return_lse) if impl == "auto" else impl
    takes = OPTIONS.get(chosen, ())
    for name, value in given.items():
        if impl != "auto" and name not in takes:
            fail(name, f"None for impl={impl!r} (a setting of {_takers(name)})", repr(value))
    options = {name: value for name, value in given.items() if name in takes}
    if chosen in ("xla", "cudnn"):
        return _jax_nn(call, q, k, v, chosen, bias, return_weights, return_lse)
    if chosen != "dense":
        _fused_only(chosen, bias, return_weights)
        return IMPLEMENTATIONS[chosen](call, q, k, v, return_lse=return_lse, **options)
    return dense.attend(call, q, k, v, bias=bias, return_weights=return_weights,
                        return_lse=return_lse)  # fmt: skip


@takes_call_args
def choose_impl(q, k, v, *, bias=None, return_weights=False, return_lse=False,
                **call_args: Unpack[CallArgs]) -> str:  # fmt: skip
    """The implementation ``attention(..., impl="auto")`` picks for these arguments.

    Args: as ``attention``'s (q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]``, ``bias``,
    the returns asked for and the call), checked as it checks them.

    Returns:
      A name of ``IMPLS`` other than ``"auto"``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return _choose(call, q.dtype, bias, return_weights, return_lse)


def _takers(option: str) -> str:
    return " and ".join(repr(impl) for impl, names in OPTIONS.items() if option in names)


def _fused_only(impl: str, bias, return_weights) -> None:
    """Refuses what only the materialized implementations compute."""
    if bias is not None:
        fail("bias", f"None for impl={impl!r} (use impl='dense' for a bias)", "an array")
    if return_weights:
        fail("return_weights", f"False for impl={impl!r} (it never forms the weights)", True)


def _backend() -> str:
    """The platform ``impl="auto"`` chooses for (a function, so tests can fake it)."""
    return jax.default_backend()


def _choose(call: Call, dtype, bias, return_weights, return_lse) -> str:
    backend = _backend()
    fused_ok = bias is None and not return_weights
    if backend == "gpu":
        jax_nn_ok = _jax_nn_reason(call, return_weights, return_lse) is None
        # A modifier would be materialized for cuDNN: the fused kernel evaluates it per tile.
        if jax_nn_ok and call.score is None and _cudnn_fits(call.dims, dtype, bias):
            return "cudnn"
        if fused_ok:
            return "pallas"
        return "xla" if jax_nn_ok else "dense"  # a bias: materialized either way
    if backend == "tpu" and fused_ok:
        # Our Pallas kernel's blocks do not meet Mosaic TPU's (8, 128) tiling: what
        # splash cannot run goes to blockwise, which XLA compiles for the TPU.
        return "splash" if splash.reason(call, return_lse=return_lse) is None else "blockwise"
    if backend == "cpu" and fused_ok and _blockwise_faster(call.dims):
        return "blockwise"
    return "dense"


def _cudnn_fits(dims: Dims, dtype, bias) -> bool:
    """Inputs cuDNN's fused kernel takes: half precision, equal head dims 8k <= 128."""
    if bias is not None and (dims.T % 2 or dims.S % 2):
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


def _jax_nn_reason(call: Call, return_weights, return_lse) -> str | None:
    """Why ``jax.nn.dot_product_attention`` would compute another function, or None."""
    if call.sink_logits is not None:
        return "sink_logits (jax.nn has no equivalent)"
    if call.softcap is not None:
        return "softcap (jax.nn has no equivalent)"
    q_positions, kv_positions, q_segment_ids, _ = call.given
    for name, x in (("q_positions", q_positions), ("kv_positions", kv_positions)):
        if x is not None:
            return f"{name} (jax.nn has no equivalent)"
    if not scores.additive(call.score):
        return "a score_mod with a soft-cap (jax.nn takes additive biases only)"
    if q_segment_ids is not None:
        return "segment ids (jax.nn returns the mean of V on rows they fully mask)"
    if return_weights or return_lse:
        return "return_weights/return_lse"
    if _window_args(call.mask) is None:
        return f"mask {call.mask!r} (jax.nn has full, causal and band masks only)"
    causal, window = _window_args(call.mask)
    if (causal or window is not None) and call.dims.T != call.dims.S:
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


def _jax_nn(call: Call, q, k, v, impl, bias, return_weights, return_lse):
    reason = _jax_nn_reason(call, return_weights, return_lse)
    if reason is not None:
        fail("impl", f"an impl computing our semantics for {reason}", repr(impl))
    if impl == "cudnn":
        if _backend() != "gpu":
            fail("impl", "'cudnn' only on a GPU backend", f"backend {_backend()!r}")
        if q.dtype not in _CUDNN_DTYPES:
            fail("q", "bfloat16 or float16 inputs for impl='cudnn'", q.dtype)
    is_causal, window = _window_args(call.mask)
    if call.score is not None:  # additive (checked above): one [B,N,T,S] bias
        extra = dense.modifier_bias(call).astype(q.dtype)
        bias = extra if bias is None else bias + extra
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        scale=call.scale,
        is_causal=is_causal,
        local_window_size=window,
        implementation=impl,
    )
