"""Softmax attention modules: ``SelfAttention`` (MHA/GQA/MQA, any mask) and ``CrossAttention``.

``Softmax`` is what softmax-based layers share (``LatentAttention`` too): the
layer's mask, soft-cap and learned sink logits around a call into ``attn``,
the weights tap, and the slot layout of their decode caches.

Sequence parallelism. ``SelfAttention`` runs as ring attention
(``attn.ring_attention``) when its config says ``impl="ring"``, or ``"auto"``
under a mesh whose axis ``models.mesh.SEQ_AXIS`` ("seq") has more than one
device (``models.mesh`` holds the policy: which axes split what). The mesh
is the one the caller set with ``jax.set_mesh(mesh)`` (read back while tracing
with ``jax.sharding.get_abstract_mesh()``), so no module holds a mesh and the
same model runs on one device or many. The layer wraps the ring in a
``jax.shard_map`` that is manual over "seq" only (``axis_names={"seq"}``): the
sequence axis T is split over "seq" and every other mesh axis stays automatic,
so a batch split over data or fsdp stays split without the layer naming those
axes. The ring sees the tokens' real ``positions`` and needs nothing else: the
caller may lay the sequence out in any order over the devices, and the zigzag
order of ``models.mesh.ring_layout`` balances causal work (train does it once per batch, on
the host). Without a mesh, or one without a "seq" axis, ``"ring"`` computes as
``"auto"``: impl never changes the math, so a model trained sequence-parallel
evaluates and decodes on one device.

Batch parallelism. Under a mesh with ``models.mesh.BATCH_AXES`` ("data", "fsdp"), each
device attends only its own rows: the call runs in a ``jax.shard_map`` manual
over those axes (and "seq" for the ring). XLA cannot split the blockwise
kernels' tile loops by itself (they index tiles that mix batch and heads), and
left to partition them it gathers the whole q, k and v on every device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

import attn
from attn import ring, scores
from attn.errors import fail
from models.cache import EMPTY, CrossCache, ForgetCache, KVCache
from models.config import MASK_FIELDS, T5_BUCKETS, T5_MAX_DISTANCE, AttentionConfig, register_kind
from models.heads import Buffer, Heads, cached_impl, dense, step_positions
from models.mesh import SEQ_AXIS, batch_axes, seq_devices, shard_rows

# FoX's forget-gate bias at initialization: sigmoid(4) = 0.98 per token, so the
# decay starts mild (a gate's product halves over ~35 tokens) and the layer
# starts close to plain softmax attention; training moves it per head.
FORGET_BIAS_INIT = 4.0


def _score_mod(args: dict, *, bidirectional: bool):
    """The layer's modifier from its arrays in ``args`` (``Softmax._score_args``), or None."""
    if "slopes" in args:
        return scores.alibi(args["slopes"])
    if "table" in args:
        return scores.relative_bias(
            args["table"],
            num_buckets=T5_BUCKETS,
            max_distance=T5_MAX_DISTANCE,
            bidirectional=bidirectional,
        )
    if "log_forget" in args:
        return scores.forgetting(args["log_forget"])
    return None


def _plain_impl(impl: str) -> str:
    """``attn.attention``'s impl for a call that does not run on the ring."""
    return "auto" if impl == "ring" else impl


