"""Models: a causal decoder, a bidirectional encoder and an encoder-decoder.

All three share ``Block`` and take a per-layer pattern of attention configs.
Calling a model returns float32 logits ``[B,T,V]``; with
``capture_weights=True`` it also returns the attention weights of every layer.

Decoding (``Decoder`` and ``EncoderDecoder``) is functional::

    cache = model.init_cache(batch, max_len)            # DecodeCache pytree
    logits, cache = model.prefill(prompt, cache, lengths)   # [B,T,V]
    logits, cache = model.decode_step(token, cache)         # [B,V]

Rows may have different prompt lengths: row b continues at position
``lengths[b]`` (the cache tracks it per row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn import masks
from models.cache import DecodeCache, cache_overflow
from models.config import AttentionConfig, ModelConfig
from models.layers import Block


def _fail(arg: str, expected: str, got) -> None:
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def _concrete(x):
    """NumPy value of x, or None under a trace (value checks are then skipped)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_tokens(tokens, name: str = "tokens", vocab: int | None = None):
    """Integer ids ``[B,T]``; with ``vocab``, values in ``[0, vocab)`` when concrete.

    Under a trace the values cannot be checked; ``_LM._embed`` then gives an
    out-of-range id a NaN embedding, so its logits are NaN rather than plausible.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        _fail(name, "integer token ids of shape [B,T]", f"{tokens.dtype} {tokens.shape}")
    if tokens.shape[1] == 0:
        _fail(name, "at least one token per row", f"shape {tokens.shape}")
    value = None if vocab is None else _concrete(tokens)
    if value is not None and ((value < 0).any() or (value >= vocab).any()):
        _fail(name, f"token ids in [0, {vocab})", f"ids from {value.min()} to {value.max()}")
    return tokens


def _check_lengths(lengths, B: int, T: int, name: str = "lengths", minimum: int = 0):
    """None, or ``[B]`` int32 lengths in ``[minimum, T]`` (values checked when concrete)."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        _fail(name, f"integer lengths of shape ({B},)", f"{lengths.dtype} {lengths.shape}")
    value = _concrete(lengths)
    if value is not None and ((value < minimum).any() or (value > T).any()):
        _fail(name, f"values in [{minimum}, {T}]", value.tolist())
    return lengths.astype(jnp.int32)


def _layer_gates(head_gates, layers: tuple[AttentionConfig, ...]) -> list:
    """Per-layer ``[N]`` gates (or None) from None, ``[L, N]``, or a sequence of L ``[N]``/None."""
    L = len(layers)
    if head_gates is None:
        return [None] * L
    if isinstance(head_gates, list | tuple):
        if len(head_gates) != L:
            _fail("head_gates", f"{L} per-layer entries", f"{len(head_gates)}")
        gates = list(head_gates)
    else:
        head_gates = jnp.asarray(head_gates)
        if head_gates.ndim != 2 or head_gates.shape[0] != L:
            _fail("head_gates", f"shape ({L}, N) or a sequence of {L} [N] arrays", head_gates.shape)
        gates = list(head_gates)
    for i, (g, layer) in enumerate(zip(gates, layers, strict=True)):
        if g is not None and jnp.shape(g) != (layer.num_heads,):
            _fail(f"head_gates[{i}]", f"shape ({layer.num_heads},)", jnp.shape(g))
    return gates


def _padding(tokens, lengths, segment_ids, layers, name="lengths"):
    """Segment ids (for softmax layers) and validity (for linear layers) of padded inputs."""
    B, T = tokens.shape
    if lengths is not None and segment_ids is not None:
        _fail("segment_ids", "None when lengths is given", "both")
    if segment_ids is not None:
        if any(layer.kind == "linear" for layer in layers):
            _fail(
                "segment_ids",
                "None for a model with linear-attention layers (pass lengths for padding)",
                "an array",
            )
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != (B, T):
            _fail("segment_ids", f"shape ({B}, {T})", segment_ids.shape)
        return segment_ids, None
    lengths = _check_lengths(lengths, B, T, name)
    if lengths is None:
        return None, None
    return masks.segment_ids_from_lengths(lengths, T), jnp.arange(T)[None, :] < lengths[:, None]


