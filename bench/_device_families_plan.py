"""The families phase's plan (``bench/_device_families.py``): the sizes, the items in order
and the FLOP counts (documented in that module's docstring)."""

from __future__ import annotations

TOKENS = 32768  # B * T of every step
LENGTHS = (2048, 8192, 32768)
CHUNK = 64
TARGET = 2.0  # each chunkwise form within 2x of fla at 8K forward + backward
TARGET_T = 8192
CHUNKWISE = ("gated_deltanet", "kda", "deltanet", "deltaproduct", "ssd", "linear")
FAMILIES = (*CHUNKWISE, "softmax", "sparse")  # their 8K rows come first, in this order
NEWER = ("dplr", "path", "log_linear")  # after everything else: 8K, then 2K, then 32K
NEWER_LENGTHS = {"dplr": LENGTHS, "path": (2048, 8192), "log_linear": LENGTHS}
# The memories trained at test time, last (8K, then 2K, then TTT-Linear's 32K); fla has
# kernels for TTT-Linear (another function: a timing reference) and MesaNet.
MEMORIES = ("ttt_linear", "mesa_net", "ttt_mlp", "titans")
MEMORY_LENGTHS = {"ttt_linear": LENGTHS, "mesa_net": (2048, 8192), "ttt_mlp": (2048, 8192),
                  "titans": (2048, 8192)}  # fmt: skip
PEERLESS = {"ttt_mlp": "fla has no TTT-MLP kernel", "titans": "fla has no Titans kernel"}
TIMING_ONLY = ("sparse", "ttt_linear")  # their peers compute another function: not compared
MINI_BATCH = 16  # TTT's and Titans' b, the authors' (and fla's chunk for TTT-Linear)
CG_STEPS = 30  # MesaNet's conjugate gradient steps, fla's default (the layer's)
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
    # TTT's heads of 64 (its authors' 125M model; fla's TTT-Linear takes V == K), MesaNet's
    # the same (fla's kernel takes K == V <= 128); the MLPs' hidden width 4H.
    **{f: dict(N=16, H=64, E=64) for f in MEMORIES},
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
    **{f: dict(N=2, H=16, E=16) for f in MEMORIES},
}
DRY_T, DRY_CHUNK, DRY_SPARSE_T, DRY_CONTEXT = 64, 16, 128, 256


def batch_for(T: int) -> int:
    return max(1, TOKENS // T)


SIDES = ("ours", "peer")  # two items per point: a peer that fails or overruns spares ours


def _items(family: str, T: int, mode: str, dry_run: bool) -> list[dict]:
    """The point's two items (ours, then its peer's; ours alone where fla has no peer)."""
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
    sides = SIDES[:1] if family in PEERLESS else SIDES
    return [dict(point, name=f"{name} {side}", side=side) for side in sides]


def items(dry_run: bool) -> list[dict]:
    """8K forward + backward of every family, decoding, 2K and 32K, then 8K forward, then
    the newer families and the memories; each point as our item, then its peer's."""
    if dry_run:  # one of each; the forward path of two
        points = [(f, 0, "fwd+bwd") for f in FAMILIES] + [("decode", DRY_CONTEXT, "step")]
        points += [(f, 0, "fwd") for f in ("gated_deltanet", "softmax")]
        points += [(f, 0, "fwd+bwd") for f in (*NEWER, *MEMORIES)]
    else:
        points = [(f, TARGET_T, "fwd+bwd") for f in FAMILIES]
        points += [("decode", S, "step") for S in DECODE_CONTEXTS]
        points += [(f, T, "fwd+bwd") for T in LENGTHS if T != TARGET_T for f in FAMILIES]
        points += [(f, TARGET_T, "fwd") for f in FAMILIES]
        points += [(f, T, "fwd+bwd") for T in (TARGET_T, 2048, 32768) for f in NEWER
                   if T in NEWER_LENGTHS[f]]  # fmt: skip
        points += [(f, T, "fwd+bwd") for T in (TARGET_T, 2048, 32768) for f in MEMORIES
                   if T in MEMORY_LENGTHS[f]]  # fmt: skip
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
    if family in MEMORIES:
        return memory_flops_per_token(family, item)
    writes = 4 * C * H + 2 * C * E + 4 * H * E + C * C / 3
    reads = 2 * C * H + 2 * C * E + 2 * H * E
    if family == "deltaproduct":
        n = item["n"]
        return n * (writes + reads / n)  # n steps per token, one query
    return writes + reads


def memory_flops_per_token(family: str, item: dict) -> float:
    """Forward FLOPs per token and head of a memory trained at test time (module docstring)."""
    H, E, b = item["H"], item["E"], MINI_BATCH
    if family == "ttt_linear":  # k W, q W, the update k^T g; q k^T and its product with g
        return 6 * H * H + 4 * b * H
    if family == "mesa_net":  # the sums; per CG step a product with G; the read of S
        C, s = item["chunk"], CG_STEPS
        return 2 * H * (H + E) + s * (2 * H * H + 4 * C * H) + 2 * H * E + 2 * C * (H + E)
    F = 4 * H  # the MLPs: forward at k, back through W2, read at q, both layers' updates
    flops = 14 * H * F + 4 * b * (H + F)
    if family == "titans":  # the momentum's read at q and its update
        flops += 8 * H * F
    return flops


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
