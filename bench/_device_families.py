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
  fla's ``chunk_dplr_delta_rule``, ``parallel_path_attn`` and ``chunk_log_linear_attn``.

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
queries' passes through the blocks' transforms), x3.5. Sparse: ``4 B N H`` per
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

TITLE = "The families against their peers (fla, cuDNN, jax.nn)"
WEIGHT = 0.38  # about 170 s of the run's 450 s (numerics 0.08, tune 0.38, train 0.18)

TOKENS = 32768  # B * T of every step
LENGTHS = (2048, 8192, 32768)
CHUNK = 64
TARGET = 2.0  # each chunkwise form within 2x of fla at 8K forward + backward
TARGET_T = 8192
CHUNKWISE = ("gated_deltanet", "kda", "deltanet", "deltaproduct", "ssd", "linear")
FAMILIES = (*CHUNKWISE, "softmax", "sparse")  # their 8K rows come first, in this order
NEWER = ("dplr", "path", "log_linear")  # after everything else: 8K, then 2K, then 32K
NEWER_LENGTHS = {"dplr": LENGTHS, "path": (2048, 8192), "log_linear": LENGTHS}
DECODE_CONTEXTS = (8192, 32768)
BLOCKWISE_MAX_T = 8192  # blockwise softmax: 0.7 s a forward + backward at 8K, B = 4
BACKWARD_SOFTMAX = 2.5  # flash attention's backward does 5 matmuls to the forward's 2
BACKWARD_CHUNKWISE = 2.0

# Sizes per family (dry run: tiny, so the CPU checks the paths, not the speed).
SHAPES = {
    "linear": dict(N=16, H=128, E=128),
    "deltanet": dict(N=16, H=128, E=128),
    "gated_deltanet": dict(N=16, H=128, E=128),
    "kda": dict(N=16, H=128, E=128),
    "deltaproduct": dict(N=16, H=128, E=128, n=2),
    "ssd": dict(N=32, H=128, E=64),
    "softmax": dict(N=16, H=128),
    "sparse": dict(
        N=16,
        K=1,
        H=128,
        moba_block=128,
        moba_top_k=8,
        compress_block=32,
        compress_stride=16,
        select_block=64,
        num_selected=16,
        window=512,
        dsa_top_k=1024,
        index_heads=4,
        index_dim=64,
    ),
    "decode": dict(B=16, N=32, K=8, H=128, page=16),
    "dplr": dict(N=32, H=64, E=64),  # RWKV-7's heads of 64
    "path": dict(N=16, H=128),
    "log_linear": dict(N=32, H=128, E=64),  # Mamba-2's sizes, as ssd
}
DRY_SHAPES = {
    **{f: dict(N=2, H=16, E=16) for f in ("linear", "deltanet", "gated_deltanet", "kda")},
    "deltaproduct": dict(N=2, H=16, E=16, n=2),
    "ssd": dict(N=2, H=16, E=16),
    "softmax": dict(N=2, H=16),
    "sparse": dict(
        N=2,
        K=1,
        H=16,
        moba_block=16,
        moba_top_k=2,
        compress_block=16,
        compress_stride=8,
        select_block=16,
        num_selected=4,
        window=32,
        dsa_top_k=32,
        index_heads=2,
        index_dim=16,
    ),
    "decode": dict(B=2, N=4, K=2, H=16, page=16),
    "dplr": dict(N=2, H=16, E=16),
    "path": dict(N=2, H=16),
    "log_linear": dict(N=2, H=16, E=16),
}
DRY_T, DRY_CHUNK, DRY_SPARSE_T, DRY_CONTEXT = 64, 16, 128, 256


