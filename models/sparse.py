"""Sparse attention layers: MoBA, NSA and DSA as softmax layers that read a few blocks or tokens.

Each kind is a ``SelfAttention`` (projections, RoPE, masks, score modifiers,
soft-cap, sink logits) whose attention is one of ``attn.sparse``'s:

* ``moba`` (``MobaConfig``): ``attn.moba_attention``, no parameters of its own;
* ``nsa`` (``NSAConfig``): ``attn.nsa_attention``, with the branch gates
  ``sigmoid(x W_g)`` and the compression MLP (an intra-block position
  embedding, then two layers over a block's ``compress_block`` keys or values);
* ``dsa`` (``DSAConfig``): ``attn.indexed_topk_attention``, with the lightning
  indexer's projections. The indexer reads the layer's input detached (as
  DeepSeek-V3.2 trains it) and learns from its own loss alone
  (``attn.sparse.indexer_loss``, weight ``indexer_loss_weight``), which the
  layer adds to the gradient of whatever objective its output enters.

Decode caches keep the full keys and values at one slot per position, and
beside them what each method reads instead of all keys: MoBA each key's block
sum so far, summed as the forward pass sums a block (``attn.sparse.window_key_sums``),
NSA the compressed key and value of the block ending at each token (computed
once, when the block completes), DSA the indexer's key of each token. Prefill
and decode attend over the cache in position order, so blocks are cut as the
forward pass cut them: prefill in chunks and decoding equal the forward pass,
packed rows equal each sequence alone, and a paged cache equals a contiguous
one. The kinds never run as ring attention, and need a full cache (no
``window``: NSA has its own window branch).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

import attn
from attn.cache import EMPTY
from attn.checks import fail
from attn.sparse import compression_windows, indexer_loss
from models.cache import KVCache
from models.config import check_positive_float, check_positive_int, is_int, register_kind
from models.functions import probed_weights
from models.heads import dense, step_positions
from models.patterns import PresetSizes, register_preset
from models.softmax import SelfAttention, SoftmaxConfig


@dataclasses.dataclass(frozen=True)
class SparseConfig(SoftmaxConfig):
    """What the sparse kinds share: a softmax layer over a full cache.

    Attributes:
      chunk: queries per step of the sparse kernels (memory, not math).
    """

    chunk: int = 128

    def check_fields(self) -> None:
        super().check_fields()
        check_positive_int(self.chunk, "chunk")
        for name in ("window", "radius"):
            if getattr(self, name) is not None:
                fail(
                    name,
                    f"None for kind {self.kind!r} (its cache keeps every position)",
                    repr(getattr(self, name)),
                )
        if self.global_tokens or self.initial_tokens:
            fail("initial_tokens/global_tokens", f"none for kind {self.kind!r}", "some")
        if self.impl != "auto":
            fail("impl", f"'auto' for kind {self.kind!r} (it computes itself)", repr(self.impl))
        if self.score == "forgetting":
            fail("score", f"not 'forgetting' for kind {self.kind!r}", repr(self.score))


@dataclasses.dataclass(frozen=True)
class MobaConfig(SparseConfig):
    """MoBA (``attn.moba_attention``): each query head reads ``top_k`` blocks of ``block_size``."""

    kind: str = "moba"
    block_size: int = 16
    top_k: int = 3

    def check_fields(self) -> None:
        super().check_fields()
        check_positive_int(self.block_size, "block_size")
        check_positive_int(self.top_k, "top_k")


@dataclasses.dataclass(frozen=True)
class NSAConfig(SparseConfig):
    """NSA (``attn.nsa_attention``); ``branch_window`` is its window branch's span.

    Attributes:
      compress_hidden: hidden width of the compression MLP.
    """

    kind: str = "nsa"
    compress_block: int = 16
    compress_stride: int = 8
    select_block: int = 16
    num_selected: int = 4
    branch_window: int = 32
    initial_blocks: int = 1
    local_blocks: int = 1
    compress_hidden: int = 32

    def check_fields(self) -> None:
        super().check_fields()
        for name in (
            "compress_block",
            "compress_stride",
            "select_block",
            "num_selected",
            "branch_window",
            "compress_hidden",
        ):
            check_positive_int(getattr(self, name), name)
        if self.compress_stride > self.compress_block:
            fail(
                "compress_stride",
                f"at most compress_block={self.compress_block}",
                self.compress_stride,
            )
        for name in ("initial_blocks", "local_blocks"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "an int >= 0", repr(getattr(self, name)))


INDEXER_LOSSES = ("dense", "sparse")


@dataclasses.dataclass(frozen=True)
class DSAConfig(SparseConfig):
    """DSA (``attn.indexed_topk_attention``): each query reads its ``top_k`` tokens by the
    lightning indexer (``index_heads`` heads of ``index_dim``).

    Attributes:
      indexer_loss: ``"dense"``: the KL over every visible token (the paper's warm-up
        signal; it costs a dense pass of the main logits), or ``"sparse"``: over the
        selected tokens only.
      indexer_loss_weight: the loss's weight in the gradient.
    """

    kind: str = "dsa"
    top_k: int = 16
    index_heads: int = 4
    index_dim: int = 16
    indexer_loss: str = "dense"
    indexer_loss_weight: float = 1.0

    def check_fields(self) -> None:
        super().check_fields()
        for name in ("top_k", "index_heads", "index_dim"):
            check_positive_int(getattr(self, name), name)
        if self.indexer_loss not in INDEXER_LOSSES:
            fail("indexer_loss", f"one of {INDEXER_LOSSES}", repr(self.indexer_loss))
        check_positive_float(self.indexer_loss_weight, "indexer_loss_weight")


@jax.custom_vjp
def with_loss(out, loss):
    """``out``, whose backward pass also gives the scalar ``loss`` a cotangent of 1: the
    gradient of any objective ``out`` enters then includes ``grad(loss)``."""
    return out


def _with_loss_fwd(out, loss):
    return out, None


def _with_loss_bwd(_, g):
    return g, jnp.ones((), jnp.float32)


with_loss.defvjp(_with_loss_fwd, _with_loss_bwd)


def in_position_order(arrays: tuple, kv_pos):
    """Cached arrays ``[B,S,...]`` and their positions with the slots sorted by position
    (empty ones last): each row's tokens then form one run, as the sparse layouts need."""
    key = jnp.where(kv_pos == EMPTY, jnp.iinfo(jnp.int32).max, kv_pos)
    order = jnp.argsort(key, axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), 1)  # noqa: E731
    return tuple(take(x) for x in arrays), take(kv_pos)


