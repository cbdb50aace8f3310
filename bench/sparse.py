"""Benchmark: trainable sparse attention (MoBA, NSA, DSA) against blockwise dense attention.

Measures, at B=1, N=8 query heads over K=2 kv heads, H=64, causal, float32:

1. Forward and forward + backward time against T (2K to 32K) of
   ``attn.moba_attention``, ``attn.nsa_attention`` (compressed keys and values
   given: the layer's compression MLP is not timed) and
   ``attn.indexed_topk_attention`` (its indexer included) beside
   ``attn.blockwise_attention`` (FlashAttention-2 in XLA, skipping the blocks
   the causal mask empties) at the same shapes, with XLA's temporary memory and
   FLOP count of each forward + backward program; the speed-up over blockwise
   and the length where it crosses 1x.
2. One decode step (T = 1) over a context of ``decode_context`` keys: each
   method, reading what its decode cache keeps beside the keys (MoBA's running
   key sums, NSA's compressed blocks, DSA's indexer keys), against dense
   attention over the whole cache.

Every method reads about ``reads`` = 512 keys per query: MoBA 8 blocks of 64,
NSA 4 selected blocks of 64 and a window of 256 beside its compressed tokens,
DSA 512 tokens. Timing as ``bench/linear.py``'s (compiled ahead of time, best
of interleaved runs). The matmul rate of the machine is measured beside.

    python bench/sparse.py              # the full run
    python bench/sparse.py --quick      # smoke test: T = 256 and 512, "-quick" files
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/sparse.py`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attn  # noqa: E402
from attn import masks  # noqa: E402
from bench import _delta  # noqa: E402
from bench._report import write_report  # noqa: E402
from bench.linear import best_times  # noqa: E402

LENGTHS = (2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (256, 512)
METHODS = ("blockwise", "moba", "nsa", "dsa")
# Time grows like T^2 for dense attention, like T (and T^2 / blocks for the scores the
# selections rank) for the sparse methods: projections use the larger exponent only for
# blockwise and DSA (whose indexer scores T x S).
EXPONENT = {"blockwise": 2, "moba": 1, "nsa": 1, "dsa": 2}


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --quick, --lengths, ...)."""

    quick: bool = False
    lengths: tuple[int, ...] = ()  # () means the default table
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    reads: int = 512  # keys per query of each sparse method
    block: int = 64  # MoBA's and NSA's selected blocks
    index_heads: int = 4
    index_dim: int = 32
    chunk: int = 128
    decode_context: int = 32768
    repeats: int = 3
    max_seconds: float = 60.0
    out_dir: str = "bench/results"
    name: str = "sparse-cpu"

    def __post_init__(self):
        if self.reads % (2 * self.block) or self.block % 2:
            raise ValueError(
                f"--reads: expected a multiple of 2 * block = {2 * self.block} "
                f"(and an even block), got {self.reads} and {self.block}"
            )


def method_fns(cfg: Config) -> tuple[dict, dict]:
    """``(fns, nsa_sizes)``: name -> ``fn(q, k, v, gates, ck, cv, iq, ik, iw) -> out``, and
    the NSA sizes the inputs are compressed with."""
    causal = masks.causal()
    b, R = cfg.block, cfg.reads
    nsa_sizes = dict(
        compress_block=b // 2,
        compress_stride=b // 4,
        select_block=b,
        num_selected=R // (2 * b),
        window=R // 2,
        initial_blocks=1,
        local_blocks=2,
    )

    def blockwise(q, k, v, *_):
        return attn.blockwise_attention(q, k, v, mask=causal)

    def moba(q, k, v, *_):
        return attn.moba_attention(
            q, k, v, block_size=b, top_k=R // b, chunk=cfg.chunk, mask=causal
        )

    def nsa(q, k, v, gates, ck, cv, *_):
        return attn.nsa_attention(q, k, v, gates, ck, cv, chunk=cfg.chunk, mask=causal, **nsa_sizes)

    def dsa(q, k, v, gates, ck, cv, iq, ik, iw):
        return attn.indexed_topk_attention(
            q, k, v, iq, ik, iw, top_k=R, chunk=cfg.chunk, mask=causal
        )

    return {"blockwise": blockwise, "moba": moba, "nsa": nsa, "dsa": dsa}, nsa_sizes


