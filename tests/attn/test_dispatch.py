"""attn.attention: implementations agree or refuse, never change the math."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import attn
from attn import masks
from tests.util import qkv, rel_err


@pytest.mark.parametrize(
    "mask",
    [None, masks.causal(), masks.sliding_window(3), masks.causal() & masks.sliding_window(2)],
)
def test_xla_equals_dense_where_semantics_match(mask):
    q, k, v = qkv(0, B=2, T=9, N=4, K=2)
    dense = attn.attention(q, k, v, impl="dense", mask=mask)
    assert rel_err(attn.attention(q, k, v, impl="xla", mask=mask), dense) <= 1e-5
    assert rel_err(attn.attention(q, k, v, mask=mask), dense) <= 1e-5


def test_bidirectional_band_maps_to_jax_nn():
    q, k, v = qkv(1, B=1, T=8, N=2)
    mask = masks.bidirectional_window(2)
    assert (
        rel_err(
            attn.attention(q, k, v, impl="xla", mask=mask),
            attn.attention(q, k, v, impl="dense", mask=mask),
        )
        <= 1e-5
    )


def test_xla_gradients_equal_dense():
    q, k, v = qkv(2, B=1, T=7, N=2)
    g = lambda impl: jax.grad(  # noqa: E731
        lambda q: attn.attention(q, k, v, impl=impl, mask=masks.causal()).sum()
    )(q)
    assert rel_err(g("xla"), g("dense")) <= 1e-5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sink_logits": jnp.zeros(4)}, "sink_logits"),
        ({"softcap": 5.0}, "softcap"),
        ({"return_weights": True}, "return_weights"),
    ],
)
def test_xla_refuses_other_semantics(kwargs, match):
    q, k, v = qkv(3, B=2, T=9, N=4, K=2)
    with pytest.raises(ValueError, match=match):
        attn.attention(q, k, v, impl="xla", **kwargs)
    # ...while auto falls back to an implementation that has them.
    auto = attn.attention(q, k, v, **kwargs)
    dense = attn.attention(q, k, v, impl="dense", **kwargs)
    assert (
        rel_err(
            auto[0] if isinstance(auto, tuple) else auto,
            dense[0] if isinstance(dense, tuple) else dense,
        )
        <= 1e-5
    )


SEGMENTS = jnp.asarray([[1] * 5 + [2] * 3 + [0], [1] * 2 + [0] * 7], jnp.int32)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_segment_ids": SEGMENTS, "q_segment_ids": SEGMENTS, "mask": masks.causal()},
        {"q_positions": jnp.arange(9) + 3, "kv_positions": jnp.arange(9), "mask": masks.causal()},
        {"mask": masks.chunked(4)},
        {"mask": masks.causal(), "bias": jnp.ones((2, 4, 9, 1))},
    ],
)
def test_xla_takes_what_a_mask_array_expresses(kwargs):
    """Segment ids (padding rows included), positions and masks jax.nn has no argument
    for reach it as a boolean mask array; rows that see nothing come back as ours, 0."""
    q, k, v = qkv(3, B=2, T=9, N=4, K=2)
    want = attn.attention(q, k, v, impl="dense", **kwargs)
    assert rel_err(attn.attention(q, k, v, impl="xla", **kwargs), want) <= 1e-6


def test_cudnn_needs_a_gpu_and_unknown_impl_is_named():
    q, k, v = qkv(5, B=1, T=4, N=2, dtype=jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cudnn"):
            attn.attention(q, k, v, impl="cudnn")
    else:
        out = attn.attention(q, k, v, impl="cudnn")
        assert rel_err(out, attn.attention(q, k, v, impl="dense")) <= 1e-2
    with pytest.raises(ValueError, match="impl"):
        attn.attention(q, k, v, impl="flash")


def fake_platform(monkeypatch, backend):
    """impl="auto" chooses as on ``backend``; the kernels still run on this CPU."""
    monkeypatch.setattr(attn.dispatch, "_backend", lambda: backend)


def test_auto_on_gpu_takes_cudnn_where_it_fits_else_pallas(monkeypatch):
    fake_platform(monkeypatch, "gpu")
    choose = attn.dispatch.choose_impl
    q, k, v = qkv(6, B=1, T=9, N=2, dtype=jnp.bfloat16)
    assert choose(q, k, v, mask=masks.causal()) == "cudnn"
    assert choose(q, k, v, softcap=5.0) == "pallas"  # semantics cuDNN lacks
    assert choose(q, k, v, mask=masks.chunked(4)) == "pallas"
    assert choose(*qkv(6, B=1, T=9, N=2), mask=masks.causal()) == "pallas"  # float32
    odd = qkv(6, B=1, T=9, N=2, H=12, dtype=jnp.bfloat16)  # head dim not a multiple of 8
    assert choose(*odd, mask=masks.causal()) == "pallas"
    even = qkv(6, B=1, T=8, N=2, dtype=jnp.bfloat16)
    assert choose(*even, bias=jnp.zeros((1, 2, 8, 8))) == "cudnn"  # jax.nn takes a bias
    bias = jnp.zeros((1, 2, 9, 9))
    assert choose(q, k, v, bias=bias) == "pallas"  # cuDNN's biased training needs even T, S
    assert choose(q, k, v, bias=bias, softcap=5.0) == "pallas"  # read per tile
    assert choose(*even, mask=jnp.ones((8, 8), bool)) == "pallas"  # no materialized mask
    # And the Pallas kernel it picks computes dense's function (interpreted on this CPU host,
    # which only runs it when asked: the option reaches the implementation auto picks).
    q, k, v = qkv(7, B=2, T=9, N=4, K=2)
    seg = jnp.asarray([[1] * 6 + [2] * 3, [1] * 9], jnp.int32)
    kw = dict(mask=masks.causal(), q_segment_ids=seg, kv_segment_ids=seg)
    assert choose(q, k, v, **kw) == "pallas"
    want = attn.attention(q, k, v, impl="dense", **kw)
    assert rel_err(attn.attention(q, k, v, interpret=True, **kw), want) <= 1e-5


def test_auto_on_tpu_takes_splash_where_it_maps_else_blockwise(monkeypatch):
    fake_platform(monkeypatch, "tpu")
    choose = attn.dispatch.choose_impl
    q, k, v = qkv(8, B=1, T=9, N=2)
    assert choose(q, k, v, mask=masks.causal()) == "splash"
    assert choose(q, k, v, mask=masks.causal() & masks.initial_tokens(2)) == "splash"
    # Our Pallas kernel does not lower for Mosaic TPU (tests/attn/pallas/test_export.py).
    assert choose(q, k, v, mask=masks.causal(), return_lse=True) == "blockwise"
    rows = jnp.stack([jnp.arange(9), jnp.arange(9) + 3])
    two = qkv(8, B=2, T=9, N=2)
    assert choose(*two, mask=masks.causal(), q_positions=rows) == "blockwise"
    assert choose(q, k, v, return_weights=True) == "dense"


def test_auto_on_cpu_is_unchanged(monkeypatch):
    fake_platform(monkeypatch, "cpu")
    choose = attn.dispatch.choose_impl
    assert choose(*qkv(9, B=1, T=9, N=2), mask=masks.causal()) == "dense"
    long = qkv(9, B=1, T=128, N=2)
    assert choose(*long, mask=masks.causal()) == "blockwise"
    assert choose(*long, bias=jnp.zeros((1, 2, 128, 128))) == "blockwise"  # read per tile
    assert choose(*long, bias=jnp.zeros((1, 2, 128, 128)), return_weights=True) == "dense"
    fake_platform(monkeypatch, "METAL")  # anything else: the reference
    assert choose(*long, mask=masks.causal()) == "dense"
    # Never an interpreter: whatever the call asks for, on a CPU auto picks compiled XLA.
    sinks = jnp.zeros((2,), jnp.float32)
    fake_platform(monkeypatch, "cpu")
    for x in (qkv(9, B=1, T=9, N=2), long):
        for extra in ({}, dict(softcap=5.0, sink_logits=sinks), dict(return_lse=True)):
            assert choose(*x, mask=masks.causal(), **extra) in ("dense", "blockwise")


def test_the_blockwise_tile_kernel_is_at_most_12_frames_below_attention():
    """A reader follows ``attention(impl="blockwise")`` to the tile kernel in a few frames:
    the checked call object is handed down, not re-spelled at every level."""
    root = Path(attn.__file__).parent
    stacks = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "tile" and code.co_filename.endswith("kernels.py"):
            stack = []
            while frame is not None:
                stack.append(frame.f_code)
                frame = frame.f_back
            stacks.append(stack[::-1])

    q, k, v = qkv(30, B=1, T=32, N=2)
    call = functools.partial(attn.attention, impl="blockwise", mask=masks.causal(), block_q=16)
    sys.setprofile(profile)
    try:
        jax.make_jaxpr(call)(q, k, v)
    finally:
        sys.setprofile(None)
    ours = [c for c in stacks[0] if Path(c.co_filename).is_relative_to(root)]
    names = [c.co_name for c in ours]
    frames = ours[names.index("attention") :]
    assert frames[-1].co_name == "tile" and len(frames) <= 12, [c.co_name for c in frames]


def test_the_call_arguments_are_declared_once_and_listed_in_every_signature():
    import inspect

    for fn in (attn.dot_product_attention, attn.blockwise_attention, attn.attention,
               attn.pallas.flash_attention, attn.ring_attention, attn.decode_attention,
               attn.dispatch.choose_impl):  # fmt: skip
        params = inspect.signature(fn).parameters
        # jax.nn's bias and mask may be positional where its signature has them.
        positional = ("bias", "mask") if fn in (attn.attention, attn.dot_product_attention) else ()
        for name in attn.softmax.call.CALL_ARGS:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if name in positional else None
            assert params[name].kind is (kind or inspect.Parameter.KEYWORD_ONLY), (fn, name)
    q, k, v = qkv(31, B=1, T=4, N=2)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['block_size'\]"):
        attn.dot_product_attention(q, k, v, block_size=4)
    with pytest.raises(ValueError, match=r"^block_q: expected None for impl='dense'"):
        attn.attention(q, k, v, impl="dense", block_q=4)


def test_choose_impl_checks_the_call_it_is_asked_about():
    q, k, v = qkv(32, B=1, T=4, N=2)
    assert attn.dispatch.choose_impl(q, k, v, mask=masks.causal()) in attn.IMPLS
    with pytest.raises(ValueError, match=r"^mask: expected a boolean array .* or an attn.masks"):
        attn.dispatch.choose_impl(q, k, v, mask="causal")
    with pytest.raises(ValueError, match=r"^k: expected head dim"):
        attn.dispatch.choose_impl(q, k[..., :4], v)