class Softmax(Heads):
    """Base of softmax layers: mask, soft-cap, sink logits, the weights tap, cache slots."""

    def _init_softmax(self, cfg: AttentionConfig, *, causal: bool, dtype, param_dtype):
        self._init_heads(cfg, causal=causal, dtype=dtype)
        self.sink_logits = (
            nnx.Param(jnp.zeros((cfg.num_heads,), param_dtype)) if cfg.sink_logits else None
        )

    def _init_score(self, width: int, *, dtype, param_dtype, rngs):
        """The modifier's arrays: ALiBi's fixed slopes, T5's table, FoX's gate projection."""
        cfg, N = self.cfg, self.cfg.num_heads
        score = getattr(cfg, "score", None)
        slopes = jnp.asarray(scores.alibi_slopes(N))
        self.alibi_slopes = Buffer(slopes) if score == "alibi" else None
        # T5 learns its table; a small random start makes every bucket differ.
        self.t5_table = (
            nnx.Param(0.1 * jax.random.normal(rngs.params(), (N, T5_BUCKETS), param_dtype))
            if score == "t5"
            else None
        )
        self.forget_proj = (
            dense(
                width, N, dtype=dtype, param_dtype=param_dtype, rngs=rngs, use_bias=True,
                bias_init=nnx.initializers.constant(FORGET_BIAS_INIT),
            )
            if score == "forgetting"
            else None
        )  # fmt: skip

    def _score_args(self, x) -> dict:
        """The modifier's arrays for a call on ``x [B,T,D]``: slopes, table or log gates."""
        if self.alibi_slopes is not None:
            return {"slopes": self.alibi_slopes[...]}
        if self.t5_table is not None:
            return {"table": self.t5_table[...]}
        if self.forget_proj is not None:
            return {"log_forget": self._log_forget(x)}
        return {}

    def _log_forget(self, x):
        """FoX's per-token log forget gates ``[B,T,N]`` float32 (each < 0)."""
        return jax.nn.log_sigmoid(self.forget_proj(x).astype(jnp.float32))

    def _softmax(self, fn, *args, impl: str, tap: bool = False, **kwargs):
        """``fn(*args, ...)`` (``attn.attention`` or ``attn.latent_attention``) with this
        layer's mask, soft-cap and learned sink logits; returns ``out [B,T,N,E]``.

        With ``tap`` and ``sow_weights`` it also sows the weights ``[B,N,T,S]``:
        only the dense implementation materializes them, so the tapped call uses
        it (every implementation computes the same function).
        """
        kwargs["mask"] = self.cfg.mask(self.causal)
        if kwargs.get("score_mod") is None:
            kwargs.pop("score_mod", None)
        if self.cfg.softcap is not None:
            kwargs["softcap"] = self.cfg.softcap
        if self.sink_logits is not None:
            kwargs["sink_logits"] = self.sink_logits[...]
        if tap and self.sow_weights:
            out, weights = fn(*args, impl="dense", return_weights=True, **kwargs)
            self._sow(weights)
            return out
        return fn(*args, impl=impl, **kwargs)

    @staticmethod
    def _full_kwargs(positions, segment_ids) -> dict:
        """Position and segment arguments of a whole-sequence call (none when default,
        so positionless implementations such as jax.nn's stay eligible)."""
        kw = {}
        if positions is not None:
            kw.update(q_positions=positions, kv_positions=positions)
        if segment_ids is not None:
            kw.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        return kw

    @staticmethod
    def _cached_kwargs(positions, kv_pos) -> dict:
        """Cached calls see slots by their stored positions; empty slots by segment id 0."""
        return dict(
            q_positions=positions,
            kv_positions=kv_pos,
            q_segment_ids=jnp.ones(positions.shape, jnp.int32),
            kv_segment_ids=(kv_pos != EMPTY).astype(jnp.int32),
        )

    def _slots(self, batch: int, max_len: int) -> tuple[int, dict]:
        """``(S, SlotCache fields)`` of an empty cache: S from ``cfg.cache_layout(max_len)``."""
        S, pinned = self.cfg.cache_layout(max_len)
        # A window's ring buffer when it is shorter than max_len; else one slot per position.
        fields = dict(pos=jnp.full((batch, S), EMPTY, jnp.int32), pinned=pinned, ring=max_len > S)
        return S, fields


