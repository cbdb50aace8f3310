"""Softmax attention layers: ``SelfAttention`` (MHA/GQA/MQA, any mask) and ``CrossAttention``.

``SoftmaxConfig`` is the self-attention kind's config: the mask fields every
softmax-family layer reads (``models.masked.MaskedConfig``) plus partial RoPE
and a score modifier. The modules derive from ``models.masked.Softmax``.

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

The plain call, the per-shard call and the ring call are one function,
``_attend``, whose keywords are ``attn.attention``'s (``q_segment_ids``,
``kv_segment_ids``, ...): the layer passes them by name down to ``attn``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

import attn
from attn import ring, scores
from attn.checks import fail
from models.cache import CrossCache, ForgetCache, KVCache
from models.config import check_bool, check_rotary, register_kind
from models.heads import Buffer, dense, step_positions
from models.masked import MaskedConfig, Softmax
from models.mesh import SEQ_AXIS, batch_axes, seq_devices, shard_rows

# A softmax layer's score modifiers (``attn.scores``): ALiBi's fixed slopes, T5's
# learned bucket table, the Forgetting Transformer's per-head forget gates.
SCORES = ("alibi", "t5", "forgetting")
# T5's bucketing (Raffel et al. 2020): 32 buckets, log-spaced up to 128 positions.
T5_BUCKETS = 32
T5_MAX_DISTANCE = 128
# FoX's forget-gate bias at initialization: sigmoid(4) = 0.98 per token, so the
# decay starts mild (a gate's product halves over ~35 tokens) and the layer
# starts close to plain softmax attention; training moves it per head.
FORGET_BIAS_INIT = 4.0


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig(MaskedConfig):
    """A softmax self-attention layer (kind ``"softmax"``): MHA, GQA, MQA, any mask.

    Attributes:
      rotary_dim: leading channels that rotate (partial RoPE); None means all H.
      score: a score modifier of the logits (``attn.scores``), or None:
        ``"alibi"`` (ALiBi's fixed per-head slopes, Press et al. 2022),
        ``"t5"`` (a learned bias per head and log-spaced distance bucket, T5),
        ``"forgetting"`` (FoX, Lin et al. 2025: a per-head forget gate
        ``sigmoid(x W_f + b_f)`` per token; the logit of key j for query i gets
        the sum of the log gates after j up to i). Usually with ``rope=False``:
        each is a position signal of its own. ``"forgetting"`` decodes with the
        running sum of the gates in its cache and cannot run sequence-parallel.
      qk_norm: an RMSNorm over each head's H channels of q and of k (one learned
        scale per channel, shared by the heads), before RoPE: Qwen3's and
        Qwen3-Next's. Those write the scale as ``1 + w`` with w starting at 0;
        ours starts at 1, the same function, and the same training where weight
        decay spares the norms' scales, as ``train.optimizer``'s does.
    """

    kind: str = "softmax"
    rotary_dim: int | None = None
    score: str | None = None
    qk_norm: bool = False

    def check_fields(self) -> None:
        check_rotary(self)
        super().check_fields()
        check_bool(self.qk_norm, "qk_norm")
        if self.score is not None and self.score not in SCORES:
            fail("score", f"one of {SCORES} or None", repr(self.score))
        if self.score == "forgetting" and self.impl == "ring":
            why = "FoX's running sum of gates runs in array order, which the ring's layout permutes"
            fail("impl", f"not 'ring' with score='forgetting' ({why})", repr(self.impl))


@register_kind("softmax", config=SoftmaxConfig, family="softmax", sequence_parallel=True)
class SelfAttention(Softmax):
    """Softmax self-attention: MHA (K == N), GQA (1 < K < N), MQA (K == 1), any mask.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``, optional sink
    logits ``[N]``. RoPE (``cfg.rope``) rotates q and k at their absolute positions.
    """

    def __init__(self, cfg: SoftmaxConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=causal, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self._init_output_gate(width, cfg.output_gate, cfg.head_dim, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self._init_score(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def _init_score(self, width: int, *, dtype, param_dtype, rngs):
        """The modifier's arrays: ALiBi's fixed slopes, T5's table, FoX's gate projection."""
        score, N = self.cfg.score, self.cfg.num_heads
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

    def _score_mod(self, x):
        """The layer's modifier for a call on ``x [B,T,D]``, or None."""
        if self.alibi_slopes is not None:
            return scores.alibi(self.alibi_slopes[...])
        if self.t5_table is not None:
            return scores.relative_bias(
                self.t5_table[...],
                num_buckets=T5_BUCKETS,
                max_distance=T5_MAX_DISTANCE,
                bidirectional=not self.causal,
            )
        if self.forget_proj is not None:
            return scores.forgetting(self._log_forget(x))
        return None

    def _log_forget(self, x):
        """FoX's per-token log forget gates ``[B,T,N]`` float32 (each < 0)."""
        return jax.nn.log_sigmoid(self.forget_proj(x).astype(jnp.float32))

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
        B, T, _ = x.shape
        q, k, v = self._qkv(x, jnp.arange(T) if positions is None else positions)
        mod = self._score_mod(x)
        if self.sow_weights:  # the tap needs the dense weights [B,N,T,S], unsharded
            out = self._softmax(self._attention, q, k, v, impl="auto", tap=True, score_mod=mod,
                                **self._whole(positions, segment_ids))  # fmt: skip
            return self._output(self._gated(out, x))
        on_ring, axes = self._on_ring(T), batch_axes(B)
        if on_ring and positions is None:  # the ring attends by the tokens' positions
            positions = jnp.arange(T, dtype=jnp.int32)
        if positions is not None and (on_ring or axes):  # split like the tokens
            positions = jnp.broadcast_to(positions, (B, T))
        mask, softcap = self.cfg.mask(self.causal), self.cfg.softcap
        if on_ring:
            # Tiles stop at a zigzag chunk (half a shard), so a tile never spans both chunks.
            shard = T // seq_devices()
            layout = "zigzag" if shard % 2 == 0 else "contiguous"
            blocks = ring.default_blocks(layout, shard, shard, None, None)
            local = functools.partial(_attend, mask=mask, softcap=softcap, ring_blocks=blocks)
            split = PartitionSpec(axes or None, SEQ_AXIS)
            run = functools.partial(shard_rows, local, split, {SEQ_AXIS, *axes})
        else:
            run = functools.partial(_attend, mask=mask, softcap=softcap, impl=self._impl(),
                                    fn=self._attention)  # fmt: skip
            if axes:
                run = functools.partial(shard_rows, run, PartitionSpec(axes), set(axes))
        out = run(q, k, v, sink_logits=self._sinks(), score_mod=mod,
                  **self._whole(positions, segment_ids))  # fmt: skip
        return self._output(self._gated(out, x))

    def _attention(self, q, k, v, **call):
        """The layer's attention call: ``attn.attention`` (a function kind's own function:
        ``models.functions``)."""
        return attn.attention(q, k, v, **call)

    def _on_ring(self, T: int) -> bool:
        """Whether this call runs as ring attention (see the module docstring).

        ``"auto"`` takes the ring when the context mesh's "seq" axis has several
        devices and they divide T (else XLA partitions the plain call); ``"ring"``
        takes it whenever there is a "seq" axis, and raises if it does not divide T.
        """
        impl, devices = self.cfg.impl, seq_devices()
        if impl not in ("auto", "ring") or devices is None:
            return False
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
            mod = self._score_mod(x)
        out = self._softmax(
            self._attention, q, keys, values, impl=self._impl(cached=True), score_mod=mod,
            **self._cached(positions, kv_pos),
        )  # fmt: skip
        return self._output(self._gated(out, x)), cache

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


