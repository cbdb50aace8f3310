"""What the Pallas kernels share: the call's static configuration, its integer inputs,
the launch settings and the tile mask.

Internal to ``attn.pallas``. Arrays keep the project's layouts, padded to whole
blocks: q ``[B,Tp,N,H]``, k ``[B,Sp,K,H]``, v ``[B,Sp,K,E]``, out like q with E,
lse and the backward's row statistics ``[B,N,Tp]`` float32, positions and
segment ids ``[B,Tp]`` / ``[B,Sp]`` int32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn import masks, scores
from attn.checks import fail
from attn.softmax import pairs
from attn.softmax.call import MASKED, CallSpec
from attn.softmax.schedule import BlockSpec, Schedule


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Hashable settings of one call: a static argument of the custom VJP.

    The call's ``T`` and ``S`` are the real lengths (the arrays are padded
    past them) and ``block_q``/``block_k`` the forward and dq kernels' tiles,
    which the forward schedule is laid out in.
    """

    call: CallSpec
    block_q: int  # forward and dq kernels: query rows per program
    block_k: int  # forward and dq kernels: keys per inner-loop step
    bwd_block_q: int  # dk/dv kernel: query rows per inner-loop step
    bwd_block_k: int  # dk/dv kernel: keys per program
    platform: str  # lowered for: "cpu", "gpu" or "tpu" (not necessarily the host's)
    interpret: bool
    num_warps: int | None  # Triton launch of the forward kernel (None off a GPU)
    num_stages: int | None
    bwd_num_warps: int | None = None  # of the dq and dk/dv kernels (None: the forward's)
    bwd_num_stages: int | None = None

    def launch(self, backward: bool = False) -> tuple[int | None, int | None]:
        """``(num_warps, num_stages)`` of the forward kernel, or of the backward kernels."""
        if not backward:
            return self.num_warps, self.num_stages
        warps = self.num_warps if self.bwd_num_warps is None else self.bwd_num_warps
        stages = self.num_stages if self.bwd_num_stages is None else self.bwd_num_stages
        return warps, stages

    @property
    def blocks(self) -> BlockSpec:
        """The call in the forward and dq kernels' blocks (the ``by_query`` schedule's)."""
        return BlockSpec(self.call, self.block_q, self.block_k)

    @property
    def bwd_blocks(self) -> BlockSpec:
        """The call in the dk/dv kernel's blocks (the ``by_key`` schedule's)."""
        return BlockSpec(self.call, self.bwd_block_q, self.bwd_block_k)


class KernelInts(NamedTuple):
    """The integer inputs of the kernels; no gradient flows to them."""

    by_query: Schedule  # forward and dq: key blocks per query block
    by_key: Schedule  # dk/dv: query blocks per key block
    q_pos: jax.Array  # [B,Tp] int32
    kv_pos: jax.Array  # [B,Sp] int32
    q_seg: jax.Array | None  # [B,Tp] int32
    kv_seg: jax.Array | None  # [B,Sp] int32
    keep: jax.Array | None = None  # the boolean mask array as int8 in pair_layout


def flash_call(config: FlashConfig, kernel, name: str, grid, in_specs, out_specs, out_shape,
               backward: bool = False):  # fmt: skip
    """``pl.pallas_call`` of one of the kernels with the config's interpret mode and
    compiler parameters (the backward kernels' launch settings where ``backward``)."""
    return pl.pallas_call(
        functools.partial(kernel, config),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=config.interpret,
        compiler_params=compiler_params(config, backward),
        name=name,
    )


def row_inputs(config: FlashConfig, ints: KernelInts, q_rows, kv_rows) -> tuple[list, list]:
    """``(in_specs, arrays)`` of the kernels' per-row inputs, in the order they read them:
    the positions, then the segment ids if the call has them."""
    specs, arrays = [q_rows, kv_rows], [ints.q_pos, ints.kv_pos]
    if config.call.has_segments:
        specs, arrays = [*specs, q_rows, kv_rows], [*arrays, ints.q_seg, ints.kv_seg]
    return specs, arrays


# jax.export's platform names, and jax.default_backend()'s, to the kernels' platforms.
PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def interpret_mode(interpret: bool | None, platform: str, compiled: bool, what: str) -> bool:
    """Whether a kernel runs in Pallas's interpreter: as ``interpret`` says.

    None asks for the compiled kernel. Where none is compiled for ``platform``
    (``compiled`` False: a CPU, or a TPU kernel elsewhere) that is refused rather
    than interpreted in silence: the interpreter is 10 to 100x slower than the
    XLA forms ``impl="auto"`` picks, so it runs only when asked for.

    Raises:
      ValueError: ``interpret`` is None and only the interpreter runs ``what`` on
        ``platform``, naming ``interpret=True``.
    """
    if interpret is None:
        if not compiled:
            fail("interpret", f"True to run {what} on platform {platform!r}, where only Pallas's "
                 "interpreter runs it (10 to 100x slower than the XLA forms impl='auto' picks)",
                 None)  # fmt: skip
        return False
    return bool(interpret)