@register_kind(
    "softmax",
    fields=(*MASK_FIELDS, "rotary_dim", "score"),
    family="softmax",
    sequence_parallel=True,
)
class SelfAttention(Softmax):
    """Softmax self-attention: MHA (K == N), GQA (1 < K < N), MQA (K == 1), any mask.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``, optional sink
    logits ``[N]``. RoPE (``cfg.rope``) rotates q and k at their absolute positions.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=causal, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self._init_score(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, positions=None, segment_ids=None):
        """Self-attention over the whole sequence.

        Args:
          x: ``[B,T,D]``.
          positions: ``[B,T]`` ints (default ``arange(T)``), for RoPE and the mask.
          segment_ids: ``[B,T]`` ints; tokens attend within their segment (packing;
            id 0 is padding).

        Returns:
          ``y [B,T,D]``.
        """
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]) if positions is None else positions)
        score_args = self._score_args(x)
        if self._on_ring(x.shape[1]):
            return self._output(self._ring(q, k, v, positions, segment_ids, score_args))
        impl = _plain_impl(self.cfg.impl)
        axes = () if self.sow_weights else batch_axes(x.shape[0])
        if not axes:
            kwargs = self._full_kwargs(positions, segment_ids)
            mod = _score_mod(score_args, bidirectional=not self.causal)
            out = self._softmax(
                attn.attention, q, k, v, impl=impl, tap=True, score_mod=mod, **kwargs
            )
            return self._output(out)
        local = functools.partial(
            _attention_shard,
            mask=self.cfg.mask(self.causal),
            softcap=self.cfg.softcap,
            impl=impl,
            bidirectional=not self.causal,
        )
        args = self._shard_args(q, k, v, positions, segment_ids, score_args)
        return self._output(shard_rows(local, args, PartitionSpec(axes), set(axes)))

    def _shard_args(self, q, k, v, positions, segment_ids, score_args) -> dict:
        """The arrays of a call run per shard: q, k, v; pos, seg, sink and the modifier's."""
        args = {"q": q, "k": k, "v": v, **score_args}
        if positions is not None:
            args["pos"] = jnp.broadcast_to(positions, q.shape[:2])
        if segment_ids is not None:
            args["seg"] = segment_ids
        if self.sink_logits is not None:
            args["sink"] = self.sink_logits[...]
        return args

    def _on_ring(self, T: int) -> bool:
        """Whether this call runs as ring attention (see the module docstring).

        ``"auto"`` takes the ring when the context mesh's "seq" axis has several
        devices and they divide T (else XLA partitions the plain call); ``"ring"``
        takes it whenever there is a "seq" axis, and raises if it does not divide T.
        """
        impl, devices = self.cfg.impl, seq_devices()
        if self.sow_weights or impl not in ("auto", "ring") or devices is None:
            return False  # (the weights tap needs the dense weights [B,N,T,S])
        if self.cfg.score == "forgetting":  # its gate sums run in array order (config refuses ring)
            return False
        if impl == "auto":
            return devices > 1 and T % devices == 0
        if T % devices:
            fail(
                "x",
                f"a sequence length T divisible by the {devices} devices of mesh axis "
                f"{SEQ_AXIS!r} (impl='ring')",
                f"T={T}",
            )
        return True

    def _ring(self, q, k, v, positions, segment_ids, score_args):
        """``out [B,T,N,H]``: ring attention with T split over the context mesh's "seq" axis.

        Args:
          q: ``[B,T,N,H]``; k, v: ``[B,T,K,H]``, in the sequence's layout order.
          positions: ``[B,T]`` the tokens' positions (None: ``arange(T)``, the
            contiguous layout); segment_ids: ``[B,T]`` or None.
        """
        B, T = q.shape[:2]
        devices = seq_devices()
        if positions is None:
            positions = jnp.arange(T, dtype=jnp.int32)
        args = self._shard_args(q, k, v, positions, segment_ids, score_args)
        # Tiles stop at a zigzag chunk (half a shard), so a tile never spans both chunks.
        shard = T // devices
        layout = "zigzag" if shard % 2 == 0 else "contiguous"
        block_q, block_k = ring.default_blocks(layout, shard, shard, None, None)
        local = functools.partial(
            _ring_shard,
            mask=self.cfg.mask(self.causal),
            softcap=self.cfg.softcap,
            block_q=block_q,
            block_k=block_k,
            bidirectional=not self.causal,
        )
        axes = batch_axes(B)
        return shard_rows(local, args, PartitionSpec(axes or None, SEQ_AXIS), {SEQ_AXIS, *axes})

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Empty ``KVCache``: k, v ``[B,S,K,H]`` with S from ``cfg.cache_layout(max_len)``
        (a ``ForgetCache`` for FoX, which also keeps its gates' running sums)."""
        cfg = self.cfg
        S, fields = self._slots(batch, max_len)
        zeros = functools.partial(jnp.zeros, (batch, S, cfg.kv_heads, cfg.head_dim), self.dtype)
        if self.forget_proj is not None:
            N = cfg.num_heads
            sums = jnp.zeros((batch, S, N), jnp.float32), jnp.zeros((batch, N), jnp.float32)
            return ForgetCache(zeros(), zeros(), *sums, **fields)
        return KVCache(zeros(), zeros(), **fields)

    def extend(self, x, cache: KVCache, start, lengths=None):
        """Attends T new tokens to the cache and themselves, and stores them.

        Args:
          x: ``[B,T,D]``; cache: ``KVCache``; start: ``[B]`` position of ``x[:, 0]``.
          lengths: ``[B]`` real tokens per row, or None (all T).

        Returns:
          ``(y [B,T,D], KVCache)``.
        """
        positions = step_positions(start, x.shape[1])
        q, k, v = self._qkv(x, positions)
        if isinstance(cache, ForgetCache):
            (keys, values), kv_pos, cache, mod = self._extend_forget(x, k, v, cache, start, lengths)
        else:
            (keys, values), kv_pos, cache = cache.extend((k, v), start, lengths)
            mod = _score_mod(self._score_args(x), bidirectional=not self.causal)
        kwargs = self._cached_kwargs(positions, kv_pos)
        impl = cached_impl(_plain_impl(self.cfg.impl))
        out = self._softmax(attn.attention, q, keys, values, impl=impl, score_mod=mod, **kwargs)
        return self._output(out), cache

    def _extend_forget(self, x, k, v, cache: ForgetCache, start, lengths):
        """Stores FoX's new keys with their gate sums; returns them and the call's modifier.

        The new tokens' sums continue the row's total; tokens past ``lengths``
        (not stored) add no gate, so the total stays that of the stored tokens.
        """
        T = x.shape[1]
        log_f = self._log_forget(x)
        if lengths is not None:
            log_f = jnp.where(jnp.arange(T)[None, :, None] < lengths[:, None, None], log_f, 0.0)
        c = cache.total[:, None] + jnp.cumsum(log_f, axis=1)  # [B,T,N]
        (keys, values, c_kv), kv_pos, cache = cache.extend((k, v, c), start, lengths)
        cache = cache.replace(total=c[:, -1])
        return (keys, values), kv_pos, cache, scores.Forgetting(c, c_kv)


def _attention_shard(args: dict, *, mask, softcap, impl: str, bidirectional: bool):
    """One device's ``attn.attention`` on its rows of ``args`` (q, k, v; pos, seg, sink,
    the modifier's arrays)."""
    pos, seg = args.get("pos"), args.get("seg")
    kwargs = {} if pos is None else dict(q_positions=pos, kv_positions=pos)
    mod = _score_mod(args, bidirectional=bidirectional)
    if mod is not None:
        kwargs["score_mod"] = mod
    if seg is not None:
        kwargs.update(q_segment_ids=seg, kv_segment_ids=seg)
    if softcap is not None:
        kwargs["softcap"] = softcap
    if "sink" in args:
        kwargs["sink_logits"] = args["sink"]
    return attn.attention(args["q"], args["k"], args["v"], mask=mask, impl=impl, **kwargs)


def _ring_shard(args: dict, *, mask, softcap, block_q: int, block_k: int, bidirectional: bool):
    """One device's ``attn.ring_attention`` on its shard of ``args`` (q, k, v, pos; seg, sink,
    ALiBi's or T5's arrays)."""
    return attn.ring_attention(
        args["q"],
        args["k"],
        args["v"],
        axis_name=SEQ_AXIS,
        mask=mask,
        q_positions=args["pos"],
        kv_positions=args["pos"],
        q_segment_ids=args.get("seg"),
        kv_segment_ids=args.get("seg"),
        softcap=softcap,
        score_mod=_score_mod(args, bidirectional=bidirectional),
        sink_logits=args.get("sink"),
        block_q=block_q,
        block_k=block_k,
    )


class CrossAttention(Softmax):
    """Softmax cross-attention: T decoder queries over S encoder outputs (T != S).

    No RoPE and no mask (positions of two sequences are not comparable); source
    padding is hidden by segment ids (1 real, 0 padding). A query whose whole
    source is padding gets zeros.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, dtype, param_dtype, rngs):
        if cfg.score is not None:
            why = "positions of two sequences are not comparable"
            fail("cross.score", f"None for cross-attention ({why})", repr(cfg.score))
        self._init_softmax(cfg, causal=False, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def memory(self, memory, segment_ids) -> CrossCache:
        """Keys and values ``[B,S,K,H]`` of the encoder output ``memory [B,S,D]``.

        Args:
          memory: ``[B,S,D]``; segment_ids: ``[B,S]`` ints, 1 real and 0 padding.
        """
        cfg = self.cfg
        B, S, _ = memory.shape
        return CrossCache(
            k=self.k_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim),
            v=self.v_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim),
            segment_ids=segment_ids.astype(jnp.int32),
        )

    def __call__(self, x, memory: CrossCache):
        """Args: x ``[B,T,D]``; memory from ``memory()``. Returns ``y [B,T,D]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        out = self._softmax(
            attn.attention,
            q,
            memory.k,
            memory.v,
            impl=cached_impl(_plain_impl(cfg.impl)),
            tap=True,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=memory.segment_ids,
        )
        return self._output(out)