def inputs(cfg: Config, T: int, S: int | None = None, seed: int = 0):
    """q ``[B,T,N,H]``, k, v ``[B,S,K,H]``, the gates, NSA's compressed keys and values (block
    means), and the indexer's inputs."""
    S = S or T
    rng = np.random.default_rng(seed)
    B, N, K, H = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    q, k, v = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, H)
    gates = jax.nn.sigmoid(normal(B, T, N, 3))
    _, sizes = method_fns(cfg)
    win = dict(compress_block=sizes["compress_block"], compress_stride=sizes["compress_stride"])
    ck = attn.sparse.compression_windows(k, **win)[0].mean(2)
    cv = attn.sparse.compression_windows(v, **win)[0].mean(2)
    iq, ik = normal(B, T, cfg.index_heads, cfg.index_dim), normal(B, S, cfg.index_dim)
    iw = jnp.abs(normal(B, T, cfg.index_heads))
    return q, k, v, gates, ck, cv, iq, ik, iw


def fwd_bwd(fn):
    """Gradients of ``sum(out^2)`` with respect to q, k and v."""
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) ** 2), argnums=(0, 1, 2))


def vs_length(cfg: Config, lengths) -> dict:
    fns, _ = method_fns(cfg)

    def skip_reason(name, kind, T, done):
        return _delta.projected_skip(done, T, cfg.max_seconds, EXPONENT[name])

    return _delta.time_methods(
        cfg, lengths, best_times, skip_reason, fns, lambda T: inputs(cfg, T), fwd_bwd
    )


def decode_step(cfg: Config) -> dict:
    """One query over ``decode_context`` keys: seconds per method, each reading what its
    decode cache keeps beside the keys (MoBA's running key sums, NSA's compressed blocks,
    DSA's indexer keys); the baseline is dense attention over the whole cache (one query
    has no blocks to skip)."""
    fns, _ = method_fns(cfg)
    S, b = cfg.decode_context, cfg.block
    args = inputs(cfg, 1, S)
    sums = attn.sparse.block_key_sums(args[1], b)

    def moba(q, k, v, *rest, key_sums):
        return attn.moba_attention(q, k, v, block_size=b, top_k=cfg.reads // b, chunk=cfg.chunk,
                                   mask=masks.causal(), key_sums=key_sums)  # fmt: skip

    jobs = {name: (fn, args) for name, fn in fns.items() if name != "moba"}
    jobs["blockwise"] = (lambda q, k, v, *_: attn.dot_product_attention(q, k, v), args)
    jobs["moba"] = (lambda *a: moba(*a[:-1], key_sums=a[-1]), (*args, sums))
    seconds = best_times(jobs, cfg.repeats)
    for name, s in seconds.items():
        print(f"  decode S={S}: {name:>9} {s * 1e3:9.3f} ms", flush=True)
    return {"S": S, "seconds": seconds, "baseline": "dense"}