def read_positions(cache, x, positions):
    """A cache payload ``x`` (``[B,S,...]``, or a paged pool) at ``positions [B,P]``: one
    slot per position (a full cache), or through the block tables (a paged one)."""
    if cache.paged:
        size = x.shape[1]
        pages = jnp.take_along_axis(cache.tables, positions // size, axis=1)
        return x[jnp.maximum(pages, 0), positions % size]
    return x[jnp.arange(x.shape[0])[:, None], positions]


@struct.dataclass
class MobaCache(KVCache):
    """A MoBA layer's keys and values, with each key's block sum so far.

    Attributes:
      ksum: ``[B,S,K,H]`` float32 (``attn.sparse.window_key_sums``).
    """

    ksum: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("k", "v", "ksum")


@struct.dataclass
class NSACache(KVCache):
    """An NSA layer's keys and values, with the compressed key and value of the block ending
    at each token (zeros where none ends).

    Attributes:
      ck, cv: ``[B,S,K,H]``.
    """

    ck: jax.Array
    cv: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("k", "v", "ck", "cv")


class SparseAttention(SelfAttention):
    """Base of the sparse kinds: whole-sequence and cached calls of ``_sparse``.

    A kind names the per-token arrays it computes from the layer input
    (``_token_arrays``: those of the queries, and those of the keys, which the
    cache stores) and its attention (``_sparse``).
    """

    def _on_ring(self, T: int) -> bool:
        return False

    def _token_arrays(self, x) -> tuple[tuple, tuple]:
        return (), ()

    def __call__(self, x, *, positions=None, segment_ids=None):
        B, T, _ = x.shape
        pos = jnp.arange(T, dtype=jnp.int32) if positions is None else positions
        pos = jnp.broadcast_to(pos, (B, T))
        q, k, v = self._qkv(x, pos)
        q_side, kv_side = self._token_arrays(x)
        rows = self._whole(pos, segment_ids)
        mod = self._score_mod(x)
        out = self._sparse(q, k, v, q_side, kv_side, training=True, score_mod=mod, **rows)
        if self.sow_weights:
            self._sow(self._weights(q, k, q_side, kv_side, score_mod=mod, **rows))
        return self._output(self._gated(out, x))

    def extend(self, x, cache: KVCache, start, lengths=None):
        positions = step_positions(start, x.shape[1])
        q, k, v = self._qkv(x, positions)
        q_side, kv_side = self._token_arrays(x)
        kept = self._kept(cache, k, v, start, positions)
        visible, kv_pos, cache = cache.extend((k, v, *kv_side, *kept), start, lengths)
        (keys, values, *rest), kv_pos = in_position_order(visible, kv_pos)
        kv_side, kept = tuple(rest[: len(kv_side)]), tuple(rest[len(kv_side) :])
        mod, rows = self._score_mod(x), self._cached(positions, kv_pos)
        out = self._sparse(q, keys, values, q_side, kv_side, training=False, kept=kept,
                           score_mod=mod, **rows)  # fmt: skip
        return self._output(self._gated(out, x)), cache

    def _kept(self, cache, k, v, start, positions) -> tuple:
        """What the cache keeps beside the keys for the new tokens ``[B,T,...]`` (none)."""
        return ()

    def _sparse(self, q, k, v, q_side, kv_side, *, training: bool, kept=None, **rows):
        """``out [B,T,N,E]``: the kind's attention of the call (``rows``: positions, segment
        ids, score modifier, named as ``attn.attention`` names them), with the layer's
        mask, soft-cap and sink logits; ``kept``: the cache's per-token summaries, in
        position order (None: computed from k, v)."""
        return self._attend(q, k, v, q_side, kv_side, training=training, kept=kept,
                            mask=self.cfg.mask(self.causal), softcap=self.cfg.softcap,
                            sink_logits=self._sinks(), **rows)  # fmt: skip

    def _weights(self, q, k, q_side, kv_side, **rows):
        fn = functools.partial(self._sparse, q_side=q_side, kv_side=kv_side, training=False)
        return probed_weights(fn, q, k, rows)


@register_kind("moba", config=MobaConfig, family="sparse")
class MobaAttention(SparseAttention):
    """MoBA: the softmax layer reading each query head's ``top_k`` blocks; its cache keeps
    each key's block sum so far (``MobaCache``)."""

    def init_cache(self, batch: int, max_len: int) -> MobaCache:
        cache = super().init_cache(batch, max_len)
        sums = jnp.zeros(cache.k.shape, jnp.float32)
        return MobaCache(cache.k, cache.v, sums, pos=cache.pos, pinned=cache.pinned,
                         ring=cache.ring)  # fmt: skip

    def _kept(self, cache, k, v, start, positions):
        """The new keys' block sums so far (``attn.sparse.window_key_sums``): slot i of new
        key t's block holds the key at position ``positions[t] - offset + i``, cached or
        new, up to t (empty after)."""
        bs, T = self.cfg.block_size, k.shape[1]
        before = start[:, None] - bs + 1 + jnp.arange(bs - 1)  # the bs - 1 positions before
        past = read_positions(cache, cache.k, jnp.maximum(before, 0)).astype(k.dtype)
        keys = jnp.concatenate([past, k], 1)  # [B, bs - 1 + T, K, H]
        slot, offset = jnp.arange(bs), (positions % bs)[..., None]  # offset [B,T,1]
        idx = jnp.arange(T)[None, :, None] - offset + slot + bs - 1  # into keys
        windows = keys[jnp.arange(k.shape[0])[:, None, None], jnp.maximum(idx, 0)]
        windows = jnp.where((slot <= offset)[..., None, None], windows, 0)
        return (attn.sparse.window_key_sums(windows),)

    def _attend(self, q, k, v, q_side, kv_side, *, training, kept, **call):
        cfg = self.cfg
        return attn.moba_attention(q, k, v, block_size=cfg.block_size, top_k=cfg.top_k,
                                   chunk=cfg.chunk, key_sums=kept[0] if kept else None,
                                   **call)  # fmt: skip


@register_kind("nsa", config=NSAConfig, family="sparse")
class NSAAttention(SparseAttention):
    """NSA: the softmax layer's q, k, v, with branch gates and a compression MLP.

    Parameters beside the softmax layer's: the gates ``[D, N*3]`` (+ bias), and per
    compressed keys and values an intra-block position embedding ``[l, H]`` and an MLP
    ``[l*H, hidden] -> [hidden, H]`` shared by the kv heads.
    """

    def __init__(self, cfg: NSAConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        l, H, hidden = cfg.compress_block, cfg.head_dim, cfg.compress_hidden
        self.gate_proj = linear(width, cfg.num_heads * 3, use_bias=True)
        init = nnx.initializers.normal(0.02)
        self.compress_pos = nnx.Param(init(rngs.params(), (2, l, H), param_dtype))
        self.compress_in = nnx.List([linear(l * H, hidden) for _ in range(2)])
        self.compress_out = nnx.List([linear(hidden, H) for _ in range(2)])

    def _token_arrays(self, x):
        B, T, _ = x.shape
        gates = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
        return (gates.reshape(B, T, self.cfg.num_heads, 3),), ()

    def init_cache(self, batch: int, max_len: int) -> NSACache:
        cache = super().init_cache(batch, max_len)
        zeros = jnp.zeros(cache.k.shape, self.dtype)
        return NSACache(cache.k, cache.v, zeros, zeros, pos=cache.pos, pinned=cache.pinned,
                        ring=cache.ring)  # fmt: skip

    def _phi(self, windows, i: int):
        """The compression MLP on blocks ``[..., l, K, H]`` of keys (``i = 0``) or values (1):
        ``[..., K, H]``."""
        windows = windows + self.compress_pos[...][i][:, None].astype(windows.dtype)
        *lead, l, K, H = windows.shape
        flat = jnp.moveaxis(windows, -3, -2).reshape(*lead, K, l * H)
        return self.compress_out[i](jax.nn.gelu(self.compress_in[i](flat)))

    def _compress(self, x, i: int, kv_positions, kv_segment_ids):
        """The compressed keys or values of ``x [B,S,K,H]`` in slot layout: ``[B,M,K,H]``."""
        cfg = self.cfg
        windows, _ = compression_windows(
            x, compress_block=cfg.compress_block, compress_stride=cfg.compress_stride,
            kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
        )  # fmt: skip
        return self._phi(windows, i)

    def _kept(self, cache, k, v, start, positions):
        """The compressed key and value of the block ending at each new token (zeros where
        none ends), from the block's keys: the cached ones, then the new."""
        l, d = self.cfg.compress_block, self.cfg.compress_stride
        T = k.shape[1]
        before = start[:, None] - l + 1 + jnp.arange(l - 1)  # the l - 1 positions before
        first = positions - l + 1  # each new token's block would start here
        ends = (first >= 0) & (first % d == 0)
        idx = jnp.arange(T)[:, None] + jnp.arange(l)  # [T,l] into (l - 1 cached, T new)
        out = []
        for i, (x, name) in enumerate(((k, "k"), (v, "v"))):
            past = read_positions(cache, getattr(cache, name), jnp.maximum(before, 0))
            windows = jnp.concatenate([past.astype(x.dtype), x], 1)[:, idx]  # [B,T,l,K,H]
            out.append(jnp.where(ends[..., None, None], self._phi(windows, i), 0.0))
        return tuple(out)

    def _attend(self, q, k, v, q_side, kv_side, *, training, kept, kv_positions=None,
                kv_segment_ids=None, **call):  # fmt: skip
        cfg = self.cfg
        (gates,) = q_side
        if kept:  # the cache's per-token compressed blocks, in slot layout
            ends = functools.partial(
                attn.sparse.compressed_at_ends, compress_block=cfg.compress_block,
                compress_stride=cfg.compress_stride, kv_positions=kv_positions,
                kv_segment_ids=kv_segment_ids,
            )  # fmt: skip
            ck, cv = (ends(x) for x in kept)
        else:
            ck = self._compress(k, 0, kv_positions, kv_segment_ids)
            cv = self._compress(v, 1, kv_positions, kv_segment_ids)
        return attn.nsa_attention(
            q,
            k,
            v,
            gates,
            ck,
            cv,
            compress_block=cfg.compress_block,
            compress_stride=cfg.compress_stride,
            select_block=cfg.select_block,
            num_selected=cfg.num_selected,
            window=cfg.branch_window,
            initial_blocks=cfg.initial_blocks,
            local_blocks=cfg.local_blocks,
            chunk=cfg.chunk,
            kv_positions=kv_positions,
            kv_segment_ids=kv_segment_ids,
            **call,
        )

    def _weights(self, *args, **rows):
        fail(
            "capture_weights",
            "a kind whose output is weights over tokens (NSA's compressed "
            "branch reads compressed blocks)",
            "kind 'nsa'",
        )


@struct.dataclass
class IndexedCache(KVCache):
    """A DSA layer's keys and values, with the lightning indexer's keys.

    Attributes:
      ik: ``[B,S,F]`` the indexer's key of each slot's token.
    """

    ik: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("k", "v", "ik")


@register_kind("dsa", config=DSAConfig, family="sparse")
class DSAAttention(SparseAttention):
    """DSA: the softmax layer reading each query's ``top_k`` tokens by the lightning indexer.

    Parameters beside the softmax layer's: the indexer's queries ``[D, I*F]``, keys
    ``[D, F]`` and head weights ``[D, I]``, all reading the layer input detached.
    """

    def __init__(self, cfg: DSAConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        I, F = cfg.index_heads, cfg.index_dim
        self.index_q = linear(width, I * F)
        self.index_k = linear(width, F)
        self.index_w = linear(width, I)

    def _token_arrays(self, x):
        B, T, _ = x.shape
        x = jax.lax.stop_gradient(x)
        iq = self.index_q(x).reshape(B, T, self.cfg.index_heads, self.cfg.index_dim)
        return (iq, self.index_w(x) * self.cfg.index_heads**-0.5), (self.index_k(x),)

    def init_cache(self, batch: int, max_len: int) -> IndexedCache:
        cache = super().init_cache(batch, max_len)
        S = cache.k.shape[1]
        ik = jnp.zeros((batch, S, self.cfg.index_dim), self.dtype)
        return IndexedCache(
            cache.k, cache.v, ik, pos=cache.pos, pinned=cache.pinned, ring=cache.ring
        )

    def _attend(self, q, k, v, q_side, kv_side, *, training, kept, **call):
        cfg = self.cfg
        (iq, iw), (ik,) = q_side, kv_side
        out = attn.indexed_topk_attention(
            q, k, v, iq, ik, iw, top_k=cfg.top_k, chunk=cfg.chunk, **call
        )
        if not training:
            return out
        top_k = None if cfg.indexer_loss == "dense" else cfg.top_k
        loss = indexer_loss(q, k, iq, ik, iw, top_k=top_k, chunk=cfg.chunk, **call)
        return with_loss(out, cfg.indexer_loss_weight * loss)


def _preset(config: type):
    def build(sizes: PresetSizes):
        return config(num_heads=sizes.num_heads, head_dim=sizes.head_dim)

    return build


register_preset(
    "moba", _preset(MobaConfig), description="MoBA: top-k blocks by q . mean key (Lu et al. 2025)"
)
register_preset(
    "nsa",
    _preset(NSAConfig),
    description="NSA: compressed, selected and window branches (Yuan et al. 2025)",
)
register_preset(
    "dsa",
    _preset(DSAConfig),
    description="DSA: top-k tokens by a lightning indexer (DeepSeek-V3.2)",
)