def compiler_params(config: FlashConfig, backward: bool = False):
    """Triton launch settings when lowering for a GPU (the forward kernel's, or with
    ``backward`` the dq and dk/dv kernels'); nothing elsewhere.

    Chosen by the platform lowered for, never by the host: on a CPU host
    exporting for ``cuda``, asking ``jax.default_backend()`` would leave the
    parameters None, which jax reads as Mosaic GPU, a different lowering that
    refuses these kernels.
    """
    if config.interpret or config.platform != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu  # loads Triton's lowering: GPU only

    num_warps, num_stages = config.launch(backward)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def allowed(mask: masks.Mask, q_pos, k_pos):
    """The mask on a tile: boolean ``[Q, J]`` from positions ``[Q]`` and ``[J]``."""
    return allowed_pairs(mask, q_pos[:, None], k_pos[None, :])


def allowed_pairs(mask: masks.Mask, q, k):
    """The mask on a tile from positions laid out against each other (``[Q, 1]`` and
    ``[1, J]``, or both ``[Q, J]``).

    The algebra's own jnp code, except that global tokens are compared one
    position at a time: their generic rule builds a ``[Q, J, P]`` array, whose
    size Triton would need to be a power of two (and Mosaic GPU has no layout for).
    """
    match mask:
        case masks.And(a, b):
            return allowed_pairs(a, q, k) & allowed_pairs(b, q, k)
        case masks.Or(a, b):
            return allowed_pairs(a, q, k) | allowed_pairs(b, q, k)
        case masks.GlobalTokens(positions):
            hits = [(q == p) | (k == p) for p in positions]
            return functools.reduce(jnp.logical_or, hits)
    return mask.pairs(q, k)


def tile_visible(config: FlashConfig, q_pos, k_pos, k_start, q_seg=None, k_seg=None):
    """Boolean ``[Q, J]``: mask, segment ids, and (where S is padded) the real keys."""
    ok = allowed(config.call.mask, q_pos, k_pos)
    if q_seg is not None:
        ok = ok & masks.same_segment(q_seg, k_seg)
    J = k_pos.shape[0]
    if config.call.S % J:  # the last key block holds padding
        index = k_start + lax.broadcasted_iota(jnp.int32, (1, J), 1)
        ok = ok & (index < config.call.S)
    return ok


def logits(config: FlashConfig, q, k):
    """Float32 ``scale * q k^T`` of a tile ``[Q,H] x [J,H] -> [Q,J]`` (before the modifier)."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s * config.call.scale


def modify(config: FlashConfig, s, views: dict, q_pos, k_pos):
    """A tile's logits ``[Q,J]`` through the call's modifier (the soft-cap included).

    Args:
      views: role -> the tile's leaves of that role (``attn.scores.ROLES``):
        head leaves ``[1, ...]``, q leaves ``[Q]``, k leaves ``[J]``.
      q_pos, k_pos: int32 ``[Q]``, ``[J]``.
    """
    if config.call.score is None:
        return s
    views = dict(
        head=views["head"], q=[x[:, None] for x in views["q"]], k=[x[None, :] for x in views["k"]]
    )
    return config.call.score.apply(s, q_pos[:, None], k_pos[None, :], views)


def modify_vjp(config: FlashConfig, s, views: dict, q_pos, k_pos):
    """``modify`` and its VJP: ``(x, vjp)``, ``vjp(dx) -> (ds, views' cotangents)``."""
    return jax.vjp(lambda s, views: modify(config, s, views, q_pos, k_pos), s, views)


def head_view(ref, *index):
    """A head leaf's tile view from its ref (block ``[..., 1, *rest]``) at leading ``index``.

    ``[1]`` without trailing axes; with one (a table), its entries loaded one
    by one as ``attn.scores.Entries`` (Triton cannot slice a loaded vector).
    """
    rest = ref.shape[len(index) + 1 :]
    if not rest:
        return ref[(*index, slice(None))]
    if len(rest) > 1:  # no modifier of attn.scores has one; a user's might
        fail("score_mod", "head leaves [N] or [N, entries] for impl='pallas'", f"[N, {rest}]")
    return scores.Entries(ref[(*index, 0, b)] for b in range(rest[0]))


def store_head(ref, value, *index):
    """Writes a head leaf's tile cotangent (``head_view``'s structure) to ``ref``."""
    if isinstance(value, scores.Entries):
        for b, x in enumerate(value.items):
            ref[(*index, 0, b)] = x
    else:
        ref[(*index, slice(None))] = value


def role_counts(config: FlashConfig) -> dict[str, int]:
    """How many leaves of each role the call's modifier has."""
    roles = () if config.call.score is None else config.call.score.roles
    return {role: roles.count(role) for role in scores.ROLES}


def take_views(config: FlashConfig, refs):
    """Splits a kernel's refs into the modifier's (``{role: [refs]}``) and the rest."""
    views = {}
    for role, n in role_counts(config).items():
        views[role], refs = list(refs[:n]), refs[n:]
    return views, refs


def score_leaves(config: FlashConfig, leaves, Tp: int, Sp: int) -> dict:
    """A modifier's leaves in the kernels' layouts, by role.

    Head leaves ``[N, ...]`` -> ``[N, 1, ...]``; q leaves ``[B,T,N]`` -> ``[B,N,Tp]``;
    k leaves ``[B,S,N]`` -> ``[B,N,Sp]`` (float32, zero-padded).
    """
    if config.call.score is None:
        return {role: [] for role in scores.ROLES}
    groups = config.call.score.by_role(leaves)

    def rows(x, length):
        x = x.astype(jnp.float32).transpose(0, 2, 1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])))

    return dict(
        head=[x.astype(jnp.float32).reshape(x.shape[0], 1, *x.shape[1:]) for x in groups["head"]],
        q=[rows(x, Tp) for x in groups["q"]],
        k=[rows(x, Sp) for x in groups["k"]],
    )


