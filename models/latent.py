"""``LatentAttention``: multi-head latent attention (DeepSeek-V2) with a latent decode cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn.checks import fail
from models.cache import LatentCache
from models.config import check_positive_int, is_int, register_kind
from models.heads import dense, step_positions
from models.masked import MaskedConfig, Softmax


@dataclasses.dataclass(frozen=True)
class LatentConfig(MaskedConfig):
    """A multi-head latent attention layer (kind ``"mla"``, DeepSeek-V2).

    Besides the mask fields (``MaskedConfig``; ``impl`` may not be ``"ring"``):

    Attributes:
      kv_rank: R, rank of the shared key/value latent (what the cache holds).
      q_rank: rank of the query latent, or None for a direct query projection.
      rope_head_dim: width of the decoupled RoPE key shared by all heads (and of
        each head's RoPE query part).
      nope_head_dim: per-head query/key channels without RoPE; None means H.
      v_head_dim: E, per-head value dim; None means H.

    MLA has no kv heads (keys are per head after the up-projection):
    ``num_kv_heads`` is None or N. Its positions live in the decoupled key;
    ``rope=False`` keeps that key and its query part unrotated (NoPE MLA: Kimi
    Linear's ``mla_use_nope``, where the layers between give the order).
    """

    kind: str = "mla"
    kv_rank: int = 16
    q_rank: int | None = None
    rope_head_dim: int = 4
    nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def check_fields(self) -> None:
        super().check_fields()
        check_positive_int(self.kv_rank, "kv_rank")
        check_positive_int(self.q_rank, "q_rank", allow_none=True)
        check_positive_int(self.nope_head_dim, "nope_head_dim", allow_none=True)
        check_positive_int(self.v_head_dim, "v_head_dim", allow_none=True)
        r = self.rope_head_dim
        if not is_int(r) or r < 2 or r % 2:
            fail("rope_head_dim", "an even int >= 2", repr(r))
        if self.num_kv_heads is not None and self.num_kv_heads != self.num_heads:
            # keys are per head after the up-projection: there are no kv heads to share
            fail("num_kv_heads", "None or num_heads for kind='mla'", repr(self.num_kv_heads))
        if self.impl == "ring":
            fail("impl", "not 'ring' for kind='mla' (ring is softmax's)", "'ring'")

    @property
    def qk_nope_dim(self) -> int:
        """Per-head query/key channels without RoPE."""
        return self.head_dim if self.nope_head_dim is None else self.nope_head_dim

    @property
    def value_dim(self) -> int:
        """E: per-head value dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@register_kind("mla", config=LatentConfig, family="softmax")
class LatentAttention(Softmax):
    """Multi-head latent attention (DeepSeek-V2).

    Keys and values of all heads are up-projected from one latent
    ``c_kv = norm(x W_dkv) [B,S,R]``; positions enter through a decoupled RoPE key
    ``k_rope [B,S,Hr]`` shared by the heads. Head n's key is
    ``[c_kv W_uk[:, n], k_rope]`` and its value ``c_kv W_uv[:, n]``; queries are
    ``[q_nope, rope(q_rope)]`` per head, from ``x`` directly or through a query
    latent of rank ``q_rank``.

    Two equal ways to compute it (``absorbed``), the two forms of
    ``attn.latent_attention``; this module owns the parameters, projections,
    RoPE and the cache:

    * naive: materialize per-head keys ``[B,S,N,Hn+Hr]`` and values ``[B,S,N,E]``
      and run MHA;
    * absorbed (decoding): the up-projections move to the query and output
      side. Scores are ``(q_nope W_uk^T) . c_kv + q_rope . k_rope``, i.e. MQA with
      one shared key ``[c_kv, k_rope]`` of width R + Hr and value ``c_kv``; the
      latent output ``[B,T,N,R]`` is up-projected by ``W_uv`` before the output
      projection. The cache holds only ``c_kv`` and ``k_rope``.

    The logit scale is ``1/sqrt(Hn + Hr)`` in both (the naive head dim).
    """

    def __init__(self, cfg: LatentConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=causal, dtype=dtype, param_dtype=param_dtype)
        N, R, Hr, Hn, E = (
            cfg.num_heads,
            cfg.kv_rank,
            cfg.rope_head_dim,
            cfg.qk_nope_dim,
            cfg.value_dim,
        )
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = functools.partial(nnx.RMSNorm, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.q_rank is None:
            self.q_proj = linear(width, N * (Hn + Hr))
            self.q_down = self.q_norm = self.q_up = None
        else:
            self.q_proj = None
            self.q_down = linear(width, cfg.q_rank)
            self.q_norm = norm(cfg.q_rank)
            self.q_up = linear(cfg.q_rank, N * (Hn + Hr))
        self.kv_down = linear(width, R + Hr)  # the latent and the shared RoPE key, one matmul
        self.kv_norm = norm(R)
        # Up-projections [R,N,H]: fan-in R, the latent axis.
        init = jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2)
        )
        self.w_uk = nnx.Param(init(rngs.params(), (R, N, Hn), param_dtype))
        self.w_uv = nnx.Param(init(rngs.params(), (R, N, E), param_dtype))
        self.o_proj = linear(N * E, width)
        self._init_output_gate(width, cfg.output_gate, E, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)  # fmt: skip

    @property
    def scale(self) -> float:
        return (self.cfg.qk_nope_dim + self.cfg.rope_head_dim) ** -0.5

    def _queries(self, x, positions):
        """q_nope ``[B,T,N,Hn]`` and rotated q_rope ``[B,T,N,Hr]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        direct = self.q_proj is not None
        h = self.q_proj(x) if direct else self.q_up(self.q_norm(self.q_down(x)))
        q = h.reshape(B, T, cfg.num_heads, cfg.qk_nope_dim + cfg.rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_dim], q[..., cfg.qk_nope_dim :]
        return q_nope, self._rope(q_rope, positions)

    def _latent(self, x, positions):
        """c_kv ``[B,T,R]`` (normalized) and the rotated shared key k_rope ``[B,T,Hr]``."""
        R = self.cfg.kv_rank
        h = self.kv_down(x)
        c_kv = self.kv_norm(h[..., :R])
        k_rope = self._rope(h[..., R:][:, :, None], positions)
        return c_kv, k_rope[:, :, 0]

    def _mla(self, q_nope, q_rope, c_kv, k_rope, *, form: str, impl: str, tap=False, **kwargs):
        """``attn.latent_attention`` with this layer's up-projections; ``out [B,T,N,E]``."""
        w_uk, w_uv = self.w_uk[...].astype(self.dtype), self.w_uv[...].astype(self.dtype)
        args = (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
        call = functools.partial(attn.latent_attention, form=form, scale=self.scale)
        return self._softmax(call, *args, impl=impl, tap=tap, **kwargs)

    def __call__(self, x, *, positions=None, segment_ids=None, absorbed: bool = False):
        """MLA over the whole sequence; arguments and result as ``SelfAttention.__call__``.

        ``absorbed`` picks the latent-space computation (same function).
        """
        rope_pos = jnp.arange(x.shape[1]) if positions is None else positions
        q_nope, q_rope = self._queries(x, rope_pos)
        c_kv, k_rope = self._latent(x, rope_pos)
        out = self._mla(
            q_nope,
            q_rope,
            c_kv,
            k_rope,
            form="absorbed" if absorbed else "naive",
            impl=self._impl(),
            tap=True,
            **self._whole(positions, segment_ids),
        )
        return self._output(self._gated(out, x))

    def init_cache(self, batch: int, max_len: int) -> LatentCache:
        """Empty ``LatentCache``: c_kv ``[B,S,R]``, k_rope ``[B,S,Hr]``."""
        cfg = self.cfg
        S, fields = self._slots(batch, max_len)
        return LatentCache(
            jnp.zeros((batch, S, cfg.kv_rank), self.dtype),
            jnp.zeros((batch, S, cfg.rope_head_dim), self.dtype),
            **fields,
        )

    def extend(self, x, cache: LatentCache, start, lengths=None):
        """As ``SelfAttention.extend``, attending in latent space (absorbed)."""
        positions = step_positions(start, x.shape[1])
        q_nope, q_rope = self._queries(x, positions)
        c_kv, k_rope = self._latent(x, positions)
        (all_c, all_r), kv_pos, cache = cache.extend((c_kv, k_rope), start, lengths)
        out = self._mla(
            q_nope,
            q_rope,
            all_c,
            all_r,
            form="absorbed",
            impl=self._impl(cached=True),
            **self._cached(positions, kv_pos),
        )
        return self._output(self._gated(out, x)), cache