def batch_for(T: int) -> int:
    return max(1, TOKENS // T)


SIDES = ("ours", "peer")  # two items per point: a peer that fails or overruns spares ours


def _items(family: str, T: int, mode: str, dry_run: bool) -> list[dict]:
    """The point's two items (ours, then its peer's)."""
    shape = (DRY_SHAPES if dry_run else SHAPES)[family]
    if family == "decode":
        point = dict(family=family, S=T, mode="step", **shape)
        name = f"decode S={T}"
    else:
        if dry_run:
            T = DRY_SPARSE_T if family == "sparse" else DRY_T
        chunk = DRY_CHUNK if dry_run else CHUNK
        B = 1 if dry_run else batch_for(T)
        point = dict(family=family, T=T, B=B, mode=mode, chunk=chunk, **shape)
        name = f"{family} T={T} {mode}"
    return [dict(point, name=f"{name} {side}", side=side) for side in SIDES]


def items(dry_run: bool) -> list[dict]:
    """8K forward + backward of every family, decoding, 2K and 32K, then 8K forward; each
    point as our item, then its peer's."""
    if dry_run:  # one of each; the forward path of two
        points = [(f, 0, "fwd+bwd") for f in FAMILIES] + [("decode", DRY_CONTEXT, "step")]
        points += [(f, 0, "fwd") for f in ("gated_deltanet", "softmax")]
        points += [(f, 0, "fwd+bwd") for f in NEWER]
    else:
        points = [(f, TARGET_T, "fwd+bwd") for f in FAMILIES]
        points += [("decode", S, "step") for S in DECODE_CONTEXTS]
        points += [(f, T, "fwd+bwd") for T in LENGTHS if T != TARGET_T for f in FAMILIES]
        points += [(f, TARGET_T, "fwd") for f in FAMILIES]
        points += [(f, T, "fwd+bwd") for T in (TARGET_T, 2048, 32768) for f in NEWER
                   if T in NEWER_LENGTHS[f]]  # fmt: skip
    return [item for p in points for item in _items(*p, dry_run)]


def point_key(item: dict) -> tuple:
    """What an item's two sides share."""
    return (item["family"], item.get("T", item.get("S")), item["mode"])


# ----------------------------------------------------------------------------
# FLOP counts (documented in the module docstring)


def causal_pairs(T: int) -> int:
    return T * (T + 1) // 2


def chunkwise_flops_per_token(family: str, item: dict) -> float:
    """Forward FLOPs per token and head of the chunk algorithm (module docstring)."""
    C, H, E = item["chunk"], item["H"], item["E"]
    if family in ("linear", "ssd"):
        return 2 * C * (H + E) + 4 * H * E
    if family == "dplr":
        return 10 * C * H + 8 * C * E + 6 * H * E + 2 * H * H + 2 * H * H * E / C + C * C / 3
    if family == "log_linear":
        return 2 * C * (H + E) + 4 * H * E * log_levels(item["T"], C)
    writes = 4 * C * H + 2 * C * E + 4 * H * E + C * C / 3
    reads = 2 * C * H + 2 * C * E + 2 * H * E
    if family == "deltaproduct":
        n = item["n"]
        return n * (writes + reads / n)  # n steps per token, one query
    return writes + reads


def log_levels(T: int, C: int) -> int:
    """The levels above a chunk a log-linear token reads: ``ceil(log2(T / C))``."""
    return max(0, (-(-T // C) - 1).bit_length())


def sparse_reads(item: dict, method: str) -> tuple[float, float]:
    """``(query-key pairs read, selection scoring FLOPs)`` of one row and head, summed
    over its T queries (query t sees keys 0..t)."""
    T, H = item["T"], item["H"]
    seen = [t + 1 for t in range(T)]
    if method == "dense":
        return float(causal_pairs(T)), 0.0
    if method == "moba":
        b, k = item["moba_block"], item["moba_top_k"]
        pairs = sum(t % b + 1 + b * min(k - 1, t // b) for t in range(T))
        return float(pairs), float(sum(2 * H * (t // b) for t in range(T)))
    if method == "nsa":
        cb, cs = item["compress_block"], item["compress_stride"]
        selected = item["num_selected"] * item["select_block"]
        pairs = sum(
            max(0, (s - cb) // cs + 1) + min(s, selected) + min(s, item["window"]) for s in seen
        )
        return float(pairs), 0.0
    if method == "fla_nsa":  # fla's parallel_nsa: mean-pooled blocks of select_block, no window
        sb = item["select_block"]
        return float(sum(s // sb + min(s, item["num_selected"] * sb) for s in seen)), 0.0
    if method == "dsa":
        index = 2 * item["index_heads"] * item["index_dim"]
        pairs = sum(min(s, item["dsa_top_k"]) for s in seen)
        return float(pairs), float(index * causal_pairs(T))
    raise KeyError(method)


def flops(item: dict, method: str | None = None) -> float | None:
    """Useful FLOPs of one step of ``item`` (``method``: the sparse one, or ``"dense"``)."""
    family, mode = item["family"], item["mode"]
    if family == "decode":
        return None
    B, N, H = item["B"], item["N"], item["H"]
    if family == "softmax" or (family == "sparse" and method == "dense"):
        total = 4.0 * B * N * H * causal_pairs(item["T"])
        return total * (1 + BACKWARD_SOFTMAX) if mode == "fwd+bwd" else total
    if family == "sparse":
        pairs, scoring = sparse_reads(item, method)
        attention = 4.0 * B * N * H * pairs
        scoring *= B * N if method != "dsa" else B  # DSA's indexer is shared by the heads
        return attention * (1 + BACKWARD_SOFTMAX if mode == "fwd+bwd" else 1) + scoring
    if family == "path":  # twice softmax's matmuls: the queries' passes through the blocks
        total = 8.0 * B * N * H * causal_pairs(item["T"])
        return total * (1 + BACKWARD_SOFTMAX) if mode == "fwd+bwd" else total
    total = B * item["T"] * N * chunkwise_flops_per_token(family, item)
    return total * (1 + BACKWARD_CHUNKWISE) if mode == "fwd+bwd" else total


def kv_bytes(item: dict) -> int:
    """K and V bytes one decode step reads (bf16)."""
    return 2 * item["B"] * item["S"] * item["K"] * item["H"] * 2


# ----------------------------------------------------------------------------
# Inputs and our forms


class Inputs:
    """Random device arrays, drawn by ``jax.random`` (fast on the device, unlike NumPy's at
    these sizes) from one key; cast to the dtype asked for after drawing in float32."""

    def __init__(self, seed: int = 0):
        import jax

        self.key = jax.random.key(seed)

    def _next(self):
        import jax

        self.key, sub = jax.random.split(self.key)
        return sub

    def normal(self, *shape, dtype="bfloat16", scale=1.0, unit=False):
        import jax
        import jax.numpy as jnp

        x = jax.random.normal(self._next(), shape, jnp.float32) * scale
        if unit:
            x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return x.astype(dtype)

    def uniform(self, *shape, low=0.0, high=1.0, dtype="float32"):
        import jax
        import jax.numpy as jnp

        x = jax.random.uniform(self._next(), shape, jnp.float32, low, high)
        return x.astype(dtype)


def setup(item: dict) -> dict:
    """The inputs (device arrays), our forms and the peers of ``item``.

    Returns ``{"args": {name: array}`` in call order, ``"grads"``: how many of the
    first args get gradients, ``"out"``: the output's shape, ``"forms"``: ``{form:
    fn(*args)}`` (or a ``"not measured: ..."`` string), ``"peers"``: ``{label: kind}``}.
    """
    import jax
    import jax.numpy as jnp

    import attn
    from attn import masks

    family = item["family"]
    r = Inputs(0)
    if family == "decode":
        return _decode_setup(item, r)
    if family in NEWER:
        return _newer_setup(item, r)
    B, T, N, H = item["B"], item["T"], item["N"], item["H"]
    chunk = item.get("chunk")
    causal = masks.causal()
    if family in ("softmax", "sparse"):
        K = item.get("K", N)
        args = {"q": r.normal(B, T, N, H), "k": r.normal(B, T, K, H), "v": r.normal(B, T, K, H)}
        if family == "sparse":
            return _sparse_setup(item, args, r)

        def form(impl):
            return lambda q, k, v: attn.attention(q, k, v, mask=causal, impl=impl)

        forms = {impl: form(impl) for impl in ("pallas", "mosaic", "blockwise")}
        if H not in (64, 128):  # a dry run's head dim
            forms["mosaic"] = f"not measured: head dim {H} (Mosaic GPU takes 64 and 128)"
        if T > BLOCKWISE_MAX_T:
            forms["blockwise"] = f"not measured: T > {BLOCKWISE_MAX_T} (seconds a step)"
        return dict(args=args, grads=3, out=(B, T, N, H), forms=forms, peers={"cudnn": "cudnn"})
    E = item["E"]
    if family == "ssd":
        args = {
            "x": r.normal(B, T, N, E),
            "dt": jax.nn.softplus(r.normal(B, T, N, dtype="float32") - 3),
            "A": -r.uniform(N, low=1.0, high=16.0),
            "B": r.normal(B, T, 1, H, scale=H**-0.5),
            "C": r.normal(B, T, 1, H, scale=H**-0.5),
            "D": jnp.ones((N,), jnp.float32),
        }

        def ssd(x, dt, A, b, c, D):
            return attn.ssd(x, dt, A, b, c, D=D, chunk_size=chunk)

        return dict(
            args=args, grads=6, out=(B, T, N, E), forms={"chunkwise": ssd}, peers={"fla": "fla"}
        )
    steps = (item["n"],) if family == "deltaproduct" else ()
    args = {
        "q": r.normal(B, T, N, H, unit=True),
        "k": r.normal(B, T, *steps, N, H, unit=True),
        "v": r.normal(B, T, *steps, N, E),
        "beta": r.uniform(B, T, *steps, N, dtype="bfloat16"),
    }
    if family in ("gated_deltanet", "deltaproduct"):
        args["g"] = -r.uniform(B, T, N, low=0.001, high=0.1)
    if family == "kda":
        args["g"] = -r.uniform(B, T, N, H, low=0.001, high=0.1)
    if family == "linear":
        del args["beta"]

        def form(q, k, v):
            return attn.linear_attention(
                q,
                k,
                v,
                form="chunkwise",
                feature_map="identity",
                normalize=False,
                scale=H**-0.5,
                chunk_size=chunk,
            )

    elif family == "deltaproduct":

        def form(q, k, v, beta, g):
            return attn.delta_product(q, k, v, beta, log_gates=g, chunk_size=chunk)

    else:

        def form(q, k, v, beta, g=None):
            return attn.delta_rule(q, k, v, beta, log_gates=g, chunk_size=chunk)

    return dict(
        args=args,
        grads=len(args),
        out=(B, T, N, E),
        forms={"chunkwise": form},
        peers={"fla": "fla"},
    )


def _newer_setup(item: dict, r: Inputs) -> dict:
    """The DPLR delta rule (RWKV-7), PaTH (with FoX's gate) and log-linear Mamba-2, each in
    the meaning of the fla op it is timed against (``bench/_fla_peer.py``)."""
    import jax
    import jax.numpy as jnp

    import attn

    family, B, T, N, H = item["family"], item["B"], item["T"], item["N"], item["H"]
    chunk = item["chunk"]
    if family == "dplr":  # RWKV-7: a = -kappa, b = kappa * a_in, log_w in (-0.6, 0), scale 1
        E = item["E"]
        kappa = r.normal(B, T, N, H, dtype="float32", unit=True)
        args = {
            "q": r.normal(B, T, N, H, scale=H**-0.5),
            "k": r.normal(B, T, N, H, scale=H**-0.5),
            "v": r.normal(B, T, N, E),
            "a": (-kappa).astype(jnp.bfloat16),
            "b": (kappa * r.uniform(B, T, N, H)).astype(jnp.bfloat16),
            "log_w": -r.uniform(B, T, N, H, low=0.001, high=0.6),
        }

        def form(q, k, v, a, b, log_w):
            return attn.dplr_delta_rule(q, k, v, a, b, log_w, scale=1.0, chunk_size=chunk)

        out = (B, T, N, E)
    elif family == "path":  # w, beta and the gate float32, as fla asks
        args = {
            "q": r.normal(B, T, N, H),
            "k": r.normal(B, T, N, H),
            "v": r.normal(B, T, N, H),
            "w": r.normal(B, T, N, H, dtype="float32", unit=True),
            "beta": r.uniform(B, T, N, low=0.0, high=2.0),
            "g": -r.uniform(B, T, N, low=0.001, high=0.1),
        }
        scale = H**-0.5

        def form(q, k, v, w, beta, g):  # fla scales its gate's sums with the logits
            return attn.path_attention(
                q, k, v, w, beta, log_forget=g * scale, scale=scale, block_size=chunk
            )

        out = (B, T, N, H)
    else:  # log-linear Mamba-2: q = C, k = B (one group), v = dt x, g = dt A, every level
        E, L = item["E"], (T - 1).bit_length() + 1
        dt = jax.nn.softplus(r.normal(B, T, N, dtype="float32") - 3)
        args = {
            "q": r.normal(B, T, 1, H, scale=H**-0.5),
            "k": r.normal(B, T, 1, H, scale=H**-0.5),
            "v": r.normal(B, T, N, E),
            "g": dt * -r.uniform(N, low=1.0, high=16.0),
            "level_scales": r.uniform(B, T, N, L, low=0.5, high=1.5),
        }

        def form(q, k, v, g, level_scales):
            return attn.log_linear_attention(q, k, v, g, level_scales, scale=1.0, chunk_size=chunk)

        out = (B, T, N, E)
    name = "blockwise" if family == "path" else "chunkwise"
    return dict(args=args, grads=len(args), out=out, forms={name: form}, peers={"fla": "fla"})


def _sparse_setup(item: dict, args: dict, r: Inputs) -> dict:
    import jax

    import attn
    from attn import masks

    B, T, N = item["B"], item["T"], item["N"]
    causal = masks.causal()
    win = dict(compress_block=item["compress_block"], compress_stride=item["compress_stride"])
    args.update(
        gates=jax.nn.sigmoid(r.normal(B, T, N, 3, dtype="float32")).astype("bfloat16"),
        ck=attn.sparse.compression_windows(args["k"], **win)[0].mean(2),
        cv=attn.sparse.compression_windows(args["v"], **win)[0].mean(2),
        iq=r.normal(B, T, item["index_heads"], item["index_dim"], dtype="float32"),
        ik=r.normal(B, T, item["index_dim"], dtype="float32"),
        iw=abs(r.normal(B, T, item["index_heads"], dtype="float32")),
    )
    nsa_sizes = dict(
        select_block=item["select_block"],
        num_selected=item["num_selected"],
        window=item["window"],
        initial_blocks=1,
        local_blocks=2,
        **win,
    )

    def moba(q, k, v, *_):
        return attn.moba_attention(
            q,
            k,
            v,
            block_size=item["moba_block"],
            top_k=item["moba_top_k"],
            mask=causal,
            impl="pallas",
        )

    def nsa(q, k, v, gates, ck, cv, *_):
        return attn.nsa_attention(q, k, v, gates, ck, cv, mask=causal, impl="pallas", **nsa_sizes)

    def dsa(q, k, v, gates, ck, cv, iq, ik, iw):
        return attn.indexed_topk_attention(
            q, k, v, iq, ik, iw, top_k=item["dsa_top_k"], mask=causal
        )

    return dict(
        args=args,
        grads=3,
        out=(B, T, N, item["H"]),
        forms={"moba": moba, "nsa": nsa, "dsa": dsa},
        peers={"cudnn dense": "cudnn", "fla nsa": "fla"},
    )


def _decode_setup(item: dict, r: Inputs) -> dict:
    import jax.numpy as jnp
    import numpy as np

    import attn

    B, S, N, K, H, page = (item[x] for x in ("B", "S", "N", "K", "H", "page"))
    k, v = r.normal(B, S, K, H), r.normal(B, S, K, H)
    # The same cache in a pool of shuffled pages: row b's page i is pool page tables[b, i].
    per_row = -(-S // page)
    order = np.random.default_rng(0).permutation(B * per_row).astype(np.int32)
    back = jnp.asarray(np.argsort(order))  # pool page p holds the cache's page back[p]

    def pool(x):
        x = jnp.pad(x, [(0, 0), (0, per_row * page - S), (0, 0), (0, 0)])
        return jnp.take(x.reshape(B * per_row, page, K, H), back, axis=0)

    args = {
        "q": r.normal(B, 1, N, H),
        "k": k,
        "v": v,
        "lengths": jnp.full((B,), S, jnp.int32),
        "pool_k": pool(k),
        "pool_v": pool(v),
        "tables": jnp.asarray(order.reshape(B, per_row)),
    }

    def split(q, k, v, lengths, *_):
        return attn.decode_attention(q, k, v, lengths=lengths)

    def split_pallas(q, k, v, lengths, *_):
        return attn.decode_attention(q, k, v, lengths=lengths, impl="pallas")

    def paged(q, k, v, lengths, pool_k, pool_v, tables):
        return attn.paged_decode_attention(q, pool_k, pool_v, tables, lengths)

    return dict(
        args=args,
        grads=0,
        out=(B, 1, N, H),
        forms={"split-K": split, "split-K pallas": split_pallas, "paged": paged},
        peers={"jax.nn": "jax.nn"},
    )


def host(args: dict) -> tuple[dict, dict]:
    """``(arrays, dtypes)``: host copies of the device ``args`` for the torch side, bf16 as
    its bits (``uint16``: NumPy has no bf16 torch reads), and each one's dtype name."""
    import numpy as np

    arrays, dtypes = {}, {}
    for name, x in args.items():
        dtypes[name] = str(x.dtype)
        a = np.array(x)  # a writable copy (torch warns on a read-only one)
        arrays[name] = a.view(np.uint16) if dtypes[name] == "bfloat16" else a
    return arrays, dtypes


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
        if family != "sparse":  # the peer computes our function: compare them
            rows[label]["match"] = {f: compare(v, values) for f, v in ours.items()}
    return bandwidth(item, rows)


def bandwidth(item: dict, rows: dict) -> dict:
    """A decode step's rows with the K/V bytes read per second."""
    if item["family"] == "decode":
        for row in rows.values():
            if row.get("status") == "ok":
                row["gb_per_s"] = kv_bytes(item) / (row["ms"] * 1e-3) / 1e9
    return rows


# ----------------------------------------------------------------------------
# The report


def _time_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return row.get("status", "-")
    cell = f"{row['ms']:.3g} ms"
    if row.get("tflops") is not None:
        cell += f" / {row['tflops']:.3g} TF"
        if row.get("peak_share") is not None:
            cell += f" / {100 * row['peak_share']:.0f}%"
    if row.get("gb_per_s") is not None:
        cell += f" / {row['gb_per_s']:.0f} GB/s"
    return cell


def ratio(ours: dict | None, peer: dict | None) -> float | None:
    """ours ms / peer ms, where both were measured."""
    if not ours or not peer or ours.get("status") != "ok" or peer.get("status") != "ok":
        return None
    return ours["ms"] / peer["ms"]


def _match_cell(peer: dict, form: str) -> str:
    m = (peer.get("match") or {}).get(form)
    if not m:
        return "-"
    cell = f"out {m['out']:.1e}"
    if "grad" in m:
        cell += f", d{m['grad']} {m['grad_rel']:.1e}"
    return cell


def _main_peer(family: str) -> str:
    return {"softmax": "cudnn", "sparse": "cudnn dense", "decode": "jax.nn"}.get(family, "fla")


def points(rows: list[dict]) -> dict:
    """``{point_key: {"ours": row, "peer": row}}`` in the rows' order."""
    out = {}
    for r in rows:
        out.setdefault(point_key(r), {})[r.get("side", "ours")] = r
    return out


def _side(pair: dict, side: str, key: str) -> dict:
    """The side's rows (``ours`` or ``peers``); a side that did not run gives its status."""
    r = pair.get(side)
    if r is None:
        return {}
    return r.get(key) or {"-": {"status": r.get("status", "-")}}


def markdown(rows: list[dict], info: dict) -> str:
    """A table per family, then the 8K forward + backward ratios against the 2x target."""
    fla = next(
        (p["fla"] for r in rows for p in (r.get("peers") or {}).values() if "fla" in p), None
    )
    matmul = info.get("matmul_tflops")
    lines = [
        f"Each step holds {TOKENS} tokens (B x T); chunks of {CHUNK}; bf16 inputs, float32 "
        "states. Cells: best time / useful TFLOP/s (the same count for ours and the peer; "
        "bench/_device_families.py says which) / share of the bf16 peak"
        + (f" (measured matmul: {matmul:.3g} TFLOP/s)" if matmul else "")
        + ". ours / peer: the time ratio (below 1: ours is faster). Match: the largest "
        "difference from the peer, relative to its largest value, of the output and of the "
        "worst gradient, on the first batch row.",
        "",
        "fla: "
        + (
            f"{fla['version']} at commit {fla['commit']} (torch {fla['torch']}, triton "
            f"{fla['triton']})"
            if fla
            else "not loaded in this run"
        )
        + ".",
    ]
    if info.get("dry_run"):
        lines += [
            "",
            "Dry run: tiny shapes on the CPU (Pallas in interpret mode); no time here "
            "means anything.",
        ]
    pairs = points(rows)
    for family in (*FAMILIES, "decode", *NEWER):
        group = [(k, pair) for k, pair in pairs.items() if k[0] == family]
        if not group:
            continue
        first = next(iter(group[0][1].values()))
        shape = {k: v for k, v in first.items() if k in ("N", "K", "H", "E", "n")}
        main = _main_peer(family)
        ops = [_side(pair, "peer", "peers").get(main, {}).get("op") for _, pair in group]
        op = next((o for o in ops if o), main)
        length = "S" if family == "decode" else "T"
        lines += [
            "",
            f"**{family}** ({', '.join(f'{k}={v}' for k, v in shape.items())}); peer: {op}",
            "",
            f"| {length} | B | pass | form | ours | peer | ours / peer | match |",
            "|---:|---:|---|---|---|---|---:|---|",
        ]
        for (_, at, mode), pair in group:
            B = next(iter(pair.values())).get("B")
            peers = _side(pair, "peer", "peers") or {main: {"status": "-"}}
            for form, o in (_side(pair, "ours", "ours") or {"-": {"status": "-"}}).items():
                for label, p in peers.items():
                    if family == "sparse" and label == "fla nsa" and form != "nsa":
                        continue
                    x = ratio(o, p)
                    name = f"{label}: " if label not in (main, "-") else ""
                    lines.append(
                        f"| {at} | {B} | {mode} | {form} | {_time_cell(o)} | {name}"
                        f"{_time_cell(p)} | {'-' if x is None else f'{x:.2f}x'} | "
                        f"{_match_cell(p, form)} |"
                    )
    lines += ["", summary(rows)]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """The 8K forward + backward ratios of the chunkwise forms against the 2x target."""
    pairs = points(rows)
    cells = []
    for family in CHUNKWISE:
        pair = pairs.get((family, TARGET_T, "fwd+bwd"), {})
        x = ratio(
            _side(pair, "ours", "ours").get("chunkwise"), _side(pair, "peer", "peers").get("fla")
        )
        if x is None:
            cells.append(f"{family} not measured")
        else:
            cells.append(f"{family} {x:.2f}x ({'met' if x <= TARGET else 'NOT met'})")
    met = sum(c.endswith("(met)") for c in cells)
    return (
        f"Target: each chunkwise form within {TARGET:g}x of fla at T = {TARGET_T} forward + "
        f"backward (ours / fla): " + "; ".join(cells) + f". {met} of {len(CHUNKWISE)} met."
    )
