"""Device phase ``families``: each family's forms against its peer, in the same run.

Forward and forward + backward times of the families at T = 2K, 8K and 32K, B
chosen so that every step holds ``TOKENS`` = 32K tokens (B = 16, 4, 1), inputs in
bf16 (q, k, v, beta, B, C and x; the gates, ``dt``, ``A`` and ``D`` float32; every
state float32), each against its peer on the same inputs (drawn on the device by
``jax.random``; the torch side gets host copies of those very arrays, bf16 as its bits):

* ``softmax`` (N = 16 heads, H = 128, causal): ``attn.attention(impl="pallas")`` (Triton),
  ``impl="mosaic"`` (Mosaic GPU for Hopper) and ``impl="blockwise"`` (only up to T = 8K:
  0.7 s a step there) against cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``);
* the chunkwise forms, chunks of 64, against fla's Triton kernels through torch
  (``bench/_fla_peer.py`` says which op, and where the functions differ):
  ``linear`` (``attn.linear_attention``: identity features, no normalizer, scale
  ``1/sqrt(H)``), ``deltanet``, ``gated_deltanet`` (a log gate per head), ``kda`` (a
  log gate per key channel) (``attn.delta_rule``), ``deltaproduct``
  (``attn.delta_product``, n = 2 Householder steps per token, a gate per head): N = 16
  heads, H = E = 128, the shapes fla's own benchmarks use, q and k unit-norm, beta in
  (0, 1), log gates in (-0.1, -0.001]; ``ssd`` (``attn.ssd``: N = 32 heads of E = 64, state
  dim H = 128, one group of B and C, Mamba-2's sizes) against ``chunk_simple_gla``;
* ``sparse`` (N = 16 query heads over K = 1 kv head, H = 128, causal): MoBA (blocks of
  128, top 8; our Pallas kernel), NSA (the paper's sizes: compression 32 / 16, 16
  selected blocks of 64, a window of 512; the selected branch in our Pallas kernel;
  compressed keys given, as ``bench/sparse.py``) and DSA (the top 1024 tokens of a 4-head,
  dim-64 indexer) against cuDNN's dense causal attention at the same shape, and NSA also
  against fla's ``parallel_nsa`` (16 blocks of 64, no window: a timing reference, not our
  function, its FLOPs counted from what it reads);
* ``decode`` (B = 16 rows, N = 32 query heads over K = 8, H = 128, contexts S = 8K and 32K,
  one query a row): ``attn.decode_attention`` (split-K, its default splits; dense splits
  and the Pallas kernel) and ``attn.paged_decode_attention`` (pages of 16, shuffled)
  against ``jax.nn.dot_product_attention(key_value_seq_lengths=...)``: time per step and
  the K/V bytes read per second;
* the newer families, after all of the above (8K, then 2K, then 32K forward + backward):
  ``dplr`` (``attn.dplr_delta_rule`` with RWKV-7's inputs, N = 32 heads of H = E = 64,
  scale 1), ``path`` (``attn.path_attention``, blockwise, blocks of 64, FoX's gate; N = 16
  heads, H = 128; not at 32K: seconds a step) and ``log_linear`` (``attn.log_linear_attention``
  as log-linear Mamba-2: SSD's sizes, one group, ``bit_length(T - 1) + 1`` levels) against
  fla's ``chunk_dplr_delta_rule``, ``parallel_path_attn`` and ``chunk_log_linear_attn``;
* the memories trained at test time, last (8K, then 2K, then TTT-Linear's 32K; N = 16 heads
  of H = E = 64): ``ttt_linear``, ``ttt_mlp`` (``attn.ttt_linear``, ``attn.ttt_mlp``: the
  dual form, mini-batches of 16, the inner LayerNorm) and ``titans`` (``attn.titans``, the
  MLP memory, mini-batches of 16), and ``mesa_net`` (``attn.mesa_net``, chunkwise, 30 CG
  steps). Peers: fla's ``chunk_mesa_net`` (our function) and ``chunk_ttt_linear`` (another
  function: a timing reference, not compared); fla has no TTT-MLP or Titans kernel, so those
  points are ours alone.

FLOPs: one count per family and shape, the same for ours and the peer (``flops``), so the
ratio of TFLOP/s is the inverse ratio of times. Softmax: ``4 B N H`` per visible
query-key pair (causal: ``T (T + 1) / 2``), x3.5 with the backward (``bench/gpu.py``'s).
Chunkwise forms, per token and head with chunks of C, the matmuls of the chunk algorithm
(2 flops a multiply-add, the causal half of the ``C x C`` products not subtracted):
linear attention and SSD ``2 C (H + E) + 4 H E`` (intra-chunk scores and their product
with the values; the query's read of the state and the state's update); the delta rule
``6 C H + 4 C E + 6 H E + C^2 / 3`` (K K^T, W = T (beta K), U' = T (beta V), W S, the
triangular inverse ``C^3 / 3`` per chunk, and the read and update as above);
DeltaProduct per step (n per token) the delta rule's writes plus 1/n of its reads;
x3 with the backward (its matmuls: twice the forward's). The DPLR delta rule
``10 C H + 8 C E + 6 H E + 2 H^2 + 2 H^2 E / C + C^2 / 3`` (the four decayed products a b^T,
a k^T, q b^T, q k^T; W from the inverse; the reads R' and the output's two intra-chunk
products; the triangular inverse; the read, the writes k v^T and b r^T; the chunk's
transition ``M`` and ``M S``), x3; log-linear attention ``2 C (H + E) + 4 H E
ceil(log2(T / C))`` (the intra-chunk levels as linear attention's; each level above the
chunk read and built once), x3; PaTH ``8 B N H`` per causal pair (twice softmax's: the
queries' passes through the blocks' transforms), x3.5. The memories, with mini-batches of
b = 16 and hidden width F = 4H: TTT-Linear ``6 H^2 + 4 b H`` (the inner model at k and at
q, the update ``k^T g``; the mini-batch's ``q k^T`` and its product with the gradients);
TTT-MLP ``14 H F + 4 b (H + F)`` (forward at k, back through the second layer, the read at
q and both layers' updates; the two layers' ``b x b`` products), Titans that plus ``8 H F``
(the momentum's read and update); MesaNet with s = 30 CG steps ``2 H (H + E) + s (2 H^2 +
4 C H) + 2 H E + 2 C (H + E)`` (the two sums; per step a product with the chunk's start G
and the intra-chunk keys; the read of S); x3. Sparse: ``4 B N H`` per
query-key pair each query reads (x3.5 with the backward), plus the selection's scoring
once (no gradient flows through a top-k): MoBA's query-block scores ``2 H`` per past
block, DSA's indexer ``2 I F`` per visible key; cuDNN's dense causal attention at the
same shape is counted as softmax. Decode has no FLOP count: the K/V bytes read.

Timing (ours and the peer alike): the wall time of a call followed by a device
synchronisation, the best of ``ctx.repeats`` runs after a warm-up, at most
``max_seconds`` of runs (``best_seconds``); our programs compiled ahead of time
(``compile_seconds``), fla's first call (its compile and Triton's autotuning) timed
apart. Forward + backward is the gradient of ``sum(out * ct)`` with respect to the
inputs that have one (``grads``: q, k, v, beta and the gates; SSD all six inputs;
softmax and sparse q, k, v), with ``out`` returned too. A peer that computes our
function is compared on each tensor's first batch row (up to 2M elements): the
largest absolute difference of the output and of each gradient, relative to the
peer's largest value.

Items: each point (family, T, pass) is two items, ours and then its peer's, so that a
peer that fails, crashes its process or overruns the phase (fla's first call of an op
compiles and autotunes its kernels: tens of seconds on a fresh machine, not started with
less than 45 s left, ``bench/_fla_peer.py``) spares our row; the peer's item compares
against the samples the ours item left in the process. Order: every family's 8K forward
+ backward first (the target: each chunkwise form within 2x of fla there), then
decoding, then 2K and 32K forward + backward, then 8K forward; a budget cut drops the
tail. torch runs in the phase's process beside JAX (which holds 75% of the device's
memory by default; fla needs a few GiB at these shapes).
"""