def masked_unless_full(config: FlashConfig, s, kind, visible):
    """``s`` with invisible entries at ``MASKED``; FULL tiles never evaluate the mask."""
    return lax.cond(
        kind == masks.BlockKind.FULL,
        lambda s: s,
        lambda s: jnp.where(visible(), s, MASKED),
        s,
    )


def matmul(a, b, contract=(1, 0)):
    """2-D float32-accumulated product contracting ``a``'s and ``b``'s given axes."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def mod_specs(mod: dict, head, q, k):
    """BlockSpecs of the modifier's leaves (``score_leaves``), in role order, and the leaves.

    Args:
      head: ``(rows, index_map)`` of head leaves ``[N, 1, ...]``: the block's head
        rows (None for one head) and the grid's head-block index.
      q, k: ``(block_shape, index_map)`` of the q ``[B,N,Tp]`` and k ``[B,N,Sp]`` leaves.
    """
    rows, head_index = head
    specs = []
    for x in mod["head"]:
        rest = (0,) * (x.ndim - 1)
        specs.append(pl.BlockSpec((rows, *x.shape[1:]), lambda *g, _r=rest: (head_index(*g), *_r)))
    specs += [pl.BlockSpec(*q) for _ in mod["q"]] + [pl.BlockSpec(*k) for _ in mod["k"]]
    return specs, [*mod["head"], *mod["q"], *mod["k"]]


def pair_layout(x, K: int, G: int, Tp: int, Sp: int, fill):
    """A pair array ``[B|1, N|1, T|1, S|1]`` (``attn.softmax.pairs``) as the kernels read it:
    padded to ``Tp`` and ``Sp`` and ``[B|1, K|1, G|1, Tp|1, Sp|1]``, never broadcast."""
    return pairs.grouped(pairs.padded(x, Tp, Sp, fill), K, G)


def pair_by_query(config: FlashConfig, x):
    """BlockSpec of a pair array on the grid ``(b, n, i)``: block ``[bq|1, Sp|1]``."""
    B, K, _, T, _ = x.shape
    G, bq = config.call.G, config.block_q

    def index(b, n, i):
        return (b if B > 1 else 0, n // G if K > 1 else 0, n % G if K > 1 else 0,
                i if T > 1 else 0, 0)  # fmt: skip

    return pl.BlockSpec((None, None, None, bq if T > 1 else 1, x.shape[-1]), index)


def pair_by_key(config: FlashConfig, x):
    """BlockSpec of a pair array on the grid ``(b, h, j)``: block ``[G|1, Tp|1, bk|1]``."""
    B, K, G, T, S = x.shape
    bk = config.bwd_block_k

    def index(b, h, j):
        return b if B > 1 else 0, h if K > 1 else 0, 0, 0, j if S > 1 else 0

    return pl.BlockSpec((None, None, G, T, bk if S > 1 else 1), index)


def pair_rows(ref, keys, shape):
    """A ``[Q, J]`` tile from a ``pair_by_query`` block ``[bq|1, Sp|1]`` at ``keys``."""
    return jnp.broadcast_to(ref[:, keys] if ref.shape[1] > 1 else ref[...], shape)


def pair_columns(ref, g, rows, shape):
    """A ``[Q, J]`` tile from a ``pair_by_key`` block ``[G|1, Tp|1, bk|1]``: head g, ``rows``."""
    G, T, _ = ref.shape
    return jnp.broadcast_to(ref[g if G > 1 else 0, rows if T > 1 else slice(None), :], shape)


def pair_count(config: FlashConfig) -> int:
    """How many pair arrays (bias, boolean mask) the kernels take."""
    return (config.call.bias_shape is not None) + (config.call.keep_shape is not None)


def take_pairs(config: FlashConfig, refs):
    """``(bias_ref or None, keep_ref or None, rest)`` from the head of ``refs``."""
    bias = keep = None
    if config.call.bias_shape is not None:
        bias, *refs = refs
    if config.call.keep_shape is not None:
        keep, *refs = refs
    return bias, keep, refs