def crossover(lengths, blockwise: dict, method: dict) -> float | None:
    """The T where ``blockwise / method`` crosses 1 (log-linear between measured lengths);
    None when it never does within the lengths measured (or at the first)."""
    pts = [(T, blockwise[T] / method[T]) for T in lengths if blockwise.get(T) and method.get(T)]
    for (t0, r0), (t1, r1) in itertools.pairwise(pts):
        if r0 < 1 <= r1:
            f = (math.log(1) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return float(2 ** (math.log2(t0) + f * (math.log2(t1) - math.log2(t0))))
    if pts and pts[0][1] >= 1:
        return float(pts[0][0])  # already faster at the shortest length
    return None


def main(cfg: Config) -> dict:
    start = time.perf_counter()
    lengths = cfg.lengths or (QUICK_LENGTHS if cfg.quick else LENGTHS)
    if cfg.quick:
        cfg = dataclasses.replace(cfg, repeats=1, reads=64, block=16, decode_context=max(lengths))
    print(f"matmul rate, {lengths=}", flush=True)
    rate = _delta.matmul_rate(best_times)
    L = vs_length(cfg, lengths)
    cross = {
        kind: {m: crossover(lengths, L[kind]["blockwise"], L[kind][m]) for m in METHODS[1:]}
        for kind in ("forward", "forward_backward")
    }
    result = {
        "config": dataclasses.asdict(cfg),
        "lengths": list(lengths),
        "env": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "matmul_flops_per_s": rate,
        "vs_length": L,
        "crossover": cross,
        "decode": decode_step(cfg),
        "wall_seconds": time.perf_counter() - start,
    }
    name = cfg.name + ("-quick" if cfg.quick else "")
    write_report(result, cfg.out_dir, name, markdown, plot)
    return result


def attention_flops(c: dict, method: str, T: int) -> float:
    """Forward FLOPs of the score and value products over the keys each query reads."""
    N, H = c["heads"], c["head_dim"]
    if method == "blockwise":
        reads = T * (T + 1) / 2
    elif method == "nsa":
        b = c["block"]
        window, selected = c["reads"] // 2, (c["reads"] // (2 * b)) * b
        compressed = max(0, (T - b // 2) // (b // 4) + 1)
        reads = T * (window + selected + compressed / 2)  # a query sees half the blocks on average
    else:
        reads = T * c["reads"]
    return 4.0 * c["batch"] * N * H * reads


def _ms(x):
    return "skipped" if x is None else f"{x * 1e3:.1f}"


def markdown(r: dict) -> str:
    c, L = r["config"], r["vs_length"]
    lines = [
        f"# Sparse attention against blockwise dense attention ({r['env']['backend']})\n",
        f"B={c['batch']}, N={c['heads']} over K={c['kv_heads']}, H={c['head_dim']}, causal, "
        f"float32; each sparse method reads about {c['reads']} keys per query (MoBA "
        f"{c['reads'] // c['block']} blocks of {c['block']}; NSA's selected blocks and window "
        f"plus compressed tokens; DSA {c['reads']} tokens). Matmul rate "
        f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; jax {r['env']['jax']}, "
        f"{r['env']['cpu_count']} cores, load {r['env']['load_average'][0]:.1f}.\n",
    ]
    for kind in ("forward", "forward_backward"):
        lines.append(f"\n## {kind.replace('_', ' + ')} (ms; speed-up over blockwise)\n")
        lines.append("| T | " + " | ".join(METHODS) + " |")
        lines.append("|---|" + "---|" * len(METHODS))
        for T in r["lengths"]:
            base = L[kind]["blockwise"].get(str(T), L[kind]["blockwise"].get(T))
            cells = []
            for m in METHODS:
                t = L[kind][m].get(str(T), L[kind][m].get(T))
                ratio = f" ({base / t:.2f}x)" if t and base and m != "blockwise" else ""
                cells.append(_ms(t) + ratio)
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        cross = ", ".join(
            f"{m} {'never' if x is None else f'T = {x:.0f}'}"
            for m, x in r["crossover"][kind].items()
        )
        lines.append(f"\nCrosses 1x: {cross}.\n")
    lines.append(
        "\n## forward: attention GFLOP (the score and value products of what each query reads) "
        "and the rate achieved; forward + backward temporary memory (MiB, XLA)\n"
    )
    lines.append("| T | " + " | ".join(METHODS) + " |")
    lines.append("|---|" + "---|" * len(METHODS))
    for T in r["lengths"]:
        cells = []
        for m in METHODS:
            t = L["forward"][m].get(str(T), L["forward"][m].get(T))
            b = L["temp_bytes"][m].get(str(T), L["temp_bytes"][m].get(T))
            f = attention_flops(c, m, T)
            rate = "" if not t else f" at {f / t / 1e9:.0f} GFLOP/s"
            cells.append(f"{f / 1e9:.1f}{rate}; {'-' if b is None else f'{b / 2**20:.0f}'}")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    lines.append(
        "\nGFLOP count 2 flops per multiply-add of q.k and p.v over the keys read (causal "
        "dense: T(T+1)/2 per head; NSA: its window, selected blocks and compressed tokens); "
        "XLA's own count (`flops` in the JSON) sees a loop's body once and is not used.\n"
    )
    d = r["decode"]
    base = d["seconds"]["blockwise"]
    lines.append(f"\n## one decode step over S = {d['S']} keys (ms)\n")
    lines.append("| dense | " + " | ".join(METHODS[1:]) + " |")
    lines.append("|---|" + "---|" * (len(METHODS) - 1))
    cells = [f"{d['seconds'][m] * 1e3:.2f} ({base / d['seconds'][m]:.2f}x)" for m in METHODS[1:]]
    lines.append(f"| {base * 1e3:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, kind in zip(axes, ("forward", "forward_backward"), strict=True):
        for m in METHODS:
            pts = [(T, r["vs_length"][kind][m].get(T)) for T in r["lengths"]]
            pts = [(T, s) for T, s in pts if s]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (sequence length)")
        ax.set_ylabel("seconds (lower is better)")
        ax.set_title(kind.replace("_", " + "))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))