from __future__ import annotations

import time

from bench._device_families_inputs import Inputs, host, setup
from bench._device_families_plan import (  # noqa: F401  (the phase protocol and its tests)
    FAMILIES,
    MEMORIES,
    NEWER,
    PEERLESS,
    TIMING_ONLY,
    TOKENS,
    flops,
    items,
    kv_bytes,
    log_levels,
    point_key,
    sparse_reads,
)
from bench._device_families_report import markdown, summary  # noqa: F401  (the phase protocol)

TITLE = "The families against their peers (fla, cuDNN, jax.nn)"
WEIGHT = 0.38  # about 170 s of the run's 450 s (numerics 0.08, tune 0.38, train 0.18)


# ----------------------------------------------------------------------------
# Measuring


def max_seconds(ctx) -> float:
    """Seconds of timed runs one program gets: 1, less as the phase's time runs out."""
    return min(1.0, max(0.1, ctx.left() / 40))


def sample(x):
    """The first ``SAMPLE`` elements of ``x``'s first batch row, float32 on the host."""
    import numpy as np

    from bench._fla_peer import SAMPLE

    return np.asarray(x[:1].reshape(-1)[:SAMPLE], np.float32)


def time_jax(fn, args: dict, n_diff: int, mode: str, ctx, ct=None) -> tuple[dict, dict]:
    """Compiles ``fn(*args.values())`` (forward; with ``mode == "fwd+bwd"`` its output and
    the gradients of ``sum(out * ct)`` w.r.t. the first ``n_diff`` args) and times it.

    Returns ``(row, values)``: the row's ms, compile seconds and program bytes; the
    output's and the gradients' samples by name (``"out"``, the args' names).
    """
    import jax

    from bench._device_common import best_seconds, program_bytes

    names, inputs = list(args), tuple(args.values())
    if mode == "fwd+bwd":

        def step(*a):
            *x, ct = a
            rest = x[n_diff:]
            out, vjp = jax.vjp(lambda *d: fn(*d, *rest), *x[:n_diff])
            return out, vjp(ct.astype(out.dtype))

        inputs = (*inputs, ct)
    else:
        step = fn
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*inputs).compile()
    row = {"compile_seconds": time.perf_counter() - start, "program_bytes": program_bytes(compiled)}
    held = {}

    def run():
        held["out"] = jax.block_until_ready(compiled(*inputs))

    seconds = best_seconds(run, ctx.repeats, max_seconds(ctx))
    out = held.pop("out")
    values = {"out": sample(out[0] if mode == "fwd+bwd" else out)}
    if mode == "fwd+bwd":
        values.update({names[i]: sample(g) for i, g in enumerate(out[1])})
    row.update(status="ok", ms=seconds * 1e3)
    return row, values