class _LM(nnx.Module):
    """What the three models share: embeddings, output head, running a stack of blocks."""

    def _embed(self, tokens):
        """``[B,T]`` ids -> ``[B,T,D]``. Ids outside ``[0, V)`` (only possible under a
        trace, where they are not checked) embed as NaN instead of wrapping around."""
        tokens = jnp.where(tokens < 0, self.config.vocab_size, tokens)
        return self.embed(tokens)  # an id >= V gathers NaN (jnp.take's "fill" mode)

    def _init_embeddings(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.embed = nnx.Embed(
            config.vocab_size, config.width, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.final_norm = nnx.RMSNorm(
            config.width,
            epsilon=config.norm_eps,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        # The head computes in float32 so logits are float32 whatever the dtype.
        self.head = (
            None
            if config.tied_embeddings
            else nnx.Linear(
                config.width,
                config.vocab_size,
                use_bias=False,
                dtype=jnp.float32,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    def _blocks(self, layers, *, causal: bool, cross: AttentionConfig | None, rngs):
        return nnx.List(
            [Block(self.config, layer, causal=causal, cross=cross, rngs=rngs) for layer in layers]
        )

    def _logits(self, x):
        """Float32 logits ``[B,T,V]`` from the residual stream ``[B,T,D]``."""
        h = self.final_norm(x).astype(jnp.float32)
        if self.head is not None:
            return self.head(h)
        return jnp.einsum("BTD,VD->BTV", h, self.embed.embedding[...].astype(jnp.float32))

    @staticmethod
    def _run(blocks, x, layers, *, head_gates, capture_weights, **kwargs):
        """Runs a stack: ``(x [B,T,D], self weights per layer, cross weights per layer)``."""
        self_w, cross_w = [], []
        for block, gates in zip(blocks, _layer_gates(head_gates, layers), strict=True):
            x, (w, wc) = block(x, head_gates=gates, capture_weights=capture_weights, **kwargs)
            self_w.append(w)
            cross_w.append(wc)
        return x, tuple(self_w), tuple(cross_w)

    # Decoding (causal stacks) ------------------------------------------------

    def _empty_cache(self, batch: int, max_len: int, cross: tuple = ()) -> DecodeCache:
        for name, x in (("batch", batch), ("max_len", max_len)):
            if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 1:
                _fail(name, "a positive int", repr(x))
        return DecodeCache(
            layers=tuple(b.attn.init_cache(batch, max_len) for b in self.blocks),
            lengths=jnp.zeros((batch,), jnp.int32),
            cross=cross,
        )

    def prefill(self, tokens, cache: DecodeCache, lengths=None, *, head_gates=None):
        """Runs a prompt (or a further chunk of one) through the model into the cache.

        Args:
          tokens: ``[B,T]`` ints; row b's real tokens are its first ``lengths[b]``
            (the rest is padding, invisible to every later token).
          cache: a ``DecodeCache`` from ``init_cache`` (or a previous call).
          lengths: ``[B]`` ints in ``[0, T]``, or None (all T are real).
          head_gates: as in ``__call__``.

        Returns:
          ``(logits [B,T,V] float32, cache)``; row b's next position is its old one
          plus ``lengths[b]``. Logits at padding are meaningless.

        Raises:
          ValueError: the tokens do not fit a full (non-window) layer cache and the
            lengths are concrete. Under ``jit`` the overflowing rows' logits are NaN
            instead (see ``models.cache.cache_overflow``).
        """
        tokens = _check_tokens(tokens, vocab=self.config.vocab_size)
        B, T = tokens.shape
        if not isinstance(cache, DecodeCache) or cache.lengths.shape != (B,):
            _fail("cache", f"a DecodeCache for batch {B} (see init_cache)", type(cache).__name__)
        if self.blocks[0].cross is not None and not cache.cross:
            _fail("cache", "a cache holding the source (init_cache(..., src=...))", "no cross K/V")
        lengths = _check_lengths(lengths, B, T)
        cache_overflow(cache, T if lengths is None else lengths)  # raises when concrete
        # Jitted at the boundary: eager calls compile once per shape instead of
        # dispatching op by op; inside a caller's jit it is inlined.
        graphdef, state = nnx.split(self)
        return _jit_prefill(graphdef, state, tokens, cache, lengths, head_gates)

    def _prefill(self, tokens, cache: DecodeCache, lengths, head_gates):
        """``prefill`` after its checks, traced."""
        T = tokens.shape[1]
        count = T if lengths is None else lengths
        overflow = cache_overflow(cache, count)  # [B] rows past a full cache, or None
        x = self._embed(tokens)
        start = cache.lengths
        memory = cache.cross or (None,) * len(self.blocks)
        layers = []
        gates = _layer_gates(head_gates, self.config.layers)
        for block, layer_cache, mem, g in zip(
            self.blocks, cache.layers, memory, gates, strict=True
        ):
            x, layer_cache = block.extend(x, layer_cache, start, lengths, memory=mem, head_gates=g)
            layers.append(layer_cache)
        logits = self._logits(x)
        if overflow is not None:  # under a trace: rows past a full cache get NaN logits
            logits = jnp.where(overflow[:, None, None], jnp.nan, logits)
        return logits, DecodeCache(tuple(layers), start + count, cache.cross)

    def decode_step(self, token, cache: DecodeCache, *, head_gates=None):
        """One token per row at the row's next position.

        Args:
          token: ``[B]`` ints (or ``[B,1]``).
          cache: the ``DecodeCache``.
          head_gates: as in ``__call__``.

        Returns:
          ``(logits [B,V] float32, cache)``.
        """
        token = jnp.asarray(token)
        if token.ndim == 1:
            token = token[:, None]
        if token.ndim != 2 or token.shape[1] != 1:
            _fail("token", "shape [B] or [B, 1]", token.shape)
        logits, cache = self.prefill(token, cache, head_gates=head_gates)
        return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jit_prefill(graphdef, state, tokens, cache, lengths, head_gates):
    return nnx.merge(graphdef, state)._prefill(tokens, cache, lengths, head_gates)


class Decoder(_LM):
    """Causal language model with a per-layer attention pattern (``config.layers``).

    ``Decoder(config, rngs=nnx.Rngs(0))(tokens [B,T]) -> logits [B,T,V]`` float32.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            _fail("config", "a ModelConfig", type(config).__name__)
        self._init_embeddings(config, rngs)
        self.blocks = self._blocks(config.layers, causal=True, cross=None, rngs=rngs)

    def __call__(
        self,
        tokens,
        *,
        positions=None,
        segment_ids=None,
        head_gates=None,
        capture_weights: bool = False,
    ):
        """Logits of every position (teacher forcing).

        Args:
          tokens: ``[B,T]`` ints.
          positions: ``[B,T]`` ints, default ``arange(T)`` (RoPE and masks).
          segment_ids: ``[B,T]`` ints for packed sequences (softmax layers only).
            Right padding needs nothing: causal tokens never see later ones.
          head_gates: ``[L,N]`` or a sequence of L ``[N]`` (or None) per-head output
            multipliers; default ones.
          capture_weights: also return the attention weights.

        Returns:
          ``logits [B,T,V]`` float32, or ``(logits, weights)`` with ``weights`` a
          tuple of L entries: ``[B,N,T,T]`` float32 for softmax/MLA layers, None for
          linear ones.
        """
        tokens = _check_tokens(tokens, vocab=self.config.vocab_size)
        segment_ids, _ = _padding(tokens, None, segment_ids, self.config.layers)
        if positions is not None:
            positions = jnp.asarray(positions)
            if positions.shape != tokens.shape:
                _fail("positions", f"shape {tokens.shape}", positions.shape)
        x, weights, _ = self._run(
            self.blocks,
            self._embed(tokens),
            self.config.layers,
            head_gates=head_gates,
            capture_weights=capture_weights,
            positions=positions,
            segment_ids=segment_ids,
        )
        logits = self._logits(x)
        return (logits, weights) if capture_weights else logits

    def init_cache(self, batch: int, max_len: int) -> DecodeCache:
        """An empty ``DecodeCache`` for ``batch`` rows of up to ``max_len`` tokens.

        Full caches hold ``max_len`` slots, one per position: going past them
        raises (concrete lengths) or gives NaN logits (under ``jit``). Window
        layers hold ``initial_tokens + window`` slots whatever ``max_len``; linear
        layers a constant state.
        """
        return self._empty_cache(batch, max_len)


class Encoder(_LM):
    """Bidirectional encoder (``config.layers`` with non-causal masks) with an LM head.

    Padded inputs via ``lengths`` (right padding) or ``segment_ids``: padding
    never changes the outputs at real tokens.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            _fail("config", "a ModelConfig", type(config).__name__)
        self._init_embeddings(config, rngs)
        self.blocks = self._blocks(config.layers, causal=False, cross=None, rngs=rngs)

    def encode(
        self, tokens, *, lengths=None, segment_ids=None, head_gates=None, capture_weights=False
    ):
        """The residual stream ``[B,T,D]`` after the last block (before the final norm).

        Arguments as ``__call__``.

        Returns ``(hidden, weights)``.
        """
        tokens = _check_tokens(tokens, vocab=self.config.vocab_size)
        segment_ids, valid = _padding(tokens, lengths, segment_ids, self.config.layers)
        x, weights, _ = self._run(
            self.blocks,
            self._embed(tokens),
            self.config.layers,
            head_gates=head_gates,
            capture_weights=capture_weights,
            segment_ids=segment_ids,
            valid=valid,
        )
        return x, weights

    def __call__(
        self, tokens, *, lengths=None, segment_ids=None, head_gates=None, capture_weights=False
    ):
        """Logits at every position.

        Args:
          tokens: ``[B,T]`` ints.
          lengths: ``[B]`` ints, real tokens per row (right padding), or None.
          segment_ids: ``[B,T]`` ints (packing; softmax layers only), or None.
          head_gates: as in ``Decoder.__call__``.
          capture_weights: also return the weights (tuple of L ``[B,N,T,T]`` or None).

        Returns:
          ``logits [B,T,V]`` float32, or ``(logits, weights)``.
        """
        x, weights = self.encode(
            tokens,
            lengths=lengths,
            segment_ids=segment_ids,
            head_gates=head_gates,
            capture_weights=capture_weights,
        )
        logits = self._logits(x)
        return (logits, weights) if capture_weights else logits


class EncoderDecoder(_LM):
    """Encoder (``config.encoder_layers``, bidirectional) + decoder (``config.layers``,
    causal, with cross-attention ``config.cross`` in every block). One embedding
    table serves both sides and the output head.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            _fail("config", "a ModelConfig", type(config).__name__)
        if not config.encoder_layers:
            _fail("config.encoder_layers", "at least one AttentionConfig", "()")
        self._init_embeddings(config, rngs)
        self.encoder_blocks = self._blocks(
            config.encoder_layers, causal=False, cross=None, rngs=rngs
        )
        self.encoder_norm = nnx.RMSNorm(
            config.width,
            epsilon=config.norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            rngs=rngs,
        )
        self.blocks = self._blocks(config.layers, causal=True, cross=config.cross, rngs=rngs)

    def encode(self, src, *, src_lengths=None, capture_weights=False):
        """Encoder output ``[B,S,D]``, source segment ids ``[B,S]`` (1 real, 0 padding)
        and the encoder's weights."""
        src = _check_tokens(src, "src", vocab=self.config.vocab_size)
        B, S = src.shape
        src_lengths = _check_lengths(src_lengths, B, S, "src_lengths")
        seg, valid = _padding(src, src_lengths, None, self.config.encoder_layers, "src_lengths")
        x, weights, _ = self._run(
            self.encoder_blocks,
            self._embed(src),
            self.config.encoder_layers,
            head_gates=None,
            capture_weights=capture_weights,
            segment_ids=seg,
            valid=valid,
        )
        seg = jnp.ones((B, S), jnp.int32) if seg is None else seg
        return self.encoder_norm(x), seg, weights

    def _memories(self, memory, seg) -> tuple:
        return tuple(block.cross.memory(memory, seg) for block in self.blocks)

    def __call__(self, src, tgt, *, src_lengths=None, head_gates=None, capture_weights=False):
        """Logits of every target position given the source.

        Args:
          src: ``[B,S]`` ints; tgt: ``[B,T]`` ints (S and T independent).
          src_lengths: ``[B]`` real source tokens per row, or None.
          head_gates: for the decoder's self-attention, as in ``Decoder.__call__``.
          capture_weights: also return ``{"encoder", "decoder", "cross"}`` weights,
            tuples of ``[B,N,S,S]``, ``[B,N,T,T]``, ``[B,N,T,S]`` (None for linear).

        Returns:
          ``logits [B,T,V]`` float32, or ``(logits, weights)``.
        """
        memory, seg, enc_w = self.encode(
            src, src_lengths=src_lengths, capture_weights=capture_weights
        )
        tgt = _check_tokens(tgt, "tgt", vocab=self.config.vocab_size)
        if tgt.shape[0] != memory.shape[0]:
            _fail("tgt", f"batch {memory.shape[0]} like src", tgt.shape)
        x = self._embed(tgt)
        gates = _layer_gates(head_gates, self.config.layers)
        dec_w, cross_w = [], []
        for block, mem, g in zip(self.blocks, self._memories(memory, seg), gates, strict=True):
            x, (w, wc) = block(x, memory=mem, head_gates=g, capture_weights=capture_weights)
            dec_w.append(w)
            cross_w.append(wc)
        logits = self._logits(x)
        if not capture_weights:
            return logits
        return logits, {"encoder": enc_w, "decoder": tuple(dec_w), "cross": tuple(cross_w)}

    def init_cache(self, batch: int, max_len: int, *, src, src_lengths=None) -> DecodeCache:
        """Encodes the source and returns a ``DecodeCache`` holding its cross K/V.

        Args:
          batch: B, must equal ``src.shape[0]``.
          max_len: target tokens to decode (prompt + generated).
          src: ``[B,S]`` ints; src_lengths: ``[B]`` or None.
        """
        src = _check_tokens(src, "src", vocab=self.config.vocab_size)
        if src.shape[0] != batch:
            _fail("src", f"batch {batch}", src.shape)
        memory, seg, _ = self.encode(src, src_lengths=src_lengths)
        return self._empty_cache(batch, max_len, cross=self._memories(memory, seg))
