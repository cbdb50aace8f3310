"""``impl="splash"``: our masks on JAX's TPU splash-attention kernel.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) takes
masks on array indices, one per head (``MultiHeadMask``), and skips the blocks
they leave empty. Ours are on positions, so with contiguous positions (the
default ones, or explicit ones that are ranges) a mask maps as:

    full()                          FullMask
    causal()                        CausalMask(offset = first q position - first k position)
    sliding_window(w) [& causal()]  LocalMask(window (w - 1, 0), same offset)
    bidirectional_window(r)         LocalMask(window (r, r), same offset)
    band(l, r) [& causal()]         LocalMask(window (l, r), or (l, 0) with causal())
    causal() & chunked(c)           ChunkedCausalMask(c), when q and k start at one multiple of c

and anything else (initial tokens, global tokens, unions, other positions)
becomes a ``NumpyMask`` evaluated from ``Mask.allowed`` when tracing, up to
``NUMPY_MASK_LIMIT`` entries. Refused, with the reason: traced positions (splash
masks are static), positions that differ across the batch (one mask serves
every row), ``return_lse`` (splash's lse output is not differentiable), and
NumPy masks above the limit.

Semantics are ours, where splash's differ:

* the logit scale is folded into q (splash has none);
* a row that sees no key gives zeros: splash leaves such rows to its finite
  mask value (a mean of V). Every call passes sink logits, ``MASKED`` when the
  caller has none: the sink then dominates exactly the empty rows, whose
  output becomes 0, and weighs ``exp(MASKED - max) = 0`` everywhere else;
* segment id 0 is padding, seen by no query and seeing no key: splash matches
  equal ids only, so padding becomes ``Q_PADDING`` on the query side and
  ``KV_PADDING`` on the key side, ids no real token has;
* T and S are padded to whole blocks of 128 (the TPU's lanes); padding keys are
  hidden by the mask or, for masks that would see them, by ``KV_PADDING``.
"""

from __future__ import annotations

import dataclasses
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn import masks, scores
from attn.checks import as_arrays, fail
from attn.pallas.blocks import SPLASH_BLOCK
from attn.pallas.common import PLATFORMS, interpret_mode
from attn.softmax.call import MASKED, Call, CallArgs, check_call, takes_call_args

