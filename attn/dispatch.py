"""``attn.attention``: the one softmax-attention call models make.

It picks an implementation and never changes the math: every ``impl`` computes
``attn.dot_product_attention``'s function or refuses with a ``ValueError``.
What each one computes is one table, ``CAPABILITIES`` (implementation name ->
frozenset of ``FLAGS``): a call that needs a flag its implementation lacks is
refused, naming the argument (tests/attn/test_capabilities.py keeps the table
honest, and the property tests iterate it: tests/attn/impls.py).
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from attn import masks, scores
from attn.checks import Dims, as_arrays, fail
from attn.pallas import flash, splash
from attn.softmax import blockwise, dense
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args, visible
from attn.softmax.jax_nn import mean_where_empty

IMPLS = ("auto", "dense", "blockwise", "xla", "cudnn", "pallas", "splash", "mosaic")

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
    "mosaic": ("block_q", "block_k", "interpret", "platform"),
}


# What a call may need of an implementation: one vocabulary, one line a flag. What every
# implementation takes has no flag: masks of attn.masks (splash's NumPy fallback up to
# splash.NUMPY_MASK_LIMIT entries), segment ids (and jax.nn's sequence lengths), fewer
# queries than keys at the default (bottom-right) positions, gradients, bfloat16 and
# float16 inputs, head dims 64 and 128.
FLAGS = {
    "bias": "a bias array (jax.nn's bias)",
    "mask_array": "a boolean mask array (jax.nn's mask)",
    "score_mod": "an attn.scores modifier without a soft-cap (ALiBi, T5 buckets, FoX, their sums; "
    "jax.nn and cuDNN: those declaring ScoreMod.additive, as a materialized bias)",
    "softcap": "softcap= (and splash takes scores.softcap(c) as the score_mod too)",
    "sink": "sink_logits",
    "positions": "positions of any kind: traced, or differing across the batch (splash: "
    "concrete ones, the same in every row)",
    "empty_rows_mean": "empty_rows='mean' (jax.nn's mean of V where a query sees nothing)",
    "return_lse": "return_lse=True (differentiable)",
    "return_weights": "return_weights=True",
    "float32": "float32 inputs on every backend (mosaic's interpreted twin takes them on a CPU, "
    "its Hopper kernels do not)",
    "head_dim_8k": "head dims H and E that are multiples of 8 up to 128, not only 64 and 128",
    "any_head_dim": "any head dims H and E (cuDNN: multiples of 8 up to 128, 256 from Hopper)",
    "cpu": "runs on a CPU (pallas, splash and mosaic with interpret=True: their interpreter)",
}
_EVERY = frozenset(FLAGS)
_JAX_NN = _EVERY - {"softcap", "sink", "return_lse", "return_weights"}
# Splash's and Mosaic's kernels read no pair arrays, no modifier but the soft-cap, no weights.
_NO_ARRAYS = {"bias", "mask_array", "score_mod", "return_weights"}
CAPABILITIES = {
    "auto": _EVERY,  # it picks one that computes the call (dense, at worst)
    "dense": _EVERY,
    "blockwise": _EVERY - {"return_weights"},
    "xla": _JAX_NN,
    "cudnn": _JAX_NN - {"float32", "any_head_dim", "cpu"},
    "pallas": _EVERY - {"return_weights"},
    "splash": _EVERY - _NO_ARRAYS - {"positions", "empty_rows_mean", "return_lse"},
    "mosaic": _EVERY - _NO_ARRAYS - {"float32", "head_dim_8k", "any_head_dim"},
}


def _mosaic(call, q, k, v, **options):
    from attn.pallas import mosaic  # loads Pallas's Mosaic GPU: only when asked for

    return mosaic.attend(call, q, k, v, **options)


IMPLEMENTATIONS = {
    "dense": dense.attend,
    "blockwise": blockwise.attend,
    "pallas": flash.attend,
    "splash": splash.attend,
    "mosaic": _mosaic,
}


@takes_call_args
def attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    impl: str = "auto",
    implementation: str | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_residual: bool = False,
    empty_rows: str = "zero",
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    platform: str | None = None,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention through the implementation ``impl``.

    A superset of ``jax.nn.dot_product_attention``: its arguments (a boolean
    ``mask`` array, ``bias``, ``scale``, ``is_causal``, ``query_seq_lengths``,
    ``key_value_seq_lengths``, ``local_window_size``, rank-3 inputs) keep their
    meaning in every implementation (``attn.softmax.jax_nn``), beside ours.

    Args:
      query, key, value: ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,E]`` as in
        ``dot_product_attention`` (or ``[T,N,H]``, ``[S,K,H]``, ``[S,K,E]``).
      bias, mask: the call's (``CallArgs``), in ``jax.nn``'s positions.
      impl: ``"dense"`` (ours, materialized); ``"blockwise"`` (ours, FlashAttention:
        memory linear in T and S, skips masked blocks; no ``return_weights``);
        ``"xla"`` or ``"cudnn"`` (``jax.nn.dot_product_attention``: what it has no
        argument for, segment ids, explicit positions and masks other than
        causal and band ones, goes to it as a boolean mask array, and the rows
        that see nothing are set as ours are; refused: learned sink logits, a
        soft-cap, returned weights or lse, which it cannot compute);
        ``"pallas"`` (``attn.pallas.flash_attention``: our fused kernel for every
        mask, interpret mode on a CPU; no ``return_weights``); ``"splash"``
        (TPU splash attention through ``attn.pallas.splash_attention``, where our
        mask maps, else a ``ValueError`` naming why); ``"mosaic"``
        (``attn.pallas.mosaic.mosaic_attention``: Mosaic GPU kernels for Hopper,
        bfloat16 and float16, head dims 64 and 128, no bias, mask array or score
        modifier but the soft-cap; its interpreted twin on a CPU; not chosen by
        ``"auto"`` until a GPU run shows it right and faster);
        ``"auto"`` picks the fastest correct one for the platform (on CPU:
        blockwise where it measured faster than dense, from T = 128 on; see
        ``BLOCKWISE_MIN_T``; on GPU: cuDNN where its semantics, dtype and head
        dim fit without a materialized mask, else pallas; on TPU: splash where
        the call maps, else blockwise; returned weights always to dense). A
        ``score_mod`` runs in every implementation of ours; jax.nn and cuDNN
        take it only when it is additive (``ScoreMod.additive``), as a materialized
        ``[B,N,T,S]`` bias, so auto sends it to pallas on a GPU. ``CAPABILITIES``
        says what each takes (``FLAGS``).
      implementation: ``jax.nn``'s: None (``impl`` decides), ``"xla"`` or ``"cudnn"``
        (the same as ``impl=``); given with another ``impl`` than ``"auto"``, a ``ValueError``.
      return_weights, return_lse, return_residual: as in ``attn.dot_product_attention``
        (the residual of ``impl="xla"`` and ``"cudnn"`` is ``jax.nn``'s own).
      empty_rows: ``"zero"`` (ours) or ``"mean"`` (``jax.nn``'s mean of V): the output
        of a real query that sees no key.
      block_q, block_k: tile sizes of ``"blockwise"``, ``"pallas"`` and ``"mosaic"``;
        interpret: of ``"pallas"``, ``"splash"`` and ``"mosaic"``; platform: of
        ``"pallas"``, ``"splash"`` and ``"mosaic"`` (the platform the kernels are
        lowered for, e.g. ``"cuda"`` to export from a CPU). None: each
        implementation's default. Another implementation refuses them, except
        under ``"auto"``, which passes on those its choice takes.
      **call_args: the call (``attn.softmax.call.CallArgs``), as in
        ``attn.dot_product_attention``.

    Returns:
      What ``attn.dot_product_attention`` returns for the same arguments.
    """
    if impl not in IMPLS:
        fail("impl", f"one of {IMPLS}", repr(impl))
    if implementation is not None:
        if implementation not in ("xla", "cudnn") or impl not in ("auto", implementation):
            fail("implementation", f"None, 'xla' or 'cudnn', agreeing with impl={impl!r}",
                 repr(implementation))  # fmt: skip
        impl = implementation
    given = dict(block_q=block_q, block_k=block_k, interpret=interpret, platform=platform)
    given = {name: value for name, value in given.items() if value is not None}

    def run(call, q, k, v, empty_rows, *, return_weights=False, return_lse=False, residual=False):
        # jax.nn's residual is its own lse, which the jax.nn route may return.
        wants_lse = return_lse and not residual
        chosen = _choose(call, q.dtype, return_weights, wants_lse) if impl == "auto" else impl
        if chosen == "splash" and empty_rows == "mean":  # empty rows are found by the lse
            if impl == "splash":
                fail("empty_rows", "'zero' for impl='splash' (it returns no lse to find "
                     "empty rows by)", repr(empty_rows))  # fmt: skip
            chosen = "blockwise"
        takes = OPTIONS.get(chosen, ())
        for name, value in given.items():
            if impl != "auto" and name not in takes:
                fail(name, f"None for impl={impl!r} (a setting of {_takers(name)})", repr(value))
        options = {name: value for name, value in given.items() if name in takes}
        if chosen in ("xla", "cudnn"):
            return _jax_nn(call, q, k, v, chosen, return_weights, wants_lse, empty_rows, residual)
        returns = dict(return_lse=return_lse)
        if chosen == "dense":
            returns["return_weights"] = return_weights
        elif return_weights:
            fail("return_weights", f"False for impl={impl!r} (it never forms the weights)", True)
        fn = functools.partial(IMPLEMENTATIONS[chosen], **options)
        return dense.with_empty_rows(fn, call, q, k, v, empty_rows, **returns)

    call_args = dict(call_args, bias=bias, mask=mask)
    return dense.batched(run, query, key, value, call_args, empty_rows, return_residual,
                         return_weights=return_weights, return_lse=return_lse)  # fmt: skip


