"""Models: a causal decoder, a bidirectional encoder and an encoder-decoder.

All three share ``Block`` and take a per-layer pattern of attention configs.
Calling a model returns float32 logits ``[B,T,V]``, always; attention weights
and per-head gates are taps on the attention modules (``models.taps``).

Padding and packing are segment ids ``[B,T]`` (id 0 is padding) for every
layer kind; ``lengths`` (right padding) is turned into them. Packed rows pass
``positions`` that restart per segment (``packed_positions``) as well.

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
from jax.sharding import PartitionSpec

from attn import checks
from attn.checks import fail
from attn.paged import pages_for
from models import inputs
from models.block import Block
from models.cache import DecodeCache, SlotCache, cache_overflow, paged_layer
from models.config import AttentionConfig, ModelConfig
from models.heads import Dense, rows
from models.mesh import explicit_spec


def packed_positions(segment_ids):
    """``[B,T]`` int32 positions that restart at 0 where each segment starts.

    For packed rows (several sequences one after another, each a run of one
    id): pass them as ``positions`` with the ``segment_ids`` so RoPE and the
    position-based masks (windows, initial and global tokens) see each
    sequence as if it ran alone.

    Args:
      segment_ids: ``[B,T]`` ints; a segment is a run of equal ids.
    """
    seg = jnp.asarray(segment_ids)
    if seg.ndim != 2:
        fail("segment_ids", "a [B,T] array", seg.shape)
    t = jnp.arange(seg.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


class _LM(nnx.Module):
    """What the three models share: embeddings, output head, running a stack of blocks."""

    def _embed(self, tokens):
        """``[B,T]`` ids -> ``[B,T,D]``. Ids outside ``[0, V)`` (only possible under a
        trace, where they are not checked) embed as NaN instead of wrapping around."""
        tokens = jnp.where(tokens < 0, self.config.vocab_size, tokens)
        spec = explicit_spec(tokens)  # under Explicit axes: rows where the tokens are
        out = None if spec is None else PartitionSpec(*spec, None)
        return self.embed(tokens, out_sharding=out)  # an id >= V gathers NaN ("fill" mode)

    def _init_embeddings(self, config: ModelConfig, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            fail("config", "a ModelConfig", type(config).__name__)
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.embed = nnx.Embed(
            config.vocab_size, config.width, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.final_norm = self._norm(rngs)
        # The head computes in float32 so logits are float32 whatever the dtype.
        self.head = (
            None
            if config.tied_embeddings
            else Dense(
                config.width,
                config.vocab_size,
                use_bias=False,
                dtype=jnp.float32,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    def _norm(self, rngs: nnx.Rngs) -> nnx.RMSNorm:
        config = self.config
        return nnx.RMSNorm(
            config.width,
            epsilon=config.norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            rngs=rngs,
        )

    def _blocks(self, layers, *, causal: bool, cross: AttentionConfig | None, rngs, name: str):
        for i, layer in enumerate(layers):  # a ValueError naming config.<name>[i].<field>
            layer.check_direction(causal, f"config.{name}[{i}]")
        return nnx.List(
            [Block(self.config, layer, causal=causal, cross=cross, rngs=rngs) for layer in layers]
        )

    def _logits(self, x):
        """Float32 logits ``[B,T,V]`` from the residual stream ``[B,T,D]``."""
        h = self.final_norm(x).astype(jnp.float32)
        if self.head is not None:
            return self.head(h)
        table = self.embed.embedding[...].astype(jnp.float32)
        flat = rows(h)
        if flat is None:
            return jnp.einsum("BTD,VD->BTV", h, table)
        return (flat @ table.T).reshape(*h.shape[:-1], -1)

    def _forward(self, blocks, tokens, *, positions=None, segment_ids=None, memory=()):
        """The residual stream ``[B,T,D]`` after a stack (``memory``: one CrossCache a block)."""
        return self._streams(blocks, tokens, positions, segment_ids, memory)[-1]

    def _streams(self, blocks, tokens, positions, segment_ids, memory=()) -> list:
        """The residual stream after the embedding and after each block: L + 1 ``[B,T,D]``."""
        xs = [self._embed(tokens)]
        memory = memory or (None,) * len(blocks)
        for block, mem in zip(blocks, memory, strict=True):
            xs.append(block(xs[-1], positions=positions, segment_ids=segment_ids, memory=mem))
        return xs

    # Decoding (causal stacks) ------------------------------------------------

    def _empty_cache(
        self, batch: int, max_len: int, cross: tuple = (), page_size=None, num_pages=None
    ) -> DecodeCache:
        for name, x in (("batch", batch), ("max_len", max_len)):
            if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 1:
                fail(name, "a positive int", repr(x))
        conv = tuple(b.init_conv_state(batch) for b in self.blocks)
        if page_size is None and num_pages is not None:
            fail("page_size", "a positive int with num_pages", None)
        if page_size is not None:
            page_size = checks.positive_int(page_size, "page_size")
            full = batch * pages_for(max_len, page_size)  # every row at max_len
            num_pages = full if num_pages is None else checks.positive_int(num_pages, "num_pages")
        return DecodeCache(
            layers=tuple(
                self._layer_cache(b, batch, max_len, page_size, num_pages) for b in self.blocks
            ),
            lengths=jnp.zeros((batch,), jnp.int32),
            cross=cross,
            conv=conv if any(c is not None for c in conv) else (),
        )

    @staticmethod
    def _layer_cache(block, batch: int, max_len: int, page_size, num_pages):
        """A block's empty layer cache; with ``page_size``, a full one is paged
        (built from its shapes, so the contiguous cache is never allocated), unless
        its kind rewrites old entries (``SlotCache.PAGEABLE``: PaTH's keys)."""
        if page_size is not None:
            shape = jax.eval_shape(lambda: block.attn.init_cache(batch, max_len))
            if isinstance(shape, SlotCache) and not shape.ring and shape.PAGEABLE:
                return paged_layer(shape, num_pages, page_size)
        return block.attn.init_cache(batch, max_len)

    def prefill(self, tokens, cache: DecodeCache, lengths=None):
        """Runs a prompt (or a further chunk of one) through the model into the cache.

        Args:
          tokens: ``[B,T]`` ints; row b's real tokens are its first ``lengths[b]``
            (the rest is padding, invisible to every later token).
          cache: a ``DecodeCache`` from ``init_cache`` (or a previous call).
          lengths: ``[B]`` ints in ``[0, T]``, or None (all T are real).

        Returns:
          ``(logits [B,T,V] float32, cache)``; row b's next position is its old one
          plus ``lengths[b]``. Logits at padding are meaningless.

        Raises:
          ValueError: the tokens do not fit a full (non-window) layer cache and the
            lengths are concrete. Under ``jit`` the overflowing rows' logits are NaN
            instead (see ``models.cache.cache_overflow``).
        """
        tokens = inputs.check_tokens(tokens, vocab=self.config.vocab_size)
        B, T = tokens.shape
        if not isinstance(cache, DecodeCache) or cache.lengths.shape != (B,):
            fail("cache", f"a DecodeCache for batch {B} (see init_cache)", type(cache).__name__)
        if self.blocks[0].cross is not None and not cache.cross:
            fail("cache", "a cache holding the source (init_cache(..., src=...))", "no cross K/V")
        if any(b.conv is not None for b in self.blocks) and len(cache.conv) != len(self.blocks):
            fail(
                "cache", "a cache holding the short-conv states (see init_cache)", "no conv states"
            )
        lengths = inputs.check_lengths(lengths, B, T)
        cache_overflow(cache, T if lengths is None else lengths)  # raises when concrete
        # Jitted at the boundary: eager calls compile once per shape instead of
        # dispatching op by op; inside a caller's jit it is inlined.
        graphdef, state = nnx.split(self)
        return _jit_prefill(graphdef, state, tokens, cache, lengths)

    def _prefill(self, tokens, cache: DecodeCache, lengths):
        """``prefill`` after its checks, traced."""
        count = tokens.shape[1] if lengths is None else lengths
        overflow = cache_overflow(cache, count)  # [B] rows past a full cache, or None
        x = self._embed(tokens)
        start = cache.lengths
        none = (None,) * len(self.blocks)
        layers, conv = [], []
        for block, layer_cache, mem, state in zip(
            self.blocks, cache.layers, cache.cross or none, cache.conv or none, strict=True
        ):
            x, layer_cache, state = block.extend(
                x, layer_cache, start, lengths, memory=mem, conv_state=state
            )
            layers.append(layer_cache)
            conv.append(state)
        logits = self._logits(x)
        if overflow is not None:  # under a trace: rows past a full cache get NaN logits
            logits = jnp.where(overflow[:, None, None], jnp.nan, logits)
        return logits, DecodeCache(
            tuple(layers), start + count, cache.cross, tuple(conv) if cache.conv else ()
        )

    def decode_step(self, token, cache: DecodeCache):
        """One token per row at the row's next position.

        Args:
          token: ``[B]`` ints (or ``[B,1]``).
          cache: the ``DecodeCache``.

        Returns:
          ``(logits [B,V] float32, cache)``.
        """
        token = jnp.asarray(token)
        if token.ndim == 1:
            token = token[:, None]
        if token.ndim != 2 or token.shape[1] != 1:
            fail("token", "shape [B] or [B, 1]", token.shape)
        logits, cache = self.prefill(token, cache)
        return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jit_prefill(graphdef, state, tokens, cache, lengths):
    return nnx.merge(graphdef, state)._prefill(tokens, cache, lengths)


class Decoder(_LM):
    """Causal language model with a per-layer attention pattern (``config.layers``).

    ``Decoder(config, rngs=nnx.Rngs(0))(tokens [B,T]) -> logits [B,T,V]`` float32.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self._init_embeddings(config, rngs)
        self.blocks = self._blocks(config.layers, causal=True, cross=None, rngs=rngs, name="layers")

    def __call__(self, tokens, *, positions=None, segment_ids=None):
        """Logits of every position (teacher forcing).

        Args:
          tokens: ``[B,T]`` ints.
          positions: ``[B,T]`` ints, default ``arange(T)`` (RoPE and masks); for
            packed rows, ``packed_positions(segment_ids)``.
          segment_ids: ``[B,T]`` ints for packed sequences (every layer kind; id 0
            is padding). Right padding needs nothing: causal tokens never see later ones.

        Returns:
          ``logits [B,T,V]`` float32.
        """
        tokens = inputs.check_tokens(tokens, vocab=self.config.vocab_size)
        x = self._forward(
            self.blocks,
            tokens,
            positions=inputs.check_positions(positions, tokens),
            segment_ids=inputs.segments(tokens, None, segment_ids),
        )
        return self._logits(x)

    def hidden_states(self, tokens, *, positions=None, segment_ids=None) -> jax.Array:
        """The residual stream after the embedding and after each block, ``[L+1,B,T,D]``
        (before the final norm): where massive activations are read (Sun et al. 2024).

        Arguments as ``__call__``'s.
        """
        tokens = inputs.check_tokens(tokens, vocab=self.config.vocab_size)
        positions = inputs.check_positions(positions, tokens)
        segment_ids = inputs.segments(tokens, None, segment_ids)
        return jnp.stack(self._streams(self.blocks, tokens, positions, segment_ids))

    def init_cache(
        self,
        batch: int,
        max_len: int,
        *,
        page_size: int | None = None,
        num_pages: int | None = None,
    ) -> DecodeCache:
        """An empty ``DecodeCache`` for ``batch`` rows of up to ``max_len`` tokens.

        Full caches hold ``max_len`` slots, one per position: going past them
        raises (concrete lengths) or gives NaN logits (under ``jit``). Window
        layers hold ``initial_tokens + window`` slots whatever ``max_len``; linear
        layers a constant state. A layer with a short convolution also keeps its
        last W-1 inputs ``[B,W-1,D]`` (``DecodeCache.conv``).

        With ``page_size``, the full caches are paged (``attn.paged``): one pool
        of ``num_pages`` pages of ``page_size`` tokens per layer payload, shared
        by the rows, and per-row block tables of ``ceil(max_len / page_size)``
        entries, all empty. Pages are allocated on the host by an
        ``attn.PageTable(num_pages, page_size, batch, ...)`` and handed over with
        ``models.cache.set_block_tables``; ``models.serve`` does both. Windows keep their
        ring buffers (``initial_tokens + window`` slots already hold exactly
        what they read) and recurrent layers their states.

        Args:
          batch: B, the rows (sequences decoded at once).
          max_len: the most tokens a row holds (prompt + generated).
          page_size: tokens per page, or None (contiguous caches).
          num_pages: pages in each pool; default enough for every row at
            ``max_len`` (``batch * ceil(max_len / page_size)``).
        """
        return self._empty_cache(batch, max_len, page_size=page_size, num_pages=num_pages)


class Encoder(_LM):
    """Bidirectional encoder (``config.layers`` with non-causal masks) with an LM head.

    Its layers' local span is ``radius`` (a band), not ``window``. Padded
    inputs via ``lengths`` (right padding) or ``segment_ids`` (packing too):
    padding never changes the outputs at real tokens.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self._init_embeddings(config, rngs)
        self.blocks = self._blocks(
            config.layers, causal=False, cross=None, rngs=rngs, name="layers"
        )

    def encode(self, tokens, *, lengths=None, segment_ids=None, positions=None):
        """The residual stream ``[B,T,D]`` after the last block (before the final norm).

        Arguments as ``__call__``.
        """
        tokens = inputs.check_tokens(tokens, vocab=self.config.vocab_size)
        return self._forward(
            self.blocks,
            tokens,
            positions=inputs.check_positions(positions, tokens),
            segment_ids=inputs.segments(tokens, lengths, segment_ids),
        )

    def __call__(self, tokens, *, lengths=None, segment_ids=None, positions=None):
        """Logits at every position.

        Args:
          tokens: ``[B,T]`` ints.
          lengths: ``[B]`` ints, real tokens per row (right padding), or None.
          segment_ids: ``[B,T]`` ints (packing and padding, id 0 is padding), or None.
          positions: ``[B,T]`` ints, default ``arange(T)``.

        Returns:
          ``logits [B,T,V]`` float32.
        """
        x = self.encode(tokens, lengths=lengths, segment_ids=segment_ids, positions=positions)
        return self._logits(x)


class EncoderDecoder(_LM):
    """Encoder (``config.encoder_layers``, bidirectional) + decoder (``config.layers``,
    causal, with cross-attention ``config.cross`` in every block). One embedding
    table serves both sides and the output head.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self._init_embeddings(config, rngs)
        if not config.encoder_layers:
            fail("config.encoder_layers", "at least one AttentionConfig", "()")
        self.encoder_blocks = self._blocks(
            config.encoder_layers, causal=False, cross=None, rngs=rngs, name="encoder_layers"
        )
        self.encoder_norm = self._norm(rngs)
        self.blocks = self._blocks(
            config.layers, causal=True, cross=config.cross, rngs=rngs, name="layers"
        )

    def encode(self, src, *, src_lengths=None):
        """Encoder output ``[B,S,D]`` and source segment ids ``[B,S]`` (1 real, 0 padding)."""
        src = inputs.check_tokens(src, "src", vocab=self.config.vocab_size)
        seg = inputs.segments(src, src_lengths, None, "src_lengths")
        x = self._forward(self.encoder_blocks, src, segment_ids=seg)
        seg = jnp.ones(src.shape, jnp.int32) if seg is None else seg
        return self.encoder_norm(x), seg

    def _memories(self, memory, seg) -> tuple:
        return tuple(block.cross.memory(memory, seg) for block in self.blocks)

    def __call__(self, src, tgt, *, src_lengths=None):
        """Logits of every target position given the source.

        Args:
          src: ``[B,S]`` ints; tgt: ``[B,T]`` ints (S and T independent).
          src_lengths: ``[B]`` real source tokens per row, or None.

        Returns:
          ``logits [B,T,V]`` float32.
        """
        memory, seg = self.encode(src, src_lengths=src_lengths)
        tgt = inputs.check_tokens(tgt, "tgt", vocab=self.config.vocab_size)
        if tgt.shape[0] != memory.shape[0]:
            fail("tgt", f"batch {memory.shape[0]} like src", tgt.shape)
        return self._logits(self._forward(self.blocks, tgt, memory=self._memories(memory, seg)))

    def init_cache(self, batch: int, max_len: int, *, src, src_lengths=None) -> DecodeCache:
        """Encodes the source and returns a ``DecodeCache`` holding its cross K/V.

        Args:
          batch: B, must equal ``src.shape[0]``.
          max_len: target tokens to decode (prompt + generated).
          src: ``[B,S]`` ints; src_lengths: ``[B]`` or None.
        """
        src = inputs.check_tokens(src, "src", vocab=self.config.vocab_size)
        if src.shape[0] != batch:
            fail("src", f"batch {batch}", src.shape)
        memory, seg = self.encode(src, src_lengths=src_lengths)
        return self._empty_cache(batch, max_len, cross=self._memories(memory, seg))