# The largest [T,S] boolean mask the NumPy fallback builds when tracing (64 MB).
NUMPY_MASK_LIMIT = 2**26
LANES = 128
# Splash's ids for padding (our id 0) on each side: distinct, and below any id >= 0.
Q_PADDING = np.iinfo(np.int32).min
KV_PADDING = Q_PADDING + 1


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why splash cannot compute a call: the argument, what splash needs, what it got."""

    arg: str
    expected: str
    got: object

    def __str__(self) -> str:
        return f"{self.arg}: expected {self.expected}, got {self.got}"


def splash_reason(q, k, v, bias=None, mask=None, *, return_weights=False, return_lse=False,
                  **call_args) -> str | None:  # fmt: skip
    """Why ``splash_attention`` would refuse these arguments, or None where they map.

    Takes ``attn.attention``'s arguments (``bias`` and ``mask`` in ``jax.nn``'s
    positions, ``return_weights``); checks nothing that splash would not refuse
    (a malformed call is ``splash_attention``'s to report).
    """
    try:
        call = check_call(*as_arrays(q, k, v), bias=bias, mask=mask, **call_args)
    except ValueError:
        return None
    return reason(call, return_weights=return_weights, return_lse=return_lse)


def reason(call: Call, *, return_weights=False, return_lse=False) -> str | None:
    """``splash_reason`` of a checked call."""
    refusal = _refusal(call, return_weights, return_lse)
    return None if refusal is None else str(refusal)


def _refusal(call: Call, return_weights, return_lse) -> Refusal | None:
    score = call.score
    if score is not None and not isinstance(score, scores.Softcap):
        return Refusal(
            "score_mod",
            "None or scores.softcap(c) for impl='splash' (splash has no hook on the "
            "logits but its soft-cap; impl='pallas' evaluates any modifier)",
            type(score).__name__,
        )
    for name, x in (("bias", call.bias), ("mask", call.keep)):
        if x is not None:  # splash's masks are static, and it has no bias input
            return Refusal(name, f"no {name} array for impl='splash' (impl='pallas' reads one "
                           "per tile)", f"shape {x.shape}")  # fmt: skip
    if return_weights:
        return Refusal("return_weights", "False for impl='splash' (it never forms the weights)",
                       True)  # fmt: skip
    if return_lse:
        return Refusal(
            "return_lse", "False for impl='splash' (its lse output is not differentiable)", True
        )
    q_positions, kv_positions = call.given[:2]
    for name, x in (("q_positions", q_positions), ("kv_positions", kv_positions)):
        if isinstance(x, jax.core.Tracer):
            return Refusal(name, "concrete positions for impl='splash' (its masks are static)",
                           "a traced array")  # fmt: skip
        if x is not None:
            x = np.asarray(x)
            if x.ndim == 2 and (x != x[:1]).any():
                return Refusal(
                    name, "the same positions in every batch row for impl='splash'", "rows differ"
                )
    T, S = call.dims.T, call.dims.S
    if _maps_to_numpy(call.mask, q_positions, kv_positions, T, S):
        compiled = jax.default_backend() == "tpu"  # the refusal's bound, as the host runs it
        Tp, Sp = _padded(T, compiled), _padded(S, compiled)
        if Tp * Sp > NUMPY_MASK_LIMIT:
            return Refusal(
                "mask",
                f"a mask splash computes, or at most {NUMPY_MASK_LIMIT} entries for its NumPy "
                f"fallback, for impl='splash'",
                f"{call.mask!r} over [{Tp},{Sp}]",
            )
    return None


def _block(length: int, compiled: bool) -> int:
    """The tile for ``length``: the TPU's when the kernel is compiled, else interpret mode's."""
    return min(SPLASH_BLOCK["tpu" if compiled else "cpu"], -(-length // LANES) * LANES)


def _padded(length: int, compiled: bool) -> int:
    block = _block(length, compiled)
    return -(-length // block) * block


def _first_rows(x):
    return None if x is None else np.asarray(x).reshape(-1, np.shape(x)[-1])[0]


def _contiguous(x) -> bool:
    return x is None or bool((np.diff(_first_rows(x)) == 1).all())


def _maps_to_numpy(mask, q_positions, kv_positions, T: int, S: int) -> bool:
    if not (_contiguous(q_positions) and _contiguous(kv_positions)):
        return True
    q0 = S - T if q_positions is None else int(_first_rows(q_positions)[0])
    k0 = 0 if kv_positions is None else int(_first_rows(kv_positions)[0])
    return _computable(mask, q0 - k0, q0, k0) is None


def _computable(mask, offset: int, q0: int, k0: int):
    """``(kind, argument)`` of the splash mask for contiguous positions, or None."""
    match mask:
        case None | masks.Full():
            return "full", None
        case masks.Causal():
            return "causal", None
        case (
            masks.SlidingWindow(window=w)
            | masks.And(masks.Causal(), masks.SlidingWindow(window=w))
            | masks.And(masks.SlidingWindow(window=w), masks.Causal())
        ):
            return "local", (w - 1, 0)
        case masks.BidirectionalWindow(radius=r):
            return "local", (r, r)
        case masks.Band(left=left, right=right):
            return "local", (left, right)
        case masks.And(masks.Causal(), masks.Band(left=left)) | masks.And(
            masks.Band(left=left), masks.Causal()
        ):
            return "local", (left, 0)
        case masks.And(masks.Causal(), masks.Chunked(c=c)) | masks.And(
            masks.Chunked(c=c), masks.Causal()
        ):
            if offset == 0 and q0 == k0 and q0 % c == 0:
                return "chunked", c
    return None


def _splash_mask(mask, q_pos: np.ndarray, k_pos: np.ndarray, Tp: int, Sp: int):
    """The splash mask ``[Tp, Sp]`` and whether padding keys need a segment id to hide them."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam

    T, S = q_pos.size, k_pos.size
    shape = (Tp, Sp)
    spec = None
    if _contiguous(q_pos[None]) and _contiguous(k_pos[None]):
        offset = int(q_pos[0] - k_pos[0])
        spec = _computable(mask, offset, int(q_pos[0]), int(k_pos[0]))
    if spec is None:
        table = np.zeros(shape, bool)
        table[:T, :S] = np.asarray(mask.allowed(q_pos, k_pos))
        return sa.NumpyMask(table), False
    kind, arg = spec
    if kind == "full":
        return sa.FullMask(shape), Sp > S
    if kind == "causal":
        return sa.CausalMask(shape, offset=offset), False
    if kind == "local":
        # A causal window never reaches keys past the last real one; a band does.
        return sa.LocalMask(shape, window_size=arg, offset=offset), arg[1] > 0 and Sp > S
    return sam.ChunkedCausalMask(shape, chunk_size=arg), False


@takes_call_args
def splash_attention(
    q,
    k,
    v,
    *,
    return_lse: bool = False,
    interpret: bool | None = None,
    platform: str | None = None,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention through splash attention, with our semantics (module doc).

    Args: as ``attn.dot_product_attention`` (no ``bias`` or returned weights,
    ``return_lse`` must be False, and ``score_mod`` may only be a soft-cap),
    plus ``interpret`` (True: Pallas's interpreter; None compiles, refused unless
    lowering for a TPU, where alone the kernel compiles) and
    ``platform`` (the platform lowered for, None: ``jax.default_backend()``;
    ``"tpu"`` exports the Mosaic kernel from any host with ``jax.export``).

    Returns:
      ``out [B,T,N,E]`` in q's dtype.

    Raises:
      ValueError: naming the argument that does not map (see ``splash_reason``).
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, return_lse=return_lse, interpret=interpret, platform=platform)


def attend(call: Call, q, k, v, *, return_lse=False, interpret=None, platform=None):
    """``splash_attention`` of a checked call (see there)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    refusal = _refusal(call, False, return_lse)
    if refusal is not None:
        fail(refusal.arg, refusal.expected, refusal.got)
    q, k, v = call.isolate(q, k, v)
    T, S, N = call.dims.T, call.dims.S, call.dims.N
    platform = jax.default_backend() if platform is None else platform
    if platform not in PLATFORMS:
        fail("platform", f"one of {sorted(PLATFORMS)} or None", repr(platform))
    interpret = interpret_mode(interpret, platform, PLATFORMS[platform] == "tpu", "impl='splash'")
    bq, bk = _block(T, not interpret), _block(S, not interpret)
    Tp, Sp = _padded(T, not interpret), _padded(S, not interpret)
    q_positions, kv_positions = call.given[:2]
    q_pos = _first_rows(q_positions)
    q_pos = np.arange(T) + S - T if q_pos is None else q_pos.astype(np.int64)
    k_pos = _first_rows(kv_positions)
    k_pos = np.arange(S) if k_pos is None else k_pos.astype(np.int64)
    splash_mask, hide_padding = _splash_mask(call.mask, q_pos, k_pos, Tp, Sp)

    q_seg, kv_seg = _segment_ids(call, Tp, Sp, hide_padding)
    block_sizes = sa.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk,
        block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk,
        block_q_dq=bq, block_kv_dq=bk,
    )  # fmt: skip
    kernel = sa.make_splash_mha(
        sa.MultiHeadMask([splash_mask] * N),
        block_sizes=block_sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=None if call.score is None else call.score.cap,
        interpret=interpret,
    )
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    qs = (q.astype(jnp.float32) * call.scale).astype(dtype)
    qs = jnp.pad(qs, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B,N,Tp,H]
    ks, vs = (
        jnp.pad(x.astype(dtype), ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
        for x in (k, v)
    )
    if call.sink_logits is not None:
        sinks = call.sink_logits.reshape(N)
    else:
        sinks = jnp.full((N,), MASKED, jnp.float32)

    def one_row(q, k, v, q_seg, kv_seg):
        ids = None if q_seg is None else sa.SegmentIds(q=q_seg, kv=kv_seg)
        return kernel(q, k, v, segment_ids=ids, sinks=sinks)

    out = jax.vmap(one_row)(qs, ks, vs, q_seg, kv_seg)  # [B,N,Tp,E]
    return out.transpose(0, 2, 1, 3)[:, :T].astype(q.dtype)


def _segment_ids(call, Tp: int, Sp: int, hide_padding: bool):
    """Splash's ``[B,Tp]``, ``[B,Sp]`` ids with our padding (id 0) and the padded keys
    mapped to ids nothing matches; None, None when neither is needed."""
    B, T, S = call.dims.B, call.dims.T, call.dims.S
    q_seg, kv_seg = call.q_segment_ids, call.kv_segment_ids
    if q_seg is None and not hide_padding:
        return None, None
    if q_seg is None:
        q_seg, kv_seg = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
    else:
        q_seg = jnp.where(q_seg == masks.PADDING, Q_PADDING, q_seg)
        kv_seg = jnp.where(kv_seg == masks.PADDING, KV_PADDING, kv_seg)
    q_seg = jnp.pad(q_seg, ((0, 0), (0, Tp - T)), mode="edge")  # padding rows are dropped
    if hide_padding:
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, Sp - S)), constant_values=KV_PADDING)
    else:
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, Sp - S)), mode="edge")
    return q_seg, kv_seg
