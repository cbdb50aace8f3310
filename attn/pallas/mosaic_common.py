"""What the Mosaic GPU kernels share: the call's settings, the launch and the program.

Internal to ``attn.pallas``'s Mosaic GPU attention (``mosaic``, ``mosaic_forward``,
``mosaic_backward``). Every Hopper kernel is one ``program``: a schedule row of blocks
streamed through shared memory into consumers that each hold their own block.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn.softmax.call import CallSpec

# A schedule row (per block: its count, W blocks, W kinds) padded to whole 128-byte rows:
# a TMA copy moves a multiple of the warpgroup's 128 threads' bytes.
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
ROW_ALIGN = 32
COPIES = 6  # the most copies into a slot (dq's: q, dO, positions, segment ids, lse, D)
PRODUCER_REGISTERS = 40  # the TMA warpgroup's registers a thread; the consumers share the rest


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Hashable settings of one call (what the kernels are traced with)."""

    call: CallSpec
    block_q: int
    block_k: int
    stages: int  # key blocks in flight in the Hopper kernel's pipeline
    interpret: bool  # the twin under the interpreter, else the Hopper kernel
    # Consumer warpgroups per program beside a TMA producer warpgroup (0: one warpgroup that
    # pipelines its own copies); each takes its own block_q rows (block_k keys in dk/dv).
    consumers: int = 0
    width: int = 0  # the forward's and dq's schedule (per program's rows): key blocks
    width_k: int = 0  # the dk/dv schedule (per program's keys): query blocks

    @property
    def slots(self) -> int:
        """The warpgroups that compute in a program, each in its own shared-memory slots."""
        return max(self.consumers, 1)

    @property
    def program_rows(self) -> int:
        """The forward's and dq's query rows per program: ``block_q`` a slot."""
        return self.block_q * self.slots

    @property
    def program_keys(self) -> int:
        """The dk/dv kernel's keys per program: ``block_k`` a slot."""
        return self.block_k * self.slots

    @property
    def padded(self) -> tuple[int, int]:
        """``(Tp, Sp)``: T and S padded to whole programs."""
        return round_up(self.call.T, self.program_rows), round_up(self.call.S, self.program_keys)

    @property
    def approx(self) -> bool:
        """Whether the Hopper kernels take the fast ``ex2``/``lg2`` (a few ulp of float32);
        not with a soft-cap, whose ``tanh`` it would take too (about 2^-11)."""
        return self.call.softcap is None

    @property
    def segments(self) -> bool:
        """Whether the kernels read segment ids: the call's, or ones marking S's padding."""
        return self.call.has_segments or self.call.S % self.program_keys != 0


def take_rows(config: MosaicConfig, refs, sink: bool = False):
    """``(q_seg_ref, kv_seg_ref, sink_ref, rest)`` from a kernel's refs after its positions:
    the segment ids where the kernels read them, the sink logits (with ``sink``) where the
    call has them, each None where not."""
    q_seg = kv_seg = sink_ref = None
    if config.segments:
        q_seg, kv_seg, *refs = refs
    if sink and config.call.has_sink:
        sink_ref, *refs = refs
    return q_seg, kv_seg, sink_ref, refs


def sink_rows(sink):
    """Sink logits ``[N]`` as ``[N, ROW_ALIGN]`` float32: one TMA-sized row per head."""
    return jnp.pad(sink.astype(jnp.float32).reshape(-1, 1), ((0, 0), (0, ROW_ALIGN - 1)))