def compare(ours: dict, peer: dict) -> dict | None:
    """Largest ``|ours - peer|`` over the samples, relative to the peer's largest value: the
    output's, and the worst gradient's (with its name)."""
    import numpy as np

    if not ours or not peer:
        return None

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

    out = {"out": rel(ours["out"], peer["out"])}
    grads = {n: rel(ours[n], peer[n]) for n in ours if n != "out" and n in peer}
    if grads:
        worst = max(grads, key=grads.get)
        out.update(grad=worst, grad_rel=grads[worst])
    return out


def rates(row: dict, count: float | None, ctx) -> dict:
    """TFLOP/s of a measured row, and its share of the data sheet's peak and of the
    measured matmul rate."""
    if row.get("status") != "ok" or not count:
        return row
    tflops = count / (row["ms"] * 1e-3) / 1e12
    row.update(tflops=tflops, flops=count)
    row["peak_share"] = tflops / ctx.peak_tflops if ctx.peak_tflops else None
    row["matmul_share"] = tflops / ctx.matmul_tflops if ctx.matmul_tflops else None
    return row


def guarded(measure) -> tuple[dict, dict]:
    """``measure()``, an exception recorded as the row's ``failed: ...`` status."""
    try:
        return measure()
    except Exception as e:  # an out-of-memory or a lowering error: record it, go on
        return {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}, {}


def _jax_peer(kind: str, args: dict, mode: str, ctx, ct) -> tuple[dict, dict]:
    """cuDNN's dense causal attention, or jax.nn's decode step, timed as ours."""
    import jax

    if kind == "cudnn":
        op = "jax.nn.dot_product_attention(implementation='cudnn')"
        if ctx.platform != "gpu":
            return {"op": op, "status": "not measured: cuDNN needs a GPU"}, {}

        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        qkv = {n: args[n] for n in ("q", "k", "v")}
        row, values = guarded(lambda: time_jax(attend, qkv, 3, mode, ctx, ct))
        return dict(row, op=op), values

    def step(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)

    inputs = {n: args[n] for n in ("q", "k", "v", "lengths")}
    row, values = guarded(lambda: time_jax(step, inputs, 0, "fwd", ctx))
    return dict(row, op="jax.nn.dot_product_attention(key_value_seq_lengths=...)"), values


