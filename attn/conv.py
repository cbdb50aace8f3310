"""Short causal depthwise convolutions (token shift) and their decode state.

Linear-attention and hybrid layers (H3, Based, Mamba, fla's ``use_short_conv``)
run a depthwise causal convolution of small width W (about 4) over q, k, v or
the layer input: each channel mixes the current token with the W-1 before it,
which hands a token its predecessor's features (what associative recall
needs and a linear state alone blurs).

Tap order. For a weight ``w [W,D]``

    y[t] = bias + sum_{j=0..W-1} w[j] * x[t - (W-1) + j]

so ``w[W-1]`` multiplies the current token and ``w[0]`` the one W-1 steps back
(the layout of a causal ``conv1d`` kernel, e.g. PyTorch's ``Conv1d`` weight
``[D,1,W]`` transposed). Inputs before the sequence are zeros.

Decode state. ``state [B,W-1,D]`` holds the W-1 inputs just before ``x``
(oldest first; zeros at the start of a sequence) and ``new_state`` the last
W-1 inputs after it, the old state's among them when T < W-1. So a prefill
followed by any split into chunks or single steps (``short_conv_step``)
computes one forward over the whole sequence. The state has x's dtype: it
holds inputs, copied, never rounded sums.

Segment ids (packing and padding), as in ``attn.linear_attention``: ``[B,T]``
ints, id 0 is padding. A padding token is as if absent: it outputs 0 (no
bias), is never read by another token and leaves the state as it was. A
segment is a run of equal non-zero ids, padding between them skipped, so the
window of a token holds the W-1 previous *real* tokens of its segment (fewer
at the segment's start, where the window is cut, not filled from the previous
segment); an id that comes back after another segment starts a new segment.
The given state is the past of the first segment of each row (the sequence
``x`` continues); ``new_state`` is that of the last segment, with zeros in the
slots before its start. A row of padding only returns its state unchanged.

Numerics: products and sums in float32 whatever the input dtype; the output
is cast back to x's dtype. W is tiny, so the convolution is W shifted
multiply-adds that XLA fuses into one loop (no ``conv_general_dilated``
with D feature groups, no ``[T,T]`` matrix).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import fail
from attn.masks import PADDING, drop_padding

__all__ = ["short_conv", "short_conv_step"]


# ----------------------------------------------------------------------------
# Validation


def _check_float(x, name: str, shape: tuple[int, ...], layout: str) -> None:
    got = np.shape(x)
    if got != shape:
        fail(name, f"shape {shape} = {layout}", f"shape {got}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail(name, "a floating-point array", f"dtype {jnp.result_type(x)}")


def _check_args(x, weight, bias, state) -> tuple[int, int, int, int]:
    """Checks x ``[B,T,D]``, weight ``[W,D]``, bias ``[D]``, state ``[B,W-1,D]``.

    Returns B, T, D, W.
    """
    if getattr(x, "ndim", None) != 3:
        fail("x", "a rank-3 array [B,T,D]", f"shape {getattr(x, 'shape', type(x).__name__)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail("x", "a floating-point array", f"dtype {x.dtype}")
    B, T, D = x.shape
    if T == 0:
        fail("x", "at least one token (T >= 1)", f"shape {x.shape}")
    if np.ndim(weight) != 2:
        fail("weight", f"a rank-2 array [W,D] with D = {D}", f"shape {np.shape(weight)}")
    W = np.shape(weight)[0]
    if W < 1:
        fail("weight", "width W >= 1 (shape [W,D])", f"shape {np.shape(weight)}")
    _check_float(weight, "weight", (W, D), "[W,D] (D = x's channels)")
    if bias is not None:
        _check_float(bias, "bias", (D,), "[D] (D = x's channels)")
    if state is not None:
        _check_float(state, "state", (B, W - 1, D), "[B,W-1,D] (W = weight's width)")
    return B, T, D, W


# ----------------------------------------------------------------------------
# The convolution


def _runs(seg):
    """Run index ``[B,L]`` of ids ``[B,L]``: 0 for the first run, +1 where the id changes."""
    changed = seg[:, 1:] != seg[:, :-1]
    return jnp.pad(jnp.cumsum(changed, axis=1, dtype=jnp.int32), ((0, 0), (1, 0)))


def _taps(ext, weight, T: int, W: int, run=None):
    """``sum_j weight[j] * ext[:, t+j]`` ``[B,T,D]`` float32; ext ``[B,W-1+T,D]`` float32.

    With ``run [B,W-1+T]``, tap j is read only where its run index is the
    current token's (``ext[:, t+W-1]``): the window stops at a segment start.
    """
    out = jnp.zeros((ext.shape[0], T, ext.shape[2]), jnp.float32)
    for j in range(W):
        tap = ext[:, j : j + T]
        if run is not None and j < W - 1:
            tap = jnp.where((run[:, j : j + T] == run[:, W - 1 :])[..., None], tap, 0.0)
        out = out + weight[j] * tap
    return out


def short_conv(x, weight, bias=None, *, state=None, segment_ids=None):
    """Causal depthwise convolution of width W over tokens, with its decode state.

    ``y[t] = bias + sum_{j<W} weight[j] * x[t - (W-1) + j]``: ``weight[W-1]``
    multiplies the current token, ``weight[0]`` the oldest (see the module
    docstring for the state and segment conventions).

    Args:
        x: inputs ``[B,T,D]`` (D any channel count: model width, or N*H for
            q/k/v), any float dtype; T >= 1.
        weight: taps ``[W,D]``, W >= 1, oldest tap first.
        bias: ``[D]`` or None.
        state: ``[B,W-1,D]``, the W-1 inputs before ``x`` (oldest first); zeros
            (the start of a sequence) if None. With segment ids it is the past
            of each row's first segment.
        segment_ids: ``[B,T]`` ints or None (one sequence per row). Id 0 is
            padding (skipped, outputs 0); a token reads only earlier real
            tokens of its own segment (a run of equal non-zero ids).

    Returns:
        ``(y [B,T,D] in x's dtype, new_state [B,W-1,D] in x's dtype)``: the
        last W-1 inputs (with segment ids, of the last segment, zeros before
        its start), to pass as ``state`` to the next chunk or step.
    """
    B, T, D, W = _check_args(x, weight, bias, state)
    seg = checks.segment_ids(segment_ids, "segment_ids", B, T)
    past = jnp.zeros((B, W - 1, D), x.dtype) if state is None else jnp.asarray(state, x.dtype)
    w32 = jnp.asarray(weight, jnp.float32)

    if seg is None:
        ext = jnp.concatenate([past, x], axis=1)  # [B,W-1+T,D]
        y = _taps(ext.astype(jnp.float32), w32, T, W)
        if bias is not None:
            y = y + jnp.asarray(bias, jnp.float32)
        return y.astype(x.dtype), ext[:, T:]

    # Padding is as if absent: move the real tokens to the front of each row
    # (stable, so in order), convolve them there, and put the outputs back.
    real = seg != PADDING
    x = drop_padding(x, seg)  # padding holds anything, NaN included
    order = jnp.argsort(jnp.where(real, 0, 1), axis=1, stable=True)  # [B,T]: real tokens first
    rank = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1  # [B,T]: index among real tokens
    num_real = rank[:, -1] + 1  # [B]
    packed = jnp.take_along_axis(x, order[..., None], axis=1)
    packed_seg = jnp.take_along_axis(seg, order, axis=1)
    ext = jnp.concatenate([past, packed], axis=1)  # [B,W-1+T,D]
    # The state continues the first segment, so it shares its run index 0;
    # the padding moved to the tail gets runs of its own, and its outputs
    # are discarded below.
    run = jnp.concatenate([jnp.zeros((B, W - 1), jnp.int32), _runs(packed_seg)], axis=1)
    y_packed = _taps(ext.astype(jnp.float32), w32, T, W, run)
    if bias is not None:
        y_packed = y_packed + jnp.asarray(bias, jnp.float32)
    y = jnp.take_along_axis(y_packed, jnp.maximum(rank, 0)[..., None], axis=1)
    y = jnp.where(real[..., None], y, 0.0)
    if W == 1:
        return y.astype(x.dtype), past  # no state to keep

    # The last W-1 real inputs end at ext index W-2+num_real; slots from an
    # earlier segment than the last token's are zeroed (its window starts fresh).
    at = num_real[:, None] + jnp.arange(W - 1)  # [B,W-1]
    last = jnp.take_along_axis(ext, at[..., None], axis=1)
    run_at = jnp.take_along_axis(run, at, axis=1)
    keep = run_at == jnp.take_along_axis(run, num_real[:, None] + W - 2, axis=1)
    new_state = jnp.where(keep[..., None], last, jnp.zeros((), x.dtype))
    return y.astype(x.dtype), new_state


def short_conv_step(state, x_t, weight, bias=None, *, segment_id=None):
    """Advances ``short_conv`` by one token (decoding): ``short_conv`` with T = 1.

    Args:
        state: ``[B,W-1,D]``, the W-1 previous inputs (oldest first), e.g. the
            ``new_state`` of a prefill.
        x_t: this token's input ``[B,D]``.
        weight, bias: as in ``short_conv`` (``[W,D]``, ``[D]`` or None).
        segment_id: ``[B]`` ints or None: 0 marks a padding step, which outputs
            0 and leaves the state as it was; any other id continues the state.

    Returns:
        ``(y_t [B,D] in x_t's dtype, new_state [B,W-1,D])``.
    """
    if getattr(x_t, "ndim", None) != 2:
        fail("x_t", "a rank-2 array [B,D]", f"shape {getattr(x_t, 'shape', type(x_t).__name__)}")
    if state is None:
        fail("state", "a [B,W-1,D] array (zeros at the start of a sequence)", "None")
    B = x_t.shape[0]
    seg = checks.segment_ids(segment_id, "segment_id", B)
    seg = None if seg is None else seg[:, None]
    y, new_state = short_conv(x_t[:, None], weight, bias, state=state, segment_ids=seg)
    return y[:, 0], new_state