def swizzle():
    """Shared-memory tiles of 16-bit elements in 128-byte swizzled rows: wgmma's operands."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def kernel(body, out_shape, scratch, grid, approx: bool = False, **kwargs):
    """``plgpu.kernel`` over the grid ``(batch, head, block)`` (axis names ``b``, ``h``,
    ``i``), under the lane lowering
    (the default of jax 0.10; jax 0.11's is the warpgroup one), with the output and
    scratch keywords of the installed jax (``out_type``/``scratch_types`` from 0.10.2);
    ``approx`` takes the fast transcendentals."""
    names = inspect.signature(plgpu.kernel).parameters
    out_kw, scratch_kw = (
        ("out_type", "scratch_types") if "out_type" in names else ("out_shape", "scratch_shapes")
    )
    params = plgpu.CompilerParams(
        approx_math=approx, lowering_semantics=plgpu.LoweringSemantics.Lane
    )
    return plgpu.kernel(body, **{out_kw: out_shape, scratch_kw: scratch}, grid=grid,
                        grid_names=("b", "h", "i"), compiler_params=params, **kwargs)  # fmt: skip


def load(ref, layout):
    """A whole shared-memory vector into registers in ``layout`` (jax 0.10's ``plgpu.load``
    needs the index ``()``, which jax 0.11 deprecates)."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def interpreter():
    """Pallas's Mosaic GPU interpreter (jax 0.10 keeps it private)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def copy_in(copies, bar, first=0) -> None:
    """Every ``(gmem, smem)`` copy started on its own barrier (``bar``'s from ``first``
    on), then all awaited."""
    for j, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[first + j])
    for j in range(len(copies)):
        plgpu.barrier_wait(bar.at[first + j])


def product(a_smem, b_smem, shape, issued=None):
    """float32 ``a b^T`` of two shared-memory tiles on wgmma (``[M, K] x [N, K] -> [M, N]``);
    ``issued()`` runs between issuing the wgmma and waiting for it."""

    def run(ref):
        plgpu.wgmma(ref, a_smem, b_smem.transpose((1, 0)))
        if issued is not None:
            issued()
        return ref[...]  # reading the accumulator waits for the wgmma

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, b_smem):
    """``acc + a b`` on wgmma: ``a`` ``[M, K]`` from registers (cast to ``b``'s dtype),
    ``b`` ``[K, N]`` a shared-memory tile, ``acc`` float32 ``[M, N]`` in wgmma's layout."""
    mma = lambda ref: plgpu.wgmma(ref, a.astype(b_smem.dtype), b_smem)  # noqa: E731
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def dot(a, b, contract):
    """float32-accumulated product of two 2-D arrays contracting the axes ``contract``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def scheduled(count, width: int, step, carry):
    """``step`` over the first ``count`` of a schedule row's ``width`` slots (the
    interpreter takes static trip counts only)."""
    visit = lambda t, c: lax.cond(t < count, functools.partial(step, t), lambda c: c, c)  # noqa: E731
    return lax.fori_loop(0, width, visit, carry)


def key_stream(config: MosaicConfig, k_ref, v_ref, kv_pos_ref, kv_seg_ref, table_smem):
    """``(specs, sources)``: the scheduled key blocks of K, V, their positions and (where
    read) segment ids, as the inputs of a pipeline over a schedule row (grid axes ``b``,
    ``h`` the query head)."""
    bk, call = config.block_k, config.call
    b, kv = lax.axis_index("b"), lax.axis_index("h") // call.G
    key_block = lambda t: (table_smem[1 + t], 0)  # noqa: E731
    key_vector = lambda t: (table_smem[1 + t],)  # noqa: E731
    specs = [
        plgpu.BlockSpec((bk, k_ref.shape[-1]), key_block, transforms=swizzle()),
        plgpu.BlockSpec((bk, v_ref.shape[-1]), key_block, transforms=swizzle()),
        plgpu.BlockSpec((bk,), key_vector),
    ]
    sources = [k_ref.at[b, :, kv, :], v_ref.at[b, :, kv, :], kv_pos_ref.at[b]]
    if config.segments:
        specs.append(plgpu.BlockSpec((bk,), key_vector))
        sources.append(kv_seg_ref.at[b])
    return specs, sources


def launch(config: MosaicConfig, twin, hopper, scratch, out_shape, grid, args):
    """The twin under the interpreter, or the Hopper kernel (with a producer warpgroup and
    ``config.consumers`` consumers where specialised), on ``args``."""
    if config.interpret:
        return kernel(functools.partial(twin, config), out_shape, [], grid,
                      interpret=interpreter())(*args)  # fmt: skip
    threads = dict(num_threads=config.consumers + 1, thread_name="wg") if config.consumers else {}
    body = functools.partial(hopper, config)
    return kernel(body, out_shape, scratch, grid, approx=config.approx, **threads)(*args)


def slot_scratch(config: MosaicConfig, rows: int, widths, dtype, table_width: int, vectors):
    """A backward kernel's shared memory: per slot one swizzled ``[rows, width]`` tile of
    ``dtype`` for each of ``widths`` and one ``[rows]`` vector for each dtype of
    ``vectors``; the schedule row; the copy barriers."""
    C = config.slots
    return [
        *[plgpu.SMEM((C, rows, w), dtype, transforms=swizzle()) for w in widths],
        plgpu.SMEM((table_width,), jnp.int32),
        *[plgpu.SMEM((C, rows), vector) for vector in vectors],
        barriers(config),
    ]


def barriers(config: MosaicConfig):
    """A Hopper kernel's copy barriers: the schedule row's, then ``COPIES`` a slot."""
    return plgpu.Barrier(num_barriers=1 + COPIES * config.slots)


def slot_of(config: MosaicConfig):
    """The computing warpgroup's slot: its ``wg`` index where specialised, else 0."""
    return lax.axis_index("wg") if config.consumers else 0


def slot_in(copies, bar, slot) -> None:
    """A slot's own copies in (on its ``COPIES`` barriers after the schedule row's)."""
    copy_in(copies, bar, first=1 + COPIES * slot)


def program(config: MosaicConfig, table, bar, stream, step, start, finish, tail=()):
    """One program of a Hopper kernel.

    Its schedule row comes into shared memory (``table``: the gmem and smem refs), then each
    slot's ``start(slot)`` brings its own block in and returns its carry, ``step(index, *refs,
    carry) -> carry`` runs over the row's blocks (times ``tail``) as ``stream = (specs,
    sources)`` brings them in, and ``finish(slot, carry)`` writes the slot out. Specialised,
    a producer warpgroup streams the blocks into ``config.stages`` slots and each consumer
    warpgroup computes; else one warpgroup pipelines its own copies.
    """
    (table_ref, table_smem), (specs, sources) = table, stream
    i = lax.axis_index("i")
    kwargs = dict(in_specs=specs, max_concurrent_steps=config.stages)
    if not config.consumers:
        copy_in([(table_ref.at[i], table_smem)], bar)
        grid = (table_smem[0], *tail)
        carry = plgpu.emit_pipeline(step, grid=grid, init_carry=start(0), **kwargs)(*sources)
        finish(0, carry)
        return
    wg = lax.axis_index("wg")

    @pl.when(wg == config.consumers)  # the producer brings the row in; everyone reads it
    def _():
        plgpu.copy_gmem_to_smem(table_ref.at[i], table_smem, bar.at[0])

    plgpu.barrier_wait(bar.at[0])
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(table_smem[0], *tail), num_compute_wgs=config.consumers, wg_axis="wg",
        memory_registers=PRODUCER_REGISTERS,
        compute_context=lambda run: finish(wg, run(start(wg))), **kwargs,
    )  # fmt: skip
    pipeline(*sources)