_samples: dict = {}  # the child's last "ours" item: {point_key: {form: samples}}


def run_item(item: dict, ctx) -> dict:
    """One side of one point (the phase protocol): our forms, or the peers."""
    import jax.numpy as jnp

    s = setup(item)
    mode, args = item["mode"], s["args"]
    n_diff = s["grads"] if mode == "fwd+bwd" else 0
    ct = Inputs(1).normal(*s["out"], dtype=jnp.bfloat16) if mode == "fwd+bwd" else None
    if item["side"] == "ours":
        rows, samples = run_ours(item, s, args, n_diff, ct, ctx)
        _samples.clear()
        _samples[point_key(item)] = samples
        return {"status": overall(rows), "ours": rows}
    rows = run_peers(item, s, args, n_diff, ct, ctx)
    return {"status": overall(rows), "peers": rows}


def overall(rows: dict) -> str:
    """An item's status: ``ok`` where one of its rows was measured, else the first row's."""
    statuses = [r.get("status", "?") for r in rows.values()]
    return "ok" if "ok" in statuses else (statuses[0] if statuses else "ok")


def run_ours(item, s, args, n_diff, ct, ctx) -> tuple[dict, dict]:
    family, mode = item["family"], item["mode"]
    rows, samples = {}, {}
    for form, fn in s["forms"].items():
        if isinstance(fn, str):
            rows[form] = {"status": fn}
            continue
        if ctx.left() <= 0:
            rows[form] = {"status": "not measured: time budget"}
            continue
        row, samples[form] = guarded(lambda fn=fn: time_jax(fn, args, n_diff, mode, ctx, ct))
        rows[form] = rates(row, flops(item, form if family == "sparse" else None), ctx)
    return bandwidth(item, rows), samples


def run_peers(item, s, args, n_diff, ct, ctx) -> dict:
    from bench import _fla_peer

    family, mode = item["family"], item["mode"]
    ours = _samples.get(point_key(item), {})  # this child ran our side just before
    rows = {}
    for label, kind in s["peers"].items():
        if ctx.left() <= 0:
            rows[label] = {"status": "not measured: time budget"}
            continue
        if kind == "fla":
            fla_family = "nsa" if family == "sparse" else family
            try:  # before copying the inputs to the host for it
                _fla_peer.load(ctx.fla_path)
            except _fla_peer.Unavailable as e:
                op = f"fla {_fla_peer.op_name(fla_family)}"
                rows[label] = {"op": op, "status": f"not measured: {e}"}
                continue
            arrays, dtypes = host(args)
            ct_host = None if ct is None else host({"ct": ct})[0]["ct"]

            def measure(fla_family=fla_family, arrays=arrays, dtypes=dtypes, ct_host=ct_host):
                return _fla_peer.measure(
                    fla_family,
                    item,
                    arrays,
                    dtypes,
                    list(arrays),
                    n_diff,
                    ct_host,
                    mode,
                    ctx,
                    max_seconds(ctx),
                )

            row, values = guarded(measure)
            row.setdefault("op", f"fla {_fla_peer.op_name(fla_family)}")
        else:
            row, values = _jax_peer(kind, args, mode, ctx, ct)
        method = None
        if family == "sparse":
            method = "dense" if kind == "cudnn" else "fla_nsa"
        rows[label] = rates(row, flops(item, method), ctx)
        if family not in TIMING_ONLY:  # the peer computes our function: compare them
            rows[label]["match"] = {f: compare(v, values) for f, v in ours.items()}
    return bandwidth(item, rows)


def bandwidth(item: dict, rows: dict) -> dict:
    """A decode step's rows with the K/V bytes read per second."""
    if item["family"] == "decode":
        for row in rows.values():
            if row.get("status") == "ok":
                row["gb_per_s"] = kv_bytes(item) / (row["ms"] * 1e-3) / 1e9
    return rows