@takes_call_args
def choose_impl(q, k, v, *, return_weights=False, return_lse=False,
                **call_args: Unpack[CallArgs]) -> str:  # fmt: skip
    """The implementation ``attention(..., impl="auto")`` picks for these arguments.

    Args: as ``attention``'s (q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]``,
    the returns asked for and the call), checked as it checks them.

    Returns:
      A name of ``IMPLS`` other than ``"auto"``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return _choose(call, q.dtype, return_weights, return_lse)


def _takers(option: str) -> str:
    return " and ".join(repr(impl) for impl, names in OPTIONS.items() if option in names)


def _backend() -> str:
    """The platform ``impl="auto"`` chooses for (a function, so tests can fake it)."""
    return jax.default_backend()


def _choose(call: Call, dtype, return_weights, return_lse) -> str:
    backend = _backend()
    if backend == "gpu":
        native = _jax_nn_reason(call, return_weights, return_lse) is None and _native(call)
        # A modifier would be materialized for cuDNN: the fused kernel evaluates it per tile.
        if native and call.score is None and _cudnn_fits(call.dims, dtype, call.bias):
            return "cudnn"
        return "dense" if return_weights else "pallas"
    if return_weights:
        return "dense"
    if backend == "tpu":
        # Our Pallas kernel's blocks do not meet Mosaic TPU's (8, 128) tiling: what
        # splash cannot run goes to blockwise, which XLA compiles for the TPU.
        return "splash" if splash.reason(call, return_lse=return_lse) is None else "blockwise"
    if backend == "cpu" and _blockwise_faster(call.dims):
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
    """Why ``jax.nn.dot_product_attention`` cannot compute the call, or None."""
    if call.sink_logits is not None:
        return "sink_logits (jax.nn has no equivalent)"
    if call.softcap is not None:
        return "softcap (jax.nn has no equivalent)"
    if not scores.additive(call.score):
        return (
            "a score_mod that is not additive: a soft-cap, or one not declaring "
            "ScoreMod.additive (jax.nn takes additive biases only)"
        )
    if return_weights or return_lse:
        return "return_weights/return_lse"
    return None


def _native(call: Call) -> bool:
    """Whether the call's visibility is jax.nn's own arguments (no materialized mask)."""
    if call.keep is not None or any(x is not None for x in call.given):
        return False
    if _window_args(call.mask) is None:
        return False
    causal, window = _window_args(call.mask)
    # jax.nn aligns causal and band masks to the top-left corner, ours to the bottom right.
    return call.dims.T == call.dims.S or not (causal or window is not None)


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
        case masks.Band(left=left, right=right):
            return False, (left, right)
        case masks.And(masks.Causal(), masks.Band(left=left)) | masks.And(
            masks.Band(left=left), masks.Causal()
        ):
            return True, (left, 0)
    return None


def _jax_nn(call: Call, q, k, v, impl, return_weights, return_lse, empty_rows, residual=False):
    """``jax.nn.dot_product_attention`` computing the call: natively where its arguments
    say it, else with the visibility as a boolean ``[B,1,T,S]`` mask array."""
    reason = _jax_nn_reason(call, return_weights, return_lse)
    if reason is not None:
        fail("impl", f"an impl computing our semantics for {reason}", repr(impl))
    if impl == "cudnn":
        if _backend() != "gpu":
            fail("impl", "'cudnn' only on a GPU backend", f"backend {_backend()!r}")
        if q.dtype not in _CUDNN_DTYPES:
            fail("q", "bfloat16 or float16 inputs for impl='cudnn'", q.dtype)
    bias = call.bias
    if call.score is not None:  # additive (checked above): one [B,N,T,S] bias
        extra = dense.modifier_bias(call).astype(q.dtype)
        bias = extra if bias is None else bias + extra
    raw_v = v  # jax.nn's mean of V on an empty row reads every key, padding included
    q, k, v = call.isolate(q, k, v)
    if _native(call):
        is_causal, window = _window_args(call.mask)
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, scale=call.scale, is_causal=is_causal, local_window_size=window,
            implementation=impl, return_residual=residual,
        )  # fmt: skip
    ok = visible(call.mask, call.q_positions, call.kv_positions, call.q_segment_ids,
                 call.kv_segment_ids)[:, None]  # fmt: skip
    ok = ok if call.keep is None else ok & call.keep
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=ok, scale=call.scale,
                                       implementation=impl, return_residual=residual)  # fmt: skip
    out, *lse = out if residual else (out,)
    # jax.nn gives a row that sees nothing the mean of V: ours is 0, and so is a
    # padding query's under empty_rows="mean" (as jax.nn's query_seq_lengths give).
    empty = ~ok.any(-1)  # [B|1, N|1, T]
    empty = jnp.broadcast_to(empty, (call.dims.B, call.dims.N, call.dims.T)).transpose(0, 2, 1)
    lse = [jnp.where(empty, -jnp.inf, x) for x in lse]  # ours: -inf on those rows
    out = jnp.where(empty[..., None], jnp.zeros((), out.dtype), out)
    if empty_rows == "mean":  # the mean of the caller's V, which isolation zeroed at padding
        out = mean_where_empty(call, out, jnp.where(empty, -jnp.inf, 0.0), raw_v)
    return (out, *lse) if lse else out