def _attend(q, k, v, *, mask, softcap, impl: str = "auto", ring_blocks=None,
            fn=attn.attention, sink_logits=None, score_mod=None, q_positions=None,
            kv_positions=None, q_segment_ids=None, kv_segment_ids=None):  # fmt: skip
    """One call of a layer, as ``attn.attention`` names its arguments: ``fn``
    (``attn.attention``, or a function kind's), or with ``ring_blocks`` ``(block_q,
    block_k)`` ``attn.ring_attention`` over ``SEQ_AXIS``. The plain call, and the body of
    the per-shard and ring calls."""
    if ring_blocks is None:
        return fn(q, k, v, impl=impl, mask=mask, softcap=softcap, sink_logits=sink_logits,
                  score_mod=score_mod, q_positions=q_positions, kv_positions=kv_positions,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)  # fmt: skip
    block_q, block_k = ring_blocks
    return attn.ring_attention(
        q, k, v, axis_name=SEQ_AXIS, block_q=block_q, block_k=block_k, mask=mask,
        softcap=softcap, sink_logits=sink_logits, score_mod=score_mod, q_positions=q_positions,
        kv_positions=kv_positions, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
    )  # fmt: skip


class CrossAttention(Softmax):
    """Softmax cross-attention: T decoder queries over S encoder outputs (T != S).

    No RoPE and no mask (positions of two sequences are not comparable); source
    padding is hidden by segment ids (1 real, 0 padding). A query whose whole
    source is padding gets zeros.
    """

    def __init__(self, cfg: SoftmaxConfig, width: int, *, dtype, param_dtype, rngs):
        if cfg.score is not None:
            why = "positions of two sequences are not comparable"
            fail("cross.score", f"None for cross-attention ({why})", repr(cfg.score))
        self._init_softmax(cfg, causal=False, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self._init_output_gate(width, cfg.output_gate, cfg.head_dim, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)  # fmt: skip

    def memory(self, memory, segment_ids) -> CrossCache:
        """Keys and values ``[B,S,K,H]`` of the encoder output ``memory [B,S,D]``.

        Args:
          memory: ``[B,S,D]``; segment_ids: ``[B,S]`` ints, 1 real and 0 padding.
        """
        cfg = self.cfg
        B, S, _ = memory.shape
        return CrossCache(
            k=self._head_norm(
                self.k_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim), self.k_head_norm
            ),
            v=self.v_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim),
            segment_ids=segment_ids.astype(jnp.int32),
        )

    def __call__(self, x, memory: CrossCache):
        """Args: x ``[B,T,D]``; memory from ``memory()``. Returns ``y [B,T,D]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        q = self._head_norm(q, self.q_head_norm)
        out = self._softmax(
            attn.attention,
            q,
            memory.k,
            memory.v,
            impl=self._impl(cached=True),
            tap=True,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=memory.segment_ids,
        )
        return self._output(self._gated(out, x))
